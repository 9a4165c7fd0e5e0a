"""`python -m fa_a2a.bench_block`: the attention block from hidden states, emulated ranks (fa_a2a.tools.bench_block)."""

import sys

from fa_a2a.tools.bench_block import main

if __name__ == "__main__":
    sys.exit(main())

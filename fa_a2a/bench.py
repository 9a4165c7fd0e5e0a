"""`python -m fa_a2a.bench`: the benchmark: FA4 + the fused post-A2A against the serial and NCCL paths across sequence lengths (fa_a2a.tools.bench)."""

import sys

from fa_a2a.tools.bench import main

if __name__ == "__main__":
    sys.exit(main())

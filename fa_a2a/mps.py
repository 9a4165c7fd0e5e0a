"""`python -m fa_a2a.mps`: run a command (e.g. torchrun) under a private CUDA MPS daemon (fa_a2a.tools.mps)."""

import sys

from fa_a2a.tools.mps import main

if __name__ == "__main__":
    sys.exit(main())

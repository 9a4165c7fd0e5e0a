"""`python -m fa_a2a.calibrate`: the X-Stage platform model M_X = (T_iss0, R, Q) of this GPU from microbenchmarks (fa_a2a.tools.calibrate)."""

import sys

from fa_a2a.tools.calibrate import main

if __name__ == "__main__":
    sys.exit(main())

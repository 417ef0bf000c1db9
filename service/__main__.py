"""`python -m service`: the same as the `moe-serve` console script."""

import sys

from service.cli import main

if __name__ == "__main__":
    sys.exit(main())

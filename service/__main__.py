"""`python -m moe_serve.service`: the same as the `moe-serve` console script."""

import sys

from moe_serve.service.cli import main

if __name__ == "__main__":
    sys.exit(main())

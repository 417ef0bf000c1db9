import sys

from moe_serve.loadtest.cli import main

sys.exit(main())

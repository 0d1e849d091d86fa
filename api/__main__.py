"""`python -m asyncengine.api ...`: the same command line as `asyncengine` and `python -m asyncengine`."""

import sys

from asyncengine.api.cli import main

if __name__ == "__main__":
    sys.exit(main())

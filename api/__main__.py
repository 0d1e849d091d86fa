"""`python -m asyncengine.api serve [MODEL] ...`: the same CLI as the `asyncengine` console script."""

import sys

from asyncengine.api.cli import main

if __name__ == "__main__":
    sys.exit(main())

"""`python -m asyncengine ...`: the `asyncengine` command line (asyncengine/api/cli.py), the same in every way.

    python -m asyncengine                          # no subcommand: `generate`, the embedded model's demo prompts
    python -m asyncengine --prompt "ROMEO:" --max-tokens 80 --temperature 0.8 --seed 1
    python -m asyncengine serve /path/to/llama --max-model-len 4096
    python -m asyncengine bench serve --base-url http://127.0.0.1:8000 --num-prompts 200
"""

import sys

from asyncengine.api.cli import main

if __name__ == "__main__":
    sys.exit(main())

"""Where the engine keeps what it measures or builds on a machine: the measured choices
(`asyncengine/measured_choices.py`) and the native CPU kernels built here (`kernels/cpu_native.py`).

`$ASYNCENGINE_CACHE_DIR`, else `$XDG_CACHE_HOME/asyncengine`, else `~/.cache/asyncengine`; not created here.
"""

from __future__ import annotations

import os
from pathlib import Path

ENV_DIR = "ASYNCENGINE_CACHE_DIR"


def cache_dir() -> Path:
    if os.environ.get(ENV_DIR):
        return Path(os.environ[ENV_DIR])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "asyncengine"

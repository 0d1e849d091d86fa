"""Test hook, not a user setting: ASYNCENGINE_FAULT_AFTER_STEPS=N makes an engine's device step raise after N
successful steps, so the failure path (error events, 503s, exit status 1) can be tested in a real server process.
The server's CLI installs it on an in-process engine; an engine core process (engine_core.py) installs it on its
own engine, since the variable is inherited."""

from __future__ import annotations

import logging
import os
from typing import Optional

logger = logging.getLogger(__name__)

FAULT_ENV = "ASYNCENGINE_FAULT_AFTER_STEPS"


def fault_after_steps_from_env() -> Optional[int]:
    """N from the environment, None when unset; ValueError (naming the variable) when not an integer."""
    value = os.environ.get(FAULT_ENV)
    if not value:
        return None
    try:
        return max(0, int(value))
    except ValueError:
        raise ValueError(f"{FAULT_ENV} must be an integer, got {value!r}") from None


def install_fault_hook(engine, after_steps: int) -> None:
    """Make `engine.launch` (an LLMEngine's; every step is launched, in both pipeline modes) raise RuntimeError
    once `after_steps` steps have run."""
    launch = engine.launch
    calls = 0

    def faulty_launch(step):
        nonlocal calls
        calls += 1
        if calls > after_steps:
            raise RuntimeError(f"injected engine fault after {after_steps} steps ({FAULT_ENV})")
        return launch(step)

    logger.warning("test hook %s=%d: the engine will fail after %d steps", FAULT_ENV, after_steps, after_steps)
    engine.launch = faulty_launch

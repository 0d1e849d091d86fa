"""A pytest plugin: tests marked `alone` run while no other test of the run runs, under pytest-xdist.

Some tests measure the machine (the soak's RSS slope over 90 s): a test on the other worker that loads both cores
slows them enough to read as a trend. Under xdist each test, from its setup to its teardown, holds one lock shared
by the run's workers: shared, or exclusively when it is marked `alone`. A turnstile keeps a waiting `alone` test
from being overtaken by the other worker's next tests: every test passes through it before it takes the lock, and
an `alone` test holds it from before its wait to its end. The lock files live in the run's own directory
(`run_dir`, which tests/conftest.py also gives the engine's cache); without xdist (one process runs every test)
nothing is locked.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterator

import pytest

RUN_DIR_ENV = "ASYNCENGINE_TEST_RUN_DIR"


def run_dir() -> Path:
    """The test run's own directory, shared by every process it starts (they inherit the variable); the process
    that makes it (the first to ask: the xdist controller, or the only process) removes it at exit."""
    if RUN_DIR_ENV not in os.environ:
        os.environ[RUN_DIR_ENV] = tempfile.mkdtemp(prefix="asyncengine-test-run-")
        atexit.register(shutil.rmtree, os.environ[RUN_DIR_ENV], ignore_errors=True)
    return Path(os.environ[RUN_DIR_ENV])


run_dir()  # made now, at import, so that the xdist controller makes it before it starts its workers


@contextlib.contextmanager
def machine_share(alone: bool) -> Iterator[None]:
    """Hold the run's machine lock, exclusively when `alone`, for the duration of the block."""
    if "PYTEST_XDIST_WORKER" not in os.environ:
        yield
        return
    locks = run_dir()
    with open(locks / "turnstile.lock", "a") as turnstile, open(locks / "machine.lock", "a") as machine:
        fcntl.flock(turnstile, fcntl.LOCK_EX)
        fcntl.flock(machine, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        if not alone:
            fcntl.flock(turnstile, fcntl.LOCK_UN)
        yield
    # closing the files released both locks


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    with machine_share(alone=item.get_closest_marker("alone") is not None):
        yield

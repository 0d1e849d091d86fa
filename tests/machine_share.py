"""A pytest plugin: tests marked `alone` run while no other test of the run runs, under pytest-xdist.

Some tests measure the machine (the soak's RSS slope over 90 s): a test on the other worker that loads both cores
slows them enough to read as a trend. Under xdist each test, from its setup to its teardown, holds one lock shared
by the run's workers: shared, or exclusively when it is marked `alone`. A turnstile keeps a waiting `alone` test
from being overtaken by the other worker's next tests: every test passes through it before it takes the lock, and
an `alone` test holds it from before its wait to its end. The lock files live in a directory of the run's own,
made by the first process that loads this plugin (the xdist controller) and inherited by its workers through the
environment; without xdist (one process runs every test) nothing is locked.
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

if RUN_DIR_ENV not in os.environ:
    os.environ[RUN_DIR_ENV] = tempfile.mkdtemp(prefix="asyncengine-test-run-")
    atexit.register(shutil.rmtree, os.environ[RUN_DIR_ENV], ignore_errors=True)


@contextlib.contextmanager
def machine_share(alone: bool) -> Iterator[None]:
    """Hold the run's machine lock, exclusively when `alone`, for the duration of the block."""
    if "PYTEST_XDIST_WORKER" not in os.environ:
        yield
        return
    run_dir = Path(os.environ[RUN_DIR_ENV])
    with open(run_dir / "turnstile.lock", "a") as turnstile, open(run_dir / "machine.lock", "a") as machine:
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

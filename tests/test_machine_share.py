"""The `alone` marker (tests/machine_share.py): under two xdist workers an `alone` test overlaps no other test, and
the other tests still run side by side. A real inner pytest run on a throw-away test file."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

INNER_TESTS = '''
import json, os, time
import pytest

def record(name, seconds):
    start = time.monotonic()
    time.sleep(seconds)
    with open(os.environ["INTERVALS"], "a") as f:
        f.write(json.dumps([name, start, time.monotonic()]) + "\\n")

@pytest.mark.alone
def test_alone():
    record("alone", 0.8)

@pytest.mark.parametrize("i", range(8))
def test_plain(i):
    record(f"plain{i}", 0.3)
'''


def test_an_alone_test_overlaps_no_other_and_the_others_run_in_parallel(tmp_path):
    (tmp_path / "test_inner.py").write_text(INNER_TESTS)
    intervals = tmp_path / "intervals.jsonl"
    env = {k: v for k, v in os.environ.items()  # the inner run is a run of its own: its own workers and lock
           if not k.startswith("PYTEST_") and k != "ASYNCENGINE_TEST_RUN_DIR"}
    env.update(INTERVALS=str(intervals), PYTHONPATH=str(Path(__file__).parent), PYTEST_DISABLE_PLUGIN_AUTOLOAD="1")
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "xdist.plugin", "-p", "machine_share", "-p", "no:cacheprovider", "-n", "2",
         "--dist", "load", "-o", "addopts=", "-o", 'markers=alone: runs alone', str(tmp_path / "test_inner.py")],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    spans = {name: (start, end) for name, start, end in map(json.loads, intervals.read_text().splitlines())}
    assert len(spans) == 9
    alone = spans.pop("alone")
    for name, (start, end) in spans.items():
        assert end <= alone[0] or start >= alone[1], f"{name} ran during the alone test"
    overlapping = sum(1 for a in spans.values() for b in spans.values()
                      if a < b and a[0] < b[1] and b[0] < a[1])
    assert overlapping >= 2, f"the plain tests did not run side by side: {spans}"

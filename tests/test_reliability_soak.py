"""The soak test's CI version: `python -m loadtest.soak --minutes 1.5 --warmup-s 45 --max-slope 4` against a server
subprocess on the default model must pass: no RSS slope above 4 MiB/min after the warm-up, no unexpected request
failure, KV usage back to 0, a clean exit on SIGTERM; a run that fails on the RSS slope alone is repeated once,
and the second must pass. The 5-minute run is `python -m loadtest.soak --minutes 5` (see loadtest/soak.py).

Why 4 MiB/min and not the 5-minute run's 1 (session 22, loadtest/RESULTS.md): until the engine process read the
KV cache in place (session 21's native decode attention), its RSS swung by tens of MiB with the decode mirror's
copies, so this test could only detect slopes above 30-80 MiB/min and passed whatever the server did. Without
that noise it sees the API server process's own creep, the same in the tree before session 21: about 3 MiB/min
in its first two minutes and 1.6-1.9 MiB/min over five (12 clients), live memory allocated outside Python's
allocator (tracemalloc flat, glibc's in-use bytes rising; not uvloop, not pymalloc; cause not found yet). The
5-minute soak reports it as a failure; this test catches anything steeper than that creep (a step that keeps a
tensor, a request that is never released), which it could not before."""

from __future__ import annotations

import json
import subprocess
import sys


def run_soak(out) -> tuple[subprocess.CompletedProcess, dict]:
    cmd = [sys.executable, "-m", "loadtest.soak", "--minutes", "1.5", "--warmup-s", "45", "--max-slope", "4",
           "--concurrency", "12", "--num-kv-blocks", "512", "--out", str(out)]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    print(result.stdout)
    return result, json.loads((out / "soak.json").read_text())


def test_short_soak_passes(tmp_path):
    out = tmp_path / "soak"
    result, report = run_soak(out)
    if not report["passed"] and all(p.startswith("RSS grows") for p in report["problems"]):
        # 45 s after the warm-up leave 45 samples: a floor held up by a burst of long prompts near the end reads as a
        # slope in a few percent of runs (tests/test_soak_slope.py). A leak rises again in a second run.
        out = tmp_path / "soak-again"
        result, report = run_soak(out)
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    assert report["passed"] and (out / "soak.png").stat().st_size > 10_000
    assert report["requests"]["failed"] == 0 and report["requests"]["ok"] > 50
    assert report["requests"]["cancelled"] > 0  # the load did leave at random points
    assert report["kv_drained_after_s"] is not None and report["server_exit_code"] == 0
    assert report["rss"]["fit_samples"] >= 30
    kinds = {k.split(":")[0] for k in report["requests"]["by_kind"]}
    assert {"chat-stream-short", "cmpl-stream-short", "chat-json-short", "cmpl-json-short"} <= kinds, kinds

"""The soak test's CI version: `python -m loadtest.soak --minutes 1.5 --warmup-s 45 --max-slope 1.5` against a
server subprocess on the default model must pass: no RSS slope above 1.5 MiB/min after the warm-up, no unexpected
request failure, KV usage back to 0, a clean exit on SIGTERM; a run that fails on the RSS slope alone is repeated
once, and the second must pass. The 5-minute run is `python -m loadtest.soak --minutes 5` (see loadtest/soak.py).

The limit's history (loadtest/RESULTS.md, sessions 22-23): until the engine process read the KV cache in place
(session 21), its RSS swung by tens of MiB and this test could only detect slopes above 30-80 MiB/min. Without
that noise it saw the API server's creep, 3 MiB/min early and 1.6 over five minutes, and ran at 4 MiB/min for a
session. The creep was hypercorn holding every connection its client had closed for the 75 s keep-alive timeout
(api/cli.py close_connections_at_peer_eof). With that fixed this run measures -0.2 to +0.4 MiB/min (standard
error 0.1-0.2) and the 5-minute run 0.99; 1.5 leaves room for a noisy host and still catches a leak of a few
KiB a request."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


def run_soak(out) -> tuple[subprocess.CompletedProcess, dict]:
    cmd = [sys.executable, "-m", "loadtest.soak", "--minutes", "1.5", "--warmup-s", "45", "--max-slope", "1.5",
           "--concurrency", "12", "--num-kv-blocks", "512", "--out", str(out)]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    print(result.stdout)
    return result, json.loads((out / "soak.json").read_text())


# Alone (tests/machine_share.py): beside the Ray Serve tests on the other xdist worker its load ran slowly enough
# to read as a slope, 3.3 MiB/min in both runs; it passes alone.
@pytest.mark.alone
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
    # the slope by part names the process a failure comes from; the engine runs in a process of its own
    assert set(report["rss"]["part_slopes_mib_per_min"]) == {"api server anon", "engine process anon",
                                                             "other processes anon", "file-backed"}
    assert min(s["parts_mib"]["engine process anon"] for s in report["samples"]) > 50
    kinds = {k.split(":")[0] for k in report["requests"]["by_kind"]}
    assert {"chat-stream-short", "cmpl-stream-short", "chat-json-short", "cmpl-json-short"} <= kinds, kinds

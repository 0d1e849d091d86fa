"""Start-up with and without the recorded CUDA choices (asyncengine/measured_choices.py, table "cuda_linear"): the
8B shape (4 layers, random weights), started three times in fresh processes: once to warm Triton's own kernel
cache, then with an empty choices directory (timing every shape) and with the one the previous start filled
(reading them). Prints each start's LLM() seconds, how many choices the file holds, and whether the last two
starts chose the same thresholds.

    python scripts/startup_choices_check.py [--quantization fp8|none]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

CHILD = """
import json, sys, time
from asyncengine import LLM
from asyncengine.models.layers import LinearBase
start = time.perf_counter()
llm = LLM(sys.argv[1], quantization=None if sys.argv[2] == "none" else sys.argv[2], max_model_len=2048,
          gpu_memory_utilization=0.5, enforce_eager=True)
seconds = time.perf_counter() - start
layers = [m for m in llm.engine.runner.model.modules() if isinstance(m, LinearBase)]
print(json.dumps({"seconds": seconds, "thresholds": [[getattr(m, "gemv_max_m", None), getattr(m, "gemm_max_m", None)]
                                                       for m in layers]}))
"""


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quantization", default="fp8")
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from loadtest.bench_offline import build_checkpoint

    folder = build_checkpoint(Path("/tmp/llama3-8b-4layers"), layers=4)
    warm_up, choices = tempfile.mkdtemp(prefix="choices-"), tempfile.mkdtemp(prefix="choices-")
    runs = []
    for label, folder_of_choices in (("Triton's cache warmed", warm_up), ("choices timed", choices),
                                     ("choices read", choices)):
        env = {**os.environ, "ASYNCENGINE_CACHE_DIR": folder_of_choices}
        out = subprocess.run([sys.executable, "-c", CHILD, str(folder), args.quantization], env=env,
                             capture_output=True, text=True, timeout=280)
        if out.returncode:
            print(out.stderr[-3000:])
            raise SystemExit(1)
        runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
        print(f"{args.quantization}, {label}: LLM() {runs[-1]['seconds']:.1f} s")
    table = json.loads((Path(choices) / "cuda_linear.json").read_text())
    kept = sum(len(entries) for entries in table.values())
    same = runs[1]["thresholds"] == runs[2]["thresholds"]
    print(f"{args.quantization}: {kept} choices kept; same thresholds when timed and when read: {same}")


if __name__ == "__main__":
    main()

"""Two-GPU check of a tensor-parallel engine's close (issue 13): build the 8B-shape checkpoint, run the float32
greedy prompts of bench_tp at TP=2, close the engine, and exit; prints the wall time of each part and, last,
"closed cleanly" once the engine's close has returned. Run it under `timeout` with PYTHONFAULTHANDLER=1."""

import argparse
import sys
import time
from pathlib import Path

from loadtest.bench_offline import build_checkpoint
from loadtest.bench_tp import greedy_tokens


def main() -> int:
    args = argparse.Namespace(distributed_executor_backend="mp", max_num_seqs=16, max_num_batched_tokens=8192)
    t0 = time.perf_counter()
    folder = build_checkpoint(Path("/tmp/llama3-8b-tp"))
    t1 = time.perf_counter()
    tokens = greedy_tokens(folder, 2, args, tiny=False)  # closes the engine in its `finally`
    t2 = time.perf_counter()
    print(f"checkpoint {t1 - t0:.1f} s; TP=2 engine, 6 prompts and close {t2 - t1:.1f} s; "
          f"{sum(len(t) for t in tokens)} tokens; closed cleanly", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Hardware counters of the decode GEMV at one row (issue 14), for Nsight Compute: what bounds each 8B shape.

Runs `quant_gemv`'s kernel with its chosen config on the Llama-3-8B shapes (int4 group 128, FP8 per channel, bf16)
once each to compile, then once each to be profiled, in the order printed:

    ncu --clock-control none --kernel-name regex:_gemv_kernel --launch-skip N \
        --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
        --section SchedulerStats python scripts/gemv_ncu.py [--formats int4,fp8,bf16]

where N is the number of cases (the script prints it first; `--count` prints only that). ncu flushes the caches
before each profiled launch, so every weight comes from memory, as in a decode step.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

LINEARS = ("qkv", "o", "gate_up", "down")  # of bench_gemv.SHAPES (the LM head stays bf16 and is left out)


def case(fmt: str, name: str):
    """run() -> y for one format at one 8B shape: bench_gemv's case (its x, one weight copy), with the config
    quant_gemv picks for M = 1."""
    from loadtest.bench_gemv import SHAPES, Case, Group

    k, n = SHAPES[name]
    one = Case(Group(fmt, name, k, n, 1), "cuda", copies=1)
    ours = one.ours(None)  # config None: the chosen one
    return lambda: ours(one.weights[0])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--formats", default="int4,fp8,bf16")
    parser.add_argument("--count", action="store_true", help="print the number of cases and exit")
    args = parser.parse_args()
    names = [(fmt, name) for fmt in args.formats.split(",") for name in LINEARS]
    if args.count:
        print(len(names))
        return 0
    print(f"{len(names)} cases, profiled in this order:", flush=True)
    runs = [(fmt, name, case(fmt, name)) for fmt, name in names]
    for _, _, run in runs:  # compile (the launches ncu skips)
        run()
    torch.cuda.synchronize()
    for i, (fmt, name, run) in enumerate(runs):
        print(f"  {i}: {fmt} {name}", flush=True)
        run()
    torch.cuda.synchronize()
    return 0


if __name__ == "__main__":
    sys.exit(main())

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

SHAPES = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096)}  # (K, N)


def case(fmt: str, k: int, n: int):
    """run(x) -> y for one format at (K, N), with the config quant_gemv picks for M = 1."""
    from asyncengine.kernels import quant_gemv, quant_reference

    if fmt == "int4":
        qweight, scales, zeros = quant_reference.quantize_int_weight(torch.randn(k, n, device="cuda"), 128)
        scales, zeros = scales.bfloat16(), zeros.bfloat16()
        return lambda x: quant_gemv.int4_gemv(x, qweight, scales, zeros, 128)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    scale = None
    if fmt == "fp8":
        w, scale = quant_reference.quantize_fp8(w, dim=-1)
    return lambda x: quant_gemv.dense_gemv(x, w, None, scale)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--formats", default="int4,fp8,bf16")
    parser.add_argument("--count", action="store_true", help="print the number of cases and exit")
    args = parser.parse_args()
    names = [(fmt, name) for fmt in args.formats.split(",") for name in SHAPES]
    if args.count:
        print(len(names))
        return 0
    print(f"{len(names)} cases, profiled in this order:", flush=True)
    runs = []
    for fmt, name in names:
        k, n = SHAPES[name]
        runs.append((fmt, name, case(fmt, k, n), torch.randn(1, k, device="cuda", dtype=torch.bfloat16)))
    for _, _, run, x in runs:  # compile (the launches ncu skips)
        run(x)
    torch.cuda.synchronize()
    for i, (fmt, name, run, x) in enumerate(runs):
        print(f"  {i}: {fmt} {name}", flush=True)
        run(x)
    torch.cuda.synchronize()
    return 0


if __name__ == "__main__":
    sys.exit(main())

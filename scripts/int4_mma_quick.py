"""The int4 decode GEMV's MMA path (GemvConfig.mma) against each Llama-3-8B shape's table row, timed alike in one
process (issue 14): `bench_gemv`'s timer (a CUDA graph cycling weight copies past L2), M = 1 and M = 8, a few
hand-picked MMA tiles (no sweep), each checked against the float32 reference first. For a device call too short for
`--gemv-sweep`:

    python scripts/int4_mma_quick.py [--ms 1,8]

prints one line per (shape, M, config): microseconds per call, GB/s, and the ratio to the table row's time.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

MMA_TILES = [(256, 128, 4), (128, 128, 4), (512, 128, 8), (256, 64, 4)]  # (block_n, block_k, warps)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ms", default="1,8")
    args = parser.parse_args()
    from asyncengine.kernels import device_name, quant_gemv
    from loadtest import bench_gemv
    from loadtest.bench_offline import measure_copy_bandwidth

    gpu = device_name(0)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    copy_gbps = measure_copy_bandwidth(2.0) / 1e9
    print(f"device: {gpu}  {sms} SMs  copy {copy_gbps:.0f} GB/s", flush=True)
    for m in (int(v) for v in args.ms.split(",")):
        for name in ("qkv", "o", "gate_up", "down"):
            k, n = bench_gemv.SHAPES[name]
            group = bench_gemv.Group("int4", name, k, n, m)
            case = bench_gemv.Case(group, "cuda", bench_gemv.copies_for(group))
            ref = case.reference().float()
            row = quant_gemv.config_for("int4", m, n, k, sms, gpu)
            configs = [row]
            for block_n, block_k, warps in MMA_TILES:
                split = quant_gemv.split_k_for(n, k, block_n, block_k, sms)
                configs += [quant_gemv.GemvConfig(block_n, block_k, s, warps, mma=True)
                            for s in sorted({split, max(1, split // 2), split * 2})]
            base = None
            for config in configs:
                out = case.ours(config)(case.weights[0]).float()
                error = ((out - ref).norm() / ref.norm()).item()
                us = bench_gemv.time_per_call_us(case.ours(config), case.weights, "cuda")
                base = base or us
                print(f"{name:8} M={m}  {us:7.2f} us  {case.bytes / us / 1e3:6.0f} GB/s  x{base / us:5.2f}  "
                      f"err {error:.1e}  {config}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

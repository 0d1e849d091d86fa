"""Tuned launch configurations of the W8A8 FP8 GEMM (fp8_gemm.py) per weight shape and batch bucket.

Key: (N, K, M bucket) with the bucket fp8_gemm.m_bucket(M) (16, 32, 64, 128, 256, 512). Shapes missing here take
fp8_gemm.default_config. Paste the lines that `python -m loadtest.bench_kernels --fp8-gemm-sweep` prints under
"winners" (measured on one GPU kind: note which, below).
"""

from __future__ import annotations

from .fp8_gemm import Fp8GemmConfig

# Measured on: one NVIDIA H200, 2026-11-25, `--fp8-gemm-sweep --ms 64,128,256,512` (run 94); the rows of M = 16 and 32
# below on one NVIDIA H100 80GB HBM3 (run 92). Comments: our time, the weight's GB/s, and torch._scaled_mm row-wise on
# the same pre-quantized x. Arguments: block_n, block_k, split_k, num_warps, num_stages.
FP8_GEMM_TUNED: dict[tuple[int, int, int], Fp8GemmConfig] = {
    (6144, 4096, 64): Fp8GemmConfig(64, 256, 1, 4, 5),  # qkv: 9.8 us, 2570 GB/s; row-wise 14.2 us
    (6144, 4096, 128): Fp8GemmConfig(64, 256, 1, 4, 3),  # qkv: 12.2 us, 2062 GB/s; row-wise 14.4 us
    (6144, 4096, 256): Fp8GemmConfig(128, 128, 1, 8, 5, block_m=128),  # qkv: 14.8 us, 1702 GB/s; row-wise 14.8 us
    (6144, 4096, 512): Fp8GemmConfig(64, 128, 1, 4, 3, block_m=128),  # qkv: 24.6 us, 1022 GB/s; row-wise 26.1 us
    (4096, 4096, 64): Fp8GemmConfig(64, 256, 1, 4, 5),  # o: 7.9 us, 2135 GB/s; row-wise 13.8 us
    (4096, 4096, 128): Fp8GemmConfig(64, 256, 1, 4, 5, block_m=64),  # o: 8.9 us, 1892 GB/s; row-wise 14.1 us
    (4096, 4096, 256): Fp8GemmConfig(64, 256, 1, 4, 3, block_m=128),  # o: 11.4 us, 1475 GB/s; row-wise 14.2 us
    (4096, 4096, 512): Fp8GemmConfig(128, 128, 1, 8, 5, block_m=128),  # o: 15.0 us, 1122 GB/s; row-wise 15.3 us
    (28672, 4096, 64): Fp8GemmConfig(64, 128, 1, 4, 3),  # gate_up: 33.9 us, 3464 GB/s; row-wise 45.4 us
    (28672, 4096, 128): Fp8GemmConfig(128, 128, 1, 8, 3),  # gate_up: 36.4 us, 3230 GB/s; row-wise 39.7 us
    (28672, 4096, 256): Fp8GemmConfig(128, 128, 1, 8, 3),  # gate_up: 58.7 us, 2002 GB/s; row-wise 55.6 us
    (28672, 4096, 512): Fp8GemmConfig(64, 128, 1, 8, 5),  # gate_up: 114.7 us, 1024 GB/s; row-wise 96.9 us
    (4096, 14336, 64): Fp8GemmConfig(64, 256, 2, 4, 5),  # down: 20.2 us, 2901 GB/s; row-wise 37.6 us
    (4096, 14336, 128): Fp8GemmConfig(64, 256, 1, 4, 5, block_m=64),  # down: 24.1 us, 2434 GB/s; row-wise 37.7 us
    (4096, 14336, 256): Fp8GemmConfig(128, 128, 2, 8, 5, block_m=128),  # down: 32.8 us, 1788 GB/s; row-wise 37.8 us
    (4096, 14336, 512): Fp8GemmConfig(128, 128, 1, 8, 5, block_m=128),  # down: 45.0 us, 1306 GB/s; row-wise 44.2 us
    # run 92, one H100:
    (6144, 4096, 16): Fp8GemmConfig(64, 256, 1, 4, 5),  # qkv: 10.9 us, 2319 GB/s; row-wise 19.3 us
    (6144, 4096, 32): Fp8GemmConfig(64, 256, 1, 4, 5),  # qkv: 11.4 us, 2205 GB/s; row-wise 18.6 us
    (4096, 4096, 16): Fp8GemmConfig(64, 256, 1, 4, 5),  # o: 8.2 us, 2052 GB/s; row-wise 14.8 us
    (4096, 4096, 32): Fp8GemmConfig(64, 256, 1, 4, 5),  # o: 8.3 us, 2017 GB/s; row-wise 14.3 us
    (28672, 4096, 16): Fp8GemmConfig(64, 128, 1, 4, 3),  # gate_up: 42.2 us, 2782 GB/s; row-wise 48.6 us
    (28672, 4096, 32): Fp8GemmConfig(128, 256, 1, 8, 3),  # gate_up: 44.1 us, 2662 GB/s; row-wise 48.8 us
    (4096, 14336, 16): Fp8GemmConfig(64, 256, 1, 4, 5),  # down: 23.8 us, 2463 GB/s; row-wise 45.3 us
    (4096, 14336, 32): Fp8GemmConfig(64, 256, 1, 4, 5),  # down: 24.3 us, 2412 GB/s; row-wise 43.5 us
}

"""Tuned launch configurations of the W8A8 FP8 GEMM (fp8_gemm.py) per weight shape and batch bucket.

Key: (N, K, M bucket) with the bucket fp8_gemm.m_bucket(M) (16, 32, 64, 128, 256, 512). Shapes missing here take
fp8_gemm.default_config. Paste the lines that `python -m loadtest.bench_kernels --fp8-gemm-sweep` prints under
"winners" (measured on one GPU kind: note which, below).
"""

from __future__ import annotations

from .fp8_gemm import Fp8GemmConfig

# Measured on: one NVIDIA H100 80GB HBM3, 2026-11-25, `--fp8-gemm-sweep` (run 92). Comments: our time, the
# weight's GB/s, and torch._scaled_mm row-wise on the same pre-quantized x. Arguments: block_n, block_k, split_k,
# num_warps, num_stages.
FP8_GEMM_TUNED: dict[tuple[int, int, int], Fp8GemmConfig] = {
    (6144, 4096, 16): Fp8GemmConfig(64, 256, 1, 4, 5),  # qkv: 10.9 us, 2319 GB/s; row-wise 19.3 us
    (6144, 4096, 32): Fp8GemmConfig(64, 256, 1, 4, 5),  # qkv: 11.4 us, 2205 GB/s; row-wise 18.6 us
    (6144, 4096, 64): Fp8GemmConfig(64, 256, 1, 4, 5),  # qkv: 11.9 us, 2120 GB/s; row-wise 16.6 us
    (6144, 4096, 128): Fp8GemmConfig(64, 256, 1, 4, 3),  # qkv: 13.5 us, 1861 GB/s; row-wise 14.7 us
    (6144, 4096, 256): Fp8GemmConfig(128, 128, 1, 4, 5),  # qkv: 16.1 us, 1562 GB/s; row-wise 15.3 us
    (6144, 4096, 512): Fp8GemmConfig(128, 128, 1, 4, 3),  # qkv: 27.3 us, 923 GB/s; row-wise 28.3 us
    (4096, 4096, 16): Fp8GemmConfig(64, 256, 1, 4, 5),  # o: 8.2 us, 2052 GB/s; row-wise 14.8 us
    (4096, 4096, 32): Fp8GemmConfig(64, 256, 1, 4, 5),  # o: 8.3 us, 2017 GB/s; row-wise 14.3 us
    (4096, 4096, 64): Fp8GemmConfig(64, 256, 1, 4, 5),  # o: 8.9 us, 1884 GB/s; row-wise 13.9 us
    (4096, 4096, 128): Fp8GemmConfig(64, 128, 1, 4, 5),  # o: 11.3 us, 1490 GB/s; row-wise 13.8 us
    (4096, 4096, 256): Fp8GemmConfig(64, 128, 1, 4, 5),  # o: 11.8 us, 1425 GB/s; row-wise 13.8 us
    (4096, 4096, 512): Fp8GemmConfig(128, 128, 1, 4, 5),  # o: 16.2 us, 1036 GB/s; row-wise 16.3 us
    (28672, 4096, 16): Fp8GemmConfig(64, 128, 1, 4, 3),  # gate_up: 42.2 us, 2782 GB/s; row-wise 48.6 us
    (28672, 4096, 32): Fp8GemmConfig(128, 256, 1, 8, 3),  # gate_up: 44.1 us, 2662 GB/s; row-wise 48.8 us
    (28672, 4096, 64): Fp8GemmConfig(64, 256, 1, 4, 3),  # gate_up: 45.1 us, 2602 GB/s; row-wise 50.3 us
    (28672, 4096, 128): Fp8GemmConfig(128, 128, 1, 8, 5),  # gate_up: 50.4 us, 2329 GB/s; row-wise 49.7 us
    (28672, 4096, 256): Fp8GemmConfig(128, 128, 1, 8, 3),  # gate_up: 87.2 us, 1346 GB/s; row-wise 62.5 us
    (28672, 4096, 512): Fp8GemmConfig(128, 128, 1, 4, 3),  # gate_up: 168.5 us, 697 GB/s; row-wise 103.4 us
    (4096, 14336, 16): Fp8GemmConfig(64, 256, 1, 4, 5),  # down: 23.8 us, 2463 GB/s; row-wise 45.3 us
    (4096, 14336, 32): Fp8GemmConfig(64, 256, 1, 4, 5),  # down: 24.3 us, 2412 GB/s; row-wise 43.5 us
    (4096, 14336, 64): Fp8GemmConfig(64, 256, 1, 4, 5),  # down: 25.4 us, 2312 GB/s; row-wise 38.6 us
    (4096, 14336, 128): Fp8GemmConfig(64, 128, 2, 4, 5),  # down: 31.8 us, 1844 GB/s; row-wise 37.0 us
    (4096, 14336, 256): Fp8GemmConfig(64, 128, 1, 4, 5),  # down: 36.6 us, 1603 GB/s; row-wise 37.4 us
    (4096, 14336, 512): Fp8GemmConfig(128, 128, 1, 8, 5),  # down: 46.0 us, 1276 GB/s; row-wise 45.2 us
}

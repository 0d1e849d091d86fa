"""Tuned launch configurations of the decode GEMV (quant_gemv.py), per weight format and shape.

Key: (format, N, K, M bucket): format bf16 / fp16 / fp32 / fp8 (dense weights) or int4 (group size 128 unless a
tile's block_k is cut to the group); M bucket 1 (M == 1, the FMA path unless dot=True) or 16 (M of 2..16, tl.dot).
Shapes missing here take quant_gemv.default_config. Paste the lines that `python -m loadtest.bench_kernels
--gemv-sweep` prints under "winners" (measured on one GPU kind: note which, below); an int4 winner on one of its
alternative paths carries slot_dot=True or half_fma=True (GemvConfig's docstring).
"""

from __future__ import annotations

from .quant_gemv import GemvConfig

# Measured on: one NVIDIA H100 80GB HBM3 (132 SMs, copy 2995 GB/s), 2026-11-24, session 7's sweep (run 41); the
# Llama-3-8B shapes. Comments: our time, GB/s, share of the copy bandwidth; the library's time beside it.
TUNED: dict[tuple[str, int, int, int], GemvConfig] = {
    # int4: session 8's run 48 (one H100 80GB HBM3, 2026-11-24, branch s8-int4 at 03afcb9): the M = 1 rows on the
    # bf16x2 word sums (half_fma: rel error ~3e-3 against the float32 reference, the float32 FMA path ~3e-9), the
    # M = 16 rows on one dot per nibble slot; in run 41 these shapes took 14.7 / 11.6 / 55.8 / 28.4 us at M = 1.
    ("int4", 6144, 4096, 1): GemvConfig(512, 64, 44, 4, 3, False, half_fma=True),  # qkv: 11.4 us,   1177 GB/s  40%; old int4 GEMM tile 35.8 us
    ("int4", 6144, 4096, 16): GemvConfig(128, 128, 11, 4, 3, True, slot_dot=True),  # qkv: 21.4 us,    641 GB/s  22%; old int4 GEMM tile 35.9 us
    ("int4", 4096, 4096, 1): GemvConfig(64, 128, 9, 4, 3, False, half_fma=True),  # o: 9.2 us,    966 GB/s  33%; old int4 GEMM tile 28.6 us
    ("int4", 4096, 4096, 16): GemvConfig(128, 128, 9, 4, 3, True, slot_dot=True),  # o: 17.5 us,    524 GB/s  18%; old int4 GEMM tile 28.8 us
    ("int4", 28672, 4096, 1): GemvConfig(1024, 64, 10, 8, 3, False, half_fma=True),  # gate_up: 28.4 us,   2202 GB/s  74%; old int4 GEMM tile 132.3 us
    ("int4", 28672, 4096, 16): GemvConfig(128, 128, 2, 4, 3, True, slot_dot=True),  # gate_up: 70.1 us,    905 GB/s  31%; old int4 GEMM tile 132.2 us
    ("int4", 4096, 14336, 1): GemvConfig(512, 64, 66, 4, 3, False, half_fma=True),  # down: 19.9 us,   1572 GB/s  53%; old int4 GEMM tile 94.0 us
    ("int4", 4096, 14336, 16): GemvConfig(128, 128, 17, 4, 3, True, slot_dot=True),  # down: 39.1 us,    813 GB/s  27%; old int4 GEMM tile 94.3 us
    ("fp8", 6144, 4096, 1): GemvConfig(16, 512, 1, 8, 3, False),  # qkv: 13.4 us,   1888 GB/s  63%; _scaled_mm per-tensor 13.1 us, _scaled_mm rowwise 19.3 us, fp8_linear (quant+rowwise) 21.3 us
    ("fp8", 6144, 4096, 16): GemvConfig(32, 256, 2, 4, 3, True),  # qkv: 15.2 us,   1680 GB/s  56%; _scaled_mm per-tensor 13.1 us, _scaled_mm rowwise 18.2 us, fp8_linear (quant+rowwise) 19.9 us
    ("fp8", 6144, 4096, 64): GemvConfig(32, 128, 2, 4, 3, True),  # qkv: 21.9 us,   1211 GB/s  40%; _scaled_mm per-tensor 13.2 us, _scaled_mm rowwise 16.4 us, fp8_linear (quant+rowwise) 18.2 us
    ("fp8", 4096, 4096, 1): GemvConfig(128, 128, 9, 8, 3, False),  # o: 10.9 us,   1537 GB/s  51%; _scaled_mm per-tensor 9.3 us, _scaled_mm rowwise 15.7 us, fp8_linear (quant+rowwise) 17.5 us
    ("fp8", 4096, 4096, 16): GemvConfig(32, 128, 5, 4, 3, True),  # o: 11.8 us,   1448 GB/s  48%; _scaled_mm per-tensor 9.4 us, _scaled_mm rowwise 14.7 us, fp8_linear (quant+rowwise) 16.7 us
    ("fp8", 4096, 4096, 64): GemvConfig(32, 128, 3, 4, 3, True),  # o: 16.7 us,   1066 GB/s  36%; _scaled_mm per-tensor 9.7 us, _scaled_mm rowwise 14.3 us, fp8_linear (quant+rowwise) 16.2 us
    ("fp8", 28672, 4096, 1): GemvConfig(64, 256, 1, 8, 3, False),  # gate_up: 44.7 us,   2632 GB/s  88%; _scaled_mm per-tensor 43.8 us, _scaled_mm rowwise 51.2 us, fp8_linear (quant+rowwise) 52.0 us
    ("fp8", 28672, 4096, 16): GemvConfig(32, 128, 1, 4, 3, True),  # gate_up: 47.8 us,   2481 GB/s  83%; _scaled_mm per-tensor 44.9 us, _scaled_mm rowwise 51.4 us, fp8_linear (quant+rowwise) 53.2 us
    ("fp8", 28672, 4096, 64): GemvConfig(64, 64, 1, 4, 3, True),  # gate_up: 72.0 us,   1690 GB/s  56%; _scaled_mm per-tensor 48.2 us, _scaled_mm rowwise 51.6 us, fp8_linear (quant+rowwise) 54.5 us
    ("fp8", 4096, 14336, 1): GemvConfig(32, 512, 5, 4, 3, False),  # down: 26.2 us,   2245 GB/s  75%; _scaled_mm per-tensor 26.0 us, _scaled_mm rowwise 48.2 us, fp8_linear (quant+rowwise) 51.9 us
    ("fp8", 4096, 14336, 16): GemvConfig(32, 256, 3, 4, 3, True),  # down: 28.3 us,   2100 GB/s  70%; _scaled_mm per-tensor 27.3 us, _scaled_mm rowwise 45.8 us, fp8_linear (quant+rowwise) 48.7 us
    ("fp8", 4096, 14336, 64): GemvConfig(32, 128, 3, 4, 3, True),  # down: 43.7 us,   1397 GB/s  47%; _scaled_mm per-tensor 25.3 us, _scaled_mm rowwise 39.3 us, fp8_linear (quant+rowwise) 44.6 us
    ("bf16", 6144, 4096, 1): GemvConfig(32, 256, 1, 4, 3, True),  # qkv: 21.6 us,   2329 GB/s  78%; cuBLAS F.linear 22.5 us
    ("bf16", 6144, 4096, 16): GemvConfig(32, 256, 1, 4, 3, True),  # qkv: 22.0 us,   2306 GB/s  77%; cuBLAS F.linear 22.6 us
    ("bf16", 6144, 4096, 64): GemvConfig(64, 256, 1, 4, 3, True),  # qkv: 22.6 us,   2290 GB/s  76%; cuBLAS F.linear 21.9 us
    ("bf16", 4096, 4096, 1): GemvConfig(32, 256, 1, 4, 3, True),  # o: 16.2 us,   2067 GB/s  69%; cuBLAS F.linear 17.5 us
    ("bf16", 4096, 4096, 16): GemvConfig(32, 256, 1, 4, 4, True),  # o: 15.7 us,   2158 GB/s  72%; cuBLAS F.linear 17.7 us
    ("bf16", 4096, 4096, 64): GemvConfig(32, 256, 1, 4, 3, True),  # o: 17.0 us,   2037 GB/s  68%; cuBLAS F.linear 16.1 us
    ("bf16", 28672, 4096, 1): GemvConfig(32, 128, 1, 4, 3, True),  # gate_up: 81.4 us,   2886 GB/s  96%; cuBLAS F.linear 83.4 us
    ("bf16", 28672, 4096, 16): GemvConfig(32, 128, 1, 4, 3, True),  # gate_up: 82.9 us,   2844 GB/s  95%; cuBLAS F.linear 84.7 us
    ("bf16", 28672, 4096, 64): GemvConfig(64, 128, 1, 4, 3, True),  # gate_up: 86.4 us,   2768 GB/s  92%; cuBLAS F.linear 87.9 us
    ("bf16", 4096, 14336, 1): GemvConfig(32, 256, 2, 4, 3, True),  # down: 44.4 us,   2645 GB/s  88%; cuBLAS F.linear 45.9 us
    ("bf16", 4096, 14336, 16): GemvConfig(32, 256, 1, 4, 4, True),  # down: 45.0 us,   2624 GB/s  88%; cuBLAS F.linear 46.5 us
    ("bf16", 4096, 14336, 64): GemvConfig(32, 128, 3, 4, 3, True),  # down: 48.9 us,   2452 GB/s  82%; cuBLAS F.linear 48.3 us
    ("bf16", 128256, 4096, 1): GemvConfig(16, 512, 1, 8, 3, False),  # lm_head: 341.3 us,   3079 GB/s 103%; cuBLAS F.linear 372.5 us
    ("bf16", 128256, 4096, 16): GemvConfig(64, 256, 1, 4, 4, True),  # lm_head: 350.3 us,   3012 GB/s 101%; cuBLAS F.linear 381.3 us
    ("bf16", 128256, 4096, 64): GemvConfig(64, 128, 1, 4, 3, True),  # lm_head: 366.3 us,   2915 GB/s  97%; cuBLAS F.linear 389.0 us
}

"""Tuned launch configurations of the decode GEMV (quant_gemv.py), per weight format and shape.

Key: (format, N, K, M bucket) for a row any GPU takes, or (format, N, K, M bucket, GPU name) for a row only that GPU
model takes (its name as torch.cuda.get_device_name reports it; such a row wins over the row for any GPU):
format bf16 / fp16 / fp32 / fp8 (dense weights) or int4 (group size 128 unless a tile's block_k is cut to the
group); M bucket 1 (M == 1, the FMA path unless dot=True) or 16 (M of 2..16, tl.dot). Shapes missing here take
quant_gemv.default_config. `python -m loadtest.bench_kernels --gemv-sweep --write-table` writes its winners here as
rows of the GPU it ran on (`--any-gpu`: rows for any GPU); an int4 winner on one of its alternative paths carries
slot_dot=True or half_fma=True (GemvConfig's docstring). The rows without a GPU name were measured on the GPUs their
comments name: tiles tuned on an H200 are not always an H100's best (run 126: the FP8 M = 1 rows lost to the W8A8
GEMM there), hence the per-GPU rows.
"""

from __future__ import annotations

from .quant_gemv import GemvConfig

# Measured on: one NVIDIA H100 80GB HBM3 (132 SMs, copy 2995 GB/s), 2026-11-24, session 7's sweep (run 41); the
# Llama-3-8B shapes. Comments: our time, GB/s, share of the copy bandwidth; the library's time beside it.
# The bf16 8B rows at M = 1 and 16 are session 9's run 59 (one NVIDIA H200, copy ~4,230 GB/s; written by
# `--gemv-sweep --formats bf16 --shapes 8b --ms 1,16 --write-table`): the FMA path with load-ahead (session 8) now
# wins at M = 1 where run 41's H100 sweep, before load-ahead existed, chose tl.dot. Their M = 64 rows are run 41's.
TUNED: dict[tuple, GemvConfig] = {
    # int4 and fp8: session 8's run 51 (one H100 80GB HBM3, 2026-11-24, main + s8-fp8 at 7693a21): int4 M = 1 rows
    # mostly on the bf16x2 word sums (half_fma: rel error ~3e-3 against the float32 reference, the float32 FMA path
    # ~3e-9), M = 16 rows on one dot per nibble slot; fp8 M = 1 rows on 32-bit words of four codes (fp8_words). In run
    # 41 the int4 shapes took 14.7 / 11.6 / 55.8 / 28.4 us at M = 1. fp8 "down" at M = 16 and 64 are run 41's (the
    # sweep's budget ran out before them). The int4 M = 16 rows are run 48's: the M = 16 kernel changes measured in
    # run 51 (PTX slot_dot codes, 2-slice reduction rounds) were slower and are reverted to run 48's code.
    # The int4 and fp8 M = 1 rows are session 13's run 82 (one NVIDIA H200, copy 4,255 GB/s; `--gemv-sweep --formats
    # int4,fp8 --ms 1 --write-table`): the same tiles as run 51 except int4 o and fp8 gate_up / down, each 0-5% faster
    # than run 51's tile in that sweep.
    ("int4", 6144, 4096, 1): GemvConfig(512, 64, 44, 4, 3, False),  # qkv: 9.2 us,   1456 GB/s  34%; old int4 GEMM tile 36.5 us
    ("int4", 6144, 4096, 16): GemvConfig(128, 128, 11, 4, 3, True, slot_dot=True),  # qkv: 21.4 us,    641 GB/s  22%; old int4 GEMM tile 35.9 us (run 48)
    ("int4", 4096, 4096, 1): GemvConfig(256, 64, 33, 2, 3, False, half_fma=True),  # o: 7.6 us,   1180 GB/s  28%; old int4 GEMM tile 30.0 us
    ("int4", 4096, 4096, 16): GemvConfig(128, 128, 9, 4, 3, True, slot_dot=True),  # o: 17.5 us,    524 GB/s  18%; old int4 GEMM tile 28.8 us (run 48)
    ("int4", 28672, 4096, 1): GemvConfig(1024, 64, 10, 8, 3, False, half_fma=True),  # gate_up: 25.0 us,   2493 GB/s  59%; old int4 GEMM tile 137.7 us
    ("int4", 28672, 4096, 16): GemvConfig(128, 128, 2, 4, 3, True, slot_dot=True),  # gate_up: 70.1 us,    905 GB/s  31%; old int4 GEMM tile 132.2 us (run 48)
    ("int4", 4096, 14336, 1): GemvConfig(1024, 64, 66, 8, 3, False, half_fma=True),  # down: 17.5 us,   1789 GB/s  42%; old int4 GEMM tile 97.9 us
    ("int4", 4096, 14336, 16): GemvConfig(128, 128, 17, 4, 3, True, slot_dot=True),  # down: 39.1 us,    813 GB/s  27%; old int4 GEMM tile 94.3 us (run 48)
    # int4 at 17 <= M <= 64 (64-row tiles, quant_gemv.m_bucket): session 13's run 86 (one NVIDIA H200), `--gemv-sweep
    # --formats int4 --ms 16,32,64`, against quant_int4's dequantize + GEMM (what M > 64 runs).
    ("int4", 6144, 4096, 64): GemvConfig(128, 128, 6, 4, 3, True),  # qkv: 25.1 us,    584 GB/s  14%; dequantize + GEMM 31.0 us
    ("int4", 4096, 4096, 64): GemvConfig(64, 128, 9, 4, 3, True),  # o: 20.7 us,    481 GB/s  11%; dequantize + GEMM 20.6 us
    ("int4", 28672, 4096, 64): GemvConfig(128, 128, 1, 4, 3, True),  # gate_up: 81.7 us,    815 GB/s  19%; dequantize + GEMM 144.3 us
    ("int4", 4096, 14336, 64): GemvConfig(64, 128, 9, 4, 3, True),  # down: 52.2 us,    643 GB/s  15%; dequantize + GEMM 78.3 us
    ("fp8", 6144, 4096, 1): GemvConfig(32, 512, 2, 8, 3, False, fp8_words=True),  # qkv: 10.1 us,   2487 GB/s  58%; _scaled_mm per-tensor 9.4 us, _scaled_mm rowwise 18.9 us, fp8_linear (quant+rowwise) 21.0 us
    ("fp8", 6144, 4096, 16): GemvConfig(32, 256, 1, 4, 4, True),  # qkv: 16.3 us,   1566 GB/s  52%; _scaled_mm per-tensor 13.0 us, _scaled_mm rowwise 17.7 us, fp8_linear (quant+rowwise) 19.2 us
    ("fp8", 6144, 4096, 64): GemvConfig(32, 128, 2, 4, 3, True),  # qkv: 22.0 us,   1203 GB/s  40%; _scaled_mm per-tensor 13.3 us, _scaled_mm rowwise 15.2 us, fp8_linear (quant+rowwise) 17.3 us
    ("fp8", 4096, 4096, 1): GemvConfig(64, 512, 5, 8, 3, False, fp8_words=True),  # o: 8.2 us,   2049 GB/s  48%; _scaled_mm per-tensor 7.4 us, _scaled_mm rowwise 14.2 us, fp8_linear (quant+rowwise) 16.3 us
    ("fp8", 4096, 4096, 16): GemvConfig(32, 256, 5, 4, 4, True),  # o: 12.0 us,   1419 GB/s  47%; _scaled_mm per-tensor 9.4 us, _scaled_mm rowwise 13.6 us, fp8_linear (quant+rowwise) 15.5 us
    ("fp8", 4096, 4096, 64): GemvConfig(32, 128, 3, 4, 3, True),  # o: 17.7 us,   1006 GB/s  33%; _scaled_mm per-tensor 9.7 us, _scaled_mm rowwise 13.7 us, fp8_linear (quant+rowwise) 15.8 us
    ("fp8", 28672, 4096, 1): GemvConfig(64, 256, 1, 4, 3, False, fp8_words=True),  # gate_up: 31.5 us,   3739 GB/s  88%; _scaled_mm per-tensor 30.2 us, _scaled_mm rowwise 46.1 us, fp8_linear (quant+rowwise) 47.3 us
    ("fp8", 28672, 4096, 16): GemvConfig(32, 256, 1, 4, 4, True),  # gate_up: 46.5 us,   2553 GB/s  85%; _scaled_mm per-tensor 44.8 us, _scaled_mm rowwise 49.5 us, fp8_linear (quant+rowwise) 51.4 us
    ("fp8", 28672, 4096, 64): GemvConfig(64, 128, 1, 4, 3, True),  # gate_up: 76.5 us,   1591 GB/s  53%; _scaled_mm per-tensor 48.1 us, _scaled_mm rowwise 50.5 us, fp8_linear (quant+rowwise) 53.1 us
    ("fp8", 4096, 14336, 1): GemvConfig(32, 512, 3, 8, 3, False, fp8_words=True),  # down: 18.9 us,   3110 GB/s  73%; _scaled_mm per-tensor 19.8 us, _scaled_mm rowwise 43.6 us, fp8_linear (quant+rowwise) 47.3 us
    ("fp8", 4096, 14336, 16): GemvConfig(32, 256, 3, 4, 3, True),  # down: 28.3 us,   2100 GB/s  70%; _scaled_mm per-tensor 27.3 us, _scaled_mm rowwise 45.8 us, fp8_linear (quant+rowwise) 48.7 us
    ("fp8", 4096, 14336, 64): GemvConfig(32, 128, 3, 4, 3, True),  # down: 43.7 us,   1397 GB/s  47%; _scaled_mm per-tensor 25.3 us, _scaled_mm rowwise 39.3 us, fp8_linear (quant+rowwise) 44.6 us
    ("bf16", 6144, 4096, 1): GemvConfig(16, 512, 1, 8, 3, False, load_ahead=True),  # qkv: 15.0 us,   3367 GB/s  81%; cuBLAS F.linear 16.7 us
    ("bf16", 6144, 4096, 16): GemvConfig(32, 256, 2, 4, 4, True),  # qkv: 17.4 us,   2911 GB/s  70%; cuBLAS F.linear 17.0 us
    ("bf16", 6144, 4096, 64): GemvConfig(64, 256, 1, 4, 3, True),  # qkv: 22.6 us,   2290 GB/s  76%; cuBLAS F.linear 21.9 us
    ("bf16", 4096, 4096, 1): GemvConfig(16, 512, 2, 4, 3, False, load_ahead=True),  # o: 12.1 us,   2784 GB/s  67%; cuBLAS F.linear 14.5 us
    ("bf16", 4096, 4096, 16): GemvConfig(64, 256, 5, 4, 3, True),  # o: 12.7 us,   2671 GB/s  65%; cuBLAS F.linear 14.4 us
    ("bf16", 4096, 4096, 64): GemvConfig(32, 256, 1, 4, 3, True),  # o: 17.0 us,   2037 GB/s  68%; cuBLAS F.linear 16.1 us
    ("bf16", 28672, 4096, 1): GemvConfig(32, 256, 1, 4, 3, False, load_ahead=True),  # gate_up: 57.3 us,   4103 GB/s  99%; cuBLAS F.linear 56.3 us
    ("bf16", 28672, 4096, 16): GemvConfig(64, 256, 1, 4, 3, True),  # gate_up: 58.1 us,   4057 GB/s  98%; cuBLAS F.linear 57.3 us
    ("bf16", 28672, 4096, 64): GemvConfig(64, 128, 1, 4, 3, True),  # gate_up: 86.4 us,   2768 GB/s  92%; cuBLAS F.linear 87.9 us
    ("bf16", 4096, 14336, 1): GemvConfig(32, 512, 2, 8, 3, False, load_ahead=True),  # down: 31.2 us,   3771 GB/s  91%; cuBLAS F.linear 32.6 us
    ("bf16", 4096, 14336, 16): GemvConfig(64, 128, 3, 4, 4, True),  # down: 33.9 us,   3482 GB/s  84%; cuBLAS F.linear 33.2 us
    ("bf16", 4096, 14336, 64): GemvConfig(32, 128, 3, 4, 3, True),  # down: 48.9 us,   2452 GB/s  82%; cuBLAS F.linear 48.3 us
    ("bf16", 128256, 4096, 1): GemvConfig(64, 128, 1, 4, 3, False, load_ahead=True),  # lm_head: 232.9 us,   4513 GB/s 109%; cuBLAS F.linear 239.3 us
    ("bf16", 128256, 4096, 16): GemvConfig(64, 128, 1, 4, 4, True),  # lm_head: 239.1 us,   4412 GB/s 107%; cuBLAS F.linear 243.6 us
    ("bf16", 128256, 4096, 64): GemvConfig(64, 128, 1, 4, 3, True),  # lm_head: 366.3 us,   2915 GB/s  97%; cuBLAS F.linear 389.0 us
    # bf16 at other models' per-rank shapes: session 9's run 57 (one NVIDIA H200, copy ~4,250 GB/s, 2026-11-24),
    # `--gemv-sweep --formats bf16 --shapes qwen3-30b-a3b,70b-tp2,8b-tp2 --ms 1,16`: Qwen3-30B-A3B's dense linears,
    # and the Llama-3-70B and -8B shapes at TP=2. At M = 1 every winner is the FMA path with load-ahead; the untuned
    # default lost to cuBLAS at all of these in run 55-56's start-up choice (e.g. 70B qkv 53.2 vs 35.1 us).
    ("bf16", 5120, 2048, 1): GemvConfig(16, 512, 1, 8, 3, False, load_ahead=True),  # qwen3-30b-a3b qkv: 8.0 us,   2637 GB/s  62%; cuBLAS F.linear 9.0 us
    ("bf16", 5120, 2048, 16): GemvConfig(64, 128, 1, 4, 4, True),  # qwen3-30b-a3b qkv: 9.1 us,   2326 GB/s  55%; cuBLAS F.linear 8.8 us
    ("bf16", 2048, 4096, 1): GemvConfig(32, 512, 5, 8, 3, False, load_ahead=True),  # qwen3-30b-a3b o: 7.7 us,   2180 GB/s  52%; cuBLAS F.linear 9.9 us
    ("bf16", 2048, 4096, 16): GemvConfig(64, 256, 5, 4, 4, True),  # qwen3-30b-a3b o: 8.0 us,   2122 GB/s  50%; cuBLAS F.linear 9.9 us
    ("bf16", 151936, 2048, 1): GemvConfig(32, 512, 1, 8, 3, False, load_ahead=True),  # qwen3-30b-a3b lm_head: 140.7 us,   4425 GB/s 105%; cuBLAS F.linear 145.2 us
    ("bf16", 151936, 2048, 16): GemvConfig(64, 256, 1, 4, 3, True),  # qwen3-30b-a3b lm_head: 145.9 us,   4298 GB/s 102%; cuBLAS F.linear 149.5 us
    ("bf16", 5120, 8192, 1): GemvConfig(16, 256, 2, 8, 3, False, load_ahead=True),  # 70b-tp2 qkv: 24.4 us,   3434 GB/s  81%; cuBLAS F.linear 26.5 us
    ("bf16", 5120, 8192, 16): GemvConfig(64, 128, 2, 4, 4, True),  # 70b-tp2 qkv: 26.4 us,   3191 GB/s  76%; cuBLAS F.linear 26.9 us
    ("bf16", 8192, 4096, 1): GemvConfig(32, 512, 1, 8, 3, False, load_ahead=True),  # 70b-tp2 o: 18.5 us,   3634 GB/s  86%; cuBLAS F.linear 20.0 us
    ("bf16", 8192, 4096, 16): GemvConfig(64, 256, 1, 4, 4, True),  # 70b-tp2 o: 19.1 us,   3530 GB/s  84%; cuBLAS F.linear 20.0 us
    ("bf16", 28672, 8192, 1): GemvConfig(64, 256, 1, 8, 3, False, load_ahead=True),  # 70b-tp2 gate_up: 108.3 us,   4339 GB/s 103%; cuBLAS F.linear 116.3 us
    ("bf16", 28672, 8192, 16): GemvConfig(64, 256, 1, 4, 3, True),  # 70b-tp2 gate_up: 110.1 us,   4277 GB/s 101%; cuBLAS F.linear 117.9 us
    ("bf16", 8192, 14336, 1): GemvConfig(32, 512, 1, 8, 3, False, load_ahead=True),  # 70b-tp2 down: 55.5 us,   4229 GB/s 100%; cuBLAS F.linear 60.2 us
    ("bf16", 8192, 14336, 16): GemvConfig(64, 256, 1, 4, 4, True),  # 70b-tp2 down: 56.4 us,   4181 GB/s  99%; cuBLAS F.linear 60.6 us
    ("bf16", 64128, 8192, 1): GemvConfig(32, 256, 1, 4, 3, False, load_ahead=True),  # 70b-tp2 lm_head: 232.4 us,   4521 GB/s 107%; cuBLAS F.linear 251.8 us
    ("bf16", 64128, 8192, 16): GemvConfig(64, 256, 1, 4, 3, True),  # 70b-tp2 lm_head: 237.5 us,   4434 GB/s 105%; cuBLAS F.linear 253.8 us
    ("bf16", 3072, 4096, 1): GemvConfig(16, 512, 2, 8, 3, False, load_ahead=True),  # 8b-tp2 qkv: 9.7 us,   2588 GB/s  61%; cuBLAS F.linear 12.3 us
    ("bf16", 3072, 4096, 16): GemvConfig(64, 256, 6, 4, 3, True),  # 8b-tp2 qkv: 11.3 us,   2244 GB/s  53%; cuBLAS F.linear 12.4 us
    ("bf16", 4096, 2048, 1): GemvConfig(32, 512, 3, 8, 3, False, load_ahead=True),  # 8b-tp2 o: 7.6 us,   2206 GB/s  52%; cuBLAS F.linear 7.7 us
    ("bf16", 4096, 2048, 16): GemvConfig(32, 256, 1, 4, 4, True),  # 8b-tp2 o: 7.8 us,   2179 GB/s  52%; cuBLAS F.linear 7.8 us
    ("bf16", 14336, 4096, 1): GemvConfig(32, 512, 1, 8, 3, False, load_ahead=True),  # 8b-tp2 gate_up: 31.2 us,   3760 GB/s  89%; cuBLAS F.linear 33.1 us
    ("bf16", 14336, 4096, 16): GemvConfig(64, 256, 1, 4, 4, True),  # 8b-tp2 gate_up: 32.2 us,   3662 GB/s  87%; cuBLAS F.linear 33.3 us
    ("bf16", 4096, 7168, 1): GemvConfig(32, 512, 2, 8, 3, False, load_ahead=True),  # 8b-tp2 down: 18.0 us,   3256 GB/s  77%; cuBLAS F.linear 20.2 us
    ("bf16", 4096, 7168, 16): GemvConfig(32, 256, 1, 4, 4, True),  # 8b-tp2 down: 19.9 us,   2972 GB/s  70%; cuBLAS F.linear 20.8 us
    ("bf16", 64128, 4096, 1): GemvConfig(64, 256, 1, 8, 3, False, load_ahead=True),  # 8b-tp2 lm_head: 119.5 us,   4399 GB/s 104%; cuBLAS F.linear 127.8 us
    ("bf16", 64128, 4096, 16): GemvConfig(64, 256, 1, 4, 3, True),  # 8b-tp2 lm_head: 122.0 us,   4324 GB/s 102%; cuBLAS F.linear 128.8 us
}

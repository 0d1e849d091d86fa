"""Tuned launch configurations of the fused MoE's decode kernels (moe.py: gate_up_act, down_reduce).

Key: (hidden, intermediate, top_k, tokens bucket): the expert shape and the batch rounded up to a power of two
(1, 2, 4, 8, 16). Shapes missing here take moe.default_decode_config. Paste the lines that `python -m
loadtest.bench_kernels --moe-sweep` prints under "winners" (measured on one GPU kind: note which, below).
"""

from __future__ import annotations

from .moe import DecodeConfig, GemvTiles

# Measured on: one NVIDIA H200 (132 SMs, copy 4,210 GB/s), 2026-11-24, session 12's sweeps (gate_up_act's and
# down_reduce's tiles, each with and without load_ahead), the Qwen3-30B-A3B expert shape; the machine.
# Session 8's H100 rows (run 49) measured on this H200 in the same session: 25.7 us at T = 1, 77.3 us at T = 4.
# Comments: the layer's experts (both kernels) per layer, GB/s of the experts hit, share of the copy bandwidth; the
# default tiles' time beside it.
TUNED: dict[tuple[int, int, int, int], DecodeConfig] = {
    (2048, 768, 8, 1): DecodeConfig(GemvTiles(8, 256, 4, True), GemvTiles(16, 256, 2, True)),  # 25.5 us,   2979 GB/s  71%; default 28.4 us
    (2048, 768, 8, 2): DecodeConfig(GemvTiles(4, 256, 2, True), GemvTiles(128, 128, 8, False)),  # 40.9 us,   3529 GB/s  84%; default 49.0 us
    (2048, 768, 8, 4): DecodeConfig(GemvTiles(8, 128, 2, True), GemvTiles(128, 64, 4, False)),  # 73.3 us,   3791 GB/s  90%; default 81.7 us
    (2048, 768, 8, 8): DecodeConfig(GemvTiles(4, 256, 2, True), GemvTiles(128, 64, 4, False)),  # 127.5 us,   3890 GB/s  92%; default 146.0 us
    (2048, 768, 8, 16): DecodeConfig(GemvTiles(8, 128, 2, True), GemvTiles(32, 64, 4, False)),  # 217.1 us,   3606 GB/s  85%; default 257.2 us
}

# Int4 experts (GPTQ / AWQ / compressed-tensors W4A16, groups of 128): K tiles in inputs (each step's sub-tiles
# stay within a group). Shapes missing here take the bf16 row above with moe._int4_block_k.
# Measured on: one NVIDIA H100 80GB HBM3 (copy 3,023 GB/s), 2026-12-07, run 166 (`bench_kernels --moe-sweep --int4`,
# random int4 experts, asymmetric groups of 128) on session 31's final kernels; T = 16 is run 163's row (run 166's
# winner, 123.1 us, measured slower than that row's 119.9 in the same sweep). Comments: both kernels per layer,
# GB/s of the int4 bytes (words, scales, zero points) of the experts hit, share of the copy bandwidth; the tiles
# the table held before beside it. Same call, bf16 experts at their tuned tiles: 32.2 us at T = 1, 98.8 at T = 4.
TUNED_INT4: dict[tuple[int, int, int, int], DecodeConfig] = {
    (2048, 768, 8, 1): DecodeConfig(GemvTiles(8, 256, 2, True, False), GemvTiles(32, 256, 2, False, True)),  # 18.8 us,   1097 GB/s  36%; table before 19.6 us
    (2048, 768, 8, 2): DecodeConfig(GemvTiles(8, 256, 1, True, False), GemvTiles(16, 256, 1, True, True)),  # 25.9 us,   1522 GB/s  50%; table before 29.4 us
    (2048, 768, 8, 4): DecodeConfig(GemvTiles(8, 256, 1, True, False), GemvTiles(64, 256, 4, True, True)),  # 43.5 us,   1656 GB/s  55%; table before 43.7 us
    (2048, 768, 8, 8): DecodeConfig(GemvTiles(32, 256, 4, True, True), GemvTiles(32, 128, 2, False, True)),  # 71.0 us,   1804 GB/s  60%; table before 79.2 us
    (2048, 768, 8, 16): DecodeConfig(GemvTiles(8, 256, 1, False, True), GemvTiles(64, 128, 4, False, True)),  # 140.7 us,   1472 GB/s  50%; default 192.4 us
}

"""Tuned launch configurations of the fused MoE's decode kernels (moe.py: gate_up_act, down_reduce).

Key: (hidden, intermediate, top_k, tokens bucket): the expert shape and the batch rounded up to a power of two
(1, 2, 4, 8, 16). Shapes missing here take moe.default_decode_config. Paste the lines that `python -m
loadtest.bench_kernels --moe-sweep` prints under "winners" (measured on one GPU kind: note which, below).
"""

from __future__ import annotations

from .moe import DecodeConfig, GemvTiles

# Measured on: one NVIDIA H100 80GB HBM3 (132 SMs, copy 2,985 GB/s), 2026-11-24, session 8's sweep (run 49); the
# Qwen3-30B-A3B expert shape. Comments: the layer's experts (both kernels) per layer, GB/s of the experts hit,
# share of the copy bandwidth; the default tiles' time beside it.
TUNED: dict[tuple[int, int, int, int], DecodeConfig] = {
    (2048, 768, 8, 1): DecodeConfig(GemvTiles(8, 128, 8), GemvTiles(32, 128, 8)),  # 33.2 us,   2289 GB/s  77%; default 34.8 us
    (2048, 768, 8, 2): DecodeConfig(GemvTiles(16, 512, 4), GemvTiles(128, 128, 8)),  # 57.2 us,   2525 GB/s  85%; default 60.9 us
    (2048, 768, 8, 4): DecodeConfig(GemvTiles(16, 256, 2), GemvTiles(64, 128, 2)),  # 103.0 us,   2697 GB/s  90%; default 105.9 us
    (2048, 768, 8, 8): DecodeConfig(GemvTiles(16, 256, 2), GemvTiles(32, 128, 8)),  # 177.8 us,   2789 GB/s  93%; default 185.8 us
    (2048, 768, 8, 16): DecodeConfig(GemvTiles(16, 256, 2), GemvTiles(32, 128, 8)),  # 286.0 us,   2737 GB/s  92%; default 308.0 us
}

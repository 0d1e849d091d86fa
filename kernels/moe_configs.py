"""Tuned launch configurations of the fused MoE's decode kernels (moe.py: gate_up_act, down_reduce).

Key: (hidden, intermediate, top_k, tokens bucket): the expert shape and the batch rounded up to a power of two
(1, 2, 4, 8, 16). Shapes missing here take moe.default_decode_config. Paste the lines that `python -m
loadtest.bench_kernels --moe-sweep` prints under "winners" (measured on one GPU kind: note which, below).
"""

from __future__ import annotations

from .moe import DecodeConfig, GemvTiles  # noqa: F401  (the table's lines name both)

# Not measured yet: empty until the first --moe-sweep on a GPU.
TUNED: dict[tuple[int, int, int, int], DecodeConfig] = {}

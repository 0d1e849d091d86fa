"""Tuned launch configurations of the decode GEMV (quant_gemv.py), per weight format and shape.

Key: (format, N, K, M bucket): format bf16 / fp16 / fp32 / fp8 (dense weights) or int4 (group size 128 unless a
tile's block_k is cut to the group); M bucket 1 (M == 1, the FMA path unless dot=True) or 16 (M of 2..16, tl.dot).
Shapes missing here take quant_gemv.default_config. Paste the lines that `python -m loadtest.bench_kernels
--gemv-sweep` prints under "winners" (measured on one GPU kind: note which, below).
"""

from __future__ import annotations

from .quant_gemv import GemvConfig

# Measured on: (none yet; the defaults apply)
TUNED: dict[tuple[str, int, int, int], GemvConfig] = {
}

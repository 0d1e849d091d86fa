"""The CUDA side of the quantized linear layers: one entry per format, each picking its kernel by shape.

    int_weight_matmul  4-bit: quant_int4 (split-K GEMV for M <= 16, dequantizing GEMM above); other widths have
                       no kernel (asyncengine rejects them on CUDA at start-up)
    fp8_linear         quant_fp8: per-token quantization + torch._scaled_mm (per-tensor form when it applies)
Same signatures as kernels/quant_reference.py.
"""

from __future__ import annotations

from .quant_fp8 import fp8_linear
from .quant_int4 import int_weight_matmul

__all__ = ["fp8_linear", "int_weight_matmul"]

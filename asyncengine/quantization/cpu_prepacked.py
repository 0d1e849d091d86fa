"""Weights laid out for the CPU's GEMM (issue 17).

`F.linear(x, W)` with W stored [N, K] row-major asks the BLAS for x @ W^T; with the same W stored column-major
(the [K, N] matrix W^T contiguous, W a transposed view of it) the BLAS reads W^T directly. On this project's CPU
machines (AMD EPYC, AVX2, torch's MKL) the second is faster at decode sizes and the same at prefill sizes, and the
results are bit-identical (the same products summed in the same order): measured at 64 rows x (256 -> 512, 1408,
256; 704 -> 256; 256 -> 8192) 1.03-1.04x for the layers and 1.14x for an LM head of 8,192 rows.

The weight keeps its logical shape [N, K], so loaders, state dicts and every reader see the same tensor; only the
strides change. oneDNN's packed format (`torch.ops.mkldnn._linear_pointwise`) measured slower on these shapes
(0.82-0.99x) except the LM head (1.31x), and not bit-identical; MKL's packed sgemm (`torch.ops.mkl._mkl_linear`)
was no faster than the transposed layout except the LM head (1.18x): neither is used.
"""

from __future__ import annotations

import torch


def use_cpu_gemm_layout(weight: torch.Tensor) -> None:
    """Re-store a 2-D CPU floating-point weight [N, K] column-major, in place (same values, same shape);
    anything else is left as it is. Its old storage is freed once nothing else refers to it."""
    if weight.device.type != "cpu" or weight.dim() != 2 or not weight.is_floating_point():
        return
    if weight.t().is_contiguous():  # already column-major
        return
    weight.data = weight.data.t().contiguous().t()


def is_cpu_gemm_layout(weight: torch.Tensor) -> bool:
    return weight.dim() == 2 and weight.t().is_contiguous()

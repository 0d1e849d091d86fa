"""FP8 (e4m3) activation quantization per token, and the W8A8 product through torch._scaled_mm.

`quantize_per_token`: one program per row of x [M, K]: amax over the row, scale = amax / 448 (never below a
floor, so a zero row stays zero), x / scale rounded to e4m3. `fp8_linear` then multiplies with cuBLASLt's FP8
GEMM (torch._scaled_mm, row-wise scales: x's per token [M, 1], the weight's per output channel [1, N]); with a
static per-tensor input scale and one weight scale for the whole tensor it takes the per-tensor form, which the
issue measured at 2.36 ms against 3.98 ms for bf16 on the 8B decode chain (row-wise: 4.06 ms).
`fp8_gemm_linear`: the same product with our own W8A8 GEMM (fp8_gemm.py) in place of `_scaled_mm`, for the
decode-sized batches where it measures faster (quant_linear.fp8_gemm_max_m).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .fp8_gemm import fp8_gemm
from .pdl import enabled as pdl_enabled, wait_for_prior_grids
from .quant_reference import FP8_DTYPE, FP8_MAX, _MIN_SCALE


@triton.jit
def _quantize_per_token_kernel(
    out_ptr,  # [M, K] float8_e4m3fn
    scale_ptr,  # [M] float32
    x_ptr,  # [M, K]
    stride_x,
    K,
    min_scale,
    FP8_MAX_VALUE: tl.constexpr,
    BLOCK_K: tl.constexpr,  # next power of two >= K
    USE_PDL: tl.constexpr,  # launched with PDL (kernels/pdl.py)
):
    wait_for_prior_grids(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_K)
    mask = cols < K
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(x), axis=0) / FP8_MAX_VALUE, min_scale)
    q = tl.clamp(x / scale, -FP8_MAX_VALUE, FP8_MAX_VALUE)
    tl.store(out_ptr + row * K + cols, q.to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(scale_ptr + row, scale)


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (x_fp8 [M, K] contiguous, scale [M, 1] float32); as quant_reference.quantize_fp8(x, dim=-1)."""
    m, k = x.shape
    out = torch.empty(m, k, device=x.device, dtype=FP8_DTYPE)
    scale = torch.empty(m, 1, device=x.device, dtype=torch.float32)
    pdl = pdl_enabled(x.device)
    block_k = triton.next_power_of_2(k)
    _quantize_per_token_kernel[(m,)](out, scale, x, x.stride(0), k, _MIN_SCALE, FP8_MAX_VALUE=FP8_MAX,
                                     BLOCK_K=block_k, USE_PDL=pdl, launch_pdl=pdl, num_warps=_warps_for(block_k))
    return out, scale


def _warps_for(block_k: int) -> int:
    """Warps per row: about 8 elements a thread, 4 to 16 warps. A decode batch has few rows, so each row's program
    is alone on its SM and its latency is the kernel's: run 92 (one H100) timed the 14336-wide rows of the down
    projection's input at 5-7 us with 4 warps (112 elements a thread)."""
    return max(4, min(16, block_k // 256))


def _quantize_static(x: torch.Tensor, input_scale: torch.Tensor) -> torch.Tensor:
    return (x.float() / input_scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def _quantize_input(x2: torch.Tensor, input_scale: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """A linear's input [M, K] in e4m3 and its scale: per token ([M, 1]) when input_scale is None, else the static
    one ([] float32)."""
    if input_scale is None:
        return quantize_per_token(x2)
    return _quantize_static(x2, input_scale), input_scale.float()


def fp8_linear(x: torch.Tensor, w_fp8: torch.Tensor, w_scale: torch.Tensor, input_scale: Optional[torch.Tensor],
               bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Same contract as quant_reference.fp8_linear: x [M, K], w_fp8 [N, K], w_scale [N, 1] (or []), input_scale []
    (static) or None (dynamic per token) -> [M, N] in x's dtype."""
    x2 = x.reshape(-1, x.shape[-1])
    if input_scale is not None and w_scale.numel() == 1:
        out = torch._scaled_mm(_quantize_static(x2, input_scale), w_fp8.t(), scale_a=input_scale.reshape(()),
                               scale_b=w_scale.reshape(-1)[0].reshape(()), bias=bias, out_dtype=x.dtype)
    else:
        x8, x_scale = _quantize_input(x2, input_scale)
        if input_scale is not None:  # the row-wise form takes a scale per row
            x_scale = x_scale.reshape(1, 1).expand(x2.shape[0], 1)
        w_scale_row = w_scale.reshape(1, -1).expand(1, w_fp8.shape[0]).float().contiguous()
        out = torch._scaled_mm(x8, w_fp8.t(), scale_a=x_scale.contiguous(), scale_b=w_scale_row, bias=bias,
                               out_dtype=x.dtype)
    return out.reshape(*x.shape[:-1], w_fp8.shape[0])


def fp8_gemm_linear(x: torch.Tensor, w_fp8: torch.Tensor, w_scale: torch.Tensor, input_scale: Optional[torch.Tensor],
                    bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """fp8_linear's contract (x [M, K] with M <= fp8_gemm.MAX_M), the product by our W8A8 GEMM: x quantized per token
    (input_scale None) or with the static scale, then `fp8_gemm` with the weight's scales in its epilogue."""
    x2 = x.reshape(-1, x.shape[-1])
    x8, x_scale = _quantize_input(x2, input_scale)
    out = fp8_gemm(x8, x_scale, w_fp8, w_scale, x.dtype, bias)
    return out.reshape(*x.shape[:-1], w_fp8.shape[0])

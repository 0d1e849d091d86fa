"""FP8 (e4m3) activation quantization per token, and the W8A8 product through torch._scaled_mm.

`quantize_per_token`: one program per row of x [M, K]: amax over the row, scale = amax / 448 (never below a
floor, so a zero row stays zero), x / scale rounded to e4m3. `fp8_linear` then multiplies with cuBLASLt's FP8
GEMM (torch._scaled_mm, row-wise scales: x's per token [M, 1], the weight's per output channel [1, N]); with a
static per-tensor input scale and one weight scale for the whole tensor it takes the per-tensor form, which the
issue measured at 2.36 ms against 3.98 ms for bf16 on the 8B decode chain (row-wise: 4.06 ms).
`fp8_gemm_linear`: the same product with our own W8A8 GEMM (fp8_gemm.py) in place of `_scaled_mm`, for the
decode-sized batches where it measures faster (quant_linear.fp8_gemm_max_m).
`Fp8Activation`: a linear's input together with its per-token e4m3 copy, made by the kernel that produced the
input (fused_add_rms_norm, silu_and_mul with `fp8_copy=True`, via `store_fp8_row`), so that the product does not
launch a quantization of its own: on the 8B shape 3 of a layer's 4 launches go (host and GPU), of 128 a step.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .fp8_gemm import fp8_gemm
from .pdl import enabled as pdl_enabled, wait_for_prior_grids
from .quant_reference import FP8_DTYPE, FP8_MAX, _MIN_SCALE, Fp8Activation, check_fp8_group_scales, taken_fp8_copy


@triton.jit
def store_fp8_row(fp8_row_ptr, scale_row_ptr, x, cols, mask, min_scale, FP8_MAX_VALUE: tl.constexpr):
    """Quantizes one row x [BLOCK] float32 (zeros where ~mask) per token: scale = max(amax / 448, min_scale) at
    scale_row_ptr, clamp(x / scale) in e4m3 at fp8_row_ptr + cols. The one definition of the math, shared by
    `quantize_per_token` and the kernels that quantize the row they produce (`Fp8Activation`)."""
    scale = tl.maximum(tl.max(tl.abs(x), axis=0) / FP8_MAX_VALUE, min_scale)
    q = tl.clamp(x / scale, -FP8_MAX_VALUE, FP8_MAX_VALUE)
    tl.store(fp8_row_ptr + cols, q.to(fp8_row_ptr.dtype.element_ty), mask=mask)
    tl.store(scale_row_ptr, scale)


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
    store_fp8_row(out_ptr + row * K, scale_ptr + row, x, cols, mask, min_scale, FP8_MAX_VALUE)


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (x_fp8 [M, K] contiguous, scale [M, 1] float32); as quant_reference.quantize_fp8(x, dim=-1)."""
    m, k = x.shape
    out, scale = fp8_row_buffers(m, k, x.device)
    pdl = pdl_enabled(x.device)
    block_k = triton.next_power_of_2(k)
    _quantize_per_token_kernel[(m,)](out, scale, x, x.stride(0), k, _MIN_SCALE, FP8_MAX_VALUE=FP8_MAX,
                                     BLOCK_K=block_k, USE_PDL=pdl, launch_pdl=pdl, num_warps=fp8_warps(block_k))
    return out, scale


def fp8_row_buffers(m: int, k: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Empty (x_fp8 [m, k] e4m3, scale [m, 1] float32) for `store_fp8_row` to fill."""
    return (torch.empty(m, k, device=device, dtype=FP8_DTYPE),
            torch.empty(m, 1, device=device, dtype=torch.float32))


def fp8_warps(block_k: int) -> int:
    """Warps per row: about 8 elements a thread, 4 to 16 warps. A decode batch has few rows, so each row's program
    is alone on its SM and its latency is the kernel's: run 92 (one H100) timed the 14336-wide rows of the down
    projection's input at 5-7 us with 4 warps (112 elements a thread)."""
    return max(4, min(16, block_k // 256))


def _quantize_static(x: torch.Tensor, input_scale: torch.Tensor) -> torch.Tensor:
    return (x.float() / input_scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def _quantize_input(x2: torch.Tensor, input_scale: Optional[torch.Tensor],
                    quantized: Optional[Fp8Activation] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """A linear's input [M, K] in e4m3 and its scale: per token ([M, 1]) when input_scale is None, else the static
    one ([] float32). `quantized`: x2's per-token copy made by the kernel before (taken as is)."""
    if quantized is not None:
        return taken_fp8_copy(quantized, input_scale)
    if input_scale is None:
        return quantize_per_token(x2)
    return _quantize_static(x2, input_scale), input_scale.float()


def fp8_linear(x: torch.Tensor, w_fp8: torch.Tensor, w_scale: torch.Tensor, input_scale: Optional[torch.Tensor],
               bias: Optional[torch.Tensor] = None, quantized: Optional[Fp8Activation] = None) -> torch.Tensor:
    """Same contract as quant_reference.fp8_linear: x [M, K], w_fp8 [N, K], w_scale [N, 1] (or []), input_scale []
    (static) or None (dynamic per token) -> [M, N] in x's dtype. quantized: x's per-token e4m3 copy, when the
    kernel that made x made it too (then no quantization is launched here)."""
    x2 = x.reshape(-1, x.shape[-1])
    if input_scale is not None and w_scale.numel() == 1:
        out = torch._scaled_mm(_quantize_static(x2, input_scale), w_fp8.t(), scale_a=input_scale.reshape(()),
                               scale_b=w_scale.reshape(-1)[0].reshape(()), bias=bias, out_dtype=x.dtype)
    else:
        x8, x_scale = _quantize_input(x2, input_scale, quantized)
        if input_scale is not None:  # the row-wise form takes a scale per row
            x_scale = x_scale.reshape(1, 1).expand(x2.shape[0], 1)
        w_scale_row = w_scale.reshape(1, -1).expand(1, w_fp8.shape[0]).float().contiguous()
        out = torch._scaled_mm(x8, w_fp8.t(), scale_a=x_scale.contiguous(), scale_b=w_scale_row, bias=bias,
                               out_dtype=x.dtype)
    return out.reshape(*x.shape[:-1], w_fp8.shape[0])


def fp8_gemm_linear(x: torch.Tensor, w_fp8: torch.Tensor, w_scale: torch.Tensor, input_scale: Optional[torch.Tensor],
                    bias: Optional[torch.Tensor] = None, quantized: Optional[Fp8Activation] = None) -> torch.Tensor:
    """fp8_linear's contract (x [M, K] with M <= fp8_gemm.MAX_M), the product by our W8A8 GEMM: x quantized per token
    (input_scale None; or `quantized`, its copy made beforehand) or with the static scale, then `fp8_gemm` with the
    weight's scales in its epilogue."""
    x2 = x.reshape(-1, x.shape[-1])
    x8, x_scale = _quantize_input(x2, input_scale, quantized)
    out = fp8_gemm(x8, x_scale, w_fp8, w_scale, x.dtype, bias)
    return out.reshape(*x.shape[:-1], w_fp8.shape[0])


# -- weight-only FP8 with group scales (block-wise checkpoints) above the decode GEMV's batch sizes ---------------

@triton.jit
def _dequantize_groups_kernel(out_ptr, w_ptr, scale_ptr, N, K, group_size, BLOCK_N: tl.constexpr,
                              BLOCK_K: tl.constexpr):
    """out[n, k] = w[n, k] * scale[k // group_size, n] for one [BLOCK_N, BLOCK_K] tile of w [N, K] (row-major,
    as out), rounded once to out's dtype."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = (rows < N)[:, None] & (ks < K)[None, :]
    offsets = rows[:, None].to(tl.int64) * K + ks[None, :]
    w = tl.load(w_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    scale = tl.load(scale_ptr + (ks // group_size)[None, :] * N + rows[:, None], mask=mask, other=0.0)
    tl.store(out_ptr + offsets, (w * scale).to(out_ptr.dtype.element_ty), mask=mask)


def dequantize_groups(w_fp8: torch.Tensor, group_scales: torch.Tensor, group_size: int,
                      dtype: torch.dtype) -> torch.Tensor:
    """quant_reference.dequantize_fp8_groups on the GPU: w_fp8 [N, K] (contiguous) with group scales [G, N] float32
    -> a new [N, K] tensor in dtype."""
    n, k = w_fp8.shape
    if not w_fp8.is_contiguous():
        raise ValueError("FP8 dequantize: the weight must be contiguous")
    check_fp8_group_scales(w_fp8, group_scales, group_size, "FP8 dequantize")
    out = torch.empty((n, k), device=w_fp8.device, dtype=dtype)
    block_n, block_k = 32, 128
    _dequantize_groups_kernel[(triton.cdiv(n, block_n), triton.cdiv(k, block_k))](
        out, w_fp8, group_scales.float().contiguous(), n, k, group_size, BLOCK_N=block_n, BLOCK_K=block_k)
    return out


def fp8_group_linear(x: torch.Tensor, w_fp8: torch.Tensor, group_scales: torch.Tensor, group_size: int,
                     bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Same contract as quant_reference.fp8_group_linear (weight-only, x not quantized): the weight dequantized to
    x's dtype for this call (`dequantize_groups`), then the library's GEMM. The path above the decode GEMV's batch
    sizes (prefill): it writes and reads the weight once more in x's dtype, which block-wise W8A8 (activations
    quantized per group of inputs, FP8 tensor cores) would not."""
    w = dequantize_groups(w_fp8, group_scales, group_size, x.dtype)
    return torch.nn.functional.linear(x, w, bias)

"""RMSNorm kernels: one program normalises one row of [T, H]; math in float32.

Rounding follows `reference.rms_norm` step by step: the normalised row is rounded to x's dtype before the weight
multiplies it, and the product is rounded to the promoted dtype of (weight, x).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _normalize_row(x_raw, w_ptr, cols, col_mask, H, eps):
    """x_raw: [BLOCK_H] in x's dtype (zeros past H) -> weight * round_to_x_dtype(x * rsqrt(mean(x^2) + eps)), fp32."""
    x = x_raw.to(tl.float32)
    variance = tl.sum(x * x, axis=0) / H
    normed = (x * tl.rsqrt(variance + eps)).to(x_raw.dtype).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)  # [BLOCK_H]
    return normed * w


@triton.jit
def _rms_norm_kernel(
    out_ptr,  # [T, H]
    x_ptr,  # [T, H]
    w_ptr,  # [H]
    stride_out,
    stride_x,
    H,
    eps,
    BLOCK_H: tl.constexpr,  # next power of two >= H
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_H)
    col_mask = cols < H
    x = tl.load(x_ptr + row * stride_x + cols, mask=col_mask, other=0.0)
    y = _normalize_row(x, w_ptr, cols, col_mask, H, eps)
    tl.store(out_ptr + row * stride_out + cols, y.to(out_ptr.dtype.element_ty), mask=col_mask)


@triton.jit
def _fused_add_rms_norm_kernel(
    out_ptr,  # [T, H]
    x_ptr,  # [T, H]
    res_ptr,  # [T, H], overwritten with x + residual
    w_ptr,  # [H]
    stride_out,
    stride_x,
    stride_res,
    H,
    eps,
    BLOCK_H: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_H)
    col_mask = cols < H
    x = tl.load(x_ptr + row * stride_x + cols, mask=col_mask, other=0.0).to(tl.float32)
    res = tl.load(res_ptr + row * stride_res + cols, mask=col_mask, other=0.0)
    # The new residual is rounded to its dtype first, and normalised from that rounded value (as the reference).
    new_res = (x + res.to(tl.float32)).to(res.dtype)
    tl.store(res_ptr + row * stride_res + cols, new_res, mask=col_mask)
    y = _normalize_row(new_res, w_ptr, cols, col_mask, H, eps)
    tl.store(out_ptr + row * stride_out + cols, y.to(out_ptr.dtype.element_ty), mask=col_mask)


def _launch_config(hidden: int) -> tuple[int, int]:
    """(BLOCK_H, num_warps) for one row of `hidden` elements."""
    block = triton.next_power_of_2(hidden)
    return block, min(16, max(1, block // 512))


def _check(x: torch.Tensor, weight: torch.Tensor) -> None:
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"x must be [T, H] with contiguous rows, got shape {tuple(x.shape)} strides {x.stride()}")
    if weight.shape != (x.shape[1],) or weight.stride(0) != 1:
        raise ValueError(f"weight must be a contiguous [{x.shape[1]}], got {tuple(weight.shape)}")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [T, H] (rows contiguous), weight: [H] -> new [T, H] in promote(x, weight) dtype."""
    _check(x, weight)
    out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    if x.shape[0] == 0:
        return out
    block, warps = _launch_config(x.shape[1])
    _rms_norm_kernel[(x.shape[0],)](
        out, x, weight, out.stride(0), x.stride(0), x.shape[1], eps, BLOCK_H=block, num_warps=warps
    )
    return out


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """residual <- x + residual (IN PLACE); returns (rms_norm(residual), residual).

    x, residual: [T, H] of one dtype, rows contiguous; weight: [H]. The returned residual is the argument itself.
    """
    _check(x, weight)
    if residual.shape != x.shape or residual.dtype != x.dtype or residual.stride(1) != 1:
        raise ValueError("residual must match x in shape and dtype, with contiguous rows")
    out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    if x.shape[0] == 0:
        return out, residual
    block, warps = _launch_config(x.shape[1])
    _fused_add_rms_norm_kernel[(x.shape[0],)](
        out,
        x,
        residual,
        weight,
        out.stride(0),
        x.stride(0),
        residual.stride(0),
        x.shape[1],
        eps,
        BLOCK_H=block,
        num_warps=warps,
    )
    return out, residual

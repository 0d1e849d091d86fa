"""RMSNorm kernels; math in float32. `rms_norm` normalises ROWS rows per program (many rows for short ones, such
as Qwen3's per-head q/k norms over [T, heads, 128], read in place from the strided QKV output), one row per
program for hidden-sized rows; `fused_add_rms_norm` one row per program, and with `fp8_copy` also the row's
per-token e4m3 copy for the FP8 linear it feeds (quant_fp8.Fp8Activation). The kernel compiled with the copy gives
a few elements a rounding or two away from the kernel compiled without it (run 109, H200: 4.6e-6 of the elements;
each kernel is deterministic; quantizing the stored row read back did not change it): the copy is always exactly
the per-token quantization of the output returned beside it.

Rounding follows `reference.rms_norm` step by step: the normalised row is rounded to x's dtype before the weight
multiplies it, and the product is rounded to the promoted dtype of (weight, x).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .pdl import enabled as pdl_enabled, wait_for_prior_grids_early
from .quant_fp8 import Fp8Activation, fp8_row_buffers, store_fp8_row
from .quant_reference import FP8_MAX, _MIN_SCALE


@triton.jit
def _load_weight(w_ptr, cols, col_mask):
    """The norm's weight [BLOCK_H] as float32 (zeros past H). A weight no kernel writes: a PDL kernel loads it
    before its wait (kernels/pdl.py rule 1), off the critical path; after the residual's store it could not be
    hoisted (the compiler cannot tell the two apart) and cost a dependent round trip."""
    return tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)


@triton.jit
def _normalize_row(x_raw, w, H, eps):
    """x_raw: [BLOCK_H] or [ROWS, BLOCK_H] in x's dtype (zeros past H), w: `_load_weight`'s -> each row's
    weight * round_to_x_dtype(x * rsqrt(mean(x^2) + eps)), float32, x_raw's shape. The one definition of the
    math: every kernel that RMS-normalises calls it, so they agree bit for bit on the same tile."""
    x = x_raw.to(tl.float32)
    variance = tl.sum(x * x, axis=-1, keep_dims=True) / H  # [1] or [ROWS, 1]
    normed = (x * tl.rsqrt(variance + eps)).to(x_raw.dtype).to(tl.float32)
    return normed * w


@triton.jit
def normalize_heads_in_place(
    x_ptr,  # [num_heads, head_dim] of one token, heads contiguous
    w_ptr,  # [head_dim]
    num_heads,
    head_dim,  # a runtime int, as `rms_norm` passes it (a constexpr would compile the mean's division otherwise)
    eps,
    ROWS: tl.constexpr,  # rows per tile: `head_norm_tile`'s, the tile `rms_norm` uses for rows of head_dim
    BLOCK_H: tl.constexpr,  # next power of two >= head_dim
):
    """RMS-normalises each head in place, leaving x as `rms_norm` would write it (weight of x's dtype). A float32
    sum's bits depend on the order of its additions, which the tile's layout fixes: the same tile shape and warps
    as `rms_norm` give the same order. Ends with a barrier, so the caller's threads may read what any stored."""
    cols = tl.arange(0, BLOCK_H)
    col_mask = cols < head_dim
    w = _load_weight(w_ptr, cols, col_mask)
    for start in range(0, num_heads, ROWS):
        rows = start + tl.arange(0, ROWS)
        mask = (rows < num_heads)[:, None] & col_mask[None, :]
        tile = x_ptr + rows[:, None] * head_dim + cols[None, :]  # [ROWS, BLOCK_H]
        y = _normalize_row(tl.load(tile, mask=mask, other=0.0), w, head_dim, eps)
        # In place: every thread's loads before any store (a thread must not read a twin's normalised value).
        tl.debug_barrier()
        tl.store(tile, y.to(x_ptr.dtype.element_ty), mask=mask)
    tl.debug_barrier()


@triton.jit
def _rms_norm_kernel(
    out_ptr,  # [R, H] contiguous, R = T * heads
    x_ptr,  # row r at (r // heads) * stride_token + (r % heads) * stride_head, H contiguous elements
    w_ptr,  # [H]
    num_rows,
    heads,
    stride_token,
    stride_head,
    H,
    eps,
    BLOCK_H: tl.constexpr,  # next power of two >= H
    ROWS: tl.constexpr,  # rows per program
    USE_PDL: tl.constexpr,  # launched with PDL (kernels/pdl.py)
):
    cols = tl.arange(0, BLOCK_H)
    w = _load_weight(w_ptr, cols, cols < H)
    wait_for_prior_grids_early(USE_PDL, True)  # kernels/pdl.py rule 3: the next kernel's prologue overlaps ours
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)  # [ROWS]
    mask = (rows < num_rows)[:, None] & (cols < H)[None, :]
    x_rows = (rows // heads) * stride_token + (rows % heads) * stride_head
    x_raw = tl.load(x_ptr + x_rows[:, None] + cols[None, :], mask=mask, other=0.0)  # [ROWS, BLOCK_H]
    y = _normalize_row(x_raw, w, H, eps)
    tl.store(out_ptr + rows[:, None] * H + cols[None, :], y.to(out_ptr.dtype.element_ty), mask=mask)


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
    fp8_ptr,  # [T, H] float8_e4m3fn contiguous: the output's per-token copy (QUANT)
    fp8_scale_ptr,  # [T] float32 (QUANT)
    min_scale,
    BLOCK_H: tl.constexpr,
    USE_PDL: tl.constexpr,  # launched with PDL (kernels/pdl.py)
    QUANT: tl.constexpr,  # also write the output row in e4m3 with its scale (quant_fp8.store_fp8_row)
    FP8_MAX_VALUE: tl.constexpr,
):
    cols = tl.arange(0, BLOCK_H)
    col_mask = cols < H
    w = _load_weight(w_ptr, cols, col_mask)
    # kernels/pdl.py rule 3: the next kernel's prologue (a GEMV's prefetch) overlaps ours; not with the FP8 copy,
    # which feeds a W8A8 GEMM that waits first: nothing of it to overlap (run 119)
    wait_for_prior_grids_early(USE_PDL, not QUANT)
    row = tl.program_id(0).to(tl.int64)
    x = tl.load(x_ptr + row * stride_x + cols, mask=col_mask, other=0.0).to(tl.float32)
    res = tl.load(res_ptr + row * stride_res + cols, mask=col_mask, other=0.0)
    # The new residual is rounded to its dtype first, and normalised from that rounded value (as the reference).
    new_res = (x + res.to(tl.float32)).to(res.dtype)
    tl.store(res_ptr + row * stride_res + cols, new_res, mask=col_mask)
    y = _normalize_row(new_res, w, H, eps).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * stride_out + cols, y, mask=col_mask)
    if QUANT:  # the stored (rounded) values, as quantize_per_token would read them back
        store_fp8_row(fp8_ptr + row * H, fp8_scale_ptr + row, y.to(tl.float32), cols, col_mask, min_scale,
                      FP8_MAX_VALUE)


def _launch_config(hidden: int) -> tuple[int, int]:
    """(BLOCK_H, num_warps) for one row of `hidden` elements."""
    block = triton.next_power_of_2(hidden)
    return block, min(16, max(1, block // 512))


def _check(x: torch.Tensor, weight: torch.Tensor, dims: tuple[int, ...] = (2,)) -> None:
    if x.dim() not in dims or x.stride(-1) != 1:
        raise ValueError(f"x must be {' or '.join(('[T, H]', '[T, heads, H]')[:len(dims)])} with contiguous rows, got "
                         f"shape {tuple(x.shape)} strides {x.stride()}")
    if weight.shape != (x.shape[-1],) or weight.stride(0) != 1:
        raise ValueError(f"weight must be a contiguous [{x.shape[-1]}], got {tuple(weight.shape)}")


def _rows_per_program(block: int) -> tuple[int, int]:
    """(ROWS, num_warps): short rows are batched so that a program reads ~2k elements; hidden-sized rows go one
    per program (the previous launch: a one-row program of 128 elements was launch-bound, 16% of a Qwen3
    embedding pass on an H100)."""
    if block >= 2048:
        return 1, min(16, block // 512)
    return 2048 // block, 4


def head_norm_tile(head_dim: int) -> tuple[int, int, int]:
    """(ROWS, BLOCK_H, num_warps) with which `rms_norm` normalises rows of head_dim: a kernel that normalises heads
    itself (`normalize_heads_in_place`) launches with these to give the same bits."""
    block = triton.next_power_of_2(head_dim)
    rows, warps = _rows_per_program(block)
    return rows, block, warps


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [T, H] or [T, heads, H] (each row of H contiguous, other strides free, e.g. a view into a QKV output),
    weight: [H] -> a new contiguous tensor of x's shape in promote(x, weight) dtype."""
    _check(x, weight, dims=(2, 3))
    out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    heads, stride_head = (x.shape[1], x.stride(1)) if x.dim() == 3 else (1, 0)
    num_rows = x.shape[0] * heads
    if num_rows == 0:
        return out
    block = triton.next_power_of_2(x.shape[-1])
    rows, warps = _rows_per_program(block)
    pdl = pdl_enabled(x.device)
    _rms_norm_kernel[(triton.cdiv(num_rows, rows),)](
        out, x, weight, num_rows, heads, x.stride(0), stride_head, x.shape[-1], eps, BLOCK_H=block, ROWS=rows,
        USE_PDL=pdl, num_warps=warps, launch_pdl=pdl,
    )
    return out


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                       fp8_copy: bool = False):
    """residual <- x + residual (IN PLACE); returns (rms_norm(residual), residual), or with fp8_copy
    (Fp8Activation(rms_norm(residual), its per-token e4m3 copy, scales), residual).

    x, residual: [T, H] of one dtype, rows contiguous; weight: [H]. The returned residual is the argument itself.
    """
    _check(x, weight)
    if residual.shape != x.shape or residual.dtype != x.dtype or residual.stride(1) != 1:
        raise ValueError("residual must match x in shape and dtype, with contiguous rows")
    tokens, hidden = x.shape
    out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    fp8, fp8_scale = fp8_row_buffers(tokens, hidden, x.device) if fp8_copy else (out, out)  # unused without
    if tokens:
        block, warps = _launch_config(hidden)
        pdl = pdl_enabled(x.device)
        _fused_add_rms_norm_kernel[(tokens,)](
            out, x, residual, weight, out.stride(0), x.stride(0), residual.stride(0), hidden, eps, fp8, fp8_scale,
            _MIN_SCALE, BLOCK_H=block, USE_PDL=pdl, QUANT=fp8_copy, FP8_MAX_VALUE=FP8_MAX, num_warps=warps,
            launch_pdl=pdl,
        )
    return (Fp8Activation(out, fp8, fp8_scale) if fp8_copy else out), residual

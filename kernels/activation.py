"""SiLU-and-multiply, the activation of gated MLPs: [T, 2I] laid out as [gate | up] -> silu(gate) * up, [T, I].

Rounding follows `reference.silu_and_mul`: silu(gate) is rounded to x's dtype before it multiplies `up`.
With `fp8_copy` a program takes a whole row and also writes its per-token e4m3 copy for the FP8 linear it feeds
(the down projection; quant_fp8.Fp8Activation).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .pdl import enabled as pdl_enabled, wait_for_prior_grids_early
from .quant_fp8 import Fp8Activation, fp8_row_buffers, fp8_warps, store_fp8_row
from .quant_reference import FP8_MAX, _MIN_SCALE

BLOCK_I = 1024  # columns per program


@triton.jit
def _silu_and_mul_kernel(
    out_ptr,  # [T, I]
    x_ptr,  # [T, 2I] = [gate | up]
    stride_out,
    stride_x,
    I,
    fp8_ptr,  # [T, I] float8_e4m3fn contiguous: the output's per-token copy (QUANT)
    fp8_scale_ptr,  # [T] float32 (QUANT)
    min_scale,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,  # launched with PDL (kernels/pdl.py)
    QUANT: tl.constexpr,  # also write the row in e4m3 with its scale; then BLOCK >= I (one program a row)
    FP8_MAX_VALUE: tl.constexpr,
):
    # kernels/pdl.py rule 3: the next kernel's prologue (a GEMV's prefetch) overlaps ours; not with the FP8 copy,
    # which feeds a W8A8 GEMM that waits first: nothing of it to overlap (run 119)
    wait_for_prior_grids_early(USE_PDL, not QUANT)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < I
    gate_raw = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x + I + cols, mask=mask, other=0.0).to(tl.float32)
    gate = gate_raw.to(tl.float32)
    silu = (gate / (1.0 + tl.exp(-gate))).to(gate_raw.dtype).to(tl.float32)
    y = (silu * up).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * stride_out + cols, y, mask=mask)
    if QUANT:  # the stored (rounded) values, as quantize_per_token would read them back
        store_fp8_row(fp8_ptr + row * I, fp8_scale_ptr + row, y.to(tl.float32), cols, mask, min_scale, FP8_MAX_VALUE)


def silu_and_mul(x: torch.Tensor, fp8_copy: bool = False):
    """x: [T, 2I] (rows contiguous) -> new [T, I] in x's dtype; with fp8_copy, Fp8Activation of it (its per-token
    e4m3 copy and scales made in the same kernel)."""
    if x.dim() != 2 or x.shape[1] % 2 or x.stride(1) != 1:
        raise ValueError(f"x must be [T, 2I] with contiguous rows, got {tuple(x.shape)} strides {x.stride()}")
    tokens, inter = x.shape[0], x.shape[1] // 2
    out = torch.empty((tokens, inter), dtype=x.dtype, device=x.device)
    fp8, fp8_scale = fp8_row_buffers(tokens, inter, x.device) if fp8_copy else (out, out)  # unused without
    if tokens and inter:
        # a per-token scale needs the whole row in one program
        block = triton.next_power_of_2(inter) if fp8_copy else min(BLOCK_I, triton.next_power_of_2(inter))
        grid = (tokens, triton.cdiv(inter, block))
        pdl = pdl_enabled(x.device)
        _silu_and_mul_kernel[grid](out, x, out.stride(0), x.stride(0), inter, fp8, fp8_scale, _MIN_SCALE, BLOCK=block,
                                   USE_PDL=pdl, QUANT=fp8_copy, FP8_MAX_VALUE=FP8_MAX,
                                   num_warps=fp8_warps(block) if fp8_copy else 4, launch_pdl=pdl)
    return Fp8Activation(out, fp8, fp8_scale) if fp8_copy else out

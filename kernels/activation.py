"""SiLU-and-multiply, the activation of gated MLPs: [T, 2I] laid out as [gate | up] -> silu(gate) * up, [T, I].

Rounding follows `reference.silu_and_mul`: silu(gate) is rounded to x's dtype before it multiplies `up`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .pdl import enabled as pdl_enabled, wait_for_prior_grids

BLOCK_I = 1024  # columns per program


@triton.jit
def _silu_and_mul_kernel(
    out_ptr,  # [T, I]
    x_ptr,  # [T, 2I] = [gate | up]
    stride_out,
    stride_x,
    I,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,  # launched with PDL (kernels/pdl.py)
):
    wait_for_prior_grids(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < I
    gate_raw = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x + I + cols, mask=mask, other=0.0).to(tl.float32)
    gate = gate_raw.to(tl.float32)
    silu = (gate / (1.0 + tl.exp(-gate))).to(gate_raw.dtype).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (silu * up).to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [T, 2I] (rows contiguous) -> new [T, I] in x's dtype."""
    if x.dim() != 2 or x.shape[1] % 2 or x.stride(1) != 1:
        raise ValueError(f"x must be [T, 2I] with contiguous rows, got {tuple(x.shape)} strides {x.stride()}")
    tokens, inter = x.shape[0], x.shape[1] // 2
    out = torch.empty((tokens, inter), dtype=x.dtype, device=x.device)
    if tokens == 0 or inter == 0:
        return out
    block = min(BLOCK_I, triton.next_power_of_2(inter))
    grid = (tokens, triton.cdiv(inter, block))
    pdl = pdl_enabled(x.device)
    _silu_and_mul_kernel[grid](out, x, out.stride(0), x.stride(0), inter, BLOCK=block, USE_PDL=pdl, num_warps=4,
                               launch_pdl=pdl)
    return out

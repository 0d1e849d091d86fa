"""Neox-style rotary embedding (rotate halves), applied IN PLACE to q and k; one program per token.

For each head x = [x1 | x2] (D/2 each) and the token's cache row [cos | sin]:
    x1' = x1 * cos - x2 * sin,    x2' = x2 * cos + x1 * sin      (float32, rounded once to x's dtype)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .pdl import enabled as pdl_enabled, wait_for_prior_grids


@triton.jit
def _rotate_heads(
    x_ptr,  # [nh, D] of one token, heads contiguous
    cos,  # [HALF_PAD] float32
    sin,  # [HALF_PAD] float32
    num_heads,
    HALF: tl.constexpr,  # D / 2
    HEADS_PAD: tl.constexpr,
    HALF_PAD: tl.constexpr,
):
    """Rotates the heads in place; returns the rotated halves [HEADS_PAD, HALF_PAD] as stored (x's dtype)."""
    heads = tl.arange(0, HEADS_PAD)
    cols = tl.arange(0, HALF_PAD)
    mask = (heads[:, None] < num_heads) & (cols[None, :] < HALF)
    first = x_ptr + heads[:, None] * (2 * HALF) + cols[None, :]  # [HEADS_PAD, HALF_PAD]
    x1 = tl.load(first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(first + HALF, mask=mask, other=0.0).to(tl.float32)
    out1 = x1 * cos[None, :] - x2 * sin[None, :]
    out2 = x2 * cos[None, :] + x1 * sin[None, :]
    out1 = out1.to(x_ptr.dtype.element_ty)
    out2 = out2.to(x_ptr.dtype.element_ty)
    # In place: every thread's loads done before any store. A tile with fewer elements than threads (one kv head
    # of 64 pairs over 128 threads) is held by two threads each; without the barrier one could store the rotated
    # values before its twin loads them, and the twin would rotate them again (and may be the one that stores).
    tl.debug_barrier()
    tl.store(first, out1, mask=mask)
    tl.store(first + HALF, out2, mask=mask)
    return out1, out2


@triton.jit
def _cos_sin(positions_ptr, cache_ptr, token, stride_cache, HALF: tl.constexpr, HALF_PAD: tl.constexpr):
    """The token's cos and sin rows [HALF_PAD] (float32, zeros past HALF) from the [max_pos, D] cache."""
    pos = tl.load(positions_ptr + token).to(tl.int64)
    cols = tl.arange(0, HALF_PAD)
    cos = tl.load(cache_ptr + pos * stride_cache + cols, mask=cols < HALF, other=0.0).to(tl.float32)
    sin = tl.load(cache_ptr + pos * stride_cache + HALF + cols, mask=cols < HALF, other=0.0).to(tl.float32)
    return cos, sin


@triton.jit
def _rotary_kernel(
    positions_ptr,  # [T] int
    q_ptr,  # [T, nh * D], token stride stride_q
    k_ptr,  # [T, nkv * D], token stride stride_k
    cache_ptr,  # [max_pos, D] float32 = [cos | sin]
    stride_q,
    stride_k,
    stride_cache,
    num_heads,
    num_kv_heads,
    HALF: tl.constexpr,
    Q_HEADS_PAD: tl.constexpr,
    K_HEADS_PAD: tl.constexpr,
    HALF_PAD: tl.constexpr,
    USE_PDL: tl.constexpr,  # launched with PDL (kernels/pdl.py)
):
    token = tl.program_id(0).to(tl.int64)
    # before the wait: positions are the step's inputs, the table a constant (kernels/pdl.py rule 1), and the
    # position -> row lookup is two dependent loads
    cos, sin = _cos_sin(positions_ptr, cache_ptr, token, stride_cache, HALF, HALF_PAD)
    wait_for_prior_grids(USE_PDL)
    _rotate_heads(q_ptr + token * stride_q, cos, sin, num_heads, HALF, Q_HEADS_PAD, HALF_PAD)
    _rotate_heads(k_ptr + token * stride_k, cos, sin, num_kv_heads, HALF, K_HEADS_PAD, HALF_PAD)


def _heads_view_ok(x: torch.Tensor, head_dim: int) -> bool:
    """True when x is [T, n * head_dim] (or [T, n, head_dim]) with each token's heads contiguous."""
    flat = x.reshape(x.shape[0], -1) if x.dim() == 3 and x.stride(1) == head_dim else x
    return flat.dim() == 2 and flat.stride(1) == 1 and flat.shape[1] % head_dim == 0


def check_rotary_inputs(q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor, head_dim: int) -> None:
    """ValueError unless cos_sin_cache is [max_pos, head_dim] with contiguous rows and q, k hold contiguous heads."""
    if head_dim % 2 or cos_sin_cache.shape[-1] != head_dim or cos_sin_cache.stride(-1) != 1:
        raise ValueError(f"cos_sin_cache must be [max_pos, {head_dim}] with contiguous rows")
    for name, x in (("q", q), ("k", k)):
        if not _heads_view_ok(x, head_dim):
            raise ValueError(f"{name} must be [T, heads * {head_dim}] with contiguous heads, got {tuple(x.shape)}")


def rotary_embedding(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q [T, nh*D] and k [T, nkv*D] IN PLACE at positions [T]; returns (q, k), the same tensors.

    cos_sin_cache: [max_position, D] float32 holding [cos | sin]. Token rows may be strided (slices of a fused
    qkv output); each token's heads must be contiguous.
    """
    check_rotary_inputs(q, k, cos_sin_cache, head_dim)
    tokens = q.shape[0]
    if tokens == 0:
        return q, k
    num_heads = q[0].numel() // head_dim
    num_kv_heads = k[0].numel() // head_dim
    half = head_dim // 2
    pdl = pdl_enabled(q.device)
    _rotary_kernel[(tokens,)](
        positions,
        q,
        k,
        cos_sin_cache,
        q.stride(0),
        k.stride(0),
        cos_sin_cache.stride(0),
        num_heads,
        num_kv_heads,
        HALF=half,
        Q_HEADS_PAD=triton.next_power_of_2(num_heads),
        K_HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        HALF_PAD=triton.next_power_of_2(half),
        USE_PDL=pdl,
        num_warps=4,
        launch_pdl=pdl,
    )
    return q, k

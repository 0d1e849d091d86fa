"""Rotary embedding fused with the paged KV-cache write: one program per (token, kv head) rotates the kv head's
group of q heads IN PLACE, rotates its k head (in place too), and writes the rotated k and v into the caches at
the token's slot (slot < 0: padding, not written). Splitting the token over its kv heads shortens the kernel at
decode batch sizes (one token: KVH small programs in parallel instead of one doing every head).

One launch instead of `rotary.rotary_embedding` followed by `cache.reshape_and_cache`, with their exact
arithmetic: each rotated half is rounded to k's dtype, stored back into k, and converted to the cache's dtype from
that rounded value (an FP8 cache: scaled by 1 / k_scale, saturated, rounded to e4m3, as `reference.quantize_kv`).
So the caches, q and k end bit for bit as the two kernels leave them. Cache layout and strides as in cache.py.

Given per-head norm weights (Qwen3's q_norm / k_norm), each program first RMS-normalises its q heads and its k
head in place, with `norm.normalize_heads_in_place` on `rms_norm`'s tile, so the launch also replaces the two
`rms_norm` launches before it, bit for bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from asyncengine.kernels.cache import _store_token, check_cache_inputs, to_cache_dtype
from asyncengine.kernels.norm import head_norm_tile, normalize_heads_in_place
from asyncengine.kernels.pdl import enabled as pdl_enabled, wait_for_prior_grids_early
from asyncengine.kernels.reference import is_fp8
from asyncengine.kernels.rotary import _cos_sin, _rotate_heads, check_rotary_inputs


@triton.jit
def _store_rotated_key(
    k1,  # [HEADS_PAD, HALF_PAD] first halves of the rotated heads, in k's dtype
    k2,  # [HEADS_PAD, HALF_PAD] second halves
    dst_ptr,  # [KVH, D] of one cache slot, head stride stride_dst_h
    stride_dst_h,
    num_kv_heads,
    inv_scale,
    HALF: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HALF_PAD: tl.constexpr,
    QUANT: tl.constexpr,
):
    heads = tl.arange(0, HEADS_PAD)
    cols = tl.arange(0, HALF_PAD)
    mask = (heads[:, None] < num_kv_heads) & (cols[None, :] < HALF)
    first = dst_ptr + heads[:, None] * stride_dst_h + cols[None, :]
    tl.store(first, to_cache_dtype(k1, dst_ptr, inv_scale, QUANT), mask=mask)
    tl.store(first + HALF, to_cache_dtype(k2, dst_ptr, inv_scale, QUANT), mask=mask)


@triton.jit
def _rotary_cache_kernel(
    positions_ptr,  # [T] int
    q_ptr,  # [T, H * D], token stride stride_q, heads contiguous
    k_ptr,  # [T, KVH * D], token stride stride_k, heads contiguous
    v_ptr,  # [T, KVH, D], strides stride_v_t, stride_v_h
    cos_sin_ptr,  # [max_pos, D] float32 = [cos | sin]
    k_cache_ptr,  # [NB, BS, KVH, D]
    v_cache_ptr,  # [NB, BS, KVH, D]
    slot_ptr,  # [T] int, < 0 = padding
    q_norm_ptr,  # [D] q's per-head norm weight (read only with NORM)
    k_norm_ptr,  # [D] k's
    stride_q,
    stride_k,
    stride_v_t,
    stride_v_h,
    stride_cos_sin,
    stride_kc_b,
    stride_kc_s,
    stride_kc_h,
    stride_vc_b,
    stride_vc_s,
    stride_vc_h,
    group,  # query heads per kv head
    k_inv_scale,  # float32 1 / k_scale (read only with QUANT)
    v_inv_scale,
    head_dim,  # D (used only with NORM)
    eps,  # the norms' epsilon (read only with NORM)
    HALF: tl.constexpr,  # D / 2
    GROUP_PAD: tl.constexpr,  # next power of two >= group
    HALF_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,  # tokens per cache page
    QUANT: tl.constexpr,  # the caches are e4m3
    NORM: tl.constexpr,  # RMS-normalise the q and k heads first (Qwen3)
    NORM_ROWS: tl.constexpr,  # rows per normalisation tile (norm.head_norm_tile)
    HEAD_DIM_PAD: tl.constexpr,  # next power of two >= D
    USE_PDL: tl.constexpr,  # launched with PDL (kernels/pdl.py)
):
    token = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1).to(tl.int64)
    # before the wait: the step's inputs and a constant table (kernels/pdl.py rule 1); position -> cos/sin row is
    # two dependent loads, off the critical path this way
    cos, sin = _cos_sin(positions_ptr, cos_sin_ptr, token, stride_cos_sin, HALF, HALF_PAD)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    wait_for_prior_grids_early(USE_PDL, True)  # kernels/pdl.py rule 3: the next kernel's prologue overlaps ours
    q_heads = q_ptr + token * stride_q + kv_head * group * (2 * HALF)  # [group, D]: the kv head's q heads
    k_head = k_ptr + token * stride_k + kv_head * (2 * HALF)  # [1, D]
    if NORM:  # in place, then rotated from what was stored (the helper ends with a barrier)
        normalize_heads_in_place(q_heads, q_norm_ptr, group, head_dim, eps, NORM_ROWS, HEAD_DIM_PAD)
        normalize_heads_in_place(k_head, k_norm_ptr, 1, head_dim, eps, NORM_ROWS, HEAD_DIM_PAD)
    _rotate_heads(q_heads, cos, sin, group, HALF, GROUP_PAD, HALF_PAD)
    k1, k2 = _rotate_heads(k_head, cos, sin, 1, HALF, 1, HALF_PAD)
    if slot >= 0:
        block = slot // BLOCK_SIZE
        offset = slot % BLOCK_SIZE
        _store_rotated_key(k1, k2, k_cache_ptr + block * stride_kc_b + offset * stride_kc_s + kv_head * stride_kc_h,
                           stride_kc_h, 1, k_inv_scale, HALF, 1, HALF_PAD, QUANT)
        _store_token(v_ptr + token * stride_v_t + kv_head * stride_v_h,
                     v_cache_ptr + block * stride_vc_b + offset * stride_vc_s + kv_head * stride_vc_h,
                     stride_v_h, stride_vc_h, 1, v_inv_scale, 2 * HALF, 1, 2 * HALF_PAD, QUANT)


def _check_qk_norm(q: torch.Tensor, q_norm_weight, k_norm_weight, eps) -> bool:
    """True when the per-head norms are given (both weights and eps); ValueError naming the argument when only
    some are, or when a weight is not a contiguous [D] of q's dtype (rms_norm would then round its output to
    another dtype than q's, and the in-place result could not match it)."""
    given = {"q_norm_weight": q_norm_weight, "k_norm_weight": k_norm_weight, "eps": eps}
    if all(x is None for x in given.values()):
        return False
    missing = [name for name, x in given.items() if x is None]
    if missing:
        raise ValueError(f"{', '.join(missing)} missing: the q/k norms need q_norm_weight, k_norm_weight and eps")
    for name, w in (("q_norm_weight", q_norm_weight), ("k_norm_weight", k_norm_weight)):
        if w.shape != (q.shape[-1],) or w.stride(0) != 1 or w.dtype != q.dtype:
            raise ValueError(f"{name} must be a contiguous [{q.shape[-1]}] tensor of q's dtype {q.dtype}, got "
                             f"{tuple(w.shape)} {w.dtype}")
    return True


def rotary_and_cache(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    *,
    q_norm_weight: torch.Tensor | None = None,
    k_norm_weight: torch.Tensor | None = None,
    eps: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`rotary_embedding(positions, q, k, cos_sin_cache, D)` then `reshape_and_cache(k, v, ...)` in one launch;
    returns (q, k), rotated IN PLACE (the same tensors).

    q_norm_weight, k_norm_weight ([D], q's dtype) and eps, given together: q and k are first replaced by
    `rms_norm(q, q_norm_weight, eps)` and `rms_norm(k, k_norm_weight, eps)` (Qwen3's per-head norms), bit for bit
    as the norm kernel writes them; the returned q and k, and the cached k, are normalised and rotated.

    q: [T, H, D], k, v: [T, KVH, D] (token strides free, e.g. views of a fused qkv output; each token's q and k
    heads contiguous, v's last dim contiguous); positions, slot_mapping: [T] int; cos_sin_cache: [max_pos, D]
    float32 = [cos | sin]; k_cache, v_cache: [NB, BS, KVH, D] in k's dtype or both float8_e4m3fn (then stored
    divided by k_scale / v_scale, as `reference.quantize_kv`).
    """
    if q.dim() != 3 or k.dim() != 3 or v.shape != k.shape or k_cache.shape[2:] != k.shape[1:]:
        raise ValueError(f"q must be [T, H, D], k and v [T, KVH, D] matching the caches' [NB, BS, KVH, D]; got "
                         f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, cache {tuple(k_cache.shape)}")
    head_dim = q.shape[-1]
    check_rotary_inputs(q, k, cos_sin_cache, head_dim)
    check_cache_inputs(k, v, k_cache, v_cache)
    tokens, num_kv_heads = k.shape[0], k.shape[1]
    if q.shape[1] % num_kv_heads:
        raise ValueError(f"q's {q.shape[1]} heads are not a multiple of k's {num_kv_heads}")
    norm = _check_qk_norm(q, q_norm_weight, k_norm_weight, eps)
    if tokens == 0:
        return q, k
    group = q.shape[1] // num_kv_heads
    half = head_dim // 2
    # With the norms: rms_norm's tile and warps (norm.head_norm_tile), for its bits; 4 warps for D <= 1024.
    norm_rows, head_dim_pad, warps = head_norm_tile(head_dim) if norm else (1, 1, 4)
    pdl = pdl_enabled(q.device)
    _rotary_cache_kernel[(tokens, num_kv_heads)](
        positions, q, k, v, cos_sin_cache, k_cache, v_cache, slot_mapping,
        q_norm_weight if norm else q, k_norm_weight if norm else k,
        q.stride(0), k.stride(0), v.stride(0), v.stride(1), cos_sin_cache.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        group, 1.0 / k_scale, 1.0 / v_scale, head_dim, eps if norm else 0.0,
        HALF=half, GROUP_PAD=triton.next_power_of_2(group), HALF_PAD=triton.next_power_of_2(half), BLOCK_SIZE=k_cache.shape[1], QUANT=is_fp8(k_cache),
        NORM=norm, NORM_ROWS=norm_rows, HEAD_DIM_PAD=head_dim_pad, USE_PDL=pdl, num_warps=warps, launch_pdl=pdl,
    )  # fmt: skip
    return q, k

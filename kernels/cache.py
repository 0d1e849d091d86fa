"""Write this step's keys and values into the paged KV cache; one program per token, slot < 0 skipped.

Cache layout, per layer: [num_blocks, block_size, num_kv_heads, D]; slot = block * block_size + offset.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _store_token(
    src_ptr,  # [KVH, D] of one token, head stride stride_src_h
    dst_ptr,  # [KVH, D] of one cache slot, head stride stride_dst_h
    stride_src_h,
    stride_dst_h,
    num_kv_heads,
    HEAD_DIM: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
):
    heads = tl.arange(0, HEADS_PAD)
    cols = tl.arange(0, HEAD_DIM_PAD)
    mask = (heads[:, None] < num_kv_heads) & (cols[None, :] < HEAD_DIM)
    x = tl.load(src_ptr + heads[:, None] * stride_src_h + cols[None, :], mask=mask)
    tl.store(dst_ptr + heads[:, None] * stride_dst_h + cols[None, :], x.to(dst_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr,  # [T, KVH, D]
    value_ptr,  # [T, KVH, D]
    k_cache_ptr,  # [NB, BS, KVH, D]
    v_cache_ptr,  # [NB, BS, KVH, D]
    slot_ptr,  # [T] int, < 0 = padding
    stride_key_t,
    stride_key_h,
    stride_value_t,
    stride_value_h,
    stride_kc_b,
    stride_kc_s,
    stride_kc_h,
    stride_vc_b,
    stride_vc_s,
    stride_vc_h,
    num_kv_heads,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot < 0:
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    _store_token(
        key_ptr + token * stride_key_t,
        k_cache_ptr + block * stride_kc_b + offset * stride_kc_s,
        stride_key_h,
        stride_kc_h,
        num_kv_heads,
        HEAD_DIM,
        HEADS_PAD,
        HEAD_DIM_PAD,
    )
    _store_token(
        value_ptr + token * stride_value_t,
        v_cache_ptr + block * stride_vc_b + offset * stride_vc_s,
        stride_value_h,
        stride_vc_h,
        num_kv_heads,
        HEAD_DIM,
        HEADS_PAD,
        HEAD_DIM_PAD,
    )


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write key/value [T, KVH, D] into k_cache/v_cache [NB, BS, KVH, D] at slot_mapping [T] (in place).

    Token and head strides of key/value are free (views of a fused qkv output); the last dim must be contiguous.
    Values are converted to the cache dtype.
    """
    for name, x in (("key", key), ("value", value), ("k_cache", k_cache), ("v_cache", v_cache)):
        if x.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dim")
    tokens, num_kv_heads, head_dim = key.shape
    if tokens == 0:
        return
    _reshape_and_cache_kernel[(tokens,)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        num_kv_heads,
        BLOCK_SIZE=k_cache.shape[1],
        HEAD_DIM=head_dim,
        HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM_PAD=triton.next_power_of_2(head_dim),
        num_warps=4,
    )

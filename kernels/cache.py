"""Write this step's keys and values into the paged KV cache; one program per token, slot < 0 skipped.

Cache layout, per layer: [num_blocks, block_size, num_kv_heads, D]; slot = block * block_size + offset.
An FP8 (e4m3) cache stores x * (1 / scale) saturated to +-448 (`reference.quantize_kv`); the bf16/fp32 path is a
plain cast, chosen by the constexpr QUANT, so it compiles to the same code as before.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from asyncengine.kernels.pdl import enabled as pdl_enabled, wait_for_prior_grids
from asyncengine.kernels.reference import FP8_E4M3_MAX, is_fp8

FP8_MAX = tl.constexpr(FP8_E4M3_MAX)


@triton.jit
def _round_to_e4m3(x):
    """x (float32, |x| <= 448) rounded to the nearest e4m3 value, ties to even, still in float32, sign kept.

    The cast to e4m3 that follows is then exact. Rounding here, rather than in the cast, is what Triton's
    interpreter runs correctly: its float32 -> float8e4nv cast truncates when rounding carries into the exponent
    (126.7 -> 64, not 128) and flushes subnormals (see tests/test_kv_cache_fp8.py). e4m3 keeps 3 mantissa bits,
    so a value in [2^e, 2^(e+1)) rounds to a multiple of 2^(e-3), and below 2^-6 (subnormals) of 2^-9; adding and
    subtracting 1.5 * 2^23 steps rounds |x| to a multiple of the step (float32 addition rounds to nearest even).
    """
    magnitude = tl.abs(x)
    bits = magnitude.to(tl.int32, bitcast=True)
    sign = x.to(tl.int32, bitcast=True) ^ bits  # the sign bit alone (no 32-bit literal: it would widen to int64)
    exponent = (bits >> 23) - 127  # -127 for zero
    step_exponent = tl.maximum(exponent, -6) - 3
    step = ((step_exponent + 127) << 23).to(tl.float32, bitcast=True)  # 2^step_exponent
    magic = step * 12582912.0  # 1.5 * 2^23 steps: its float32 ulp is one step
    rounded = (magnitude + magic) - magic
    return (rounded.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit
def _store_token(
    src_ptr,  # [KVH, D] of one token, head stride stride_src_h
    dst_ptr,  # [KVH, D] of one cache slot, head stride stride_dst_h
    stride_src_h,
    stride_dst_h,
    num_kv_heads,
    inv_scale,  # float32 1 / scale (read only with QUANT)
    HEAD_DIM: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    QUANT: tl.constexpr,  # the cache is e4m3: scale and saturate before the cast
):
    heads = tl.arange(0, HEADS_PAD)
    cols = tl.arange(0, HEAD_DIM_PAD)
    mask = (heads[:, None] < num_kv_heads) & (cols[None, :] < HEAD_DIM)
    x = tl.load(src_ptr + heads[:, None] * stride_src_h + cols[None, :], mask=mask)
    tl.store(dst_ptr + heads[:, None] * stride_dst_h + cols[None, :], to_cache_dtype(x, dst_ptr, inv_scale, QUANT),
             mask=mask)


@triton.jit
def to_cache_dtype(x, dst_ptr, inv_scale, QUANT: tl.constexpr):
    """x (in the model's dtype) as the cache stores it: scaled, saturated and rounded to e4m3 with QUANT, else a
    plain cast to the cache's dtype (`reference.quantize_kv`)."""
    if QUANT:
        x = _round_to_e4m3(tl.clamp(x.to(tl.float32) * inv_scale, -FP8_MAX, FP8_MAX))
    return x.to(dst_ptr.dtype.element_ty)


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
    k_inv_scale,
    v_inv_scale,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    QUANT: tl.constexpr,
    USE_PDL: tl.constexpr,  # launched with PDL (kernels/pdl.py): the wait comes before the early return
):
    wait_for_prior_grids(USE_PDL)
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
        k_inv_scale,
        HEAD_DIM,
        HEADS_PAD,
        HEAD_DIM_PAD,
        QUANT,
    )
    _store_token(
        value_ptr + token * stride_value_t,
        v_cache_ptr + block * stride_vc_b + offset * stride_vc_s,
        stride_value_h,
        stride_vc_h,
        num_kv_heads,
        v_inv_scale,
        HEAD_DIM,
        HEADS_PAD,
        HEAD_DIM_PAD,
        QUANT,
    )


def check_cache_inputs(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor):
    """ValueError unless every tensor is contiguous in its last dim and the caches are both FP8 or neither."""
    for name, x in (("key", key), ("value", value), ("k_cache", k_cache), ("v_cache", v_cache)):
        if x.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dim")
    if is_fp8(k_cache) != is_fp8(v_cache):
        raise ValueError(f"k_cache ({k_cache.dtype}) and v_cache ({v_cache.dtype}) must both be FP8 or neither")


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Write key/value [T, KVH, D] into k_cache/v_cache [NB, BS, KVH, D] at slot_mapping [T] (in place).

    Token and head strides of key/value are free (views of a fused qkv output); the last dim must be contiguous.
    Values are converted to the cache dtype; an FP8 cache (both caches e4m3) stores them quantized with k_scale /
    v_scale as `reference.quantize_kv` does, bit for bit.
    """
    check_cache_inputs(key, value, k_cache, v_cache)
    tokens, num_kv_heads, head_dim = key.shape
    if tokens == 0:
        return
    pdl = pdl_enabled(key.device)
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
        1.0 / k_scale,
        1.0 / v_scale,
        BLOCK_SIZE=k_cache.shape[1],
        HEAD_DIM=head_dim,
        HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM_PAD=triton.next_power_of_2(head_dim),
        QUANT=is_fp8(k_cache),
        USE_PDL=pdl,
        num_warps=4,
        launch_pdl=pdl,
    )

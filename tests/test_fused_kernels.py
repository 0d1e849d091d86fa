"""Fused decode-path kernels and programmatic dependent launch (issue 14: fewer, overlapping kernels per token).

- `rotary_cache.rotary_and_cache` (rotary of q and k fused with the paged KV write) leaves q, k and both caches
  bit for bit as the two kernels it replaces do (`rotary.rotary_embedding`, then `cache.reshape_and_cache`), for a
  bf16 / float32 cache and an FP8 (e4m3) one, on shuffled slots with padding; and close to the references.
- `ops.cache_and_attend(..., rotary=...)` (the attention layer's one call) equals rotating first, then caching and
  attending, on CPU (the references and the fast CPU kernels) and with CUDA (the fused kernel).
- PDL (kernels/pdl.py): the switch (CUDA, capability >= 9, no interpreter, ASYNCENGINE_PDL != 0), and on a GPU the
  decode step's kernels captured in a CUDA graph with PDL on and off give identical bits.

Without CUDA the kernels run in Triton's interpreter at small sizes (hence TRITON_INTERPRET before Triton loads).
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

pytest.importorskip("triton")

from asyncengine.kernels import reference  # noqa: E402
from test_cpu_kernels import shuffled_block_tables  # noqa: E402
from test_kernels import ATTENTION_TOLERANCE, assert_matches, fresh_seed, nan_poisoned_empty  # noqa: E402,F401
from test_kv_cache_fp8 import random_fp8, same_bytes  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FP8 = torch.float8_e4m3fn
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (NaN-safe, any dtype)."""
    if a.dtype == FP8:
        return same_bytes(a, b)
    return a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def qkv_step(tokens, heads, kv_heads, head_dim, num_blocks, block_size, dtype, cache_dtype, device=DEVICE):
    """One step's inputs: q, k, v as strided views of a fused qkv [T, (H + 2 KVH) * D]; shuffled slots with
    padding (-1); positions; a random cos/sin table; caches with random (or random e4m3) contents."""
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype, device=device)
    q = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)
    k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    v = qkv[:, (heads + kv_heads) * head_dim :].view(tokens, kv_heads, head_dim)
    slots = torch.randperm(num_blocks * block_size, device=device)[:tokens]
    slots[1::4] = -1  # padding tokens of a CUDA-graph batch
    positions = torch.randint(0, 4 * block_size, (tokens,), device=device)
    cos_sin = torch.randn(8 * block_size, head_dim, device=device)
    shape = (num_blocks, block_size, kv_heads, head_dim)
    if cache_dtype == FP8:
        k_cache, v_cache = random_fp8(shape, device), random_fp8(shape, device)
    else:
        k_cache = torch.randn(shape, dtype=cache_dtype, device=device)
        v_cache = torch.randn_like(k_cache)
    return qkv, q, k, v, slots, positions, cos_sin, k_cache, v_cache


CASES = [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.bfloat16, FP8),
         (torch.float32, FP8)]


@pytest.mark.parametrize("dtype,cache_dtype", CASES)
def test_rotary_and_cache_equals_rotary_then_cache_bit_for_bit(dtype, cache_dtype):
    from asyncengine.kernels import cache, rotary, rotary_cache

    heads, kv_heads, head_dim, block_size = 6, 2, 64, 16  # groups of 3 q heads (not a power of two)
    scales = (0.37, 1.9) if cache_dtype == FP8 else (1.0, 1.0)
    qkv, q, k, v, slots, positions, cos_sin, k_cache, v_cache = qkv_step(
        9, heads, kv_heads, head_dim, 6, block_size, dtype, cache_dtype)
    two_qkv, two_k_cache, two_v_cache = qkv.clone(), k_cache.clone(), v_cache.clone()
    ref_k_cache, ref_v_cache = k_cache.clone(), v_cache.clone()
    ref_q, ref_k = reference.rotary_and_cache(positions, q.clone(), k.clone(), v, cos_sin, ref_k_cache, ref_v_cache,
                                              slots, *scales)

    # The two kernels the fused one replaces, on a copy of the same step.
    two_q, two_k, two_v = (two_qkv[:, a:b].unflatten(-1, (-1, head_dim)) for a, b in (
        (0, heads * head_dim), (heads * head_dim, (heads + kv_heads) * head_dim),
        ((heads + kv_heads) * head_dim, None)))
    rotary.rotary_embedding(positions, two_q.flatten(1), two_k.flatten(1), cos_sin, head_dim)
    cache.reshape_and_cache(two_k, two_v, two_k_cache, two_v_cache, slots, *scales)

    out_q, out_k = rotary_cache.rotary_and_cache(positions, q, k, v, cos_sin, k_cache, v_cache, slots, *scales)
    assert out_q.data_ptr() == q.data_ptr() and out_k.data_ptr() == k.data_ptr()
    assert same(qkv, two_qkv), "q or k differ from the rotary kernel's (or v was touched)"
    assert same(k_cache, two_k_cache) and same(v_cache, two_v_cache)
    assert_matches(q, ref_q)
    assert_matches(k, ref_k)
    written = slots[slots >= 0]
    untouched = torch.ones(k_cache.shape[0] * block_size, dtype=torch.bool, device=DEVICE)
    untouched[written] = False
    for mine, ref in ((k_cache, ref_k_cache), (v_cache, ref_v_cache)):
        rows, ref_rows = mine.view(-1, kv_heads, head_dim), ref.view(-1, kv_heads, head_dim)
        assert same(rows[untouched], ref_rows[untouched]), "a slot outside slot_mapping was written"
        # The interpreter rounds float32 -> bf16 one ulp off torch: allow that, and its e4m3 step after it.
        rtol = 0.13 if cache_dtype == FP8 else ATTENTION_TOLERANCE[dtype][1]
        torch.testing.assert_close(rows[written].float(), ref_rows[written].float(), rtol=rtol, atol=rtol)


def test_rotary_and_cache_rejects_mismatched_shapes_naming_them():
    from asyncengine.kernels import rotary_cache

    _, q, k, v, slots, positions, cos_sin, k_cache, v_cache = qkv_step(3, 4, 2, 64, 2, 16, torch.float32,
                                                                      torch.float32)
    with pytest.raises(ValueError, match="k and v"):
        rotary_cache.rotary_and_cache(positions, q, k, v[:, :1], cos_sin, k_cache, v_cache, slots)
    with pytest.raises(ValueError, match="cos_sin_cache"):
        rotary_cache.rotary_and_cache(positions, q, k, v, cos_sin[:, :32], k_cache, v_cache, slots)
    with pytest.raises(ValueError, match="FP8 or neither"):
        rotary_cache.rotary_and_cache(positions, q, k, v, cos_sin, k_cache, v_cache.to(FP8), slots)


def split_heads(qkv: torch.Tensor, heads: int, kv_heads: int, head_dim: int):
    """q [T, H, D], k, v [T, KVH, D]: views of a fused qkv [T, (H + 2 KVH) * D]."""
    sizes = [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim]
    return tuple(x.unflatten(-1, (-1, head_dim)) for x in qkv.split(sizes, dim=-1))


def check_qk_norm_fused_equals_two_steps(tokens, heads, kv_heads, head_dim, num_blocks, block_size, dtype,
                                         cache_dtype, scales, poison=False, device=DEVICE):
    """rotary_and_cache with the q/k norms == rms_norm of q and k, then rotary_and_cache, bit for bit: q and k
    (normalised and rotated in place in qkv), both caches (written slots and untouched ones) and v (untouched).
    poison: the caches start as NaN (e4m3 NaN bytes), so a slot written by one path only shows.
    Returns the fused path's (q, k, caches) and the inputs, for the callers' own checks."""
    from asyncengine.kernels import norm, rotary_cache

    qkv, q, k, v, slots, positions, cos_sin, k_cache, v_cache = qkv_step(
        tokens, heads, kv_heads, head_dim, num_blocks, block_size, dtype, cache_dtype, device=device)
    if poison:
        for cache in (k_cache, v_cache):
            cache.view(torch.uint8).fill_(0x7F) if cache_dtype == FP8 else cache.fill_(float("nan"))
    q_weight, k_weight = (1.0 + 0.3 * torch.randn(head_dim, device=device)).to(dtype), torch.rand(
        head_dim, device=device).to(dtype) * 2  # Qwen3's trained norms sit around 1
    eps = 1e-6
    inputs = dict(qkv=qkv.clone(), slots=slots, positions=positions, cos_sin=cos_sin, k_cache=k_cache.clone(),
                  v_cache=v_cache.clone(), q_weight=q_weight, k_weight=k_weight, eps=eps)
    two_qkv, two_k_cache, two_v_cache = qkv.clone(), k_cache.clone(), v_cache.clone()
    two_q, two_k, two_v = split_heads(two_qkv, heads, kv_heads, head_dim)
    normed_q, normed_k = norm.rms_norm(two_q, q_weight, eps), norm.rms_norm(two_k, k_weight, eps)
    rotary_cache.rotary_and_cache(positions, normed_q, normed_k, two_v, cos_sin, two_k_cache, two_v_cache, slots,
                                  *scales)

    out_q, out_k = rotary_cache.rotary_and_cache(positions, q, k, v, cos_sin, k_cache, v_cache, slots, *scales,
                                                 q_norm_weight=q_weight, k_norm_weight=k_weight, eps=eps)
    if device == "cuda":
        torch.cuda.synchronize()
    assert out_q.data_ptr() == q.data_ptr() and out_k.data_ptr() == k.data_ptr()
    assert same(q, normed_q), "q differs from rms_norm then rotary_and_cache"
    assert same(k, normed_k), "k differs from rms_norm then rotary_and_cache"
    assert same(v, two_v), "v was touched"
    assert same(k_cache, two_k_cache) and same(v_cache, two_v_cache), "a cache differs from the two-step path"
    return q, k, k_cache, v_cache, inputs


@pytest.mark.parametrize("group", [1, 2, 4])
@pytest.mark.parametrize("dtype,cache_dtype", CASES)
def test_rotary_and_cache_with_qk_norm_equals_rms_norm_then_rotary_and_cache_bit_for_bit(dtype, cache_dtype, group):
    kv_heads, head_dim, block_size = 2, 64, 16
    scales = (0.37, 1.9) if cache_dtype == FP8 else (1.0, 1.0)
    q, k, k_cache, _, inputs = check_qk_norm_fused_equals_two_steps(
        7, group * kv_heads, kv_heads, head_dim, 4, block_size, dtype, cache_dtype, scales)
    # And close to the references (norm, rotary, cache in torch).
    ref_q, ref_k, ref_v = split_heads(inputs["qkv"], group * kv_heads, kv_heads, head_dim)
    ref_k_cache, ref_v_cache = inputs["k_cache"], inputs["v_cache"]
    ref_q, ref_k = reference.rotary_and_cache(inputs["positions"], ref_q, ref_k, ref_v, inputs["cos_sin"],
                                              ref_k_cache, ref_v_cache, inputs["slots"], *scales,
                                              q_norm_weight=inputs["q_weight"], k_norm_weight=inputs["k_weight"],
                                              eps=inputs["eps"])
    # bf16: kernels and reference round at different points (normalised row, times the weight, the rotation), each
    # half an ulp of values up to ~16 (weights up to 2). The rotation mixes two such values into one that may be
    # far smaller, so an element's own magnitude does not bound its error; the head's largest value does. Seen in
    # 400 seeds: 0.066 at 0.516 (seed 155), 0.25 at 16.1 (seed 173), both under 1% of the largest |value|; a wrong
    # weight, position or head is off by the order of the values themselves.
    def tolerance(ref: torch.Tensor) -> tuple[float, float]:  # (atol, rtol)
        if dtype == torch.float32:
            return 1e-5, 1e-5
        return 0.02 * ref.float().abs().max().item(), 0.02

    for out, ref in ((q, ref_q), (k, ref_k)):
        assert_matches(out, ref, {dtype: tolerance(ref)})
    written = inputs["slots"][inputs["slots"] >= 0]
    rows, ref_rows = k_cache.view(-1, kv_heads, head_dim)[written], ref_k_cache.view(-1, kv_heads, head_dim)[written]
    atol, rtol = tolerance(ref_rows)
    if cache_dtype == FP8:  # plus an e4m3 rounding either way (3 mantissa bits)
        atol, rtol = atol + 0.13, 0.13
    torch.testing.assert_close(rows.float(), ref_rows.float(), rtol=rtol, atol=atol)


def test_rotary_and_cache_rejects_incomplete_or_mismatched_norms_naming_them():
    from asyncengine.kernels import rotary_cache

    _, q, k, v, slots, positions, cos_sin, k_cache, v_cache = qkv_step(3, 4, 2, 64, 2, 16, torch.float32,
                                                                      torch.float32)
    weight = torch.ones(64)
    args = (positions, q, k, v, cos_sin, k_cache, v_cache, slots)
    with pytest.raises(ValueError, match="k_norm_weight, eps missing"):
        rotary_cache.rotary_and_cache(*args, q_norm_weight=weight)
    with pytest.raises(ValueError, match="k_norm_weight must be a contiguous"):
        rotary_cache.rotary_and_cache(*args, q_norm_weight=weight, k_norm_weight=weight.bfloat16(), eps=1e-6)
    with pytest.raises(ValueError, match="q_norm_weight must be a contiguous"):
        rotary_cache.rotary_and_cache(*args, q_norm_weight=torch.ones(32), k_norm_weight=weight, eps=1e-6)


def decode_metadata(seq_lens, block_size, device=DEVICE, cpu_plan=False):
    """AttentionMetadata of a decode step (one new token per sequence) over shuffled block tables, and the slots
    of the new tokens. cpu_plan: on CPU, also the step's plan that the CPU fast path reads."""
    from asyncengine.kernels import cpu
    from asyncengine.models.layers import AttentionMetadata

    tables, num_blocks = shuffled_block_tables(seq_lens, block_size, spare_blocks=2, spare_columns=1)
    slots = torch.tensor([int(tables[b, (n - 1) // block_size]) * block_size + (n - 1) % block_size
                          for b, n in enumerate(seq_lens)], dtype=torch.int64)
    qsl = torch.arange(len(seq_lens) + 1, dtype=torch.int32)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    metadata = AttentionMetadata(qsl.to(device), lens.to(device), tables.to(device), slots.to(device), qsl, lens,
                                 max_query_len=1, max_seq_len=max(seq_lens))
    if cpu_plan and device == "cpu":
        metadata.cpu_plan = cpu.plan_attention(qsl.numpy(), lens.numpy(), tables.numpy(), block_size)
    return metadata, num_blocks


@pytest.mark.parametrize("cache_dtype", [torch.float32, FP8])
@pytest.mark.parametrize("fast_cpu", [True, False])
def test_cache_and_attend_with_rotary_equals_rotating_first(cache_dtype, fast_cpu, monkeypatch):
    """The layer's one call: rotation inside (fused with the cache write with CUDA) == rotary, then cache+attend."""
    from asyncengine import ops

    monkeypatch.setattr(ops, "CPU_FAST_PATH", fast_cpu)
    heads, kv_heads, head_dim, block_size, seq_lens = 4, 2, 64, 16, [37, 5, 70]
    metadata, num_blocks = decode_metadata(seq_lens, block_size, cpu_plan=fast_cpu)
    qkv, q, k, v, _, _, cos_sin, k_cache, v_cache = qkv_step(3, heads, kv_heads, head_dim, num_blocks, block_size,
                                                             torch.float32, cache_dtype)
    positions = torch.tensor([n - 1 for n in seq_lens], device=DEVICE)
    ref_k_cache, ref_v_cache = k_cache.clone(), v_cache.clone()
    ref_q, ref_k = reference.rotary_embedding(positions, q.flatten(1), k.flatten(1), cos_sin, head_dim)
    ref = ops.cache_and_attend(ref_q.view(q.shape), ref_k.view(k.shape), v, ref_k_cache, ref_v_cache, metadata,
                               0.125, k_scale=0.5, v_scale=2.0)
    out = ops.cache_and_attend(q, k, v, k_cache, v_cache, metadata, 0.125, k_scale=0.5, v_scale=2.0,
                               rotary=(positions, cos_sin))
    assert_matches(out, ref, ATTENTION_TOLERANCE)


@pytest.mark.parametrize("fast_cpu", [True, False])
def test_cache_and_attend_with_qk_norm_equals_norming_first(fast_cpu, monkeypatch):
    """Qwen3's layer call: the norms inside (fused with rotary and the cache write with CUDA) == rms_norm of q and
    k first, then the same call without them; bit for bit (the same kernels, or the fused one that matches them)."""
    from asyncengine import ops

    monkeypatch.setattr(ops, "CPU_FAST_PATH", fast_cpu)
    heads, kv_heads, head_dim, block_size, seq_lens = 4, 2, 64, 16, [37, 5, 70]
    metadata, num_blocks = decode_metadata(seq_lens, block_size, cpu_plan=fast_cpu)
    _, q, k, v, _, _, cos_sin, k_cache, v_cache = qkv_step(3, heads, kv_heads, head_dim, num_blocks, block_size,
                                                             torch.float32, torch.float32)
    positions = torch.tensor([n - 1 for n in seq_lens], device=DEVICE)
    plain = (q.clone(), k.clone(), k_cache.clone(), v_cache.clone())  # the inputs (with CUDA rotated in place)
    qk_norm = ops.QKNorm(torch.rand(head_dim, device=DEVICE) + 0.5, torch.rand(head_dim, device=DEVICE) + 0.5, 1e-6)
    ref_k_cache, ref_v_cache = k_cache.clone(), v_cache.clone()
    ref_q, ref_k = ops.rms_norm(q, qk_norm.q_weight, 1e-6), ops.rms_norm(k, qk_norm.k_weight, 1e-6)
    ref = ops.cache_and_attend(ref_q, ref_k, v, ref_k_cache, ref_v_cache, metadata, 0.125,
                               rotary=(positions, cos_sin))
    out = ops.cache_and_attend(q, k, v, k_cache, v_cache, metadata, 0.125, rotary=(positions, cos_sin),
                               qk_norm=qk_norm)
    assert not out.isnan().any()
    assert same(out, ref) and same(k_cache, ref_k_cache) and same(v_cache, ref_v_cache)
    unnormed = ops.cache_and_attend(*plain[:2], v, *plain[2:], metadata, 0.125, rotary=(positions, cos_sin))
    assert not same(out, unnormed), "the norms changed nothing: the test proves nothing"


# ----------------------------------------------------------------------------------------------------------------
# PDL: the switch (kernels/pdl.py)
# ----------------------------------------------------------------------------------------------------------------


def test_pdl_is_off_on_cpu_under_the_interpreter_and_by_the_env_switch(monkeypatch):
    from asyncengine.kernels import interpreting, pdl

    assert not pdl.enabled(torch.device("cpu"))
    if torch.cuda.is_available():
        hopper = torch.cuda.get_device_capability()[0] >= 9
        assert pdl.enabled(torch.device("cuda")) == (hopper and not interpreting())
        monkeypatch.setenv(pdl.ENV_SWITCH, "0")
        assert not pdl.enabled(torch.device("cuda"))
    else:
        monkeypatch.setenv(pdl.ENV_SWITCH, "1")
        assert not pdl.enabled(torch.device("cpu"))


# ----------------------------------------------------------------------------------------------------------------
# GPU: Llama-3-8B sizes (32 heads, 8 kv heads, D = 128, hidden 4096, intermediate 14336), bf16
# ----------------------------------------------------------------------------------------------------------------

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER, BLOCK = 4096, 32, 8, 128, 14336, 16


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, FP8])
def test_gpu_rotary_and_cache_at_llama_sizes_equals_the_two_kernels_bit_for_bit(cache_dtype):
    from asyncengine.kernels import cache, rotary, rotary_cache

    scales = (0.05, 0.03) if cache_dtype == FP8 else (1.0, 1.0)
    qkv, q, k, v, slots, positions, cos_sin, k_cache, v_cache = qkv_step(
        300, HEADS, KV_HEADS, HEAD_DIM, 512, BLOCK, torch.bfloat16, cache_dtype, device="cuda")
    two_qkv, two_k_cache, two_v_cache = qkv.clone(), k_cache.clone(), v_cache.clone()
    sizes = [HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM]
    two_q, two_k, two_v = (x.unflatten(-1, (-1, HEAD_DIM)) for x in two_qkv.split(sizes, dim=-1))
    ref_q, ref_k = reference.rotary_embedding(positions, two_q.flatten(1), two_k.flatten(1), cos_sin, HEAD_DIM)
    rotary.rotary_embedding(positions, two_q.flatten(1), two_k.flatten(1), cos_sin, HEAD_DIM)
    cache.reshape_and_cache(two_k, two_v, two_k_cache, two_v_cache, slots, *scales)
    rotary_cache.rotary_and_cache(positions, q, k, v, cos_sin, k_cache, v_cache, slots, *scales)
    torch.cuda.synchronize()
    assert same(qkv, two_qkv) and same(k_cache, two_k_cache) and same(v_cache, two_v_cache)
    assert_matches(q.flatten(1), ref_q)
    assert_matches(k.flatten(1), ref_k)


QWEN3_MOE_HEADS, QWEN3_MOE_KV_HEADS = 32, 4  # Qwen3-30B-A3B's attention (D = 128): groups of 8 q heads


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("tokens", [1, 300])
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, FP8])
def test_gpu_rotary_and_cache_with_qk_norm_at_qwen3_moe_sizes_equals_the_two_steps_bit_for_bit(cache_dtype, tokens):
    """Qwen3-30B-A3B attention shape, bf16, caches poisoned with NaN: the fused norms + rotary + cache write leave
    q, k and the caches bit for bit as rms_norm then rotary_and_cache; written slots hold no NaN."""
    scales = (0.05, 0.03) if cache_dtype == FP8 else (1.0, 1.0)
    q, k, k_cache, v_cache, inputs = check_qk_norm_fused_equals_two_steps(
        tokens, QWEN3_MOE_HEADS, QWEN3_MOE_KV_HEADS, HEAD_DIM, 512, BLOCK, torch.bfloat16, cache_dtype, scales,
        poison=True, device="cuda")
    written = inputs["slots"][inputs["slots"] >= 0]
    for cache in (k_cache, v_cache):
        assert not cache.view(-1, QWEN3_MOE_KV_HEADS, HEAD_DIM)[written].float().isnan().any(), "a slot unwritten"
    ref_q, ref_k, _ = split_heads(inputs["qkv"], QWEN3_MOE_HEADS, QWEN3_MOE_KV_HEADS, HEAD_DIM)
    ref_q = reference.rms_norm(ref_q, inputs["q_weight"], inputs["eps"])
    ref_k = reference.rms_norm(ref_k, inputs["k_weight"], inputs["eps"])
    ref_q, ref_k = reference.rotary_embedding(inputs["positions"], ref_q.flatten(1), ref_k.flatten(1),
                                              inputs["cos_sin"], HEAD_DIM)
    tolerance = {torch.bfloat16: (0.05, 0.02)}
    assert_matches(q.flatten(1), ref_q, tolerance)
    assert_matches(k.flatten(1), ref_k, tolerance)


def decode_layer_weights(quant: str):
    """Random weights of one Llama-3-8B layer for the decode GEMV: bf16, FP8 (weight-only, per channel), or int4
    (the engine's packed layout, group 128)."""
    def linear(n, k):
        if quant == "int4":
            groups = k // 128
            return dict(qweight=torch.randint(-2**31, 2**31 - 1, (k // 8, n), dtype=torch.int32, device="cuda"),
                        scales=torch.rand(groups, n, dtype=torch.bfloat16, device="cuda") / 64,
                        zeros=torch.randint(0, 16, (groups, n), device="cuda").to(torch.bfloat16))
        w = torch.randn(n, k, dtype=torch.bfloat16, device="cuda") / k**0.5
        if quant == "fp8":
            return dict(weight=w.to(FP8), w_scale=torch.rand(n, 1, device="cuda") + 0.5)
        return dict(weight=w)

    return dict(qkv=linear((HEADS + 2 * KV_HEADS) * HEAD_DIM, HIDDEN), o=linear(HIDDEN, HEADS * HEAD_DIM),
                gate_up=linear(2 * INTER, HIDDEN), down=linear(HIDDEN, INTER),
                norm1=torch.rand(HIDDEN, dtype=torch.bfloat16, device="cuda") + 0.5,
                norm2=torch.rand(HIDDEN, dtype=torch.bfloat16, device="cuda") + 0.5)


def gemv(x, params):
    from asyncengine.kernels import quant_gemv

    if "qweight" in params:
        return quant_gemv.int4_gemv(x, params["qweight"], params["scales"], params["zeros"], 128)
    return quant_gemv.dense_gemv(x, params["weight"], w_scale=params.get("w_scale"))


def decode_step(state, layers, metadata, cos_sin, k_scale, v_scale):
    """The decode step's kernels for every layer, as the engine launches them (batch-1 or a few sequences):
    norm, qkv GEMV, rotary + cache write, decode attention, o GEMV, norm, gate_up GEMV, silu_and_mul, down GEMV."""
    from asyncengine.kernels import activation, attention, norm, quant_fp8, rotary_cache

    hidden, residual = state["hidden"], state["residual"]
    tokens = hidden.shape[0]
    for layer, (weights, (k_cache, v_cache)) in enumerate(zip(layers, state["caches"])):
        normed, residual = norm.fused_add_rms_norm(hidden, residual, weights["norm1"], 1e-5)
        qkv = gemv(normed, weights["qkv"])
        q, k, v = (x.unflatten(-1, (-1, HEAD_DIM)) for x in qkv.split(
            [HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM], dim=-1))
        rotary_cache.rotary_and_cache(state["positions"], q, k, v, cos_sin, k_cache, v_cache, metadata.slot_mapping,
                                      k_scale, v_scale)
        out = attention.paged_attention(q, k_cache, v_cache, metadata.query_start_loc, metadata.seq_lens,
                                        metadata.block_tables, HEAD_DIM**-0.5, max_query_len=1,
                                        max_seq_len=metadata.max_seq_len, k_scale=k_scale, v_scale=v_scale)
        hidden = gemv(out.view(tokens, -1), weights["o"])
        normed, residual = norm.fused_add_rms_norm(hidden, residual, weights["norm2"], 1e-5)
        hidden = gemv(activation.silu_and_mul(gemv(normed, weights["gate_up"])), weights["down"])
        state[f"x8_{layer}"] = quant_fp8.quantize_per_token(normed)  # the FP8 path's activation kernel
    state["out"].copy_(norm.rms_norm(hidden, layers[-1]["norm1"], 1e-5))


def run_decode_graph(pdl_on: bool, quant: str, cache_dtype, seed: int, monkeypatch):
    """Fresh inputs from `seed`, the decode step captured in a CUDA graph with PDL on or off, replayed three
    times (steps at growing positions); returns the outputs and caches."""
    from asyncengine.kernels import pdl

    monkeypatch.setenv(pdl.ENV_SWITCH, "1" if pdl_on else "0")
    assert pdl.enabled(torch.device("cuda")) == pdl_on
    torch.manual_seed(seed)
    layers = [decode_layer_weights(quant) for _ in range(2)]
    seq_lens = [1500, 37, 700]
    metadata, num_blocks = decode_metadata(seq_lens, BLOCK, device="cuda")
    shape = (num_blocks, BLOCK, KV_HEADS, HEAD_DIM)
    caches = [(torch.randn(shape, device="cuda").to(cache_dtype), torch.randn(shape, device="cuda").to(cache_dtype))
              for _ in layers]
    scales = (0.7, 1.3) if cache_dtype == FP8 else (1.0, 1.0)
    cos_sin = torch.randn(4096, HEAD_DIM, device="cuda")
    state = dict(hidden=torch.randn(len(seq_lens), HIDDEN, dtype=torch.bfloat16, device="cuda"),
                 residual=torch.randn(len(seq_lens), HIDDEN, dtype=torch.bfloat16, device="cuda"),
                 positions=torch.tensor([n - 1 for n in seq_lens], device="cuda"), caches=caches,
                 out=torch.empty(len(seq_lens), HIDDEN, dtype=torch.bfloat16, device="cuda"))
    residual_start = state["residual"].clone()
    decode_step(state, layers, metadata, cos_sin, *scales)  # compile and make the GEMV counters, eagerly
    state["residual"].copy_(residual_start)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        decode_step(state, layers, metadata, cos_sin, *scales)
    outputs = []
    for _ in range(3):
        graph.replay()
        outputs.append(state["out"].clone())
        state["positions"].add_(1)
        metadata.seq_lens.add_(1)
        metadata.slot_mapping.add_(1)  # the next offset of each sequence's last block (none is full here)
    torch.cuda.synchronize()
    return outputs, [c for pair in caches for c in pair]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("quant,cache_dtype", [("bf16", torch.bfloat16), ("fp8", FP8), ("int4", torch.bfloat16)])
def test_gpu_decode_step_in_a_cuda_graph_gives_the_same_bits_with_and_without_pdl(quant, cache_dtype, monkeypatch):
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("PDL needs compute capability 9.0 (Hopper) or later")
    seed = int.from_bytes(os.urandom(4), "little")
    with_pdl = run_decode_graph(True, quant, cache_dtype, seed, monkeypatch)
    without = run_decode_graph(False, quant, cache_dtype, seed, monkeypatch)
    for a, b in zip(with_pdl[0] + with_pdl[1], without[0] + without[1]):
        assert not (a.float().isnan().any()), "NaN in a decode output"
        assert same(a, b), f"PDL changed the results (seed {seed})"


AHEAD_OF_TIME = """
import sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from asyncengine.kernels import (activation, attention, cache, moe, norm, pdl, quant_fp8, quant_gemv, rotary,
                                 rotary_cache)

target = GPUTarget("cuda", 90, 32)
bf16, i32, i64, f32, fp8 = "*bf16", "*i32", "*i64", "*fp32", "*fp8e4nv"

def compile_kernel(fn, types, constants):
    signature = {a: "constexpr" if a in constants else types.get(a, "*bf16" if a.endswith("_ptr") else "i32")
                 for a in fn.arg_names}
    try:
        ptx = triton.compile(ASTSource(fn, signature, dict(constants, USE_PDL=True)), target=target).asm["ptx"]
    except Exception as e:
        print(fn.__name__, "failed:", e)
        return False
    prefetched = fn is not quant_gemv._gemv_kernel or "prefetch.global.L2" in ptx
    if "griddepcontrol.wait" not in ptx or "griddepcontrol.launch_dependents" not in ptx:
        return False
    # pdl.py rule 3: only the kernels it names let their dependents launch before their own wait
    early = ptx.index("griddepcontrol.launch_dependents") < ptx.index("griddepcontrol.wait")
    name = f"{fn.__module__.rsplit('.', 1)[-1]}.{fn.__name__}"
    named = name in pdl.EARLY_LAUNCH_KERNELS and not (constants.get("QUANT") and name in pdl.NOT_EARLY_WITH_FP8_COPY)
    if early != named:
        print(fn.__name__, "launches its dependents", "before" if early else "after", "its wait")
    return early == named and prefetched


def barrier_between(fn, types, constants, after: str, before: str) -> bool:
    # A bar.sync between the first PTX line containing `before` and the last `after` line ahead of it? (Threads
    # of one program reading what others of it stored: the in-place rotary, the fused decode merge.)
    signature = {a: "constexpr" if a in constants else types.get(a, "*bf16" if a.endswith("_ptr") else "i32")
                 for a in fn.arg_names}
    lines = triton.compile(ASTSource(fn, signature, constants), target=target).asm["ptx"].splitlines()
    first = next(i for i, line in enumerate(lines) if before in line)
    last = max(i for i, line in enumerate(lines[:first]) if after in line)
    return any("bar.sync" in line or "barrier.sync" in line for line in lines[last:first])

# the MoE decode kernels' int4 constexprs, unused on bf16 and FP8 experts
BF16_OR_FP8 = dict(INT4=False, SUB_K=1, WHOLE_SUBS=True, GROUP_SUBS=1, ASM=True, X_BF16_PAIRS=False, HALF_FMA=False)
decode = dict(NUM_SPLITS=4, GROUP=4, BLOCK_H=16, BLOCK_N=64, BLOCK_SIZE=16, HEAD_DIM=128, HEAD_DIM_PAD=128,
              DOT_F32=False, PRECISION="tf32x3", SLIDING_WINDOW=0, SOFTCAP=0.0, KV_FP8=False, FUSED_REDUCE=True,
              SPLITS_PAD=4, MERGE_HEADS=4)
kernels = [
    (norm._rms_norm_kernel, dict(eps="fp32"), dict(BLOCK_H=4096, ROWS=1)),
    (norm._fused_add_rms_norm_kernel, dict(eps="fp32"), dict(BLOCK_H=4096, QUANT=False, FP8_MAX_VALUE=448.0)),
    (activation._silu_and_mul_kernel, {}, dict(BLOCK=1024, QUANT=False, FP8_MAX_VALUE=448.0)),
    (rotary._rotary_kernel, dict(positions_ptr=i64, cache_ptr=f32),
     dict(HALF=64, Q_HEADS_PAD=32, K_HEADS_PAD=8, HALF_PAD=64)),
    (cache._reshape_and_cache_kernel, dict(slot_ptr=i64, k_inv_scale="fp32", v_inv_scale="fp32"),
     dict(BLOCK_SIZE=16, HEAD_DIM=128, HEADS_PAD=8, HEAD_DIM_PAD=128, QUANT=False)),
    (rotary_cache._rotary_cache_kernel, dict(positions_ptr=i64, cos_sin_ptr=f32, k_cache_ptr=fp8, v_cache_ptr=fp8,
                                             slot_ptr=i64, k_inv_scale="fp32", v_inv_scale="fp32", eps="fp32"),
     dict(HALF=64, GROUP_PAD=4, HALF_PAD=64, BLOCK_SIZE=16, QUANT=True, NORM=True, NORM_ROWS=16, HEAD_DIM_PAD=128)),
    (attention._decode_partial_kernel, dict(part_acc_ptr=f32, part_max_ptr=f32, part_sum_ptr=f32, counter_ptr=i32,
                                            query_start_loc_ptr=i32, seq_lens_ptr=i32, block_tables_ptr=i32,
                                            qk_scale="fp32", v_scale="fp32"), decode),
    (attention._decode_reduce_kernel, dict(part_acc_ptr=f32, part_max_ptr=f32, part_sum_ptr=f32,
                                           query_start_loc_ptr=i32, seq_lens_ptr=i32),
     dict(GROUP=4, MERGE_HEADS=4, NUM_SPLITS=4, SPLITS_PAD=4, HEAD_DIM=128, HEAD_DIM_PAD=128, BLOCK_N=64,
          SLIDING_WINDOW=0)),
    (quant_gemv._gemv_kernel, dict(partial_ptr=f32, counter_ptr=i32, w_ptr=i32, scale_ptr=bf16, zero_ptr=bf16),
     dict(INT4=True, HAS_SCALE=True, HAS_BIAS=False, PARTIAL=True, USE_DOT=False, DOT_FP32=False, X_HALF=True,
          X_FP16=False, ASM=True, X_BF16_PAIRS=True, SLOT_DOT=False, HALF_FMA=True, REDUCE_CHUNK=8, FP8_WORDS=False,
          LOAD_AHEAD=False, E4M3_PTX=False, BLOCK_M=1, BLOCK_N=64, BLOCK_K=128, VEC=8, PF_ROWS=16, PF_LINES=2,
          PF_STEP=32, INT4_FMA=True, EARLY_TILE=True,
          GROUP_SCALE=False, group_size=128)),
    (quant_gemv._gemv_kernel, dict(partial_ptr=f32, counter_ptr=i32, w_ptr=bf16, scale_ptr=f32, zero_ptr=bf16),
     dict(INT4=False, HAS_SCALE=False, HAS_BIAS=False, PARTIAL=True, USE_DOT=False, DOT_FP32=False, X_HALF=True,
          X_FP16=False, ASM=True, X_BF16_PAIRS=False, SLOT_DOT=False, HALF_FMA=False, REDUCE_CHUNK=8, FP8_WORDS=False,
          LOAD_AHEAD=False, E4M3_PTX=False, BLOCK_M=1, BLOCK_N=32, BLOCK_K=256, VEC=8, PF_ROWS=32, PF_LINES=8,
          PF_STEP=64, INT4_FMA=False, EARLY_TILE=True,
          GROUP_SCALE=False, group_size=1)),
    (quant_gemv._gemv_kernel, dict(partial_ptr=f32, counter_ptr=i32, w_ptr=fp8, scale_ptr=f32, zero_ptr=f32),
     dict(INT4=False, HAS_SCALE=True, HAS_BIAS=False, PARTIAL=True, USE_DOT=False, DOT_FP32=False, X_HALF=True,
          X_FP16=False, ASM=True, X_BF16_PAIRS=True, SLOT_DOT=False, HALF_FMA=False, REDUCE_CHUNK=8, FP8_WORDS=True,
          LOAD_AHEAD=True, E4M3_PTX=True, BLOCK_M=1, BLOCK_N=16, BLOCK_K=512, VEC=4, PF_ROWS=16, PF_LINES=16,
          PF_STEP=128, INT4_FMA=False, EARLY_TILE=True, GROUP_SCALE=False, group_size=1)),
    # FP8 with group scales (block-wise checkpoints) on the word path
    (quant_gemv._gemv_kernel, dict(partial_ptr=f32, counter_ptr=i32, w_ptr=fp8, scale_ptr=f32, zero_ptr=f32),
     dict(INT4=False, HAS_SCALE=True, HAS_BIAS=False, PARTIAL=True, USE_DOT=False, DOT_FP32=False, X_HALF=True,
          X_FP16=False, ASM=True, X_BF16_PAIRS=True, SLOT_DOT=False, HALF_FMA=False, REDUCE_CHUNK=8, FP8_WORDS=True,
          LOAD_AHEAD=False, E4M3_PTX=True, BLOCK_M=1, BLOCK_N=32, BLOCK_K=128, VEC=4, PF_ROWS=32, PF_LINES=4,
          PF_STEP=128, INT4_FMA=False, EARLY_TILE=True, GROUP_SCALE=True, group_size=128)),
    (quant_fp8._quantize_per_token_kernel, dict(out_ptr=fp8, scale_ptr=f32, min_scale="fp32"),
     dict(FP8_MAX_VALUE=448.0, BLOCK_K=4096)),
    # the norm and the activation writing their output's per-token FP8 copy too
    (norm._fused_add_rms_norm_kernel, dict(eps="fp32", fp8_ptr=fp8, fp8_scale_ptr=f32, min_scale="fp32"),
     dict(BLOCK_H=4096, QUANT=True, FP8_MAX_VALUE=448.0)),
    (activation._silu_and_mul_kernel, dict(fp8_ptr=fp8, fp8_scale_ptr=f32, min_scale="fp32"),
     dict(BLOCK=16384, QUANT=True, FP8_MAX_VALUE=448.0)),
    # the MoE decode kernels on bf16 experts, on FP8 experts with group scales (block-wise checkpoints), and on
    # int4 experts (GPTQ / AWQ)
    (moe._gate_up_act_kernel, dict(ids_ptr=i64, scale_ptr=f32),
     dict(TOP_K=8, BLOCK_N=16, BLOCK_K=256, LOAD_AHEAD=True, GROUP_SCALE=False, **BF16_OR_FP8)),
    (moe._down_reduce_kernel, dict(ids_ptr=i64, weights_ptr=f32, partial_ptr=f32, counter_ptr=i32, scale_ptr=f32),
     dict(TOP_K=8, BLOCK_N=32, BLOCK_K=256, LOAD_AHEAD=False, GROUP_SCALE=False, **BF16_OR_FP8)),
    (moe._gate_up_act_kernel, dict(w13_ptr=fp8, ids_ptr=i64, scale_ptr=f32),
     dict(TOP_K=8, BLOCK_N=16, BLOCK_K=128, LOAD_AHEAD=True, GROUP_SCALE=True, **BF16_OR_FP8)),
    (moe._down_reduce_kernel, dict(w2_ptr=fp8, ids_ptr=i64, weights_ptr=f32, partial_ptr=f32, counter_ptr=i32,
                                   scale_ptr=f32), dict(TOP_K=8, BLOCK_N=32, BLOCK_K=128, LOAD_AHEAD=False,
                                                        GROUP_SCALE=True, **BF16_OR_FP8)),
    # int4: gate_up_act summing in bf16x2 (HALF_FMA) and loading a step ahead, down_reduce in float32, steps of
    # several group sub-tiles
    (moe._gate_up_act_kernel, dict(w13_ptr=i32, ids_ptr=i64),
     dict(TOP_K=8, BLOCK_N=16, BLOCK_K=512, LOAD_AHEAD=True, GROUP_SCALE=False, INT4=True, SUB_K=128, WHOLE_SUBS=True, GROUP_SUBS=1, ASM=True,
          X_BF16_PAIRS=True, HALF_FMA=True)),
    (moe._down_reduce_kernel, dict(w2_ptr=i32, ids_ptr=i64, weights_ptr=f32, partial_ptr=f32, counter_ptr=i32),
     dict(TOP_K=8, BLOCK_N=32, BLOCK_K=256, LOAD_AHEAD=False, GROUP_SCALE=False, INT4=True, SUB_K=128, WHOLE_SUBS=True, GROUP_SUBS=1, ASM=True,
          X_BF16_PAIRS=True, HALF_FMA=False)),
    # the int4 GEMV's tensor-core path at one row (GemvConfig.mma), 8 columns a thread
    (quant_gemv._int4_mma_kernel, dict(partial_ptr=f32, counter_ptr=i32, w_ptr=i32, scale_ptr=bf16, zero_ptr=bf16),
     dict(group_size=128, HAS_BIAS=False, PARTIAL=True, ASM=True, REDUCE_CHUNK=8, BLOCK_M=1, THREADS=128, COLS=8,
          BLOCK_K=128, PF_ROWS=8, PF_LINES=2, PF_STEP=32)),
]
ok = [compile_kernel(*k) for k in kernels]
print("with griddepcontrol", sum(ok), "of", len(ok))
rotary_kernel, decode_kernel = kernels[5], kernels[6]
guards = [
    barrier_between(rotary_kernel[0], rotary_kernel[1], dict(rotary_kernel[2], NORM=False, USE_PDL=False),
                    "ld.global", "st.global"),
    # with the q/k norms the first store is the in-place normalisation's
    barrier_between(rotary_kernel[0], rotary_kernel[1], dict(rotary_kernel[2], USE_PDL=False), "ld.global",
                    "st.global"),
    barrier_between(rotary._rotary_kernel, kernels[3][1], dict(kernels[3][2], USE_PDL=False), "ld.global",
                    "st.global"),
    barrier_between(decode_kernel[0], decode_kernel[1], dict(decode_kernel[2], NUM_SPLITS=1, SPLITS_PAD=1,
                                                              USE_PDL=False), "st.global", "ld.global.cg"),
]
print("barriers", guards)
# the split-KV decode reads its cache's first block before the PDL wait (the latency the preload hides)
decode_lines = triton.compile(ASTSource(decode_kernel[0], {a: "constexpr" if a in decode_kernel[2] or a == "USE_PDL"
                                                           else decode_kernel[1].get(a, "*bf16" if a.endswith("_ptr")
                                                                                     else "i32")
                                                           for a in decode_kernel[0].arg_names},
                                        dict(decode_kernel[2], USE_PDL=True)), target=target).asm["ptx"].splitlines()
wait_line = next(i for i, line in enumerate(decode_lines) if "griddepcontrol.wait" in line)
print("decode loads before its wait", sum("ld.global" in line for line in decode_lines[:wait_line]))
# the decode GEMV's FMA paths load their first weight tile before the PDL wait (quant_gemv.FIRST_TILE_BEFORE_WAIT):
# the int4 and the FP8 load-ahead entries above, with EARLY_TILE and without it
def gemv_loads_before_wait(entry, early):
    fn, types, constants = entry
    signature = {a: "constexpr" if a in constants or a == "USE_PDL" else types.get(a, "*bf16" if a.endswith("_ptr")
                                                                                   else "i32") for a in fn.arg_names}
    lines = triton.compile(ASTSource(fn, signature, dict(constants, USE_PDL=True, EARLY_TILE=early)),
                           target=target).asm["ptx"].splitlines()
    wait = next(i for i, line in enumerate(lines) if "griddepcontrol.wait" in line)
    return sum("ld.global" in line for line in lines[:wait])
print("gemv loads before its wait", [gemv_loads_before_wait(kernels[i], early) for i in (8, 10) for early in (True, False)])
# the int4 MMA path: its first tile before the wait, the products on the tensor cores
mma_fn, mma_types, mma_constants = kernels[-1]
mma_lines = triton.compile(ASTSource(mma_fn, {a: "constexpr" if a in mma_constants or a == "USE_PDL" else mma_types.get(
    a, "*bf16" if a.endswith("_ptr") else "i32") for a in mma_fn.arg_names}, dict(mma_constants, USE_PDL=True)),
    target=target).asm["ptx"].splitlines()
mma_wait = next(i for i, line in enumerate(mma_lines) if "griddepcontrol.wait" in line)
print("gemv int4 mma loads before its wait", sum("ld.global" in line for line in mma_lines[:mma_wait]),
      "mma.sync", sum("mma.sync" in line for line in mma_lines))
int4_ahead = (kernels[8][0], kernels[8][1], dict(kernels[8][2], LOAD_AHEAD=True))  # the int4 load-ahead loop
print("gemv int4 load-ahead loads before its wait",
      [gemv_loads_before_wait(int4_ahead, early) for early in (True, False)])
# the MoE grouped GEMM (prefill; no PDL) on FP8 experts with group scales, and on int4 experts
grouped = moe._grouped_gemm_kernel
def grouped_ptx(weight_type, scale_type, **constants):
    return triton.compile(ASTSource(grouped, {a: "constexpr" if a.isupper() else dict(
        b_ptr=weight_type, weights_ptr=f32, scale_ptr=scale_type, sorted_ids_ptr=i32, block_expert_ptr=i32).get(
        a, "*bf16" if a.endswith("_ptr") else "i32") for a in grouped.arg_names}, dict(
        A_ROW_DIV=8, MUL_WEIGHT=True, DOT_F32=False, PRECISION="tf32", BLOCK_M=64, BLOCK_N=128, BLOCK_K=64,
        GROUP_M=8, **constants)), target=target).asm["ptx"]
for name, ptx in (("fp8", grouped_ptx(fp8, f32, GROUP_SCALE=True, INT4=False)),
                  ("int4", grouped_ptx(i32, bf16, GROUP_SCALE=False, INT4=True))):
    print(f"moe grouped {name} mma", "mma.sync" in ptx or "wgmma" in ptx)
# block-wise FP8's other kernels: the GEMV's tl.dot path with group scales (M > 1) and the dequantize above it
gemv_dot = dict(kernels[10][2], USE_DOT=True, FP8_WORDS=False, LOAD_AHEAD=False, E4M3_PTX=False, BLOCK_M=16,
                BLOCK_K=128, GROUP_SCALE=True, EARLY_TILE=False)
gemv_dot_ptx = triton.compile(ASTSource(quant_gemv._gemv_kernel, {a: "constexpr" if a in gemv_dot or a == "USE_PDL"
                                                                  else kernels[10][1].get(a, "*bf16" if a.endswith("_ptr") else "i32")
                                                                  for a in quant_gemv._gemv_kernel.arg_names},
                                        dict(gemv_dot, USE_PDL=True)), target=target).asm["ptx"]
dequant = quant_fp8._dequantize_groups_kernel
dequant_ptx = triton.compile(ASTSource(dequant, {a: "constexpr" if a.startswith("BLOCK") else dict(w_ptr=fp8, scale_ptr=f32).get(
    a, "*bf16" if a.endswith("_ptr") else "i32") for a in dequant.arg_names}, dict(BLOCK_N=32, BLOCK_K=128)),
    target=target).asm["ptx"]
print("fp8 group gemv dot mma", "mma.sync" in gemv_dot_ptx or "wgmma" in gemv_dot_ptx, "dequantize",
      "st.global" in dequant_ptx)
"""


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU tests run these kernels natively")
def test_pdl_kernels_compile_for_hopper_with_griddepcontrol(tmp_path):
    """Without a GPU: every decode-path kernel compiled for sm_90 with USE_PDL carries griddepcontrol.wait and
    launch_dependents in its PTX (and ptxas accepts it), the trigger before the wait in exactly the kernels that
    pdl.EARLY_LAUNCH_KERNELS names (rule 3; those writing an FP8 copy excepted) and after it elsewhere; the GEMV
    prefetches; the GEMV's FMA paths load their first weight tile before the wait (and none without
    EARLY_TILE), int4's load-ahead loop too; and a bar.sync separates the stores and loads of one program that
    other threads of it read back (run 51 found the one-split merge without it); the MoE kernels on FP8 experts with group scales and on int4
    experts (the decode kernels' bf16x2 and float32 word sums) compile (the grouped GEMM's product on the tensor
    cores); the int4 GEMV's MMA path loads its first tile before the wait and multiplies with mma.sync. About a minute on 2 loaded cores (a fresh Triton cache)."""
    import subprocess
    import sys

    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_CACHE_DIR": str(tmp_path)}
    run = subprocess.run([sys.executable, "-c", AHEAD_OF_TIME], env=env, capture_output=True, text=True, timeout=600)
    assert "with griddepcontrol 22 of 22" in run.stdout, (run.stdout[-3000:], run.stderr[-3000:])
    assert "barriers [True, True, True, True]" in run.stdout, (run.stdout[-3000:], run.stderr[-3000:])
    preloads = int(run.stdout.split("decode loads before its wait")[1].split()[0])
    assert preloads >= 4, run.stdout[-3000:]  # metadata, block table, K and V tiles
    int4_early, int4_late, fp8_early, fp8_late = (int(v) for v in run.stdout.split("gemv loads before its wait [")[1]
                                                  .split("]")[0].split(","))
    assert int4_early > 0 and fp8_early > 0 and int4_late == fp8_late == 0, run.stdout[-3000:]
    ahead_early, ahead_late = (int(v) for v in run.stdout.split("gemv int4 load-ahead loads before its wait [")[1]
                               .split("]")[0].split(","))
    assert ahead_early == int4_early and ahead_late == 0, run.stdout[-3000:]  # the same first tile, before the wait
    assert "moe grouped fp8 mma True" in run.stdout and "moe grouped int4 mma True" in run.stdout, run.stdout[-3000:]
    assert "fp8 group gemv dot mma True dequantize True" in run.stdout, run.stdout[-3000:]
    mma_preloads, mma_count = (int(v) for v in run.stdout.split("gemv int4 mma loads before its wait ")[1]
                               .split("\n")[0].split(" mma.sync "))
    # its first tile's words (4 chunks x 2 vectors), scales and zeros before the wait; 10 MMAs a chunk, 4 a step
    assert mma_preloads >= 8 and mma_count >= 40, run.stdout[-3000:]


# ----------------------------------------------------------------------------------------------------------------
# Split-KV decode attention in one launch (the last split to arrive merges)
# ----------------------------------------------------------------------------------------------------------------


def decode_batch(seq_lens, *, heads=4, kv_heads=2, head_dim=64, block_size=16, dtype=torch.float32,
                 cache_dtype=None, device=DEVICE):  # fmt: skip
    """q [B, H, D] (one query per sequence, strided as in a fused qkv), caches over shuffled block tables."""
    tables, num_blocks = shuffled_block_tables(seq_lens, block_size, spare_blocks=3, spare_columns=1)
    shape = (num_blocks, block_size, kv_heads, head_dim)
    if cache_dtype == FP8:
        k_cache, v_cache = random_fp8(shape, device), random_fp8(shape, device)
    else:
        k_cache, v_cache = (torch.randn(shape, dtype=dtype, device=device) for _ in range(2))
    qkv = torch.randn(len(seq_lens), heads + 2 * kv_heads, head_dim, dtype=dtype, device=device)
    qsl = torch.arange(len(seq_lens) + 1, dtype=torch.int32, device=device)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    return qkv[:, :heads], k_cache, v_cache, qsl, lens, tables.to(device)


def decode(batch, num_splits, fused, **kwargs):
    from asyncengine.kernels import attention

    return attention.paged_attention_decode(*batch, 0.125, num_splits, fused_reduce=fused, **kwargs)


@pytest.mark.parametrize("num_splits", [1, 5])
@pytest.mark.parametrize("dtype,cache_dtype", [(torch.float32, None), (torch.bfloat16, None), (torch.bfloat16, FP8)])
def test_fused_split_kv_decode_equals_the_two_kernels_bit_for_bit(num_splits, dtype, cache_dtype):
    from asyncengine.kernels import arrival_counters

    # e4m3 values reach ~300: k_scale keeps the scores in a realistic range (else one key takes all the weight)
    scales = dict(k_scale=0.01, v_scale=0.02) if cache_dtype == FP8 else {}
    batch = decode_batch([700, 5, 257, 64], dtype=dtype, cache_dtype=cache_dtype)  # some segments empty
    two = decode(batch, num_splits, False, **scales)
    fused = decode(batch, num_splits, True, **scales)
    assert same(fused, two)
    q, k_cache, v_cache, qsl, lens, tables = batch
    ref = reference.paged_attention(q, k_cache, v_cache, qsl, lens, tables, 0.125, None, None,
                                    scales.get("k_scale", 1.0), scales.get("v_scale", 1.0))
    assert_matches(fused, ref, ATTENTION_TOLERANCE)
    again = decode(batch, num_splits, True, **scales)  # the counters were left zeroed: the same result again
    assert same(again, fused)
    assert not arrival_counters("split-KV decode", q.device, 1).any(), "arrival counters not reset"


@pytest.mark.skipif(DEVICE != "cpu", reason="simulates the PDL wait in Triton's interpreter")
@pytest.mark.parametrize("where", ["first", "inside", "last", "next block"])
def test_split_kv_decode_reads_the_newest_key_after_the_pdl_wait(where, monkeypatch):
    """Under PDL the decode kernel loads its first block of keys before waiting for the previous kernel (the
    rotary + cache write), which may still be writing the step's newest key. Simulated in the interpreter: the
    newest key and value hold garbage when the program starts and are written by a stand-in for the wait. The
    output must be the attention over the written values (the preload's stale row is replaced after the wait)."""
    from asyncengine.kernels import attention

    block_n = attention.decode_tiles(True, 0)[0]  # the preloaded block's keys (float32 tiles, as here)
    seq_len = {"first": 1, "inside": block_n // 2 + 3, "last": block_n, "next block": block_n + 1}[where]
    batch = decode_batch([seq_len], heads=4, kv_heads=1)  # one program: it preloads before any wait ran
    q, k_cache, v_cache, qsl, lens, tables = batch
    block, offset = tables[0, (seq_len - 1) // 16].item(), (seq_len - 1) % 16
    written = k_cache[block, offset].clone(), v_cache[block, offset].clone()
    expected = reference.paged_attention(q, k_cache, v_cache, qsl, lens, tables, 0.125, None, None)
    k_cache[block, offset], v_cache[block, offset] = float("nan"), float("nan")  # not yet written

    def previous_kernel_finishes(USE_PDL):  # what griddepcontrol.wait guarantees: the write is visible
        k_cache[block, offset], v_cache[block, offset] = written

    monkeypatch.setattr(attention, "wait_for_prior_grids", previous_kernel_finishes)
    out = decode(batch, 1, True)
    assert_matches(out, expected, ATTENTION_TOLERANCE)


@pytest.mark.parametrize("window,softcap", [(40, None), (None, 30.0), (100, 20.0)])
def test_fused_split_kv_decode_with_window_and_softcap(window, softcap):
    batch = decode_batch([300, 17, 129])
    kwargs = dict(sliding_window=window, softcap=softcap)
    assert same(decode(batch, 4, True, **kwargs), decode(batch, 4, False, **kwargs))


def test_fused_split_kv_decode_of_a_sequence_does_not_depend_on_its_batch():
    """Batch invariance at a fixed split count: each sequence alone gives the bits it gets inside the batch."""
    seq_lens = [650, 33, 300]
    q, k_cache, v_cache, qsl, lens, tables = decode_batch(seq_lens)
    together = decode((q, k_cache, v_cache, qsl, lens, tables), 5, True)
    for b in range(len(seq_lens)):
        alone = decode((q[b : b + 1], k_cache, v_cache, qsl[:2], lens[b : b + 1], tables[b : b + 1]), 5, True)
        assert same(alone, together[b : b + 1]), f"sequence {b} changed with its batch"


def test_fused_split_kv_decode_skips_sequences_without_a_query():
    q, k_cache, v_cache, _, lens, tables = decode_batch([100, 60, 90])
    qsl = torch.tensor([0, 1, 1, 2], dtype=torch.int32, device=DEVICE)  # sequence 1 has no query this step
    out = torch.full((3, 4, 64), 7.0, device=DEVICE)
    batch = (q, k_cache, v_cache, qsl, lens, tables)
    from asyncengine.kernels import attention

    attention.paged_attention_decode(*batch, 0.125, 3, out=out)
    assert (out[2] == 7.0).all(), "a row past the last query was written"
    ref = reference.paged_attention(q[:2], k_cache, v_cache, qsl, lens, tables, 0.125)
    assert_matches(out[:2], ref, ATTENTION_TOLERANCE)
    assert same(decode(batch, 3, True), decode(batch, 3, True))  # and the counters of sequence 1 stayed zero


@pytest.mark.gpu
@needs_cuda
def test_gpu_fused_split_kv_decode_at_llama_sizes_in_a_cuda_graph():
    """64 sequences and one long one at 8B shapes (bf16 and FP8 caches): fused == two kernels bit for bit, and a
    captured graph replayed on new contexts keeps matching (the counters reset on every replay)."""
    from asyncengine.kernels import attention

    for cache_dtype in (None, FP8):
        scales = dict(k_scale=0.05, v_scale=0.04) if cache_dtype == FP8 else {}
        seq_lens = torch.randint(1, 4000, (64,)).tolist()
        batch = decode_batch(seq_lens, heads=HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM, dtype=torch.bfloat16,
                             cache_dtype=cache_dtype, device="cuda")
        for splits in (1, 4, attention.DECODE_MAX_SPLITS):
            fused, two = decode(batch, splits, True, **scales), decode(batch, splits, False, **scales)
            assert same(fused, two), (f"cache {cache_dtype}, {splits} splits: NaN {fused.isnan().sum().item()}, max "
                                      f"|fused - two kernels| {(fused.float() - two.float()).abs().max().item()}")
        one = decode_batch([3500], heads=HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM, dtype=torch.bfloat16,
                           cache_dtype=cache_dtype, device="cuda")
        q, k_cache, v_cache, qsl, lens, tables = one
        out = torch.empty_like(q)

        def step():
            attention.paged_attention(q, k_cache, v_cache, qsl, lens, tables, 0.125, max_query_len=1,
                                      max_seq_len=4096, out=out, **scales)

        step()  # compile and make the counters outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        for _ in range(3):
            lens.copy_(torch.randint(1, 3500, (1,), device="cuda", dtype=lens.dtype))
            q.copy_(torch.randn_like(q))
            graph.replay()
            splits = attention.decode_num_splits(1, KV_HEADS, 4096, torch.cuda.get_device_properties(0)
                                                 .multi_processor_count)
            assert same(out, decode(one, splits, False, **scales))

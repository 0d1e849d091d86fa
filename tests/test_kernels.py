"""Triton kernels against their torch references (`asyncengine.kernels.reference`).

Without CUDA the kernels run in Triton's interpreter at small sizes (TRITON_INTERPRET must be set before Triton
is imported, hence the top of this file); with CUDA the same tests run natively, and the `gpu` tests add real
Llama-3-8B sizes and CUDA-graph capture of the decode path.

Every test draws fresh random inputs and poisons outputs with NaN (torch.empty itself is patched to fill NaN),
so an element a kernel forgets to write fails the comparison.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

pytest.importorskip("triton")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

# (atol, rtol) per dtype. The interpreter rounds float32 -> bf16 toward zero (one ulp off torch's rounding).
TOLERANCE = {torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 2e-3), torch.bfloat16: (2e-2, 2e-2)}
ATTENTION_TOLERANCE = {torch.float32: (2e-4, 2e-4), torch.float16: (2e-3, 2e-3), torch.bfloat16: (2e-2, 2e-2)}
FLOAT_DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(autouse=True)
def nan_poisoned_empty(monkeypatch):
    """Make every floating torch.empty return NaNs, so unwritten outputs (and workspaces) show up."""
    # `with torch.device(...)` finds constructors in a set torch builds once, on first use: built while the
    # wrapper below stands in for torch.empty, it would miss the real one and place nothing (an engine built in a
    # poisoned test landed on the CPU). Build it now, with the real torch.empty.
    from torch.utils._device import _device_constructors

    _device_constructors()
    real_empty = torch.empty

    def empty(*args, **kwargs):
        tensor = real_empty(*args, **kwargs)
        if tensor.is_floating_point():
            tensor.fill_(float("nan"))
        return tensor

    monkeypatch.setattr(torch, "empty", empty)


def test_nan_poisoned_empty_leaves_device_contexts_placing_tensors():
    """Run alone in a fresh process, this failed before the fixture built torch's constructor set first."""
    with torch.device("meta"):
        assert torch.empty(2).device.type == "meta"


@pytest.fixture(autouse=True)
def fresh_seed():
    """A different seed per test run: the kernels must be right on any valid input."""
    seed = int.from_bytes(os.urandom(4), "little")
    torch.manual_seed(seed)
    return seed


def assert_matches(out: torch.Tensor, ref: torch.Tensor, tolerance=TOLERANCE) -> None:
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert not out.isnan().any(), "kernel left NaN (unwritten elements?)"
    atol, rtol = tolerance[ref.dtype]
    torch.testing.assert_close(out.float(), ref.float(), atol=atol, rtol=rtol)


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


# ----------------------------------------------------------------------------------------------------------------
# Elementwise and row-wise kernels
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_rms_norm_matches_reference_on_strided_rows(dtype):
    from asyncengine.kernels import norm, reference

    wide = torch.randn(7, 300, dtype=dtype, device=DEVICE)
    x = wide[:, :200]  # rows strided, H not a power of two
    weight = torch.randn(200, dtype=dtype, device=DEVICE)
    assert_matches(norm.rms_norm(x, weight, 1e-6), reference.rms_norm(x, weight, 1e-6))


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_rms_norm_per_head_reads_heads_in_place_from_a_strided_qkv(dtype):
    """[T, heads, D] read from a QKV output (rows qkv_size apart, heads D apart), many rows per program, the
    last program partly masked (T * heads not a multiple of its rows)."""
    from asyncengine.kernels import norm, reference

    tokens, heads, head_dim = 5, 3, 64
    qkv = torch.randn(tokens, heads * head_dim + 40, dtype=dtype, device=DEVICE)
    q = qkv[:, : heads * head_dim].unflatten(-1, (heads, head_dim))
    weight = torch.randn(head_dim, dtype=dtype, device=DEVICE)
    out = norm.rms_norm(q, weight, 1e-6)
    assert out.shape == (tokens, heads, head_dim) and out.is_contiguous()
    assert_matches(out, reference.rms_norm(q, weight, 1e-6))


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_fused_add_rms_norm_updates_residual_in_place(dtype):
    from asyncengine.kernels import norm, reference

    x = torch.randn(5, 256, dtype=dtype, device=DEVICE)
    residual = torch.randn(5, 256, dtype=dtype, device=DEVICE)
    weight = torch.randn(256, dtype=dtype, device=DEVICE)
    ref_out, ref_residual = reference.fused_add_rms_norm(x, residual.clone(), weight, 1e-5)
    out, new_residual = norm.fused_add_rms_norm(x, residual, weight, 1e-5)
    assert new_residual.data_ptr() == residual.data_ptr()
    assert_matches(new_residual, ref_residual)
    assert_matches(out, ref_out)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_silu_and_mul_matches_reference_across_column_blocks(dtype):
    from asyncengine.kernels import activation, reference

    x = torch.randn(3, 2 * 1500, dtype=dtype, device=DEVICE)  # I > one column block
    assert_matches(activation.silu_and_mul(x), reference.silu_and_mul(x))


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_rotary_embedding_in_place_on_strided_qkv_views(dtype):
    from asyncengine.kernels import reference, rotary

    tokens, heads, kv_heads, head_dim, max_pos = 6, 4, 2, 64, 128
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype, device=DEVICE)
    q, k = qkv[:, : heads * head_dim], qkv[:, heads * head_dim : (heads + kv_heads) * head_dim]
    cos_sin = torch.randn(max_pos, head_dim, device=DEVICE)
    positions = torch.randint(0, max_pos, (tokens,), device=DEVICE)
    v_before = qkv[:, (heads + kv_heads) * head_dim :].clone()
    ref_q, ref_k = reference.rotary_embedding(positions, q.clone(), k.clone(), cos_sin, head_dim)
    out_q, out_k = rotary.rotary_embedding(positions, q, k, cos_sin, head_dim)
    assert out_q.data_ptr() == q.data_ptr() and out_k.data_ptr() == k.data_ptr()
    assert_matches(q, ref_q)
    assert_matches(k, ref_k)
    assert torch.equal(qkv[:, (heads + kv_heads) * head_dim :], v_before), "v part of qkv was touched"


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_reshape_and_cache_writes_slots_and_skips_padding(dtype):
    from asyncengine.kernels import cache, reference

    tokens, kv_heads, head_dim, num_blocks, block_size = 9, 2, 64, 6, 16
    kv = torch.randn(tokens, 2, kv_heads, head_dim, dtype=dtype, device=DEVICE)
    key, value = kv[:, 0], kv[:, 1]  # strided views, as split from a fused projection
    slots = torch.randperm(num_blocks * block_size, device=DEVICE)[:tokens]
    slots[[2, 5]] = -1  # padding tokens
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, dtype=dtype, device=DEVICE)
    v_cache = torch.randn_like(k_cache)
    written = slots[slots >= 0]
    for c in (k_cache, v_cache):  # the slots to be written start as NaN
        c.view(-1, kv_heads, head_dim)[written] = float("nan")
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    reference.reshape_and_cache(key, value, ref_k, ref_v, slots)
    cache.reshape_and_cache(key, value, k_cache, v_cache, slots)
    assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)


# ----------------------------------------------------------------------------------------------------------------
# Paged attention
# ----------------------------------------------------------------------------------------------------------------


def make_batch(q_lens, seq_lens, *, heads=4, kv_heads=2, head_dim=64, block_size=16, dtype=torch.float32,
               spare_blocks=3, device=DEVICE):  # fmt: skip
    """Random q and paged K/V for sequences (q_len, seq_len), with shuffled, non-contiguous block tables.

    Returns (q [T, H, D], k_cache, v_cache, query_start_loc [B+1] int32, seq_lens [B] int32, block_tables
    [B, max_blocks + 1] int32 whose unused entries point at random (valid) blocks).
    """
    blocks_per_seq = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_seq) + spare_blocks
    order = torch.randperm(num_blocks)
    block_tables = torch.randint(0, num_blocks, (len(seq_lens), max(blocks_per_seq) + 1), dtype=torch.int32)
    used = 0
    for b, n in enumerate(blocks_per_seq):
        block_tables[b, :n] = order[used : used + n]
        used += n
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache = torch.randn(shape, dtype=dtype, device=device)
    v_cache = torch.randn(shape, dtype=dtype, device=device)
    starts = [0]
    for n in q_lens:
        starts.append(starts[-1] + n)
    q = torch.randn(starts[-1], heads, head_dim, dtype=dtype, device=device)
    query_start_loc = torch.tensor(starts, dtype=torch.int32, device=device)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    return q, k_cache, v_cache, query_start_loc, lens, block_tables.to(device)


def check_attention(batch, scale, **kwargs):
    from asyncengine.kernels import attention, reference

    q, k_cache, v_cache, qsl, seq_lens, block_tables = batch
    out = attention.paged_attention(q, k_cache, v_cache, qsl, seq_lens, block_tables, scale, **kwargs)
    ref = reference.paged_attention(q, k_cache, v_cache, qsl, seq_lens, block_tables, scale)
    assert_matches(out, ref, ATTENTION_TOLERANCE)
    return out


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("give_max_lens", [True, False])
def test_attention_mixed_batch_prefill_chunked_prefill_and_decodes(dtype, give_max_lens):
    # A fresh prefill, a chunked prefill over a cached prefix, and two decodes; lengths off block boundaries.
    q_lens, seq_lens = [13, 21, 1, 1], [13, 70, 33, 17]
    batch = make_batch(q_lens, seq_lens, dtype=dtype)
    hints = dict(max_query_len=max(q_lens), max_seq_len=max(seq_lens)) if give_max_lens else {}
    check_attention(batch, 0.125, **hints)


@pytest.mark.parametrize(
    "heads, kv_heads, head_dim, block_size",
    [(4, 2, 64, 8), (6, 2, 32, 32), (8, 1, 128, 16), (2, 2, 48, 16)],
    ids=["gqa2-bs8", "group3-bs32", "mqa-d128", "mha-d48"],
)
def test_attention_prefill_spans_several_query_tiles(heads, kv_heads, head_dim, block_size):
    # 150 queries over 2-3 tiles of one sequence, behind a 37-token cached prefix, plus a short prefill.
    batch = make_batch([150, 3], [187, 3], heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                       block_size=block_size)  # fmt: skip
    check_attention(batch, head_dim**-0.5)


def test_attention_skips_sequences_without_queries():
    batch = make_batch([4, 0, 5], [20, 9, 5])
    check_attention(batch, 0.1)


def test_attention_accepts_strided_q_and_out_buffer():
    from asyncengine.kernels import attention, reference

    q, k_cache, v_cache, qsl, seq_lens, block_tables = make_batch([7, 1], [30, 12], dtype=torch.bfloat16)
    qkv = torch.randn(q.shape[0], 8, 64, dtype=q.dtype, device=DEVICE)
    q = qkv[:, :4]  # token stride 8 * 64, as q.view() of a fused qkv slice
    out = torch.full((q.shape[0], 4, 64), float("nan"), dtype=q.dtype, device=DEVICE)
    got = attention.paged_attention(q, k_cache, v_cache, qsl, seq_lens, block_tables, 0.125, out=out)
    assert got is out
    assert_matches(out, reference.paged_attention(q, k_cache, v_cache, qsl, seq_lens, block_tables, 0.125),
                   ATTENTION_TOLERANCE)  # fmt: skip


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("num_splits", [1, 3, 8])
def test_attention_decode_split_kv_matches_reference(dtype, num_splits):
    from asyncengine.kernels import attention, reference

    # Long-ish contexts, one much shorter than the split count needs (so some segments are empty).
    q, k_cache, v_cache, qsl, seq_lens, block_tables = make_batch([1, 1, 1], [700, 5, 257], dtype=dtype)
    out = attention.paged_attention_decode(q, k_cache, v_cache, qsl, seq_lens, block_tables, 0.125, num_splits)
    ref = reference.paged_attention(q, k_cache, v_cache, qsl, seq_lens, block_tables, 0.125)
    assert_matches(out, ref, ATTENTION_TOLERANCE)


@pytest.mark.parametrize("give_max_lens", [True, False])
def test_attention_launcher_takes_decode_path_for_single_token_queries(give_max_lens, monkeypatch):
    from asyncengine.kernels import attention

    taken = []
    real = attention._launch_decode
    monkeypatch.setattr(attention, "_launch_decode", lambda *a, **kw: taken.append(a[-2]) or real(*a, **kw))
    batch = make_batch([1, 1], [600, 130], heads=8, kv_heads=2)
    hints = dict(max_query_len=1, max_seq_len=600) if give_max_lens else {}
    check_attention(batch, 0.125, **hints)
    assert taken and taken[0] >= 1


def test_decode_num_splits_depends_on_host_bounds_only():
    from asyncengine.kernels.attention import DECODE_MAX_SPLITS, decode_num_splits

    assert decode_num_splits(1, 8, 60, 132) == 1  # too short to split
    assert 1 < decode_num_splits(1, 8, 4096, 132) <= DECODE_MAX_SPLITS  # few long sequences fill the GPU
    assert decode_num_splits(256, 8, 4096, 132) == 1  # enough programs already
    assert decode_num_splits(0, 8, 0, 132) == 1


def test_cache_write_then_attention_over_it():
    """The layer's order: write this step's K/V with reshape_and_cache, then attend over the paged cache."""
    from asyncengine.kernels import cache, reference

    q_lens, seq_lens, block_size = [5, 1, 3], [5, 40, 19], 16
    q, k_cache, v_cache, qsl, lens, block_tables = make_batch(q_lens, seq_lens, dtype=torch.bfloat16)
    slots = []
    for b, (q_len, seq_len) in enumerate(zip(q_lens, seq_lens)):
        for pos in range(seq_len - q_len, seq_len):
            slots.append(int(block_tables[b, pos // block_size]) * block_size + pos % block_size)
    slot_mapping = torch.tensor(slots + [-1], device=DEVICE)  # one padding token at the end
    new_k = torch.randn(len(slots) + 1, 2, 64, dtype=q.dtype, device=DEVICE)
    new_v = torch.randn_like(new_k)
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    reference.reshape_and_cache(new_k, new_v, ref_k, ref_v, slot_mapping)
    cache.reshape_and_cache(new_k, new_v, k_cache, v_cache, slot_mapping)
    check_attention((q, k_cache, v_cache, qsl, lens, block_tables), 0.125, max_query_len=5, max_seq_len=40)


# -- sliding window and soft-capping ----------------------------------------------------------------------------


def poison_outside_window(batch, q_lens, seq_lens, window):
    """Fill with NaN the blocks that lie wholly before every query's window (blocks the engine may have freed and
    handed to another request), and point every unused table entry at a clean spare block: a kernel that reads a
    freed block, even masked, then outputs NaN."""
    q, k_cache, v_cache, qsl, lens, block_tables = batch
    block_size = k_cache.shape[1]
    owned = {int(block_tables[b, i]) for b, n in enumerate(seq_lens) for i in range(-(-n // block_size))}
    spare = min(set(range(k_cache.shape[0])) - owned)
    for b, (q_len, seq_len) in enumerate(zip(q_lens, seq_lens)):
        first_visible = max(0, seq_len - q_len - window + 1)
        block_tables[b, -(-seq_len // block_size):] = spare
        for i in range(first_visible // block_size):
            k_cache[block_tables[b, i]] = float("nan")
            v_cache[block_tables[b, i]] = float("nan")
    return batch


def naive_paged_attention(batch, scale, window=None, softcap=None):
    """Row by row: the query at position p over keys max(0, p - window + 1)..p read slot by slot, capped scores."""
    q, k_cache, v_cache, qsl, lens, block_tables = (t.cpu() for t in batch)
    block_size, group = k_cache.shape[1], q.shape[1] // k_cache.shape[2]
    out = torch.zeros(q.shape, dtype=torch.float64)
    for b in range(len(lens)):
        start, end, seq_len = int(qsl[b]), int(qsl[b + 1]), int(lens[b])
        for row in range(start, end):
            p = seq_len - (end - start) + (row - start)
            keys = range(0 if window is None else max(0, p - window + 1), p + 1)
            slots = [(int(block_tables[b, j // block_size]), j % block_size) for j in keys]
            k = torch.stack([k_cache[blk, off] for blk, off in slots]).double().repeat_interleave(group, 1)
            v = torch.stack([v_cache[blk, off] for blk, off in slots]).double().repeat_interleave(group, 1)
            scores = torch.einsum("hd,khd->hk", q[row].double(), k) * scale  # [H, keys]
            if softcap is not None:
                scores = torch.tanh(scores / softcap) * softcap
            out[row] = torch.einsum("hk,khd->hd", torch.softmax(scores, -1), v)
    return out.to(q.dtype)


WINDOW_CASES = pytest.mark.parametrize("window, softcap", [(8, None), (None, 2.0), (20, 3.0)],
                                       ids=["window8", "softcap2", "window20-softcap3"])


@WINDOW_CASES
def test_reference_window_and_softcap_match_a_naive_row_by_row_attention(window, softcap):
    from asyncengine.kernels import reference

    q_lens, seq_lens = [13, 9, 1, 1], [13, 45, 33, 6]
    batch = make_batch(q_lens, seq_lens, block_size=4, spare_blocks=1)
    if window is not None:
        poison_outside_window(batch, q_lens, seq_lens, window)
    q, k_cache, v_cache, qsl, lens, tables = batch
    ref = reference.paged_attention(q, k_cache, v_cache, qsl.cpu(), lens.cpu(), tables, 0.3, window, softcap)
    assert_matches(ref, naive_paged_attention(batch, 0.3, window, softcap), ATTENTION_TOLERANCE)


@WINDOW_CASES
@pytest.mark.parametrize("give_max_lens", [True, False])
def test_attention_window_and_softcap_match_reference_without_reading_freed_blocks(window, softcap, give_max_lens):
    """A fresh prompt longer than the window, chunks behind a cached prefix that starts before and inside the
    window, decodes; blocks wholly outside every query's window are NaN (freed) and must not be read."""
    from asyncengine.kernels import attention, reference

    q_lens, seq_lens = [40, 9, 70, 1, 1, 1], [40, 75, 140, 33, 6, 90]
    batch = make_batch(q_lens, seq_lens, block_size=8, spare_blocks=1)
    if window is not None:
        poison_outside_window(batch, q_lens, seq_lens, window)
    q, k_cache, v_cache, qsl, lens, tables = batch
    hints = dict(max_query_len=max(q_lens), max_seq_len=max(seq_lens)) if give_max_lens else {}
    out = attention.paged_attention(q, k_cache, v_cache, qsl, lens, tables, 0.2, sliding_window=window,
                                    softcap=softcap, **hints)
    ref = reference.paged_attention(q, k_cache, v_cache, qsl.cpu(), lens.cpu(), tables, 0.2, window, softcap)
    assert_matches(out, ref, ATTENTION_TOLERANCE)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_attention_decode_split_kv_with_window_and_softcap(num_splits):
    from asyncengine.kernels import attention, reference

    q_lens, seq_lens = [1, 1, 1], [300, 5, 129]
    batch = poison_outside_window(make_batch(q_lens, seq_lens, spare_blocks=1), q_lens, seq_lens, 50)
    q, k_cache, v_cache, qsl, lens, tables = batch
    out = attention.paged_attention_decode(q, k_cache, v_cache, qsl, lens, tables, 0.125, num_splits,
                                           sliding_window=50, softcap=4.0)
    ref = reference.paged_attention(q, k_cache, v_cache, qsl.cpu(), lens.cpu(), tables, 0.125, 50, 4.0)
    assert_matches(out, ref, ATTENTION_TOLERANCE)


def naive_bidirectional(q, k, v, lens, scale):
    """Per sequence, every query over every key of its own sequence (plain softmax), as encoders attend."""
    out, start = [], 0
    for n in lens:
        qs, ks, vs = (t[start : start + n].float().transpose(0, 1) for t in (q, k, v))  # [h, n, D]
        ks = ks.repeat_interleave(q.shape[1] // k.shape[1], dim=0)
        vs = vs.repeat_interleave(q.shape[1] // k.shape[1], dim=0)
        out.append((torch.softmax(qs @ ks.transpose(1, 2) * scale, -1) @ vs).transpose(0, 1))
        start += n
    return torch.cat(out).to(q.dtype)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(4, 4, 32), (4, 2, 64)], ids=["mha-d32", "gqa2-d64"])
def test_varlen_attention_sees_the_whole_sequence_in_both_directions(dtype, heads, kv_heads, head_dim):
    """Encoders: the 2D kernel without its causal mask, over k and v read in place from a fused qkv tensor."""
    from asyncengine.kernels import attention, reference

    lens = [1, 37, 70, 5]  # off tile boundaries, one sequence longer than a KV tile
    tokens = sum(lens)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype, device=DEVICE)
    q, k, v = (t.view(tokens, -1, head_dim) for t in qkv.split([heads * head_dim, kv_heads * head_dim,
                                                               kv_heads * head_dim], dim=-1))
    qsl = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    ref = reference.varlen_attention(q, k, v, qsl, 0.125)
    assert_matches(ref, naive_bidirectional(q, k, v, lens, 0.125), ATTENTION_TOLERANCE)
    out = attention.varlen_attention(q, k, v, qsl.to(DEVICE), 0.125, max_len=max(lens))
    assert_matches(out, ref, ATTENTION_TOLERANCE)


def test_available_reports_true_here():
    from asyncengine import kernels

    assert kernels.available()


# ----------------------------------------------------------------------------------------------------------------
# GPU: Llama-3-8B sizes (32 heads, 8 kv heads, D = 128, hidden 4096, intermediate 14336), bf16
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@needs_cuda
def test_gpu_norm_activation_rotary_cache_at_llama_sizes():
    from asyncengine.kernels import activation, cache, norm, reference, rotary

    dtype, tokens = torch.bfloat16, 512
    x = torch.randn(tokens, 4096, dtype=dtype, device="cuda")
    residual = torch.randn_like(x)
    weight = torch.randn(4096, dtype=dtype, device="cuda")
    assert_matches(norm.rms_norm(x, weight, 1e-5), reference.rms_norm(x, weight, 1e-5))
    ref_out, ref_res = reference.fused_add_rms_norm(x, residual.clone(), weight, 1e-5)
    out, res = norm.fused_add_rms_norm(x, residual, weight, 1e-5)
    assert_matches(out, ref_out)
    assert_matches(res, ref_res)
    qkv = torch.randn(tokens + 3, (16 + 2 * 8) * 128, dtype=dtype, device="cuda")  # Qwen3-0.6B's q/k norms
    q, head_weight = qkv[:, : 16 * 128].unflatten(-1, (16, 128)), torch.randn(128, dtype=dtype, device="cuda")
    assert_matches(norm.rms_norm(q, head_weight, 1e-6), reference.rms_norm(q, head_weight, 1e-6))

    gate_up = torch.randn(tokens, 2 * 14336, dtype=dtype, device="cuda")
    assert_matches(activation.silu_and_mul(gate_up), reference.silu_and_mul(gate_up))

    qkv = torch.randn(tokens, (32 + 16) * 128, dtype=dtype, device="cuda")
    q, k = qkv[:, : 32 * 128], qkv[:, 32 * 128 : 40 * 128]
    cos_sin = torch.randn(8192, 128, device="cuda")
    positions = torch.randint(0, 8192, (tokens,), device="cuda")
    ref_q, ref_k = reference.rotary_embedding(positions, q.clone(), k.clone(), cos_sin, 128)
    rotary.rotary_embedding(positions, q, k, cos_sin, 128)
    assert_matches(q, ref_q)
    assert_matches(k, ref_k)

    k_cache = torch.randn(2048, 16, 8, 128, dtype=dtype, device="cuda")
    v_cache = torch.randn_like(k_cache)
    slots = torch.randperm(2048 * 16, device="cuda")[:tokens]
    slots[::7] = -1
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    new_k, new_v = qkv[:, 32 * 128 : 40 * 128].view(tokens, 8, 128), qkv[:, 40 * 128 :].view(tokens, 8, 128)
    reference.reshape_and_cache(new_k, new_v, ref_k, ref_v, slots)
    cache.reshape_and_cache(new_k, new_v, k_cache, v_cache, slots)
    assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)


def attention_error_vs_fp32_reference(batch, **hints) -> float:
    """Relative error of the bf16 kernel against the reference run on float32 copies of the same inputs."""
    from asyncengine.kernels import attention, reference

    q, k_cache, v_cache, qsl, seq_lens, block_tables = batch
    out = attention.paged_attention(q, k_cache, v_cache, qsl, seq_lens, block_tables, 128**-0.5, **hints)
    ref = reference.paged_attention(q.float(), k_cache.float(), v_cache.float(), qsl, seq_lens, block_tables,
                                    128**-0.5)  # fmt: skip
    assert not out.isnan().any()
    return rel_error(out, ref)


@pytest.mark.gpu
@needs_cuda
def test_gpu_attention_mixed_batch_at_llama_sizes():
    q_lens, seq_lens = [2048, 512, 1, 1, 1, 1], [2048, 2048, 3000, 1, 777, 4096]
    batch = make_batch(q_lens, seq_lens, heads=32, kv_heads=8, head_dim=128, dtype=torch.bfloat16)
    assert attention_error_vs_fp32_reference(batch, max_query_len=2048, max_seq_len=4096) < 1e-2
    assert attention_error_vs_fp32_reference(batch) < 1e-2


@pytest.mark.gpu
@needs_cuda
def test_gpu_attention_decode_batch_at_llama_sizes():
    seq_lens = torch.randint(1, 4000, (64,)).tolist()
    batch = make_batch([1] * 64, seq_lens, heads=32, kv_heads=8, head_dim=128, dtype=torch.bfloat16)
    assert attention_error_vs_fp32_reference(batch, max_query_len=1, max_seq_len=4096) < 1e-2
    one = make_batch([1], [3500], heads=32, kv_heads=8, head_dim=128, dtype=torch.bfloat16)
    assert attention_error_vs_fp32_reference(one, max_query_len=1, max_seq_len=4096) < 1e-2


@pytest.mark.gpu
@needs_cuda
def test_gpu_attention_decode_is_cuda_graph_capturable():
    from asyncengine.kernels import attention, reference

    batch = make_batch([1] * 8, [1000] * 8, heads=32, kv_heads=8, head_dim=128, dtype=torch.bfloat16)
    q, k_cache, v_cache, qsl, seq_lens, block_tables = batch
    out = torch.empty_like(q)

    def step():
        attention.paged_attention(q, k_cache, v_cache, qsl, seq_lens, block_tables, 0.1, max_query_len=1,
                                  max_seq_len=block_tables.shape[1] * 16, out=out)  # fmt: skip

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # compile outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    # New inputs in the same buffers: shorter contexts and new queries, then replay.
    seq_lens.copy_(torch.randint(1, 1000, (8,), device="cuda", dtype=seq_lens.dtype))
    q.copy_(torch.randn_like(q))
    graph.replay()
    torch.cuda.synchronize()
    ref = reference.paged_attention(q, k_cache, v_cache, qsl, seq_lens, block_tables, 0.1)
    assert_matches(out, ref, ATTENTION_TOLERANCE)


@pytest.mark.gpu
@needs_cuda
def test_gpu_attention_window_and_softcap_at_gemma2_sizes():
    """Gemma-2-9B's attention (16 query heads over 8 kv heads, head_dim 256, window 4096, soft-cap 50) in bf16
    against the float32 reference: a mixed batch with prompts past the window, and a decode batch."""
    from asyncengine.kernels import attention, reference

    for q_lens, seq_lens in (([3000, 700, 1, 1, 1], [5000, 6000, 4097, 9000, 100]), ([1] * 32, [8000] * 32)):
        batch = make_batch(q_lens, seq_lens, heads=16, kv_heads=8, head_dim=256, dtype=torch.bfloat16,
                           spare_blocks=1)
        poison_outside_window(batch, q_lens, seq_lens, 4096)
        q, k_cache, v_cache, qsl, lens, tables = batch
        out = attention.paged_attention(q, k_cache, v_cache, qsl, lens, tables, 256**-0.5, sliding_window=4096,
                                        softcap=50.0, max_query_len=max(q_lens), max_seq_len=max(seq_lens))
        ref = reference.paged_attention(q.float(), k_cache.float(), v_cache.float(), qsl.cpu(), lens.cpu(), tables,
                                        256**-0.5, 4096, 50.0)
        assert not out.isnan().any()
        assert rel_error(out, ref) < 1e-2


# ----------------------------------------------------------------------------------------------------------------
# Fused mixture of experts
# ----------------------------------------------------------------------------------------------------------------


def naive_moe(hidden, w13, w2, topk_weights, topk_ids):
    """Token by token, expert by expert, in float64: the definition the reference must meet."""
    out = torch.zeros(hidden.shape, dtype=torch.float64, device=hidden.device)
    inter = w13.shape[1] // 2
    for t in range(hidden.shape[0]):
        for weight, expert in zip(topk_weights[t].tolist(), topk_ids[t].tolist()):
            gate_up = w13[expert].double() @ hidden[t].double()
            act = torch.nn.functional.silu(gate_up[:inter]) * gate_up[inter:]
            out[t] += weight * (w2[expert].double() @ act)
    return out


# Two chained GEMMs with bf16 intermediates: an intermediate that rounds the other way (its float32 sum ran in
# another order) moves an output by a few bf16 ulps, so elementwise bf16 bounds are wider than TOLERANCE's.
# The interpreter also truncates each float32 -> bf16 rounding (gate_up, act, down: about 0.4% low each, so ~1.5%
# in all); a GPU rounds to nearest, unbiased.
MOE_TOLERANCE = {torch.float32: (1e-4, 1e-4), torch.bfloat16: (6e-2, 6e-2)}
MOE_BF16_REL_ERROR = 3e-2 if not torch.cuda.is_available() else 1e-2


def make_moe(tokens, experts, top_k, hidden, inter, dtype=torch.float32, device=DEVICE):
    """Random inputs and expert weights (scaled so outputs are O(1)), and a random top-k routing per token."""
    x = torch.randn(tokens, hidden, dtype=dtype, device=device)
    w13 = (torch.randn(experts, 2 * inter, hidden, device=device) * hidden**-0.5).to(dtype)
    w2 = (torch.randn(experts, hidden, inter, device=device) * inter**-0.5).to(dtype)
    topk_ids = torch.rand(tokens, experts, device=device).topk(top_k, dim=-1).indices
    topk_weights = torch.softmax(torch.randn(tokens, top_k, device=device), dim=-1)
    return x, w13, w2, topk_weights, topk_ids


def test_moe_reference_matches_naive_definition():
    from asyncengine.kernels import reference

    args = make_moe(9, 6, 2, 32, 24, device="cpu")
    out = reference.fused_moe(*args)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), naive_moe(*args), atol=1e-5, rtol=1e-5)


def test_moe_align_groups_assignments_by_expert_in_padded_blocks():
    from asyncengine.kernels.moe import align_by_expert

    topk_ids = torch.tensor([[3, 0], [3, 1], [0, 3], [3, 2]], device=DEVICE)  # expert 3 four times, 4 unused
    sorted_ids, block_expert = align_by_expert(topk_ids, num_experts=5, block_m=4)
    n = topk_ids.numel()
    assert sorted_ids.numel() % 4 == 0 and sorted_ids.numel() >= n + 4 * 3
    blocks = sorted_ids.view(-1, 4).tolist()
    flat = topk_ids.reshape(-1).tolist()
    seen = []
    for block, expert in zip(blocks, block_expert.tolist()):
        real = [i for i in block if i < n]
        if expert < 0:
            assert not real, "a block past the last expert holds assignments"
            continue
        assert all(flat[i] == expert for i in real) and real == sorted(real), (block, expert)
        seen += real
    assert sorted(seen) == list(range(n)), "every assignment appears exactly once"
    assert [e for e in block_expert.tolist() if e >= 0] == [0, 1, 2, 3]  # one block each; expert 3 fills one


def force_moe_path(monkeypatch, path: str) -> None:
    """Run fused_moe through the grouped GEMMs or through the decode kernels, whatever the batch size."""
    from asyncengine.kernels import moe

    monkeypatch.setattr(moe, "DECODE_MAX_TOKENS", 0 if path == "grouped" else 10**6)


MOE_CASES = {  # (tokens, experts, top_k, hidden, inter), sizes off tile boundaries
    "decode-top2": (1, 8, 2, 64, 48),
    "few-tokens-many-experts": (5, 16, 4, 48, 32),
    "top1-hidden-over-k-tiles": (3, 4, 1, 300, 20),
    "prefill-tiles": (70, 4, 2, 32, 80),  # several M blocks per expert, prefill tiles (grouped path only)
}


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("path, case", [(p, c) for c in MOE_CASES for p in ("grouped", "decode")
                                        if not (p == "decode" and c == "prefill-tiles")])  # fmt: skip
def test_fused_moe_matches_reference(dtype, path, case, monkeypatch):
    from asyncengine.kernels import moe, reference

    force_moe_path(monkeypatch, path)
    args = make_moe(*MOE_CASES[case], dtype)
    out, ref = moe.fused_moe(*args), reference.fused_moe(*args)
    assert_matches(out, ref, MOE_TOLERANCE)
    assert rel_error(out, ref) < (1e-5 if dtype == torch.float32 else MOE_BF16_REL_ERROR)


@pytest.mark.parametrize("path, tokens", [("grouped", 40), ("decode", 6)])
def test_fused_moe_when_every_token_picks_the_same_experts(path, tokens, monkeypatch):
    """Load imbalance and repeated ids: all tokens on experts 2 and 2 again (one expert, many blocks)."""
    from asyncengine.kernels import moe, reference

    force_moe_path(monkeypatch, path)
    x, w13, w2, weights, _ = make_moe(tokens, 6, 2, 32, 16)
    ids = torch.full((tokens, 2), 2, device=DEVICE)
    assert_matches(moe.fused_moe(x, w13, w2, weights, ids), reference.fused_moe(x, w13, w2, weights, ids),
                   MOE_TOLERANCE)


def test_fused_moe_launches_the_same_kernels_whatever_the_routing(monkeypatch):
    """No batch launches one kernel per expert: decode-sized batches take the two decode kernels, larger ones two
    grouped GEMMs, however many experts are hit."""
    from asyncengine.kernels import moe

    calls = []
    for name in ("_grouped_gemm", "_fused_moe_decode"):
        real = getattr(moe, name)
        monkeypatch.setattr(moe, name, lambda *a, real=real, name=name: calls.append(name) or real(*a))
    moe.fused_moe(*make_moe(4, 16, 4, 16, 16))  # up to 16 experts hit
    assert calls == ["_fused_moe_decode"]
    calls.clear()
    moe.fused_moe(*make_moe(moe.DECODE_MAX_TOKENS + 1, 16, 4, 16, 16))
    assert calls == ["_grouped_gemm", "_grouped_gemm"]


@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("experts, top_k", [(128, 8), (60, 4), (8, 2)], ids=["qwen3", "qwen2-60", "mixtral"])
def test_topk_softmax_matches_reference_routing(experts, top_k, renormalize):
    from asyncengine.kernels import moe, reference

    logits = torch.randn(9, experts, device=DEVICE) * 3  # float32: no ties
    weights, ids = moe.topk_softmax(logits, top_k, renormalize)
    ref_weights, ref_ids = reference.topk_softmax(logits, top_k, renormalize)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights, ref_weights, atol=1e-6, rtol=1e-5)


def test_topk_softmax_breaks_ties_toward_the_lowest_expert():
    from asyncengine.kernels import moe

    logits = torch.zeros(3, 60, dtype=torch.bfloat16, device=DEVICE)  # every expert tied
    logits[1, [7, 3, 50]] = 1.0  # three tied at the top, then 57 tied below
    weights, ids = moe.topk_softmax(logits, 4, renormalize=True)
    assert ids.tolist() == [[0, 1, 2, 3], [3, 7, 50, 0], [0, 1, 2, 3]]
    torch.testing.assert_close(weights[0], torch.full((4,), 0.25, device=DEVICE))
    assert weights[1, 0] == weights[1, 1] == weights[1, 2] > weights[1, 3]


def decode_inputs(tokens, dtype, renormalize, experts=16, top_k=4, hidden=40, inter=24):
    """Random x and experts (small: the interpreter runs one program at a time), routed by moe.route on a random
    router (split over K: num_sms=64)."""
    from asyncengine.kernels import moe

    x, w13, w2, _, _ = make_moe(tokens, experts, top_k, hidden, inter, dtype)
    gate = (torch.randn(experts, hidden, device=DEVICE) * hidden**-0.5).to(dtype)
    weights, ids = moe.route(x, gate, top_k, renormalize, num_sms=64)
    return x, w13, w2, weights, ids


@pytest.mark.parametrize("dtype, renormalize", [(torch.float32, True), (torch.bfloat16, False)])
def test_decode_moe_matches_reference_across_decode_batch_sizes(dtype, renormalize):
    """T from 1 to 16 through the decode kernels (down_reduce's last-arriving reduction over the top-k)."""
    from asyncengine.kernels import moe, reference

    for tokens in (1, 2, 3, 8, 13, moe.DECODE_MAX_TOKENS):
        args = decode_inputs(tokens, dtype, renormalize)
        out, ref = moe.fused_moe(*args), reference.fused_moe(*args)
        assert_matches(out, ref, MOE_TOLERANCE)
        assert rel_error(out, ref) < (1e-5 if dtype == torch.float32 else MOE_BF16_REL_ERROR), tokens


# (block_n, block_k, num_warps, load_ahead) of gate_up_act and down_reduce
DECODE_TILES = [((8, 16, 2), (16, 16, 1)), ((32, 256, 4), (64, 128, 8)), ((8, 16, 2, True), (16, 16, 1, True)),
                ((32, 256, 4, True), (64, 128, 8, True))]


@pytest.mark.parametrize("tiles", DECODE_TILES, ids=str)
def test_decode_moe_matches_reference_under_narrow_and_wide_tiles(tiles):
    """Tiles narrower and wider than H (40) and I (24): column and K tails masked in both kernels."""
    from asyncengine.kernels import moe, reference

    config = moe.DecodeConfig(moe.GemvTiles(*tiles[0]), moe.GemvTiles(*tiles[1]))
    x, w13, w2, weights, ids = decode_inputs(3, torch.float32, True)
    out = moe._fused_moe_decode(x, w13, w2, weights.reshape(-1), ids.reshape(-1), 4, config)
    assert_matches(out, reference.fused_moe(x, w13, w2, weights, ids), MOE_TOLERANCE)


@pytest.mark.parametrize("tiles", [((8, 16, 2), (16, 16, 1)), ((16, 32, 4), (8, 8, 2))], ids=str)
def test_decode_moe_loading_ahead_gives_the_same_bits(tiles):
    """GemvTiles.load_ahead moves when each weight tile is loaded, not the order of any sum: the same bits."""
    from asyncengine.kernels import moe

    x, w13, w2, weights, ids = decode_inputs(3, torch.bfloat16, True)
    outs = [moe._fused_moe_decode(x, w13, w2, weights.reshape(-1), ids.reshape(-1), 4, moe.DecodeConfig(
        moe.GemvTiles(*tiles[0], load_ahead=ahead), moe.GemvTiles(*tiles[1], load_ahead=ahead)))
        for ahead in (False, True)]
    assert torch.equal(outs[0], outs[1])


def test_decode_moe_is_deterministic_and_leaves_its_counters_zeroed():
    """The reduction sums a token's assignments in a fixed order whichever program arrives last, and resets the
    arrival counters (a CUDA-graph replay must find them zeroed)."""
    from asyncengine.kernels import moe

    args = decode_inputs(3, torch.bfloat16, True)
    first = moe.fused_moe(*args)
    assert torch.equal(moe.fused_moe(*args), first)
    assert not moe.counters(first.device).any()


@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("experts, top_k, hidden", [(128, 8, 1000), (60, 4, 100)])  # 4 K slices, then 1
def test_route_matches_reference_router_and_routing(experts, top_k, hidden, renormalize):
    """The fused router (split over experts and K; 17 tokens take the library product) against F.linear +
    reference.topk_softmax, float32 logits (no ties)."""
    from asyncengine.kernels import moe, reference

    gate = torch.randn(experts, hidden, device=DEVICE) * hidden**-0.5
    for tokens in (1, 16, 17):
        x = torch.randn(tokens, hidden, device=DEVICE) * 3
        weights, ids = moe.route(x, gate, top_k, renormalize, num_sms=64)
        ref_weights, ref_ids = reference.route(x, gate, top_k, renormalize)
        assert torch.equal(ids, ref_ids), tokens
        torch.testing.assert_close(weights, ref_weights, atol=1e-6, rtol=1e-5)
    assert not moe.counters(torch.device(DEVICE)).any()


def test_route_does_not_depend_on_the_rest_of_the_batch():
    from asyncengine.kernels import moe

    x = torch.randn(16, 256, dtype=torch.bfloat16, device=DEVICE)
    gate = (torch.randn(128, 256, device=DEVICE) * 256**-0.5).to(torch.bfloat16)
    weights, ids = moe.route(x, gate, 8, True, num_sms=64)
    for tokens in (1, 5):
        alone = moe.route(x[:tokens], gate, 8, True, num_sms=64)
        assert torch.equal(alone[0], weights[:tokens]) and torch.equal(alone[1], ids[:tokens])


def test_route_breaks_ties_toward_the_lowest_expert_and_moe_follows_it():
    """A zero token ties every expert; experts with equal router rows tie in pairs. The chosen experts are
    distinct, lowest index first, and the decode kernels compute exactly that routing."""
    from asyncengine.kernels import moe, reference

    x, w13, w2, _, _ = make_moe(3, 16, 4, 64, 24)
    x[0] = 0.0
    gate = torch.randn(8, 64, device=DEVICE).repeat_interleave(2, dim=0)  # experts 2j and 2j + 1 equal
    weights, ids = moe.route(x, gate, 4, True, num_sms=64)
    assert ids[0].tolist() == [0, 1, 2, 3]
    torch.testing.assert_close(weights[0], torch.full((4,), 0.25, device=DEVICE))
    for row in ids[1:].tolist():  # pairs: each even expert is followed by its odd twin
        assert row[0] % 2 == 0 and row[1] == row[0] + 1 and row[2] % 2 == 0 and row[3] == row[2] + 1, row
    assert_matches(moe.fused_moe(x, w13, w2, weights, ids), reference.fused_moe(x, w13, w2, weights, ids),
                   MOE_TOLERANCE)


def test_route_rejects_bad_shapes_and_top_k():
    from asyncengine.kernels import moe

    x, gate = torch.randn(2, 32, device=DEVICE), torch.randn(8, 32, device=DEVICE)
    with pytest.raises(ValueError, match="gate_weight"):
        moe.route(x, gate[:, :16], 2, True)
    with pytest.raises(ValueError, match="top_k"):
        moe.route(x, gate, 9, True)


def make_fp8_moe(tokens, experts, top_k, hidden, inter, group, dtype=torch.float32, device=DEVICE):
    """make_moe's inputs with the experts in FP8 e4m3 per [16, group] block (block-wise checkpoints; the scales as
    group scales [E, G, N], spread over 2**-4 ... 2**4 so a misplaced scale shows): (x, w13, w2, weights, ids,
    w13_scale, w2_scale, group)."""
    from asyncengine.kernels.quant_reference import FP8_DTYPE, fp8_group_scales

    x, w13, w2, weights, ids = make_moe(tokens, experts, top_k, hidden, inter, torch.float32, device)

    def quantize(w):  # [E, N, K] -> (e4m3 [E, N, K], group scales [E, ceil(K / group), N])
        e, n, k = w.shape
        blocks = 2.0 ** torch.randint(-4, 5, (e, -(-n // 16), -(-k // group)), device=device).float() / 64.0
        w8 = torch.empty(w.shape, dtype=FP8_DTYPE, device=device)
        for i in range(e):  # one expert at a time: the real shapes' float32 temporaries stay small
            per_weight = blocks[i].repeat_interleave(16, 0)[:n].repeat_interleave(group, 1)[:, :k]
            w8[i] = (w[i] / per_weight).clamp(-448, 448).to(FP8_DTYPE)
        return w8, torch.stack([fp8_group_scales(b, 16, n) for b in blocks])

    (w13, s13), (w2, s2) = quantize(w13), quantize(w2)
    return x.to(dtype), w13, w2, weights, ids, s13, s2, group


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("path, case", [("grouped", "few-tokens-many-experts"), ("decode", "few-tokens-many-experts"),
                                        ("grouped", "prefill-tiles"), ("decode", "decode-top2")])
@pytest.mark.parametrize("group", [16, 32])
def test_fused_moe_with_fp8_experts_matches_reference(dtype, path, case, group, monkeypatch):
    """FP8 experts with group scales (block-wise checkpoints such as Qwen3-30B-A3B-FP8) through the grouped GEMMs and
    the decode kernels, against the reference dequantizing each expert; groups of 16 and 32 inputs, H and I off
    the groups' boundaries where the case has them (48 / 32, 32 / 80, 64 / 48)."""
    from asyncengine.kernels import moe, reference

    force_moe_path(monkeypatch, path)
    args = make_fp8_moe(*MOE_CASES[case], group, dtype)
    out, ref = moe.fused_moe(*args), reference.fused_moe(*args)
    assert out.dtype == dtype and not out.isnan().any()
    assert rel_error(out, ref) < (1e-5 if dtype == torch.float32 else MOE_BF16_REL_ERROR)


def test_fused_moe_checks_fp8_experts_group_scales_by_name():
    from asyncengine.kernels import moe

    x, w13, w2, weights, ids, s13, s2, group = make_fp8_moe(3, 4, 2, 32, 16, 16)
    with pytest.raises(ValueError, match="w2_scale must be contiguous float32"):
        moe.fused_moe(x, w13, w2, weights, ids, s13, s2[:, :, :8].contiguous(), group)
    with pytest.raises(ValueError, match="multiple of 16"):
        moe.fused_moe(x, w13, w2, weights, ids, s13, s2, 24)
    with pytest.raises(ValueError, match="FP8 e4m3 expert weights"):
        moe.fused_moe(x, w13.float(), w2.float(), weights, ids, s13, s2, group)


def make_int4_moe(tokens, experts, top_k, hidden, inter, group, dtype=torch.float32, device=DEVICE,
                  symmetric=False):
    """make_moe's inputs with the experts in packed int4 (GPTQ / AWQ checkpoints after loading: each row's inputs 8
    a word, int32 [E, N, K / 8]; scales and zero points [E, G, N] in `dtype`, quant_reference.quantize_int_weight):
    (x, w13, w2, weights, ids, w13_scale, w2_scale, group, w13_zeros, w2_zeros)."""
    from asyncengine.kernels.quant_reference import quantize_int_weight

    x, w13, w2, weights, ids = make_moe(tokens, experts, top_k, hidden, inter, torch.float32, device)

    def quantize(w):  # [E, N, K] -> (int32 [E, N, K / 8], scales [E, G, N], zeros [E, G, N])
        parts = [quantize_int_weight(w[e].t(), group, symmetric=symmetric) for e in range(w.shape[0])]
        q = torch.stack([p[0].t().contiguous() for p in parts])
        return q, torch.stack([p[1] for p in parts]).to(dtype), torch.stack([p[2] for p in parts]).to(dtype)

    (w13, s13, z13), (w2, s2, z2) = quantize(w13), quantize(w2)
    return x.to(dtype), w13, w2, weights, ids, s13, s2, group, z13, z2


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("path, case", [("grouped", "few-tokens-many-experts"), ("decode", "few-tokens-many-experts"),
                                        ("grouped", "prefill-tiles"), ("decode", "decode-top2")])
@pytest.mark.parametrize("group, symmetric", [(16, False), (32, True)])
def test_fused_moe_with_int4_experts_matches_reference(dtype, path, case, group, symmetric, monkeypatch):
    """Int4 experts (GPTQ / AWQ mixtures of experts) through the grouped GEMMs and the decode kernels, each weight
    tile dequantized with its group's scales and zero points, against the reference dequantizing each expert;
    asymmetric groups of 16 and symmetric ones of 32 inputs. In bf16 on CPU the bound is MOE_BF16_REL_ERROR + 1%:
    the decode kernels keep each dequantized weight in float32 where the reference rounds it to bf16, on top of the
    interpreter's truncating roundings (40 seeds: median 1.8%, largest 2.3%; one seed of a CI-sized run reached
    3.01%). Float32 holds to 1e-5."""
    from asyncengine.kernels import moe, reference

    force_moe_path(monkeypatch, path)
    args = make_int4_moe(*MOE_CASES[case], group, dtype, symmetric=symmetric)  # H, I: multiples of 8, not of 32
    out, ref = moe.fused_moe(*args), reference.fused_moe(*args)
    assert out.dtype == dtype and not out.isnan().any()
    bf16_bound = MOE_BF16_REL_ERROR + (1e-2 if not torch.cuda.is_available() else 0.0)
    assert rel_error(out, ref) < (1e-5 if dtype == torch.float32 else bf16_bound)


# int4 decode tiles (block_n, block_k, num_warps) of gate_up_act and down_reduce, against H 48 and I 40 in groups
# of 16 or 32: K tiles below one group, of one group, and of several groups (sub-tiles; the last steps past K)
INT4_DECODE_TILES = [((8, 16, 2), (16, 16, 1)), ((4, 32, 1), (8, 64, 2)), ((16, 128, 4), (32, 256, 4))]


@pytest.mark.parametrize("tiles", INT4_DECODE_TILES, ids=str)
@pytest.mark.parametrize("group", [16, 32])
def test_decode_moe_with_int4_experts_matches_reference_under_narrow_and_wide_tiles(tiles, group):
    """The int4 decode kernels' step in sub-tiles within one group each (moe._int4_sub_k): K tiles smaller than a
    group, equal to it, and spanning several, with K tails (H 48, I 40) masked, scales and zero points included;
    loading each step ahead (GemvTiles.load_ahead) gives the same bits."""
    from asyncengine.kernels import moe, reference

    x, w13, w2, weights, ids, s13, s2, group, z13, z2 = make_int4_moe(3, 8, 4, 48, 40, group)
    outs = [moe._fused_moe_decode(x, w13, w2, weights.reshape(-1), ids.reshape(-1), 4, moe.DecodeConfig(
        moe.GemvTiles(*tiles[0], load_ahead=ahead), moe.GemvTiles(*tiles[1], load_ahead=ahead)), s13, s2, group, z13,
        z2) for ahead in (False, True)]  # fmt: skip
    ref = reference.fused_moe(x, w13, w2, weights, ids, s13, s2, group, z13, z2)
    assert rel_error(outs[0], ref) < 1e-5
    assert torch.equal(outs[0], outs[1])


import triton  # noqa: E402  (Triton's JIT resolves a kernel's callees among its module's globals)
import triton.language as tl  # noqa: E402

from asyncengine.kernels.quant_gemv import _x_half_pairs, _x_words  # noqa: E402


@triton.jit
def _x_loads_kernel(x_ptr, out_ptr, n_words, WORDS: tl.constexpr):
    """Stores, for words 0 .. WORDS - 1 of x (those past n_words masked), the 12 tensors the int4 kernels read x
    as (quant_gemv._x_half_pairs, then _x_words on bf16 pairs), as int32 bits [12, WORDS]."""
    word = tl.arange(0, WORDS)
    valid = word < n_words
    loaded = _x_half_pairs(x_ptr, word, valid) + _x_words(x_ptr, word, valid, True)
    for i in tl.static_range(12):
        tl.store(out_ptr + i * WORDS + word, loaded[i].to(tl.int32, bitcast=True))


def test_int4_x_vector_loads_give_the_pairs_and_floats_of_the_reference():
    """The int4 decode kernels (the dense GEMV's and the MoE's) load each word's 8 bf16 inputs of x as one 16-byte
    vector (quant_gemv._x_pair_vectors) and split it in registers. The bf16x2 pairs (x_j, x_j+4), j = 0 ... 3, and
    the float32 inputs 8 w + j must be, bit for bit and in order, those built in torch from x's bits. The bf16x2
    path runs only on CUDA, so its pairs are checked here (in Triton's interpreter on CPU); words past the mask
    read zeros."""
    words, valid_words = 16, 13
    x = torch.randn(words * 8, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    out = torch.zeros(12, words, dtype=torch.int32, device=DEVICE)
    _x_loads_kernel[(1,)](x.to(DEVICE), out, valid_words, WORDS=words)
    bits = x.view(torch.int16).to(torch.int32).reshape(words, 8) & 0xFFFF  # [W, 8]: input 8 w + j's bf16 bits
    bits[valid_words:] = 0
    pairs = [bits[:, j] | (bits[:, j + 4] << 16) for j in range(4)]  # (x_j, x_j+4): x_j in the low half
    floats = [bits[:, j] << 16 for j in range(8)]  # a bf16's float32 bits
    expected = torch.stack(pairs + floats).to(torch.int32)
    assert torch.equal(out.cpu(), expected)
    assert out[:, :valid_words].ne(0).any() and not out[:, valid_words:].any()


def test_fused_moe_checks_int4_experts_scales_and_zeros_by_name():
    from asyncengine.kernels import moe

    x, w13, w2, weights, ids, s13, s2, group, z13, z2 = make_int4_moe(3, 4, 2, 32, 16, 16)
    with pytest.raises(ValueError, match="w2_zeros must be contiguous"):
        moe.fused_moe(x, w13, w2, weights, ids, s13, s2, group, z13, None)
    with pytest.raises(ValueError, match="w13_scale must be contiguous float32"):
        moe.fused_moe(x, w13, w2, weights, ids, s13.half(), s2, group, z13, z2)
    with pytest.raises(ValueError, match="do not fit hidden"):
        moe.fused_moe(x, w13[:, :, :2].contiguous(), w2, weights, ids, s13, s2, group, z13, z2)


def test_fused_moe_rejects_mismatched_shapes():
    from asyncengine.kernels import moe

    x, w13, w2, weights, ids = make_moe(3, 4, 2, 32, 16)
    with pytest.raises(ValueError, match="w13"):
        moe.fused_moe(x, w13[:, :, :16], w2, weights, ids)
    with pytest.raises(ValueError, match="topk"):
        moe.fused_moe(x, w13, w2, weights[:2], ids)


# GPU: expert shapes of Mixtral-8x7B (8 experts, top-2, hidden 4096, intermediate 14336) and Qwen3-30B-A3B
# (128 experts, top-8, hidden 2048, intermediate 768), bf16, against the reference on float32 copies.
MOE_SHAPES = {"mixtral-8x7b": (8, 2, 4096, 14336), "qwen3-30b-a3b": (128, 8, 2048, 768)}


def moe_error_vs_fp32_reference(x, w13, w2, topk_weights, topk_ids) -> float:
    from asyncengine.kernels import moe, reference

    out = moe.fused_moe(x, w13, w2, topk_weights, topk_ids)
    assert out.shape == x.shape and out.dtype == x.dtype and not out.isnan().any(), "unwritten or NaN outputs"
    ref = reference.fused_moe(x.float(), w13.float(), w2.float(), topk_weights, topk_ids)
    return rel_error(out, ref)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("shape", list(MOE_SHAPES))
@pytest.mark.parametrize("tokens", [1, 3, 8, 16, 64, 1000])
def test_gpu_fused_moe_at_real_expert_shapes(shape, tokens):
    experts, top_k, hidden, inter = MOE_SHAPES[shape]
    args = make_moe(tokens, experts, top_k, hidden, inter, torch.bfloat16, "cuda")
    assert moe_error_vs_fp32_reference(*args) < 1e-2


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("shape", list(MOE_SHAPES))
@pytest.mark.parametrize("tokens", [1, 8, 16, 64, 1000])  # the decode kernels, then the grouped GEMMs
def test_gpu_fused_moe_with_fp8_experts_at_real_expert_shapes(shape, tokens):
    """FP8 experts with 128-input group scales (block-wise checkpoints), bf16 activations, against the reference
    dequantizing each expert in float32."""
    from asyncengine.kernels import moe, reference

    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 needs compute capability 8.9+")
    experts, top_k, hidden, inter = MOE_SHAPES[shape]
    x, w13, w2, weights, ids, s13, s2, group = make_fp8_moe(tokens, experts, top_k, hidden, inter, 128,
                                                            torch.bfloat16, "cuda")
    out = moe.fused_moe(x, w13, w2, weights, ids, s13, s2, group)
    assert out.shape == x.shape and out.dtype == x.dtype and not out.isnan().any(), "unwritten or NaN outputs"
    ref = reference.fused_moe(x.float(), w13, w2, weights, ids, s13, s2, group)
    assert rel_error(out, ref) < 1e-2, rel_error(out, ref)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("shape", list(MOE_SHAPES))
@pytest.mark.parametrize("tokens", [1, 8, 16, 64, 1000])  # the decode kernels, then the grouped GEMMs
def test_gpu_fused_moe_with_int4_experts_at_real_expert_shapes(shape, tokens):
    """Int4 experts (GPTQ / AWQ, groups of 128, asymmetric), bf16 activations, scales and zero points, against the
    reference dequantizing each expert and multiplying in float32."""
    from asyncengine.kernels import moe, reference

    experts, top_k, hidden, inter = MOE_SHAPES[shape]
    x, w13, w2, weights, ids, s13, s2, group, z13, z2 = make_int4_moe(tokens, experts, top_k, hidden, inter, 128,
                                                                      torch.bfloat16, "cuda")
    out = moe.fused_moe(x, w13, w2, weights, ids, s13, s2, group, z13, z2)
    assert out.shape == x.shape and out.dtype == x.dtype and not out.isnan().any(), "unwritten or NaN outputs"
    ref = reference.fused_moe(x.float(), w13, w2, weights, ids, s13, s2, group, z13, z2)
    assert rel_error(out, ref) < 1e-2, rel_error(out, ref)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("shape", list(MOE_SHAPES))
def test_gpu_fused_moe_with_tied_router_logits(shape):
    """Tied router probabilities (all logits equal, or pairs equal): the routing kernel picks distinct experts
    (the lowest index first among ties) and the MoE kernel computes exactly that routing."""
    from asyncengine.kernels import moe

    experts, top_k, hidden, inter = MOE_SHAPES[shape]
    x, w13, w2, _, _ = make_moe(33, experts, top_k, hidden, inter, torch.bfloat16, "cuda")
    logits = torch.zeros(33, experts, dtype=torch.bfloat16, device="cuda")
    logits[16:] = torch.randn(17, experts // 2, device="cuda").repeat_interleave(2, dim=1).to(torch.bfloat16)
    weights, ids = moe.topk_softmax(logits, top_k, renormalize=True)
    assert (ids.sort(dim=1).values.diff(dim=1) > 0).all(), "top-k must pick distinct experts even under ties"
    assert moe_error_vs_fp32_reference(x, w13, w2, weights, ids) < 1e-2


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("shape", list(MOE_SHAPES))
@pytest.mark.parametrize("tokens", [1, 5, 16])
def test_gpu_route_picks_a_top_k_of_the_float32_router(shape, tokens):
    """bf16 router products summed in another order may round a near-tie the other way, so the check is that
    the chosen experts are a top-k of the float32 router's probabilities up to 3% (and weights match them)."""
    from asyncengine.kernels import moe

    experts, top_k, hidden, _ = MOE_SHAPES[shape]
    x = torch.randn(tokens, hidden, dtype=torch.bfloat16, device="cuda")
    gate = (torch.randn(experts, hidden, device="cuda") * hidden**-0.5).to(torch.bfloat16)
    weights, ids = moe.route(x, gate, top_k, renormalize=False)
    probs = torch.softmax(x.float() @ gate.float().t(), dim=-1)  # [T, E]
    chosen = probs.gather(1, ids)
    unchosen = probs.scatter(1, ids, -1.0).max(dim=1).values
    assert (ids.sort(dim=1).values.diff(dim=1) > 0).all()
    assert (chosen.min(dim=1).values >= unchosen * 0.97).all()
    torch.testing.assert_close(weights, chosen, atol=2e-3, rtol=2e-2)
    assert not moe.counters(x.device).any()


@pytest.mark.gpu
@needs_cuda
def test_gpu_fused_moe_decode_is_cuda_graph_capturable():
    from asyncengine.kernels import moe, reference

    experts, top_k, hidden, inter = MOE_SHAPES["qwen3-30b-a3b"]
    x, w13, w2, _, _ = make_moe(8, experts, top_k, hidden, inter, torch.bfloat16, "cuda")
    gate = (torch.randn(experts, hidden, device="cuda") * hidden**-0.5).to(torch.bfloat16)
    out = torch.empty_like(x)
    weights = torch.empty(8, top_k, device="cuda")
    ids = torch.empty(8, top_k, dtype=torch.int64, device="cuda")

    def layer():  # routing and experts, as the model runs them
        routed = moe.route(x, gate, top_k, True)
        weights.copy_(routed[0])
        ids.copy_(routed[1])
        out.copy_(moe.fused_moe(x, w13, w2, *routed))

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        layer()  # compile (and make the arrival counters) outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        layer()
    for _ in range(3):  # new tokens, so a new routing, in the same buffers, then replay
        x.copy_(torch.randn_like(x))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(moe.route(x, gate, top_k, True)[1], ids), "the replayed routing is stale"
        assert_matches(out, reference.fused_moe(x, w13, w2, weights, ids), MOE_TOLERANCE)


@pytest.mark.skipif(torch.cuda.is_available(), reason="--tiny runs the kernels in Triton's interpreter, on CPU")
def test_moe_benchmark_runs_on_int4_experts_in_the_interpreter(capsys):
    """`bench_kernels --moe-decode / --moe-sweep --int4 --tiny` (loadtest/bench_moe.py) end to end at toy sizes: the
    decode rows, and a sweep whose winner passed its check against the reference and is printed as a TUNED_INT4
    line (times mean nothing here)."""
    from loadtest.bench_moe import main

    assert main(["--moe-decode", "--tiny", "--int4", "--tokens", "1", "--layers", "1"]) == 0
    out = capsys.readouterr().out
    assert "experts: decode kernels" in out and "grouped GEMMs (peer)" in out, out
    assert main(["--moe-sweep", "--tiny", "--int4", "--tokens", "1", "--layers", "1"]) == 0
    out = capsys.readouterr().out
    assert "paste into kernels/moe_configs.py TUNED_INT4" in out and "(64, 32, 4, 1): DecodeConfig(" in out, out
    assert "DROPPED" not in out, out

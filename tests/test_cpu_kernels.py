"""The fast CPU kernels (`asyncengine.kernels.cpu`) against the torch references, and the engine on both paths.

Attention is checked on random paged caches with shuffled block tables, grouped-query / multi-query / multi-head
layouts, and mixed batches (a fresh prefill, a chunked prefill behind a cached prefix, decodes of unequal
lengths). Float32 outputs must agree with the references to 2e-5 (SDPA's flash kernel and the references' math
path sum in different orders); bfloat16 to 2e-2. The element-wise kernels do the references' float32 arithmetic
and must agree to 1e-6. The default model's greedy tokens must be identical on both paths.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from asyncengine.kernels import cpu, cpu_native, reference

TOLERANCE = {torch.float32: dict(atol=2e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


@pytest.fixture(autouse=True)
def seeded():
    torch.manual_seed(1234)


@pytest.fixture(params=["native", "torch"])
def decode_path(request, monkeypatch):
    """Float32 decode rows in a heads-major cache run through the native kernel (cpu_native) or, with it switched
    off, through the torch path (gather or mirror, then SDPA): both must match the references."""
    if request.param == "native":
        assert cpu_native.available(), "the native CPU kernels did not build on this machine (see the warning)"
    else:
        monkeypatch.setattr(cpu_native, "ENABLED", False)
    return request.param


@pytest.fixture
def torch_decode_path(monkeypatch):
    monkeypatch.setattr(cpu_native, "ENABLED", False)


def shuffled_block_tables(seq_lens, block_size: int, spare_blocks: int, spare_columns: int):
    """(tables [B, max blocks + spare_columns] int32, num_blocks): each sequence's blocks drawn without repeats from
    a shuffled pool of what they need plus spare_blocks; the unused entries point at random valid blocks."""
    blocks_per_seq = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_seq) + spare_blocks
    order = torch.randperm(num_blocks)
    tables = torch.randint(0, num_blocks, (len(seq_lens), max(blocks_per_seq) + spare_columns), dtype=torch.int32)
    used = 0
    for b, n in enumerate(blocks_per_seq):
        tables[b, :n] = order[used : used + n]
        used += n
    return tables, num_blocks


def paged_batch(q_lens, seq_lens, *, heads, kv_heads, head_dim=32, block_size=16, dtype=torch.float32,
                heads_major=False):
    """A random step: q [T, H, D], this step's new key/value [T, KVH, D], caches holding random prefixes, shuffled
    block tables (unused entries pointing at random valid blocks), and the layout as numpy (qsl, lens, tables).
    heads_major: the caches stored as the engine allocates them on CPU (`cpu.allocate_kv_cache`)."""
    tables, num_blocks = shuffled_block_tables(seq_lens, block_size, spare_blocks=5, spare_columns=2)
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache, v_cache = torch.randn(shape, dtype=dtype), torch.randn(shape, dtype=dtype)
    if heads_major:
        k_cache, v_cache = (cpu.allocate_kv_cache(shape, dtype).copy_(c) for c in (k_cache, v_cache))
        assert cpu.heads_major(k_cache) is not None
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    tokens = int(qsl[-1])
    q = torch.randn(tokens, heads, head_dim, dtype=dtype)
    # new K/V as strided views of one projection output, as the model passes them
    kv = torch.randn(tokens, 2 * kv_heads * head_dim + 7, dtype=dtype)
    key = kv[:, : kv_heads * head_dim].view(tokens, kv_heads, head_dim)
    value = kv[:, kv_heads * head_dim : 2 * kv_heads * head_dim].view(tokens, kv_heads, head_dim)
    positions = np.concatenate([np.arange(s - n, s) for n, s in zip(q_lens, seq_lens)])
    table_np = tables.numpy()
    slots = torch.from_numpy(table_np[np.repeat(np.arange(len(q_lens)), q_lens), positions // block_size]
                             .astype(np.int64) * block_size + positions % block_size)
    return q, key, value, k_cache, v_cache, slots, qsl, np.asarray(seq_lens, dtype=np.int32), table_np


def check_cache_and_attend(q_lens, seq_lens, **kwargs):
    q, key, value, k_cache, v_cache, slots, qsl, lens, tables = paged_batch(q_lens, seq_lens, **kwargs)
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    reference.reshape_and_cache(key, value, ref_k, ref_v, slots)
    expected = reference.paged_attention(q, ref_k, ref_v, torch.from_numpy(qsl), torch.from_numpy(lens),
                                         torch.from_numpy(tables), 0.3)
    plan = cpu.plan_attention(qsl, lens, tables, k_cache.shape[1])
    out = cpu.cache_and_attend(q, key, value, k_cache, v_cache, slots, plan, 0.3)
    assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v), "the cache writes differ"
    assert out.shape == expected.shape and out.dtype == expected.dtype
    torch.testing.assert_close(out, expected, **TOLERANCE[q.dtype])
    return plan


LAYOUTS = pytest.mark.parametrize("heads, kv_heads", [(4, 2), (6, 2), (8, 1), (4, 4)],
                                  ids=["gqa2", "group3", "mqa", "mha"])
CACHE_STORAGE = pytest.mark.parametrize("heads_major", [False, True], ids=["plain-cache", "heads-major-cache"])


@LAYOUTS
@CACHE_STORAGE
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mixed_batch_fresh_prefill_chunked_prefill_and_unequal_decodes(heads, kv_heads, dtype, heads_major,
                                                                       decode_path):
    # decodes at 33, 16 (a full block) and 70 tokens; a fresh 13-token prompt; a 21-token chunk behind 49 cached
    plan = check_cache_and_attend([1, 13, 1, 21, 1], [33, 13, 16, 70, 70], heads=heads, kv_heads=kv_heads,
                                  dtype=dtype, heads_major=heads_major)
    assert plan.num_decode == 3 and [p.blocks is None for p in plan.prefills] == [True, False]


@LAYOUTS
@CACHE_STORAGE
def test_decode_only_batch_with_random_lengths(heads, kv_heads, heads_major, decode_path):
    lens = torch.randint(1, 90, (24,)).tolist()
    plan = check_cache_and_attend([1] * 24, lens, heads=heads, kv_heads=kv_heads, block_size=8,
                                  heads_major=heads_major)
    assert plan.decode_rows is None and plan.decode_mask is not None


def test_decode_batch_of_equal_full_blocks_needs_no_mask():
    plan = check_cache_and_attend([1] * 5, [32] * 5, heads=4, kv_heads=2)
    assert plan.decode_mask is None


@CACHE_STORAGE
def test_prefill_only_batch_of_prompts_and_a_chunk_of_one_long_prompt(heads_major):
    check_cache_and_attend([40, 7, 64], [40, 7, 200], heads=4, kv_heads=2, head_dim=64, block_size=32,
                           heads_major=heads_major)


def test_gather_buffers_are_reused_by_every_layer_of_a_step(torch_decode_path):
    q, key, value, k_cache, v_cache, slots, qsl, lens, tables = paged_batch([1, 1, 1], [5, 40, 17], heads=4,
                                                                            kv_heads=2)
    plan = cpu.plan_attention(qsl, lens, tables, k_cache.shape[1])
    cpu.cache_and_attend(q, key, value, k_cache, v_cache, slots, plan, 0.3)
    shape = cpu.gather_buffer_shape(k_cache, plan.decode_blocks.shape[0])
    first = plan.gather_buffer("k", shape, k_cache).data_ptr()
    cpu.cache_and_attend(q, key, value, k_cache.clone(), v_cache.clone(), slots, plan, 0.3)
    assert plan.gather_buffer("k", shape, k_cache).data_ptr() == first


def poison_freed_blocks(k_cache, v_cache, tables, q_lens, seq_lens, window):
    """NaN in the blocks wholly before each sequence's first visible key (the engine may have freed them), every
    unused table entry pointed at a clean block: reading a freed block, even masked, gives NaN."""
    block_size = k_cache.shape[1]
    owned = {int(tables[b, i]) for b, n in enumerate(seq_lens) for i in range(-(-n // block_size))}
    spare = min(set(range(k_cache.shape[0])) - owned)
    for b, (q_len, seq_len) in enumerate(zip(q_lens, seq_lens)):
        tables[b, -(-seq_len // block_size):] = spare
        for i in range(max(0, seq_len - q_len - window + 1) // block_size):
            k_cache[tables[b, i]] = float("nan")
            v_cache[tables[b, i]] = float("nan")


@pytest.mark.parametrize("window, softcap", [(8, None), (None, 2.0), (20, 3.0)],
                         ids=["window8", "softcap2", "window20-softcap3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@CACHE_STORAGE
def test_sliding_window_and_softcap_match_reference_without_reading_freed_blocks(window, softcap, dtype,
                                                                                 heads_major, decode_path):
    # decodes past and within the window, a fresh prompt longer than it, chunks behind a cached prefix
    q_lens, seq_lens = [1, 40, 1, 9, 1, 30], [90, 40, 6, 75, 33, 140]
    q, key, value, k_cache, v_cache, slots, qsl, lens, tables = paged_batch(q_lens, seq_lens, heads=4, kv_heads=2,
                                                                            block_size=8, dtype=dtype,
                                                                            heads_major=heads_major)
    if window is not None:
        poison_freed_blocks(k_cache, v_cache, tables, q_lens, seq_lens, window)  # (own blocks, so slots, kept)
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    reference.reshape_and_cache(key, value, ref_k, ref_v, slots)
    expected = reference.paged_attention(q, ref_k, ref_v, torch.from_numpy(qsl), torch.from_numpy(lens),
                                         torch.from_numpy(tables), 0.3, window, softcap)
    assert not expected.isnan().any()
    plan = cpu.plan_attention(qsl, lens, tables, k_cache.shape[1])
    out = cpu.cache_and_attend(q, key, value, k_cache, v_cache, slots, plan, 0.3, window, softcap)
    torch.testing.assert_close(out, expected, **TOLERANCE[q.dtype])
    if window is not None:  # the windowed plan is built once per step and window, and reads fewer blocks
        assert plan.for_window(window) is plan.for_window(window)
        assert plan.for_window(window).decode_blocks.numel() < plan.decode_blocks.numel()


# -- element-wise ---------------------------------------------------------------------------------------------------
def test_rms_norm_and_fused_add_match_reference_and_update_the_residual_in_place():
    x, residual, weight = torch.randn(9, 48), torch.randn(9, 48), torch.randn(48)
    torch.testing.assert_close(cpu.rms_norm(x, weight, 1e-5), reference.rms_norm(x, weight, 1e-5),
                               atol=1e-6, rtol=1e-6)
    expected, expected_residual = reference.fused_add_rms_norm(x, residual.clone(), weight, 1e-5)
    out, new_residual = cpu.fused_add_rms_norm(x, residual, weight, 1e-5)
    assert new_residual.data_ptr() == residual.data_ptr()
    torch.testing.assert_close(new_residual, expected_residual, atol=0, rtol=0)
    torch.testing.assert_close(out, expected, atol=1e-6, rtol=1e-6)


def test_silu_and_mul_matches_reference():
    x = torch.randn(7, 2 * 40)
    expected = reference.silu_and_mul(x.clone())
    torch.testing.assert_close(cpu.silu_and_mul(x), expected, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("rows", [1, 5, 64])
def test_head_logits_match_f_linear_and_the_sampler_takes_the_transposed_view(rows):
    hidden, weight = torch.randn(rows, 48), torch.randn(1000, 48)
    logits = cpu.head_logits(hidden, weight)
    assert logits.shape == (rows, 1000)
    torch.testing.assert_close(logits, torch.nn.functional.linear(hidden, weight), atol=1e-5, rtol=1e-5)
    assert torch.equal(logits.argmax(dim=-1), logits.contiguous().argmax(dim=-1))
    column_major = weight.t().contiguous().t()  # not row-major: F.linear as before
    torch.testing.assert_close(cpu.head_logits(hidden, column_major), logits, atol=1e-5, rtol=1e-5)


def rotary_cache(head_dim: int, max_positions: int = 128) -> torch.Tensor:
    """[max_positions, head_dim] float32 = [cos | sin] at rope base 10000."""
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    freqs = torch.arange(max_positions).float()[:, None] * inv_freq
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1)


def test_rotary_in_place_on_strided_views_of_one_qkv_tensor():
    tokens, heads, kv_heads, head_dim = 11, 4, 2, 32
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim)
    q, k, _ = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    positions = torch.randint(0, 100, (tokens,))
    cache = rotary_cache(head_dim)
    exp_q, exp_k = reference.rotary_embedding(positions, q.clone(), k.clone(), cache, head_dim)
    out_q, out_k = cpu.rotary_embedding(positions, q, k, cache, head_dim)
    torch.testing.assert_close(out_q, exp_q, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(out_k, exp_k, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(q, exp_q, atol=1e-6, rtol=1e-6)  # in place, in the qkv tensor


def test_rotary_on_separate_q_and_k_tensors():
    # Qwen3's per-head norms hand rotary new tensors, not views of one qkv row: each rotates on its own
    tokens, heads, kv_heads, head_dim = 9, 4, 2, 32
    q, k = torch.randn(tokens, heads * head_dim), torch.randn(tokens, kv_heads * head_dim)
    positions = torch.randint(0, 100, (tokens,))
    cache = rotary_cache(head_dim)
    exp_q, exp_k = reference.rotary_embedding(positions, q.clone(), k.clone(), cache, head_dim)
    out_q, out_k = cpu.rotary_embedding(positions, q, k, cache, head_dim)
    torch.testing.assert_close(out_q, exp_q, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(out_k, exp_k, atol=1e-6, rtol=1e-6)

# -- the engine on both paths -----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def default_llm():
    from asyncengine import LLM

    # a small token budget: prompts are prefilled in chunks, beside decodes (mixed steps)
    return LLM(max_num_batched_tokens=48, max_num_seqs=8, num_kv_blocks=128)


def test_default_model_greedy_tokens_identical_on_fast_and_reference_paths(default_llm, monkeypatch):
    from asyncengine import SamplingParams, ops

    prompts = ["ROMEO: what light", "JULIET: o romeo romeo wherefore art thou " * 3, "To be or not to be",
               "The king", "Now is the winter of our discontent made glorious summer by this sun of york " * 2]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    fast = [o.outputs[0].token_ids for o in default_llm.generate(prompts, params, use_tqdm=False)]
    monkeypatch.setattr(ops, "CPU_FAST_PATH", False)
    slow = [o.outputs[0].token_ids for o in default_llm.generate(prompts, params, use_tqdm=False)]
    assert fast == slow


class MirroredSteps:
    """Steps of a model with `layers` layers, each run twice: through an engine-like DecodeKVMirror and through the
    gather path, on two copies of the heads-major caches; every layer's outputs must be bit-identical. (The torch
    decode path: the tests using it take the torch_decode_path fixture.)"""

    def __init__(self, layers=2, heads=4, kv_heads=2, head_dim=16, block_size=8, num_blocks=96, **mirror_kwargs):
        self.heads, self.kv_heads, self.head_dim, self.block_size = heads, kv_heads, head_dim, block_size
        shape = (num_blocks, block_size, kv_heads, head_dim)
        self.gathered = [tuple(cpu.allocate_kv_cache(shape, torch.float32).normal_() for _ in "kv")
                         for _ in range(layers)]
        self.mirrored = [tuple(cpu.allocate_kv_cache(shape, torch.float32).copy_(c) for c in kv)
                         for kv in self.gathered]
        self.mirror = cpu.DecodeKVMirror(**mirror_kwargs)

    def step(self, seqs, layers=None) -> cpu.MirrorStep:
        """seqs: (blocks, length after this step, new tokens this step); runs `layers` (default all)."""
        q_lens = np.array([n for _, _, n in seqs])
        lens = np.array([length for _, length, _ in seqs], dtype=np.int32)
        width = max(len(blocks) for blocks, _, _ in seqs)
        tables = np.array([blocks + [0] * (width - len(blocks)) for blocks, _, _ in seqs], dtype=np.int32)
        qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
        positions = np.concatenate([np.arange(s - n, s) for n, s in zip(q_lens, lens)])
        rows = np.repeat(np.arange(len(seqs)), q_lens)
        slots = torch.from_numpy(tables[rows, positions // self.block_size].astype(np.int64) * self.block_size
                                 + positions % self.block_size)
        plans = (cpu.plan_attention(qsl, lens, tables, self.block_size, mirror=self.mirror),
                 cpu.plan_attention(qsl, lens, tables, self.block_size))
        tokens = int(qsl[-1])
        for layer in range(len(self.gathered)) if layers is None else layers:
            q = torch.randn(tokens, self.heads, self.head_dim)
            key, value = (torch.randn(tokens, self.kv_heads, self.head_dim) for _ in "kv")
            outs = [cpu.cache_and_attend(q, key, value, *caches[layer], slots, plan, 0.3)
                    for caches, plan in zip((self.mirrored, self.gathered), plans)]
            assert torch.equal(outs[0], outs[1]), f"layer {layer}: the mirror's attention differs from the gather's"
        return plans[0].mirror


def test_decode_mirror_appends_while_the_rows_stay_and_gives_the_gather_paths_bits(torch_decode_path):
    steps = MirroredSteps()
    a, b, c = [0, 1, 2, 3], [10, 11, 12, 13, 14], [20, 21, 22]
    first = steps.step([(a, 9, 9), (b, 16, 16)])  # prefills only: no decode rows, no mirror step
    assert first is None
    lens = {"a": 10, "b": 17}
    rebuilt = steps.step([(a, lens["a"], 1), (b, lens["b"], 1)])
    assert rebuilt.appends_to is None
    for i in range(12):  # 10 -> 22 keys: past the first capacity (doubling), across block boundaries
        lens = {k: v + 1 for k, v in lens.items()}
        appended = steps.step([(a, lens["a"], 1), (b, lens["b"], 1)])
        assert appended.appends_to == appended.step - 1
    # a prompt joins as a prefill row: the decode rows are the same, they still append
    mixed = steps.step([(a, lens["a"] + 1, 1), (c, 7, 7), (b, lens["b"] + 1, 1)])
    assert mixed.appends_to is not None
    # the prompt's first decode: the rows changed, every layer gathers again
    changed = steps.step([(a, lens["a"] + 2, 1), (c, 8, 1), (b, lens["b"] + 2, 1)])
    assert changed.appends_to is None
    # a layer that skipped a step gathers again on its next one (the others append)
    steps.step([(a, lens["a"] + 3, 1), (c, 9, 1), (b, lens["b"] + 3, 1)], layers=[0])
    steps.step([(a, lens["a"] + 4, 1), (c, 10, 1), (b, lens["b"] + 4, 1)])


def test_decode_mirror_does_not_take_two_sequences_sharing_a_prefix_for_each_other(torch_decode_path):
    steps = MirroredSteps()
    shared = [0, 1]  # two full blocks of a common prompt, then each sequence's own blocks
    x, y = shared + [5], shared + [6, 7]
    steps.step([(x, 20, 1), (y, 21, 1)])
    swapped = steps.step([(y, 21, 1), (x, 21, 1)])  # lengths fit "one longer" for one row only
    assert swapped.appends_to is None
    steps.step([(x, 22, 1), (y, 22, 1)])
    swapped = steps.step([(y, 23, 1), (x, 23, 1)])  # same lengths, rows swapped: their own last blocks differ
    assert swapped.appends_to is None


def test_decode_mirror_past_its_memory_bound_gathers(torch_decode_path):
    steps = MirroredSteps(max_bytes=4096)  # less than one layer's [2, 2, 16, 16] float32 keys and values
    steps.step([([0, 1], 10, 1), ([2, 3], 12, 1)])
    steps.step([([0, 1], 11, 1), ([2, 3], 13, 1)])
    assert not steps.mirror._layers


def test_decode_mirror_does_not_extend_a_step_before_a_prefill_only_step(torch_decode_path):
    # (the failure a 200-stream server test found: the mirror took a new prompt's first decode for the extension
    # of the finished sequence whose freed block it had been given, across the prefill-only step between them)
    steps = MirroredSteps()
    steps.step([([0], 7, 1)])  # X decodes its 7th key in block 0, and finishes
    steps.step([([0], 7, 7)])  # Y, a 7-token prompt, prefills in X's freed block: no decode rows this step
    y = steps.step([([0], 8, 1)])  # Y's first decode: X's length plus one, in the same block
    assert y.appends_to is None


def test_decode_mirror_gives_back_a_bursts_memory_once_fewer_rows_decode(torch_decode_path):
    steps = MirroredSteps(num_blocks=200)
    burst = [([3 * i, 3 * i + 1, 3 * i + 2], 20, 1) for i in range(40)]  # 40 rows of 20 keys
    steps.step(burst)
    big = sum(m.keys.nbytes for m in steps.mirror._layers.values())
    steps.step([([0, 1, 2], 21, 1), ([3, 4, 5], 21, 1)])  # two of them go on: the rows changed, layers refill
    small = sum(m.keys.nbytes for m in steps.mirror._layers.values())
    assert small * 10 < big, (small, big)

"""The native CPU kernels (`asyncengine.kernels.cpu_native`): built here, against the torch reference, and how they
are built, cached and refused.

The decode attention reads a paged, heads-major float32 cache in place; it must agree with
`reference.paged_attention` to 2e-5 (float32, summed in another order) on fresh random inputs, for head sizes and
groups with and without a compiled specialisation, sliding windows and soft-capping, and give each row the same
bits whatever batch it runs in. A machine with a C compiler (CI's, a user's with gcc) must build them.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from asyncengine.kernels import cpu, cpu_native, reference

from test_cpu_kernels import shuffled_block_tables  # noqa: E402

TOL = dict(atol=2e-5, rtol=1e-5)


@pytest.fixture(autouse=True)
def seeded():
    torch.manual_seed(4321)


def decode_inputs(seq_lens, *, heads, kv_heads, head_dim, block_size, strided_q=False):
    """q [B, H, D], heads-major caches from cpu.allocate_kv_cache (random), tables [B, W] int32, lens [B] int32."""
    tables, num_blocks = shuffled_block_tables(seq_lens, block_size, spare_blocks=7, spare_columns=3)
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache, v_cache = (cpu.allocate_kv_cache(shape, torch.float32).normal_() for _ in "kv")
    batch = len(seq_lens)
    if strided_q:  # rows of a wider projection output, as the model hands q over
        q = torch.randn(batch, heads * head_dim + 40)[:, : heads * head_dim].view(batch, heads, head_dim)
    else:
        q = torch.randn(batch, heads, head_dim)
    return q, k_cache, v_cache, tables, torch.tensor(seq_lens, dtype=torch.int32)


def expected_decode(q, k_cache, v_cache, tables, lens, scale, window=None, softcap=None):
    qsl = torch.arange(q.shape[0] + 1, dtype=torch.int32)
    return reference.paged_attention(q, k_cache, v_cache, qsl, lens, tables, scale, window, softcap)


def native_decode(q, k_cache, v_cache, tables, lens, scale, window=None, softcap=None):
    return cpu_native.decode_attention(q, cpu.heads_major(k_cache), cpu.heads_major(v_cache), tables, lens, scale,
                                       window, softcap)


def test_the_native_kernels_build_on_this_machine():
    assert cpu_native.available(), "no native CPU kernels: is there a C compiler (cc, gcc or $CC)?"


@pytest.mark.parametrize("heads, kv_heads, head_dim", [(4, 2, 64), (8, 2, 64), (16, 4, 128), (32, 4, 128),
                                                       (6, 2, 32), (4, 4, 80), (8, 1, 16), (24, 2, 64)],
                         ids=["d64-g2", "d64-g4", "d128-g4", "d128-g8", "d32-g3", "d80-mha", "d16-mqa8",
                              "d64-g12"])
@pytest.mark.parametrize("block_size", [8, 16])
def test_decode_attention_matches_the_reference(heads, kv_heads, head_dim, block_size):
    lens = torch.randint(1, 150, (13,)).tolist() + [block_size, 1]  # a full block, a single key
    q, k_cache, v_cache, tables, lens_t = decode_inputs(lens, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                                                        block_size=block_size, strided_q=True)
    out = native_decode(q, k_cache, v_cache, tables, lens_t, 0.2)
    torch.testing.assert_close(out, expected_decode(q, k_cache, v_cache, tables, lens_t, 0.2), **TOL)


@pytest.mark.parametrize("window, softcap", [(7, None), (None, 1.5), (33, 4.0), (200, None)])
def test_decode_attention_window_and_softcap_never_read_blocks_before_the_window(window, softcap):
    lens = [90, 6, 33, 140, 71, 7]
    q, k_cache, v_cache, tables, lens_t = decode_inputs(lens, heads=4, kv_heads=2, head_dim=64, block_size=8)
    expected = expected_decode(q, k_cache, v_cache, tables, lens_t, 0.3, window, softcap)
    if window is not None:  # the blocks wholly before each row's first visible key may have been freed: NaN
        for b, n in enumerate(lens):
            for i in range(max(0, n - window) // 8):
                k_cache[tables[b, i]] = float("nan")
                v_cache[tables[b, i]] = float("nan")
    out = native_decode(q, k_cache, v_cache, tables, lens_t, 0.3, window, softcap)
    assert not out.isnan().any()
    torch.testing.assert_close(out, expected, **TOL)


def test_decode_attention_gives_a_row_the_same_bits_in_any_batch():
    lens = torch.randint(20, 120, (9,)).tolist()
    q, k_cache, v_cache, tables, lens_t = decode_inputs(lens, heads=4, kv_heads=2, head_dim=64, block_size=16)
    together = native_decode(q, k_cache, v_cache, tables, lens_t, 0.125)
    for b in (0, 4, 8):
        alone = native_decode(q[b:b + 1], k_cache, v_cache, tables[b:b + 1].contiguous(), lens_t[b:b + 1], 0.125)
        assert torch.equal(alone[0], together[b])


def test_cache_and_attend_runs_float32_decode_rows_natively_and_others_on_torch(monkeypatch):
    calls = []
    real = cpu_native.decode_attention
    monkeypatch.setattr(cpu_native, "decode_attention", lambda *a, **k: calls.append(1) or real(*a, **k))
    q, k_cache, v_cache, tables, lens = decode_inputs([5, 40], heads=4, kv_heads=2, head_dim=32, block_size=8)
    key, value = torch.randn(2, 2, 32), torch.randn(2, 2, 32)
    slots = torch.tensor([int(tables[0, 0]) * 8 + 4, int(tables[1, 4]) * 8 + 7])
    plan = cpu.plan_attention(np.arange(3, dtype=np.int32), lens.numpy(), tables.numpy(), 8)
    cpu.cache_and_attend(q, key, value, k_cache, v_cache, slots, plan, 0.3)
    assert calls == [1]
    cpu.cache_and_attend(q.bfloat16(), key.bfloat16(), value.bfloat16(), k_cache.bfloat16(), v_cache.bfloat16(),
                         slots, plan, 0.3)
    assert calls == [1], "a bfloat16 cache is not the native kernel's"


def test_the_engine_keeps_no_decode_mirror_where_the_native_kernel_reads_the_cache():
    assert cpu.make_decode_mirror(torch.float32) is None
    assert isinstance(cpu.make_decode_mirror(torch.bfloat16), cpu.DecodeKVMirror)


def test_one_openmp_runtime_in_the_process():
    """The library links the libgomp torch loaded (one thread pool), not a second runtime."""
    assert cpu_native.available()
    with open("/proc/self/maps", encoding="utf-8") as maps:
        runtimes = {line.split()[-1] for line in maps if "libgomp" in line or "libiomp" in line}
    assert len(runtimes) == 1, runtimes


def test_wrong_inputs_are_refused_naming_the_tensor():
    q, k_cache, v_cache, tables, lens = decode_inputs([9, 17], heads=4, kv_heads=2, head_dim=32, block_size=8)
    with pytest.raises(ValueError, match="tables"):
        native_decode(q, k_cache, v_cache, tables.long(), lens, 0.3)
    with pytest.raises(ValueError, match="lens"):
        native_decode(q, k_cache, v_cache, tables, lens.long(), 0.3)
    with pytest.raises(ValueError, match="shapes disagree"):
        native_decode(q, k_cache, v_cache, tables[:1].contiguous(), lens, 0.3)
    assert not cpu_native.decode_attention_supported(q.double(), cpu.heads_major(k_cache))
    assert not cpu_native.decode_attention_supported(q, None)  # a cache in the plain layout


# -- the build -------------------------------------------------------------------------------------------------------
@pytest.fixture
def fresh_build(monkeypatch, tmp_path):
    """An empty cache directory and no loaded library; the real one is restored afterwards."""
    monkeypatch.setenv("ASYNCENGINE_CACHE_DIR", str(tmp_path))
    cpu_native.library.cache_clear()
    yield tmp_path
    cpu_native.library.cache_clear()


def test_a_build_is_cached_on_disk_and_reused(fresh_build, monkeypatch):
    assert cpu_native.available()
    built = list((fresh_build / "cpu_native").glob("cpu_native-*.so"))
    assert len(built) == 1
    cpu_native.library.cache_clear()

    def no_compiling(*args, **kwargs):
        if "--version" not in args[0]:
            raise AssertionError(f"compiled again: {args[0]}")
        return real_run(*args, **kwargs)

    real_run = cpu_native.subprocess.run
    monkeypatch.setattr(cpu_native.subprocess, "run", no_compiling)
    assert cpu_native.available()


def test_without_a_compiler_a_warning_says_what_runs_instead_and_the_torch_path_works(fresh_build, monkeypatch,
                                                                                       caplog):
    monkeypatch.setenv("CC", str(fresh_build / "no-such-compiler"))
    with caplog.at_level(logging.WARNING, logger=cpu_native.__name__):
        assert not cpu_native.available()
        assert not cpu_native.available()  # warned once
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "SDPA" in warnings[0] and "compiler" in warnings[0]
    assert isinstance(cpu.make_decode_mirror(torch.float32), cpu.DecodeKVMirror)
    q, k_cache, v_cache, tables, lens = decode_inputs([12, 30], heads=4, kv_heads=2, head_dim=32, block_size=8)
    assert not cpu_native.decode_attention_supported(q, cpu.heads_major(k_cache))


def test_a_failing_compile_is_reported_with_the_compilers_message(fresh_build, monkeypatch, caplog):
    broken = fresh_build / "broken.c"
    broken.write_text("this is not C\n")
    monkeypatch.setattr(cpu_native, "SOURCE", broken)
    with caplog.at_level(logging.WARNING, logger=cpu_native.__name__):
        assert cpu_native.library() is None
    assert any("failed" in r.getMessage() and "error" in r.getMessage() for r in caplog.records)
    assert not list((fresh_build / "cpu_native").glob("*.so")), "no partial library left behind"


# -- element-wise ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("tokens, hidden", [(1, 256), (64, 256), (7, 100), (33, 2048)])
def test_rms_norm_and_the_residual_add_match_the_reference(tokens, hidden):
    wide = torch.randn(tokens, hidden + 24)
    x = wide[:, :hidden]  # rows with a stride, as a projection's slice
    weight, residual = torch.randn(hidden), torch.randn(tokens, hidden)
    torch.testing.assert_close(cpu_native.rms_norm(x, weight, 1e-5), reference.rms_norm(x, weight, 1e-5),
                               atol=1e-6, rtol=1e-5)
    expected, expected_residual = reference.fused_add_rms_norm(x, residual.clone(), weight, 1e-5)
    out = cpu_native.rms_norm(x, weight, 1e-5, residual=residual)
    assert torch.equal(residual, expected_residual), "the residual add is one float32 add: exact"
    torch.testing.assert_close(out, expected, atol=1e-6, rtol=1e-5)


def test_silu_and_mul_matches_the_reference_across_the_exponents_range():
    gate = torch.cat([torch.linspace(-100, 100, 4001), torch.randn(3999) * 4]).view(8, 1000)
    x = torch.cat([gate, torch.randn(8, 1000)], dim=1)
    torch.testing.assert_close(cpu_native.silu_and_mul(x), reference.silu_and_mul(x.clone()), atol=1e-6, rtol=2e-6)


def test_the_native_exp_keeps_nan_and_saturates_past_the_float_range():
    x = torch.tensor([[float("nan"), 200.0, -200.0, 89.0, -89.0, 0.0, 1.0, -3.0]])
    out = cpu_native.silu_and_mul(torch.cat([x, torch.ones_like(x)], dim=1))[0]
    assert out[0].isnan(), "NaN must propagate, not be clamped into a number"
    torch.testing.assert_close(out[1:], torch.nn.functional.silu(x[0, 1:]), atol=1e-6, rtol=1e-6)


def test_cpu_kernels_take_the_native_element_wise_path_for_float32_rows(monkeypatch):
    calls = []
    for name in ("rms_norm", "silu_and_mul"):
        real = getattr(cpu_native, name)
        monkeypatch.setattr(cpu_native, name, lambda *a, _real=real, _n=name, **k: calls.append(_n) or _real(*a, **k))
    x, residual, weight = torch.randn(5, 64), torch.randn(5, 64), torch.randn(64)
    cpu.rms_norm(x, weight, 1e-6)
    cpu.fused_add_rms_norm(x, residual, weight, 1e-6)
    cpu.silu_and_mul(torch.randn(5, 128))
    assert calls == ["rms_norm", "rms_norm", "silu_and_mul"]
    cpu.rms_norm(x.bfloat16(), weight.bfloat16(), 1e-6)
    cpu.silu_and_mul(torch.randn(5, 128, dtype=torch.bfloat16))
    assert len(calls) == 3, "bfloat16 stays on torch"


# -- where the engine's torch work runs --------------------------------------------------------------------------
def test_llm_and_the_in_process_client_build_their_engine_on_the_thread_that_steps_it(monkeypatch):
    """(pooling_engine.build_engine_on_its_thread: with a second OpenMP thread pool in the process, every parallel
    region of a step paid a futex wake-up, 1.35x of the default model's offline decode on 2 cores)."""
    import threading

    from asyncengine import LLM, SamplingParams, pooling_engine
    from asyncengine.config import EngineConfig
    from asyncengine.engine_client import InProcessClient

    built_on = []
    real = pooling_engine.build_engine
    monkeypatch.setattr(pooling_engine, "build_engine",
                        lambda config: built_on.append(threading.current_thread().name) or real(config))
    llm = LLM(num_kv_blocks=160, max_num_seqs=4)
    stepped_on = llm._device_thread.submit(lambda: threading.current_thread().name).result()
    assert built_on == [stepped_on] and stepped_on.startswith("asyncengine-llm")
    assert llm.generate(["To be"], SamplingParams(max_tokens=3), use_tqdm=False)[0].outputs[0].token_ids
    llm.close()
    client = InProcessClient(EngineConfig(num_kv_blocks=160, max_num_seqs=4))
    try:
        assert built_on[1] == client._device_thread.submit(lambda: threading.current_thread().name).result()
    finally:
        client.close()


def test_write_kv_writes_exactly_what_index_copy_writes_and_refuses_a_slot_out_of_range():
    tokens, kv_heads, head_dim, num_blocks, block_size = 11, 2, 64, 9, 8
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache, v_cache = (cpu.allocate_kv_cache(shape, torch.float32).normal_() for _ in "kv")
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    kv = torch.randn(tokens, 2 * kv_heads * head_dim + 5)  # strided views of one projection output
    key = kv[:, : kv_heads * head_dim].view(tokens, kv_heads, head_dim)
    value = kv[:, kv_heads * head_dim: 2 * kv_heads * head_dim].view(tokens, kv_heads, head_dim)
    slots = torch.randperm(num_blocks * block_size)[:tokens]
    reference.reshape_and_cache(key, value, ref_k, ref_v, slots)
    cpu.write_cache(key, value, k_cache, v_cache, slots)
    assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)
    storage = (kv_heads, -1, head_dim)
    before = k_cache.clone()
    with pytest.raises(ValueError, match="slots must lie"):
        cpu_native.write_kv(key, value, cpu.heads_major(k_cache).view(storage), cpu.heads_major(v_cache).view(storage),
                            torch.tensor([0] * (tokens - 1) + [num_blocks * block_size]))
    assert torch.equal(k_cache, before), "nothing written"


def test_argmax_rows_matches_torch_first_maximum_and_nan():
    x = torch.randn(9, 1000)
    x[1, 10] = x[1, 700] = 50.0  # a tie: the first
    x[2, 333] = float("nan")
    x[2, 900] = float("nan")
    x[3] = float("-inf")
    x[4, :] = 7.0
    x[5, 999] = float("inf")
    wide = torch.cat([x, torch.randn(9, 24)], dim=1)[:, :1000]  # strided rows
    for logits in (x, wide):
        assert torch.equal(cpu_native.argmax_rows(logits), logits.argmax(dim=-1))
    from asyncengine.sampler import greedy_tokens

    assert torch.equal(greedy_tokens(x), x.argmax(dim=-1))


def test_rotary_matches_the_reference_in_place_on_one_qkv_row_and_on_separate_tensors():
    tokens, heads, kv_heads, head_dim = 13, 4, 2, 64
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    freqs = torch.arange(256).float()[:, None] * inv_freq
    cache = torch.cat((freqs.cos(), freqs.sin()), dim=-1)  # [256, D]
    positions = torch.randint(0, 256, (tokens,))
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim)
    q, k, _ = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    exp_q, exp_k = reference.rotary_embedding(positions, q.clone(), k.clone(), cache, head_dim)
    calls = []
    real = cpu_native.rotary_neox

    def counted(*args):
        calls.append(args[0].shape)
        return real(*args)

    try:
        cpu_native.rotary_neox = counted
        cpu.rotary_embedding(positions, q, k, cache, head_dim)
        assert calls == [(tokens, (heads + kv_heads) * head_dim)], "q and k of one qkv row: one pass"
        q2, k2 = torch.randn(tokens, heads * head_dim), torch.randn(tokens, kv_heads * head_dim)
        exp_q2, exp_k2 = reference.rotary_embedding(positions, q2.clone(), k2.clone(), cache, head_dim)
        cpu.rotary_embedding(positions, q2, k2, cache, head_dim)
        assert len(calls) == 3
    finally:
        cpu_native.rotary_neox = real
    for got, expected in ((q, exp_q), (k, exp_k), (q2, exp_q2), (k2, exp_k2)):
        torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-6)
    before = q2.clone()
    with pytest.raises(ValueError, match="positions"):
        cpu_native.rotary_neox(q2, torch.full((tokens,), 256), cache, head_dim)
    assert torch.equal(q2, before)

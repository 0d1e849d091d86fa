"""The FP8 KV cache (`--kv-cache-dtype fp8`): K/V stored in e4m3 with one float32 scale per layer for K and one
for V, quantized on write (x * (1 / scale), saturating at +-448) and dequantized on read inside attention.

- Kernels (Triton's interpreter on CPU, native with CUDA) on fresh random inputs, outputs poisoned with NaN: the
  cache write equals `reference.reshape_and_cache` bit for bit; attention over an e4m3 cache equals the reference
  that dequantizes the same cache (the attention tolerances of test_kernels.py), and stays within 8% (relative
  Frobenius error) of attention over the float32 values the cache was written from: e4m3 keeps 3 mantissa bits,
  a rounding error of at most 2^-4 (6.25%) of each element, about 3.6% rms (measured: 3.7% to 5.4% over 8 seeds,
  the softmax amplifying the error of K where scores are peaked).
  Triton's interpreter loads e4m3 correctly (every finite bit pattern) but rounds its float32 -> e4m3 cast wrongly
  (a carry into the exponent is dropped: 126.7 -> 64; subnormals flush): the cache kernel therefore rounds in
  float32 itself (`cache._round_to_e4m3`), on the GPU too, and the cast only converts exact values. Both facts
  are tested below, so the kernels are never skipped on CPU.
- The CPU kernels (`kernels/cpu.py`) store e4m3 too and agree with the references.
- The engine on CPU: the block count at the same memory is 2x bf16 (4x float32). Greedy decoding with the FP8
  cache, teacher-forced on the engine's own tokens: transformers whose attention sees K/V rounded through e4m3
  the same way picks exactly the engine's tokens (logprobs within 2e-3); unquantized transformers rates each of
  them within 0.15 nats of its best (0.5 for mixtures of experts, whose routing can flip), so near-ties may make
  the texts part (measured on the shipped model: 2 of 4 prompts' 16 tokens identical, the others parting at steps
  10 and 11). Every family; prefix caching, chunked prefill and preemption give the very tokens of a plain run.
- Scales: the checkpoint's own (k_scale / v_scale, the legacy kv_scale, compressed-tensors' kv_cache_scheme as
  compressed-tensors itself writes it), else 1.0.
"""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

from asyncengine import LLM, SamplingParams  # noqa: E402
from asyncengine.config import EngineConfig  # noqa: E402
from asyncengine.kernels import cpu, reference  # noqa: E402
from asyncengine.kernels.cache import _round_to_e4m3  # noqa: E402
from checkpoints import ARCHITECTURES  # noqa: E402
from conftest import assert_no_leaks  # noqa: E402
from test_cpu_kernels import shuffled_block_tables  # noqa: E402
from test_kernels import fresh_seed  # noqa: E402,F401 - autouse: a fresh seed per test

FP8 = torch.float8_e4m3fn
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
ATTENTION_TOLERANCE = {torch.float32: dict(atol=2e-4, rtol=2e-4), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}
FP8_VS_FULL_PRECISION = 0.08  # relative error of attention over an e4m3 cache against the float32 values


@pytest.fixture(autouse=True)
def nan_poisoned_empty(monkeypatch):
    """Every floating torch.empty returns NaNs, so an output (or workspace) element left unwritten shows up."""
    # `with torch.device(...)` finds constructors in a set torch builds once, on first use: built while the
    # wrapper below stands in for torch.empty, it would miss the real one and place nothing (an engine built in a
    # poisoned test landed on the CPU). Build it now, with the real torch.empty.
    from torch.utils._device import _device_constructors

    _device_constructors()
    real_empty = torch.empty

    def empty(*args, **kwargs):
        tensor = real_empty(*args, **kwargs)
        if tensor.is_floating_point() and tensor.dtype != FP8:
            tensor.fill_(float("nan"))
        return tensor

    monkeypatch.setattr(torch, "empty", empty)




def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype == FP8 and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def random_fp8(shape, device=DEVICE) -> torch.Tensor:
    """Random finite e4m3 values spread over many binades (|x| up to about 300)."""
    return (torch.randn(shape, device=device) * torch.exp2(torch.randint(-3, 7, shape, device=device).float())
            ).clamp(-448, 448).to(FP8)


# ----------------------------------------------------------------------------------------------------------------
# Triton kernels (the interpreter on CPU)
# ----------------------------------------------------------------------------------------------------------------


@triton.jit
def convert(src, dst, N: tl.constexpr):
    """dst[:N] = src[:N] cast to dst's dtype."""
    i = tl.arange(0, N)
    tl.store(dst + i, tl.load(src + i).to(dst.dtype.element_ty))


@triton.jit
def quantize(src, dst, N: tl.constexpr):
    """dst[:N] = src[:N] rounded as the cache kernel rounds (float32, |x| <= 448), then cast to e4m3."""
    i = tl.arange(0, N)
    tl.store(dst + i, _round_to_e4m3(tl.load(src + i)).to(dst.dtype.element_ty))


@pytest.mark.skipif(torch.cuda.is_available(), reason="a fact about Triton's interpreter")
def test_interpreter_loads_e4m3_exactly_but_its_float32_cast_rounds_wrongly():
    """Why the cache kernel rounds to the e4m3 grid itself. If the second half fails, Triton fixed its cast."""
    patterns = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(FP8)
    finite = ~patterns.float().isnan()
    loaded = torch.zeros(256)
    convert[(1,)](patterns, loaded, N=256)
    assert torch.equal(loaded[finite], patterns.float()[finite])  # every finite e4m3 value loads exactly
    x = torch.tensor([126.7, -0.00125, 1.0, 3.0] * 4)
    cast = torch.zeros(16, dtype=FP8)
    convert[(1,)](x, cast, N=16)
    assert cast[0].item() == 64.0 and x[0].to(FP8).item() == 128.0  # the carry into the exponent is dropped


def test_cache_kernel_rounding_equals_torch_on_every_midpoint_and_random_values():
    """`_round_to_e4m3` then the cast: torch's float32 -> e4m3 (nearest, ties to even) bit for bit, on every e4m3
    value, every midpoint between neighbours (the ties), subnormals, zeros of both signs and random values."""
    grid = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(FP8).float()
    grid = grid[~grid.isnan()].sort().values
    random = (torch.randn(2048) * torch.exp2(torch.randint(-14, 9, (2048,)).float())).clamp(-448, 448)
    x = torch.cat([grid, (grid[1:] + grid[:-1]) / 2, random, torch.tensor([0.0, -0.0, 1e-12, -1e-12])])
    x = torch.cat([x, torch.zeros(4096 - x.numel())]).to(DEVICE)
    out = torch.zeros(4096, dtype=FP8, device=DEVICE)
    quantize[(1,)](x, out, N=4096)
    assert same_bytes(out, x.to(FP8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reshape_and_cache_fp8_equals_reference_bit_for_bit_and_skips_padding(dtype):
    from asyncengine.kernels import cache

    tokens, kv_heads, head_dim, num_blocks, block_size = 9, 2, 64, 6, 16
    # strided views of one projection, with values past +-448 * scale (saturated) and tiny ones (subnormal)
    kv = torch.randn(tokens, 2, kv_heads, head_dim, device=DEVICE) * torch.exp2(
        torch.randint(-12, 6, (tokens, 2, kv_heads, head_dim), device=DEVICE).float())
    kv[0, :, 0, :3] = torch.tensor([1e4, -1e4, 30.0])  # past +-448 * scale: saturated
    kv = kv.to(dtype)
    key, value = kv[:, 0], kv[:, 1]
    k_scale, v_scale = (0.01 + 0.1 * torch.rand(2)).tolist()
    slots = torch.randperm(num_blocks * block_size, device=DEVICE)[:tokens]
    slots[[2, 5]] = -1  # padding
    k_cache = random_fp8((num_blocks, block_size, kv_heads, head_dim))
    v_cache = random_fp8((num_blocks, block_size, kv_heads, head_dim))
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    reference.reshape_and_cache(key, value, ref_k, ref_v, slots, k_scale, v_scale)
    cache.reshape_and_cache(key, value, k_cache, v_cache, slots, k_scale, v_scale)
    assert same_bytes(k_cache, ref_k) and same_bytes(v_cache, ref_v)
    written = ref_k.view(-1, kv_heads, head_dim)[slots[0]].float()  # token 0's slot (not padding)
    assert written[0, :2].tolist() == [448.0, -448.0]  # saturated, not NaN


def make_fp8_batch(q_lens, seq_lens, *, heads=4, kv_heads=2, head_dim=64, block_size=16, dtype=torch.float32):
    """Random q [T, H, D] and e4m3 caches with shuffled block tables (unused entries point at valid blocks)."""
    tables, num_blocks = shuffled_block_tables(seq_lens, block_size, spare_blocks=3, spare_columns=1)
    shape = (num_blocks, block_size, kv_heads, head_dim)
    qsl = torch.tensor(np.concatenate([[0], np.cumsum(q_lens)]), dtype=torch.int32, device=DEVICE)
    q = torch.randn(int(qsl[-1]), heads, head_dim, dtype=dtype, device=DEVICE)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    return q, random_fp8(shape), random_fp8(shape), qsl, lens, tables.to(DEVICE)


MIXED = ([7, 1, 5, 1, 20], [7, 30, 40, 1, 20])  # a prompt, decodes, a chunk behind a cached prefix


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("give_max_lens", [True, False])
def test_attention_over_fp8_cache_equals_reference_dequantizing_it(dtype, give_max_lens):
    from asyncengine.kernels import attention

    q, k_cache, v_cache, qsl, lens, tables = make_fp8_batch(*MIXED, dtype=dtype)
    k_scale, v_scale = 0.004, 0.01  # the random e4m3 values span +-300: scores of order 1
    hints = dict(max_query_len=20, max_seq_len=40) if give_max_lens else {}
    out = attention.paged_attention(q, k_cache, v_cache, qsl, lens, tables, 0.125, k_scale=k_scale,
                                    v_scale=v_scale, **hints)
    ref = reference.paged_attention(q, k_cache, v_cache, qsl.cpu(), lens.cpu(), tables, 0.125, k_scale=k_scale,
                                    v_scale=v_scale)
    assert not out.isnan().any()
    torch.testing.assert_close(out.float(), ref.float(), **ATTENTION_TOLERANCE[dtype])
    # the scales are used, not ignored: without them the reference differs by far more than the tolerance
    plain = reference.paged_attention(q, k_cache, v_cache, qsl.cpu(), lens.cpu(), tables, 0.125)
    assert rel_error(plain, ref) > 0.1


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("window, softcap", [(None, None), (9, 20.0)], ids=["full", "window-softcap"])
def test_split_kv_decode_over_fp8_cache_with_window_and_softcap(num_splits, window, softcap):
    from asyncengine.kernels import attention

    q, k_cache, v_cache, qsl, lens, tables = make_fp8_batch([1, 1, 1], [50, 17, 33])
    scales = dict(k_scale=0.003, v_scale=0.02)
    out = attention.paged_attention_decode(q, k_cache, v_cache, qsl, lens, tables, 0.125, num_splits,
                                           sliding_window=window, softcap=softcap, **scales)
    ref = reference.paged_attention(q, k_cache, v_cache, qsl.cpu(), lens.cpu(), tables, 0.125, window, softcap,
                                    **scales)
    torch.testing.assert_close(out, ref, **ATTENTION_TOLERANCE[torch.float32])


def test_fp8_cache_written_then_read_is_close_to_the_float32_cache():
    """The whole path: the same K/V written by the Triton kernel into a float32 cache and into an e4m3 cache (scale
    amax / 448 per tensor, as a calibrated checkpoint has it), then attention over each."""
    from asyncengine.kernels import attention, cache

    q_lens, seq_lens = [12, 1, 1], [12, 40, 23]
    q, k_cache, _, qsl, lens, tables = make_fp8_batch(q_lens, seq_lens)
    num_blocks, block_size, kv_heads, head_dim = k_cache.shape
    slots = torch.cat([torch.stack([tables[b, p // block_size] * block_size + p % block_size for p in range(n)])
                       for b, n in enumerate(seq_lens)]).long()
    key = torch.randn(len(slots), kv_heads, head_dim, device=DEVICE) * 3
    value = torch.randn(len(slots), kv_heads, head_dim, device=DEVICE)
    full = [torch.zeros(num_blocks, block_size, kv_heads, head_dim, device=DEVICE) for _ in range(2)]
    fp8 = [torch.zeros(num_blocks, block_size, kv_heads, head_dim, dtype=FP8, device=DEVICE) for _ in range(2)]
    k_scale, v_scale = key.abs().max().item() / 448, value.abs().max().item() / 448
    cache.reshape_and_cache(key, value, *full, slots)
    cache.reshape_and_cache(key, value, *fp8, slots, k_scale, v_scale)
    exact = attention.paged_attention(q, *full, qsl, lens, tables, 0.125)
    approx = attention.paged_attention(q, *fp8, qsl, lens, tables, 0.125, k_scale=k_scale, v_scale=v_scale)
    error = rel_error(approx, exact)
    assert 0 < error < FP8_VS_FULL_PRECISION, error


# Compiles the FP8 variants for a GPU architecture (no GPU needed: Triton's own ptxas), outside the interpreter.
AHEAD_OF_TIME = """
import sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from asyncengine.kernels import attention, cache

target = GPUTarget("cuda", int(sys.argv[1]), 32)

def compile_kernel(fn, pointers, constants):
    signature = {a: "constexpr" if a in constants else pointers.get(a, "fp32" if "scale" in a else "i32")
                 for a in fn.arg_names}
    try:
        return "e4m3" in triton.compile(ASTSource(fn, signature, constants), target=target).asm["ptx"]
    except Exception as e:
        print(e)
        return False

fp8, bf16, i32, f32 = "*fp8e4nv", "*bf16", "*i32", "*fp32"
shape = dict(BLOCK_SIZE=16, HEAD_DIM=128, HEAD_DIM_PAD=128)
pdl = dict(USE_PDL=int(sys.argv[1]) >= 90)  # programmatic dependent launch: Hopper's griddepcontrol
results = [
    compile_kernel(cache._reshape_and_cache_kernel,
                   dict(key_ptr=bf16, value_ptr=bf16, k_cache_ptr=fp8, v_cache_ptr=fp8, slot_ptr="*i64"),
                   dict(shape, **pdl, HEADS_PAD=8, QUANT=True)),
    compile_kernel(attention._prefill_kernel,
                   dict(out_ptr=bf16, q_ptr=bf16, k_cache_ptr=fp8, v_cache_ptr=fp8, query_start_loc_ptr=i32,
                        seq_lens_ptr=i32, block_tables_ptr=i32),
                   dict(shape, GROUP=4, GROUP_PAD=4, BLOCK_Q=16, BLOCK_N=64, DOT_F32=False, PRECISION="tf32x3",
                        CAUSAL=True, SLIDING_WINDOW=0, SOFTCAP=0.0, KV_FP8=True)),
    compile_kernel(attention._decode_partial_kernel,
                   dict(part_acc_ptr=f32, part_max_ptr=f32, part_sum_ptr=f32, out_ptr=bf16, counter_ptr=i32,
                        q_ptr=bf16, k_cache_ptr=fp8, v_cache_ptr=fp8, query_start_loc_ptr=i32, seq_lens_ptr=i32,
                        block_tables_ptr=i32),
                   dict(shape, **pdl, NUM_SPLITS=4, GROUP=4, BLOCK_H=16, BLOCK_N=64, DOT_F32=False,
                        PRECISION="tf32x3", SLIDING_WINDOW=0, SOFTCAP=0.0, KV_FP8=True, FUSED_REDUCE=True,
                        SPLITS_PAD=4, MERGE_HEADS=4)),
]
print("compiled", sum(results), "of", len(results))
"""


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU tests run these kernels natively")
def test_fp8_kernels_compile_for_hopper_and_triton_refuses_older_gpus(tmp_path):
    """Without a GPU, the FP8 kernels (cache write, prefill, split-KV decode; bf16 queries) compile to sm_90 code
    that converts e4m3 (sm_89 too, checked by hand); for sm_80 Triton refuses e4m3 ("fp8e4nv not supported in this
    architecture"), which is why EngineConfig refuses --kv-cache-dtype fp8 below compute capability 8.9.
    About 30 s on 2 loaded cores (a fresh Triton cache): slow."""
    import subprocess
    import sys

    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_CACHE_DIR": str(tmp_path)}
    for arch, expected in (("90", "compiled 3 of 3"), ("80", "compiled 0 of 3")):
        run = subprocess.run([sys.executable, "-c", AHEAD_OF_TIME, arch], env=env, capture_output=True, text=True,
                             timeout=600)
        assert expected in run.stdout, (arch, run.stdout[-2000:], run.stderr[-2000:])
    assert "fp8e4nv not supported in this architecture" in run.stdout


def test_attention_refuses_mixed_cache_dtypes():
    from asyncengine.kernels import attention

    q, k_cache, v_cache, qsl, lens, tables = make_fp8_batch([1], [5])
    with pytest.raises(ValueError, match="must both be"):
        attention.paged_attention(q, k_cache, v_cache.float(), qsl, lens, tables, 0.125)


# ----------------------------------------------------------------------------------------------------------------
# CPU kernels
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("heads_major", [False, True], ids=["plain-cache", "heads-major-cache"])
@pytest.mark.parametrize("window", [None, 9])
def test_cpu_cache_and_attend_fp8_equals_references(heads_major, window):
    """A fresh prompt (attends to its own keys, rounded through e4m3 as the cache holds them), a chunk behind a
    cached prefix and decodes: the cache bytes equal the reference write, the output the reference attention."""
    q_lens, seq_lens = [7, 1, 5, 1], [7, 30, 40, 18]
    block_size, kv_heads, head_dim = 16, 2, 32
    blocks_per_seq = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_seq) + 2
    tables = torch.randperm(num_blocks)[: sum(blocks_per_seq)].split(blocks_per_seq)
    tables = torch.stack([torch.cat([t, t.new_zeros(max(blocks_per_seq) - len(t))]) for t in tables]).int()
    shape = (num_blocks, block_size, kv_heads, head_dim)
    caches = [random_fp8(shape, "cpu") for _ in range(2)]
    if heads_major:
        caches = [cpu.allocate_kv_cache(shape, FP8).view(torch.uint8).copy_(c.view(torch.uint8)).view(FP8)
                  for c in caches]
        assert cpu.heads_major(caches[0]) is not None
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    q = torch.randn(int(qsl[-1]), 4, head_dim)
    key, value = torch.randn(2, int(qsl[-1]), kv_heads, head_dim) * 0.5
    positions = np.concatenate([np.arange(s - n, s) for n, s in zip(q_lens, seq_lens)])
    rows = np.repeat(np.arange(len(q_lens)), q_lens)
    slots = torch.from_numpy(tables.numpy()[rows, positions // block_size].astype(np.int64) * block_size
                             + positions % block_size)
    scales = dict(k_scale=0.004, v_scale=0.01)
    ref_k, ref_v = (c.clone() for c in caches)
    reference.reshape_and_cache(key, value, ref_k, ref_v, slots, **scales)
    lens = np.asarray(seq_lens, dtype=np.int32)
    expected = reference.paged_attention(q, ref_k, ref_v, torch.from_numpy(qsl), torch.from_numpy(lens), tables,
                                         0.125, window, None, **scales)
    plan = cpu.plan_attention(qsl, lens, tables.numpy(), block_size)
    out = cpu.cache_and_attend(q, key, value, *caches, slots, plan, 0.125, window, None, **scales)
    assert same_bytes(caches[0], ref_k) and same_bytes(caches[1], ref_v)
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=1e-5)


# ----------------------------------------------------------------------------------------------------------------
# Configuration
# ----------------------------------------------------------------------------------------------------------------


def test_unknown_kv_cache_dtype_names_the_flag_and_the_supported_values():
    with pytest.raises(ValueError, match=r"kv_cache_dtype \(--kv-cache-dtype\) 'fp8_e5m2' is not supported "
                                         r"\(supported: auto, fp8, fp8_e4m3\)"):
        EngineConfig(kv_cache_dtype="fp8_e5m2")


def test_fp8_kv_cache_on_a_gpu_without_e4m3_fails_at_start_up_saying_what_works(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100")
    with pytest.raises(ValueError, match=r"compute capability 8.9 or newer .*A100 is 8.0 \(supported here: auto\)"):
        EngineConfig(kv_cache_dtype="fp8", device="cuda")
    EngineConfig(kv_cache_dtype="auto", device="cuda")  # the bf16 cache is fine there


def test_fp8_kv_cache_is_refused_for_a_pooling_runner():
    with pytest.raises(ValueError, match="needs the generate runner"):
        EngineConfig(kv_cache_dtype="fp8", runner="pooling")


def test_cli_kv_cache_dtype_flag_reaches_the_engine_config():
    from asyncengine.api.cli import build_parser, engine_config, with_default_command

    parser = build_parser()
    for value in ("auto", "fp8", "fp8_e4m3"):
        args = parser.parse_args(with_default_command(["serve", "--kv-cache-dtype", value]))
        assert engine_config(args).kv_cache_dtype == value
    assert engine_config(parser.parse_args(with_default_command(["serve"]))).kv_cache_dtype == "auto"
    with pytest.raises(ValueError, match="--kv-cache-dtype"):
        engine_config(parser.parse_args(with_default_command(["serve", "--kv-cache-dtype", "int8"])))


# ----------------------------------------------------------------------------------------------------------------
# The engine on CPU
# ----------------------------------------------------------------------------------------------------------------

PROMPTS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog. 0123456789",
    "Paged attention stores keys and values in fixed-size blocks. Continuous batching keeps the accelerator busy",
    [0, 5, 17, 42, 99, 7],
]
NEW_TOKENS = 16
NATS = 0.15  # how far (log-probability) the FP8 engine may stray from unquantized transformers at one step
SAME_NATS = 2e-3  # ... and from transformers whose attention sees the same e4m3-rounded K/V


def attention_layers(llm):
    from asyncengine.models.layers import PagedAttention

    return [m for m in llm.engine.runner.model.modules() if isinstance(m, PagedAttention)]


def greedy_with_logprobs(llm, prompts=PROMPTS):
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS, logprobs=1)
    return llm.generate(prompts, params, use_tqdm=False)


def transformers_model(folder, kv_scales=None):
    """transformers' own model of folder (float32); with kv_scales ([(k_scale, v_scale)] per layer) its attention
    sees K (after rotary) and V rounded through e4m3 with those scales, as our FP8 cache holds them (a function
    registered through transformers' AttentionInterface around the family's own eager attention, which knows its
    soft-capping)."""
    import sys

    from transformers import AttentionInterface, AutoModelForCausalLM
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    if kv_scales is None:
        return AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)

    def fp8_kv_attention(module, query, key, value, *args, **kwargs):
        k_scale, v_scale = kv_scales[module.layer_idx]
        key = reference.dequantize_kv(reference.quantize_kv(key, k_scale, FP8), k_scale, key.dtype)
        value = reference.dequantize_kv(reference.quantize_kv(value, v_scale, FP8), v_scale, value.dtype)
        eager = sys.modules[type(module).__module__].eager_attention_forward
        return eager(module, query, key, value, *args, **kwargs)

    AttentionInterface.register("fp8_kv_cache_test", fp8_kv_attention)
    AttentionMaskInterface.register("fp8_kv_cache_test", eager_mask)  # the masks eager attention takes
    return AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32,
                                                attn_implementation="fp8_kv_cache_test")


def teacher_forced_logprobs(model, out, eos_ids) -> torch.Tensor:
    """[N, vocab] log-probabilities of `model` at the N steps that produced out's generated tokens, EOS set to
    -inf after the softmax (min_tokens keeps the engine from choosing it; its logprobs are the raw ones)."""
    prompt, generated = out.prompt_token_ids, out.outputs[0].token_ids
    with torch.no_grad():
        logits = model(torch.tensor([prompt + generated])).logits[0].float()
    logprobs = logits[len(prompt) - 1: len(prompt) - 1 + len(generated)].log_softmax(-1)
    logprobs[:, eos_ids] = float("-inf")
    return logprobs


def assert_tracks_transformers(folder, llm, outputs, exact_nats: float = NATS) -> None:
    """Teacher-forced on the engine's tokens:
    - transformers with K/V rounded through e4m3 as our cache holds them picks every one of the engine's tokens
      as its greedy choice, with the engine's logprob to SAME_NATS (float32 rounding, and a K element on an e4m3
      midpoint rounded the other way after a rotary that differs in the last bit);
    - transformers with exact K/V rates each chosen token within NATS of its best and gives it a logprob within
      NATS of the engine's: what e4m3 costs on this model (on the shipped model, measured: at most 0.094 nats;
      greedy texts equal for 2 of 4 prompts, the others parting at steps 10 and 11)."""
    scales = [(a.k_scale, a.v_scale) for a in attention_layers(llm)]
    fp8_model, exact_model = transformers_model(folder, scales), transformers_model(folder)
    eos = llm.engine.model_config.eos_token_ids
    for out in outputs:
        generated = torch.tensor(out.outputs[0].token_ids)
        engine_chosen = torch.tensor([lp[t].logprob for lp, t in zip(out.outputs[0].logprobs, generated.tolist())])
        same = teacher_forced_logprobs(fp8_model, out, eos)
        assert torch.equal(same.argmax(-1), generated), "transformers with e4m3 K/V decodes other tokens"
        assert (same.gather(1, generated[:, None])[:, 0] - engine_chosen).abs().max() < SAME_NATS
        exact = teacher_forced_logprobs(exact_model, out, eos)
        hf_chosen = exact.gather(1, generated[:, None])[:, 0]
        shortfall = exact.max(-1).values - hf_chosen
        assert shortfall.max() < exact_nats, f"a token transformers rates {shortfall.max():.3f} nats below its best"
        assert (engine_chosen - hf_chosen).abs().max() < exact_nats


def test_fp8_cache_doubles_the_blocks_of_bf16_and_quadruples_float32(llama_dir):
    blocks = {}
    for dtype, kv in (("bfloat16", "auto"), ("float32", "auto"), ("float32", "fp8")):
        llm = LLM(str(llama_dir), dtype=dtype, kv_cache_dtype=kv, kv_cache_memory_gb=0.001, max_model_len=128,
                  device="cpu")  # kv_cache_memory_gb sizes the CPU cache
        runner = llm.engine.runner
        assert all(c.dtype == runner.kv_cache_dtype for pair in runner.kv_caches for c in pair)
        blocks[dtype, kv] = runner.num_blocks
    assert blocks["float32", "fp8"] == 2 * blocks["bfloat16", "auto"] == 4 * blocks["float32", "auto"], blocks
    assert llm.engine.runner.kv_caches[0][0].dtype == FP8


def test_greedy_with_fp8_cache_tracks_transformers_and_matches_across_cache_paths(llama_dir):
    """Scales 1.0 (the checkpoint has none). Prefix caching (the same prompts again), chunked prefill and
    preemption must give the plain run's tokens: the cache holds the same e4m3 values however it was filled."""
    llm = LLM(str(llama_dir), dtype="float32", kv_cache_dtype="fp8", max_model_len=128)
    assert {(a.k_scale, a.v_scale) for a in attention_layers(llm)} == {(1.0, 1.0)}
    outputs = greedy_with_logprobs(llm)
    assert_tracks_transformers(llama_dir, llm, outputs)
    tokens = [o.outputs[0].token_ids for o in outputs]
    again = greedy_with_logprobs(llm, PROMPTS[2:3])
    assert again[0].num_cached_tokens >= 16 and again[0].outputs[0].token_ids == tokens[2]
    assert_no_leaks(llm.engine)
    for options in (dict(max_num_batched_tokens=8, block_size=4),
                    dict(num_kv_blocks=32, block_size=4, max_num_seqs=8)):
        other = LLM(str(llama_dir), dtype="float32", kv_cache_dtype="fp8", max_model_len=128, **options)
        assert [o.outputs[0].token_ids for o in greedy_with_logprobs(other)] == tokens, options
        if "num_kv_blocks" in options:
            assert other.engine.scheduler.num_preemptions > 0
        assert_no_leaks(other.engine)


@pytest.mark.parametrize("arch", [a for a in ARCHITECTURES if a != "LlamaForCausalLM"])
def test_greedy_with_fp8_cache_tracks_transformers_in_every_family(checkpoint_dir, arch):
    """Sliding windows (Mistral, Phi-3, Gemma 2/3), soft-capping (Gemma 2), q/k norms (Qwen3), experts. Against
    exact transformers the mixtures of experts get 0.5 nats: e4m3's perturbation can flip a token's top-k experts,
    a jump rather than a drift (measured: 0.27 nats at one step of Mixtral); the e4m3-rounded reference must still
    give the very tokens."""
    folder = checkpoint_dir(arch)
    llm = LLM(str(folder), dtype="float32", kv_cache_dtype="fp8", max_model_len=128)
    assert_tracks_transformers(folder, llm, greedy_with_logprobs(llm), exact_nats=0.5 if "Moe" in arch or
                               "Mixtral" in arch else NATS)


def with_tensors(src, dst, extra: dict, config_update: dict | None = None):
    """A copy of checkpoint src with `extra` tensors added (and config.json updated)."""
    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    tensors.update(extra)
    save_file(tensors, str(dst / "model.safetensors"))
    if config_update:
        config = json.loads((dst / "config.json").read_text())
        config.update(config_update)
        (dst / "config.json").write_text(json.dumps(config))
    return dst


def layer_count(folder) -> int:
    return json.loads((folder / "config.json").read_text())["num_hidden_layers"]


@pytest.mark.parametrize("naming", ["k_scale", "kv_scale", "output_scale"])
def test_checkpoint_kv_scales_are_loaded_and_used(llama_dir, tmp_path, naming, caplog):
    """vLLM / llm-compressor's self_attn.k_scale and v_scale, the legacy single kv_scale (both), compressed-
    tensors' first layout (k_proj / v_proj output_scale), calibrated as amax / 448 of each layer's K / V (K with
    a margin of 2 for rotary). Greedy tracks transformers: the scales are applied on both the write and the read
    (one side alone would scale the scores or the outputs by 100x or more)."""
    import quant_checkpoints as qc

    n = layer_count(llama_dir)
    amax = qc._kv_amax(transformers_model(llama_dir))
    k_scales = [2 * amax[f"model.layers.{i}.self_attn.k_proj"] / 448 for i in range(n)]
    v_scales = [amax[f"model.layers.{i}.self_attn.v_proj"] / 448 for i in range(n)]
    names = {"k_scale": ("self_attn.k_scale", "self_attn.v_scale"), "kv_scale": ("self_attn.kv_scale", None),
             "output_scale": ("self_attn.k_proj.output_scale", "self_attn.v_proj.output_scale")}[naming]
    extra = {}
    for i in range(n):
        extra[f"model.layers.{i}.{names[0]}"] = torch.tensor(k_scales[i])
        if names[1]:
            extra[f"model.layers.{i}.{names[1]}"] = torch.tensor([v_scales[i]])
    folder = with_tensors(llama_dir, tmp_path / "scaled", extra)
    llm = LLM(str(folder), dtype="float32", kv_cache_dtype="fp8", max_model_len=128)
    expected_v = k_scales if naming == "kv_scale" else v_scales
    assert [a.k_scale for a in attention_layers(llm)] == pytest.approx(k_scales)
    assert [a.v_scale for a in attention_layers(llm)] == pytest.approx(expected_v)
    assert_tracks_transformers(llama_dir, llm, greedy_with_logprobs(llm, PROMPTS[:2]))
    with caplog.at_level("INFO", logger="asyncengine.model_runner"):  # auto: scales read, unused, and said so
        auto = LLM(str(folder), dtype="float32", max_model_len=128)
    assert auto.engine.runner.kv_caches[0][0].dtype == torch.float32
    assert "KV-cache scales are unused: the cache is float32" in caplog.text


@pytest.mark.slow
def test_two_ranks_with_fp8_cache_and_checkpoint_scales_give_the_tokens_of_one(llama_dir, tmp_path):
    """Each rank reads the scales (CheckpointSlices) and keeps its heads' cache in e4m3 (~40 s: slow)."""
    n = layer_count(llama_dir)
    extra = {f"model.layers.{i}.self_attn.{w}_scale": torch.tensor(0.004 * (i + 1)) for i in range(n) for w in "kv"}
    folder = with_tensors(llama_dir, tmp_path / "scaled", extra)
    tokens = {}
    for tp in (1, 2):
        llm = LLM(str(folder), dtype="float32", kv_cache_dtype="fp8", tensor_parallel_size=tp, max_model_len=128,
                  num_kv_blocks=32, block_size=4, max_num_seqs=8, device="cpu")  # one process per rank
        try:
            tokens[tp] = [o.outputs[0].token_ids for o in greedy_with_logprobs(llm)]
            assert llm.engine.scheduler.num_preemptions > 0
        finally:
            llm.close()
    assert tokens[2] == tokens[1]


def test_per_head_kv_scales_are_refused_naming_the_tensor(llama_dir, tmp_path):
    folder = with_tensors(llama_dir, tmp_path / "per-head", {"model.layers.0.self_attn.k_scale": torch.ones(2)})
    with pytest.raises(ValueError, match=r"'layers.0.self_attn.k_scale' must be one positive finite number"):
        LLM(str(folder), kv_cache_dtype="fp8")


def test_compressed_tensors_kv_cache_scheme_checkpoint_runs_with_its_scales(llama_dir, tmp_path):
    """An FP8_DYNAMIC checkpoint with an FP8 kv_cache_scheme, as compressed-tensors itself applies and writes it
    (its self_attn.k_scale / v_scale parameters, set here as an observer would: amax / 448 of the layer's K / V on
    a calibration prompt). Greedy tracks transformers on the dequantized weights."""
    import quant_checkpoints as qc

    qdir, ddir = qc.compressed_tensors_fp8_checkpoint(llama_dir, tmp_path, scheme="FP8_DYNAMIC", strategy="channel",
                                                      kv_cache_scheme=True)
    config = json.loads((qdir / "config.json").read_text())["quantization_config"]
    assert config["kv_cache_scheme"]["num_bits"] == 8 and config["kv_cache_scheme"]["type"] == "float"
    saved = load_file(str(qdir / "model.safetensors"))
    assert "model.layers.0.self_attn.k_scale" in saved
    llm = LLM(str(qdir), dtype="float32", kv_cache_dtype="fp8", max_model_len=128)
    layers = range(layer_count(qdir))
    for which in ("k", "v"):
        loaded = [getattr(a, f"{which}_scale") for a in attention_layers(llm)]
        assert loaded == [saved[f"model.layers.{i}.self_attn.{which}_scale"].item() for i in layers]
        assert all(scale != 1.0 for scale in loaded)
    assert_tracks_transformers(ddir, llm, greedy_with_logprobs(llm, PROMPTS[:2]))


def test_dynamic_kv_cache_scheme_is_refused_saying_what_is_supported():
    from asyncengine.quantization.compressed_tensors import compressed_tensors_config

    weights = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel", "dynamic": False}
    inputs = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "token", "dynamic": True}
    group = {"targets": ["Linear"], "weights": weights, "input_activations": inputs}
    base = {"format": "float-quantized", "config_groups": {"group_0": group}}
    kv = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "tensor", "dynamic": False}
    compressed_tensors_config({**base, "kv_cache_scheme": kv})
    with pytest.raises(ValueError, match="kv_cache_scheme strategy 'tensor' .*dynamic: True.*static per-tensor"):
        compressed_tensors_config({**base, "kv_cache_scheme": {**kv, "dynamic": True}})
    with pytest.raises(ValueError, match="kv_cache_scheme of type 'int' with 8 bits"):
        compressed_tensors_config({**base, "kv_cache_scheme": {**kv, "type": "int"}})


# ----------------------------------------------------------------------------------------------------------------
# GPU, at Llama-3-8B sizes
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@needs_cuda
def test_gpu_fp8_cache_write_at_llama_sizes_equals_reference_bit_for_bit():
    from asyncengine.kernels import cache

    tokens, kv_heads, head_dim, num_blocks, block_size = 4096, 8, 128, 1024, 16
    kv = (torch.randn(tokens, 2, kv_heads, head_dim, device="cuda") * 40).bfloat16()
    key, value = kv[:, 0], kv[:, 1]
    slots = torch.randperm(num_blocks * block_size, device="cuda")[:tokens]
    slots[::7] = -1
    caches = [random_fp8((num_blocks, block_size, kv_heads, head_dim)) for _ in range(2)]
    refs = [c.clone() for c in caches]
    cache.reshape_and_cache(key, value, *caches, slots, 0.07, 0.03)
    reference.reshape_and_cache(key, value, *refs, slots, 0.07, 0.03)
    assert same_bytes(caches[0], refs[0]) and same_bytes(caches[1], refs[1])


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("q_lens, seq_lens", [([2048, 512, 1, 1, 1], [2048, 2048, 3000, 1, 4096]),
                                              ([1] * 64, None)], ids=["mixed", "decode-64"])
def test_gpu_attention_over_fp8_cache_at_llama_sizes(q_lens, seq_lens):
    """bf16 queries over e4m3 caches against the float32 reference over the same dequantized values (poisoned
    outputs), and against attention over the bf16 values the cache was rounded from."""
    from asyncengine.kernels import attention

    seq_lens = seq_lens or torch.randint(1, 4000, (64,)).tolist()
    q, k_cache, v_cache, qsl, lens, tables = make_fp8_batch(q_lens, seq_lens, heads=32, kv_heads=8, head_dim=128,
                                                            dtype=torch.bfloat16)
    scales = dict(k_scale=0.003, v_scale=0.01)
    out = attention.paged_attention(q, k_cache, v_cache, qsl, lens, tables, 128**-0.5, max_query_len=max(q_lens),
                                    max_seq_len=4096, **scales)
    ref = reference.paged_attention(q.float(), k_cache, v_cache, qsl.cpu(), lens.cpu(), tables, 128**-0.5,
                                    **scales)
    assert not out.isnan().any()
    assert rel_error(out, ref) < 1e-2


@pytest.mark.gpu
@needs_cuda
def test_gpu_engine_with_fp8_cache_and_cuda_graphs_tracks_transformers(llama_dir):
    """The Triton path end to end (prefill, decode replayed from CUDA graphs) in float32 with the FP8 cache: the
    same criteria as on CPU."""
    llm = LLM(str(llama_dir), dtype="float32", kv_cache_dtype="fp8", max_model_len=128, device="cuda")
    assert llm.engine.runner.graphs is not None and llm.engine.runner.kv_caches[0][0].dtype == FP8
    assert_tracks_transformers(llama_dir, llm, greedy_with_logprobs(llm))
    assert_no_leaks(llm.engine)

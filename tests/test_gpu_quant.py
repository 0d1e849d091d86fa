"""GPU: the quantized kernels at Llama-3-8B sizes (hidden 4096, intermediate 14336, fused qkv 6144, gate/up
28672), in bf16, against their torch references, outputs NaN-poisoned. Skipped without CUDA."""

from __future__ import annotations

import gc
import pytest
import torch

from test_kernels import fresh_seed, nan_poisoned_empty, rel_error  # noqa: F401
from test_quant_kernels import check_int4, e4m3_codes_one_hot_case

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
SHAPES = [(4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096)]  # (K, N): qkv, o, gate_up, down
LM_HEAD = (4096, 128256)
FP8_REL_ERROR = 1e-2  # bf16 output rounding over sums of 4096 products


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("m", [1, 8, 16, 17, 40, 64, 65, 1024])  # the GEMV (16- and 64-row tiles), then dequantize + cuBLAS
@pytest.mark.parametrize("k, n", SHAPES)
def test_gpu_int4_at_llama_8b_sizes(m, k, n):
    check_int4(m, k, n, 128, torch.bfloat16)


# int4 GEMV tiles beyond the table's: wide N tiles of the M = 1 FMA path (several columns a thread, K cut below a
# group), in float32 and with bf16x2 word sums (half_fma), each also loading a step ahead (load_ahead), and the
# one-dot-per-nibble-slot tl.dot path (block_k 128)
INT4_TILES = [(512, 32, 4, 4, False, False, False, False), (1024, 32, 2, 8, False, False, False, False),
              (512, 32, 4, 4, False, False, True, False), (128, 128, 17, 4, False, False, True, False),
              (512, 64, 44, 4, False, False, False, True), (1024, 64, 10, 8, False, False, True, True),
              (64, 128, 4, 4, True, True, False, False), (128, 128, 1, 4, True, True, False, False)]
# (block_n, block_k, split_k, num_warps, dot, slot_dot, half_fma, load_ahead)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("m", [1, 16])
@pytest.mark.parametrize("tiles", INT4_TILES)
@pytest.mark.parametrize("k, n", SHAPES)
def test_gpu_int4_gemv_tiles_at_llama_8b_sizes(m, tiles, k, n):
    """Each candidate path and tile of the sweep against the reference in bf16, outputs poisoned (the inline PTX
    of the FMA paths and the slot dots run only on a GPU). half_fma's bf16 word sums stay within bf16's error.
    load_ahead applies at M == 1 only: above it, a ValueError."""
    from asyncengine.kernels import quant_gemv, quant_reference
    from test_quant_kernels import int4_case

    block_n, block_k, split_k, warps, dot, slot_dot, half_fma, load_ahead = tiles
    config = quant_gemv.GemvConfig(block_n, block_k, split_k, warps, 3, dot, slot_dot, half_fma,
                                   load_ahead=load_ahead)
    x, qweight, scales, zeros = int4_case(m, k, n, 128, torch.bfloat16)
    if load_ahead and m > 1:
        with pytest.raises(ValueError, match="load_ahead applies at M == 1"):
            quant_gemv.int4_gemv(x, qweight, scales, zeros, 128, config=config)
        return
    out = quant_gemv.int4_gemv(x, qweight, scales, zeros, 128, config=config)
    ref = quant_reference.int_weight_matmul(x, qweight, scales, zeros, 128, 4)
    assert out.dtype == ref.dtype and not out.isnan().any()
    assert rel_error(out, ref) < 1e-2, rel_error(out, ref)


# GemvConfig.mma tiles: (block_n, block_k, split_k, num_warps), a warp per 32 or 64 columns
INT4_MMA_TILES = [(128, 128, 8, 4), (64, 64, 11, 2), (256, 128, 4, 8), (32, 32, 1, 1), (128, 32, 33, 4),
                  (256, 128, 8, 4), (128, 64, 1, 2)]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("m", [1, 8])
@pytest.mark.parametrize("tiles", INT4_MMA_TILES)
@pytest.mark.parametrize("k, n", SHAPES)
def test_gpu_int4_mma_gemv_at_llama_8b_sizes(tiles, k, n, m):
    """The int4 tensor-core path (mma.sync on each thread's own words, inline PTX: only on a GPU) at the 8B shapes,
    one row and eight (B's columns), against the float32 reference, to bf16's rounding of y; outputs poisoned. The
    same sums as the interpreter's stand-in, so a fragment taken from the wrong lane or nibble shows as a large
    error here."""
    from asyncengine.kernels import quant_gemv
    from test_quant_kernels import assert_mma_sums_are_float32, int4_case

    block_n, block_k, split_k, warps = tiles
    x, qweight, scales, zeros = int4_case(m, k, n, 128, torch.bfloat16)
    out = quant_gemv.int4_gemv(x, qweight, scales, zeros, 128, config=quant_gemv.GemvConfig(
        block_n, block_k, split_k, warps, mma=True))
    assert_mma_sums_are_float32(out, x, qweight, scales, zeros, 128)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("m", [1, 16, 256])
@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("per_channel", [False, True])
@pytest.mark.parametrize("k, n", SHAPES[:2])
def test_gpu_fp8_linear_at_llama_8b_sizes(m, static, per_channel, k, n):
    from asyncengine.kernels import quant_fp8, quant_reference

    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 needs compute capability 8.9+")
    w8, w_scale = quant_reference.quantize_fp8(torch.randn(n, k, device="cuda"), dim=-1 if per_channel else None)
    w_scale = w_scale.reshape(-1, 1).expand(n, 1).contiguous()
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    input_scale = (x.float().abs().amax() / 448).reshape(()) if static else None
    out = quant_fp8.fp8_linear(x, w8, w_scale, input_scale)
    ref = quant_reference.fp8_linear(x, w8, w_scale, input_scale)
    assert out.dtype == ref.dtype and not out.isnan().any()
    assert rel_error(out, ref) < FP8_REL_ERROR, rel_error(out, ref)


@pytest.mark.gpu
@needs_cuda
def test_gpu_fp8_per_token_quantization_matches_reference_within_one_step():
    """The scales equal the reference's; the e4m3 values too, but for the rare value on a rounding boundary that
    the kernel's float32 division puts one e4m3 step away (1 in 3.7M on an H100 with Triton's division; 3,764
    with tl.div_rn, so torch's own division is not the IEEE one either): at most 1e-5 of them, one step each."""
    from asyncengine.kernels import quant_fp8, quant_reference

    x = torch.randn(256, 14336, device="cuda", dtype=torch.bfloat16) * 3
    q, scale = quant_fp8.quantize_per_token(x)
    ref_q, ref_scale = quant_reference.quantize_fp8(x, dim=-1)
    torch.testing.assert_close(scale, ref_scale, atol=0, rtol=1e-6)
    ours, ref = q.float(), ref_q.float()
    differ = ours != ref
    assert differ.float().mean().item() <= 1e-5
    one_step = ref.abs().clamp(min=2.0**-6) / 8  # e4m3: 3 mantissa bits, so a step is at most 1/8 of the value
    assert ((ours - ref).abs() <= one_step)[differ].all()


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("m", [1, 4, 16, 40, 64])
@pytest.mark.parametrize("k, n", SHAPES + [LM_HEAD])
@pytest.mark.parametrize("fp8", [False, True])
def test_gpu_decode_gemv_at_llama_8b_sizes(m, k, n, fp8):
    """bf16 weights, or FP8 weights with per-channel scales (weight-only), against the reference; the LM head's
    shape too (the head takes our GEMV where it measures faster)."""
    from asyncengine.kernels import quant_gemv, quant_reference

    if fp8 and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 needs compute capability 8.9+")
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    scale = None
    if fp8:
        w, scale = quant_reference.quantize_fp8(w, dim=-1)
    out = quant_gemv.dense_gemv(x, w, None, scale)
    ref = quant_reference.dense_gemv(x, w, None, scale)
    assert out.dtype == ref.dtype and not out.isnan().any()
    assert rel_error(out, ref) < 1e-2, rel_error(out, ref)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("m", [1, 4, 16, 40, 64, 65, 1024])  # the GEMV (word path, 16- and 64-row tiles), then
# dequantize + the library's GEMM
@pytest.mark.parametrize("k, n", SHAPES)
def test_gpu_fp8_block_wise_weights_at_llama_8b_sizes(m, k, n):
    """FP8 weights with 128 x 128 block scales (Qwen3-*-FP8, DeepSeek), weight-only, in bf16, against the float32
    reference, through what a layer runs: the decode GEMV up to 64 rows, dequantize + cuBLAS above."""
    from asyncengine.kernels import quant_fp8, quant_gemv, quant_reference
    from test_quant_kernels import fp8_block_case

    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 needs compute capability 8.9+")
    w8, scales = fp8_block_case(n, k, (128, 128), device="cuda")
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    if m <= quant_gemv.MAX_M:
        out = quant_gemv.dense_gemv(x, w8, None, scales, group_size=128)
    else:
        out = quant_fp8.fp8_group_linear(x, w8, scales, 128)
    ref = quant_reference.dense_gemv(x, w8, None, scales, group_size=128)
    assert out.dtype == ref.dtype and not out.isnan().any()
    assert rel_error(out, ref) < FP8_REL_ERROR, rel_error(out, ref)


@pytest.mark.gpu
@needs_cuda
def test_gpu_engine_fp8_block_wise_checkpoint_greedy_matches_transformers_on_dequantized_weights(llama_dir,
                                                                                                  tmp_path):
    """The whole engine on CUDA in float32 on a block-wise FP8 checkpoint (16 x 32 blocks of the tiny model):
    prefill through dequantize + the library's GEMM, decode through the GEMV with group scales where start-up
    chose it."""
    import quant_checkpoints as qc
    from test_quantization import assert_same_greedy

    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 needs compute capability 8.9+")
    assert_same_greedy(*qc.fp8_block_checkpoint(llama_dir, tmp_path, block=(16, 32)), device="cuda")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("fmt", ["awq", "gptq-act-order"])
def test_gpu_engine_int4_greedy_matches_transformers_on_dequantized_weights(llama_dir, tmp_path, fmt):
    """The whole engine on CUDA in float32 through the int4 kernels (GEMM for the prefill, GEMV for decode)."""
    import quant_checkpoints as qc
    from test_quantization import assert_same_greedy

    if fmt == "awq":
        pytest.importorskip("awq", reason="AutoAWQ (the test extra) packs the AWQ checkpoint")

    pair = qc.awq_checkpoint(llama_dir, tmp_path) if fmt == "awq" else qc.gptq_checkpoint(llama_dir, tmp_path,
                                                                                          desc_act=True)
    assert_same_greedy(*pair, device="cuda")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("arch", ["Qwen3MoeForCausalLM", "MixtralForCausalLM"])
@pytest.mark.parametrize("act_order", [False, True], ids=["", "act-order"])
def test_gpu_engine_int4_experts_greedy_matches_transformers_on_dequantized_weights(checkpoint_dir, tmp_path, arch,
                                                                                    act_order):
    """The whole engine on CUDA in float32 on a GPTQ mixture of experts (groups of 16, asymmetric): the fused MoE
    kernels on int4 experts (decode kernels and grouped GEMMs), the int4 kernels on the dense layers; act-order:
    each assignment's x gathered in its expert's order (FusedMoE._forward_input_orders)."""
    import quant_checkpoints as qc
    from test_quantization import assert_same_greedy

    assert_same_greedy(*qc.gptq_checkpoint(checkpoint_dir(arch), tmp_path, sym=False, group_size=16,
                                           desc_act=act_order), device="cuda")


@pytest.mark.gpu
@needs_cuda
def test_gpu_engine_online_fp8_generates_and_chose_its_decode_kernels(llama_dir):
    from asyncengine import LLM, SamplingParams
    from asyncengine.models.layers import LinearBase

    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 needs compute capability 8.9+")
    llm = LLM(str(llama_dir), dtype="bfloat16", quantization="fp8", max_model_len=128)
    out = llm.generate(["Hello world"], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 16
    layers = [m for m in llm.engine.runner.model.modules() if isinstance(m, LinearBase) and m.weight.dtype ==
              torch.float8_e4m3fn]
    from asyncengine.kernels.quant_gemv import MAX_M

    assert layers and all(0 <= m.gemv_max_m <= MAX_M for m in layers)
    from asyncengine.kernels.fp8_gemm import MAX_M as GEMM_MAX_M

    assert all(m.gemv_max_m <= m.gemm_max_m <= GEMM_MAX_M for m in layers)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("m", [1, 64, 300, 4096])
def test_gpu_norm_and_silu_fp8_copies_are_the_per_token_quantization_at_llama_8b_sizes(m):
    """The fused copies (hidden 4096 after the norm, 14336 after silu_and_mul) are bit for bit what
    quantize_per_token makes of the outputs returned beside them. silu_and_mul's outputs equal those of the kernel
    without the copy; a few of the norm's differ from them by a rounding or two (the kernel with the copy is
    compiled apart, and the row's sum of squares may be ordered otherwise: runs 105-107)."""
    from asyncengine.kernels import activation, norm, quant_fp8

    def exact_copy(copy):
        q, scale = quant_fp8.quantize_per_token(copy.value)
        assert torch.equal(copy.scale, scale) and torch.equal(copy.fp8.view(torch.uint8), q.view(torch.uint8))

    x, residual = (torch.randn(m, 4096, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    weight = torch.randn(4096, device="cuda", dtype=torch.bfloat16)
    plain, plain_residual = norm.fused_add_rms_norm(x, residual.clone(), weight, 1e-5)
    copy, new_residual = norm.fused_add_rms_norm(x, residual, weight, 1e-5, fp8_copy=True)
    assert torch.equal(new_residual, plain_residual)
    exact_copy(copy)
    differ = copy.value != plain
    # The normalised value may round to the next bf16 (2^-8 relative), and its product with the weight round again.
    two_roundings = plain.float().abs() * 2.0**-6 + 1e-6
    gap = (copy.value.float() - plain.float()).abs()
    print(f"M={m}: the norm's output differs in {int(differ.sum())} of {differ.numel()} elements, by at most "
          f"{(gap / plain.float().abs().clamp(min=1e-6)).max().item():.2e} relative")
    assert differ.float().mean().item() <= 1e-4  # runs 106-107: 25 of 1.2M at M = 300, 16 of 16.8M at 4,096
    assert (gap <= two_roundings).all()
    gate_up = torch.randn(m, 2 * 14336, device="cuda", dtype=torch.bfloat16) * 3
    silu_copy = activation.silu_and_mul(gate_up, fp8_copy=True)
    exact_copy(silu_copy)
    assert torch.equal(silu_copy.value, activation.silu_and_mul(gate_up))


@pytest.mark.gpu
@needs_cuda
def test_gpu_engine_fp8_with_fused_input_copies_gives_the_same_logprobs_and_launches_fewer_quantizations(
        llama_dir, monkeypatch):
    """Online FP8, eager: prompts long enough that their prefill takes the W8A8 products. With the norms' and
    silu's fused copies the greedy tokens and their logprobs are exactly those of the per-product quantization, and
    only the o projection still quantizes (1 of 4 products a layer, the first layer's qkv aside)."""
    from asyncengine import LLM, SamplingParams
    from asyncengine.kernels import quant_fp8
    from asyncengine.models.layers import LinearBase

    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 needs compute capability 8.9+")
    llm = LLM(str(llama_dir), dtype="bfloat16", quantization="fp8", max_model_len=512, enforce_eager=True,
              enable_prefix_caching=False)
    prompts = [list(range(3 + i, 3 + i + 150 + 7 * i)) for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2)
    calls = []
    original = quant_fp8.quantize_per_token
    monkeypatch.setattr(quant_fp8, "quantize_per_token", lambda x: calls.append(x.shape) or original(x))

    def run():
        calls.clear()
        outs = llm.generate(prompts, params, use_tqdm=False)
        return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs], len(calls)

    fused, fused_calls = run()
    monkeypatch.setattr(LinearBase, "takes_fp8_input", lambda self, m: False)
    separate, separate_calls = run()
    assert fused == separate
    assert 0 < fused_calls < separate_calls / 2, (fused_calls, separate_calls)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("m", [16, 17, 40, 64, 100, 128, 256, 300, 512])  # every token tile, rows masked off
@pytest.mark.parametrize("per_token", [False, True])
@pytest.mark.parametrize("k, n", SHAPES)
def test_gpu_fp8_gemm_at_llama_8b_sizes_eager_and_in_graph_replays(m, per_token, k, n):
    """Our W8A8 GEMM with the config the table (fp8_gemm_configs) or the default picks, against the reference in
    bf16, outputs poisoned; then captured in a CUDA graph and replayed on new inputs, so the split-K arrival
    counters must have been left at zero by each run."""
    from asyncengine.kernels import fp8_gemm, quant_reference

    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 needs compute capability 8.9+")
    w8, w_scale = quant_reference.quantize_fp8(torch.randn(n, k, device="cuda") * 0.02, dim=-1)
    x = torch.randn(m, k, device="cuda")

    def run(x):
        x8, x_scale = quant_reference.quantize_fp8(x, dim=-1 if per_token else None)
        return fp8_gemm.fp8_gemm(x8, x_scale, w8, w_scale, torch.bfloat16), (x8, x_scale)

    out, (x8, x_scale) = run(x)
    ref = quant_reference.fp8_scaled_mm(x8, x_scale, w8, w_scale, torch.bfloat16)
    assert not out.isnan().any() and rel_error(out, ref) < FP8_REL_ERROR, rel_error(out, ref)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        run(x)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured, (x8, x_scale) = run(x)
    for _ in range(2):
        x.copy_(torch.randn_like(x))
        graph.replay()
        torch.cuda.synchronize()
        ref = quant_reference.fp8_scaled_mm(x8, x_scale, w8, w_scale, torch.bfloat16)
        assert rel_error(captured, ref) < FP8_REL_ERROR, ("graph replay", rel_error(captured, ref))


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("m", [20, 128])
@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("bias", [False, True])
def test_gpu_fp8_gemm_linear_matches_the_fp8_linear_reference(m, static, bias):
    """The engine's entry (quantization + our GEMM) against quant_reference.fp8_linear, per-token or static input
    scales, with a bias."""
    from asyncengine.kernels import quant_fp8, quant_reference

    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 needs compute capability 8.9+")
    k, n = 4096, 6144
    w8, w_scale = quant_reference.quantize_fp8(torch.randn(n, k, device="cuda") * 0.02, dim=-1)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    input_scale = (x.float().abs().amax() / 448).reshape(()) if static else None
    b = torch.randn(n, device="cuda", dtype=torch.bfloat16) if bias else None
    out = quant_fp8.fp8_gemm_linear(x, w8, w_scale, input_scale, b)
    ref = quant_reference.fp8_linear(x, w8, w_scale, input_scale, b)
    assert out.dtype == torch.bfloat16 and rel_error(out, ref) < FP8_REL_ERROR, rel_error(out, ref)


def _gemv_case(fmt: str, m: int, k: int, n: int):
    """(run(x) -> y with the shape's chosen config, reference(x) -> y in float32 sums) for one format."""
    from asyncengine.kernels import quant_gemv, quant_reference

    if fmt == "int4":
        qweight, scales, zeros = quant_reference.quantize_int_weight(torch.randn(k, n, device="cuda"), 128)
        scales, zeros = scales.bfloat16(), zeros.bfloat16()
        return (lambda x: quant_gemv.int4_gemv(x, qweight, scales, zeros, 128),
                lambda x: quant_reference.int_weight_matmul(x, qweight, scales, zeros, 128))
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    scale = None
    if fmt == "fp8":
        w, scale = quant_reference.quantize_fp8(w, dim=-1)
    return lambda x: quant_gemv.dense_gemv(x, w, None, scale), lambda x: quant_reference.dense_gemv(x, w, None, scale)


needs_fp8 = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                               reason="FP8 needs a CUDA GPU of compute capability 8.9+")


@pytest.mark.gpu
@needs_fp8
@pytest.mark.parametrize("lane", range(8))
def test_gpu_fp8_words_converts_every_e4m3_code_exactly(lane):
    """The word path's inline PTX conversion (two cvt.rn.f16x2.e4m3x2 per word) for every non-NaN code in each byte
    lane: y[n] equals code n's value exactly (float32 x one-hot, float32 y)."""
    from asyncengine.kernels import quant_gemv

    x, w8, expected = e4m3_codes_one_hot_case(lane)
    assert quant_gemv.e4m3_ptx_ok(x.cuda())
    out = quant_gemv.dense_gemv(x.cuda(), w8.cuda(), None, torch.ones(1, device="cuda"),
                                config=quant_gemv.GemvConfig(16, 16, 1, fp8_words=True))
    torch.testing.assert_close(out[0].cpu(), expected, atol=0, rtol=0)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("k, n", SHAPES)
@pytest.mark.parametrize("tiles", [(8, 512, 1, 4), (16, 512, 1, 8), (64, 256, 1, 8), (32, 512, 5, 4),
                                   (128, 128, 9, 8)])
@pytest.mark.parametrize("fmt, fp8_words, load_ahead", [("fp8", True, False), ("fp8", True, True), ("fp8", False, True),
                                                      ("bf16", False, True)])
def test_gpu_gemv_m1_alternatives_at_llama_8b_sizes(k, n, tiles, fmt, fp8_words, load_ahead):
    """The M = 1 alternatives (GemvConfig.fp8_words, .load_ahead) against the reference: float32 x to 1e-5 (exact
    weights, float32 sums), bf16 x to FP8_REL_ERROR; direct stores and split-K."""
    from asyncengine.kernels import quant_gemv, quant_reference

    if fmt == "fp8" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 needs compute capability 8.9+")
    w, scale = torch.randn(n, k, device="cuda").bfloat16(), None
    if fmt == "fp8":
        w, scale = quant_reference.quantize_fp8(w.float(), dim=-1)
    config = quant_gemv.GemvConfig(*tiles[:3], num_warps=tiles[3], fp8_words=fp8_words, load_ahead=load_ahead)
    for dtype, tolerance in ((torch.float32, 1e-5), (torch.bfloat16, FP8_REL_ERROR)):
        x = torch.randn(1, k, device="cuda", dtype=dtype)
        out = quant_gemv.dense_gemv(x, w, None, scale, config=config)
        ref = quant_reference.dense_gemv(x, w, None, scale)
        assert out.dtype == ref.dtype and not out.isnan().any()
        assert rel_error(out, ref) < tolerance, (dtype, rel_error(out, ref))


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("fmt", ["bf16", "fp8", "int4"])
@pytest.mark.parametrize("m", [1, 16, 64])
def test_gpu_gemv_chosen_configs_match_reference_in_cuda_graph_replays(fmt, m):
    """At every 8B shape (and the bf16 LM head), the config the table (quant_gemv_configs.TUNED) or the default
    picks: eager against the reference, then captured in a CUDA graph and replayed twice on new inputs, so the
    split-K arrival counters must have been left at zero by each run."""
    if fmt == "fp8" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 needs compute capability 8.9+")
    for k, n in SHAPES + ([LM_HEAD] if fmt == "bf16" else []):
        run, reference = _gemv_case(fmt, m, k, n)
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        out = run(x)
        assert not out.isnan().any() and rel_error(out, reference(x)) < 1e-2, (k, n, rel_error(out, reference(x)))
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            run(x)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = run(x)
        for _ in range(2):
            x.copy_(torch.randn_like(x))
            graph.replay()
            torch.cuda.synchronize()
            assert rel_error(captured, reference(x)) < 1e-2, (k, n, "graph replay", rel_error(captured, reference(x)))


@pytest.mark.gpu
@needs_cuda
def test_gpu_start_up_choice_times_device_work_in_graphs_and_picks_the_faster_product():
    """gemv_max_m times in CUDA graphs: a wrapper's host time (a 200 us sleep) is not charged, while a product that
    does 4x the device work loses at every decode size."""
    import time

    from asyncengine.kernels import quant_linear

    w = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)

    def slow_host(x, ws):
        time.sleep(200e-6)
        return torch.nn.functional.linear(x, ws[0])

    def four_times(x, ws):
        for _ in range(3):
            torch.nn.functional.linear(x, ws[0])
        return torch.nn.functional.linear(x, ws[0])

    copies = quant_linear._copies((w,))
    assert len(copies) > 8 and all(c[0].data_ptr() != w.data_ptr() for c in copies[1:])
    x = torch.ones(1, 4096, device="cuda", dtype=w.dtype)
    direct = quant_linear.graph_time_us(lambda ws: torch.nn.functional.linear(x, ws[0]), copies)
    assert quant_linear.graph_time_us(lambda ws: slow_host(x, ws), copies) < 1.5 * direct + 2
    assert quant_linear.gemv_max_m(("test-slow-host",), slow_host, four_times, (w,), 4096, w.dtype, "cuda") == \
        quant_linear.MAX_M
    assert quant_linear.gemv_max_m(("test-four-times",), four_times, slow_host, (w,), 4096, w.dtype, "cuda") == 0


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("arch, shape", [
    ("LlamaForCausalLM", dict(num_hidden_layers=16, hidden_size=2048, intermediate_size=8192, num_attention_heads=16,
                              num_key_value_heads=16)),
    ("Qwen3MoeForCausalLM", dict(num_hidden_layers=4, hidden_size=1024, num_experts=64, moe_intermediate_size=768,
                                 num_attention_heads=8, num_key_value_heads=8, head_dim=128)),
], ids=["dense", "moe"])
def test_gpu_online_fp8_never_holds_the_bf16_model_on_the_gpu(tmp_path, arch, shape):
    """--quantization fp8 of a bf16 checkpoint: each layer waits in host memory and is quantized onto the GPU once
    its tensors are in (models/loader.py LayerwiseProcessing), so the GPU's peak while loading stays near the FP8
    model, well under the bf16 checkpoint (before: the bf16 model whole on the GPU, then quantized). Above what the
    loaded model holds, the peak adds one layer's copies and start-up's timing copies of one shape (up to
    kernels.quant_linear.L2_DEFEAT_BYTES, 256 MB)."""
    from checkpoints import build_checkpoint
    from safetensors import safe_open

    from asyncengine.config import EngineConfig, load_model_config
    from asyncengine.models.loader import load_model

    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 needs compute capability 8.9+")
    folder = build_checkpoint(tmp_path / arch, arch, dtype=torch.bfloat16, **shape)
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        checkpoint_bytes = sum(torch.Size(f.get_slice(n).get_shape()).numel() * 2 for n in f.keys())  # bf16
    config = EngineConfig(model=str(folder), dtype="bfloat16", device="cuda", quantization="fp8")
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    model = load_model(load_model_config(config, torch.device("cuda")), torch.device("cuda"), max_positions=64)
    gc.collect()  # start-up's timing graphs and weight copies, in reference cycles until collected
    torch.cuda.synchronize()
    peak, held = torch.cuda.max_memory_allocated() - before, torch.cuda.memory_allocated() - before
    print(f"online FP8 load of a {checkpoint_bytes / 2**30:.2f} GiB bf16 checkpoint: peak {peak / 2**30:.2f} GiB, "
          f"held {held / 2**30:.2f} GiB")
    # What stays: the FP8 weights, bf16 embeddings and norms, and the kernels' workspaces (run 161, one H100: the
    # dense model held 1.55 GiB of a 2.00 GiB checkpoint, 0.5 GiB of it beyond the FP8 weights). Above it while
    # loading: one layer's copies and start-up's timing copies of one shape (run 161: 0.40 and 0.04 GiB). Loading the
    # bf16 model whole first would put at least its bf16 minus its FP8 bytes above it: half the checkpoint (an
    # estimate from the sizes; the old loader was not run on the GPU).
    assert held < checkpoint_bytes, (held, checkpoint_bytes)
    assert peak - held < 0.35 * checkpoint_bytes, (peak, held, checkpoint_bytes)
    fp8 = [n for n, p in model.named_parameters() if p.dtype == torch.float8_e4m3fn]
    assert fp8 and all(p.is_cuda for p in model.parameters())

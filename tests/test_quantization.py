"""Quantized checkpoints (AWQ, GPTQ, FP8 per-tensor / per-channel / block-wise, compressed-tensors FP8, online FP8) on
CPU, through the torch references.

- Greedy tokens of each quantized tiny checkpoint equal transformers' on the same weights dequantized to float32
  (packers and dequantization in tests/quant_checkpoints.py: AutoAWQ and compressed-tensors where they install,
  the published specification for GPTQ, which gptqmodel cannot be installed here to pack, and for quant_method fp8,
  block-wise included: its packer agrees bit for bit with compressed-tensors' FP8_BLOCK, partial blocks included).
- The default model quantized to FP8 (online, and block-wise in a checkpoint) and to int4 (GPTQ layout, group 128)
  keeps its perplexity on held-out text within 1.05x / 1.5x of the unquantized model; a packer with a broken nibble
  order lands far outside.
- Unsupported combinations fail at start-up with a ValueError that says what is supported.
"""

from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import quant_checkpoints as qc
from asyncengine import LLM, SamplingParams
from asyncengine.config import EngineConfig, default_model_path, load_model_config
from asyncengine.models.layers import AttentionMetadata
from asyncengine.models.loader import load_model
from test_model_correctness import NEW_TOKENS, transformers_greedy

PROMPTS = ["Hello world", "The quick brown fox jumps over the lazy dog. 0123456789", [0, 5, 17, 42, 99, 7]]
HELD_OUT = Path(__file__).parent / "data" / "heldout.txt"

FORMATS = {
    "gptq4-sym": lambda src, out: qc.gptq_checkpoint(src, out, bits=4, sym=True),
    "gptq4-asym-act-order": lambda src, out: qc.gptq_checkpoint(src, out, bits=4, sym=False, desc_act=True),
    "gptq4-sym-act-order-per-channel": lambda src, out: qc.gptq_checkpoint(src, out, group_size=-1, desc_act=True),
    "gptq8-asym": lambda src, out: qc.gptq_checkpoint(src, out, bits=8, sym=False),
    "awq-autoawq": lambda src, out: qc.awq_checkpoint(src, out),
    "fp8-static-per-tensor": lambda src, out: qc.fp8_checkpoint(src, out, static=True),
    "fp8-dynamic-per-tensor": lambda src, out: qc.fp8_checkpoint(src, out, static=False),
    "compressed-tensors-fp8-dynamic-per-channel": lambda src, out: qc.compressed_tensors_fp8_checkpoint(
        src, out, scheme="FP8_DYNAMIC", strategy="channel"),
    "compressed-tensors-fp8-static-per-tensor": lambda src, out: qc.compressed_tensors_fp8_checkpoint(
        src, out, scheme="FP8", strategy="tensor"),
    # block-wise (weight_scale_inv [ceil(N / bn), ceil(K / bk)]); bn = 16 keeps each fused q/k/v and gate/up shard a
    # whole number of output blocks; bk = 48 leaves a partial last block along K = 64 and K = 128
    "fp8-block-16x32": lambda src, out: qc.fp8_block_checkpoint(src, out, block=(16, 32)),
    "fp8-block-16x48": lambda src, out: qc.fp8_block_checkpoint(src, out, block=(16, 48)),
    "compressed-tensors-fp8-block-16x32": lambda src, out: qc.compressed_tensors_fp8_checkpoint(
        src, out, scheme="FP8_BLOCK", block_structure=(16, 32)),
    "compressed-tensors-w4a16-group32-sym": lambda src, out: qc.compressed_tensors_int_checkpoint(src, out),
    "compressed-tensors-w4a16-asym-per-channel": lambda src, out: qc.compressed_tensors_int_checkpoint(
        src, out, symmetric=False, group_size=None),
}


def assert_same_greedy(quantized: Path, dequantized: Path, **engine_kwargs) -> None:
    llm = LLM(str(quantized), dtype="float32", max_model_len=128, **engine_kwargs)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    mine = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    expected = transformers_greedy(dequantized, PROMPTS, llm.get_tokenizer())
    for prompt, got, ref in zip(PROMPTS, mine, expected):
        assert got == ref, f"prompt {prompt!r} diverged"


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_greedy_matches_transformers_on_dequantized_weights(llama_dir, tmp_path, fmt):
    quantized, dequantized = FORMATS[fmt](llama_dir, tmp_path)
    assert_same_greedy(quantized, dequantized)


def test_online_fp8_matches_transformers_on_per_channel_dequantized_weights(llama_dir, tmp_path):
    """--quantization fp8 on a float checkpoint: weights rounded to e4m3 with one scale per output channel."""
    reference = tmp_path / "online-fp8-dequant"
    shutil.copytree(llama_dir, reference)
    tensors = load_file(str(llama_dir / "model.safetensors"))
    for name, w in tensors.items():
        if qc._is_linear(name):
            scale = w.float().abs().amax(dim=1, keepdim=True) / 448.0
            tensors[name] = (w.float() / scale).to(qc.FP8).float() * scale
    save_file(tensors, str(reference / "model.safetensors"))
    assert_same_greedy(llama_dir, reference, quantization="fp8")


@pytest.mark.parametrize("block", [(16, 32), (16, 48), (24, 32)], ids=lambda b: f"{b[0]}x{b[1]}")
def test_fp8_block_packer_agrees_with_compressed_tensors(llama_dir, tmp_path, block):
    """The block-wise quant_method fp8 packer (written here from the specification) and compressed-tensors'
    FP8_BLOCK compressor give the same e4m3 weights and block scales (weight_scale_inv / weight_scale), and the
    same dequantized weights (ours / its decompressor), partial last blocks along K (48) and N (24) included: the
    greedy comparisons above then rest on a layout two implementations agree on."""
    ours, ours_deq = qc.fp8_block_checkpoint(llama_dir, tmp_path / "ours", block=block)
    theirs, theirs_deq = qc.compressed_tensors_fp8_checkpoint(llama_dir, tmp_path / "ct", scheme="FP8_BLOCK",
                                                              block_structure=block)
    mine, ct = load_file(str(ours / "model.safetensors")), load_file(str(theirs / "model.safetensors"))
    assert set(ct) == {k.replace(".weight_scale_inv", ".weight_scale") for k in mine}
    bn, bk = block
    for key, tensor in mine.items():
        other = ct[key.replace(".weight_scale_inv", ".weight_scale")]
        if key.endswith(".weight_scale_inv"):
            n, k = mine[key.removesuffix("_scale_inv")].shape
            assert tensor.shape == (-(-n // bn), -(-k // bk)) and tensor.dtype == torch.float32, key
        if tensor.dtype == qc.FP8:
            assert other.dtype == qc.FP8, key
            tensor, other = tensor.view(torch.uint8), other.view(torch.uint8)
        assert torch.equal(tensor, other), key
    mine, ct = load_file(str(ours_deq / "model.safetensors")), load_file(str(theirs_deq / "model.safetensors"))
    assert set(mine) == set(ct)
    for key in mine:
        assert torch.equal(mine[key], ct[key]), key
    config = json.loads((ours / "config.json").read_text())["quantization_config"]
    assert config["weight_block_size"] == [bn, bk] and config["activation_scheme"] == "dynamic"
    config = json.loads((theirs / "config.json").read_text())["quantization_config"]
    assert config["config_groups"]["group_0"]["weights"]["block_structure"] == [bn, bk]


@pytest.mark.parametrize("arch", ["Qwen3ForCausalLM", "Qwen2ForCausalLM"])
def test_fp8_block_checkpoints_of_other_dense_families_match_transformers(checkpoint_dir, tmp_path, arch):
    """Block-wise FP8 as Qwen publishes it (Qwen3-*-FP8: q/k norms; Qwen2: biases on q/k/v, kept unquantized)."""
    assert_same_greedy(*qc.fp8_block_checkpoint(checkpoint_dir(arch), tmp_path, block=(16, 32)))


def test_fp8_block_size_that_splits_a_fused_shard_is_rejected(llama_dir, tmp_path):
    """Output blocks of 24 rows: q_proj's 64 outputs end in a partial block, so the q/k/v shards, fused into one
    weight, would share a block of scales across two shards: refused at load, not loaded with scales misplaced."""
    quantized, _ = qc.fp8_block_checkpoint(llama_dir, tmp_path, block=(24, 32))
    with pytest.raises(ValueError, match="does not fall on whole"):
        LLM(str(quantized))


# -- perplexity of the default model ---------------------------------------------------------------------------

def perplexity(folder: Path, **engine_kwargs) -> float:
    """exp(mean NLL) of the held-out text under the engine's model (one prefill, float32, CPU)."""
    from transformers import AutoTokenizer

    config = EngineConfig(model=str(folder), dtype="float32", device="cpu", **engine_kwargs)
    model_config = load_model_config(config, torch.device("cpu"))
    ids = AutoTokenizer.from_pretrained(default_model_path())(HELD_OUT.read_text()).input_ids
    model = load_model(model_config, torch.device("cpu"), max_positions=len(ids) + 16)
    tokens = torch.tensor(ids)
    n, block = len(ids), 16
    blocks = -(-n // block)
    shape = (blocks, block, model_config.num_kv_heads, model_config.head_dim)
    caches = [(torch.zeros(shape), torch.zeros(shape)) for _ in range(model_config.num_layers)]
    start_loc, lens = torch.tensor([0, n], dtype=torch.int32), torch.tensor([n], dtype=torch.int32)
    metadata = AttentionMetadata(start_loc, lens, torch.arange(blocks, dtype=torch.int32)[None], torch.arange(n),
                                 start_loc, lens, n, n)
    with torch.no_grad():
        logits = model.compute_logits(model(tokens, torch.arange(n), caches, metadata))
    nll = torch.nn.functional.cross_entropy(logits[:-1], tokens[1:])
    return math.exp(nll.item())


@pytest.fixture(scope="module")
def default_ppl() -> float:
    return perplexity(Path(default_model_path()))


@pytest.fixture(scope="module")
def default_copy(tmp_path_factory) -> Path:
    """The default model in float32 (the packers quantize from it)."""
    folder = tmp_path_factory.mktemp("default") / "float32"
    shutil.copytree(default_model_path(), folder)
    tensors = {k: v.float() for k, v in load_file(str(folder / "model.safetensors")).items()}
    save_file(tensors, str(folder / "model.safetensors"))
    return folder


@pytest.mark.slow
def test_default_model_fp8_perplexity_within_5_percent(default_ppl):
    ppl = perplexity(Path(default_model_path()), quantization="fp8")
    assert ppl <= 1.05 * default_ppl, (ppl, default_ppl)


@pytest.mark.slow
def test_default_model_int4_group128_perplexity_within_1_5x(default_ppl, default_copy, tmp_path):
    quantized, _ = qc.gptq_checkpoint(default_copy, tmp_path, bits=4, group_size=128, sym=False)
    ppl = perplexity(quantized)
    assert ppl <= 1.5 * default_ppl, (ppl, default_ppl)


@pytest.mark.slow
def test_broken_int4_packing_order_blows_perplexity_up(default_ppl, default_copy, tmp_path):
    """The same packer with two nibbles of each word swapped: the perplexity check above must catch it."""
    quantized, _ = qc.gptq_checkpoint(default_copy, tmp_path, bits=4, group_size=128, sym=False, swap_nibbles=True)
    ppl = perplexity(quantized)
    assert ppl > 3 * default_ppl, (ppl, default_ppl)


@pytest.mark.slow
def test_default_model_fp8_block_64x64_perplexity_within_5_percent(default_ppl, default_copy, tmp_path):
    """Block-wise FP8 (quant_method fp8, weight_scale_inv) on the default model: 64 x 64 divides each of its
    shapes (q 256, k / v 128, gate / up 704 x 256, down 256 x 704; 128 would split gate / up, 704 = 5.5 x 128)."""
    config = json.loads((default_copy / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    dims = (config["hidden_size"], config["intermediate_size"], head_dim * config["num_attention_heads"],
            head_dim * config["num_key_value_heads"])
    assert all(d % 64 == 0 for d in dims), dims
    quantized, _ = qc.fp8_block_checkpoint(default_copy, tmp_path, block=(64, 64))
    ppl = perplexity(quantized)
    assert ppl <= 1.05 * default_ppl, (ppl, default_ppl)


# -- start-up errors --------------------------------------------------------------------------------------------

def _with_quant_config(src: Path, dst: Path, quantization_config: dict) -> Path:
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = quantization_config
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def test_unknown_quantization_name_is_rejected_with_the_supported_ones():
    with pytest.raises(ValueError, match="quantization must be one of awq, gptq, fp8, compressed-tensors, int8, "
                                         "awq_marlin, gptq_marlin; got 'int3'"):
        EngineConfig(quantization="int3")


@pytest.mark.parametrize("alias, producer", [("awq_marlin", qc.awq_checkpoint), ("gptq_marlin", qc.gptq_checkpoint)])
def test_vllm_marlin_names_load_their_format_on_our_kernels(llama_dir, tmp_path, alias, producer, caplog):
    """--quantization awq_marlin / gptq_marlin (vLLM's names for AWQ / GPTQ checkpoints on its Marlin kernels, as
    vLLM users pass them): the checkpoint loads as its own format and gives transformers' greedy tokens on the
    dequantized weights; the log says which kernels run it. Against the other format's checkpoint, the mismatch
    error names the alias the user gave."""
    import logging

    quantized, dequantized = producer(llama_dir, tmp_path)
    with caplog.at_level(logging.INFO, logger="asyncengine.quantization"):
        assert_same_greedy(quantized, dequantized, quantization=alias)
    assert any(alias in r.getMessage() and "asyncengine's own int4 kernels" in r.getMessage() for r in caplog.records)
    other = "gptq_marlin" if alias == "awq_marlin" else "awq_marlin"
    with pytest.raises(ValueError, match=f"quantization '{other}' does not match the checkpoint's"):
        LLM(str(quantized), quantization=other)


def test_marlin_name_on_an_unquantized_checkpoint_needs_a_quantized_one(llama_dir):
    with pytest.raises(ValueError, match="quantization 'awq_marlin' needs a checkpoint quantized in that format"):
        LLM(str(llama_dir), quantization="awq_marlin")


def test_awq_on_an_unquantized_checkpoint_says_fp8_quantizes_at_load(llama_dir):
    with pytest.raises(ValueError, match="needs a checkpoint quantized in that format.*'fp8'"):
        LLM(str(llama_dir), quantization="awq")


def test_requested_method_must_match_the_checkpoint(llama_dir, tmp_path):
    quantized, _ = qc.gptq_checkpoint(llama_dir, tmp_path)
    with pytest.raises(ValueError, match="'awq' does not match.*'gptq'"):
        LLM(str(quantized), quantization="awq")


@pytest.mark.parametrize("quantization_config, message", [
    ({"quant_method": "bitsandbytes"}, "quant_method 'bitsandbytes' is not supported .*awq, gptq, fp8"),
    ({"quant_method": "gptq", "bits": 3, "group_size": 128}, "3 bits is not supported .*4, 8"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}, "version 'gemv' .*gemm"),
    ({"quant_method": "fp8", "activation_scheme": "static", "weight_block_size": [16, 32]},
     "block-wise weight scales needs dynamic activation"),
    ({"quant_method": "fp8", "weight_block_size": [16]}, "weight_block_size"),
    ({"quant_method": "fp8", "weight_block_size": [16, 32], "modules_to_not_convert": ["lm_head", "model.layers.0.mlp"]},
     "unquantized decoder layers .*model.layers.0.mlp"),
    ({"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized", "config_groups": {}},
     "format 'nvfp4-pack-quantized' is not supported .*FP8 W8A8.*W4A16"),
    ({"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head", "model.layers.0.mlp"],
      "config_groups": {}}, "ignore list .*model.layers.0.mlp"),
])
def test_unsupported_checkpoint_formats_fail_at_start_up(llama_dir, tmp_path, quantization_config, message):
    folder = _with_quant_config(llama_dir, tmp_path / "ckpt", quantization_config)
    with pytest.raises(ValueError, match=message):
        LLM(str(folder))


def test_checkpoints_may_leave_the_moe_routers_unquantized():
    """llm-compressor's MoE checkpoints ignore the routers (`re:.*mlp.gate$`), Qwen's FP8 ones list every
    mlp.gate in modules_to_not_convert: the engine never quantizes them, so both parse; a decoder layer does not."""
    from asyncengine.quantization import quantization_config_for

    block = {"type": "float", "num_bits": 8, "strategy": "block", "block_structure": [128, 128], "symmetric": True}
    ct = {"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head", "re:.*mlp.gate$"],
          "config_groups": {"group_0": {"targets": ["Linear"], "weights": block}}}
    assert quantization_config_for(ct, None).block == (128, 128)
    fp8 = {"quant_method": "fp8", "weight_block_size": [128, 128],
           "modules_to_not_convert": ["lm_head", "model.layers.0.mlp.gate", "model.layers.1.mlp.gate"]}
    assert quantization_config_for(fp8, None).block == (128, 128)
    with pytest.raises(ValueError, match="ignore list .*mlp.gate_proj"):
        quantization_config_for({**ct, "ignore": ["re:.*mlp.gate_proj$"]}, None)
    awq = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"}
    for routers in (["gate"], ["block_sparse_moe.gate"], ["mlp.gate", "shared_expert_gate", "lm_head"]):
        assert quantization_config_for({**awq, "modules_to_not_convert": routers}, None).group_size == 128
    with pytest.raises(ValueError, match=r"modules_to_not_convert \['q_proj'\]"):
        quantization_config_for({**awq, "modules_to_not_convert": ["gate", "q_proj"]}, None)


@pytest.mark.parametrize("group_size, ranks", [(32, 2), (128, 4), (48, 2)])
def test_gptq_act_order_slices_regrouped_per_rank_sum_to_the_layer(group_size, ranks):
    """An act-order GPTQ layer (inputs in random group order) split along its inputs: each rank's slice, with every
    group's scales and zero points, is regrouped (`_regroup_act_order_slice`: sorted by group, each group's run padded
    with zero-weight rows to a multiple of 32, or 16 for groups of 48); the ranks' products x_r @ W_r, each through
    the engine's int4 reference on its gathered x, sum to the whole layer's dequantized product (float32)."""
    from asyncengine.kernels.quant_reference import dequantize_packed, int_weight_matmul, pack_int32
    from asyncengine.quantization.gptq import GPTQLinearMethod

    gen = torch.Generator().manual_seed(group_size + ranks)
    k, n = 8 * group_size, 64
    groups = k // group_size
    g_idx = torch.empty(k, dtype=torch.long)
    g_idx[torch.randperm(k, generator=gen)] = torch.arange(k) // group_size
    q = torch.randint(0, 16, (k, n), generator=gen)
    scales = torch.rand(groups, n, generator=gen) + 0.5
    zeros = torch.randint(1, 16, (groups, n), generator=gen)  # stored minus one below (gptq format): 1 ... 15
    whole = (q - zeros[g_idx]).float() * scales[g_idx]  # [K, N]
    x = torch.randn(3, k, generator=gen)
    method = GPTQLinearMethod(4, group_size, zeros_minus_one=True, desc_act=True)
    slice_k = k // ranks
    total = torch.zeros(3, n)
    for rank in range(ranks):
        rows = slice(rank * slice_k, (rank + 1) * slice_k)
        tensors = {"qweight": pack_int32(q[rows], 4, dim=0), "scales": scales,
                   "qzeros": pack_int32(zeros - 1, 4, dim=1), "g_idx": g_idx[rows].int()}
        qweight, s, z, perm = method.convert(tensors, slice_k)
        new_k = qweight.shape[0] * 8
        sub = new_k // s.shape[0]
        assert sub == (16 if group_size == 48 else 32) and new_k >= slice_k and perm.shape == (new_k,)
        zero_rows = int((dequantize_packed(qweight, s.float(), z.float(), sub) == 0).all(1).sum())
        assert zero_rows >= new_k - slice_k, "padding rows must weigh exactly zero"
        total += int_weight_matmul(x[:, rows].index_select(1, perm), qweight, s, z.float(), sub, 4)
    torch.testing.assert_close(total, x @ whole, rtol=1e-4, atol=1e-3)  # float32 sums of 1,024 terms in another order


def test_fused_gptq_shards_with_different_act_orders_are_rejected(llama_dir, tmp_path):
    """q, k and v read the same input, so GPTQ gives them one g_idx; a checkpoint where they differ cannot be
    fused and must not load silently."""
    quantized, _ = qc.gptq_checkpoint(llama_dir, tmp_path, desc_act=True)
    tensors = load_file(str(quantized / "model.safetensors"))
    name = "model.layers.0.self_attn.k_proj.g_idx"
    tensors[name] = tensors[name].flip(0).contiguous()
    save_file(tensors, str(quantized / "model.safetensors"))
    with pytest.raises(ValueError, match="shards of a QKVParallelLinear disagree"):
        LLM(str(quantized))


def test_cli_quantization_flag_reaches_the_engine_config_with_vllm_spelling():
    from asyncengine.api.cli import build_parser, engine_config, with_default_command
    from asyncengine.quantization import QUANTIZATION_METHODS

    parser = build_parser()
    for method in QUANTIZATION_METHODS:
        args = parser.parse_args(with_default_command(["serve", "--quantization", method]))
        assert engine_config(args).quantization == method
    assert engine_config(parser.parse_args(with_default_command(["serve"]))).quantization is None
    with pytest.raises(SystemExit):  # argparse: invalid choice, with the list of choices
        parser.parse_args(with_default_command(["serve", "--quantization", "bitsandbytes"]))


MOE_INT4_FORMATS = {
    "gptq4-sym": lambda src, out: qc.gptq_checkpoint(src, out, bits=4, sym=True),
    "gptq4-asym-group16": lambda src, out: qc.gptq_checkpoint(src, out, bits=4, sym=False, group_size=16),
    # act-order: every layer's inputs (each expert's gate / up and down) in a random group order of its own
    "gptq4-asym-act-order": lambda src, out: qc.gptq_checkpoint(src, out, bits=4, sym=False, desc_act=True),
    "awq-autoawq": lambda src, out: qc.awq_checkpoint(src, out),
    # as casperhansen/mixtral-instruct-awq: the routers listed as modules AutoAWQ did not convert
    "awq-autoawq-routers-not-converted": lambda src, out: qc.awq_checkpoint(src, out, modules_to_not_convert=["gate"]),
    # compressed-tensors' W4A16 applied to the checkpoint's linears as stored (its experts included)
    "compressed-tensors-w4a16-group32-sym": lambda src, out: qc.compressed_tensors_int_checkpoint(src, out),
    "compressed-tensors-w4a16-group16-asym": lambda src, out: qc.compressed_tensors_int_checkpoint(
        src, out, symmetric=False, group_size=16),
}


@pytest.mark.parametrize("fmt", list(MOE_INT4_FORMATS))
@pytest.mark.parametrize("arch", ["Qwen3MoeForCausalLM", "MixtralForCausalLM", "Qwen2MoeForCausalLM"])
def test_int4_checkpoints_of_moe_families_match_transformers(checkpoint_dir, tmp_path, arch, fmt):
    """GPTQ, AWQ and compressed-tensors W4A16 mixtures of experts (every expert's gate / up / down packed as a linear layer is, as the hub's
    Qwen3-30B-A3B-GPTQ-Int4 and Mixtral AWQ checkpoints store them; routers unquantized; Qwen2-MoE's shared expert
    and dense layer quantized too): greedy tokens against transformers on the dequantized weights, with prefix
    caching off and on. The experts' tensors go through each format's own conversion (the dense layers'), then
    the fused MoE reference on CPU. GPTQ act-order: down's order moves gate / up's rows, x is gathered per
    assignment in its expert's order (FusedMoE._forward_input_orders)."""
    if fmt.startswith("awq"):
        pytest.importorskip("awq", reason="AutoAWQ (the test extra) packs the AWQ checkpoint")
    quantized, dequantized = MOE_INT4_FORMATS[fmt](checkpoint_dir(arch), tmp_path)
    names = load_file(str(quantized / "model.safetensors"))
    assert any(re.search(r"\.experts\.3\.(down_proj|w2)\.(qweight|weight_packed)$", n) for n in names)
    assert not any(re.search(r"\.(mlp|block_sparse_moe)\.gate\.(q|weight_)", n) for n in names)
    assert_same_greedy(quantized, dequantized)
    assert_same_greedy(quantized, dequantized, enable_prefix_caching=True)


def test_act_order_experts_whose_gate_and_up_orders_differ_are_refused(checkpoint_dir, tmp_path):
    """The fused kernels read one x row for an expert's gate and up projections, so act-order needs both in one
    input order (GPTQ gives them one: they read one input). A checkpoint whose expert 0 up projection (Mixtral's
    w3) has another g_idx than its gate (w1) is refused at load, naming the expert."""
    quantized, _ = qc.gptq_checkpoint(checkpoint_dir("MixtralForCausalLM"), tmp_path, desc_act=True)
    tensors = load_file(str(quantized / "model.safetensors"))
    name = next(n for n in tensors if re.search(r"\.experts\.0\.w3\.g_idx$", n))
    tensors[name] = tensors[name].flip(0).contiguous()
    save_file(tensors, str(quantized / "model.safetensors"))
    with pytest.raises(ValueError, match="expert 0's gate and up projections order their inputs differently"):
        LLM(str(quantized))


@pytest.mark.parametrize("make, match", [
    (lambda src, out: qc.gptq_checkpoint(src, out, bits=8), "int8 mixture-of-experts weights"),
    (lambda src, out: qc.gptq_checkpoint(src, out, group_size=8), "group size 8"),
], ids=["gptq8", "group-8"])
def test_int4_moe_checkpoints_the_experts_cannot_take_are_refused_at_start_up(checkpoint_dir, tmp_path, make, match):
    """8-bit GPTQ and groups the fused kernels cannot tile fail at start-up, saying what is supported (act-order
    experts split over tensor-parallel ranks: tests/test_tensor_parallel.py)."""
    quantized, _ = make(checkpoint_dir("Qwen3MoeForCausalLM"), tmp_path)
    with pytest.raises(ValueError, match=match):
        LLM(str(quantized))


@pytest.mark.parametrize("arch", ["Qwen3MoeForCausalLM", "MixtralForCausalLM"])
def test_online_fp8_of_a_moe_family_matches_transformers_on_dequantized_weights(checkpoint_dir, tmp_path, arch):
    """--quantization fp8 on a float mixture of experts: dense linears per output channel, each expert's rows per
    group of 128 inputs (models/moe.py ONLINE_FP8_GROUP), the routers unquantized; transformers runs the same
    roundings, dequantized."""
    from asyncengine.kernels.quant_reference import dequantize_fp8_groups, quantize_fp8_groups
    from asyncengine.models.moe import ONLINE_FP8_GROUP

    src = checkpoint_dir(arch)
    reference = tmp_path / "online-fp8-dequant"
    shutil.copytree(src, reference)
    tensors = load_file(str(src / "model.safetensors"))
    for name, w in tensors.items():
        if not qc._is_linear(name):
            continue
        if ".experts." in name:
            w8, scales = quantize_fp8_groups(w.float(), ONLINE_FP8_GROUP)
            tensors[name] = dequantize_fp8_groups(w8, scales, ONLINE_FP8_GROUP)
        else:
            scale = w.float().abs().amax(dim=1, keepdim=True) / 448.0
            tensors[name] = (w.float() / scale).to(qc.FP8).float() * scale
    save_file(tensors, str(reference / "model.safetensors"))
    assert_same_greedy(src, reference, quantization="fp8")


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Qwen3MoeForCausalLM"])
def test_online_fp8_quantizes_each_layer_before_the_next_layer_is_read(checkpoint_dir, monkeypatch, arch):
    """--quantization fp8 processes (quantizes) every linear and every expert block as soon as its layer's tensors
    are in, before the next layer's first tensor is read: the unquantized weights never wait for the whole model
    (models/loader.py LayerwiseProcessing), which is what lets a bf16 model larger than the GPU load as FP8. The
    checkpoint's tensors come layer after layer (safetensors orders names; the tiny models have < 10 layers)."""
    from asyncengine.models import loader

    events: list[tuple[str, object]] = []  # ("read", checkpoint name) or ("processed", module), in order
    read, process = loader.iterate_weights, loader.process_module

    def reading(folder):
        for name, tensor in read(folder):
            events.append(("read", name))
            yield name, tensor

    def processing(module):
        if not getattr(module, "weights_processed", False) and hasattr(module, "weight_loader"):
            events.append(("processed", module))
        process(module)

    monkeypatch.setattr(loader, "iterate_weights", reading)
    monkeypatch.setattr(loader, "process_module", processing)
    config = EngineConfig(model=str(checkpoint_dir(arch)), dtype="float32", device="cpu", quantization="fp8")
    model = load_model(load_model_config(config, torch.device("cpu")), torch.device("cpu"), max_positions=64)
    module_names = {id(m): n for n, m in model.named_modules()}
    events = [(kind, x if kind == "read" else module_names[id(x)]) for kind, x in events]
    layer_of = lambda name: re.search(r"layers\.(\d+)\.", name)  # noqa: E731
    processed = [(i, name) for i, (kind, name) in enumerate(events) if kind == "processed" and layer_of(name)]
    layers = {int(layer_of(name)[1]) for _, name in processed}
    assert len(layers) == model.config.num_hidden_layers >= 2
    if arch.startswith("Qwen3Moe"):
        assert any(name.endswith(".mlp.experts") for _, name in processed)
    for index, name in processed:
        layer = int(layer_of(name)[1])
        next_layer_first = next((i for i, (kind, n) in enumerate(events) if kind == "read" and layer_of(n)
                                 and int(layer_of(n)[1]) == layer + 1), len(events))
        assert index < next_layer_first, f"{name} waited for layer {layer + 1}'s tensors"
    assert not [n for n, p in model.named_parameters() if hasattr(p, "target_device")]  # every staged weight replaced


@pytest.mark.parametrize("arch", ["Qwen3MoeForCausalLM", "MixtralForCausalLM", "Qwen2MoeForCausalLM"])
def test_fp8_block_checkpoints_of_moe_families_match_transformers(checkpoint_dir, tmp_path, arch):
    """Block-wise FP8 mixtures of experts (Qwen3-30B-A3B-FP8's layout: every expert's gate / up / down with its
    weight_scale_inv, routers unquantized; Qwen2-MoE's shared expert and dense layer quantized too), greedy tokens
    against transformers on the dequantized weights, with prefix caching off and on."""
    quantized, dequantized = qc.fp8_block_checkpoint(checkpoint_dir(arch), tmp_path, block=(16, 32))
    names = load_file(str(quantized / "model.safetensors"))
    assert any(re.search(r"\.experts\.3\.(down_proj|w2)\.weight_scale_inv$", n) for n in names)
    assert not any(".mlp.gate.weight_scale" in n for n in names)
    assert_same_greedy(quantized, dequantized)
    assert_same_greedy(quantized, dequantized, enable_prefix_caching=True)


def test_fp8_block_experts_whose_intermediate_size_splits_a_block_are_refused(checkpoint_dir, tmp_path):
    """Qwen3-MoE's experts of 32 intermediate rows in blocks of 24: gate and up would share a block of scales."""
    quantized, _ = qc.fp8_block_checkpoint(checkpoint_dir("Qwen3MoeForCausalLM"), tmp_path, block=(24, 32))
    with pytest.raises(ValueError, match="do not fall on whole rows"):
        LLM(str(quantized))


def test_lm_head_logits_through_the_decode_gemv_equal_the_library_product():
    """vocab_parallel_logits takes the decode GEMV (on CPU its reference) for S <= gemv_max_m and F.linear above;
    both give the same logits (float32, 1e-5 relative), and CPU start-up never picks the GEMV for the head."""
    from asyncengine.models.layers import head_gemv_max_m, vocab_parallel_logits

    gen = torch.Generator().manual_seed(17)
    weight = torch.randn(300, 64, generator=gen)
    hidden = torch.randn(3, 64, generator=gen)
    expected = torch.nn.functional.linear(hidden, weight)
    for threshold in (0, 2, 3, 16):
        logits = vocab_parallel_logits(hidden, weight, 300, gemv_max_m=threshold)
        torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)
    assert head_gemv_max_m(weight) == 0

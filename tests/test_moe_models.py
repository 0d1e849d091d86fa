"""Mixture-of-experts families beyond greedy equality (that is test_model_correctness.py, for every family): the
routing against transformers' own routers (ties included), both checkpoint layouts of the experts, a missing
expert named at load, the experts' tensor-parallel slices summing to the whole, and
lookahead scheduling and the engine process giving the plain engine's outputs on a MoE model."""

from __future__ import annotations

import asyncio
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from asyncengine import LLM, EngineConfig, SamplingParams
from asyncengine.async_engine import AsyncLLMEngine
from conftest import assert_no_leaks, assert_same_completions

MOE_ARCHS = ["MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"]
PROMPTS = ["Hello world", "The quick brown fox jumps over the lazy dog.", [0, 5, 17, 42, 99, 7]]
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


def transformers_router(arch: str, folder, layer: int = 0):
    """The sparse block's router of `layer` in transformers' model of the checkpoint, and its top-k / renorm."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    return model.model.layers[layer].mlp.gate, model.config


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_routing_matches_transformers_including_ties(checkpoint_dir, arch):
    """ops.route (the router product and the routing, as the sparse block calls it) against transformers' gate."""
    from asyncengine import ops

    router, cfg = transformers_router(arch, checkpoint_dir(arch))
    renormalize = arch == "MixtralForCausalLM" or bool(cfg.norm_topk_prob)
    hidden = torch.randn(12, cfg.hidden_size)
    hidden[6:] = 0.0  # zero states: every logit equal, a tie across all experts
    with torch.no_grad():
        _, their_weights, their_ids = router(hidden)
    weights, ids = ops.route(hidden, router.weight, cfg.num_experts_per_tok, renormalize)
    assert torch.equal(ids, their_ids)
    torch.testing.assert_close(weights, their_weights.float(), atol=1e-6, rtol=1e-6)


def per_expert_to_stacked(src: dict) -> dict:
    """Rewrite hub-style per-expert tensors (experts.<e>.gate_proj.weight ...) as transformers 5's stacked ones
    (experts.gate_up_proj [E, 2I, H], experts.down_proj [E, H, I])."""
    out, groups = {}, {}
    for name, tensor in src.items():
        if ".experts." in name and name.split(".experts.")[1].split(".")[0].isdigit():
            prefix, rest = name.split(".experts.")
            expert, proj = rest.split(".")[:2]
            groups.setdefault(prefix, {}).setdefault(proj, {})[int(expert)] = tensor
        else:
            out[name] = tensor
    for prefix, projs in groups.items():
        gate = {"gate_proj": "gate_proj", "w1": "w1"}.get(next(p for p in projs if p in ("gate_proj", "w1")))
        up, down = ("up_proj", "down_proj") if gate == "gate_proj" else ("w3", "w2")
        count = len(projs[gate])
        out[f"{prefix}.experts.gate_up_proj"] = torch.stack(
            [torch.cat([projs[gate][e], projs[up][e]]) for e in range(count)])
        out[f"{prefix}.experts.down_proj"] = torch.stack([projs[down][e] for e in range(count)])
    return out


def copy_checkpoint(src, dst, rewrite) -> None:
    dst.mkdir()
    for path in src.iterdir():
        if path.name != "model.safetensors":
            (dst / path.name).write_bytes(path.read_bytes())
    save_file(rewrite(load_file(str(src / "model.safetensors"))), str(dst / "model.safetensors"),
              metadata={"format": "pt"})


def test_checkpoint_layouts_of_the_experts_load_the_same_model(checkpoint_dir, tmp_path):
    """Per-expert tensors (as on the hub, and as transformers saves them) and stacked ones (as transformers 5
    holds them in memory) load to the same tokens."""
    folder = checkpoint_dir("Qwen3MoeForCausalLM")
    assert any(".experts.0.gate_proj." in n for n in load_file(str(folder / "model.safetensors")))
    copy_checkpoint(folder, tmp_path / "other", per_expert_to_stacked)
    assert any(n.endswith("experts.gate_up_proj") for n in load_file(str(tmp_path / "other/model.safetensors")))
    base = LLM(str(folder), max_model_len=64).generate(PROMPTS, GREEDY, use_tqdm=False)
    other = LLM(str(tmp_path / "other"), max_model_len=64).generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in base] == [o.outputs[0].token_ids for o in other]


def test_a_missing_expert_is_named_at_load(checkpoint_dir, tmp_path):
    folder = checkpoint_dir("MixtralForCausalLM")

    def drop_one_expert(tensors: dict) -> dict:
        victims = [n for n in tensors if ".experts.5." in n and n.startswith("model.layers.1.")]
        assert victims, sorted(tensors)[:20]
        return {n: t for n, t in tensors.items() if n not in victims}

    copy_checkpoint(folder, tmp_path / "broken", drop_one_expert)
    with pytest.raises(ValueError, match=r"lacks weights for: .*layers\.1\.mlp\.experts\.w\d+_weight\[\(5, "):
        LLM(str(tmp_path / "broken"), max_model_len=64)


def test_tensor_parallel_expert_slices_sum_to_the_whole(monkeypatch):
    """Each rank loads its slice of every expert's intermediate dimension; the ranks' partial outputs (what the
    all-reduce sums) add up to the one-rank output."""
    from asyncengine import ops
    from asyncengine.models import moe

    experts, hidden, inter, tokens = 4, 32, 48, 7
    gate, up = torch.randn(experts, inter, hidden), torch.randn(experts, inter, hidden)
    down = torch.randn(experts, hidden, inter)
    x = torch.randn(tokens, hidden)
    weights, ids = ops.topk_softmax(torch.randn(tokens, experts), 2, renormalize=True)

    def build(rank: int, size: int) -> moe.FusedMoE:
        monkeypatch.setattr(moe, "tp_rank", lambda: rank)
        monkeypatch.setattr(moe, "tp_size", lambda: size)
        layer = moe.FusedMoE(experts, hidden, inter, torch.float32)
        for e in range(experts):
            layer.weight_loader(layer.w13_weight, gate[e], (e, "gate"))
            layer.weight_loader(layer.w13_weight, up[e], (e, "up"))
            layer.weight_loader(layer.w2_weight, down[e], (e, "down"))
        return layer

    def partial(layer):
        return ops.fused_moe(x, layer.w13_weight, layer.w2_weight, weights, ids)

    whole = partial(build(0, 1))
    ranks = [build(r, 2) for r in range(2)]
    assert ranks[0].w13_weight.shape == (experts, inter, hidden) and ranks[1].w2_weight.shape == (experts, hidden, 24)
    torch.testing.assert_close(partial(ranks[0]) + partial(ranks[1]), whole, atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="not divisible by tensor_parallel_size 5"):
        build(0, 5)


def test_lookahead_gives_the_plain_pipelines_outputs_on_moe(checkpoint_dir):
    folder = str(checkpoint_dir("Qwen2MoeForCausalLM"))
    params = [GREEDY, SamplingParams(temperature=0.8, seed=5, max_tokens=12, logprobs=2, ignore_eos=True), GREEDY]
    results = []
    for lookahead in (False, True):
        llm = LLM(folder, max_model_len=128, async_scheduling=lookahead)
        results.append(llm.generate(PROMPTS, params, use_tqdm=False))
        assert_no_leaks(llm.engine)
    assert_same_completions(results[0], results[1])


def test_engine_process_gives_the_in_process_outputs_on_moe(checkpoint_dir):
    folder = str(checkpoint_dir("MixtralForCausalLM"))

    async def run(engine_process: bool):
        engine = AsyncLLMEngine(EngineConfig(model=folder, engine_process=engine_process, max_model_len=128))
        try:
            outs = []
            for i, prompt in enumerate(PROMPTS):
                outs.append([o async for o in engine.generate(prompt, GREEDY, request_id=f"r{i}")][-1])
            return outs
        finally:
            await engine.shutdown()

    remote, local = asyncio.run(run(True)), asyncio.run(run(False))
    assert_same_completions(remote, local)

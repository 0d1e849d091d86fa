"""The hardware limits the offline benchmark prints next to W2 and W3 (loadtest/bench_offline.py, bench_matmul.py).

The W2 ceiling is checked against a token-by-token recount of the same work; the W3 floor's list of weights
against the model's own forward pass (every weight it multiplies by, in order, once).
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from asyncengine import EngineConfig, LLMEngine, SamplingParams, ops
from loadtest.bench_matmul import linear_weights_in_order
from loadtest.bench_offline import w2_ceiling, w3_per_layer


def _recount(mc, body: float, lm_head: float, n_req: int, n_in: int, n_out: int, flop_rate: float, byte_rate: float):
    """Walk every token of every request: the token fed at index t attends over t + 1 keys; a token fed after
    the prompt (a decode token) reads those keys' K/V from the cache; each sampled token costs one lm_head row."""
    kv_per_token = 2 * mc.num_layers * mc.num_kv_heads * mc.head_dim * 2  # bf16
    flops = bytes_read = 0.0
    for _ in range(n_req):
        for t in range(n_in + n_out - 1):
            flops += 2 * body + 4 * mc.num_layers * mc.num_heads * mc.head_dim * (t + 1)
            if t >= n_in:
                bytes_read += (t + 1) * kv_per_token
        flops += n_out * 2 * lm_head
    return flops / flop_rate + bytes_read / byte_rate


def test_w2_ceiling_matches_a_token_by_token_recount():
    mc = SimpleNamespace(num_layers=3, num_heads=4, num_kv_heads=2, head_dim=8,
                         kv_bytes_per_token=lambda dtype: 2 * 3 * 2 * 8 * 2)
    ceiling = w2_ceiling(mc, n_linear=5e6, lm_head_params=1e6, n_req=7, n_in=13, n_out=5,
                         matmul_flops=1e12, copy_bytes_per_s=1e9)
    expected = _recount(mc, 4e6, 1e6, 7, 13, 5, 1e12, 1e9)
    assert abs(ceiling["seconds"] - expected) / expected < 1e-12
    assert abs(ceiling["output_tok_per_s"] - 7 * 5 / expected) / (7 * 5 / expected) < 1e-12


def test_floor_weights_are_every_matrix_the_forward_pass_multiplies_by(llama_dir, monkeypatch):
    from asyncengine.quantization import cpu_prepacked

    # Every product through F.linear (spied below): no layer takes oneDNN's packed copy, which start-up picks by
    # timing on this machine (quantization/cpu_prepacked.py) and which the spy could not see.
    monkeypatch.setattr(cpu_prepacked, "onednn_is_faster", lambda n, k, threads: False)
    engine = LLMEngine(EngineConfig(model=str(llama_dir), device="cpu", dtype="float32"))
    seen: list[torch.Tensor] = []
    original = torch.nn.functional.linear

    def spy(x, weight, bias=None):
        seen.append(weight)
        return original(x, weight, bias)

    def head_spy(hidden, weight):  # the LM head's product (on CPU not F.linear: kernels/cpu.head_logits)
        seen.append(weight)
        return original(hidden, weight)

    monkeypatch.setattr(torch.nn.functional, "linear", spy)
    monkeypatch.setattr(ops, "head_logits", head_spy)
    engine.add_request("one", [5, 6, 7], SamplingParams(max_tokens=1))
    while engine.has_unfinished_requests():
        engine.step()
    expected = linear_weights_in_order(engine.runner.model)
    assert len(expected) == 4 * engine.model_config.num_layers + 1
    assert [id(w) for w in seen] == [id(w) for w in expected]


def test_reset_prefix_cache_makes_a_repeated_prompt_compute_in_full(llama_dir):
    """The benchmark repeats prompts (W1's ablations, W4's warm-up) and resets the cache before each timed run;
    without the reset the repeat would be served from the cache."""
    from asyncengine import LLM

    llm = LLM(str(llama_dir), device="cpu", dtype="float32")
    prompt = list(range(3, 3 + 40))  # 2 full blocks of 16 and a tail
    params = SamplingParams(max_tokens=2, temperature=0)

    def hits_of_one_run() -> int:
        before = llm.engine.stats().prefix_cache_hits
        llm.generate([prompt], params, use_tqdm=False)
        return llm.engine.stats().prefix_cache_hits - before

    assert hits_of_one_run() == 0
    assert hits_of_one_run() == 32  # the repeat finds both full blocks
    llm.reset_prefix_cache()
    assert hits_of_one_run() == 0


def test_w3_extrapolation_from_fewer_layers_splits_the_step_per_layer():
    """4 layers measured at 10 ms with a 2 GB LM head at 1,000 GB/s (2 ms): 2 ms per layer, so 98 ms at 48
    layers; the roofline likewise: 1 GB per layer, 50 GB at 48 layers = 50 ms."""
    results = {"copy_bandwidth_GBps": 1000.0, "W3_ms_per_token": 10.0, "W3_bytes_per_step": 2e9 + 4 * 1e9}
    est = w3_per_layer(results, lm_head_params=10**9, layers=4, full_layers=48)
    assert abs(est["per_layer_ms"] - 2.0) < 1e-9 and abs(est["W3_ms_per_token"] - 98.0) < 1e-9
    assert abs(est["W3_roofline_ms"] - 50.0) < 1e-9 and abs(est["of_roofline"] - 50 / 98) < 1e-12


def test_moe_bench_refuses_a_checkpoint_of_another_layer_count(tmp_path):
    import json

    import pytest

    from loadtest.bench_offline import main

    (tmp_path / "config.json").write_text(json.dumps({"num_hidden_layers": 48}))
    with pytest.raises(SystemExit, match="48 layers, not 8"):
        main(["--family", "qwen3-30b-a3b", "--num-layers", "8", "--checkpoint", str(tmp_path), "--moe-part", "build",
              "--tiny", "--out", str(tmp_path / "out")])

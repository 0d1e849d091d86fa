"""Sliding-window models and the KV blocks behind their windows: when every layer is local (Mistral, Phi-3), blocks
wholly before the window of a request's next query are given back while it runs (so they do not count against the
KV budget), and the tokens stay transformers' own; when some layers are global (Gemma 2/3), every block is kept.
Also: lookahead over released blocks, the KV-size bound, Gemma 2's final soft-cap, LongRoPE's long factors, and the
error for an unknown architecture.
"""

from __future__ import annotations

import functools
import json

import pytest
import torch

from asyncengine import LLM, SamplingParams
from asyncengine.block_manager import BlockManager
from asyncengine.request import Request
from checkpoints import SLIDING_WINDOW
from conftest import assert_no_leaks

BLOCK_SIZE = 4
LONG_PROMPT = [0] + [(7 * i) % 300 + 6 for i in range(59)]  # 60 tokens, five windows long
NEW_TOKENS = 40


@functools.cache
def transformers_greedy(folder, prompt: tuple = tuple(LONG_PROMPT)) -> list[int]:
    """transformers' greedy continuation (NEW_TOKENS, float32) of a prompt, once per checkpoint and prompt."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    out = model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                         do_sample=False)
    return out[0, len(prompt):].tolist()


def live_blocks(request) -> int:
    return len(request.block_table) - request.num_released_blocks


def run_one_request(llm: LLM, prompt: list[int]):
    """Generate greedily step by step; returns (tokens, the most blocks the request held at once, the request)."""
    engine = llm.engine
    engine.add_request("r", prompt, SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True))
    most, request, tokens = 0, None, []
    while engine.has_unfinished_requests():
        if engine.scheduler.running:
            request = engine.scheduler.running[0]
        for out in engine.step():
            tokens = out.outputs[0].token_ids
        if request is not None and not request.finished:
            most = max(most, live_blocks(request))
            bm = engine.block_manager
            assert bm.num_free_blocks == bm.num_blocks - live_blocks(request), "a released block is still held"
    return tokens, most, request


@pytest.mark.parametrize("arch, prefix_caching", [("MistralForCausalLM", True), ("MistralForCausalLM", False),
                                                  ("Phi3ForCausalLM", True)])
def test_all_local_layers_give_back_blocks_behind_the_window(checkpoint_dir, arch, prefix_caching):
    folder = checkpoint_dir(arch)
    llm = LLM(str(folder), dtype="float32", max_model_len=128, block_size=BLOCK_SIZE,
              enable_prefix_caching=prefix_caching, max_num_batched_tokens=16)
    assert llm.engine.block_manager.sliding_window == SLIDING_WINDOW
    tokens, most, request = run_one_request(llm, LONG_PROMPT)
    assert tokens == transformers_greedy(folder)
    total_blocks = -(-(len(LONG_PROMPT) + NEW_TOKENS) // BLOCK_SIZE)  # 25 without releasing
    # window (12) + a 16-token chunk, and one more chunk in flight before its blocks are registered
    assert most <= -(-(SLIDING_WINDOW + 2 * 16) // BLOCK_SIZE) + 2 < total_blocks, most
    assert_no_leaks(llm.engine)


def test_lookahead_with_blocks_released_behind_the_window(checkpoint_dir):
    """Lookahead schedules a step while the previous one is in flight: blocks released for the new step are
    outside both steps' windows, so tokens stay transformers' own (three requests sharing 14 blocks, chunked)."""
    from test_lookahead import count_feedback_steps

    folder = checkpoint_dir("MistralForCausalLM")
    llm = LLM(str(folder), dtype="float32", max_model_len=128, block_size=BLOCK_SIZE, max_num_batched_tokens=16,
              num_kv_blocks=14, async_scheduling=True)
    counter = count_feedback_steps(llm)
    prompts = [LONG_PROMPT, LONG_PROMPT[:25], LONG_PROMPT[10:50]]
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, out in zip(prompts, outputs):
        assert out.outputs[0].token_ids == transformers_greedy(folder, tuple(prompt))
    assert counter["feedback"] > 0, "lookahead never fed an in-flight token"
    assert_no_leaks(llm.engine)


def test_released_blocks_stay_in_the_prefix_cache(checkpoint_dir):
    """Blocks behind the window are freed as registered blocks: a second request with the same prompt finds them
    in the prefix cache (until evicted) and gets the same tokens."""
    folder = checkpoint_dir("MistralForCausalLM")
    llm = LLM(str(folder), dtype="float32", max_model_len=128, block_size=BLOCK_SIZE, max_num_batched_tokens=16)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    first = llm.generate([LONG_PROMPT], params, use_tqdm=False)[0]
    again = llm.generate([LONG_PROMPT], params, use_tqdm=False)[0]
    assert again.num_cached_tokens >= len(LONG_PROMPT) - BLOCK_SIZE
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    assert_no_leaks(llm.engine)


@pytest.mark.parametrize("arch", ["Gemma2ForCausalLM", "Gemma3ForCausalLM"])
def test_global_layers_keep_every_block(checkpoint_dir, arch):
    folder = checkpoint_dir(arch)
    llm = LLM(str(folder), dtype="float32", max_model_len=128, block_size=BLOCK_SIZE, max_num_batched_tokens=16)
    assert llm.engine.block_manager.sliding_window is None  # layer 1 is global
    tokens, most, request = run_one_request(llm, LONG_PROMPT)
    assert tokens == transformers_greedy(folder)
    assert most == -(-(len(LONG_PROMPT) + NEW_TOKENS - 1) // BLOCK_SIZE)  # every token's block, to the last
    assert_no_leaks(llm.engine)


def test_block_manager_releases_only_registered_blocks_with_prefix_caching():
    bm = BlockManager(num_blocks=16, block_size=4, enable_prefix_caching=True, sliding_window=6)
    request = Request("r", list(range(40)), SamplingParams(max_tokens=1), max_tokens=1)
    assert bm.allocate(request, 20)
    request.num_computed_tokens = 20  # next query at 20 sees 15..20: blocks 0-2 (tokens 0-11) are dead
    assert bm.allocate(request, 24)
    assert request.num_released_blocks == 0, "unregistered blocks must not be released"
    bm.register_full_blocks(request, 20)
    assert bm.allocate(request, 24)
    assert request.num_released_blocks == 3 and bm.num_free_blocks == 16 - 3
    assert all(bm.blocks[b].block_hash is not None for b in request.block_table[:3])  # still cached
    bm.free_request(request)
    assert bm.num_free_blocks == 16 and all(b.ref_count == 0 for b in bm.blocks)


def test_longrope_uses_the_long_factors_past_the_original_length(checkpoint_dir):
    """Positions from original_max_position_embeddings on get transformers' long-factor rotary (cos, sin); earlier
    ones its short-factor rotary, with the same attention factor."""
    from transformers import AutoConfig
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    from asyncengine.models.layers import RotaryEmbedding
    from asyncengine.models.llama import rope_config

    cfg = AutoConfig.from_pretrained(str(checkpoint_dir("Phi3ForCausalLM")))
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    original = 128
    ours = RotaryEmbedding(head_dim, 256, rope_config(cfg)).cos_sin_cache  # [256, head_dim]
    theirs = Phi3RotaryEmbedding(cfg)
    x = torch.zeros(1, 1, head_dim)
    for positions in (torch.arange(0, original), torch.arange(original, 256)):
        cos, sin = theirs(x, positions[None, :])  # [1, n, head_dim], halves repeated
        expected = torch.cat((cos[0, :, : head_dim // 2], sin[0, :, : head_dim // 2]), dim=-1)
        torch.testing.assert_close(ours[positions], expected, atol=1e-5, rtol=1e-5)


def test_unknown_architecture_lists_the_supported_ones_and_the_plugin_route(tmp_path, llama_dir):
    for f in llama_dir.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    config = json.loads((tmp_path / "config.json").read_text())
    config["architectures"] = ["FalconForCausalLM"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"FalconForCausalLM.*not supported.*Gemma2ForCausalLM.*Phi3ForCausalLM.*"
                                         r"asyncengine\.plugins.*register_model"):
        LLM(str(tmp_path))


def test_all_local_kv_cache_must_hold_the_window_and_two_steps(checkpoint_dir):
    """Windowed: a cache far smaller than max_model_len is enough, but not one smaller than the window and two
    steps (12 + 2 * 16 + 2 * 4 = 52 tokens here); the cache sized from memory counts that much per sequence."""
    folder = str(checkpoint_dir("MistralForCausalLM"))
    options = dict(dtype="float32", max_model_len=128, block_size=BLOCK_SIZE, max_num_batched_tokens=16)
    LLM(folder, num_kv_blocks=13, **options)
    sized = LLM(folder, max_num_seqs=4, **options)  # sized by itself: per sequence slot 52 tokens, not 128
    assert sized.engine.runner.num_blocks == 4 * (52 // BLOCK_SIZE + 1)
    with pytest.raises(ValueError, match=r"12 blocks x 4 tokens = 48 tokens, fewer than the 52 tokens one sequence"):
        LLM(folder, num_kv_blocks=12, **options)


def test_gemma2_final_logit_softcap_shapes_the_logprobs_as_in_transformers(checkpoint_dir):
    """The final soft-cap leaves the argmax alone but not the distribution: top-5 logprobs of the first sampled
    position equal transformers' log-softmax of its capped logits (cap 8 here)."""
    from transformers import AutoModelForCausalLM

    from conftest import LOGPROB_ATOL

    folder = checkpoint_dir("Gemma2ForCausalLM")
    llm = LLM(str(folder), dtype="float32", max_model_len=128)
    out = llm.generate([LONG_PROMPT], SamplingParams(temperature=0, max_tokens=1, logprobs=5), use_tqdm=False)[0]
    ours = {token: lp.logprob for token, lp in out.outputs[0].logprobs[0].items()}
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    logits = model(torch.tensor([LONG_PROMPT])).logits[0, -1]
    theirs = torch.log_softmax(logits, -1)
    uncapped = torch.log_softmax(torch.atanh(logits / 8.0) * 8.0, -1)
    assert (uncapped - theirs).abs().max() > 10 * LOGPROB_ATOL, "the cap must matter for this checkpoint"
    top = theirs.topk(5)
    assert set(ours) == set(top.indices.tolist())
    assert all(abs(ours[t] - theirs[t].item()) <= LOGPROB_ATOL for t in ours), (ours, top)

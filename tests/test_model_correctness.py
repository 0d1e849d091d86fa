"""Greedy generation is token-for-token identical to transformers on the same weights (float32, CPU), for every
supported architecture, and stays identical with prefix caching off, chunked prefill forced and preemption
forced. The windowed families (Mistral, Phi-3: every layer; Gemma 2/3: alternate layers) have a 12-token window,
shorter than most prompts and than every prompt with its output."""

from __future__ import annotations

import pytest
import torch

from asyncengine import LLM, SamplingParams
from conftest import ARCHITECTURES, assert_no_leaks

NEW_TOKENS = 32
# Different lengths; the last two share a long prefix (prefix-cache hits across the batch).
SHARED = "Paged attention stores keys and values in fixed-size blocks. Continuous batching keeps the accelerator busy"
PROMPTS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog. 0123456789",
    SHARED + " while requests come",
    SHARED + " and go.",
    [0, 5, 17, 42, 99, 7],  # a token-id prompt
]

VARIANTS = {
    "default": dict(),
    "no_prefix_cache": dict(enable_prefix_caching=False),
    "chunked_prefill": dict(max_num_batched_tokens=8, block_size=4),  # every prompt split over several steps
    "preemption": dict(num_kv_blocks=32, block_size=4, max_num_seqs=8),  # 128 slots for 5 x ~60 tokens
}

# Every layer windowed: blocks behind the window are given back, so 32 blocks would never preempt; fewer do.
ALL_LOCAL = {"MistralForCausalLM", "Phi3ForCausalLM"}
ALL_LOCAL_PREEMPTION = dict(num_kv_blocks=14, block_size=4, max_num_seqs=8, max_num_batched_tokens=16)

_reference_cache: dict = {}


def transformers_greedy(folder, prompts, tokenizer) -> list[list[int]]:
    """transformers' own generate, one prompt at a time (no padding), float32."""
    from transformers import AutoModelForCausalLM

    key = str(folder)
    if key not in _reference_cache:
        model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
        outs = []
        for p in prompts:
            ids = torch.tensor([p]) if isinstance(p, list) else tokenizer(p, return_tensors="pt").input_ids
            gen = model.generate(ids, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
            outs.append(gen[0, ids.shape[1]:].tolist())
        _reference_cache[key] = outs
    return _reference_cache[key]


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_greedy_matches_transformers(checkpoint_dir, arch, variant):
    folder = checkpoint_dir(arch)
    options = ALL_LOCAL_PREEMPTION if variant == "preemption" and arch in ALL_LOCAL else VARIANTS[variant]
    llm = LLM(str(folder), dtype="float32", max_model_len=128, **options)
    # min_tokens: EOS masked until NEW_TOKENS, as transformers' min_new_tokens does (not merely ignored)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS)
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    expected = transformers_greedy(folder, PROMPTS, llm.get_tokenizer())
    for prompt, out, ref in zip(PROMPTS, outputs, expected):
        assert out.outputs[0].token_ids == ref, f"{arch}/{variant}: prompt {prompt!r} diverged"
        assert out.outputs[0].finish_reason == "length"
    engine = llm.engine
    if variant == "preemption":
        assert engine.scheduler.num_preemptions > 0, "the variant must actually preempt"
    if variant == "default":  # the same prompts again: now served from the prefix cache, same tokens
        again = llm.generate(PROMPTS[2:4], params, use_tqdm=False)
        assert all(o.num_cached_tokens >= 16 for o in again), [o.num_cached_tokens for o in again]
        assert [o.outputs[0].token_ids for o in again] == expected[2:4]
    assert_no_leaks(engine)


def test_outputs_in_input_order_with_prompt_fields(llama_dir):
    llm = LLM(str(llama_dir), max_model_len=128)
    prompts = ["a b c", "Hello world", "x"]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
    tok = llm.get_tokenizer()
    for p, o in zip(prompts, outs):
        assert o.prompt == p
        assert o.prompt_token_ids == tok(p).input_ids
        assert o.finished and len(o.outputs) == 1


def test_sharded_checkpoint_and_dtype(tmp_path, llama_dir):
    """A checkpoint saved in shards with model.safetensors.index.json loads to the same tokens; bf16 runs too."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(llama_dir), dtype=torch.float32)
    model.save_pretrained(str(tmp_path), max_shard_size="20KB")
    AutoTokenizer.from_pretrained(str(llama_dir)).save_pretrained(str(tmp_path))
    assert (tmp_path / "model.safetensors.index.json").exists()
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    sharded = LLM(str(tmp_path), max_model_len=64).generate(["Hello world"], params, use_tqdm=False)
    single = LLM(str(llama_dir), max_model_len=64).generate(["Hello world"], params, use_tqdm=False)
    assert sharded[0].outputs[0].token_ids == single[0].outputs[0].token_ids
    bf16 = LLM(str(llama_dir), max_model_len=64, dtype="bfloat16")
    assert bf16.engine.model_config.dtype == torch.bfloat16
    assert len(bf16.generate(["Hello"], params, use_tqdm=False)[0].outputs[0].token_ids) == 8

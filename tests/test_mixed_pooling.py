"""Embeddings from a decoder served to generate (issue #16, "mix with generation when the model does both"):
embedding requests are prefill-only in the generation scheduler, chunked and batched with generation, their KV
blocks freed when their pass ends. Proven against the pooling-only engine and transformers on the same weights
(float32, CPU), with generation's greedy tokens unchanged by the embeddings around them."""

from __future__ import annotations

import asyncio
import base64
import json
import shutil
from concurrent.futures import ThreadPoolExecutor

import numpy as np

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_no_leaks
from test_embeddings import (COSINE_MIN, cosines, needs_cuda, sentence_transformers_decoder, sentences,
                             transformers_last_hidden)
from test_server_harness import ServerThread

from asyncengine import LLM
from asyncengine.config import EngineConfig
from asyncengine.engine import LLMEngine
from asyncengine.pooling_params import EmbeddingRequestOutput, PoolingParams
from asyncengine.sampling_params import RequestOutputKind, SamplingParams

ARCH = "Qwen3ForCausalLM"
BUDGET = 32  # max_num_batched_tokens: prompts longer than this are chunked
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, output_kind=RequestOutputKind.FINAL_ONLY)


@pytest.fixture(scope="module")
def folder(checkpoint_dir):
    return checkpoint_dir(ARCH)


def engine_for(folder) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(folder), max_model_len=256, max_num_batched_tokens=BUDGET,
                                  num_kv_blocks=128))


def embed_inputs(tokenizer, n: int, seed: int) -> list[list[int]]:
    """n token lists of 3 to ~120 tokens: many longer than BUDGET, so split across steps."""
    return [tokenizer(t).input_ids[:120] for t in sentences(n, seed=seed, max_words=70)]


def run_mixed(engine: LLMEngine, gen_prompts: list[list[int]], embed_ids: list[list[int]]):
    """Generation requests first, embeddings added two steps later (so they join running batches), stepped to
    the end by hand. Returns (generated token ids by prompt index, embeddings [N, hidden], facts about the steps)."""
    for i, ids in enumerate(gen_prompts):
        engine.add_request(f"gen-{i}", ids, GREEDY)
    facts = {"mixed_steps": 0, "chunks_not_pooling": 0}
    outputs, step_no = {}, 0
    while engine.has_unfinished_requests():
        if step_no == 2:
            for i, ids in enumerate(embed_ids):
                engine.add_request(f"emb-{i}", ids, PoolingParams())
        step = engine.prepare_step()
        if step is not None:
            items = step.sched.scheduled
            facts["mixed_steps"] += any(s.pools for s in items) and any(s.samples for s in items)
            facts["chunks_not_pooling"] += sum(s.request.pooling_params is not None and not s.pools for s in items)
            got = engine.book(step, engine.run(step))
        else:
            got = []
        outputs.update((o.request_id, o) for o in engine.emit(got) if o.finished)
        step_no += 1
    generated = [outputs[f"gen-{i}"].outputs[0].token_ids for i in range(len(gen_prompts))]
    assert all(isinstance(outputs[f"emb-{i}"], EmbeddingRequestOutput) for i in range(len(embed_ids)))
    embeddings = torch.tensor([outputs[f"emb-{i}"].outputs.embedding for i in range(len(embed_ids))])
    return generated, embeddings, facts


def generate_alone(folder, gen_prompts: list[list[int]]) -> list[list[int]]:
    """The greedy tokens of the generation requests run without any embedding request."""
    alone = engine_for(folder)
    for i, ids in enumerate(gen_prompts):
        alone.add_request(f"gen-{i}", ids, GREEDY)
    finished = {}
    while alone.has_unfinished_requests():
        finished.update((o.request_id, o) for o in alone.step() if o.finished)
    return [finished[f"gen-{i}"].outputs[0].token_ids for i in range(len(gen_prompts))]



def run_pipelined_to_completion(engine: LLMEngine, gen_prompts, embed_ids, **run_options) -> dict:
    """Add greedy requests gen-i and embedding requests emb-i, step the engine's pipelined loop until every one
    has finished; request id -> final output."""
    for i, ids in enumerate(gen_prompts):
        engine.add_request(f"gen-{i}", ids, GREEDY)
    for i, ids in enumerate(embed_ids):
        engine.add_request(f"emb-{i}", ids, PoolingParams())
    outputs = {}
    with ThreadPoolExecutor(1) as device:
        for step_outputs in engine.run_pipelined(device, **run_options):
            outputs.update((o.request_id, o) for o in step_outputs if o.finished)
    return outputs


def test_mixed_batches_equal_pooling_engine_transformers_and_generation_alone(folder):
    engine = engine_for(folder)
    tok = engine.tokenizer
    gen_prompts = [tok(t).input_ids[:40] for t in sentences(6, seed=5, max_words=30)]
    embed_ids = embed_inputs(tok, 16, seed=6)
    generated, ours, facts = run_mixed(engine, gen_prompts, embed_ids)

    assert facts["mixed_steps"] > 0, "no step held both a pooling pass and sampling rows"
    assert facts["chunks_not_pooling"] > 0, "no embedding input was split into chunks"
    assert_no_leaks(engine)
    assert not engine.pooling.unfinished  # no live pooling request, no output left unemitted

    pooling_only = LLM(str(folder), runner="pooling", max_model_len=256)
    theirs = torch.tensor([o.outputs.embedding for o in pooling_only.embed(embed_ids, use_tqdm=False)])
    assert cosines(ours, theirs).min() >= COSINE_MIN
    reference = F.normalize(transformers_last_hidden(folder, embed_ids), dim=-1)
    assert cosines(ours, reference).min() >= COSINE_MIN
    assert torch.allclose(ours, reference, atol=1e-5)

    assert generated == generate_alone(folder, gen_prompts)


def test_lookahead_and_preemption_keep_embeddings_and_tokens(folder):
    """The CUDA default (lookahead: the next step is scheduled before this one is booked) and a KV cache so small
    that requests are preempted and recomputed, embeddings among them."""
    tight = LLMEngine(EngineConfig(model=str(folder), max_model_len=256, max_num_batched_tokens=BUDGET,
                                   num_kv_blocks=256 // 16, block_size=16))
    tok = tight.tokenizer
    gen_prompts = [tok(t).input_ids[:40] for t in sentences(6, seed=5, max_words=30)]
    embed_ids = embed_inputs(tok, 10, seed=10)
    outputs = run_pipelined_to_completion(tight, gen_prompts, embed_ids, lookahead=True)
    assert tight.scheduler.num_preemptions > 0
    assert_no_leaks(tight)
    ours = torch.tensor([outputs[f"emb-{i}"].outputs.embedding for i in range(len(embed_ids))])
    reference = F.normalize(transformers_last_hidden(folder, embed_ids), dim=-1)
    assert cosines(ours, reference).min() >= COSINE_MIN

    generated = [outputs[f"gen-{i}"].outputs[0].token_ids for i in range(len(gen_prompts))]
    assert generated == generate_alone(folder, gen_prompts)


def test_llm_embed_on_a_generation_engine_and_its_errors(folder, tmp_path):
    llm = LLM(str(folder), max_model_len=256, max_num_batched_tokens=BUDGET)  # auto: generate
    assert isinstance(llm.engine, LLMEngine)
    ids = embed_inputs(llm.get_tokenizer(), 4, seed=7)
    ours = torch.tensor([o.outputs.embedding for o in llm.embed(ids, use_tqdm=False)])
    assert torch.allclose(ours, F.normalize(transformers_last_hidden(folder, ids), dim=-1), atol=1e-5)
    assert llm.generate("hello world", GREEDY, use_tqdm=False)[0].outputs[0].token_ids  # still generates
    with pytest.raises(ValueError, match="^dimensions is not supported"):
        llm.embed("hi", PoolingParams(dimensions=8), use_tqdm=False)
    with pytest.raises(ValueError, match="^input is 300 tokens"):
        llm.embed([[5] * 300], use_tqdm=False)
    with pytest.raises(ValueError, match="score needs the pooling runner"):
        llm.score("a", "b", use_tqdm=False)
    assert_no_leaks(llm.engine)

    # the checkpoint's own config: last token without Normalize is followed; mean pooling is refused, clearly
    plain = sentence_transformers_decoder(folder, tmp_path / "st", normalize=False, matryoshka=False)
    unnormalised = LLM(str(plain), runner="generate", max_model_len=256, max_num_batched_tokens=BUDGET)
    raw = torch.tensor([o.outputs.embedding for o in unnormalised.embed(ids, use_tqdm=False)])
    assert torch.allclose(raw, transformers_last_hidden(folder, ids), atol=1e-5)
    (plain / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 40}))
    capped = LLM(str(plain), runner="generate", max_model_len=256)
    with pytest.raises(ValueError, match="^input is 41 tokens but this model takes at most 40"):
        capped.embed([[5] * 41], use_tqdm=False)
    [cut] = capped.embed([ids[0] + [5] * 50], PoolingParams(truncate_prompt_tokens=-1), use_tqdm=False)
    assert len(cut.prompt_token_ids) == 40
    mean = tmp_path / "mean"
    shutil.copytree(plain, mean)
    (mean / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_mean_tokens": True}))
    meaner = LLM(str(mean), runner="generate", max_model_len=256)
    with pytest.raises(ValueError, match="mean pooling .* --runner pooling"):
        meaner.embed("hi", use_tqdm=False)
    assert meaner.generate("hi", GREEDY, use_tqdm=False)[0].outputs[0].token_ids


def test_aborting_an_embedding_mid_prompt_frees_its_blocks(folder):
    engine = engine_for(folder)
    engine.add_request("long", [7] * 100, PoolingParams())  # 4 chunks of BUDGET
    step = engine.prepare_step()
    engine.emit(engine.book(step, engine.run(step)))
    assert engine.block_manager.num_free_blocks < engine.block_manager.num_blocks
    [aborted] = engine.abort_request("long")
    assert aborted.finish_reason == "abort" and aborted.outputs is None
    assert not engine.has_unfinished_requests()
    assert_no_leaks(engine)


def test_openai_client_embeddings_and_chat_concurrently_through_the_engine_process(folder):
    import openai  # here, not at the top: the GPU machine runs this file's GPU test without it
    pooling_only = LLM(str(folder), runner="pooling", max_model_len=256)
    texts = sentences(12, seed=8, max_words=25)  # up to ~100 tokens: chunked by BUDGET
    reference = torch.tensor([o.outputs.embedding for o in pooling_only.embed(texts, use_tqdm=False)])
    messages = [[{"role": "user", "content": t}] for t in sentences(4, seed=9, max_words=25)]

    async def chats(client):
        return await asyncio.gather(*(client.chat.completions.create(
            model="tiny", messages=m, max_tokens=10, temperature=0) for m in messages))

    async def both(client):
        embeds = [client.embeddings.create(model="tiny", input=t) for t in texts]
        embeds.append(client.embeddings.create(model="tiny", input=texts[:5], encoding_format="base64"))
        return await asyncio.gather(chats(client), asyncio.gather(*embeds))

    async def main(url):
        async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120) as client:
            alone = await chats(client)
            mixed, embedded = await both(client)
        return alone, mixed, embedded

    with ServerThread(str(folder), served_model_name="tiny", engine_process=True,
                      max_num_batched_tokens=BUDGET) as server:
        alone, mixed, embedded = asyncio.run(main(server.url))
        assert [c.choices[0].message.content for c in mixed] == [c.choices[0].message.content for c in alone]
        ours = torch.tensor([r.data[0].embedding for r in embedded[:-1]])
        assert cosines(ours, reference).min() >= COSINE_MIN
        batch = torch.stack([torch.from_numpy(np.frombuffer(base64.b64decode(d.embedding), dtype="<f4").copy())
                             for d in embedded[-1].data])
        assert cosines(batch, reference[:5]).min() >= COSINE_MIN
        assert server.engine_idle()
        assert server.engine.stats().kv_cache_usage == 0.0
        refused = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        with pytest.raises(openai.BadRequestError) as info:
            refused.embeddings.create(model="tiny", input="hi", dimensions=8)
        assert info.value.body["param"] == "dimensions"


@pytest.mark.gpu
@needs_cuda
def test_gpu_mixed_batches_with_lookahead_and_decode_graphs(folder):
    """On CUDA the defaults differ (lookahead, decode CUDA graphs, Triton attention): float32 embeddings of a mixed
    run still equal transformers', and the greedy tokens those of the same engine without embeddings."""
    def engine():
        return LLMEngine(EngineConfig(model=str(folder), device="cuda", dtype="float32", max_model_len=256,
                                      max_num_batched_tokens=BUDGET, num_kv_blocks=128))

    def run(eng, gen_prompts, embed_ids):
        outputs = run_pipelined_to_completion(eng, gen_prompts, embed_ids)
        assert_no_leaks(eng)
        return outputs

    mixed = engine()
    gen_prompts = [mixed.tokenizer(t).input_ids[:40] for t in sentences(8, seed=11, max_words=30)]
    embed_ids = embed_inputs(mixed.tokenizer, 24, seed=12)
    outputs = run(mixed, gen_prompts, embed_ids)
    ours = torch.tensor([outputs[f"emb-{i}"].outputs.embedding for i in range(len(embed_ids))])
    reference = F.normalize(transformers_last_hidden(folder, embed_ids), dim=-1)
    assert cosines(ours, reference).min() >= COSINE_MIN
    alone = run(engine(), gen_prompts, [])
    assert [outputs[f"gen-{i}"].outputs[0].token_ids for i in range(len(gen_prompts))] == \
        [alone[f"gen-{i}"].outputs[0].token_ids for i in range(len(gen_prompts))]


def test_two_tensor_parallel_ranks_embed_as_one(folder):
    """Rank 0 pools the hidden states its forward pass ends with (replicated on every rank after the last
    all-reduce), so tensor parallelism changes nothing."""
    llm = LLM(str(folder), tensor_parallel_size=2, max_model_len=256, max_num_batched_tokens=BUDGET,
              num_kv_blocks=64)
    try:
        ids = embed_inputs(llm.get_tokenizer(), 6, seed=13)
        ours = torch.tensor([o.outputs.embedding for o in llm.embed(ids, use_tqdm=False)])
        assert_no_leaks(llm.engine)
    finally:
        llm.close()
    reference = F.normalize(transformers_last_hidden(folder, ids), dim=-1)
    assert cosines(ours, reference).min() >= COSINE_MIN

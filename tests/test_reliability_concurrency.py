"""Many clients at once on the default model: 200 concurrent streams each get exactly the text they get alone,
and a storm of 200 clients leaving at random points leaves no request, no KV block and no memory behind."""

from __future__ import annotations

import asyncio
import random

import pytest
import torch
from test_reliability_common import (
    MiB,
    count_batch_sizes,
    default_model_server,
    http_pool,
    prompt_bank,
    send_and_close,
    settled_rss,
    stream_sse,
)
from test_server_harness import wait_until

from asyncengine import LLM, SamplingParams

NUM_CLIENTS = 200
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def prompts() -> list[str]:
    return prompt_bank(NUM_CLIENTS, seed=6)


@pytest.fixture(scope="module")
def alone(prompts) -> list[tuple[str, str]]:
    """(text, finish_reason) of each prompt run by itself: one LLM.generate call per prompt, batch of one."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # batch-1 steps are faster on one thread; the arithmetic of a row is the same
    try:
        llm = LLM(max_model_len=256, num_kv_blocks=64, enable_prefix_caching=False)
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
        outs = [llm.generate([p], params, use_tqdm=False)[0].outputs[0] for p in prompts]
    finally:
        torch.set_num_threads(threads)
    return [(o.text, o.finish_reason) for o in outs]


def test_200_concurrent_streams_each_get_their_text_alone(prompts, alone):
    with default_model_server(max_model_len=256, num_kv_blocks=512, max_num_seqs=256) as srv:
        batch_sizes = count_batch_sizes(srv.engine)
        url = srv.url + "/v1/completions"

        async def run():
            async with http_pool(NUM_CLIENTS + 8) as client:
                bodies = [{"prompt": p, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True} for p in prompts]
                return await asyncio.wait_for(asyncio.gather(*[stream_sse(client, url, b) for b in bodies]), 120)

        results = asyncio.run(run())
        wait_until(srv.engine_idle, 10)
    assert all(r.status == 200 and r.done and not r.errors for r in results)
    mismatches = [(p, want, (r.text, r.finish_reasons[0]))
                  for p, want, r in zip(prompts, alone, results) if (r.text, r.finish_reasons[0]) != want]
    assert not mismatches, f"{len(mismatches)} streams differ from the prompt run alone, e.g. {mismatches[:3]}"
    assert max(batch_sizes) >= NUM_CLIENTS // 2, f"the clients were not batched together: {max(batch_sizes)}"


# -- the disconnect storm -----------------------------------------------------------------------------------------
LONG_PROMPT = " ".join(["And the king said unto the people of the land, behold the city"] * 24)  # ~300 tokens
STORM_MODES = ("sent", "sent-linger", "headers", "mid", "plain-linger", "complete")


def storm_plan(n: int, seed: int, prompts: list[str]) -> list[tuple[str, dict, float, int]]:
    """(mode, body, linger seconds, chunks to read) per client, seeded. Modes: `sent` closes right after
    sending (before prefill), `sent-linger` a few ms later (during prefill), `headers` after the response
    headers (before the first token), `mid` after 1-8 chunks, `plain-linger` a non-streamed request left
    during its generation, `complete` reads to the end."""
    rng = random.Random(seed)
    plan = []
    for i in range(n):
        mode = rng.choice(STORM_MODES)
        prompt = LONG_PROMPT + f" {i}" if rng.random() < 0.08 else prompts[i % len(prompts)]
        body = {"prompt": prompt, "max_tokens": rng.choice([8, 16, 32]), "ignore_eos": True,
                "stream": mode != "plain-linger", "temperature": rng.choice([0.0, 0.8]),
                "n": rng.choice([1, 1, 1, 2])}
        plan.append((mode, body, rng.uniform(0.0, 0.15), rng.randint(1, 8)))
    return plan


async def run_storm(url: str, plan) -> list:
    async def one(client, mode, body, linger, chunks):
        if mode in ("sent", "sent-linger", "plain-linger"):
            await send_and_close(url, "/v1/completions", body, linger=0.0 if mode == "sent" else linger)
            return mode
        leave = {"headers": 0, "mid": chunks, "complete": None}[mode]
        result = await stream_sse(client, url + "/v1/completions", body, leave_after=leave)
        assert result.status == 200, result.body
        if mode == "complete":
            assert result.done and not result.errors
        return mode

    async with http_pool(len(plan) + 8) as client:
        return await asyncio.wait_for(asyncio.gather(*[one(client, *p) for p in plan]), 120)


STORM_ENGINE = dict(max_model_len=1024, num_kv_blocks=1024, max_num_seqs=64, max_num_batched_tokens=256)


def test_disconnect_storm_frees_every_request_block_and_byte(prompts):
    with default_model_server(**STORM_ENGINE) as srv:
        probes = [prompts[0], prompts[1], LONG_PROMPT + " 3"]  # the storm shares these prefixes

        def greedy(prompt: str) -> str:
            async def one():
                async with http_pool(2) as client:
                    body = {"prompt": prompt, "max_tokens": 12, "temperature": 0, "stream": True}
                    return await stream_sse(client, srv.url + "/v1/completions", body)
            result = asyncio.run(one())
            assert result.done and not result.errors
            return result.text

        before = [greedy(p) for p in probes]
        asyncio.run(run_storm(srv.url, storm_plan(NUM_CLIENTS // 2, seed=1, prompts=prompts)))  # warm-up
        wait_until(srv.engine_idle, 15)
        baseline = settled_rss()

        modes = asyncio.run(run_storm(srv.url, storm_plan(NUM_CLIENTS, seed=2, prompts=prompts)))
        assert len(modes) == NUM_CLIENTS and set(modes) == set(STORM_MODES)
        wait_until(srv.engine_idle, 15)  # nothing running or waiting, every KV block free
        grown = settled_rss() - baseline
        after = [greedy(p) for p in probes]
        assert srv.engine_idle()
    print(f"disconnect storm: RSS {grown / MiB:+.1f} MiB after the storm")
    assert grown < 64 * MiB, f"RSS grew by {grown / MiB:.1f} MiB over a storm of disconnects"
    assert after == before, "a prompt's greedy text changed after the storm (stale or corrupted KV reused)"


def test_disconnect_storm_through_an_engine_process_frees_every_request_and_block(prompts):
    """The same storm with the engine in its own process (serve's default): every abort crosses the pipe, and
    the core ends with nothing running or waiting and every block free (its snapshot), the server with no
    request left, and a probe's greedy text unchanged."""
    with default_model_server(engine_process=True, **STORM_ENGINE) as srv:
        probe = {"prompt": prompts[0], "max_tokens": 12, "temperature": 0, "stream": True}

        async def greedy() -> str:
            async with http_pool(2) as client:
                result = await stream_sse(client, srv.url + "/v1/completions", probe)
            assert result.done and not result.errors
            return result.text

        before = asyncio.run(greedy())
        modes = asyncio.run(run_storm(srv.url, storm_plan(NUM_CLIENTS, seed=3, prompts=prompts)))
        assert set(modes) == set(STORM_MODES)
        wait_until(srv.engine_idle, 15)
        assert asyncio.run(greedy()) == before
        assert srv.engine_idle()

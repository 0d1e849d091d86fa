"""AsyncLLMEngine with the engine in its own process (EngineConfig.engine_process, asyncengine/engine_core.py):
the same outputs as the in-process engine, aborts that free the core's blocks, validation in the caller's process,
the core's death reported to every stream, and start-up failures that say why."""

from __future__ import annotations

import asyncio
import os
import threading
import time

import pytest
import uvloop

from asyncengine import EngineConfig, RequestOutputKind, SamplingParams
from asyncengine.async_engine import AsyncLLMEngine, EngineDeadError, QueueFullError
from asyncengine.engine_core import (OPENMP_WAIT_SETTINGS, EngineCoreClient, check_api_cpu_priority,
                                     let_a_cpu_engine_process_wait_passively, run_threads_at_idle_priority)
from conftest import assert_same_completions

ENGINE_ARGS = dict(max_model_len=128, max_num_seqs=16)


@pytest.fixture(scope="module")
def engines(llama_dir):
    """An engine-process engine and an in-process peer on the same weights; each test runs its own loop."""
    remote = AsyncLLMEngine(EngineConfig(model=str(llama_dir), engine_process=True, **ENGINE_ARGS))
    local = AsyncLLMEngine(EngineConfig(model=str(llama_dir), **ENGINE_ARGS))
    yield remote, local
    asyncio.run(remote.shutdown())
    asyncio.run(local.shutdown())
    assert not remote.client.process.is_alive() and remote.client.process.exitcode == 0


async def collect(engine, prompt, params, request_id=None):
    return [out async for out in engine.generate(prompt, params, request_id=request_id)]


async def settle(engine, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while engine.client.has_unfinished_requests() or engine.stats().num_running or engine.stats().kv_cache_usage:
        assert time.monotonic() < deadline, "the core did not settle"
        await asyncio.sleep(0.01)


def assert_same_samples(mine, theirs) -> None:
    """The last outputs of two streams sampled the same (the core runs torch on one thread fewer than an
    in-process engine here, so its sums run in another order: logprobs within LOGPROB_ATOL)."""
    assert_same_completions(mine[-1], theirs[-1])


WORKLOAD = [
    ("Hello world", SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)),
    ("The quick brown", SamplingParams(max_tokens=10, temperature=0.9, seed=7, n=2, logprobs=2, ignore_eos=True)),
    ([5, 6, 7, 8, 9], SamplingParams(max_tokens=16, temperature=0, output_kind=RequestOutputKind.FINAL_ONLY)),
    ("Once upon a time", SamplingParams(max_tokens=20, temperature=0.7, seed=3, top_k=20, ignore_eos=True)),
]


def test_same_outputs_as_the_in_process_engine(engines):
    remote, local = engines

    async def run_all(engine):
        results = await asyncio.gather(*[collect(engine, p, params) for p, params in WORKLOAD])
        await settle(engine)
        return results

    got, expected = asyncio.run(run_all(remote)), asyncio.run(run_all(local))
    for (prompt, _), mine, theirs in zip(WORKLOAD, got, expected):
        assert_same_samples(mine, theirs)
        assert mine[-1].finished and mine[-1].prompt_token_ids == theirs[-1].prompt_token_ids
        assert mine[-1].prompt == theirs[-1].prompt
    stats = remote.stats()
    assert stats.prefix_cache_queries > 0 and stats.num_running == 0 and stats.num_waiting == 0


def test_delta_outputs_concatenate_to_the_final_text(engines):
    remote, local = engines
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, stop=["\n\n"],
                            output_kind=RequestOutputKind.DELTA)
    deltas = asyncio.run(collect(remote, "Tell me a story", params))
    final = asyncio.run(collect(local, "Tell me a story", params.clone()))
    assert "".join(o.outputs[0].text for o in deltas) == "".join(o.outputs[0].text for o in final)
    assert sum((o.outputs[0].token_ids for o in deltas), []) == sum((o.outputs[0].token_ids for o in final), [])
    assert deltas[-1].outputs[0].finish_reason == final[-1].outputs[0].finish_reason


def test_leaving_a_stream_aborts_the_request_in_the_core(engines):
    remote, _ = engines
    seen = []

    async def main():
        stats = []
        remote.add_stats_listener(stats.append)
        params = SamplingParams(max_tokens=100, temperature=0, ignore_eos=True)
        async for output in remote.generate("Count with me: one two", params):
            seen.append(output)
            if len(seen) == 3:
                break
        await settle(remote)
        remote.client.stats_listeners.remove(stats.append)
        return stats

    stats = asyncio.run(main())
    assert len(seen) == 3 and not seen[-1].finished
    assert remote.stats().kv_cache_usage == 0 and not remote.client.has_unfinished_requests()
    assert sum(s.prompt_tokens for s in stats) > 0 and sum(s.generation_tokens for s in stats) >= 3


def test_messages_larger_than_the_pipe_arrive_whole_under_uvloop(engines):
    """16 requests finishing in the same step with 100 positions of top-5 logprobs each: one message of about a
    megabyte, which a pipe passes in pieces (uvloop once made a half-read message fail the engine)."""
    remote, local = engines
    params = SamplingParams(max_tokens=100, temperature=0, ignore_eos=True, logprobs=5,
                            output_kind=RequestOutputKind.FINAL_ONLY)
    prompts = [f"Line {i} of the story" for i in range(16)]

    async def run_all(engine):
        return await asyncio.gather(*[collect(engine, p, params) for p in prompts])

    got = uvloop.run(run_all(remote))
    expected = asyncio.run(run_all(local))
    assert not remote.errored
    for mine, theirs in zip(got, expected):
        assert_same_samples(mine, theirs)
        assert len(mine[-1].outputs[0].logprobs) == 100


def test_bad_input_fails_in_the_callers_process(engines):
    remote, _ = engines

    async def main():
        with pytest.raises(ValueError, match="max_model_len"):
            await remote.add_request("x " * 200, SamplingParams(max_tokens=4))
        with pytest.raises(ValueError, match="token ids"):
            await remote.add_request([10**9], SamplingParams(max_tokens=4))
        with pytest.raises(ValueError, match="already in use"):
            stream = await remote.add_request("Hello", SamplingParams(max_tokens=50, ignore_eos=True), "same")
            await remote.add_request("Hello", SamplingParams(max_tokens=4), "same")
        await remote.abort("same")
        last = await stream.get()
        while not last.finished:  # on a busy machine, tokens may arrive before the abort lands
            last = await stream.get()
        assert last.outputs[0].finish_reason in ("abort", "length")
        await settle(remote)

    asyncio.run(main())


def test_a_core_that_dies_fails_every_stream_and_the_engine(llama_dir):
    engine = AsyncLLMEngine(EngineConfig(model=str(llama_dir), engine_process=True, **ENGINE_ARGS))

    async def main():
        params = SamplingParams(max_tokens=100, temperature=0, ignore_eos=True)
        streams = [await engine.add_request(f"Prompt {i}", params) for i in range(3)]
        await streams[0].get()
        engine.client.process.kill()
        for stream in streams:
            with pytest.raises(EngineDeadError, match="exited"):
                while not (await asyncio.wait_for(stream.get(), 10)).finished:
                    pass
        assert engine.errored
        with pytest.raises(EngineDeadError):
            await engine.add_request("Hello", params)
        await engine.shutdown()

    asyncio.run(main())


def test_a_core_that_cannot_start_says_why(llama_dir):
    config = EngineConfig(model=str(llama_dir), engine_process=True, max_model_len=128, num_kv_blocks=2)
    with pytest.raises(ValueError, match="could not start.*KV cache"):
        EngineCoreClient(config)


def test_a_burst_between_two_steps_still_meets_max_queue_len(llama_dir):
    """The queue length the client checks counts the requests the core has not read yet, so a burst that arrives
    between two of the core's steps cannot overrun max_queue_len."""
    engine = AsyncLLMEngine(EngineConfig(model=str(llama_dir), engine_process=True, max_model_len=64,
                                         max_num_seqs=1, max_queue_len=2))

    async def main():
        params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
        streams = [await engine.add_request("a", params) for _ in range(2)]  # the queue is now full
        with pytest.raises(QueueFullError):
            await engine.add_request("b", params)
        for stream in streams:
            outputs = [o async for o in engine.iterate(stream)]
            assert outputs[-1].finished and len(outputs[-1].outputs[0].token_ids) == 30
        assert engine.stats().num_waiting == 0
        await engine.add_request("c", params)  # room again
        await engine.shutdown()

    asyncio.run(main())


def test_a_core_gone_between_the_health_check_and_the_send_is_an_engine_dead_error(llama_dir, monkeypatch):
    engine = AsyncLLMEngine(EngineConfig(model=str(llama_dir), engine_process=True, **ENGINE_ARGS))
    engine.client.process.kill()
    engine.client.process.join(10)
    monkeypatch.setattr(engine.client, "check_alive", lambda: None)  # the health check saw it alive

    async def main():
        with pytest.raises(EngineDeadError, match="exited"):
            await engine.add_request("Hello", SamplingParams(max_tokens=4))
        engine.client.abort_request(["any"])  # sent to a core that is gone: nothing to abort, and no error

    asyncio.run(main())
    asyncio.run(engine.shutdown())


# -- the server's CPU priority beside its engine process (`asyncengine serve --api-cpu-priority`) -----------------
def test_idle_priority_needs_an_engine_process_and_a_known_name(llama_dir):
    def check(choice, **kwargs):
        check_api_cpu_priority(EngineConfig(model=str(llama_dir), device="cpu", **kwargs), choice)

    check("idle", engine_process=True)
    check("normal", engine_process=False)
    with pytest.raises(ValueError, match="api_cpu_priority 'idle' needs the engine in a process of its own"):
        check("idle", engine_process=False)  # the model's threads would be idle too
    with pytest.raises(ValueError, match="api_cpu_priority must be one of normal, idle"):
        check("auto", engine_process=True)


@pytest.fixture
def wait_settings_left_as_found():
    """Fails the test if it leaves the OpenMP wait settings of this worker's environment changed (checked after
    monkeypatch's undo, since this fixture is requested first)."""
    before = {k: os.environ.get(k) for k in OPENMP_WAIT_SETTINGS}
    yield
    assert {k: os.environ.get(k) for k in OPENMP_WAIT_SETTINGS} == before


def test_beside_an_idle_server_a_cpu_engine_process_waits_passively_unless_the_user_chose(
        wait_settings_left_as_found, llama_dir, monkeypatch):
    config = EngineConfig(model=str(llama_dir), device="cpu", engine_process=True)
    for name in OPENMP_WAIT_SETTINGS:  # recorded by monkeypatch, so that what the helper sets is undone too
        monkeypatch.setenv(name, "recorded")
        monkeypatch.delenv(name)
    assert not let_a_cpu_engine_process_wait_passively(config, "normal")
    assert not any(name in os.environ for name in OPENMP_WAIT_SETTINGS)  # the default: libgomp's spinning
    assert let_a_cpu_engine_process_wait_passively(config, "idle")
    assert os.environ["OMP_WAIT_POLICY"] == "PASSIVE"
    for name, value in (("OMP_WAIT_POLICY", "ACTIVE"), ("GOMP_SPINCOUNT", "1000")):
        for other in OPENMP_WAIT_SETTINGS:
            monkeypatch.delenv(other, raising=False)
        monkeypatch.setenv(name, value)
        assert not let_a_cpu_engine_process_wait_passively(config, "idle")
        assert {k: os.environ.get(k) for k in OPENMP_WAIT_SETTINGS} == {
            k: value if k == name else None for k in OPENMP_WAIT_SETTINGS}


def test_idle_priority_covers_the_thread_and_those_it_starts_not_the_others():
    seen = {}

    def child():
        seen["child"] = os.sched_getscheduler(0)

    def worker():
        run_threads_at_idle_priority([threading.get_native_id()])
        seen["self"] = os.sched_getscheduler(0)
        started = threading.Thread(target=child)
        started.start()
        started.join()

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    assert seen == {"self": os.SCHED_IDLE, "child": os.SCHED_IDLE}
    assert os.sched_getscheduler(0) == os.SCHED_OTHER  # this (the test's) thread kept its policy

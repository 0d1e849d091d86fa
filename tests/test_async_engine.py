"""AsyncLLMEngine embedded in an asyncio application: streaming, output kinds, cancellation, back-pressure,
errors, shutdown, and a loop that stays free for the application's own tasks."""

from __future__ import annotations

import asyncio
import time

import anyio
import pytest
import uvloop

from asyncengine import LLM, EngineConfig, RequestOutputKind, SamplingParams
from asyncengine.async_engine import AsyncLLMEngine, EngineDeadError, QueueFullError
from conftest import assert_no_leaks

GREEDY = dict(temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(llama_dir):
    """One engine for the module; each test runs its own event loop over it (the step task follows the loop)."""
    return AsyncLLMEngine(EngineConfig(model=str(llama_dir), max_model_len=128, max_num_seqs=64))


def run(coro):
    return asyncio.run(coro)


async def collect(engine, prompt, params, request_id):
    return [out async for out in engine.generate(prompt, params, request_id=request_id)]


async def settle(engine, timeout: float = 5.0) -> None:
    """Wait until the step loop has applied every abort and finished everything."""
    deadline = time.monotonic() + timeout
    while engine.client.has_unfinished_requests():
        assert time.monotonic() < deadline, "engine did not settle"
        await asyncio.sleep(0.01)


def test_output_kinds_and_equality_with_llm(engine, llama_dir):
    expected = LLM(str(llama_dir), max_model_len=128).generate(
        ["Hello world"], SamplingParams(max_tokens=12, **GREEDY), use_tqdm=False
    )[0].outputs[0]

    async def main():
        delta = await collect(engine, "Hello world", SamplingParams(max_tokens=12, output_kind=RequestOutputKind.DELTA, **GREEDY), "d")
        cumulative = await collect(engine, "Hello world", SamplingParams(max_tokens=12, **GREEDY), "c")
        final = await collect(engine, "Hello world", SamplingParams(max_tokens=12, output_kind=RequestOutputKind.FINAL_ONLY, **GREEDY), "f")
        return delta, cumulative, final

    delta, cumulative, final = run(main())
    assert len(delta) > 1 and delta[-1].finished and not any(o.finished for o in delta[:-1])
    assert sum((o.outputs[0].token_ids for o in delta), []) == expected.token_ids
    assert "".join(o.outputs[0].text for o in delta) == expected.text
    assert cumulative[-1].outputs[0].token_ids == expected.token_ids
    assert [len(o.outputs[0].token_ids) for o in cumulative] == sorted(len(o.outputs[0].token_ids) for o in cumulative)
    assert len(final) == 1 and final[0].outputs[0].text == expected.text
    assert_no_leaks(engine.client.engine)


def test_abort_and_request_id_reuse(engine):
    async def main():
        params = SamplingParams(max_tokens=100, output_kind=RequestOutputKind.DELTA, **GREEDY)
        outputs = []
        async for out in engine.generate("Hello", params, request_id="same"):
            outputs.append(out)
            if len(outputs) == 2:
                await engine.abort("same")
        assert outputs[-1].finished and outputs[-1].outputs[0].finish_reason == "abort"
        await settle(engine)
        assert_no_leaks(engine.client.engine)
        again = await collect(engine, "Hello", SamplingParams(max_tokens=3, **GREEDY), "same")
        assert again[-1].outputs[0].finish_reason == "length"

    run(main())


def test_consumer_break_and_cancel_abort_and_free_blocks(engine):
    async def main():
        params = SamplingParams(max_tokens=100, output_kind=RequestOutputKind.DELTA, **GREEDY)
        gen = engine.generate("Hello world", params, request_id="brk")
        async for _ in gen:
            break
        await gen.aclose()

        async def reader():
            async for _ in engine.generate("Hello world", params, request_id="cnl"):
                pass

        task = asyncio.create_task(reader())
        users = engine.client.engine.output_processor.user_requests
        while "cnl" not in users or not users["cnl"].children[0].output_token_ids:
            await asyncio.sleep(0.005)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await settle(engine, timeout=2.0)
        assert_no_leaks(engine.client.engine)

    run(main())


def test_burst_of_100_cancelled_after_first_token(engine):
    async def main():
        params = SamplingParams(max_tokens=64, output_kind=RequestOutputKind.DELTA, **GREEDY)

        async def first_token_then_leave(i):
            async for out in engine.generate(f"Hello {i}", params, request_id=f"burst-{i}"):
                assert out.outputs[0].token_ids
                return

        await asyncio.gather(*(first_token_then_leave(i) for i in range(100)))
        await settle(engine)
        assert engine.stats().num_running == 0
        assert_no_leaks(engine.client.engine)
        start = time.monotonic()
        done = await collect(engine, "after", SamplingParams(max_tokens=4, **GREEDY), "after-burst")
        assert done[-1].finished and time.monotonic() - start < 5.0

    run(main())


def test_slow_reader_merges_into_one_bounded_slot(engine):
    async def main():
        params = SamplingParams(max_tokens=40, output_kind=RequestOutputKind.DELTA, **GREEDY)
        stream = await engine.add_request("Hello world", params, request_id="slow")
        await settle(engine)  # the whole generation happens while nobody reads
        outputs = [o async for o in engine.iterate(stream)]
        assert len(outputs) == 1, "unread deltas must merge into the single slot"
        assert len(outputs[0].outputs[0].token_ids) == 40 and outputs[0].finished

    run(main())


def test_loop_stays_free_for_other_tasks(engine, monkeypatch):
    """A 10 ms ticker keeps running while the engine serves 32 concurrent generations whose steps each take at
    least 80 ms on the device thread (a sleep in `launch`, which every driver mode calls there; it releases the GIL,
    as a CUDA synchronize does): the loop is never held for a device call. Were the calls run inline on the loop,
    every tick would wait for one (gaps >= 80 ms); off the loop the gaps are the ticker's 10 ms plus the loop's own
    booking and the GIL's switch interval (measured: max 17 ms on a busy 2-core host)."""
    device_wait_s = 0.08
    real_launch = engine.client.engine.launch

    def slow_launch(step):
        time.sleep(device_wait_s)
        return real_launch(step)

    monkeypatch.setattr(engine.client.engine, "launch", slow_launch)

    async def main():
        ticks: list[float] = []
        stop = asyncio.Event()

        async def ticker():
            while not stop.is_set():
                ticks.append(time.monotonic())
                await asyncio.sleep(0.01)

        tick_task = asyncio.create_task(ticker())
        params = SamplingParams(max_tokens=12, **GREEDY)
        await asyncio.gather(*(collect(engine, f"tick {i}", params, f"t{i}") for i in range(32)))
        stop.set()
        await tick_task
        return ticks

    ticks = run(main())
    gaps = sorted(b - a for a, b in zip(ticks, ticks[1:]))
    duration = ticks[-1] - ticks[0]
    assert duration >= 12 * device_wait_s, "the slowed device call did not run"
    assert gaps[-1] < device_wait_s, f"the loop was held {gaps[-1]:.3f} s, as long as a device call"
    assert gaps[len(gaps) // 2] < device_wait_s / 2, f"median tick gap {gaps[len(gaps) // 2]:.3f} s"


def test_works_under_uvloop_and_anyio(engine):
    params = SamplingParams(max_tokens=5, **GREEDY)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        out = runner.run(collect(engine, "Hello", params, "uv"))
    assert out[-1].finished
    result = {}

    async def with_anyio():
        result["out"] = await collect(engine, "Hello", params, "any")

    anyio.run(with_anyio)
    assert result["out"][-1].outputs[0].token_ids == out[-1].outputs[0].token_ids


def test_bad_input_raises_before_streaming(engine):
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=2.0)
    with pytest.raises(ValueError, match="200 tokens.*max_model_len is 128"):
        run(collect(engine, [5] * 200, SamplingParams(max_tokens=4), "too-long"))
    with pytest.raises(ValueError, match=r"\(10 tokens\) \+ max_tokens \(200\)"):
        run(collect(engine, [5] * 10, SamplingParams(max_tokens=200), "too-many"))
    assert_no_leaks(engine.client.engine)


def test_queue_full_is_refused_at_once(llama_dir):
    engine = AsyncLLMEngine(EngineConfig(model=str(llama_dir), max_model_len=64, max_num_seqs=1, max_queue_len=2))

    async def main():
        params = SamplingParams(max_tokens=30, **GREEDY)
        streams = [await engine.add_request("a", params) for _ in range(2)]  # the queue is now full
        start = time.monotonic()
        with pytest.raises(QueueFullError):
            await engine.add_request("b", params)
        assert time.monotonic() - start < 0.5
        await engine.shutdown()
        for s in streams:
            outs = [o async for o in engine.iterate(s)]
            assert outs[-1].finished

    run(main())


def test_step_failure_kills_engine_and_reaches_every_reader(llama_dir):
    engine = AsyncLLMEngine(EngineConfig(model=str(llama_dir), max_model_len=64))
    calls = {"n": 0}
    real_launch = engine.client.engine.launch

    def failing_launch(step):
        calls["n"] += 1
        if calls["n"] > 3:
            raise RuntimeError("injected device fault")
        return real_launch(step)

    engine.client.engine.launch = failing_launch

    async def main():
        params = SamplingParams(max_tokens=50, output_kind=RequestOutputKind.DELTA, **GREEDY)
        results = await asyncio.gather(*(collect(engine, "Hello", params, f"f{i}") for i in range(4)),
                                       return_exceptions=True)
        assert all(isinstance(r, EngineDeadError) for r in results), results
        assert engine.errored
        with pytest.raises(EngineDeadError):
            engine.check_health()
        start = time.monotonic()
        with pytest.raises(EngineDeadError):
            await collect(engine, "Hello", params, "after-death")
        assert time.monotonic() - start < 0.1

    run(main())


def test_shutdown_aborts_in_flight_requests(llama_dir):
    engine = AsyncLLMEngine(EngineConfig(model=str(llama_dir), max_model_len=128))

    async def main():
        params = SamplingParams(max_tokens=120, output_kind=RequestOutputKind.DELTA, **GREEDY)
        task = asyncio.create_task(collect(engine, "Hello", params, "inflight"))
        core = engine.client.engine
        while not core.has_unfinished_requests() or core.output_processor.children["inflight"].num_output_tokens < 2:
            await asyncio.sleep(0.005)
        await engine.shutdown(timeout=0.0)
        outputs = await task
        assert outputs[-1].outputs[0].finish_reason == "abort"
        with pytest.raises(EngineDeadError):
            await collect(engine, "Hello", params, "late")
        assert_no_leaks(engine.client.engine)

    run(main())


def test_an_output_put_before_an_error_is_read_first_then_the_error_every_time():
    from asyncengine.async_engine import RequestStream
    from asyncengine.outputs import CompletionOutput, RequestOutput

    async def main():
        stream = RequestStream("r", RequestOutputKind.DELTA)
        stream.put(RequestOutput("r", None, [1], [CompletionOutput(0, "a", [2])], finished=False))
        stream.put_error(EngineDeadError("boom"))
        assert (await asyncio.wait_for(stream.get(), 1)).outputs[0].text == "a"
        for _ in range(2):
            with pytest.raises(EngineDeadError, match="boom"):
                await asyncio.wait_for(stream.get(), 1)

    run(main())

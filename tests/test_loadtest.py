"""Tests of the load generator (loadtest/): pure metrics, seeded datasets and arrivals, and whole runs against
a real HTTP server on 127.0.0.1.

The server here is a fake: a small Starlette app served by hypercorn in the test's own event loop, streaming
OpenAI-format SSE chunks with known delays (first token after FIRST_TOKEN_S, then one every TOKEN_S), so the
measured TTFT/ITL/TPOT can be checked against them. It can also be run alone for trying the CLI by hand:

    python tests/test_loadtest.py --port 8123          # then: python -m loadtest --base-url http://127.0.0.1:8123
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import socket
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from hypercorn.asyncio import serve
from hypercorn.config import Config as HypercornConfig
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `loadtest` lives at the repository root

from loadtest import BenchmarkConfig, RequestRecord, format_table, run_benchmark, write_json, write_plot  # noqa: E402
from loadtest.__main__ import main as cli_main  # noqa: E402
from loadtest.arrivals import arrival_offsets, poisson_gaps  # noqa: E402
from loadtest.client import build_payload, chunk_content, sse_data, sse_lines  # noqa: E402
from loadtest.config import parse_goodput  # noqa: E402
from loadtest.datasets import WORDS, jsonl_requests, load_requests, random_requests, sample_lengths  # noqa: E402
from loadtest.metrics import latency_stats, meets_slos, rolling_percentile, summarize, tpot_s  # noqa: E402
from loadtest.records import CANCELLED, FAILED, OK  # noqa: E402
from loadtest.report import result_to_dict  # noqa: E402

FIRST_TOKEN_S = 0.100
TOKEN_S = 0.020
MODEL = "fake-model"


# ------------------------------------------------------------------------------------------ fake server

class FakeOpenAI:
    """An OpenAI-compatible streaming server with fixed per-token delays.

    Completions stream `text` chunks; chat streams a role-only chunk at once, then `delta.content` chunks.
    After the tokens: a finish chunk, a usage chunk (unless `usage=False`) and `data: [DONE]` (unless
    `done=False`). A prompt containing "FAIL" gets HTTP 500. It records request bodies and peak concurrency.
    """

    def __init__(self, first_token_s: float = FIRST_TOKEN_S, token_s: float = TOKEN_S,
                 usage: bool = True, done: bool = True) -> None:
        self.first_token_s, self.token_s, self.usage, self.done = first_token_s, token_s, usage, done
        self.bodies: list[dict] = []
        self.active = 0
        self.peak_active = 0
        self.app = Starlette(routes=[
            Route("/v1/models", self.models),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/chat/completions", self.completions, methods=["POST"]),
        ])

    async def models(self, request: Request) -> JSONResponse:
        return JSONResponse({"object": "list", "data": [{"id": MODEL, "object": "model"}]})

    async def completions(self, request: Request):
        body = await request.json()
        self.bodies.append(body)
        chat = "messages" in body
        prompt = body["messages"][0]["content"] if chat else body["prompt"]
        if isinstance(prompt, str) and "FAIL" in prompt:
            return JSONResponse({"error": {"message": "injected failure"}}, status_code=500)
        prompt_tokens = len(prompt) if isinstance(prompt, list) else len(prompt.split())
        return StreamingResponse(self._events(chat, body["max_tokens"], prompt_tokens),
                                 media_type="text/event-stream")

    async def _events(self, chat: bool, max_tokens: int, prompt_tokens: int):
        self.active += 1
        self.peak_active = max(self.peak_active, self.active)
        try:
            if chat:
                yield _sse(_chunk(chat, {"role": "assistant", "content": ""}))
            for i in range(max_tokens):
                await asyncio.sleep(self.first_token_s if i == 0 else self.token_s)
                yield _sse(_chunk(chat, {"content": f" w{i}"} if chat else f" w{i}"))
            yield _sse(_chunk(chat, {} if chat else "", finish_reason="length"))
            if self.usage:
                usage = {"prompt_tokens": prompt_tokens, "completion_tokens": max_tokens,
                         "total_tokens": prompt_tokens + max_tokens}
                yield _sse({"id": "x", "object": "chunk", "model": MODEL, "choices": [], "usage": usage})
            if self.done:
                yield "data: [DONE]\n\n"
        finally:
            self.active -= 1


def _chunk(chat: bool, content, finish_reason: str | None = None) -> dict:
    choice = {"index": 0, "finish_reason": finish_reason}
    choice["delta" if chat else "text"] = content
    kind = "chat.completion.chunk" if chat else "text_completion"
    return {"id": "x", "object": kind, "model": MODEL, "choices": [choice]}


def _sse(event: dict) -> str:
    return f"data: {json.dumps(event)}\n\n"


@contextlib.asynccontextmanager
async def serving(fake: FakeOpenAI):
    """Serve `fake` with hypercorn on 127.0.0.1:<ephemeral port> in this event loop; yields the base URL."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)  # listening before hypercorn starts: early connections wait in the backlog
    port = sock.getsockname()[1]
    config = HypercornConfig()
    config.bind = [f"fd://{sock.detach()}"]
    config.graceful_timeout = 0.5
    config.loglevel = "WARNING"
    stop = asyncio.Event()
    server = asyncio.create_task(serve(fake.app, config, shutdown_trigger=stop.wait))
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        stop.set()
        await asyncio.wait_for(server, 5)


async def run_against(fake: FakeOpenAI, **overrides) -> tuple:
    async with serving(fake) as url:
        config = BenchmarkConfig(base_url=url, progress=False, **overrides)
        return await run_benchmark(config)


def record(ttft: float = 0.1, e2el: float = 1.0, tokens: int = 10, status: str = OK, itl=None,
           prompt_len: int = 100) -> RequestRecord:
    """A hand-made record; times in seconds."""
    return RequestRecord(0, prompt_len, tokens, status=status, ttft_s=ttft, e2el_s=e2el, output_tokens=tokens,
                         chunks=tokens, itl_s=list(itl or []), error=None if status == OK else "boom")


# --------------------------------------------------------------------------------------------- metrics

def test_latency_stats_are_ms_with_linear_percentiles():
    stats = latency_stats([0.010, 0.020, 0.030, 0.040], (50, 90, 99))
    assert stats.count == 4
    assert stats.mean == pytest.approx(25.0)
    assert stats.median == pytest.approx(25.0)
    assert stats.percentiles["p90"] == pytest.approx(37.0)
    assert stats.percentiles["p99"] == pytest.approx(39.7)


def test_latency_stats_of_no_samples_are_none():
    stats = latency_stats([], (50, 99))
    assert (stats.count, stats.mean, stats.percentiles) == (0, None, {"p50": None, "p99": None})


def test_tpot_excludes_the_first_token():
    assert tpot_s(record(ttft=0.2, e2el=1.1, tokens=10)) == pytest.approx(0.1)


def test_tpot_is_undefined_for_one_token_and_for_failures():
    assert tpot_s(record(tokens=1)) is None
    assert tpot_s(record(status=FAILED)) is None


def test_one_token_request_is_left_out_of_tpot_stats_but_counts_in_ttft():
    m = summarize([record(ttft=0.1, e2el=0.1, tokens=1), record(ttft=0.2, e2el=1.1, tokens=10)], 1.0)
    assert m.latency["tpot"].count == 1
    assert m.latency["tpot"].mean == pytest.approx(100.0)
    assert m.latency["ttft"].count == 2


def test_goodput_counts_requests_meeting_every_slo():
    records = [
        record(ttft=0.1, e2el=1.0, tokens=10),   # ttft 100 ms, tpot 100 ms: good
        record(ttft=0.3, e2el=1.0, tokens=10),   # ttft too slow
        record(ttft=0.1, e2el=3.0, tokens=10),   # tpot 322 ms: too slow
        record(ttft=0.1, e2el=0.1, tokens=1),    # one token: meets any TPOT SLO
        record(ttft=0.01, e2el=0.1, status=FAILED),  # failures never count
    ]
    m = summarize(records, 2.0, {"ttft": 200, "tpot": 150})
    assert m.good_requests == 2
    assert m.request_goodput == pytest.approx(1.0)
    assert summarize(records, 2.0).good_requests is None


def test_meets_slos_on_e2el_is_inclusive():
    assert meets_slos(record(e2el=1.0), {"e2el": 1000})
    assert not meets_slos(record(e2el=1.001), {"e2el": 1000})


def test_failed_and_cancelled_requests_are_excluded_from_latency_and_throughput():
    records = [record(ttft=0.1, e2el=1.0, tokens=10, prompt_len=50, itl=[0.1] * 9),
               record(ttft=5.0, e2el=9.0, tokens=99, status=FAILED, itl=[4.0]),
               record(ttft=5.0, e2el=9.0, tokens=99, status=CANCELLED)]
    m = summarize(records, 2.0)
    assert (m.completed, m.failed, m.cancelled) == (1, 1, 1)
    assert (m.total_input_tokens, m.total_output_tokens) == (50, 10)
    assert m.request_throughput == pytest.approx(0.5)
    assert m.output_throughput == pytest.approx(5.0)
    assert m.total_token_throughput == pytest.approx(30.0)
    assert m.latency["ttft"].mean == pytest.approx(100.0)
    assert m.latency["itl"].count == 9 and m.latency["itl"].percentiles["p99"] == pytest.approx(100.0)


def test_itl_is_pooled_over_requests():
    m = summarize([record(itl=[0.01, 0.01]), record(itl=[0.04])], 1.0)
    assert m.latency["itl"].count == 3
    assert m.latency["itl"].mean == pytest.approx(20.0)


def test_summarize_with_no_success_has_empty_stats_and_zero_throughput():
    m = summarize([record(status=FAILED)], 1.0)
    assert m.completed == 0 and m.request_throughput == 0
    assert all(s.mean is None for s in m.latency.values())


def test_result_json_is_strict_even_with_empty_stats_and_infinite_rate():
    from loadtest.runner import BenchmarkResult

    result = BenchmarkResult(BenchmarkConfig(), MODEL, "t", summarize([record(status=FAILED)], 1.0), [])
    data = result_to_dict(result)
    json.dumps(data, allow_nan=False)
    assert data["config"]["request_rate"] == "inf" and data["metrics"]["latency"]["ttft"]["mean"] is None


def test_rolling_percentile_follows_time_order():
    x, y = rolling_percentile([3, 1, 2, 4], [30, 10, 20, 40], 50, window=2)
    assert x == [2, 3, 4]
    assert y == pytest.approx([15, 25, 35])
    assert rolling_percentile([1], [5], 99, window=10) == ([1.0], [5.0])
    assert rolling_percentile([], [], 50, window=3) == ([], [])


# --------------------------------------------------------------------------------------- config & SSE

def test_parse_goodput():
    assert parse_goodput(["ttft:200", "TPOT:50.5"]) == {"ttft": 200.0, "tpot": 50.5}
    with pytest.raises(ValueError, match="like 'ttft:200'"):
        parse_goodput(["ttft=200"])


@pytest.mark.parametrize("kwargs, message", [
    ({"goodput": {"itl": 5}}, "goodput metric"),
    ({"request_rate": 0}, "request_rate"),
    ({"endpoint": "/v1/embeddings"}, "endpoint"),
    ({"dataset": "jsonl"}, "dataset_path"),
    ({"prompt_token_ids": True, "endpoint": "/v1/chat/completions"}, "prompt_token_ids"),
    ({"timeout": math.inf}, "timeout"),
    ({"workers": 0}, "workers"),
    ({"workers": 5, "num_prompts": 4}, "workers"),
])
def test_config_rejects_inconsistent_settings(kwargs, message):
    with pytest.raises(ValueError, match=message):
        BenchmarkConfig(**kwargs)


def test_pool_is_sized_so_no_request_waits_for_a_connection():
    assert BenchmarkConfig(num_prompts=50).pool_size() == 50
    assert BenchmarkConfig(num_prompts=50, max_concurrency=8).pool_size() == 8
    assert BenchmarkConfig(num_prompts=50, max_connections=3).pool_size() == 3


def test_sse_parsing_and_chunk_content():
    assert sse_data("data: {}") == "{}" and sse_data("data:[DONE]") == "[DONE]"
    assert sse_data(": ping") is None and sse_data("") is None and sse_data("event: x") is None
    assert chunk_content({"choices": [{"text": "hi"}]}, is_chat=False) == "hi"
    assert chunk_content({"choices": [{"delta": {"role": "assistant"}}]}, is_chat=True) == ""
    assert chunk_content({"choices": [], "usage": {}}, is_chat=False) == ""
    assert chunk_content({"choices": [{"delta": {"reasoning_content": "hmm"}}]}, is_chat=True) == "hmm"


def test_sse_lines_split_across_reads_with_any_line_end_and_length():
    """Lines cut anywhere between network reads, LF or CRLF ends, a 1 MB line (past aiohttp's readline limit), a
    multi-byte character split between reads, and a last line with no end."""
    long = "x" * (1 << 20)
    body = f"data: a\r\n\ndata: {long}\n: ping\ndata: é\ndata: [DONE]".encode()
    cuts = [0, 3, 8, 9, 500_000, len(body) - 20, len(body) - 14, len(body)]

    class Body:  # what sse_lines reads of aiohttp's StreamReader
        async def iter_any(self):
            for start, end in zip(cuts, cuts[1:]):
                yield body[start:end]

    async def read() -> list[str]:
        return [line async for line in sse_lines(Body())]

    assert asyncio.run(read()) == ["data: a", "", f"data: {long}", ": ping", "data: é", "data: [DONE]"]


def test_payload_streams_with_usage_and_ignore_eos():
    config = BenchmarkConfig(temperature=0.5, extra_body={"top_p": 0.9})
    sample = random_requests(BenchmarkConfig(num_prompts=1, input_len=5, output_len=7))[0]
    body = build_payload(config, "m", sample)
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert (body["max_tokens"], body["ignore_eos"], body["temperature"], body["top_p"]) == (7, True, 0.5, 0.9)
    chat = build_payload(BenchmarkConfig(endpoint="/v1/chat/completions", ignore_eos=False), "m", sample)
    assert chat["messages"] == [{"role": "user", "content": sample.prompt}] and "ignore_eos" not in chat


# ---------------------------------------------------------------------------------- datasets & arrivals

def test_random_dataset_is_seeded_and_reproducible():
    config = dict(num_prompts=20, input_len=50, output_len=30, len_dist="uniform")
    a = random_requests(BenchmarkConfig(**config, seed=1))
    assert a == random_requests(BenchmarkConfig(**config, seed=1))
    assert a != random_requests(BenchmarkConfig(**config, seed=2))
    assert all(len(r.prompt.split()) == r.prompt_len and set(r.prompt.split()) <= set(WORDS) for r in a)


def test_token_id_prompts_have_exact_lengths_within_the_vocabulary():
    requests = random_requests(BenchmarkConfig(num_prompts=10, input_len=64, prompt_token_ids=True, vocab_size=100))
    assert all(len(r.prompt) == r.prompt_len == 64 for r in requests)
    assert all(0 <= t < 100 for r in requests for t in r.prompt)


def test_length_distributions_have_the_requested_means():
    rng = np.random.default_rng(0)
    assert set(sample_lengths(rng, 200, 100, "fixed")) == {200}
    uniform = sample_lengths(rng, 200, 20000, "uniform", range_ratio=0.5)
    assert uniform.min() >= 100 and uniform.max() <= 300
    assert uniform.mean() == pytest.approx(200, rel=0.02)
    skewed = sample_lengths(rng, 200, 20000, "sharegpt-like")
    assert skewed.min() >= 1 and skewed.max() <= 1200
    assert skewed.mean() == pytest.approx(200, rel=0.05)
    assert np.median(skewed) < skewed.mean()  # right-skewed, like real chat lengths


def test_poisson_gaps_have_the_right_mean():
    gaps = poisson_gaps(20000, rate=5.0, seed=3)
    assert gaps.mean() == pytest.approx(0.2, rel=0.03)
    assert gaps.std() == pytest.approx(0.2, rel=0.05)  # exponential: std == mean
    assert np.array_equal(gaps, poisson_gaps(20000, rate=5.0, seed=3))


def test_arrival_offsets_start_at_zero_and_are_all_zero_at_infinite_rate():
    offsets = arrival_offsets(100, 10.0, seed=0)
    assert offsets[0] == 0 and len(offsets) == 100 and np.all(np.diff(offsets) >= 0)
    assert not arrival_offsets(5, math.inf, seed=0).any()


def test_jsonl_dataset_reads_prompts_and_reuses_lines(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "one two three", "max_tokens": 4}\n\n{"prompt": [5, 6]}\n')
    requests = jsonl_requests(path, 3, default_max_tokens=9)
    assert [(r.prompt, r.prompt_len, r.max_tokens) for r in requests] == [
        ("one two three", 3, 4), ([5, 6], 2, 9), ("one two three", 3, 4)]
    path.write_text('{"text": "no prompt"}\n')
    with pytest.raises(ValueError, match="prompts.jsonl:1"):
        jsonl_requests(path, 1, 9)


# ------------------------------------------------------------------------------- end to end, real HTTP

def test_end_to_end_measures_the_servers_known_delays(tmp_path):
    fake = FakeOpenAI()
    result = asyncio.run(run_against(fake, num_prompts=8, input_len=20, output_len=10, max_concurrency=4,
                                     goodput={"ttft": 1000, "tpot": 500}))
    m = result.metrics
    assert result.model == MODEL
    assert (m.completed, m.failed, m.cancelled) == (8, 0, 0)
    assert all(r.output_tokens == 10 and r.usage_reported and len(r.itl_s) == 9 for r in result.records)
    assert m.total_output_tokens == 80 and m.total_input_tokens == 8 * 20
    assert FIRST_TOKEN_S * 1000 <= m.latency["ttft"].mean < FIRST_TOKEN_S * 1000 + 80
    assert TOKEN_S * 1000 * 0.75 <= m.latency["itl"].median < TOKEN_S * 1000 + 20
    assert TOKEN_S * 1000 * 0.9 <= m.latency["tpot"].mean < TOKEN_S * 1000 + 20
    expected_e2el_ms = (FIRST_TOKEN_S + 9 * TOKEN_S) * 1000
    assert expected_e2el_ms <= m.latency["e2el"].mean < expected_e2el_ms + 150
    assert m.good_requests == 8
    assert fake.peak_active <= 4
    body = fake.bodies[0]
    assert body["stream"] and body["ignore_eos"] and body["stream_options"] == {"include_usage": True}

    json_path, png_path = write_json(result, tmp_path / "r.json"), write_plot(result, tmp_path / "r.png")
    saved = json.loads(json_path.read_text())
    assert saved["config"]["request_rate"] == "inf" and len(saved["requests"]) == 8
    assert saved["metrics"]["latency"]["ttft"]["count"] == 8
    assert png_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = format_table(result)
    assert "TTFT" in table and "8 completed, 0 failed" in table


def test_workers_share_the_requests_and_measure_the_same_delays():
    """Two client processes: every request sent once, records numbered globally, the concurrency limit split
    between them (never exceeded in all), the same known delays measured as by one process."""
    fake = FakeOpenAI()
    result = asyncio.run(run_against(fake, num_prompts=12, input_len=20, output_len=10, max_concurrency=4,
                                     workers=2, seed=3))
    m = result.metrics
    assert (m.completed, m.failed, m.cancelled) == (12, 0, 0)
    assert [r.index for r in result.records] == list(range(12)) and len(fake.bodies) == 12
    assert fake.peak_active <= 4
    assert FIRST_TOKEN_S * 1000 <= m.latency["ttft"].mean < FIRST_TOKEN_S * 1000 + 80
    assert TOKEN_S * 1000 * 0.9 <= m.latency["tpot"].mean < TOKEN_S * 1000 + 20
    # three rounds of 4 requests at (FIRST_TOKEN_S + 9 TOKEN_S) each: the run's duration spans them all
    assert 3 * (FIRST_TOKEN_S + 9 * TOKEN_S) <= m.duration_s < 3 * (FIRST_TOKEN_S + 9 * TOKEN_S) + 1.5
    single = asyncio.run(run_against(FakeOpenAI(), num_prompts=12, input_len=20, output_len=10, seed=3))
    assert sorted(b["prompt"] for b in fake.bodies) == sorted(r.prompt for r in load_requests(single.config))


def test_chat_endpoint_ignores_role_chunk_and_counts_chunks_without_usage():
    fake = FakeOpenAI(usage=False)
    result = asyncio.run(run_against(fake, num_prompts=3, output_len=5, endpoint="/v1/chat/completions"))
    assert result.metrics.completed == 3
    assert all(r.output_tokens == r.chunks == 5 and not r.usage_reported for r in result.records)
    assert result.metrics.latency["ttft"].mean >= FIRST_TOKEN_S * 1000  # the instant role chunk is no token


def test_http_errors_are_recorded_as_failures_with_their_text(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "hello there", "max_tokens": 3}\n{"prompt": "please FAIL", "max_tokens": 3}\n')
    result = asyncio.run(run_against(FakeOpenAI(), dataset="jsonl", dataset_path=str(path), num_prompts=2))
    ok, failed = result.records
    assert ok.status == OK and failed.status == FAILED
    assert failed.error.startswith("HTTP 500") and "injected failure" in failed.error
    assert result.metrics.completed == 1 and result.metrics.total_input_tokens == 2
    assert "injected failure" in format_table(result)


def test_stream_without_done_is_a_failure():
    result = asyncio.run(run_against(FakeOpenAI(first_token_s=0, token_s=0, done=False), num_prompts=1,
                                     output_len=2))
    assert result.records[0].status == FAILED and "[DONE]" in result.records[0].error


def test_request_timeout_marks_the_request_failed():
    fake = FakeOpenAI(first_token_s=0.01, token_s=1.0)
    started = time.perf_counter()
    result = asyncio.run(run_against(fake, num_prompts=2, output_len=50, timeout=0.3))
    assert time.perf_counter() - started < 3
    assert all(r.status == FAILED and r.error.startswith("timeout") for r in result.records)
    assert all(r.ttft_s is not None for r in result.records)  # partial timing survives


def test_duration_cap_stops_the_run_and_cancels_requests_in_flight():
    fake = FakeOpenAI(first_token_s=0.01, token_s=0.5)
    started = time.perf_counter()
    result = asyncio.run(run_against(fake, num_prompts=50, output_len=100, max_concurrency=3, duration=0.5))
    assert time.perf_counter() - started < 3
    m = result.metrics
    assert (m.completed, m.failed, m.cancelled) == (0, 0, 3)  # the 47 never sent are not records
    assert m.duration_s == pytest.approx(0.5, abs=0.2)


def test_poisson_arrivals_send_at_their_offsets():
    fake = FakeOpenAI(first_token_s=0, token_s=0)
    result = asyncio.run(run_against(fake, num_prompts=10, output_len=1, request_rate=20.0, seed=7))
    expected = arrival_offsets(10, 20.0, seed=8)  # the runner seeds arrivals with seed + 1
    lateness = np.array([r.start_s for r in result.records]) - expected
    assert expected[-1] > 0.2  # the offsets really spread the sends out...
    assert lateness.min() >= -0.001 and lateness.max() < 0.25  # ...and none is sent early or very late


def test_infinite_rate_sends_the_whole_burst_at_once():
    fake = FakeOpenAI(first_token_s=0.2, token_s=0.01)
    result = asyncio.run(run_against(fake, num_prompts=40, output_len=5))
    assert max(r.start_s for r in result.records) < 0.15
    assert fake.peak_active == 40


def test_cli_writes_table_json_and_plot(tmp_path, capsys):
    async def scenario():
        async with serving(FakeOpenAI(first_token_s=0.02, token_s=0.005)) as url:
            argv = ["--base-url", url, "--num-prompts", "6", "--input-len", "30", "--output-len", "8",
                    "--len-dist", "uniform", "--request-rate", "50", "--goodput", "ttft:500", "tpot:100",
                    "--no-progress", "--result-json", str(tmp_path / "out.json"), "--plot", str(tmp_path / "p.png")]
            return await asyncio.to_thread(cli_main, argv)  # the CLI runs its own loop, in a thread

    assert asyncio.run(scenario()) == 0
    out = capsys.readouterr().out
    assert "6 completed, 0 failed" in out and "goodput" in out and "E2EL" in out
    saved = json.loads((tmp_path / "out.json").read_text())
    assert saved["model"] == MODEL and saved["config"]["goodput"] == {"ttft": 500.0, "tpot": 100.0}
    assert (tmp_path / "p.png").stat().st_size > 10_000


# ------------------------------------------------------------------------------- standalone fake server

def _serve_forever(port: int, first_token_s: float, token_s: float) -> None:
    config = HypercornConfig()
    config.bind = [f"127.0.0.1:{port}"]
    print(f"fake OpenAI server on http://127.0.0.1:{port} (first token {first_token_s * 1000:g} ms, "
          f"then {token_s * 1000:g} ms/token); Ctrl-C to stop")
    asyncio.run(serve(FakeOpenAI(first_token_s, token_s).app, config))


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="Serve the test's fake OpenAI streaming server.")
    parser.add_argument("--port", type=int, default=8123)
    parser.add_argument("--first-token-ms", type=float, default=FIRST_TOKEN_S * 1000)
    parser.add_argument("--token-ms", type=float, default=TOKEN_S * 1000)
    cli = parser.parse_args()
    with contextlib.suppress(KeyboardInterrupt):
        _serve_forever(cli.port, cli.first_token_ms / 1000, cli.token_ms / 1000)

"""`run_benchmark(config)`: send the configured requests on schedule and summarize what came back.

Life of a run:
  1. build the request list (datasets) and the send offsets (arrivals, seeded with `config.seed + 1`);
  2. open one pooled httpx client; resolve the model id if none was given;
  3. dispatch: sleep until each request's offset, take a `max_concurrency` slot if there is a limit, then
     start a task that streams it (client.send_request);
  4. wait for all of them, or until `duration` seconds have passed: then cancel the rest. Requests that were
     in flight at the cap are recorded as CANCELLED; requests never sent are not recorded;
  5. summarize (metrics). The duration is from the first send to the last completion (or to the cap).
"""

from __future__ import annotations

import datetime as dt
import time
from dataclasses import dataclass

import anyio
import httpx
from tqdm import tqdm

from loadtest.arrivals import arrival_offsets
from loadtest.client import build_payload, fetch_first_model, make_http_client, send_request
from loadtest.config import BenchmarkConfig
from loadtest.datasets import SampleRequest, load_requests
from loadtest.metrics import BenchmarkMetrics, summarize
from loadtest.records import CANCELLED, RequestRecord


@dataclass
class BenchmarkResult:
    """Outcome of one run: the config, the model id used, the summary and every sent request's record
    (ordered by request index)."""

    config: BenchmarkConfig
    model: str
    started_at: str  # ISO 8601, UTC
    metrics: BenchmarkMetrics
    records: list[RequestRecord]


async def run_benchmark(config: BenchmarkConfig) -> BenchmarkResult:
    """Run the load test that `config` describes; returns when every request ended or the duration cap hit."""
    requests = load_requests(config)
    offsets = arrival_offsets(len(requests), config.request_rate, config.seed + 1)
    started_at = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    async with make_http_client(config) as client:
        model = config.model or await fetch_first_model(client, config)
        records, duration = await _drive(client, config, model, requests, offsets.tolist())
    metrics = summarize(records, max(duration, 1e-9), config.goodput, config.percentiles)
    return BenchmarkResult(config, model, started_at, metrics, records)


async def _drive(
    client: httpx.AsyncClient, config: BenchmarkConfig, model: str, requests: list[SampleRequest],
    offsets: list[float],
) -> tuple[list[RequestRecord], float]:
    """Send every request at its offset; return the records of those sent and the run's duration (s).

    One dispatcher loop sleeps until each offset and, under a concurrency limit, waits for a free slot before
    starting the request's task, so a pending request costs no task. Everything runs in one task group
    inside the duration's cancel scope: when the cap expires, the dispatcher and every request are cancelled.
    """
    sent: list[RequestRecord] = []
    slots = anyio.Semaphore(config.max_concurrency) if config.max_concurrency else None
    t0 = time.perf_counter()

    async def one(index: int, request: SampleRequest, bar: tqdm) -> None:
        record = RequestRecord(index, request.prompt_len, request.max_tokens, start_s=time.perf_counter() - t0)
        sent.append(record)
        try:
            await send_request(client, config, build_payload(config, model, request), record)
            bar.update(1)
        finally:
            if slots is not None:
                slots.release()

    with tqdm(total=len(requests), disable=not config.progress, unit="req", dynamic_ncols=True) as bar:
        with anyio.move_on_after(config.duration):
            async with anyio.create_task_group() as group:
                for index, (request, offset) in enumerate(zip(requests, offsets)):
                    await _wait_turn(t0 + offset, slots)
                    group.start_soon(one, index, request, bar)
        duration = time.perf_counter() - t0
    for record in sent:
        if record.e2el_s is None:  # still streaming when the cap hit
            record.status, record.error = CANCELLED, f"cancelled: --duration {config.duration:g} s reached"
    return sorted(sent, key=lambda r: r.index), duration


async def _wait_turn(send_at: float, slots: anyio.Semaphore | None) -> None:
    """Sleep until `send_at` (perf_counter time), then take a concurrency slot.

    Neither step yields to the event loop when it need not wait: with many streams in flight one loop
    iteration can take milliseconds, and yielding once per request would spread an "all at once" burst
    over seconds.
    """
    delay = send_at - time.perf_counter()
    if delay > 0:
        await anyio.sleep(delay)
    if slots is None:
        return
    try:
        slots.acquire_nowait()
    except anyio.WouldBlock:
        await slots.acquire()

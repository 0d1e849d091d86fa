"""`run_benchmark(config)`: send the configured requests on schedule and summarize what came back.

Life of a run:
  1. build the request list (datasets) and the send offsets (arrivals, seeded with `config.seed + 1`);
  2. open one pooled HTTP client (aiohttp); resolve the model id if none was given;
  3. dispatch: sleep until each request's offset, take a `max_concurrency` slot if there is a limit, then
     start a task that streams it (client.send_request);
  4. wait for all of them, or until `duration` seconds have passed: then cancel the rest. Requests that were
     in flight at the cap are recorded as CANCELLED; requests never sent are not recorded;
  5. summarize (metrics). The duration is from the first send to the last completion (or to the cap).
With `workers` > 1, steps 3 and 4 run in that many client processes, each with every workers-th request.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import multiprocessing
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

import aiohttp
import anyio
from tqdm import tqdm

from .arrivals import arrival_offsets
from .client import build_payload, fetch_first_model, make_http_client, send_request
from .config import BenchmarkConfig
from .datasets import SampleRequest, load_requests
from .metrics import BenchmarkMetrics, summarize
from .records import CANCELLED, RequestRecord

WORKER_START_S = 3.0  # with workers > 1: from now to the shared start, time for the client processes to start


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
        if config.workers == 1:
            records, duration = await _drive(client, config, model, requests, offsets.tolist())
    if config.workers > 1:  # in a thread: this loop may be serving the target itself (tests)
        records, duration = await anyio.to_thread.run_sync(
            _drive_in_workers, config, model, requests, offsets.tolist())
    metrics = summarize(records, max(duration, 1e-9), config.goodput, config.percentiles)
    return BenchmarkResult(config, model, started_at, metrics, records)


async def _drive(
    client: aiohttp.ClientSession, config: BenchmarkConfig, model: str, requests: list[SampleRequest],
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


def _drive_in_workers(config: BenchmarkConfig, model: str, requests: list[SampleRequest],
                      offsets: list[float]) -> tuple[list[RequestRecord], float]:
    """`config.workers` client processes, each sending every workers-th request at its own offset from one
    shared start (WORKER_START_S from now, time for the processes to start), with its share of the
    concurrency limit and the pool. Records come back with their global indexes; the run's duration is the
    longest worker's, all having started together."""
    n = config.workers
    share = dataclasses.replace(
        config, workers=1, progress=False,
        max_concurrency=None if config.max_concurrency is None else -(-config.max_concurrency // n),
        max_connections=None if config.max_connections is None else -(-config.max_connections // n))
    start_at = time.time() + WORKER_START_S
    context = multiprocessing.get_context("spawn")  # a fresh interpreter: nothing of this process's loop
    with ProcessPoolExecutor(n, mp_context=context) as pool:
        futures = [pool.submit(_worker, share, model, requests[i::n], offsets[i::n], list(range(i, len(requests), n)),
                               start_at) for i in range(n)]
        results = [f.result() for f in futures]
    records = sorted((r for worker_records, _ in results for r in worker_records), key=lambda r: r.index)
    return records, max(duration for _, duration in results)


def _worker(config: BenchmarkConfig, model: str, requests: list[SampleRequest], offsets: list[float],
            indexes: list[int], start_at: float) -> tuple[list[RequestRecord], float]:
    """One client process: wait for the shared start, drive its requests, renumber their records globally. A
    worker that started after the shared start (a slow machine) counts its lateness into its times."""

    async def run() -> tuple[list[RequestRecord], float, float]:
        async with make_http_client(config) as client:
            await anyio.sleep(max(0.0, start_at - time.time()))
            late = max(0.0, time.time() - start_at)
            return *await _drive(client, config, model, requests, offsets), late

    records, duration, late = anyio.run(run)
    for record in records:
        record.index = indexes[record.index]
        record.start_s += late
    return records, duration + late


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

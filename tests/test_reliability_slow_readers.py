"""Slow readers on the default model: 20 clients reading one chunk per second neither grow the server's memory
nor slow the clients that read at full speed. (tests/test_server_sse.py has the single-reader versions.)

The comparison keeps the engine's load equal: the baseline runs the same 20 requests read at full speed, so the
only difference between the two runs is how fast those 20 clients read."""

from __future__ import annotations

import asyncio
import json
import socket
import statistics
import time
import tracemalloc

from test_reliability_common import MiB, default_model_server, http_pool, rss_bytes, settled_rss, stream_sse
from test_server_harness import host_port, wait_until

NUM_SLOW, NUM_FAST = 20, 16
READ_SECONDS = 3  # each slow reader reads one chunk per second for this long, then leaves
SLOW_BODY = {"prompt": "Now is the winter of our discontent", "max_tokens": 96, "ignore_eos": True, "stream": True}
FAST_BODY = {"prompt": "And the LORD spake unto Moses", "max_tokens": 40, "ignore_eos": True, "stream": True}


async def slow_reader(url: str, body: dict, seconds: int, rcvbuf: int = 4096) -> int:
    """A raw-socket SSE client with a small receive buffer reading 512 bytes per second; returns bytes read."""
    host, port = host_port(url)
    data = json.dumps(body)
    request = (f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
               f"Content-Length: {len(data)}\r\n\r\n{data}").encode()
    loop = asyncio.get_running_loop()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.setblocking(False)
    received = 0
    try:
        await asyncio.wait_for(loop.sock_connect(sock, (host, port)), 10)
        await loop.sock_sendall(sock, request)
        for _ in range(seconds):
            received += len(await asyncio.wait_for(loop.sock_recv(sock, 512), 10))
            await asyncio.sleep(1.0)
    finally:
        sock.close()
    return received


async def fast_itl(client, url: str) -> float:
    """Median gap between content chunks of one full-speed stream (s)."""
    result = await stream_sse(client, url + "/v1/completions", FAST_BODY)
    assert result.status == 200 and result.done and not result.errors
    stamps = result.chunks_at
    return statistics.median(b - a for a, b in zip(stamps, stamps[1:]))


def run_phase(url: str, slow: bool) -> tuple[float, list[int]]:
    """NUM_FAST measured streams next to NUM_SLOW others, read slowly or not; (median ITL, slow bytes read)."""
    async def run():
        async with http_pool(NUM_SLOW + NUM_FAST + 8) as client:
            if slow:
                others = [slow_reader(url, SLOW_BODY, READ_SECONDS) for _ in range(NUM_SLOW)]
            else:
                others = [stream_sse(client, url + "/v1/completions", SLOW_BODY) for _ in range(NUM_SLOW)]
            other_tasks = [asyncio.ensure_future(o) for o in others]
            await asyncio.sleep(0.3)  # the 20 are running before the measured streams start
            itls = await asyncio.wait_for(asyncio.gather(*[fast_itl(client, url) for _ in range(NUM_FAST)]), 60)
            done = await asyncio.wait_for(asyncio.gather(*other_tasks), 60)
            return statistics.median(itls), done

    median, done = asyncio.run(run())
    return median, (done if slow else [])


def test_slow_readers_do_not_slow_fast_clients():
    # Small kernel send buffers: a slow reader's backpressure reaches the app's sends after a few KB.
    with default_model_server(max_model_len=256, num_kv_blocks=512, max_num_seqs=64, sndbuf=8192) as srv:
        async def warm_up():
            async with http_pool(NUM_FAST) as client:
                await asyncio.gather(*[stream_sse(client, srv.url + "/v1/completions", {**FAST_BODY, "max_tokens": 8})
                                       for _ in range(NUM_FAST)])

        asyncio.run(warm_up())
        baseline, _ = run_phase(srv.url, slow=False)
        rss_before = settled_rss()
        with_slow, received = run_phase(srv.url, slow=True)
        rss_after_peak = rss_bytes()
        wait_until(srv.engine_idle, 10)
        grown = settled_rss() - rss_before
    print(f"slow readers: fast ITL {baseline * 1e3:.1f} ms -> {with_slow * 1e3:.1f} ms; "
          f"RSS {grown / MiB:+.1f} MiB settled, {(rss_after_peak - rss_before) / MiB:+.1f} MiB unsettled")
    assert all(0 < r < 8192 for r in received), received  # they really read slowly, and something
    assert with_slow <= 1.5 * baseline + 0.005, (baseline, with_slow)
    assert grown < 32 * MiB, f"RSS grew by {grown / MiB:.1f} MiB"


def test_slow_readers_keep_server_memory_bounded():
    with default_model_server(max_model_len=512, num_kv_blocks=512, max_num_seqs=64, sndbuf=8192) as srv:
        body = {**SLOW_BODY, "max_tokens": 200}  # 20 x 200 token deltas, nearly all unread while they run

        async def readers(seconds: int):
            return await asyncio.wait_for(
                asyncio.gather(*[slow_reader(srv.url, body, seconds) for _ in range(NUM_SLOW)]), 60)

        asyncio.run(readers(1))  # one-time allocations happen here
        wait_until(srv.engine_idle, 10)
        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            start = time.monotonic()
            received = asyncio.run(readers(READ_SECONDS))
            elapsed = time.monotonic() - start
            wait_until(srv.engine_idle, 10)
            current, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
    print(f"slow readers: traced peak +{(peak - before) / MiB:.2f} MiB, after +{(current - before) / MiB:.2f} MiB")
    assert elapsed < READ_SECONDS + 5 and all(r > 0 for r in received)
    assert peak - before < 4 * MiB, f"peak grew by {(peak - before) / MiB:.1f} MiB during the slow reads"
    assert current - before < 1 * MiB, f"{(current - before) / MiB:.1f} MiB left behind"

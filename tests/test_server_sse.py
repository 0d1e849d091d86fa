"""SSE on the wire: exact event shapes, pings, in-band errors, disconnects that abort, slow readers that cost
nothing. Several tests build their own server because they break or slow its engine on purpose."""

from __future__ import annotations

import asyncio
import json
import socket
import statistics
import threading
import time
import tracemalloc

import httpx
import pytest
from test_server_harness import ServerThread, data_events, parse_sse, server, wait_until  # noqa: F401

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "Hi there"}]}


def post_sse(url: str, body: dict, timeout: float = 30) -> list:
    response = httpx.post(url, json=body, timeout=timeout)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/event-stream")
    return parse_sse(response.content)


def test_chat_stream_events_are_openai_shaped(server):  # noqa: F811
    body = {**CHAT, "max_tokens": 6, "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}
    events = data_events(post_sse(server.url + "/v1/chat/completions", body))
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    first, finish, usage = chunks[0], chunks[-2], chunks[-1]
    assert first["choices"] == [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                 "finish_reason": None}]
    assert finish["choices"] == [{"index": 0, "delta": {}, "logprobs": None, "finish_reason": "length"}]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 6
    content = chunks[1:-2]
    assert content and all(set(c["choices"][0]["delta"]) == {"content"} for c in content)
    assert all(c["choices"][0]["finish_reason"] is None and c["usage"] is None for c in content)
    for chunk in chunks:
        assert chunk["object"] == "chat.completion.chunk" and chunk["model"] == "tiny"
        assert chunk["id"] == first["id"] and chunk["id"].startswith("chatcmpl-")
        assert chunk["created"] == first["created"]


def test_completion_stream_events_are_openai_shaped(server):  # noqa: F811
    body = {"model": "tiny", "prompt": "Hello", "max_tokens": 5, "stream": True, "ignore_eos": True}
    events = data_events(post_sse(server.url + "/v1/completions", body))
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["object"] == "text_completion" and "usage" not in c for c in chunks)
    assert chunks[-1]["choices"][0]["text"] == "" and chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])


def test_error_before_streaming_is_a_plain_json_error(server):  # noqa: F811
    response = httpx.post(server.url + "/v1/chat/completions", json={**CHAT, "stream": True, "top_p": 0})
    assert response.status_code == 400 and response.json()["error"]["param"] == "top_p"


def slow_execute(engine, delay: float, fail_after: int | None = None):
    """Wrap the engine's device step (`LLMEngine.run`, formerly `execute`): sleep `delay` s per step; raise after
    `fail_after` steps. Returns the live call count."""
    core = engine.client.engine
    name = "run" if hasattr(core, "run") else "execute"
    original = getattr(core, name)
    calls = {"n": 0}

    def device_step(step):
        calls["n"] += 1
        if fail_after is not None and calls["n"] > fail_after:
            raise RuntimeError("injected device failure")
        time.sleep(delay)
        return original(step)

    setattr(core, name, device_step)
    return calls


def test_idle_stream_gets_ping_comments(llama_dir):
    with ServerThread(llama_dir, app_kwargs={"ping_interval": 0.05}) as srv:
        slow_execute(srv.engine, 0.25)
        body = {"prompt": "Hello", "max_tokens": 2, "stream": True, "ignore_eos": True}
        events = post_sse(srv.url + "/v1/completions", body)
    assert ("comment", "ping") in events
    assert data_events(events)[-1] == "[DONE]" and events[-1] == "[DONE]"


def test_step_failure_sends_error_event_then_done_and_health_turns_503(llama_dir):
    with ServerThread(llama_dir) as srv:
        slow_execute(srv.engine, 0.0, fail_after=5)
        body = {"prompt": "Hello", "max_tokens": 50, "stream": True, "ignore_eos": True}
        events = data_events(post_sse(srv.url + "/v1/completions", body))
        assert events[-1] == "[DONE]"
        error = events[-2]["error"]
        assert error["type"] == "service_unavailable" and "injected device failure" in error["message"]
        assert any(e["choices"][0]["text"] for e in events[:-2]), "some tokens came before the failure"
        health = httpx.get(srv.url + "/health")
        assert health.status_code == 503 and "error" in health.json()
        refused = httpx.post(srv.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
        assert refused.status_code == 503 and refused.json()["error"]["type"] == "service_unavailable"


async def _first_token_then_leave(client: httpx.AsyncClient, url: str, body: dict) -> bool:
    async with client.stream("POST", url, json=body) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                if json.loads(line[6:])["choices"][0]["text"]:
                    return True  # leaving the block closes the connection mid-stream
    return False


def test_burst_of_cancelled_streams_frees_every_request_and_block(llama_dir):
    with ServerThread(llama_dir, max_num_seqs=32) as srv:
        body = {"prompt": "The quick brown fox", "max_tokens": 200, "stream": True, "ignore_eos": True}

        async def burst():
            limits = httpx.Limits(max_connections=100, max_keepalive_connections=0)
            async with httpx.AsyncClient(limits=limits, timeout=60) as client:
                return await asyncio.gather(*[_first_token_then_leave(client, srv.url + "/v1/completions", body)
                                              for _ in range(100)])

        assert all(asyncio.run(burst()))
        wait_until(srv.engine_idle, timeout=5)
        start = time.monotonic()
        response = httpx.post(srv.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 8}, timeout=10)
        assert response.status_code == 200 and time.monotonic() - start < 2.0
        assert srv.engine_idle()


@pytest.mark.parametrize("prompt, n", [("Hello", 1), ("Hello", 3), (["Hello", "Hi", "The quick"], 2)],
                         ids=["single", "n3", "batch"])
def test_disconnect_aborts_within_a_few_steps(llama_dir, prompt, n):
    with ServerThread(llama_dir) as srv:
        calls = slow_execute(srv.engine, 0.02)
        body = {"prompt": prompt, "n": n, "max_tokens": 200, "stream": True, "ignore_eos": True}

        async def leave():
            async with httpx.AsyncClient(timeout=30) as client:
                await _first_token_then_leave(client, srv.url + "/v1/completions", body)

        asyncio.run(leave())
        left_at = calls["n"]
        wait_until(srv.engine_idle, timeout=5)
        assert calls["n"] - left_at <= 3, "the request ran on after its reader left"


def _itl_of_streams(url: str, n: int, max_tokens: int) -> list[float]:
    """Start n streams at once; return each stream's median gap between content chunks."""
    body = {"prompt": "Hello world", "max_tokens": max_tokens, "stream": True, "ignore_eos": True}

    async def one(client):
        stamps = []
        async with client.stream("POST", url + "/v1/completions", json=body) as response:
            async for line in response.aiter_lines():
                if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["text"]:
                    stamps.append(time.perf_counter())
        return statistics.median(b - a for a, b in zip(stamps, stamps[1:]))

    async def run():
        async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=n + 4)) as client:
            return await asyncio.gather(*[one(client) for _ in range(n)])

    return asyncio.run(run())


class SlowReader(threading.Thread):
    """A raw-socket SSE client with a tiny receive buffer that reads one chunk per second, then leaves."""

    def __init__(self, url: str, chunks: int = 3, max_tokens: int = 230, n: int = 1):
        super().__init__(daemon=True)
        host, port = url.removeprefix("http://").split(":")
        self.address = (host, int(port))
        self.chunks = chunks
        body = json.dumps({"prompt": "Hello world", "max_tokens": max_tokens, "stream": True, "ignore_eos": True,
                           "n": n})
        self.request = (f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                        f"Content-Length: {len(body)}\r\n\r\n{body}").encode()
        self.received = 0
        self.started = threading.Event()

    def run(self) -> None:
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(self.address)
        sock.sendall(self.request)
        self.started.set()
        for _ in range(self.chunks):
            self.received += len(sock.recv(512))
            time.sleep(1.0)
        sock.close()


def test_slow_reader_neither_slows_others_nor_holds_the_engine(llama_dir):
    # Small kernel send buffers, so the slow reader's backpressure reaches the app's sends within ~100 KB.
    with ServerThread(llama_dir, max_num_seqs=64, sndbuf=8192) as srv:
        _itl_of_streams(srv.url, 4, 8)  # warm up
        baseline = statistics.median(_itl_of_streams(srv.url, 32, 48))
        reader = SlowReader(srv.url, chunks=6, max_tokens=230, n=8)
        reader.start()
        reader.started.wait(5)
        with_slow = statistics.median(_itl_of_streams(srv.url, 32, 48))
        wait_until(srv.engine_idle, timeout=5)  # the slow request finished and freed its blocks ...
        assert reader.is_alive()  # ... while its reader had read only a few KB
        reader.join(15)
        assert reader.received > 0
    assert with_slow <= 3 * baseline + 0.02, (baseline, with_slow)


def test_slow_reader_keeps_server_memory_flat(llama_dir):
    with ServerThread(llama_dir, max_num_seqs=64, sndbuf=8192) as srv:
        warm = SlowReader(srv.url, chunks=1, max_tokens=230, n=32)  # one-time allocations happen here
        warm.start()
        warm.join(15)
        wait_until(srv.engine_idle, timeout=5)
        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            reader = SlowReader(srv.url, chunks=3, max_tokens=230, n=32)  # ~7,000 token deltas unread
            reader.start()
            reader.join(15)
            wait_until(srv.engine_idle, timeout=5)
            current, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
    print(f"slow reader: peak +{(peak - before) / 2**20:.2f} MiB, after +{(current - before) / 2**20:.2f} MiB")
    assert peak - before < 2 * 2**20, f"peak grew by {(peak - before) / 2**20:.1f} MiB during a slow read"
    assert current - before < 1 * 2**20, f"{(current - before) / 2**20:.1f} MiB left behind"


def test_non_streamed_request_is_aborted_when_the_client_leaves(llama_dir):
    with ServerThread(llama_dir) as srv:
        slow_execute(srv.engine, 0.02)
        body = {"prompt": "Hello", "max_tokens": 200, "ignore_eos": True}
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(srv.url + "/v1/completions", json=body, timeout=0.3)
        wait_until(srv.engine_idle, timeout=5)

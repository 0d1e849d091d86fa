"""The harness the server tests share: a real hypercorn server in a background thread, plus SSE helpers.

`ServerThread` runs `create_app(AsyncLLMEngine(...))` under hypercorn on uvloop, on 127.0.0.1 with an ephemeral
port, in a thread with its own event loop (the engine's step loop runs there too). `on_loop(fn)` runs a function
on that loop, for reading engine state consistently from the test thread. The tests at the bottom check the
harness itself and the simple GET routes.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from typing import Callable, Optional

import httpx
import pytest
import uvloop

from asyncengine.api import create_app
from asyncengine.api.cli import bind_socket, serve_app, url_of
from asyncengine.async_engine import AsyncLLMEngine
from asyncengine.config import EngineConfig

MAX_MODEL_LEN = 256
NUM_KV_BLOCKS = 512


class ServerThread:
    """A real server on an ephemeral port; `with ServerThread(...) as server:` starts and stops it."""

    def __init__(self, model: str, app_kwargs: Optional[dict] = None, sndbuf: Optional[int] = None,
                 **engine_kwargs):
        engine_kwargs.setdefault("max_model_len", MAX_MODEL_LEN)
        engine_kwargs.setdefault("num_kv_blocks", NUM_KV_BLOCKS)
        self.engine = AsyncLLMEngine(EngineConfig(model=str(model), **engine_kwargs))
        self.app = create_app(self.engine, **(app_kwargs or {}))
        self.sock = bind_socket("127.0.0.1", 0)
        if sndbuf is not None:  # accepted sockets inherit it: a small one makes slow readers block the app's sends
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, sndbuf)
        self.url = url_of(self.sock)
        self.loop: Optional[asyncio.AbstractEventLoop] = None
        self._stop: Optional[asyncio.Event] = None
        self._thread: Optional[threading.Thread] = None
        self.error: Optional[BaseException] = None

    def start(self, shutdown_timeout: float = 5.0) -> "ServerThread":
        ready = threading.Event()

        async def main() -> None:
            self.loop = asyncio.get_running_loop()
            self._stop = asyncio.Event()
            ready.set()
            try:
                await serve_app(self.app, self.sock, self._stop, shutdown_timeout=shutdown_timeout)
            finally:
                await self.engine.shutdown()

        def run() -> None:
            try:
                uvloop.run(main())
            except BaseException as exc:  # noqa: BLE001 - reported by stop()
                self.error = exc

        self._thread = threading.Thread(target=run, name="test-server", daemon=True)
        self._thread.start()
        assert ready.wait(10), "server loop did not start"
        wait_until(lambda: httpx.get(self.url + "/health", timeout=2).status_code in (200, 401), 10)
        return self

    def stop(self, timeout: float = 15.0) -> None:
        if self._thread is None or not self._thread.is_alive():
            return
        self.loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout)
        assert not self._thread.is_alive(), "server thread did not stop"
        assert self.error is None, self.error

    def on_loop(self, fn: Callable, timeout: float = 10.0):
        """Run fn() on the server's loop thread and return its result."""
        async def call():
            return fn()

        return asyncio.run_coroutine_threadsafe(call(), self.loop).result(timeout)

    def engine_idle(self) -> bool:
        """No request left anywhere in the engine, and every KV block free."""
        def check():
            stats = self.engine.stats()  # an engine process's: its last snapshot
            return (self.engine.num_unfinished_requests == 0 and not self.engine.client.has_unfinished_requests()
                    and stats.num_running == 0 and stats.num_waiting == 0 and stats.kv_cache_usage == 0)

        return self.on_loop(check)

    def __enter__(self) -> "ServerThread":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def host_port(url: str) -> tuple[str, int]:
    """(host, port) of an http://HOST:PORT url, for tests that talk raw sockets to the server."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    return host, int(port)


def wait_until(predicate: Callable[[], bool], timeout: float, interval: float = 0.02) -> None:
    deadline = time.monotonic() + timeout
    last_error: Optional[BaseException] = None
    while time.monotonic() < deadline:
        try:
            if predicate():
                return
        except (httpx.HTTPError, OSError) as exc:
            last_error = exc
        time.sleep(interval)
    raise AssertionError(f"condition not met within {timeout} s (last error: {last_error!r})")


def parse_sse(raw: bytes) -> list:
    """Events of an SSE body: parsed JSON objects, the string "[DONE]", or ("comment", text) for `: ...` lines."""
    events = []
    text = raw.decode("utf-8")
    assert text.endswith("\n\n"), f"SSE body must end with a blank line: {text[-80:]!r}"
    for block in text.split("\n\n")[:-1]:
        assert block, "empty SSE event"
        if block.startswith(":"):
            events.append(("comment", block[1:].strip()))
            continue
        assert block.startswith("data: ") and "\n" not in block, f"unexpected SSE event {block[:120]!r}"
        payload = block[len("data: "):]
        events.append("[DONE]" if payload == "[DONE]" else json.loads(payload))
    return events


def data_events(events: list) -> list:
    return [e for e in events if not (isinstance(e, tuple) and e[0] == "comment")]


def ws_collect(ws, ids, timeout: float = 30) -> dict:
    """Read WebSocket messages until every id in `ids` got its "done"; returns id -> list of its messages
    (errors included, "done" last). Messages for other ids (or none) go under their own key."""
    pending, by_id = set(ids), {}
    deadline = time.monotonic() + timeout
    while pending:
        message = json.loads(ws.recv(timeout=max(deadline - time.monotonic(), 0.01)))
        by_id.setdefault(message.get("id"), []).append(message)
        if message.get("type") == "done":
            pending.discard(message["id"])
    return by_id


@pytest.fixture(scope="module")
def server(llama_dir):
    with ServerThread(llama_dir, app_kwargs={"served_model_name": ["tiny", "tiny-alias"]}) as srv:
        yield srv


# -- tests of the harness and the simple routes ---------------------------------------------------------------
def test_health_is_200_with_an_empty_body(server):
    response = httpx.get(server.url + "/health")
    assert response.status_code == 200 and response.content == b""


def test_version_and_models_list_the_served_names(server):
    import asyncengine

    assert httpx.get(server.url + "/version").json() == {"version": asyncengine.__version__}
    models = httpx.get(server.url + "/v1/models").json()
    assert models["object"] == "list"
    assert [m["id"] for m in models["data"]] == ["tiny", "tiny-alias"]
    assert all(m["object"] == "model" and m["max_model_len"] == MAX_MODEL_LEN for m in models["data"])


def test_alias_model_name_is_accepted_and_echoed(server):
    body = {"model": "tiny-alias", "prompt": "Hello", "max_tokens": 2}
    response = httpx.post(server.url + "/v1/completions", json=body, timeout=30)
    assert response.status_code == 200 and response.json()["model"] == "tiny-alias"

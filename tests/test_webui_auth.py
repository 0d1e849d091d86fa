"""WebSocket authentication by subprotocol (`asyncengine.v1, bearer.<key>`), the Origin check, and the chat page's
routes, against a real hypercorn server with real WebSocket handshakes."""

from __future__ import annotations

import asyncio
import json
import logging
import socket

import httpx
import pytest
import websockets
import websockets.sync.client as ws_client
from test_server_harness import MAX_MODEL_LEN, ServerThread, ws_collect

from asyncengine.api import create_app
from asyncengine.api.auth import APIKeyMiddleware, WebSocketOriginMiddleware
from asyncengine.api.cli import build_parser
from asyncengine.async_engine import AsyncLLMEngine
from asyncengine.config import EngineConfig

KEY = "s3cret-Key_1"
ALLOWED = "https://chat.example"


@pytest.fixture(scope="module")
def server(llama_dir):
    with ServerThread(llama_dir, app_kwargs={"api_key": KEY, "allowed_origins": [ALLOWED, "http://localhost:8000"]}
                      ) as srv:
        yield srv


def ws_url(srv) -> str:
    return srv.url.replace("http://", "ws://") + "/v1/ws"


def connect(srv, subprotocols=None, key_header=None, origin=None):
    headers = {"Authorization": f"Bearer {key_header}"} if key_header is not None else None
    return ws_client.connect(ws_url(srv), open_timeout=5, subprotocols=subprotocols, additional_headers=headers,
                             origin=origin)


def refusal(srv, **kwargs) -> tuple[int, dict]:
    with pytest.raises(websockets.exceptions.InvalidStatus) as info:
        connect(srv, **kwargs)
    response = info.value.response
    return response.status_code, json.loads(response.body)["error"]


def assert_serves(ws) -> None:
    ws.send(json.dumps({"id": 1, "prompt": "Hi", "max_tokens": 2}))
    assert ws_collect(ws, [1])[1][-1] == {"id": 1, "type": "done"}


def test_the_right_key_as_subprotocol_opens_the_socket_and_the_server_answers_asyncengine_v1(server, caplog):
    caplog.set_level(logging.DEBUG)
    with connect(server, subprotocols=["asyncengine.v1", f"bearer.{KEY}"]) as ws:
        assert ws.subprotocol == "asyncengine.v1"
        assert ws.response.headers.get_all("Sec-WebSocket-Protocol") == ["asyncengine.v1"]
        assert_serves(ws)
    # a client that offers only the key gets no subprotocol back: the key is never echoed
    with connect(server, subprotocols=[f"bearer.{KEY}"]) as ws:
        assert ws.subprotocol is None and "Sec-WebSocket-Protocol" not in ws.response.headers
        assert_serves(ws)
    status, _ = refusal(server, subprotocols=["asyncengine.v1", "bearer.wrong"])
    assert status == 401
    server_logs = "\n".join(r.getMessage() for r in caplog.records if not r.name.startswith("websockets.client"))
    assert KEY not in server_logs and "bearer.wrong" not in server_logs  # the server never logs a key, at any level


def test_a_wrong_key_or_no_key_is_refused_with_401(server):
    for subprotocols in (["asyncengine.v1", "bearer.wrong"], ["asyncengine.v1", f"bearer.{KEY}x"],
                         ["asyncengine.v1", "bearer."], ["asyncengine.v1"], None):
        status, error = refusal(server, subprotocols=subprotocols)
        assert (status, error["code"]) == (401, "invalid_api_key"), subprotocols
        assert "bearer.<key>" in error["message"]


def test_a_key_in_both_places_must_be_right_in_both(server):
    with connect(server, subprotocols=["asyncengine.v1", f"bearer.{KEY}"], key_header=KEY) as ws:
        assert ws.subprotocol == "asyncengine.v1"
        assert_serves(ws)
    assert refusal(server, subprotocols=["asyncengine.v1", "bearer.wrong"], key_header=KEY)[0] == 401
    assert refusal(server, subprotocols=["asyncengine.v1", f"bearer.{KEY}"], key_header="wrong")[0] == 401
    assert refusal(server, subprotocols=["asyncengine.v1", f"bearer.{KEY}", "bearer.wrong"])[0] == 401


def test_the_origin_must_be_allowed_when_allowed_origins_is_set(server):
    right = {"subprotocols": ["asyncengine.v1", f"bearer.{KEY}"]}
    same_origin = server.url  # the server's own page (the Host header names the same host and port)
    for origin in (ALLOWED, "HTTPS://Chat.Example/", "http://localhost:8000", same_origin, None):  # None: no browser
        with connect(server, origin=origin, **right) as ws:
            assert_serves(ws)
    for origin in ("https://evil.example", "http://localhost:8001", "https://chat.example.evil", "null",
                   server.url.replace("127.0.0.1", "127.0.0.2")):
        status, error = refusal(server, origin=origin, **right)
        assert (status, error["code"]) == (403, "origin_not_allowed"), origin
    # checked before the key: a page from another origin learns nothing about keys
    assert refusal(server, origin="https://evil.example", subprotocols=["asyncengine.v1", "bearer.wrong"])[0] == 403
    # plain HTTP is CORS's business, not this check's
    headers = {"Authorization": f"Bearer {KEY}", "Origin": "https://evil.example"}
    assert httpx.get(server.url + "/v1/models", headers=headers).status_code == 200


def origin_verdict(allowed, origin) -> str:
    """Run WebSocketOriginMiddleware on a hand-written handshake: "app" if it let it through, else the status."""
    async def run() -> str:
        async def app(scope, receive, send):
            verdict.append("app")

        async def receive():
            return {"type": "websocket.connect"}

        async def send(message):
            if message["type"] == "websocket.http.response.start":
                verdict.append(message["status"])

        verdict: list = []
        headers = [(b"host", b"x")] + ([(b"origin", origin.encode())] if origin else [])
        scope = {"type": "websocket", "path": "/v1/ws", "headers": headers,
                 "extensions": {"websocket.http.response": {}}}
        await WebSocketOriginMiddleware(app, allowed)(scope, receive, send)
        return verdict[0]

    return asyncio.run(run())


def test_origin_check_is_off_without_allowed_origins_and_star_allows_all():
    assert origin_verdict(None, "https://any.example") == "app"
    assert origin_verdict(["*"], "https://any.example") == "app"
    assert origin_verdict([], "https://any.example") == 403
    assert origin_verdict([], None) == "app"
    assert origin_verdict([], "http://x") == "app"  # same origin: its Host header is "x"


def test_the_app_never_sees_the_key_from_the_subprotocol():
    seen = []

    async def app(scope, receive, send):
        seen.append(scope)

    async def run(api_key):
        scope = {"type": "websocket", "path": "/v1/ws", "subprotocols": ["asyncengine.v1", f"bearer.{KEY}"],
                 "headers": [(b"host", b"x"), (b"sec-websocket-protocol", f"asyncengine.v1, bearer.{KEY}".encode())]}
        await APIKeyMiddleware(app, api_key)(scope, None, None)

    for api_key in (KEY, None):  # stripped whether or not the server checks keys
        asyncio.run(run(api_key))
    assert len(seen) == 2
    for scope in seen:
        assert scope["subprotocols"] == ["asyncengine.v1"] and KEY not in repr(scope)
        assert (b"sec-websocket-protocol", b"asyncengine.v1") in scope["headers"]


def test_the_chat_page_loads_without_a_key_and_everything_else_still_needs_one(server):
    page = httpx.get(server.url + "/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "default-src 'self'" in page.headers["content-security-policy"]
    for asset, kind in (("/ui/chat.js", "javascript"), ("/ui/chat.css", "text/css")):
        response = httpx.get(server.url + asset)
        assert response.status_code == 200 and kind in response.headers["content-type"], asset
        assert f'"{asset[1:]}"' in page.text  # the page links it relatively (works under a mount prefix too)
    for sneaky in ("/ui/../v1/models", "/ui/%2e%2e/v1/models", "/ui/../auth.py"):  # the key-free prefix leads
        assert raw_get_status(server, sneaky) == 404, sneaky  # only to the page's own files
    assert httpx.get(server.url + "/v1/models").status_code == 401
    assert httpx.get(server.url + "/metrics").status_code == 401


def raw_get_status(srv, path: str) -> int:
    """GET `path` exactly as written (httpx would normalize the dots away)."""
    host, port = srv.url.split("://")[1].split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(f"GET {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode())
        return int(sock.recv(100).split()[1])


def test_no_ui_leaves_the_page_out(llama_dir):
    assert build_parser().parse_args(["serve", "--no-ui"]).no_ui is True
    assert build_parser().parse_args(["serve"]).no_ui is False

    async def run() -> tuple[int, int]:
        engine = AsyncLLMEngine(EngineConfig(model=str(llama_dir), max_model_len=MAX_MODEL_LEN, num_kv_blocks=64))
        transport = httpx.ASGITransport(app=create_app(engine, ui=False))
        try:
            async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
                return (await client.get("/")).status_code, (await client.get("/ui/chat.js")).status_code
        finally:
            await engine.shutdown()

    assert asyncio.run(run()) == (404, 404)

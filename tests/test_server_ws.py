"""/v1/ws with a real WebSocket client: concurrent requests tagged by id, cancel, per-request errors, close."""

from __future__ import annotations

import json

import httpx
import pytest
import websockets.sync.client as ws_client
from test_server_harness import ServerThread, server, wait_until, ws_collect  # noqa: F401
from test_server_sse import slow_execute

CHAT = {"messages": [{"role": "user", "content": "Tell me a story"}]}


def ws_url(srv) -> str:
    return srv.url.replace("http://", "ws://") + "/v1/ws"


def text_of(messages: list) -> str:
    out = ""
    for m in messages:
        for choice in m.get("choices", []):
            out += choice.get("text") or choice.get("delta", {}).get("content") or ""
    return out


def test_concurrent_requests_on_one_socket_are_tagged_by_id(server):  # noqa: F811
    greedy = {"temperature": 0, "max_tokens": 8}
    http_chat = httpx.post(server.url + "/v1/chat/completions", json={**CHAT, **greedy}, timeout=30).json()
    http_text = httpx.post(server.url + "/v1/completions", json={"prompt": "Hello", **greedy}, timeout=30).json()
    with ws_client.connect(ws_url(server), open_timeout=5) as ws:
        ws.send(json.dumps({"id": "chat-1", "type": "chat.completion", **CHAT, **greedy}))
        ws.send(json.dumps({"id": 2, "type": "completion", "prompt": "Hello", **greedy}))
        ws.send(json.dumps({"id": "routed", **CHAT, **greedy, "stream_options": {"include_usage": True}}))
        got = ws_collect(ws, ["chat-1", 2, "routed"])
    assert set(got) == {"chat-1", 2, "routed"}
    for key in ("chat-1", "routed"):
        chunks, done = got[key][:-1], got[key][-1]
        assert done == {"id": key, "type": "done"}
        assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        assert all(c["id"] == key and c["object"] == "chat.completion.chunk" for c in chunks)
        assert text_of(chunks) == http_chat["choices"][0]["message"]["content"]
    assert got["routed"][-2]["choices"] == [] and got["routed"][-2]["usage"]["completion_tokens"] > 0
    assert got["chat-1"][-2]["choices"][0]["finish_reason"] is not None
    assert all(c["object"] == "text_completion" for c in got[2][:-1])
    assert text_of(got[2][:-1]) == http_text["choices"][0]["text"]


def test_cancel_ends_one_request_with_abort(llama_dir):
    with ServerThread(llama_dir) as srv:
        slow_execute(srv.engine, 0.01)
        with ws_client.connect(ws_url(srv), open_timeout=5) as ws:
            ws.send(json.dumps({"id": "long", "prompt": "Hello", "max_tokens": 200, "ignore_eos": True}))
            ws.send(json.dumps({"id": "short", "prompt": "Hello", "max_tokens": 3, "ignore_eos": True}))
            first = json.loads(ws.recv(timeout=10))
            assert first["id"] in ("long", "short")
            ws.send(json.dumps({"type": "cancel", "id": "long"}))
            got = ws_collect(ws, ["long", "short"])
        finishes = [c["choices"][0]["finish_reason"] for c in got["long"][:-1] if c["choices"][0]["finish_reason"]]
        assert finishes == ["abort"]
        assert got["short"][-2]["choices"][0]["finish_reason"] == "length"
        wait_until(srv.engine_idle, 5)


def test_errors_go_to_their_request_and_the_socket_stays_open(server):  # noqa: F811
    with ws_client.connect(ws_url(server), open_timeout=5) as ws:
        ws.send("this is not json")
        error = json.loads(ws.recv(timeout=10))
        assert error["id"] is None and error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
        ws.send(json.dumps({"id": "bad", "prompt": "Hi", "top_p": 5}))
        bad = ws_collect(ws, ["bad"])["bad"]
        assert bad[0]["error"]["param"] == "top_p" and bad[-1] == {"id": "bad", "type": "done"}
        ws.send(json.dumps({"id": "m", "model": "nope", "prompt": "Hi"}))
        assert ws_collect(ws, ["m"])["m"][0]["error"]["code"] == "model_not_found"
        ws.send(json.dumps({"prompt": "no id"}))
        assert json.loads(ws.recv(timeout=10))["error"]["param"] == "id"
        ws.send(json.dumps({"id": "t", "type": "embedding", "prompt": "Hi"}))
        assert json.loads(ws.recv(timeout=10))["error"]["param"] == "type"
        ws.send(json.dumps({"id": "ok", "prompt": "Hi", "max_tokens": 3}))
        ok = ws_collect(ws, ["ok"])["ok"]
        assert "error" not in ok[0] and ok[-1]["type"] == "done"


def test_duplicate_in_flight_id_is_refused(llama_dir):
    with ServerThread(llama_dir) as srv:
        slow_execute(srv.engine, 0.01)
        with ws_client.connect(ws_url(srv), open_timeout=5) as ws:
            ws.send(json.dumps({"id": 7, "prompt": "Hi", "max_tokens": 30, "ignore_eos": True}))
            ws.send(json.dumps({"id": 7, "prompt": "Hi", "max_tokens": 3}))
            got = ws_collect(ws, [7])
        errors = [m for m in got[7] if m.get("type") == "error"]
        assert len(errors) == 1 and errors[0]["error"]["param"] == "id"
        assert got[7][-2]["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("requests", [1, 4])
def test_closing_the_socket_aborts_everything_it_started(llama_dir, requests):
    with ServerThread(llama_dir) as srv:
        calls = slow_execute(srv.engine, 0.01)
        with ws_client.connect(ws_url(srv), open_timeout=5) as ws:
            for i in range(requests):
                ws.send(json.dumps({"id": i, "prompt": "Hello", "max_tokens": 200, "ignore_eos": True}))
            json.loads(ws.recv(timeout=10))
            wait_until(lambda: srv.engine.stats().num_running == requests, 5)
        closed_at = calls["n"]
        wait_until(srv.engine_idle, 5)
        assert calls["n"] - closed_at <= 5

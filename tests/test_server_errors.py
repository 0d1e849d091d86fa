"""Every client mistake gets its status and OpenAI's error envelope, never a 500."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
import websockets.exceptions
import websockets.sync.client as ws_client
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_server_harness import MAX_MODEL_LEN, ServerThread, server, wait_until, ws_collect  # noqa: F401
from test_server_sse import slow_execute

CHAT = {"messages": [{"role": "user", "content": "Hi"}]}


def assert_error(response: httpx.Response, status: int, param=None, code=None) -> dict:
    assert response.status_code == status, (response.status_code, response.text)
    assert response.headers["content-type"].startswith("application/json")
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    error = body["error"]
    assert isinstance(error["message"], str) and 0 < len(error["message"]) <= 500
    if param is not None:
        assert error["param"] == param, error
    if code is not None:
        assert error["code"] == code, error
    return error


def post(server, path: str, body, **kwargs) -> httpx.Response:  # noqa: F811
    if isinstance(body, (bytes, str)):
        return httpx.post(server.url + path, content=body, headers={"content-type": "application/json"},
                          timeout=30, **kwargs)
    return httpx.post(server.url + path, json=body, timeout=30, **kwargs)


@pytest.mark.parametrize("body, param", [
    ({"prompt": "Hi", "max_tokens": "3"}, "max_tokens"),
    ({"prompt": "Hi", "max_tokens": True}, "max_tokens"),
    ({"prompt": 5}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": ["a", [1, 2]]}, "prompt"),
    ({"prompt": [[]]}, "prompt"),
    ({"prompt": [10**9]}, "prompt"),
    ({}, None),
    ({"prompt": "Hi", "top_p": 0}, "top_p"),
    ({"prompt": "Hi", "temperature": -1}, "temperature"),
    ({"prompt": "Hi", "n": 0}, "n"),
    ({"prompt": "Hi", "top_k": -3}, "top_k"),
    ({"prompt": "Hi", "logprobs": 50}, "logprobs"),
    ({"prompt": "Hi", "logit_bias": {"x": 1}}, "logit_bias"),
    ({"prompt": "Hi", "logit_bias": {"5": 500}}, "logit_bias"),
    ({"prompt": "Hi", "logit_bias": {"999999": 1}}, "logit_bias"),
    ({"prompt": "Hi", "stop": [""]}, "stop"),
    ({"prompt": "Hi", "stop_token_ids": [-1]}, "stop_token_ids"),
    ({"prompt": "Hi", "min_tokens": 9, "max_tokens": 3}, "min_tokens"),
    ({"prompt": "Hi", "seed": 2**70}, "seed"),
    ({"prompt": "Hi", "stream_options": {"include_usage": "yes"}}, "stream_options"),
    ({"prompt": "Hi", "best_of": 3}, "best_of"),
    ({"prompt": "Hi", "echo": True, "logprobs": 1}, "echo"),
], ids=lambda v: None if isinstance(v, dict) else str(v))
def test_invalid_completion_parameters_are_400_naming_the_field(server, body, param):  # noqa: F811
    assert_error(post(server, "/v1/completions", body), 400, param=param)


@pytest.mark.parametrize("body, param", [
    ({"messages": []}, "messages"),
    ({"messages": "hello"}, "messages"),
    ({"messages": [{"content": "no role"}]}, "messages"),
    ({**CHAT, "top_logprobs": 2}, "top_logprobs"),
    ({**CHAT, "logprobs": True, "top_logprobs": 30}, "top_logprobs"),
    ({**CHAT, "max_completion_tokens": 0}, "max_completion_tokens"),
    ({**CHAT, "max_tokens": 0}, "max_tokens"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages"),
    ({**CHAT, "chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs"),
], ids=lambda v: None if isinstance(v, dict) else str(v))
def test_invalid_chat_parameters_are_400_naming_the_field(server, body, param):  # noqa: F811
    assert_error(post(server, "/v1/chat/completions", body), 400, param=param)


def test_prompt_plus_max_tokens_beyond_max_model_len_states_the_numbers(server):  # noqa: F811
    prompt = [5, 6, 7]
    error = assert_error(post(server, "/v1/completions", {"prompt": prompt, "max_tokens": MAX_MODEL_LEN}),
                         400, param="max_tokens")
    assert f"({MAX_MODEL_LEN})" in error["message"] and str(MAX_MODEL_LEN + len(prompt)) in error["message"]
    error = assert_error(post(server, "/v1/chat/completions", {**CHAT, "max_completion_tokens": 10_000}), 400,
                         param="max_completion_tokens")
    assert "10000" in error["message"]
    error = assert_error(post(server, "/v1/completions", {"prompt": [5] * MAX_MODEL_LEN}), 400, param="prompt")
    assert str(MAX_MODEL_LEN) in error["message"]


@pytest.mark.parametrize("raw", [b"{", b"not json", b"", b"[1, 2]", b'{"prompt": "\xff\xfe"}', b'"str"',
                                 b'{"prompt": "\\ud800"}', b"\x00" * 10])
def test_invalid_json_and_utf8_are_400(server, raw):  # noqa: F811
    assert_error(post(server, "/v1/completions", raw), 400)


def test_unknown_fields_are_ignored(server):  # noqa: F811
    body = {"prompt": "Hi", "max_tokens": 2, "frobnicate": {"deep": [1, 2]}, "tools": [], "service_tier": "auto"}
    assert post(server, "/v1/completions", body).status_code == 200
    assert post(server, "/v1/chat/completions", {**CHAT, "max_tokens": 2, "parallel_tool_calls": False,
                                                 "response_format": {"type": "text"}}).status_code == 200


def test_unknown_model_route_and_method(server):  # noqa: F811
    assert_error(post(server, "/v1/completions", {"model": "gpt-4", "prompt": "Hi"}), 404, param="model",
                 code="model_not_found")
    assert_error(post(server, "/v1/chat/completions", {**CHAT, "model": "gpt-4"}), 404, param="model")
    assert_error(post(server, "/tokenize", {"model": "gpt-4", "prompt": "Hi"}), 404, param="model")
    assert_error(httpx.get(server.url + "/v1/nothing-here"), 404)
    assert_error(httpx.get(server.url + "/v1/completions"), 405)


def test_validation_messages_are_capped(server):  # noqa: F811
    error = assert_error(post(server, "/v1/completions", {"prompt": "Hi", "model": "m" * 5000}), 404)
    assert len(error["message"]) <= 500
    error = assert_error(post(server, "/v1/completions", {"prompt": "Hi", "stop": ["x" * 4000] * 20}), 400)
    assert len(error["message"]) <= 500


def test_oversized_bodies_are_413_by_header_and_by_counting(llama_dir):
    with ServerThread(llama_dir, app_kwargs={"max_body_bytes": 1024}) as srv:
        big = json.dumps({"prompt": "x" * 2000}).encode()
        assert_error(post(srv, "/v1/completions", big), 413)

        def chunks():  # no Content-Length: chunked transfer encoding
            for _ in range(8):
                yield b" " * 300
            yield big

        response = httpx.post(srv.url + "/v1/completions", content=chunks(), timeout=30)
        assert "content-length" not in response.request.headers
        assert_error(response, 413)
        assert post(srv, "/v1/completions", {"prompt": "Hi", "max_tokens": 2}).status_code == 200


def test_full_queue_is_429_at_once(llama_dir):
    with ServerThread(llama_dir, max_num_seqs=1, max_queue_len=1) as srv:
        slow_execute(srv.engine, 0.02)
        body = {"prompt": "Hello", "max_tokens": 100, "ignore_eos": True, "stream": True}
        with httpx.Client(timeout=30) as c1, httpx.Client(timeout=30) as c2:
            with c1.stream("POST", srv.url + "/v1/completions", json=body) as running:
                wait_until(lambda: srv.engine.stats().num_running == 1, 5)
                with c2.stream("POST", srv.url + "/v1/completions", json=body) as waiting:
                    wait_until(lambda: srv.engine.stats().num_waiting == 1, 5)
                    start = time.monotonic()
                    refused = post(srv, "/v1/completions", {"prompt": "Hi", "max_tokens": 2})
                    assert time.monotonic() - start < 1.0
                    assert_error(refused, 429, code="queue_full")
                    assert running.status_code == waiting.status_code == 200
        wait_until(srv.engine_idle, 5)


def test_api_key_is_required_everywhere_but_health(llama_dir):
    with ServerThread(llama_dir, app_kwargs={"api_key": "s3cret"}) as srv:
        good = {"Authorization": "Bearer s3cret"}
        assert httpx.get(srv.url + "/health").status_code == 200
        for path in ("/v1/models", "/metrics", "/version", "/openapi.json"):
            assert_error(httpx.get(srv.url + path), 401, code="invalid_api_key")
            assert_error(httpx.get(srv.url + path, headers={"Authorization": "Bearer wrong"}), 401)
            assert httpx.get(srv.url + path, headers=good).status_code == 200
        assert_error(post(srv, "/v1/completions", {"prompt": "Hi"}), 401)
        assert_error(post(srv, "/v1/completions", {"prompt": "Hi"}, headers={"Authorization": "s3cret"}), 401)
        assert post(srv, "/v1/completions", {"prompt": "Hi", "max_tokens": 2}, headers=good).status_code == 200

        ws_url = srv.url.replace("http://", "ws://") + "/v1/ws"
        with pytest.raises(websockets.exceptions.InvalidStatus) as info:
            ws_client.connect(ws_url, open_timeout=5)
        assert info.value.response.status_code == 401
        with pytest.raises(websockets.exceptions.InvalidStatus):
            ws_client.connect(ws_url + "?api_key=wrong", open_timeout=5)
        for kwargs in ({"additional_headers": good}, {}):
            url = ws_url if kwargs else ws_url + "?api_key=s3cret"
            with ws_client.connect(url, open_timeout=5, **kwargs) as ws:
                ws.send(json.dumps({"id": 1, "prompt": "Hi", "max_tokens": 2}))
                messages = ws_collect(ws, [1])[1]
                assert messages[-1] == {"id": 1, "type": "done"} and len(messages) >= 3


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-2**66, 2**66) | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=8,
)
FIELDS = ["prompt", "messages", "max_tokens", "max_completion_tokens", "n", "temperature", "top_p", "top_k",
          "min_p", "stop", "seed", "logit_bias", "logprobs", "top_logprobs", "stream", "stream_options", "echo",
          "min_tokens", "stop_token_ids", "repetition_penalty", "ignore_eos", "model", "presence_penalty"]


@settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(path=st.sampled_from(["/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"]),
       body=st.dictionaries(st.sampled_from(FIELDS), JSON_VALUES, max_size=6),
       prompt=st.one_of(st.text(max_size=30), st.lists(st.integers(-5, 500), max_size=8)))
def test_fuzzed_bodies_never_get_a_500(server, path, body, prompt):  # noqa: F811
    body = {"prompt": prompt, **body}
    for key, short in (("max_tokens", 4), ("max_completion_tokens", 4), ("n", 2)):
        if isinstance(body.get(key), int) and body[key] > short:
            body[key] = short  # keep accepted requests short
    response = post(server, path, body)
    assert response.status_code in (200, 400, 404, 413, 429), response.text
    if response.status_code != 200:
        assert_error(response, response.status_code)


def test_app_mounts_under_a_prefix_with_auth(llama_dir):
    from starlette.applications import Starlette
    from starlette.routing import Mount

    from asyncengine.api import create_app
    from asyncengine.async_engine import AsyncLLMEngine
    from asyncengine.config import EngineConfig

    async def run():
        engine = AsyncLLMEngine(EngineConfig(model=str(llama_dir), max_model_len=MAX_MODEL_LEN, num_kv_blocks=64))
        outer = Starlette(routes=[Mount("/llm", app=create_app(engine, api_key="k"))])
        transport = httpx.ASGITransport(app=outer)
        try:
            async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
                assert (await client.get("/llm/health")).status_code == 200
                assert (await client.get("/llm/v1/models")).status_code == 401
                body = {"prompt": "Hi", "max_tokens": 3}
                response = await client.post("/llm/v1/completions", json=body, headers={"Authorization": "Bearer k"})
                assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 3
        finally:
            await engine.shutdown()

    asyncio.run(run())

"""Structured outputs over the OpenAI API, on a real server with the default model: response_format json_object
and json_schema on chat and completions, vLLM's structured_outputs extra body (json, regex, choice, grammar), the
official client's `chat.completions.parse`, and a 400 naming the field for every bad constraint."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pydantic
import pytest
from test_server_errors import assert_error
from test_server_harness import ServerThread

from asyncengine import default_model_path

SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 10},
        "act": {"type": "integer", "minimum": 1, "maximum": 5},
        "score": {"type": "number", "minimum": 0, "maximum": 10},
        "mood": {"enum": ["comic", "tragic", "historic"]},
        "cast": {
            "type": "array",
            "maxItems": 3,
            "items": {
                "type": "object",
                "properties": {"name": {"type": "string", "maxLength": 6}, "lines": {"type": "integer",
                                                                                     "minimum": 0, "maximum": 99}},
                "required": ["name", "lines"],
                "additionalProperties": False,
            },
        },
    },
    "required": ["title", "act", "score", "mood", "cast"],
    "additionalProperties": False,
}
CHAT = [{"role": "user", "content": "Describe a play as JSON."}]


@pytest.fixture(scope="module")
def server():
    with ServerThread(default_model_path(), app_kwargs={"served_model_name": ["default"]}) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=120)


def json_schema_format(schema: dict = SCHEMA, strict: bool = True) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "play", "schema": schema, "strict": strict}}


def test_fifty_sampled_chat_completions_validate_against_a_nested_schema(client):
    outputs = []
    for seed in range(5):  # 5 requests of n=10: 50 samples at temperature 1
        response = client.chat.completions.create(
            model="default", messages=CHAT, temperature=1.0, n=10, seed=seed, max_tokens=200,
            response_format=json_schema_format())
        outputs += [(c.message.content, c.finish_reason) for c in response.choices]
    assert len(outputs) == 50
    for content, finish_reason in outputs:
        assert finish_reason == "stop"
        jsonschema.validate(json.loads(content), SCHEMA)
    assert len({c for c, _ in outputs}) > 10


def test_json_schema_on_completions_and_json_object_on_both(client):
    # the openai client has no response_format argument on completions: it goes in the extra body
    completion = client.completions.create(model="default", prompt="ROMEO:", max_tokens=200, temperature=0.7, seed=1,
                                           extra_body={"response_format": json_schema_format(strict=False)})
    jsonschema.validate(json.loads(completion.choices[0].text), SCHEMA)
    # Any JSON object: its strings are unbounded, and the default model (Shakespeare) writes on and on inside
    # them; a bias towards '"' (id 7) and '}' (98), where the grammar allows them, lets it finish.
    closing = {"7": 6.0, "98": 3.0}
    chat = client.chat.completions.create(model="default", messages=CHAT, max_tokens=220, temperature=0.7, seed=2,
                                          response_format={"type": "json_object"}, logit_bias=closing)
    assert chat.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(chat.choices[0].message.content), dict)
    plain = client.completions.create(model="default", prompt="ROMEO:", max_tokens=220, temperature=0.7, seed=3,
                                      logit_bias=closing, extra_body={"response_format": {"type": "json_object"}})
    assert plain.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(plain.choices[0].text), dict)


def test_streamed_json_schema_chat_reassembles_to_valid_json(client):
    stream = client.chat.completions.create(model="default", messages=CHAT, max_tokens=200, temperature=1.0, seed=4,
                                            response_format=json_schema_format(), stream=True)
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    jsonschema.validate(json.loads(text), SCHEMA)


@pytest.mark.parametrize("body, check", [
    ({"regex": r"(Romeo|Juliet) [0-9]{2}"}, lambda t: re.fullmatch(r"(Romeo|Juliet) [0-9]{2}", t)),
    ({"choice": ["to be", "not to be"]}, lambda t: t in ("to be", "not to be")),
    ({"grammar": 'root ::= "act " [1-5] ", scene " [1-9]'}, lambda t: re.fullmatch(r"act [1-5], scene [1-9]", t)),
    ({"json": {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
               "required": ["n"], "additionalProperties": False}},
     lambda t: json.loads(t)["n"] in range(10)),
])
def test_vllm_structured_outputs_extra_body_is_obeyed(client, body, check):
    completion = client.completions.create(model="default", prompt="O", max_tokens=40, temperature=1.0, n=4, seed=9,
                                           extra_body={"structured_outputs": body})
    for choice in completion.choices:
        assert choice.finish_reason == "stop" and check(choice.text), choice.text
    chat = client.chat.completions.create(model="default", messages=CHAT, max_tokens=40, temperature=1.0, seed=9,
                                          extra_body={"structured_outputs": body})
    assert check(chat.choices[0].message.content), chat.choices[0].message.content


class Character(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=8)
    age: int = pydantic.Field(ge=0, le=99)
    mood: str = pydantic.Field(json_schema_extra={"enum": ["glad", "sad"]})


def test_openai_client_parse_returns_a_pydantic_object(client):
    completion = client.chat.completions.parse(model="default", messages=CHAT, max_tokens=100, temperature=0.8,
                                               seed=5, response_format=Character)
    parsed = completion.choices[0].message.parsed
    assert isinstance(parsed, Character)
    assert parsed.mood in ("glad", "sad") and 0 <= parsed.age <= 99


@pytest.mark.parametrize("path, extra, param", [
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format"),
    ("/v1/chat/completions", {"response_format": {"type": "xml"}}, "response_format"),
    ("/v1/chat/completions", {"response_format": json_schema_format({"type": "object", "properties": 5})},
     "response_format"),
    ("/v1/completions", {"response_format": json_schema_format({"type": "strnig"})}, "response_format"),
    ("/v1/completions", {"structured_outputs": {"regex": "(a"}}, "structured_outputs.regex"),
    ("/v1/completions", {"structured_outputs": {"grammar": "root ::= nowhere"}}, "structured_outputs.grammar"),
    ("/v1/completions", {"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ("/v1/completions", {"structured_outputs": {"json": "{oops"}}, "structured_outputs.json"),
    ("/v1/completions", {"structured_outputs": {"choice": ["a"]}, "response_format": {"type": "json_object"}},
     "structured_outputs"),
    ("/v1/completions", {"structured_outputs": {"choice": ["a"]}, "ignore_eos": True}, "ignore_eos"),
])
def test_bad_constraints_are_400_naming_the_field(server, path, extra, param):
    body = {"prompt": "O", "max_tokens": 5, **extra} if path == "/v1/completions" else \
        {"messages": CHAT, "max_tokens": 5, **extra}
    assert_error(post(server, path, body), 400, param=param)
    assert server.engine_idle()


@pytest.mark.parametrize("extra, param", [
    # tools without tool_choice mean "auto", which needs a tool-call parser (see test_server_tools.py)
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice"),
])
def test_tools_without_a_call_this_server_can_make_are_400(server, extra, param):
    assert_error(post(server, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 5, **extra}), 400, param=param)
    ok = post(server, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 2, "tools": [], "tool_choice": "none",
                                               "parallel_tool_calls": False})
    assert ok.status_code == 200, ok.text

"""Bad input against the server's own published schemas: request bodies are generated from /openapi.json (types,
required fields), then mutated (wrong types, extremes, nulls, unknown fields, missing required fields). Every
answer must be well-formed: 2xx with valid JSON (or a complete SSE stream), or a 4xx in OpenAI's error envelope;
never a 5xx, never a hang, and the engine must stay alive.

Named cases that tests/test_server_errors.py already covers are not repeated here: invalid JSON and UTF-8
(test_invalid_json_and_utf8_are_400), wrong types and negative temperature
(test_invalid_completion_parameters_are_400_naming_the_field), unknown fields (test_unknown_fields_are_ignored),
empty messages (test_invalid_chat_parameters_are_400_naming_the_field), a bad API key
(test_api_key_is_required_everywhere_but_health). The rest are in test_named_bad_inputs below.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_reliability_common import default_model_server
from test_server_harness import data_events, parse_sse

MAX_MODEL_LEN = 64  # bounds every accepted generation, even one whose max_tokens was mutated to null
VOCAB = 8192  # the default model's
CLIENT_TIMEOUT = 30.0
EXAMPLES = 150

ENDPOINTS = {
    "/v1/completions": "CompletionRequest",
    "/v1/chat/completions": "ChatCompletionRequest",
    "/tokenize": "TokenizeRequest",
    "/detokenize": "DetokenizeRequest",
}


@pytest.fixture(scope="module")
def server():
    with default_model_server(max_model_len=MAX_MODEL_LEN, num_kv_blocks=128,
                              app_kwargs={"served_model_name": "default"}) as srv:
        yield srv


@pytest.fixture(scope="module")
def schemas(server) -> dict:
    """The components of the server's own /openapi.json."""
    document = httpx.get(server.url + "/openapi.json", timeout=10).json()
    for path, name in ENDPOINTS.items():
        ref = document["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        assert ref.endswith("/" + name), (path, ref)
    return document["components"]["schemas"]


# -- bodies from a JSON schema -----------------------------------------------------------------------------------
# Valid values are kept cheap: generations are 1-4 tokens, n <= 2, and lists and strings are short.
def _turns(draw_roles: list[str]) -> st.SearchStrategy:
    return st.tuples(*[st.fixed_dictionaries({"role": st.just(r), "content": st.text(max_size=24)})
                       for r in draw_roles]).map(list)


# The chat template wants user/assistant turns to alternate (after an optional system turn).
CONVERSATIONS = st.sampled_from([["user"], ["system", "user"], ["user", "assistant", "user"],
                                 ["system", "user", "assistant"]]).flatmap(_turns)

FIELD_OVERRIDES = {
    "max_tokens": st.integers(1, 4),
    "max_completion_tokens": st.integers(1, 4),
    "n": st.integers(1, 2),
    "best_of": st.none() | st.integers(1, 2),
    "min_tokens": st.integers(0, 2),
    "model": st.sampled_from([None, "default", "", "gpt-4"]),
    "role": st.sampled_from(["user", "system", "assistant"]) | st.text(max_size=8),
    "type": st.sampled_from(["text", "image_url"]) | st.text(max_size=8),
    "temperature": st.none() | st.floats(0.0, 2.0),
    "top_p": st.none() | st.floats(0.05, 1.0),
    "top_k": st.none() | st.integers(-1, 50),
    "min_p": st.none() | st.floats(0.0, 1.0),
    "presence_penalty": st.floats(-2.0, 2.0),
    "frequency_penalty": st.floats(-2.0, 2.0),
    "repetition_penalty": st.none() | st.floats(0.5, 2.0),
    "top_logprobs": st.none() | st.integers(0, 3),
    "seed": st.none() | st.integers(-(2**63) + 1, 2**63 - 1),
    "tokens": st.lists(st.integers(0, VOCAB - 1), max_size=12),
    "stop_token_ids": st.none() | st.lists(st.integers(0, VOCAB - 1), max_size=3),
    "logit_bias": st.none() | st.dictionaries(st.integers(0, VOCAB - 1).map(str), st.floats(-100, 100), max_size=3),
}
INT_EXTREMES = [-1, 0, 2**31, -(2**31), 2**53 + 1, 2**63 - 1, 2**63, -(2**63), 2**64 - 1, 10**30]
FLOAT_EXTREMES = [0.0, -0.0, 5e-324, -5e-324, 1e-300, 1e308, -1e308, 1.7976931348623157e308]
JSON_ANY = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=6,
)


def from_schema(schema: dict, components: dict, name: str = "", depth: int = 0) -> st.SearchStrategy:
    """A strategy of JSON values valid for `schema` (the subset msgspec emits: $ref, anyOf, object, array,
    string, integer, number, boolean, null). `name` is the property the value is for (see FIELD_OVERRIDES)."""
    if name in FIELD_OVERRIDES:
        return FIELD_OVERRIDES[name]
    if name == "messages" and "anyOf" not in schema:  # half well-formed conversations, half anything the schema allows
        return CONVERSATIONS | _from_schema(schema, components, name, depth)
    return _from_schema(schema, components, name, depth)


def _from_schema(schema: dict, components: dict, name: str, depth: int) -> st.SearchStrategy:
    if "$ref" in schema:
        return from_schema(components[schema["$ref"].rsplit("/", 1)[-1]], components, name, depth)
    if "anyOf" in schema:
        return st.one_of([from_schema(s, components, name, depth) for s in schema["anyOf"]])
    kind = schema.get("type")
    if kind == "object" and "properties" in schema:
        # max_tokens is always given (small) in valid bodies; mutations may still drop it or make it null
        required = set(schema.get("required", [])) | ({"max_tokens"} & set(schema["properties"]))
        props = {k: from_schema(v, components, k, depth + 1) for k, v in schema["properties"].items()}
        return st.fixed_dictionaries({k: v for k, v in props.items() if k in required},
                                     optional={k: v for k, v in props.items() if k not in required})
    if kind == "object":
        values = schema.get("additionalProperties")
        value = from_schema(values, components, "", depth + 1) if isinstance(values, dict) else JSON_ANY
        return st.dictionaries(st.text(max_size=8), value, max_size=3)
    if kind == "array":
        items = from_schema(schema.get("items", {}), components, name + "[]", depth + 1)
        return st.lists(items, min_size=1 if name in ("prompt", "messages") else 0, max_size=3)
    if kind == "string":
        return st.text(max_size=24)
    if kind == "integer":
        return st.integers(0, 20) | st.integers(0, 300)  # small counts (logprobs) or token ids (prompts)
    if kind == "number":
        return st.floats(-3.0, 3.0)
    if kind == "boolean":
        return st.booleans()
    if kind == "null":
        return st.none()
    return JSON_ANY


def numeric_fields(schema: dict, components: dict) -> dict[str, str]:
    """Property -> "integer" or "number", for the properties whose schema allows one (for extreme values)."""
    out = {}
    for field, prop in schema["properties"].items():
        kinds = {b.get("type") for b in prop.get("anyOf", [prop])}
        if "integer" in kinds:
            out[field] = "integer"
        elif "number" in kinds:
            out[field] = "number"
    return out


@st.composite
def mutated(draw, valid: st.SearchStrategy, schema: dict, components: dict) -> Any:
    """A valid body, then 0-3 mutations; rarely not an object at all. Extreme values go to numeric fields
    (integers get integer extremes: 2**63 and the like pass JSON and msgspec, then meet int64 tensors)."""
    body = draw(valid)
    if draw(st.integers(0, 40)) == 17:  # not 0: hypothesis favours the simplest value
        return draw(JSON_ANY)
    fields = sorted(schema["properties"])
    numeric = numeric_fields(schema, components)
    for _ in range(draw(st.integers(0, 3))):
        field = draw(st.sampled_from(fields))
        how = draw(st.sampled_from(["wrong-type", "extreme", "extreme", "null", "unknown", "drop", "long-string"]))
        if how == "wrong-type":
            body[field] = draw(JSON_ANY)
        elif how == "extreme" and numeric:
            field = draw(st.sampled_from(sorted(numeric)))
            body[field] = draw(st.sampled_from(INT_EXTREMES if numeric[field] == "integer" else FLOAT_EXTREMES))
        elif how == "null":
            body[field] = None
        elif how == "unknown":
            body[draw(st.text(min_size=1, max_size=10))] = draw(JSON_ANY)
        elif how == "drop":
            body.pop(field, None)
        elif how == "long-string":
            body[field] = draw(st.text(min_size=1, max_size=4)) * 2500  # up to 40 KB
    return body


# -- checks ----------------------------------------------------------------------------------------------------------
def assert_envelope(response: httpx.Response) -> None:
    assert response.headers["content-type"].startswith("application/json"), response.headers
    body = response.json()
    assert set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"] and isinstance(error["type"], str), error
    assert error["param"] is None or isinstance(error["param"], str), error


def assert_well_formed(response: httpx.Response, streamed: bool) -> None:
    status = response.status_code
    assert status < 500, (status, response.text[:500])
    if status >= 400:
        assert_envelope(response)
        return
    assert 200 <= status < 300, (status, response.text[:500])
    if streamed and response.headers["content-type"].startswith("text/event-stream"):
        events = data_events(parse_sse(response.content))
        assert events and events[-1] == "[DONE]", events[-3:]
        errors = [e for e in events if isinstance(e, dict) and "error" in e]
        assert not errors, errors  # an error in a 200 stream means a step failed
    else:
        assert isinstance(response.json(), dict)


def post_checked(server, path: str, body: Any) -> httpx.Response:
    data = json.dumps(body).encode()
    response = httpx.post(server.url + path, content=data, headers={"content-type": "application/json"},
                          timeout=CLIENT_TIMEOUT)  # a hang fails as httpx.ReadTimeout
    streamed = isinstance(body, dict) and body.get("stream") is True
    assert_well_formed(response, streamed)
    assert not server.engine.errored, f"the engine died on {data[:300]!r}"
    return response


@pytest.mark.parametrize("path", list(ENDPOINTS))
def test_schema_generated_bodies_get_2xx_or_an_enveloped_4xx(server, schemas, path):
    schema = schemas[ENDPOINTS[path]]
    valid = from_schema(schema, schemas)
    if path == "/tokenize":  # exactly one of prompt and messages, before mutations
        valid = valid.filter(lambda b: (b.get("prompt") is None) != (b.get("messages") is None))
    statuses: dict[int, int] = {}

    @settings(max_examples=EXAMPLES, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                     HealthCheck.function_scoped_fixture])
    @given(body=mutated(valid, schema, schemas))
    def check(body):
        response = post_checked(server, path, body)
        statuses[response.status_code] = statuses.get(response.status_code, 0) + 1

    check()
    print(f"{path}: statuses {dict(sorted(statuses.items()))}")
    assert statuses.get(200, 0) >= 5, statuses  # the generator does reach the valid region
    assert sum(n for s, n in statuses.items() if s >= 400) >= 5, statuses


@pytest.mark.parametrize("path, base", [
    ("/v1/completions", {"prompt": "Hi", "max_tokens": 2}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}),
])
def test_every_numeric_field_at_every_extreme(server, schemas, path, base):
    """Exhaustive where random search is thin: a valid body with one numeric field (from the schema) set to
    each extreme value; a few hundred requests, mostly 400s."""
    schema = schemas[ENDPOINTS[path]]
    tried = 0
    for field, kind in sorted(numeric_fields(schema, schemas).items()):
        for value in INT_EXTREMES + FLOAT_EXTREMES if kind == "number" else INT_EXTREMES:
            body = {**base, field: value}
            post_checked(server, path, body)
            tried += 1
    assert tried > 100


# -- named cases ---------------------------------------------------------------------------------------------------
CHAT = [{"role": "user", "content": "Hi"}]
FAR_BEYOND = " ".join(["the king"] * 50_000)  # ~100,000 tokens against max_model_len 64 (under the body limit)


NAMED_CASES = [
    ("/v1/completions", {"prompt": "Hi", "max_tokens": 10**9}, 400, "max_tokens"),
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 10**9}, 400, "max_tokens"),
    ("/v1/chat/completions", {"messages": CHAT, "max_completion_tokens": 10**9}, 400, "max_completion_tokens"),
    ("/v1/completions", {"prompt": "Hi", "n": 10**6}, 400, "n"),
    ("/v1/chat/completions", {"messages": CHAT, "n": 10**6}, 400, "n"),
    ("/v1/completions", {"prompt": "Hi", "top_p": 2}, 400, "top_p"),
    ("/v1/chat/completions", {"messages": CHAT, "top_p": 2}, 400, "top_p"),
    ("/v1/chat/completions", {"messages": CHAT, "temperature": -0.5}, 400, "temperature"),
    ("/v1/completions", {"prompt": FAR_BEYOND, "max_tokens": 2}, 400, "prompt"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": FAR_BEYOND}], "max_tokens": 2}, 400,
     "messages"),
    ("/v1/completions", {"prompt": [[7] * 5000, [8] * 3], "max_tokens": 2}, 400, "prompt"),
    ("/tokenize", {"prompt": "Hi", "messages": CHAT}, 400, "prompt"),
    ("/detokenize", {"tokens": [2**63 - 1]}, 400, "tokens"),
    ("/detokenize", {"tokens": [2**64]}, 400, "tokens"),
]


# each generation case twice: as JSON and as a stream (errors before streaming are plain JSON errors)
@pytest.mark.parametrize("path, body, status, param, stream", [
    (path, body, status, param, stream) for path, body, status, param in NAMED_CASES
    for stream in ((False, True) if path.startswith("/v1/") else (False,))
], ids=lambda v: v if isinstance(v, str) and len(v) < 30 else None)
def test_named_bad_inputs(server, path, body, status, param, stream):
    response = post_checked(server, path, {**body, "stream": stream} if stream else body)
    assert response.status_code == status, response.text[:300]
    assert response.json()["error"]["param"] == param, response.json()


def test_ten_megabyte_body_is_413_and_the_server_goes_on(server):
    big = json.dumps({"prompt": "x" * (10 * 2**20)}).encode()
    response = httpx.post(server.url + "/v1/completions", content=big, timeout=CLIENT_TIMEOUT,
                          headers={"content-type": "application/json"})
    assert response.status_code == 413
    assert_envelope(response)

    def chunks():  # the same without Content-Length: counted while it streams in
        for i in range(0, len(big), 2**20):
            yield big[i:i + 2**20]

    response = httpx.post(server.url + "/v1/completions", content=chunks(), timeout=CLIENT_TIMEOUT)
    assert response.status_code == 413
    assert_envelope(response)
    assert post_checked(server, "/v1/completions", {"prompt": "Hi", "max_tokens": 2}).status_code == 200


def test_bad_api_key_with_a_bad_body_is_401_first():
    with default_model_server(max_model_len=MAX_MODEL_LEN, num_kv_blocks=16, app_kwargs={"api_key": "k"}) as srv:
        for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": "Basic k"}):
            response = httpx.post(srv.url + "/v1/completions", content=b"{not json", timeout=CLIENT_TIMEOUT,
                                  headers={"content-type": "application/json", **headers})
            assert response.status_code == 401
            assert_envelope(response)


def test_top_k_beyond_int64_does_not_kill_the_engine():
    with default_model_server(max_model_len=MAX_MODEL_LEN, num_kv_blocks=16) as srv:
        response = httpx.post(srv.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2, "top_k": 2**63},
                              timeout=CLIENT_TIMEOUT)
        health = httpx.get(srv.url + "/health", timeout=10)
    assert response.status_code in (200, 400), response.text
    assert health.status_code == 200, "one request with a huge top_k killed the engine"

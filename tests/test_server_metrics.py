"""/metrics (vLLM names, counters that move, one registry per app), /openapi.json, /tokenize, /detokenize."""

from __future__ import annotations

import json
import re

import httpx
from test_server_harness import MAX_MODEL_LEN, server  # noqa: F401

from asyncengine.api import create_app

NAMES = [
    "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
    "vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:num_preemptions_total",
    "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
    "vllm:time_to_first_token_seconds_bucket", "vllm:inter_token_latency_seconds_bucket",
    "vllm:e2e_request_latency_seconds_count", "vllm:request_success_total",
]


def scrape(srv) -> dict[str, float]:
    response = httpx.get(srv.url + "/metrics")
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    values: dict[str, float] = {}
    for line in response.text.splitlines():
        if line and not line.startswith("#"):
            series, value = line.rsplit(" ", 1)
            name = re.sub(r"\{.*\}", "", series)
            if 'le="' not in series:
                values[name] = values.get(name, 0.0) + float(value)
    return values


def test_metrics_use_vllm_names_and_counters_move(server):  # noqa: F811
    before = scrape(server)
    text = httpx.get(server.url + "/metrics").text
    for name in NAMES:
        assert name in text, name
    assert 'model_name="tiny"' in text
    prompt = "Paged attention stores keys and values in fixed-size blocks."
    for _ in range(2):  # the second run hits the prefix cache
        body = {"prompt": prompt, "max_tokens": 6, "ignore_eos": True}
        assert httpx.post(server.url + "/v1/completions", json=body, timeout=30).status_code == 200
    after = scrape(server)
    assert after["vllm:generation_tokens_total"] - before.get("vllm:generation_tokens_total", 0) == 12
    assert after["vllm:prompt_tokens_total"] > before.get("vllm:prompt_tokens_total", 0)
    assert after["vllm:e2e_request_latency_seconds_count"] - before.get("vllm:e2e_request_latency_seconds_count",
                                                                        0) == 2
    assert after["vllm:time_to_first_token_seconds_count"] > before.get("vllm:time_to_first_token_seconds_count", 0)
    assert after["vllm:inter_token_latency_seconds_count"] - before.get("vllm:inter_token_latency_seconds_count",
                                                                        0) == 10
    assert after["vllm:prefix_cache_queries_total"] > before["vllm:prefix_cache_queries_total"]
    assert after["vllm:prefix_cache_hits_total"] > before["vllm:prefix_cache_hits_total"]
    assert after["vllm:num_requests_running"] == 0 and after["vllm:kv_cache_usage_perc"] >= 0


def test_two_apps_in_one_process_have_their_own_registries(server):  # noqa: F811
    first = create_app(server.engine, served_model_name="a")
    second = create_app(server.engine, served_model_name="b")
    a, b = first.state.server.metrics.render().decode(), second.state.server.metrics.render().decode()
    assert 'model_name="a"' in a and 'model_name="b"' not in a
    assert 'model_name="b"' in b


def test_openapi_document_is_generated_from_the_structs(server):  # noqa: F811
    response = httpx.get(server.url + "/openapi.json")
    doc = json.loads(response.content)
    assert doc["openapi"].startswith("3.")
    schemas = doc["components"]["schemas"]
    for name in ("CompletionRequest", "ChatCompletionRequest", "ChatCompletionChunk", "CompletionResponse",
                 "ErrorResponse", "TokenizeRequest", "UsageInfo"):
        assert name in schemas, name
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models", "/tokenize", "/health"} <= set(doc["paths"])
    assert "prompt" in schemas["CompletionRequest"]["required"]
    refs = re.findall(r'"\$ref":\s*"#/components/schemas/([^"]+)"', response.text)
    assert refs and all(ref in schemas for ref in refs)


def test_tokenize_and_detokenize_round_trip(server):  # noqa: F811
    tokenizer = server.engine.tokenizer
    text = "Hello world! How are you today?"
    result = httpx.post(server.url + "/tokenize", json={"prompt": text, "return_token_strs": True}).json()
    assert result["tokens"] == tokenizer(text).input_ids
    assert result["count"] == len(result["tokens"]) and result["max_model_len"] == MAX_MODEL_LEN
    assert result["token_strs"] == tokenizer.convert_ids_to_tokens(result["tokens"])
    plain = httpx.post(server.url + "/tokenize", json={"prompt": text, "add_special_tokens": False}).json()
    assert plain["tokens"] == tokenizer(text, add_special_tokens=False).input_ids
    chat = httpx.post(server.url + "/tokenize", json={"messages": [{"role": "user", "content": text}]}).json()
    assert chat["count"] > result["count"] and chat["token_strs"] is None
    back = httpx.post(server.url + "/detokenize", json={"tokens": plain["tokens"]}).json()
    assert back == {"prompt": text}
    bad = httpx.post(server.url + "/detokenize", json={"tokens": [10**7]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    both = httpx.post(server.url + "/tokenize", json={"prompt": "a", "messages": [{"role": "user", "content": "b"}]})
    assert both.status_code == 400

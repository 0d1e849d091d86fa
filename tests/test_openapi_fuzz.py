"""/openapi.json is the contract: Schemathesis, reading it from a real server, finds nothing.

A real hypercorn server (the harness's ServerThread) on the default model, with and without an API key, fuzzed by
the Schemathesis CLI (a subprocess) with `--checks all`, a fixed seed and a bounded number of cases per operation,
over its fuzzing phase; its coverage phase (~1,000 cases whatever the bound) runs in a slow test. The one substitution: `positive_data_acceptance` is replaced by
tests/openapi_fuzz_hooks.py's copy, which lets through the two rules between fields JSON Schema cannot state
(prompt + max_tokens within max_model_len; min_tokens <= max_tokens), identified by their error code / param.
After each run the engine holds no request and every KV block is free.

The server runs with a small max_model_len: the document bounds max_tokens (and prompts given as token ids) by it,
so the fuzzer's longest generations stay short (n <= 128 sequences of < 32 tokens).

The long test (pytest -m long) is the long run: 10,000+ cases, then no failure, no leaked KV block, and the server's
memory flat after warm-up (its heap in use and its RSS once malloc's free pages are returned; see its docstring).
"""

from __future__ import annotations

import ctypes
import gc
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import NamedTuple

import httpx
import pytest
from test_reliability_common import MiB, rss_bytes, settled_rss
from test_server_harness import ServerThread, wait_until

from asyncengine.api.openapi import decimal_below_pattern
from asyncengine.config import default_model_path

MAX_MODEL_LEN = 32
API_KEY = "sk-openapi-fuzz"
SEED = 20
TESTS_DIR = Path(__file__).parent


def fuzz_server(api_key=None) -> ServerThread:
    # max_num_seqs 128: a request with the largest n (128) decodes as one batch
    return ServerThread(default_model_path(), app_kwargs={"api_key": api_key}, max_model_len=MAX_MODEL_LEN,
                        max_num_seqs=128)


@pytest.fixture(scope="module")
def open_server():
    with fuzz_server() as server:
        yield server


@pytest.fixture(scope="module")
def keyed_server():
    with fuzz_server(API_KEY) as server:
        yield server


def run_schemathesis(server: ServerThread, cases_per_operation: int, api_key=None, timeout: float = 600,
                     phases: str = "coverage,fuzzing", seed: int = SEED) -> subprocess.CompletedProcess:
    """Schemathesis over the server's own /openapi.json: all checks, the given phases, a fixed seed."""
    command = [sys.executable, "-m", "schemathesis.cli", "run", server.url + "/openapi.json",
               "--checks", "all", "--exclude-checks", "positive_data_acceptance",
               "--phases", phases, "--seed", str(seed), "--max-examples", str(cases_per_operation),
               "--workers", "1", "--request-timeout", "60", "--max-response-time", "60",
               "--generation-database", "none", "--no-color",
               "--output-truncate", "true"]
    if api_key is not None:
        command += ["--header", f"Authorization: Bearer {api_key}"]
    env = {**os.environ, "SCHEMATHESIS_HOOKS": "openapi_fuzz_hooks",
           "PYTHONPATH": os.pathsep.join([str(TESTS_DIR), os.environ.get("PYTHONPATH", "")])}
    with tempfile.TemporaryDirectory() as workdir:  # where Schemathesis keeps its cache of failures
        result = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env, cwd=workdir)
    print(result.stdout[:20000], result.stdout[-6000:] if len(result.stdout) > 20000 else "", result.stderr[-2000:])
    return result


def cases_generated(output: str) -> int:
    match = re.search(r"(\d+) generated", output)
    assert match, output[-2000:]
    return int(match.group(1))


def assert_clean_run(result: subprocess.CompletedProcess, server: ServerThread) -> int:
    assert result.returncode == 0, result.stdout[:8000] + result.stderr[-2000:]  # the failures come first
    wait_until(server.engine_idle, 30)  # every request finished or aborted, every KV block free
    return cases_generated(result.stdout)


# -- the fuzz runs ----------------------------------------------------------------------------------------------
@pytest.mark.timeout(900)
def test_schemathesis_finds_nothing_without_an_api_key(open_server):
    cases = assert_clean_run(run_schemathesis(open_server, 10, phases="fuzzing"), open_server)
    assert cases >= 20


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_schemathesis_coverage_phase_finds_nothing_without_an_api_key(open_server):
    """The coverage phase (every bound's edges, every field's wrong types: ~1,000 cases; 6 to 7 minutes on two
    shared cores, hence slow) and the fuzzing phase."""
    cases = assert_clean_run(run_schemathesis(open_server, 10), open_server)
    assert cases >= 300


@pytest.mark.timeout(900)
def test_schemathesis_finds_nothing_with_an_api_key(keyed_server):
    """With a key the document differs only in its security; the fuzzing phase sends every operation with and
    without the key (ignored_auth). The coverage phase, the same as without a key, is left to the test above."""
    cases = assert_clean_run(run_schemathesis(keyed_server, 10, api_key=API_KEY, phases="fuzzing"), keyed_server)
    assert cases >= 20


FUZZ_RUNS = 4  # the long run's Schemathesis runs (different seeds); the first is warm-up for memory
HEAP_GROWTH_MIB = 16  # after warm-up: bound on the growth of the C heap in use (about 2 MiB per 1,000 cases)
ANON_RSS_GROWTH_MIB = 32  # after warm-up: bound on the growth of anonymous RSS once malloc's free pages are returned


@pytest.mark.long
@pytest.mark.timeout(6 * 3600)
def test_ten_thousand_fuzzed_cases_leave_no_error_no_leak_and_flat_memory(open_server):
    """The long run: 10,000+ fuzzed cases (the coverage phase does not depend on the case count: the fast tests
    run it), in FUZZ_RUNS runs with different seeds, and the server's memory measured after each.

    Raw RSS is not the measure of a leak: glibc keeps freed heap pages (the largest batch's tensors, tens of MiB)
    and RSS moves with the biggest request of the last run (a 4,000-case diagnosis: malloc's heap in use flat at
    185 MiB from 1,200 cases on, while its free-but-kept pages went 59-87 MiB and RSS 688-717 MiB). So after the
    first run (warm-up: imports, the grammar compiler, the prefix cache filling its blocks), the heap in use
    (mallinfo2) and the anonymous RSS after malloc_trim (what the process holds once the allocator returns its
    free pages; file-backed pages, the shared libraries' code as it gets touched, are reported, not bounded) must
    stay within HEAP_GROWTH_MIB and ANON_RSS_GROWTH_MIB to the end."""
    cases_per_run = int(os.environ.get("OPENAPI_FUZZ_CASES_PER_OPERATION", "2600")) // FUZZ_RUNS
    memory, cases = [ServerMemory.now()], []
    print(f"before: {memory[-1]}")
    for run in range(FUZZ_RUNS):
        result = run_schemathesis(open_server, cases_per_run, timeout=5400, phases="fuzzing", seed=SEED + run)
        cases.append(assert_clean_run(result, open_server))
        memory.append(ServerMemory.now())
        print(f"after run {run + 1} ({sum(cases)} cases): {memory[-1]}")
    assert sum(cases) >= 10_000 or "OPENAPI_FUZZ_CASES_PER_OPERATION" in os.environ
    warm, end, after_warm_up = memory[1], memory[-1], sum(cases[1:])
    heap_growth, anon_growth = end.heap_in_use - warm.heap_in_use, end.trimmed_anon - warm.trimmed_anon
    print(f"after warm-up, over {after_warm_up} cases: heap in use {heap_growth:+.1f} MiB "
          f"({heap_growth * 1000 / after_warm_up:+.2f} MiB per 1,000 cases), anonymous RSS after malloc_trim "
          f"{anon_growth:+.1f} MiB ({anon_growth * 1000 / after_warm_up:+.2f} MiB per 1,000 cases); RSS after "
          f"malloc_trim {end.trimmed_rss - warm.trimmed_rss:+.1f} MiB, raw RSS {end.rss - warm.rss:+.1f} MiB")
    assert heap_growth < HEAP_GROWTH_MIB, memory
    assert anon_growth < ANON_RSS_GROWTH_MIB, memory


class ServerMemory(NamedTuple):
    """Memory of this process, which runs the server (ServerThread) but not Schemathesis, in MiB."""

    rss: float  # as the kernel counts it now
    heap_in_use: float  # malloc's allocated bytes (glibc mallinfo2: uordblks + hblkhd), whatever it keeps free
    heap_free: float  # freed bytes malloc keeps in its arenas (fordblks)
    trimmed_rss: float  # RSS once malloc_trim(0) has returned the free pages to the kernel
    trimmed_anon: float  # its anonymous part (without the file-backed pages of code and mapped files)

    @classmethod
    def now(cls) -> "ServerMemory":
        gc.collect()
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = _MallInfo2
        heap, rss = libc.mallinfo2(), rss_bytes() / MiB
        trimmed = settled_rss() / MiB
        return cls(rss, (heap.uordblks + heap.hblkhd) / MiB, heap.fordblks / MiB, trimmed, _anonymous_rss_mib())

    def __str__(self) -> str:
        return (f"RSS {self.rss:.0f} MiB, heap in use {self.heap_in_use:.1f} MiB (free kept {self.heap_free:.0f}), "
                f"RSS after malloc_trim {self.trimmed_rss:.0f} MiB (anonymous {self.trimmed_anon:.0f})")


def _anonymous_rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no RssAnon in /proc/self/status")


class _MallInfo2(ctypes.Structure):  # glibc >= 2.33
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]


# -- the document itself ----------------------------------------------------------------------------------------
def document(server: ServerThread, api_key=None) -> dict:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    response = httpx.get(server.url + "/openapi.json", headers=headers, timeout=10)
    assert response.status_code == 200
    return response.json()


def operations(doc: dict):
    for path, item in doc["paths"].items():
        for method, operation in item.items():
            yield path, method, operation


def test_without_a_key_the_document_declares_no_security(open_server):
    doc = document(open_server)
    assert "security" not in doc and "securitySchemes" not in doc["components"]
    for path, method, operation in operations(doc):
        assert "security" not in operation and "401" not in operation["responses"], (path, method)


def test_with_a_key_every_route_but_health_declares_bearer_auth_and_401(keyed_server):
    doc = document(keyed_server, API_KEY)
    assert doc["components"]["securitySchemes"] == {"bearer": {"type": "http", "scheme": "bearer"}}
    assert doc["security"] == [{"bearer": []}]
    for path, method, operation in operations(doc):
        if path == "/health":
            assert operation["security"] == [] and "401" not in operation["responses"]
            assert httpx.get(keyed_server.url + path).status_code == 200  # as documented: no key needed
        else:
            assert "security" not in operation and "401" in operation["responses"], (path, method)
            assert httpx.request(method, keyed_server.url + path).status_code == 401


def test_every_4xx_is_the_error_envelope_and_generations_stream_as_sse(open_server):
    doc = document(open_server)
    for path, method, operation in operations(doc):
        for status, response in operation["responses"].items():
            if status.startswith("4"):
                assert response["content"]["application/json"]["schema"] == {
                    "$ref": "#/components/schemas/ErrorResponse"}, (path, status)
    for path, chunk in (("/v1/completions", "CompletionResponse"), ("/v1/chat/completions", "ChatCompletionChunk")):
        content = doc["paths"][path]["post"]["responses"]["200"]["content"]
        assert set(content) == {"application/json", "text/event-stream"}
        data = content["text/event-stream"]["schema"]["properties"]["data"]
        assert data["else"]["contentSchema"]["anyOf"][0] == {"$ref": f"#/components/schemas/{chunk}"}
    assert "/v1/ws" in doc["x-websockets"]


def test_model_bounds_are_in_the_document(open_server):
    doc = document(open_server)
    schemas = doc["components"]["schemas"]
    vocab = open_server.engine.vocab_size
    assert schemas["DetokenizeRequest"]["properties"]["tokens"]["items"] == {
        "type": "integer", "minimum": 0, "maximum": vocab - 1}
    max_tokens = schemas["CompletionRequest"]["properties"]["max_tokens"]["anyOf"][0]
    assert max_tokens == {"type": "integer", "minimum": 1, "maximum": MAX_MODEL_LEN - 1}
    assert schemas["ChatCompletionRequest"]["properties"]["messages"]["minItems"] == 1
    assert schemas["ChatCompletionRequest"]["properties"]["min_tokens"]["type"] == "integer"
    tokenize = doc["paths"]["/tokenize"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert [branch["required"] for branch in tokenize["oneOf"]] == [["prompt"], ["messages"]]
    assert "x-model-bound" not in str(doc) and "x-schema" not in str(doc)


def test_the_server_enforces_the_documented_bounds_at_their_edges(open_server):
    """The edges the issue found, both ways: what the document allows is accepted, what it forbids is a 400."""
    url, vocab = open_server.url, open_server.engine.vocab_size
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    assert httpx.post(url + "/detokenize", json={"tokens": [0, vocab - 1]}).status_code == 200
    assert httpx.post(url + "/detokenize", json={"tokens": [vocab]}).status_code == 400
    assert httpx.post(url + "/v1/chat/completions", json={"messages": []}).status_code == 400
    assert httpx.post(url + "/tokenize", json={}).status_code == 400
    assert httpx.post(url + "/tokenize", json={"prompt": "Hi", "messages": None}).status_code == 200
    assert httpx.post(url + "/v1/chat/completions", json={**chat, "min_tokens": 1.0}, timeout=60).status_code == 200
    assert httpx.post(url + "/v1/chat/completions", json={**chat, "min_tokens": 1.5}).status_code == 400
    assert httpx.post(url + "/v1/completions", json={"prompt": "Hi", "logit_bias": {str(vocab - 1): 1},
                                                     "max_tokens": 1}, timeout=60).status_code == 200
    assert httpx.post(url + "/v1/completions", json={"prompt": "Hi", "logit_bias": {"01": 1}}).status_code == 400
    assert httpx.get(url + "/v1/ws").status_code == 426


def request_validator(doc: dict, path: str):
    """A JSON Schema (2020-12) validator of the request body of POST `path`, as the document states it."""
    import jsonschema

    body = doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
    return jsonschema.Draft202012Validator({**body, "components": doc["components"]})


# What the long fuzz run found (ST202): a forced tool call with min_tokens or ignore_eos was schema-valid, but a
# forced call is constrained output that must end with EOS, which those forbid: the server was right to refuse it
# (a grammar that completes before min_tokens would leave no token to sample), the document wrong not to say so.
FORCED_CALL = {
    "messages": [{"role": "system", "content": "s"},
                 {"role": "assistant", "content": None, "tool_calls": [
                     {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
                 {"role": "tool", "tool_call_id": "c", "content": "r"}],
    "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required", "logprobs": True,
}


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "f"}}])
@pytest.mark.parametrize("extra, param", [({"min_tokens": 1}, "min_tokens"), ({"ignore_eos": True}, "ignore_eos")])
def test_a_forced_tool_call_excludes_min_tokens_and_ignore_eos_in_the_document_and_the_server(
        open_server, tool_choice, extra, param):
    validator = request_validator(document(open_server), "/v1/chat/completions")
    body = {**FORCED_CALL, "tool_choice": tool_choice}
    assert validator.is_valid(body)
    assert not validator.is_valid({**body, **extra})
    refused = httpx.post(open_server.url + "/v1/chat/completions", json={**body, **extra}, timeout=60)
    error = refused.json()["error"]
    assert refused.status_code == 400 and error["param"] == param and "forced tool call" in error["message"]
    # the rule is the forced call's: with tool_choice "none", or a user turn the template renders, it is allowed
    assert validator.is_valid({**body, **extra, "tool_choice": "none"})
    user_turn = {**body, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    assert httpx.post(open_server.url + "/v1/chat/completions", json=user_turn, timeout=60).status_code == 200
    assert httpx.post(open_server.url + "/v1/chat/completions", timeout=60,
                      json={**user_turn, **extra, "tool_choice": "none"}).status_code == 200


@pytest.mark.parametrize("limit", [1, 2, 9, 10, 11, 99, 100, 101, 384, 1000, 8192, 32000, 151936])
def test_decimal_below_pattern_matches_exactly_the_token_ids_below_the_limit(limit):
    pattern = re.compile(decimal_below_pattern(limit))
    matched = [n for n in range(limit * 3 + 20) if pattern.search(str(n))]
    assert matched == list(range(limit))
    assert not any(pattern.search(s) for s in ("", "-1", "01", "00", "+1", " 1", "1.0"))



def test_the_logprobs_cap_of_max_logprobs_is_in_the_document_and_enforced():
    """`--max-logprobs 3`: the document's logprobs and top_logprobs stop at 3, and the server agrees at the edge."""
    from asyncengine.api.inputs import SamplingPolicy
    from asyncengine.api.serving import ServingOptions

    options = ServingOptions(policy=SamplingPolicy(max_logprobs=3))
    with ServerThread(default_model_path(), app_kwargs={"options": options}, max_model_len=MAX_MODEL_LEN) as server:
        schemas = document(server)["components"]["schemas"]
        for struct, field in (("CompletionRequest", "logprobs"), ("ChatCompletionRequest", "top_logprobs")):
            assert schemas[struct]["properties"][field]["anyOf"][0] == {"type": "integer", "minimum": 0, "maximum": 3}
        body = {"prompt": "Hi", "max_tokens": 1}
        assert httpx.post(server.url + "/v1/completions", json={**body, "logprobs": 3}, timeout=60).status_code == 200
        refused = httpx.post(server.url + "/v1/completions", json={**body, "logprobs": 4}, timeout=60)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "logprobs"

"""A fault in the engine's step, in a real `asyncengine serve` process on the default model: in-flight streams end
with an error event and [DONE], /health and new requests get 503 at once, and the process exits with status 1 by
itself within a few seconds (so a supervisor restarts it) instead of hanging.

The fault comes from tests/faulty_server.py, the CLI with LLMEngine.launch wrapped to raise after N steps (in the
engine process too)."""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from test_server_cli import CLIServer

from asyncengine.api.cli import ENGINE_DEAD_DRAIN, ENGINE_DEAD_LINGER, EXIT_ENGINE_DEAD
from faulty_server import FAULT_ENV

FAULT_AFTER_STEPS = 40
NUM_STREAMS = 6


def FaultyServer(log_dir, fault_after: int, engine_process: bool = False) -> CLIServer:
    """`python tests/faulty_server.py serve` (default model): the CLI with a fault after `fault_after` steps."""
    extra = ("--engine-process",) if engine_process else ("--no-engine-process",)
    return CLIServer(None, "--max-model-len", "512", *extra, log_dir=log_dir, env={FAULT_ENV: str(fault_after)},
                     num_kv_blocks=256, launcher=[sys.executable, str(Path(__file__).with_name("faulty_server.py"))])


def read_stream(url: str, body: dict, out: dict, first: threading.Event) -> None:
    """Read one SSE stream into out["events"]; out["error_at"] = when its error event arrived."""
    events = out.setdefault("events", [])
    try:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as response:
            out["status"] = response.status_code
            for line in response.iter_lines():
                if not line.startswith("data: "):
                    continue
                event = "[DONE]" if line == "data: [DONE]" else json.loads(line[6:])
                events.append(event)
                if isinstance(event, dict) and "error" in event:
                    out["error_at"] = time.monotonic()
                if isinstance(event, dict) and event.get("choices") and event["choices"][0]["text"]:
                    first.set()
    except httpx.HTTPError as exc:
        out["transport_error"] = repr(exc)


@pytest.mark.parametrize("engine_process", [False, True], ids=["in-process", "engine-process"])
def test_engine_fault_ends_streams_with_an_error_turns_503_and_exits_1(tmp_path, engine_process):
    server = FaultyServer(tmp_path, FAULT_AFTER_STEPS, engine_process)
    try:
        body = {"prompt": "Now is the winter", "max_tokens": 400, "ignore_eos": True, "stream": True}
        streams = []
        for i in range(NUM_STREAMS):
            out, first = {}, threading.Event()
            thread = threading.Thread(target=read_stream, args=(server.url, {**body, "prompt": f"{body['prompt']} {i}"},
                                                               out, first), daemon=True)
            thread.start()
            streams.append((out, first, thread))
        assert all(first.wait(30) for _, first, _ in streams), server.logs()  # tokens flowed before the fault

        for _, _, thread in streams:
            thread.join(15)
        died_at = min(out["error_at"] for out, _, _ in streams if "error_at" in out)
        # at once after the failure: health and new requests are 503
        health = httpx.get(server.url + "/health", timeout=5)
        refused_start = time.monotonic()
        refused = httpx.post(server.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=5)
        refused_in = time.monotonic() - refused_start
        refused_stream = httpx.post(server.url + "/v1/chat/completions", timeout=5, json={
            "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "stream": True})
        assert time.monotonic() - died_at < ENGINE_DEAD_LINGER, "the 503 checks came too late to be meaningful"

        # then the process ends by itself, non-zero
        code = server.proc.wait(ENGINE_DEAD_LINGER + ENGINE_DEAD_DRAIN + 10)
        exited_after = time.monotonic() - died_at
    finally:
        server.kill()

    for out, _, _ in streams:
        events = out["events"]
        assert out.get("status") == 200 and "transport_error" not in out, out
        assert events[-1] == "[DONE]", events[-3:]
        error = events[-2]["error"]
        assert set(error) == {"message", "type", "param", "code"}, error
        assert error["type"] == "service_unavailable" and "injected engine fault" in error["message"], error
        assert any(isinstance(e, dict) and e.get("choices") and e["choices"][0]["text"] for e in events[:-2])
    assert health.status_code == 503 and health.json()["error"]["type"] == "service_unavailable"
    assert refused.status_code == 503 and refused.json()["error"]["type"] == "service_unavailable"
    assert refused_in < 1.0
    assert refused_stream.status_code == 503 and refused_stream.headers["content-type"].startswith("application/json")
    assert code == EXIT_ENGINE_DEAD, (code, server.logs())
    assert exited_after < ENGINE_DEAD_LINGER + ENGINE_DEAD_DRAIN + 8, exited_after
    assert "injected engine fault" in server.logs()


def test_fault_before_the_first_token_still_ends_the_stream_and_exits_1(tmp_path):
    server = FaultyServer(tmp_path, 0)  # the very first step fails: during prefill
    try:
        out, first = {}, threading.Event()
        read_stream(server.url, {"prompt": "Hello", "max_tokens": 8, "stream": True}, out, first)
        code = server.proc.wait(ENGINE_DEAD_LINGER + ENGINE_DEAD_DRAIN + 10)
    finally:
        server.kill()
    assert out.get("status") == 200 and not first.is_set()
    assert out["events"][-1] == "[DONE]" and out["events"][-2]["error"]["type"] == "service_unavailable"
    assert code == EXIT_ENGINE_DEAD, server.logs()

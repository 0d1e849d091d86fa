"""The `asyncengine serve` CLI as a subprocess: it serves, and SIGTERM / SIGINT shut it down gracefully."""

from __future__ import annotations

import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from checkpoints import build_checkpoint

SHUTDOWN_TIMEOUT = 3.0


@pytest.fixture(scope="module")
def long_llama_dir(tmp_path_factory) -> Path:
    """A tiny checkpoint with a 4096-token context, so one request can run for many seconds on CPU."""
    return build_checkpoint(tmp_path_factory.mktemp("long") / "llama", max_position_embeddings=4096)


class CLIServer:
    """`python -m asyncengine.api serve ...` in a subprocess; reads the bound URL from its first stdout line."""

    def __init__(self, model: Path | None, *args: str, log_dir: Path, env: dict | None = None,
                 num_kv_blocks: int = 600, launcher: list[str] | None = None):
        """model None: the embedded default model. env: extra environment variables for the server. launcher:
        the command before `serve` (default: python -m asyncengine.api)."""
        self.log = open(log_dir / "server.log", "w+b")
        cmd = [*(launcher or [sys.executable, "-m", "asyncengine.api"]), "serve", *([str(model)] if model else []), "--host",
               "127.0.0.1", "--port", "0", "--num-kv-blocks", str(num_kv_blocks), "--log-level", "warning", *args]
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
               **(env or {})}
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=self.log, env=env)
        lines: queue.Queue = queue.Queue()
        threading.Thread(target=lambda: lines.put(self.proc.stdout.readline().decode()), daemon=True).start()
        try:
            line = lines.get(timeout=90)
        except queue.Empty:
            self.kill()
            raise AssertionError("server printed no address within 90 s:\n" + self.logs())
        assert line.startswith("asyncengine serving on http://127.0.0.1:"), line + self.logs()
        self.url = line.split()[-1]

    def logs(self) -> str:
        self.log.seek(0)
        return self.log.read().decode(errors="replace")[-3000:]

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


def stream_events(url: str, body: dict, events: list, first: threading.Event) -> None:
    """Read an SSE stream into `events` (parsed JSON or "[DONE]"); set `first` at the first content."""
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as response:
        for line in response.iter_lines():
            if not line.startswith("data: "):
                continue
            event = "[DONE]" if line == "data: [DONE]" else json.loads(line[6:])
            events.append(event)
            if isinstance(event, dict) and event.get("choices") and event["choices"][0]["text"]:
                first.set()


def finish_reasons(events: list) -> list:
    return [e["choices"][0]["finish_reason"] for e in events
            if isinstance(e, dict) and e.get("choices") and e["choices"][0]["finish_reason"]]


def test_sigterm_drains_then_aborts_and_exits_0(long_llama_dir, tmp_path):
    server = CLIServer(long_llama_dir, "--shutdown-timeout", str(SHUTDOWN_TIMEOUT), "--served-model-name", "tiny",
                       log_dir=tmp_path)
    try:
        served = httpx.post(server.url + "/v1/completions", json={"model": "tiny", "prompt": "Hi", "max_tokens": 4},
                            timeout=30)
        assert served.status_code == 200 and served.json()["usage"]["completion_tokens"] >= 1

        streams = {}
        for name, max_tokens in (("long", 4000), ("short", 100)):
            events, first = [], threading.Event()
            body = {"prompt": "Hello world", "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
            thread = threading.Thread(target=stream_events, args=(server.url, body, events, first), daemon=True)
            thread.start()
            streams[name] = (events, first, thread)
        assert all(first.wait(30) for _, first, _ in streams.values())

        server.proc.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        time.sleep(0.3)
        refused = httpx.post(server.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=10)
        assert refused.status_code == 503 and refused.json()["error"]["type"] == "service_unavailable"
        assert httpx.get(server.url + "/health", timeout=10).status_code == 503

        assert server.proc.wait(SHUTDOWN_TIMEOUT + 15) == 0, server.logs()
        elapsed = time.monotonic() - signalled
        assert elapsed < SHUTDOWN_TIMEOUT + 8, elapsed
        for name, (events, _, thread) in streams.items():
            thread.join(5)
            assert events[-1] == "[DONE]", (name, events[-3:])
        assert finish_reasons(streams["short"][0]) == ["length"]  # finished within the drain time
        assert finish_reasons(streams["long"][0]) == ["abort"]  # cut at the shutdown timeout
    finally:
        server.kill()


def test_sigint_on_an_idle_server_exits_0_at_once(long_llama_dir, tmp_path):
    server = CLIServer(long_llama_dir, "--api-key", "k", log_dir=tmp_path)
    try:
        assert httpx.get(server.url + "/v1/models", headers={"Authorization": "Bearer k"}).status_code == 200
        start = time.monotonic()
        server.proc.send_signal(signal.SIGINT)
        assert server.proc.wait(15) == 0, server.logs()
        assert time.monotonic() - start < 8
    finally:
        server.kill()


def test_bad_engine_flags_exit_2_with_the_reason(tmp_path):
    result = subprocess.run([sys.executable, "-m", "asyncengine.api", "serve", str(tmp_path), "--block-size", "3"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "block_size" in result.stderr


def test_console_script_is_installed():
    exe = shutil.which("asyncengine")
    if exe is None:
        pytest.skip("the asyncengine console script is not on PATH")
    result = subprocess.run([exe, "serve", "--help"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0
    for flag in ("--api-key", "--served-model-name", "--max-model-len", "--max-num-seqs", "--max-num-batched-tokens",
                 "--block-size", "--dtype", "--max-queue-len", "--shutdown-timeout", "--seed", "--num-kv-blocks",
                 "--no-enable-prefix-caching"):
        assert flag in result.stdout, flag

"""The `asyncengine serve` CLI as a subprocess: it serves, SIGTERM / SIGINT shut it down gracefully, and vLLM's
flags do what vLLM's do (TLS, CORS, root path, tokenizer, chat template, generation config, logprobs cap, request
logs) on a real server."""

from __future__ import annotations

import json
import os
import queue
import re
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
        assert re.match(r"asyncengine serving on https?://127\.0\.0\.1:\d+$", line.strip()), line + self.logs()
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


def test_an_idle_server_without_an_engine_process_exits_2_naming_the_flag():
    result = subprocess.run([sys.executable, "-m", "asyncengine.api", "serve", "--no-engine-process",
                             "--api-cpu-priority", "idle", "--port", "0"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "api_cpu_priority 'idle' needs the engine in a process" in result.stderr


# -- vLLM's flags, on one real server ---------------------------------------------------------------------------
OVERRIDE_TEMPLATE = "{% for m in messages %}<<{{ m['content'] }}>>{% endfor %}"
ORIGIN = "https://app.example"


@pytest.fixture(scope="module")
def split_checkpoint(tmp_path_factory, llama_dir) -> tuple[Path, Path, Path]:
    """(model folder without any tokenizer, tokenizer folder, generation-config folder): the server can only
    start if --tokenizer loads the tokenizer from its folder."""
    root = tmp_path_factory.mktemp("split")
    model, tokenizer, generation = root / "model", root / "tokenizer", root / "generation"
    for folder in (model, tokenizer, generation):
        folder.mkdir()
    for path in llama_dir.iterdir():
        weights_or_config = path.name in ("config.json", "generation_config.json") or path.suffix == ".safetensors"
        shutil.copy(path, (model if weights_or_config else tokenizer) / path.name)
    (generation / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": 0, "eos_token_id": 1, "do_sample": True, "temperature": 0.5, "top_k": 7,
         "max_new_tokens": 3}))
    return model, tokenizer, generation


@pytest.fixture(scope="module")
def tls(tmp_path_factory):
    """(key file, certificate file, an SSL context trusting them) from a throwaway CA."""
    import ssl

    import trustme

    root = tmp_path_factory.mktemp("tls")
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1")
    key_path, cert_path = root / "key.pem", root / "cert.pem"
    cert.private_key_pem.write_to_path(str(key_path))
    cert_path.write_bytes(b"".join(blob.bytes() for blob in cert.cert_chain_pems))
    context = ssl.create_default_context()
    ca.configure_trust(context)
    return key_path, cert_path, context


def test_vllm_flags_on_a_real_server(split_checkpoint, tls, tmp_path):
    from transformers import AutoTokenizer

    model, tokenizer_dir, generation = split_checkpoint
    key, cert, context = tls
    server = CLIServer(model, "--tokenizer", str(tokenizer_dir), "--chat-template", OVERRIDE_TEMPLATE,
                       "--generation-config", str(generation), "--max-logprobs", "2", "--allowed-origins",
                       json.dumps([ORIGIN]), "--root-path", "/api", "--enable-log-requests", "--uvicorn-log-level",
                       "info", "--ssl-keyfile", str(key), "--ssl-certfile", str(cert), "--no-engine-process",
                       "--served-model-name", "tiny", log_dir=tmp_path)
    try:
        assert server.url.startswith("https://")
        with httpx.Client(base_url=server.url, verify=context, timeout=60) as client:
            check_root_path(client)
            check_cors(client)
            check_tokenizer_and_chat_template(client, AutoTokenizer.from_pretrained(str(tokenizer_dir)))
            check_generation_config_defaults(client)
            check_max_logprobs(client)
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(30) == 0, server.logs()
        server.log.seek(0)
        request_logs = [line for line in server.log.read().decode().splitlines() if "asyncengine.api.serving" in line]
        assert len(request_logs) == 3 and all("temperature=0.5" in line and "top_k=7" in line
                                              for line in request_logs), request_logs
    finally:
        server.kill()


def check_root_path(client: httpx.Client) -> None:
    """Behind a proxy that keeps the prefix or strips it, the routes answer; the OpenAPI document names it."""
    assert client.get("/api/v1/models").json()["data"][0]["id"] == "tiny"
    assert client.get("/v1/models").status_code == 200
    assert client.get("/openapi.json").json()["servers"] == [{"url": "/api"}]


def check_cors(client: httpx.Client) -> None:
    preflight = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization"}
    allowed = client.options("/v1/completions", headers={"Origin": ORIGIN, **preflight})
    assert allowed.status_code == 200 and allowed.headers["access-control-allow-origin"] == ORIGIN
    refused = client.options("/v1/completions", headers={"Origin": "https://evil.example", **preflight})
    assert refused.status_code == 400 and "access-control-allow-origin" not in refused.headers
    simple = client.get("/v1/models", headers={"Origin": ORIGIN})
    assert simple.headers["access-control-allow-origin"] == ORIGIN


def check_tokenizer_and_chat_template(client: httpx.Client, tokenizer) -> None:
    ids = client.post("/tokenize", json={"prompt": "Hello world"}).json()["tokens"]
    assert ids == tokenizer("Hello world").input_ids
    chat = client.post("/tokenize", json={"messages": [{"role": "user", "content": "Hi"}]}).json()["tokens"]
    assert chat == tokenizer("<<Hi>>", add_special_tokens=False).input_ids  # the override, not the checkpoint's


def check_generation_config_defaults(client: httpx.Client) -> None:
    """max_new_tokens 3 from the generation config when a request sets no max_tokens; its own value wins."""
    messages = [{"role": "user", "content": "Hi"}]
    unset = client.post("/v1/chat/completions", json={"messages": messages, "ignore_eos": True}).json()
    assert unset["usage"]["completion_tokens"] == 3 and unset["choices"][0]["finish_reason"] == "length"
    own = client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 5, "ignore_eos": True}).json()
    assert own["usage"]["completion_tokens"] == 5


def check_max_logprobs(client: httpx.Client) -> None:
    ok = client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 2, "logprobs": 2})
    assert ok.status_code == 200 and len(ok.json()["choices"][0]["logprobs"]["token_logprobs"]) == 2
    too_many = client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 2, "logprobs": 3})
    assert too_many.status_code == 400 and too_many.json()["error"]["param"] == "logprobs"
    chat = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}],
                                                      "max_tokens": 2, "logprobs": True, "top_logprobs": 3})
    assert chat.status_code == 400 and chat.json()["error"]["param"] == "top_logprobs"


"""`asyncengine serve --engine-process` (the default) as a subprocess on the default model: streaming through the
official openai client gives the non-streamed text, /metrics reads the core's counters, SIGTERM stops both
processes with status 0 (the engine process ignores signals sent to it), and a server killed outright takes its
engine process with it (no orphan holding the model's memory)."""

from __future__ import annotations

import concurrent.futures
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import httpx
import openai

from asyncengine.engine_core import OPENMP_WAIT_SETTINGS
from test_server_cli import CLIServer

PROMPTS = [f"Now is the winter of our discontent, part {i}" for i in range(8)]


def engine_process_of(pid: int) -> int:
    """The pid of the server's engine core: its child started by multiprocessing's spawn (the other child, if
    any, is multiprocessing's resource tracker)."""
    children = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        children += [int(c) for c in (task / "children").read_text().split()]
    cores = [c for c in children if b"spawn_main" in Path(f"/proc/{c}/cmdline").read_bytes()]
    assert len(cores) == 1, children
    return cores[0]


def openmp_wait_policy(pid: int) -> Optional[str]:
    """OMP_WAIT_POLICY in a process's environment as it started (None: not set)."""
    for entry in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
        if entry.startswith(b"OMP_WAIT_POLICY="):
            return entry.split(b"=", 1)[1].decode()
    return None


def policies(pid: int) -> set[int]:
    """The CPU scheduling policies of a process's threads (os.SCHED_*)."""
    policies = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            policies.add(os.sched_getscheduler(int(task.name)))
        except ProcessLookupError:  # a thread that ended meanwhile
            pass
    return policies


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"  # a zombie has exited; only its parent has not collected it yet


def wait_gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not alive(pid)


def test_streams_metrics_and_sigterm_stop_both_processes(tmp_path):
    server = CLIServer(None, "--engine-process", "--max-model-len", "512", "--api-cpu-priority", "idle",
                       log_dir=tmp_path, num_kv_blocks=256)
    try:
        core_pid = engine_process_of(server.proc.pid)
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        model = client.models.list().data[0].id

        def streamed(prompt: str) -> str:
            chunks = client.completions.create(model=model, prompt=prompt, max_tokens=24, temperature=0, stream=True)
            return "".join(c.choices[0].text for c in chunks if c.choices)

        def whole(prompt: str) -> str:
            return client.completions.create(model=model, prompt=prompt, max_tokens=24, temperature=0).choices[0].text

        with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
            streamed_texts = list(pool.map(streamed, PROMPTS))
        assert streamed_texts == [whole(p) for p in PROMPTS]
        assert all(streamed_texts)
        # the server serves from idle CPU time (--api-cpu-priority idle); its engine process, started before,
        # keeps normal priority
        assert policies(server.proc.pid) == {os.SCHED_IDLE}
        assert policies(core_pid) == {os.SCHED_OTHER}
        # and its OpenMP threads sleep when they wait instead of spinning, which would starve the idle server
        # (unless whoever runs the tests chose a wait policy for it)
        chosen = any(name in os.environ for name in OPENMP_WAIT_SETTINGS)
        assert openmp_wait_policy(core_pid) == (os.environ.get("OMP_WAIT_POLICY") if chosen else "PASSIVE")

        # a Ctrl-C or a group-wide SIGTERM reaches the engine process too: it waits for the server's word
        os.kill(core_pid, signal.SIGINT)
        os.kill(core_pid, signal.SIGTERM)
        time.sleep(0.5)
        assert alive(core_pid) and whole(PROMPTS[0]) == streamed_texts[0]

        metrics = httpx.get(server.url + "/metrics", timeout=10).text
        prompt_tokens = [line for line in metrics.splitlines() if line.startswith("vllm:prompt_tokens_total")]
        assert prompt_tokens and float(prompt_tokens[0].split()[-1]) > 0, prompt_tokens

        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(20) == 0, server.logs()
        assert wait_gone(core_pid, 10), "the engine process outlived the server"
        assert "the engine is dead" not in server.logs()  # a shutdown is not a death
    finally:
        server.kill()


def test_a_killed_server_takes_its_engine_process_with_it(tmp_path):
    server = CLIServer(None, "--engine-process", "--max-model-len", "512", log_dir=tmp_path, num_kv_blocks=256)
    try:
        core_pid = engine_process_of(server.proc.pid)
        assert policies(server.proc.pid) == policies(core_pid) == {os.SCHED_OTHER}  # the default priority
        assert openmp_wait_policy(core_pid) == os.environ.get("OMP_WAIT_POLICY")  # and libgomp's own waiting
        server.proc.kill()
        server.proc.wait(10)
        assert wait_gone(core_pid, 10), "the engine process outlived its killed server"
    finally:
        server.kill()


def test_an_engine_process_that_dies_while_idle_turns_503_and_the_server_exits_1(tmp_path):
    server = CLIServer(None, "--max-model-len", "512", log_dir=tmp_path, num_kv_blocks=256)
    try:
        assert httpx.get(server.url + "/health", timeout=10).status_code == 200
        os.kill(engine_process_of(server.proc.pid), signal.SIGKILL)
        deadline = time.monotonic() + 5
        while (health := httpx.get(server.url + "/health", timeout=10)).status_code == 200:
            assert time.monotonic() < deadline, "/health still 200 five seconds after the engine process died"
            time.sleep(0.02)
        refused = httpx.post(server.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=10)
        code = server.proc.wait(15)
    finally:
        server.kill()
    assert health.status_code == 503 and refused.status_code == 503
    assert code == 1, server.logs()
    assert "the engine process exited" in server.logs()


def test_an_engine_process_that_cannot_start_exits_2_with_the_reason():
    result = subprocess.run([sys.executable, "-m", "asyncengine.api", "serve", "--engine-process", "--port", "0",
                             "--num-kv-blocks", "2"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr[-2000:]
    assert "could not start" in result.stderr and "KV cache" in result.stderr


def test_two_quick_interrupts_stop_both_processes_with_status_0(tmp_path):
    """Ctrl-C twice: the second skips the drain, and arriving while the engine process stops it is not a
    KeyboardInterrupt traceback."""
    server = CLIServer(None, "--max-model-len", "512", log_dir=tmp_path, num_kv_blocks=256)
    try:
        core_pid = engine_process_of(server.proc.pid)
        assert httpx.get(server.url + "/health", timeout=10).status_code == 200  # serving: the handlers are in
        server.proc.send_signal(signal.SIGINT)
        time.sleep(0.05)
        server.proc.send_signal(signal.SIGINT)
        code = server.proc.wait(20)
    finally:
        server.kill()
    assert code == 0 and "Traceback" not in server.logs(), server.logs()
    assert wait_gone(core_pid, 10)

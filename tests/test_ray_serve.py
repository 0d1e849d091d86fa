"""Ray Serve replicas (asyncengine/ray_serve.py): `asyncengine serve --ray-replicas 2 -tp 2` (each replica
tensor-parallel over two ranks) in a subprocess, with a private Ray of its own, answers the official openai client from both replicas (streaming and not, over SSE and
the WebSocket, with the API key); a replica killed mid-stream by Ray (ray.kill of its actor), and one whose engine
dies (Ray's health check through `check_health`), are both replaced by Ray, and later requests succeed; every
socket of that Ray listens on loopback; SIGTERM shuts Serve and Ray down
with exit status 0 and no process left behind. `serve run asyncengine.ray_serve:build_app ...`'s arguments are
checked without a cluster (they build the same deployment).

One Ray for the module: the tests below share it in order, and the last one stops it. On 2 cores shared with
other work, starting Ray and two replicas took 54 s (load average 6) to 128 s (load 16), replacing both replicas
31-97 s, the whole module 99-248 s: hence `slow`. The ps/proc checks find the processes of this Ray by
the RAY_TMPDIR in their environment (every process it starts inherits it)."""

from __future__ import annotations

import asyncio
import json
import os
import queue
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
from listening import listening_sockets

pytest.importorskip("ray.serve")  # the `ray` extra, part of the `test` extra

from asyncengine.ray_serve import (  # noqa: E402
    DEFAULT_MAX_ONGOING_REQUESTS,
    REPLICA_HEADER,
    build_app,
    parse_serve_args,
)

# Alone (tests/machine_share.py): a Ray of its own with four engine ranks loads both cores; beside the other
# xdist worker's tests, a helper that kills a replica timed out after 120 s.
pytestmark = pytest.mark.alone

API_KEY = "ray-serve-test-key"
MODEL = "asyncengine-default"
STARTUP_TIMEOUT = 240  # seconds for Ray, Serve's proxy and two replicas to come up on a loaded machine
REPLACE_TIMEOUT = 150  # seconds for Ray to notice a dead replica and bring up its successor


# -- processes -------------------------------------------------------------------------------------------------
def processes_marked(ray_tmp: str) -> dict[int, str]:
    """pid -> command line of every process whose environment holds our RAY_TMPDIR: the CLI, Ray's own processes
    (GCS, raylet, agents, workers: they inherit the driver's environment) and the engines' core processes."""
    found = {}
    marker = f"RAY_TMPDIR={ray_tmp}".encode()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if marker not in f.read().split(b"\0"):
                    continue
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                found[int(entry)] = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:  # gone meanwhile, or not ours
            continue
    return found


def parent_of(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


def replica_processes(ray_tmp: str) -> list[int]:
    return [pid for pid, cmd in processes_marked(ray_tmp).items() if cmd.startswith("ray::ServeReplica")]


def engine_core_of(replica_pid: int, ray_tmp: str) -> int:
    """The engine core process (--engine-process, the default) a replica's AsyncLLMEngine started."""
    marked = processes_marked(ray_tmp)
    cores = [pid for pid, cmd in marked.items() if "spawn_main" in cmd and parent_of(pid) == replica_pid]
    assert len(cores) == 1, (replica_pid, marked)
    return cores[0]


class RayServeCLI:
    """`asyncengine serve --ray-replicas 2` in a subprocess whose Ray keeps its files under a temp dir of its own
    (short: Ray's socket paths must stay under the 107 bytes of a Unix socket's name)."""

    def __init__(self, log_dir: Path):
        self.ray_tmp = tempfile.mkdtemp(prefix="aer-", dir="/tmp")
        self.log = open(log_dir / "ray-serve-cli.log", "w+b")
        cmd = [sys.executable, "-m", "asyncengine.api", "serve", "--host", "127.0.0.1", "--port", "0",
               "--api-key", API_KEY, "--num-kv-blocks", "200", "--max-num-seqs", "8", "--log-level", "warning",
               "--shutdown-timeout", "20", "--ray-replicas", "2", "--ray-actor-options", '{"num_cpus": 0.5}',
               "--tensor-parallel-size", "2"]  # each replica: rank 0 in its engine core, rank 1 a child of that
        # Ray's token authentication with a token of this test's own, so that `ray_driver` can join this Ray
        self.ray_env = {"RAY_TMPDIR": self.ray_tmp, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)}
        env = {**os.environ, **self.ray_env, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
               "TOKENIZERS_PARALLELISM": "false", "RAY_USAGE_STATS_ENABLED": "0"}
        self.started = time.monotonic()
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=self.log, env=env)
        self.url = self._wait_for_address()
        self.ready_after = time.monotonic() - self.started

    def _wait_for_address(self) -> str:
        """The URL from the `asyncengine serving on URL` line (Ray forwards the replicas' output to our stdout, so
        other lines may come first)."""
        lines: queue.Queue = queue.Queue()

        def read() -> None:
            for line in self.proc.stdout:
                lines.put(line.decode(errors="replace"))
            lines.put(None)

        threading.Thread(target=read, daemon=True).start()
        deadline = time.monotonic() + STARTUP_TIMEOUT
        while time.monotonic() < deadline:
            try:
                line = lines.get(timeout=deadline - time.monotonic())
            except queue.Empty:
                break
            if line is None:
                raise AssertionError(f"the server exited ({self.proc.wait()}):\n{self.logs()}")
            match = re.match(r"asyncengine serving on (http://127\.0\.0\.1:\d+)$", line.strip())
            if match:
                return match.group(1)
        self.stop(signal.SIGKILL)
        raise AssertionError(f"no address within {STARTUP_TIMEOUT} s:\n{self.logs()}")

    def ray_driver(self, script: str, *args: str) -> str:
        """Run `script` (Python, with ray imported and connected to this server's Ray) in a driver process of its
        own, so that this process never joins a Ray; its stdout."""
        prelude = ("import json, os, sys, ray\n"
                   "ray.init(address='auto', logging_level='ERROR', log_to_driver=False)\n")
        env = {**os.environ, **self.ray_env, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}  # Ray on loopback
        done = subprocess.run([sys.executable, "-c", prelude + script, *args], env=env, capture_output=True,
                              text=True, timeout=120)
        assert done.returncode == 0, done.stderr[-3000:]
        return done.stdout

    def logs(self) -> str:
        self.log.seek(0)
        return self.log.read().decode(errors="replace")[-4000:]

    def stop(self, sig=signal.SIGTERM, timeout: float = 90) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        return self.proc.wait(timeout)

    def cleanup(self) -> None:
        """Whatever a failed test left: kill the CLI and every process of its Ray, remove the temp dir."""
        if self.proc.poll() is None:
            self.stop(signal.SIGKILL, 30)
        for pid in processes_marked(self.ray_tmp):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        shutil.rmtree(self.ray_tmp, ignore_errors=True)
        self.log.close()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    cli = RayServeCLI(tmp_path_factory.mktemp("ray-serve"))
    yield cli
    cli.cleanup()


@pytest.fixture
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)


# -- requests --------------------------------------------------------------------------------------------------
def complete(client: openai.OpenAI, prompt: str = "ROMEO:") -> tuple[str, str]:
    """A greedy completion: (the replica that answered, its text)."""
    raw = client.completions.with_raw_response.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0)
    return raw.headers[REPLICA_HEADER], raw.parse().choices[0].text


def stream_chat(client: openai.OpenAI) -> tuple[str, str]:
    """A greedy streamed chat completion over SSE: (the replica that answered, the text of its deltas)."""
    with client.chat.completions.with_streaming_response.create(
            model=MODEL, messages=[{"role": "user", "content": "Who is Romeo?"}], max_tokens=8, temperature=0,
            stream=True) as response:
        replica = response.headers[REPLICA_HEADER]
        text = "".join(chunk.choices[0].delta.content or "" for chunk in response.parse() if chunk.choices)
    return replica, text


def until_both_replicas(call, tries: int = 30) -> dict[str, str]:
    """Call until two replicas have answered: replica -> its answer."""
    answers: dict[str, str] = {}
    for _ in range(tries):
        replica, text = call()
        answers[replica] = text
        if len(answers) == 2:
            return answers
    raise AssertionError(f"only {sorted(answers)} answered in {tries} requests")


# -- the tests, in order: they share one server ------------------------------------------------------------------
@pytest.mark.slow
def test_two_replicas_answer_the_openai_client_streaming_and_not(server, client):
    print(f"Ray, Serve and two replicas up in {server.ready_after:.1f} s")
    completions = until_both_replicas(lambda: complete(client))
    chats = until_both_replicas(lambda: stream_chat(client))
    assert set(completions) == set(chats), (completions, chats)
    # the same weights, greedy: both replicas give the same text, and it is not empty
    assert len(set(completions.values())) == 1 and next(iter(completions.values())), completions
    assert len(set(chats.values())) == 1 and next(iter(chats.values())), chats
    assert [m.id for m in client.models.list().data] == [MODEL]
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0).models.list()
    assert httpx.get(server.url + "/health", timeout=30).status_code == 200  # open without a key, as served alone


@pytest.mark.slow
def test_the_private_ray_listens_on_loopback_only(server):
    """Every socket our Ray's processes listen on is on 127.0.0.1 (--host): Serve's HTTP proxy, Ray's own servers,
    and each replica's gRPC server for calls between deployments (which Ray Serve binds to [::] unless
    ray_serve.bind_internal_grpc_to moves it). Serve's gRPC proxy is off: it would listen on [::]:9000."""
    processes = processes_marked(server.ray_tmp)
    sockets = listening_sockets(processes)
    elsewhere = [(address, port, processes[pid][:200]) for address, port, pid in sockets if address != "127.0.0.1"]
    assert sockets and not elsewhere, elsewhere
    http_port = int(server.url.rsplit(":", 1)[1])
    assert any(port == http_port and processes[pid].startswith("ray::ProxyActor") for _, port, pid in sockets)
    assert not any(port == 9000 for _, port, _ in sockets), "Serve's gRPC proxy listens (default port 9000)"


@pytest.mark.slow
def test_the_websocket_is_carried_by_ray_serves_proxy(server):
    import websockets

    async def one_request() -> tuple[str, list[dict]]:
        url = server.url.replace("http://", "ws://") + "/v1/ws"
        async with websockets.connect(url, additional_headers={"Authorization": f"Bearer {API_KEY}"}) as ws:
            replica = ws.response.headers[REPLICA_HEADER]
            await ws.send(json.dumps({"id": 7, "type": "completion", "model": MODEL, "prompt": "ROMEO:",
                                      "max_tokens": 8, "temperature": 0}))
            messages = []
            while not messages or messages[-1].get("type") != "done":
                messages.append(json.loads(await asyncio.wait_for(ws.recv(), 60)))
            return replica, messages

    replica, messages = asyncio.run(one_request())
    assert replica.startswith("SERVE_REPLICA::")
    chunks = [m for m in messages if m.get("object") == "text_completion"]
    assert all(m["id"] == 7 for m in messages) and chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert "".join(c["choices"][0]["text"] for c in chunks) == complete(openai.OpenAI(
        base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60))[1]


def stream_in_thread(client: openai.OpenAI, max_tokens: int) -> tuple[threading.Thread, threading.Event, dict]:
    """A streamed completion read by a thread: (the thread, set at its first token, {"replica" that answers,
    "text", "finish", "error"})."""
    first, result = threading.Event(), {"replica": None, "text": "", "finish": None, "error": None}

    def read() -> None:
        try:
            with client.completions.with_streaming_response.create(
                    model=MODEL, prompt="ROMEO:", max_tokens=max_tokens, temperature=0, stream=True,
                    extra_body={"ignore_eos": True}) as response:
                result["replica"] = response.headers[REPLICA_HEADER]
                for chunk in response.parse():
                    result["text"] += chunk.choices[0].text
                    result["finish"] = chunk.choices[0].finish_reason or result["finish"]
                    first.set()
        except Exception as exc:  # noqa: BLE001 - the test reports it
            result["error"] = exc
        first.set()

    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    return thread, first, result


# In a driver of the server's Ray: each named replica's pid, then ray.kill of the first one's actor (Ray's replica
# ids in the response header are the names of their actors in Serve's namespace).
KILL_FIRST_REPLICA = """
actors = {name: ray.get_actor(name, namespace="serve") for name in sys.argv[1:]}
pids = {name: ray.get(actor.__ray_call__.remote(lambda self: os.getpid()), timeout=60) for name, actor in actors.items()}
ray.kill(actors[sys.argv[1]])
print(json.dumps(pids))
"""


@pytest.mark.slow
def test_killed_replica_and_dead_engine_are_replaced_by_ray(server, client):
    first_answers = until_both_replicas(lambda: complete(client))
    before = set(first_answers)
    # The replica running a stream is killed mid-run by Ray (ray.kill of its actor, as an operator or Ray's OOM
    # killer would end it); the other's engine dies under it, which only its check_health tells Ray about (the
    # process itself lives on, answering 503). Serve's controller replaces both.
    thread, first, streamed = stream_in_thread(client, max_tokens=1500)  # runs for many seconds
    assert first.wait(60) and streamed["finish"] is None, streamed
    victim = streamed["replica"]
    (other,) = before - {victim}
    pids = json.loads(server.ray_driver(KILL_FIRST_REPLICA, victim, other))
    os.kill(engine_core_of(pids[other], server.ray_tmp), signal.SIGKILL)
    killed_at = time.monotonic()
    # The stream ends with an error (the proxy's, for a replica gone), soon, rather than hanging or finishing as
    # if complete.
    thread.join(30)
    assert not thread.is_alive() and streamed["finish"] is None, streamed
    assert isinstance(streamed["error"], openai.APIError) and not isinstance(streamed["error"],
                                                                              openai.APITimeoutError), streamed
    print(f"the stream in flight ended with {streamed['error']!r} after {time.monotonic() - killed_at:.1f} s")
    answered: dict[str, str] = {}
    while len(set(answered) - before) < 2:
        assert time.monotonic() - killed_at < REPLACE_TIMEOUT, (answered, server.logs())
        try:
            replica, text = complete(client)
            answered[replica] = text
        except (openai.APIStatusError, openai.APIConnectionError):  # 503 from the dead engine, or no replica yet
            time.sleep(0.5)
    print(f"both replicas replaced {time.monotonic() - killed_at:.1f} s after the kills")
    new = set(answered) - before
    assert len(new) == 2 and not new & before
    assert {answered[r] for r in new} == set(first_answers.values())  # the successors answer as the first did
    assert pids[victim] not in replica_processes(server.ray_tmp), "ray.kill ended the replica's process"
    assert stream_chat(client)[1]


@pytest.mark.slow
def test_sigterm_drains_then_stops_serve_and_ray_and_leaves_no_process(server, client):
    assert processes_marked(server.ray_tmp)  # the check below can see them
    thread, first, result = stream_in_thread(client, max_tokens=48)
    assert first.wait(60) and result["finish"] is None, result
    stopped_at = time.monotonic()
    assert server.stop(signal.SIGTERM) == 0, server.logs()
    thread.join(30)
    # the stream in flight at SIGTERM was drained (up to --shutdown-timeout), not cut
    assert result["error"] is None and result["finish"] == "length", result
    deadline = time.monotonic() + 30
    while processes_marked(server.ray_tmp) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert processes_marked(server.ray_tmp) == {}, server.logs()
    print(f"stopped in {time.monotonic() - stopped_at:.1f} s")


# -- `serve run asyncengine.ray_serve:build_app key=value ...`: its arguments, without a cluster ---------------------
def test_build_app_reads_serve_flags_and_passes_deployment_options_through():
    app = build_app({"model": "/models/m", "max-num-seqs": "8", "enable_prefix_caching": "false", "api-key": "k",
                     "no-ui": "true", "enable-auto-tool-choice": "false",
                     "served-model-name": ["a", "b"], "num_replicas": "auto",
                     "autoscaling_config": '{"min_replicas": 1}', "ray_actor_options": '{"num_cpus": 2}'})
    deployment = app._bound_deployment
    args = deployment.init_args[0]
    assert (args.model_option, args.max_num_seqs, args.enable_prefix_caching, args.api_key) == ("/models/m", 8,
                                                                                               False, "k")
    assert args.served_model_name == ["a", "b"]
    assert args.no_ui and not args.enable_auto_tool_choice
    assert deployment.ray_actor_options["num_cpus"] == 2
    assert deployment._deployment_config.autoscaling_config.min_replicas == 1
    assert deployment._deployment_config.max_ongoing_requests == DEFAULT_MAX_ONGOING_REQUESTS
    fixed = build_app({"num_replicas": "3", "max_ongoing_requests": "16"})._bound_deployment
    assert (fixed.num_replicas, fixed._deployment_config.max_ongoing_requests) == (3, 16)


def test_a_replica_takes_one_gpu_per_rank_and_refuses_ray_workers_of_its_own(monkeypatch):
    import torch

    from asyncengine.api.cli import build_parser
    from asyncengine.ray_serve import deployment_options

    def options(*flags):
        return deployment_options(build_parser().parse_args(["serve", "--ray-replicas", "2", *flags]))

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # the option Ray needs on a GPU machine
    assert options("-tp", "4")["ray_actor_options"] == {"num_gpus": 4}
    assert options()["ray_actor_options"] == {"num_gpus": 1}
    assert options("-tp", "4", "--device", "cpu")["ray_actor_options"] == {}
    with pytest.raises(ValueError, match="--distributed-executor-backend"):
        options("-tp", "2", "--distributed-executor-backend", "ray")
    with pytest.raises(ValueError, match="--distributed-executor-backend"):
        build_app({"tensor-parallel-size": "2", "distributed-executor-backend": "ray"})


@pytest.mark.parametrize("values, message", [
    ({"max-num-seqs": "many"}, "--max-num-seqs"),
    ({"no-such-flag": "1"}, "--no-such-flag"),
    ({"no-such-switch": "false"}, "--no-such-switch"),
    ({"port": "8000"}, "http_options"),
    ({"host": "0.0.0.0"}, "http_options"),
])
def test_build_app_refuses_bad_arguments_naming_them(values, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        parse_serve_args(values)


# -- `asyncengine serve --ray-replicas`: refused before Ray starts -----------------------------------------------
def test_ray_replicas_without_ray_names_the_extra(monkeypatch, capsys):
    from asyncengine.api.cli import main

    monkeypatch.setitem(sys.modules, "ray", None)  # as where Ray is not installed: `import ray` fails
    assert main(["serve", "--ray-replicas", "2"]) == 2
    assert "pip install 'asyncengine[ray]'" in capsys.readouterr().err


@pytest.mark.parametrize("flags, message", [
    (["--ray-replicas", "2", "--ray-autoscaling-config", '{"max_replicas": 4}'], "--ray-replicas auto"),
    (["--ray-replicas", "auto"], "--ray-autoscaling-config"),
    (["--ray-replicas", "2", "--root-path", "/llm"], "--root-path"),
    (["--ray-replicas", "2", "--ssl-keyfile", "key.pem"], "--ssl-certfile"),
    (["--ray-replicas", "2", "--max-num-seqs", "0"], "max_num_seqs"),
    (["--ray-replicas", "2", "--api-cpu-priority", "idle"], "--api-cpu-priority"),
])
def test_ray_replicas_refuses_bad_flags_before_starting_ray(flags, message, capsys):
    from asyncengine.api.cli import main

    assert main(["serve", *flags]) == 2
    err = capsys.readouterr().err
    assert message in err and "error" in err
    import ray

    assert not ray.is_initialized()


@pytest.mark.parametrize("value", ["0", "-1", "two"])
def test_ray_replicas_must_be_a_positive_number_or_auto(value, capsys):
    from asyncengine.api.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--ray-replicas", value])
    assert exit_info.value.code == 2 and "--ray-replicas" in capsys.readouterr().err

"""What serving costs on CPU: offline `LLM.generate` against the same prompts served over HTTP (issue 6).

    python -m loadtest.bench_cpu_serving [--out results/bench_cpu_serving.json] [--repeats 2]

With the default model (the one shipped in the package) on CPU:
  offline  `LLM.generate` of N prompts (greedy, ignore_eos, max_tokens M) in one call: output tokens / wall time
  served   the same engine settings behind `create_app` + hypercorn, started in this process (its own thread and
           event loop), driven by `loadtest.run_benchmark` with N concurrent streaming clients sending the same
           prompts as token-id lists: output tokens / (first send -> last stream end)
The ratio served / offline is the share of the engine's throughput that the HTTP + SSE layer keeps (target
>= 0.9). Both sides are warmed up with the same shapes, then timed back to back --trials times. `--client subprocess` runs the load generator in
its own process (`python -m loadtest`), so that its Python work does not share this process's GIL with the server.
Prints one table; writes JSON.

`--compare` (issue 17) adds, timed back to back in every trial on the same prompts: transformers' `generate` with
a static batch of all the prompts (left-padded, greedy, min_new_tokens = max_new_tokens so that every row makes
M tokens, float32), and, with `--baseline-site DIR`, the offline engine of another revision (a non-editable
install of it in DIR: `pip install --no-deps --target DIR <source tree>`), each in a worker process of its own
(PeerWorker says why; until session 21 transformers ran in this process, beside the engine's device thread, and
both sides paid for it). The
table then gives engine / transformers, engine / baseline and served / offline, each the median of the trials'
ratios. Use `--engine-process --client subprocess` for the served side as `asyncengine serve` runs it.
`--quantization int8` quantizes this run's engine (offline and served; the baseline keeps its own defaults).
`--stream-interval N` streams the served requests' tokens in groups of N (EngineConfig.stream_interval).
`--api-cpu-priority idle` runs the server thread under SCHED_IDLE as `asyncengine serve --api-cpu-priority idle`
does; `--client-priority idle` runs the load generator so, standing for clients on other machines (on 2 cores a
normal-priority client takes CPU from the engine it measures).

CPU seconds (issue 17, session 8): every trial also records the CPU time each side spent, which a shared machine's
load does not bias the way it biases wall time: offline, this process's; served, this process's (the server, and the
engine unless --engine-process), the engine process's (--engine-process), and the client process's
(--client subprocess; its start-up included, about 0.7 s here). The table adds them per output token.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Optional

import numpy as np

from .config import BenchmarkConfig
from .datasets import WORDS
from .runner import run_benchmark


def make_prompts(n: int, input_words: int, seed: int) -> list[list[int]]:
    """`n` seeded text prompts of `input_words` common words, as the default model's token ids."""
    from asyncengine.config import default_model_path
    from asyncengine.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(default_model_path())
    rng = np.random.default_rng(seed)
    texts = [" ".join(rng.choice(WORDS, size=input_words).tolist()) for _ in range(n)]
    return [tokenizer(t).input_ids for t in texts]


# -- offline -----------------------------------------------------------------------------------------------------
class Offline:
    """An LLM with the benchmark's engine settings, warmed up; `trial()` times one generate of all prompts."""

    def __init__(self, prompts: list[list[int]], max_tokens: int, engine_kwargs: dict):
        from asyncengine import LLM, SamplingParams

        self.prompts = prompts
        start = time.perf_counter()
        self.llm = LLM(**engine_kwargs)
        self.startup_s = time.perf_counter() - start
        self.params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        self.llm.generate(prompts[: max(1, len(prompts) // 4)], self.params, use_tqdm=False)  # warm-up
        self.llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True), use_tqdm=False)

    def trial(self) -> dict:
        cpu, start = time.process_time(), time.perf_counter()
        outputs = self.llm.generate(self.prompts, self.params, use_tqdm=False)
        elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
        tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
        return {"output_tokens": tokens, "seconds": elapsed, "output_tok_s": tokens / elapsed, "cpu_s": cpu}


class TransformersStaticBatch:
    """transformers' `generate` over all the prompts as one left-padded static batch, greedy, float32."""

    def __init__(self, prompts: list[list[int]], max_tokens: int):
        import torch
        from transformers import AutoModelForCausalLM

        from asyncengine.config import default_model_path

        self.model = AutoModelForCausalLM.from_pretrained(default_model_path(), dtype=torch.float32).eval()
        pad = self.model.config.pad_token_id
        width = max(len(p) for p in prompts)
        self.input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
        self.attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        self.max_tokens, self.pad = max_tokens, pad
        self._generate(4)  # warm-up

    def _generate(self, rows: int):
        import torch

        with torch.inference_mode():
            return self.model.generate(self.input_ids[:rows], attention_mask=self.attention_mask[:rows],
                                       max_new_tokens=self.max_tokens, min_new_tokens=self.max_tokens,
                                       do_sample=False, pad_token_id=self.pad)

    def trial(self) -> dict:
        start = time.perf_counter()
        out = self._generate(self.input_ids.shape[0])
        elapsed = time.perf_counter() - start
        tokens = (out.shape[1] - self.input_ids.shape[1]) * out.shape[0]
        return {"output_tokens": tokens, "seconds": elapsed, "output_tok_s": tokens / elapsed}


class PeerWorker:
    """A peer of this run's offline engine in a process of its own: one trial per line written to its stdin (so
    that its trials interleave with this run's), results as JSON lines on its stdout; its first line describes
    what it loaded. A process of its own so that each side is the only thread of its process running torch: two
    threads of one process that run torch's OpenMP regions make every region of both pay a futex wake-up
    (asyncengine.pooling_engine.build_engine_on_its_thread), which would slow whichever side shared the process.
    worker_args: this module's hidden worker flags (--offline-worker or --transformers-worker and their inputs)."""

    def __init__(self, worker_args: list[str], env: Optional[dict] = None):
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "loadtest.bench_cpu_serving", *worker_args],
            cwd=tempfile.gettempdir(), env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.info = self._read()

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the worker {self.proc.args[3:]} exited ({self.proc.wait()})")
        return json.loads(line)

    def trial(self) -> dict:
        self.proc.stdin.write("trial\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(60)


def baseline_worker(site: str, prompts_path: str, max_tokens: int, torch_threads: Optional[int]) -> PeerWorker:
    """The offline engine of another revision, installed in `site`."""
    repo = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([site, repo])}  # the baseline's asyncengine first
    worker = PeerWorker(["--offline-worker", prompts_path, *_worker_flags(max_tokens, torch_threads)], env)
    if not worker.info["asyncengine"].startswith(str(Path(site).resolve())):
        worker.close()
        raise RuntimeError(f"the baseline worker imported {worker.info['asyncengine']}, not the one in {site}")
    return worker


def transformers_worker(prompts_path: str, max_tokens: int, torch_threads: Optional[int]) -> PeerWorker:
    """transformers' static batch (TransformersStaticBatch)."""
    repo = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [repo, os.environ.get("PYTHONPATH")]))}
    return PeerWorker(["--transformers-worker", prompts_path, *_worker_flags(max_tokens, torch_threads)], env)


def _worker_flags(max_tokens: int, torch_threads: Optional[int]) -> list[str]:
    return ["--max-tokens", str(max_tokens)] + (["--torch-threads", str(torch_threads)] if torch_threads else [])


def serve_worker_trials(prompts_path: str, max_tokens: int, kind: str) -> int:
    """A PeerWorker's side: load and warm up (`kind` offline: the asyncengine on the path; transformers), report,
    then one trial per line read."""
    prompts = [json.loads(line)["prompt"] for line in open(prompts_path)]
    if kind == "offline":
        import asyncengine

        peer, info = Offline(prompts, max_tokens, {}), {"asyncengine": str(Path(asyncengine.__file__).resolve())}
    else:
        import transformers

        peer, info = TransformersStaticBatch(prompts, max_tokens), {"transformers": transformers.__version__}
    print(json.dumps(info), flush=True)
    for _ in sys.stdin:
        print(json.dumps(peer.trial()), flush=True)
    return 0


# -- served ------------------------------------------------------------------------------------------------------
class InProcessServer:
    """create_app(AsyncLLMEngine) under hypercorn on 127.0.0.1:ephemeral, in a thread with its own loop."""

    def __init__(self, engine_kwargs: dict, api_cpu_priority: str = "normal"):
        from asyncengine.api import create_app
        from asyncengine.api.cli import bind_socket, url_of
        from asyncengine.async_engine import AsyncLLMEngine
        from asyncengine.config import EngineConfig
        from asyncengine.engine_core import check_api_cpu_priority, let_a_cpu_engine_process_wait_passively

        config = EngineConfig(**engine_kwargs)
        check_api_cpu_priority(config, api_cpu_priority)  # as `asyncengine serve --api-cpu-priority`
        let_a_cpu_engine_process_wait_passively(config, api_cpu_priority)  # this process's libgomp is loaded
        self.priority = api_cpu_priority
        self.engine = AsyncLLMEngine(config)
        self.app = create_app(self.engine, served_model_name="default")
        self.sock = bind_socket("127.0.0.1", 0)
        self.url = url_of(self.sock)
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._stop: Optional[asyncio.Event] = None
        self._thread: Optional[threading.Thread] = None
        self.error: Optional[BaseException] = None

    def __enter__(self) -> "InProcessServer":
        from asyncengine.api.cli import _run, serve_app

        ready = threading.Event()

        async def main() -> None:
            self._loop = asyncio.get_running_loop()
            self._stop = asyncio.Event()
            ready.set()
            try:
                await serve_app(self.app, self.sock, self._stop, shutdown_timeout=5.0)
            finally:
                await self.engine.shutdown()

        def run() -> None:
            from asyncengine.engine_core import run_threads_at_idle_priority

            if self.priority == "idle":  # this thread and those it starts (the offline side keeps its own)
                run_threads_at_idle_priority([threading.get_native_id()])
            try:
                _run(main())
            except BaseException as exc:  # noqa: BLE001 - reported on exit
                self.error = exc

        self._thread = threading.Thread(target=run, name="bench-server", daemon=True)
        self._thread.start()
        if not ready.wait(30):
            raise RuntimeError("the server's loop did not start")
        deadline = time.monotonic() + 30
        while True:
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as response:
                    if response.status == 200:
                        break
            except OSError:  # refused while starting; urllib's HTTPError and URLError are OSErrors
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("the server did not become healthy within 30 s")
            time.sleep(0.05)
        return self

    def __exit__(self, *exc) -> None:
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(30)
        if self._thread.is_alive():
            raise RuntimeError("the server thread did not stop within 30 s")
        if self.error is not None:
            raise RuntimeError(f"the server failed: {self.error!r}")


def _bench_config(url: str, dataset: str, num: int, max_tokens: int) -> BenchmarkConfig:
    return BenchmarkConfig(base_url=url, model="default", dataset="jsonl", dataset_path=dataset, num_prompts=num,
                           output_len=max_tokens, max_concurrency=num, temperature=0.0, ignore_eos=True,
                           timeout=300.0, progress=False)


def _metrics_of(metrics: dict) -> dict:
    return {"output_tokens": metrics["total_output_tokens"], "seconds": metrics["duration_s"],
            "output_tok_s": metrics["output_throughput"], "completed": metrics["completed"],
            "failed": metrics["failed"], "ttft_ms_median": metrics["latency"]["ttft"]["percentiles"]["p50"],
            "itl_ms_median": metrics["latency"]["itl"]["percentiles"]["p50"]}


def process_cpu_s(pid: int) -> Optional[float]:
    """CPU seconds (user + system) a live process has used so far; None where /proc cannot tell (not Linux)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rpartition(")")[2].split()  # after the command name, which may hold spaces
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime (fields 14, 15)


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)  # the children waited for: the client subprocess
    return usage.ru_utime + usage.ru_stime


# `python -m loadtest` under SCHED_IDLE: the load generator takes only the CPU time the server side leaves
_IDLE_CLIENT = ("import os, runpy, sys; os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0)); "
                "sys.argv[0] = 'loadtest'; runpy.run_module('loadtest', run_name='__main__', alter_sys=True)")


def served_trial(url: str, dataset: str, num: int, max_tokens: int, client: str,
                 engine_pid: Optional[int] = None, client_priority: str = "normal") -> dict:
    """One run of `num` concurrent streams through loadtest (in this process or as `python -m loadtest`, at
    `client_priority`), with the CPU seconds of this process, of the engine process `engine_pid` (if given) and
    of the client process."""
    cpu = {"server": time.process_time(), "client": _children_cpu_s()}
    engine_cpu = process_cpu_s(engine_pid) if engine_pid is not None else None
    if client == "inprocess":
        metrics = asyncio.run(run_benchmark(_bench_config(url, dataset, num, max_tokens))).metrics.to_dict()
    else:
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "run.json"
            launch = ["-c", _IDLE_CLIENT] if client_priority == "idle" else ["-m", "loadtest"]
            cmd = [sys.executable, *launch, "--base-url", url, "--model", "default", "--dataset", "jsonl",
                   "--dataset-path", dataset, "--num-prompts", str(num), "--output-len", str(max_tokens),
                   "--max-concurrency", str(num), "--temperature", "0", "--no-progress", "--result-json", str(out)]
            subprocess.run(cmd, check=True, capture_output=True, timeout=600)
            metrics = json.loads(out.read_text())["metrics"]
    cpu = {"server": time.process_time() - cpu["server"],
           "client": _children_cpu_s() - cpu["client"] if client == "subprocess" else None,
           "engine": None if engine_cpu is None else process_cpu_s(engine_pid) - engine_cpu}
    if metrics["failed"]:
        raise RuntimeError(f"{metrics['failed']} requests failed in a served run")
    return {**_metrics_of(metrics), "cpu_s": cpu}


# -- the run -----------------------------------------------------------------------------------------------------
def run(args: argparse.Namespace) -> dict:
    """Both sides stay loaded; each trial times offline then served back to back, so that both see the same
    machine (a shared VM's speed drifts by tens of percent over a minute). The ratio is the median of the
    trials' ratios."""
    engine_kwargs = {"num_kv_blocks": args.num_kv_blocks} if args.num_kv_blocks else {}
    if args.quantization:
        engine_kwargs["quantization"] = args.quantization  # this run's engine only (not the baseline's)
    prompts = make_prompts(args.num_prompts, args.input_words, args.seed)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        dataset = str(Path(tmp) / "prompts.jsonl")
        with open(dataset, "w") as f:
            for ids in prompts:
                f.write(json.dumps({"prompt": ids, "max_tokens": args.max_tokens}) + "\n")
        offline = Offline(prompts, args.max_tokens, engine_kwargs)
        startup_s = offline.startup_s
        hf = transformers_worker(dataset, args.max_tokens, args.torch_threads) if args.compare else None
        baseline = (baseline_worker(args.baseline_site, dataset, args.max_tokens, args.torch_threads)
                    if args.baseline_site else None)
        with InProcessServer({**engine_kwargs, "engine_process": args.engine_process,
                              "stream_interval": args.stream_interval}, args.api_cpu_priority) as server:
            engine_pid = server.engine.client.process.pid if args.engine_process else None
            # warm-up as Offline's: a quarter of the prompts in full, then every prompt (into the prefix cache)
            served_trial(server.url, dataset, max(1, args.num_prompts // 4), args.max_tokens, args.client)
            served_trial(server.url, dataset, args.num_prompts, 2, args.client)
            for trial in range(args.trials):
                row = {"trial": trial}
                if hf is not None:
                    row["transformers"] = hf.trial()
                if baseline is not None:
                    row["baseline"] = baseline.trial()
                row["offline"] = off = offline.trial()
                row["served"] = served = served_trial(server.url, dataset, args.num_prompts, args.max_tokens,
                                                      args.client, engine_pid, args.client_priority)
                row["ratio"] = served["output_tok_s"] / off["output_tok_s"]
                for peer in ("transformers", "baseline"):
                    if peer in row:
                        row[f"offline_over_{peer}"] = off["output_tok_s"] / row[peer]["output_tok_s"]
                rows.append(row)
                print(f"  trial {trial}: " + ", ".join(f"{k} {row[k]['output_tok_s']:.0f} tok/s" for k in
                      ("transformers", "baseline", "offline", "served") if k in row)
                      + f", served/offline {row['ratio']:.3f}", flush=True)
        for worker in (hf, baseline):
            if worker is not None:
                worker.close()
    import torch

    return {
        "benchmark": "bench_cpu_serving",
        "config": {"num_prompts": args.num_prompts, "input_tokens_mean": float(np.mean([len(p) for p in prompts])),
                   "max_tokens": args.max_tokens, "greedy": True, "ignore_eos": True, "client": args.client,
                   "client_priority": args.client_priority, "api_cpu_priority": args.api_cpu_priority,
                   "engine": engine_kwargs or "defaults", "engine_process": args.engine_process,
                   "stream_interval": args.stream_interval, "seed": args.seed, "trials": args.trials},
        "machine": {"python": platform.python_version(), "torch": torch.__version__, "cpus": os.cpu_count(),
                    "torch_threads": torch.get_num_threads(), "platform": platform.platform()},
        "runs": rows,
        "llm_startup_s": startup_s,
        "peers": {k: statistics.median(r[k]["output_tok_s"] for r in rows) for k in ("transformers", "baseline")
                  if k in rows[0]},
        "offline_over_peer_median": {k: statistics.median(r[f"offline_over_{k}"] for r in rows)
                                     for k in ("transformers", "baseline") if k in rows[0]},
        "offline_tok_s_median": statistics.median(r["offline"]["output_tok_s"] for r in rows),
        "served_tok_s_median": statistics.median(r["served"]["output_tok_s"] for r in rows),
        "ratio_median": statistics.median(r["ratio"] for r in rows),
        "cpu_us_per_token_median": cpu_per_token(rows),
    }


def cpu_per_token(rows: list[dict]) -> dict:
    """Median over the trials of each side's CPU microseconds per output token (None: not measured)."""
    def median_of(values: list) -> Optional[float]:
        return statistics.median(values) if values and None not in values else None

    per_token = {"offline": median_of([1e6 * r["offline"]["cpu_s"] / r["offline"]["output_tokens"] for r in rows])}
    for side in ("server", "engine", "client"):
        per_token[side] = median_of([None if r["served"]["cpu_s"][side] is None
                                     else 1e6 * r["served"]["cpu_s"][side] / r["served"]["output_tokens"]
                                     for r in rows])
    return per_token


def format_table(report: dict) -> str:
    c = report["config"]
    lines = [
        "== asyncengine CPU serving vs offline " + "=" * 42,
        f"{c['num_prompts']} prompts of ~{c['input_tokens_mean']:.0f} tokens, max_tokens {c['max_tokens']} "
        f"(greedy, ignore_eos), default model on CPU ({report['machine']['cpus']} cores, "
        f"{report['machine']['torch_threads']} torch threads), client {c['client']} at "
        f"{c.get('client_priority', 'normal')} priority, server at {c.get('api_cpu_priority', 'normal')}"
        + (", server's engine in its own process" if c.get("engine_process") else "")
        + (f", stream interval {c['stream_interval']}" if c.get("stream_interval", 1) > 1 else ""),
        f"{'trial':>5} {'offline tok/s':>14} {'served tok/s':>13} {'ratio':>7} {'served TTFT ms':>15} "
        f"{'served ITL ms':>14}",
    ]
    for r in report["runs"]:
        s = r["served"]
        lines.append(f"{r['trial']:>5} {r['offline']['output_tok_s']:>14.1f} {s['output_tok_s']:>13.1f} "
                     f"{r['ratio']:>7.3f} {s['ttft_ms_median']:>15.1f} {s['itl_ms_median']:>14.1f}")
    lines.append(f"{'med.':>5} {report['offline_tok_s_median']:>14.1f} {report['served_tok_s_median']:>13.1f} "
                 f"{report['ratio_median']:>7.3f}")
    lines.append(f"ratio served / offline: {report['ratio_median']:.3f} (median of {len(report['runs'])} trials; "
                 "target >= 0.9)")
    for peer, ratio in report.get("offline_over_peer_median", {}).items():
        target = {"transformers": 1.5, "baseline": 3.0}[peer]
        lines.append(f"offline engine / {peer}: {ratio:.2f} (median of the trials' ratios; {peer} median "
                     f"{report['peers'][peer]:.1f} tok/s; target >= {target})")
    lines.append(f"LLM() start-up: {report['llm_startup_s']:.1f} s (target < 10)")
    lines.append("CPU seconds per trial: offline | served: this process (server"
                 + ("" if c.get("engine_process") else " + engine") + "), engine process, client process "
                 "(start-up included)")
    for r in report["runs"]:
        cpu = r["served"]["cpu_s"]
        lines.append(f"{r['trial']:>5} {r['offline']['cpu_s']:>8.2f} | " + " ".join(
            f"{'-' if cpu[k] is None else format(cpu[k], '.2f'):>6}" for k in ("server", "engine", "client")))
    per_token = report["cpu_us_per_token_median"]
    lines.append("CPU us per output token (median): " + ", ".join(
        f"{k} {'-' if v is None else format(v, '.0f')}" for k, v in per_token.items()))
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.bench_cpu_serving",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-words", type=int, default=32, help="words per prompt (about one token each)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--trials", type=int, default=5, help="offline + served pairs, timed back to back")
    parser.add_argument("--client", choices=["inprocess", "subprocess"], default="inprocess")
    parser.add_argument("--num-kv-blocks", type=int, default=None, help="default: the engine's (1 GiB on CPU)")
    parser.add_argument("--torch-threads", type=int, default=None,
                        help="torch intra-op threads for both runs (default: torch's choice, one per core)")
    parser.add_argument("--engine-process", action="store_true",
                        help="the server's engine in a process of its own (EngineConfig.engine_process)")
    parser.add_argument("--api-cpu-priority", default="normal", choices=["normal", "idle"],
                        help="the server thread's CPU priority, as `asyncengine serve --api-cpu-priority` (idle "
                             "needs --engine-process)")
    parser.add_argument("--client-priority", default="normal", choices=["normal", "idle"],
                        help="the load generator's (--client subprocess): idle runs it under SCHED_IDLE, so "
                             "that on a machine of few cores it takes only CPU time the server side leaves, as "
                             "clients on other machines would")
    parser.add_argument("--stream-interval", type=int, default=1,
                        help="the served engine's stream_interval: each stream's tokens in groups of this many")
    parser.add_argument("--compare", action="store_true",
                        help="also time transformers' static-batch generate in every trial")
    parser.add_argument("--baseline-site", default=None,
                        help="also time the offline engine installed in this folder (another revision)")
    parser.add_argument("--quantization", default=None,
                        help="this run's engine (offline and served) quantized so, e.g. int8 (not the baseline)")
    parser.add_argument("--offline-worker", default=None, help=argparse.SUPPRESS)  # PeerWorker sides
    parser.add_argument("--transformers-worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="bench_cpu_serving.json")
    args = parser.parse_args(argv)
    if args.client_priority == "idle" and args.client != "subprocess":
        parser.error("--client-priority idle needs --client subprocess (the in-process client shares this "
                     "process, whose offline side must keep normal priority)")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if args.torch_threads:
        import torch

        torch.set_num_threads(args.torch_threads)
    if args.offline_worker or args.transformers_worker:
        kind = "offline" if args.offline_worker else "transformers"
        return serve_worker_trials(args.offline_worker or args.transformers_worker, args.max_tokens, kind)
    report = run(args)
    print(format_table(report))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

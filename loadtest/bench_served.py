"""Served against offline throughput in one call: the offline engine's W1, then `asyncengine serve` in each
server mode (engine process, then in-process) driven by our load generator with the same W1 prompts, and each
mode's ratio to the offline figure (issues 6 and 19).

    python -m loadtest.bench_served --out results/                        # GPU: Llama-3-8B shape, 1000 prompts
    python -m loadtest.bench_served --out /tmp/b --checkpoint default --num-prompts 8 --input-len 32 \\
        --output-len 16 --workers 2 --engine-args="--dtype float32 --max-model-len 512 --max-num-seqs 16"  # CPU

Every run is measured from a separate process, like a deployment: the offline engine in a child process (so its
memory is gone before the server starts), the server as a subprocess with its own event loop, and the client in
`--workers` client processes. One client process cannot parse the streams of a fast GPU server (FACTS: 46-55
req/s with one, 64-66 with four, against 62 offline), so the default is enough of them that the client is not the
limit. Offline and served runs use the same engine flags (`--engine-args`, parsed by `asyncengine serve`'s own
parser), and the same prompts: W1's token ids, max_tokens and ignore_eos, sent as a JSONL dataset.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import fields
from pathlib import Path

from .bench_offline import build_checkpoint, sharegpt_like
from .config import BenchmarkConfig
from .runner import run_benchmark

ENGINE_ARGS = "--dtype bfloat16 --max-model-len 4096 --max-num-seqs 256 --max-num-batched-tokens 8192"
SERVER_ARGS = ["--host", "127.0.0.1", "--port", "0", "--log-level", "warning"]
MODES = {"engine-process": "--engine-process", "in-process": "--no-engine-process"}
WARMUP_PROMPTS = 32  # compile kernels and capture graphs with real shapes before any timed run


def default_workers() -> int:
    """Client processes: enough that parsing the streams is not the limit (4 sufficed on an H200), leaving cores
    for the server's two processes."""
    return max(1, min(8, (os.cpu_count() or 1) - 3))


def w1_requests(n: int, input_len: int, output_len: int, vocab: int) -> tuple[list[list[int]], list[int]]:
    """W1: n ShareGPT-like requests (bench_offline's seed and length distribution) of these mean lengths."""
    return sharegpt_like(n, input_len, output_len, seed=1, vocab=vocab)


def write_dataset(path: Path, prompts: list[list[int]], outs: list[int]) -> None:
    with open(path, "w") as f:
        for p, o in zip(prompts, outs):
            f.write(json.dumps({"prompt": p, "max_tokens": o}) + "\n")


# -- offline ---------------------------------------------------------------------------------------------------
def engine_config(checkpoint: Path, engine_args: list[str]):
    """The EngineConfig `asyncengine serve CHECKPOINT ENGINE_ARGS` would build: offline runs what is served."""
    from asyncengine.api.cli import build_parser, engine_config as serve_config

    return serve_config(build_parser().parse_args(["serve", str(checkpoint), *engine_args]))


def offline_w1(checkpoint: Path, engine_args: list[str], dataset: Path) -> dict:
    """W1 through the offline `LLM` (after a warm-up, from a cold prefix cache): requests and tokens per second."""
    from asyncengine import LLM, SamplingParams

    config = engine_config(checkpoint, engine_args)
    llm = LLM(**{f.name: getattr(config, f.name) for f in fields(config) if f.init and f.name != "engine_process"})
    rows = [json.loads(line) for line in dataset.read_text().splitlines()]
    prompts, outs = [r["prompt"] for r in rows], [r["max_tokens"] for r in rows]

    def run(n: int) -> float:
        params = [SamplingParams(temperature=1.0, max_tokens=o, ignore_eos=True) for o in outs[:n]]
        llm.reset_prefix_cache()
        start = time.perf_counter()
        results = llm.generate(prompts[:n], params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        produced = sum(len(r.outputs[0].token_ids) for r in results)
        if produced != sum(outs[:n]):
            raise RuntimeError(f"offline W1 produced {produced} tokens, expected {sum(outs[:n])} (ignore_eos)")
        return elapsed

    run(min(WARMUP_PROMPTS, len(prompts)))
    elapsed = run(len(prompts))
    return dict(requests=len(prompts), seconds=elapsed, req_per_s=len(prompts) / elapsed,
                output_tok_per_s=sum(outs) / elapsed)


def offline_in_child(checkpoint: Path, engine_args: list[str], dataset: Path, out: Path) -> dict:
    """offline_w1 in a child process, so that its device memory is released before the server starts."""
    result_path = out / "offline_w1.json"
    cmd = [sys.executable, "-m", __spec__.name, "--offline-worker", "--checkpoint", str(checkpoint),
           f"--engine-args={shlex.join(engine_args)}", "--out", str(out)]
    with open(out / "offline.log", "w") as log:
        if subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT).returncode != 0:
            raise RuntimeError(f"the offline run failed; see {out / 'offline.log'}")
    return json.loads(result_path.read_text())


# -- served ----------------------------------------------------------------------------------------------------
def start_server(checkpoint: Path, log_path: Path, timeout: float = 300.0, extra_args: tuple = (),
                 profile_to: Path | None = None) -> tuple[subprocess.Popen, str]:
    """Start `asyncengine serve`; return it and its base URL once it prints the address it serves on. With
    profile_to, the server runs under cProfile (its main thread: the event loop) and writes the stats there."""
    log = open(log_path, "w")
    profiler = ["-m", "cProfile", "-o", str(profile_to)] if profile_to is not None else []
    proc = subprocess.Popen([sys.executable, "-u", *profiler, "-m", "asyncengine", "serve", str(checkpoint),
                             *SERVER_ARGS, *extra_args], stdout=subprocess.PIPE, stderr=log, text=True)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line and proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}; see {log_path}")
        log.write(line)
        match = re.search(r"(http://127\.0\.0\.1:\d+)", line)
        if match:
            return proc, match.group(1)
    proc.kill()
    raise RuntimeError("server did not start in time")


def stop_server(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def run_rate(url: str, dataset: Path, n: int, rate: float, workers: int) -> dict:
    config = BenchmarkConfig(base_url=url, dataset="jsonl", dataset_path=str(dataset), num_prompts=n,
                             request_rate=rate, temperature=1.0, ignore_eos=True, progress=False, timeout=600.0,
                             goodput={"ttft": 200.0, "tpot": 10.0}, workers=min(workers, n))
    m = asyncio.run(run_benchmark(config)).metrics
    lat = m.latency
    return dict(rate=rate, completed=m.completed, failed=m.failed, req_per_s=m.request_throughput,
                output_tok_per_s=m.output_throughput, ttft_p50_ms=lat["ttft"].median,
                ttft_p99_ms=lat["ttft"].percentiles.get("p99"), tpot_p50_ms=lat["tpot"].median,
                itl_p50_ms=lat["itl"].median, e2el_p50_ms=lat["e2el"].median)


def served_mode(args, checkpoint: Path, dataset: Path, mode: str) -> list[dict]:
    """One server in `mode`: a warm-up, then every rate (unlimited: all prompts; finite: --prompts-per-rate)."""
    out, tag = Path(args.out), f"{args.tag}_{mode.replace('-', '_')}"
    profile_to = out / f"server{tag}.prof" if args.profile_server else None
    extra = (*shlex.split(args.engine_args), *shlex.split(args.serve_args), MODES[mode])
    proc, url = start_server(checkpoint, out / f"server{tag}.log", extra_args=extra, profile_to=profile_to)
    rows = []
    try:
        run_rate(url, dataset, min(WARMUP_PROMPTS, args.num_prompts), math.inf, args.workers)
        for rate_text in args.rates:
            rate = float(rate_text)
            n = args.num_prompts if math.isinf(rate) or args.prompts_per_rate is None else args.prompts_per_rate
            rows.append(run_rate(url, dataset, n, rate, args.workers))
    finally:
        stop_server(proc)
    if profile_to is not None and profile_to.exists():
        import pstats

        stats = pstats.Stats(str(profile_to))
        stats.sort_stats("tottime").print_stats(25)
        stats.sort_stats("cumulative").print_stats(40)
    return rows


# -- the call --------------------------------------------------------------------------------------------------
def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m loadtest.bench_served", description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--out", default="bench_out")
    parser.add_argument("--checkpoint", default="/tmp/llama3-8b-random",
                        help="a checkpoint folder (the Llama-3-8B-shape random one is built there on a GPU if "
                             "missing), or 'default': the small model shipped with the package")
    parser.add_argument("--engine-args", default=ENGINE_ARGS,
                        help="engine flags of `asyncengine serve`, one string, used offline and served alike")
    parser.add_argument("--serve-args", default="", help="more `asyncengine serve` flags for the server only")
    parser.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES),
                        help="server modes, each its own server in turn")
    parser.add_argument("--no-offline", dest="offline", action="store_false",
                        help="skip the offline run (the ratio then uses <out>/bench_offline.json's W1, if any)")
    parser.add_argument("--rates", nargs="+", default=["inf"], help="request rates (req/s); inf: all at once")
    parser.add_argument("--num-prompts", type=int, default=1000)
    parser.add_argument("--prompts-per-rate", type=int, default=None,
                        help="fewer requests at finite rates (each takes num/rate seconds)")
    parser.add_argument("--input-len", type=int, default=200, help="W1's mean prompt length (tokens)")
    parser.add_argument("--output-len", type=int, default=180, help="W1's mean max_tokens")
    parser.add_argument("--workers", type=int, default=default_workers(), help="client processes")
    parser.add_argument("--tag", default="", help="suffix of the files' names")
    parser.add_argument("--profile-server", action="store_true",
                        help="run the server under cProfile and print where its event loop's time goes")
    parser.add_argument("--offline-worker", action="store_true", help=argparse.SUPPRESS)  # offline_in_child's child
    return parser.parse_args(argv)


def resolve_checkpoint(name: str) -> Path:
    if name == "default":
        from asyncengine.config import default_model_path

        return Path(default_model_path())
    return build_checkpoint(Path(name))


def main(argv=None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    checkpoint = resolve_checkpoint(args.checkpoint)
    dataset = out / "w1.jsonl"
    if args.offline_worker:
        result = offline_w1(checkpoint, shlex.split(args.engine_args), dataset)
        (out / "offline_w1.json").write_text(json.dumps(result, indent=2))
        return 0
    vocab = json.loads((checkpoint / "config.json").read_text())["vocab_size"]
    write_dataset(dataset, *w1_requests(args.num_prompts, args.input_len, args.output_len, vocab))
    results: dict = dict(checkpoint=str(checkpoint), engine_args=args.engine_args, workers=args.workers, modes={})
    if args.offline:
        results["offline"] = offline_in_child(checkpoint, shlex.split(args.engine_args), dataset, out)
    for mode in args.modes:
        results["modes"][mode] = served_mode(args, checkpoint, dataset, mode)
        (out / f"bench_served{args.tag}.json").write_text(json.dumps(results, indent=2))
    print_table(results, offline_rps(results, out))
    return 0


def offline_rps(results: dict, out: Path):
    if "offline" in results:
        return results["offline"]["req_per_s"]
    earlier = out / "bench_offline.json"
    return json.loads(earlier.read_text())["W1"]["req_per_s"] if earlier.exists() else None


def print_table(results: dict, offline: float | None) -> None:
    import torch

    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    print(f"\nW1 served and offline on {gpu}, {os.environ.get('BENCH_DATE', time.strftime('%Y-%m-%d'))}, "
          f"{results['workers']} client process(es), engine args: {results['engine_args']}")
    if offline:
        print(f"offline engine: {offline:.2f} req/s")
    print(f"{'mode':>15} {'rate':>6} {'done':>5} {'fail':>4} {'req/s':>7} {'out tok/s':>10} {'TTFT p50':>9} "
          f"{'TTFT p99':>9} {'TPOT p50':>9} {'ITL p50':>8} {'/offline':>9}")
    for mode, rows in results["modes"].items():
        for r in rows:
            ratio = f"{r['req_per_s'] / offline:.0%}" if offline and math.isinf(r["rate"]) else "-"
            print(f"{mode:>15} {r['rate']:>6} {r['completed']:>5} {r['failed']:>4} {r['req_per_s']:>7.2f} "
                  f"{r['output_tok_per_s']:>10.0f} {r['ttft_p50_ms'] or 0:>9.1f} {r['ttft_p99_ms'] or 0:>9.1f} "
                  f"{r['tpot_p50_ms'] or 0:>9.2f} {r['itl_p50_ms'] or 0:>8.2f} {ratio:>9}")
    for mode, rows in results["modes"].items():
        unlimited = [r for r in rows if math.isinf(r["rate"])]
        if unlimited and offline:
            print(f"served/offline ({mode}): {unlimited[0]['req_per_s'] / offline:.3f}")


if __name__ == "__main__":
    raise SystemExit(main())

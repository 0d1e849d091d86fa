"""Served performance on one GPU: `asyncengine serve` on the Llama-3-8B-shape random checkpoint, driven by our
load generator with the W1 ShareGPT-like load at several request rates (issue 6).

    python -m loadtest.bench_served --out results/ [--rates 4 16 32 inf] [--num-prompts 1000]

The server runs as a subprocess (its own event loop and GIL, like a deployment); the client runs here. The
prompts are exactly bench_offline's W1 prompts (token ids, max_tokens, ignore_eos), sent as a JSONL dataset,
so the unlimited-rate run compares with the offline engine's W1 figure found in <out>/bench_offline.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from loadtest.bench_offline import LLAMA3_8B, build_checkpoint, sharegpt_like
from loadtest.config import BenchmarkConfig
from loadtest.runner import run_benchmark

SERVE_ARGS = ["--dtype", "bfloat16", "--max-model-len", "4096", "--max-num-seqs", "256",
              "--max-num-batched-tokens", "8192", "--host", "127.0.0.1", "--port", "0", "--log-level", "warning"]


def start_server(checkpoint: Path, log_path: Path, timeout: float = 300.0, extra_args: tuple = (),
                 profile_to: Path | None = None) -> tuple[subprocess.Popen, str]:
    """Start the server; return it and its base URL once it prints the address it serves on. With profile_to,
    the server runs under cProfile (its main thread: the event loop) and writes the stats there on exit."""
    log = open(log_path, "w")
    profiler = ["-m", "cProfile", "-o", str(profile_to)] if profile_to is not None else []
    proc = subprocess.Popen([sys.executable, "-u", *profiler, "-m", "asyncengine.api", "serve", str(checkpoint),
                             *SERVE_ARGS, *extra_args],
                            stdout=subprocess.PIPE, stderr=log, text=True)
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


def write_dataset(path: Path, n: int) -> None:
    prompts, outs = sharegpt_like(n, 200, 180, seed=1, vocab=LLAMA3_8B["vocab_size"])
    with open(path, "w") as f:
        for p, o in zip(prompts, outs):
            f.write(json.dumps({"prompt": p, "max_tokens": o}) + "\n")


def run_rate(url: str, dataset: Path, n: int, rate: float) -> dict:
    config = BenchmarkConfig(base_url=url, dataset="jsonl", dataset_path=str(dataset), num_prompts=n,
                             request_rate=rate, temperature=1.0, ignore_eos=True, progress=False, timeout=600.0,
                             goodput={"ttft": 200.0, "tpot": 10.0})
    result = asyncio.run(run_benchmark(config))
    m = result.metrics
    lat = m.latency
    return dict(rate=rate, completed=m.completed, failed=m.failed, req_per_s=m.request_throughput,
                output_tok_per_s=m.output_throughput, ttft_p50_ms=lat["ttft"].median,
                ttft_p99_ms=lat["ttft"].percentiles.get("p99"), tpot_p50_ms=lat["tpot"].median,
                itl_p50_ms=lat["itl"].median, e2el_p50_ms=lat["e2el"].median)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench_out")
    parser.add_argument("--checkpoint", default="/tmp/llama3-8b-random")
    parser.add_argument("--rates", nargs="+", default=["4", "16", "32", "inf"])
    parser.add_argument("--num-prompts", type=int, default=1000)
    parser.add_argument("--prompts-per-rate", type=int, default=None,
                        help="fewer requests at finite rates (each takes num/rate seconds)")
    parser.add_argument("--serve-args", default="", help="extra `asyncengine serve` arguments, one string")
    parser.add_argument("--tag", default="", help="suffix of the JSON file's name")
    parser.add_argument("--profile-server", action="store_true",
                        help="run the server under cProfile and print where its event loop's time goes")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    checkpoint = build_checkpoint(Path(args.checkpoint))
    dataset = out / "w1.jsonl"
    write_dataset(dataset, args.num_prompts)
    profile_to = out / f"server{args.tag}.prof" if args.profile_server else None
    proc, url = start_server(checkpoint, out / f"server{args.tag}.log", extra_args=tuple(args.serve_args.split()),
                             profile_to=profile_to)
    rows = []
    try:
        run_rate(url, dataset, 32, math.inf)  # warm-up: compile and capture with real shapes
        for rate_text in args.rates:
            rate = float(rate_text)
            n = args.num_prompts if math.isinf(rate) or args.prompts_per_rate is None else args.prompts_per_rate
            rows.append(run_rate(url, dataset, n, rate))
            (out / f"bench_served{args.tag}.json").write_text(json.dumps(rows, indent=2))
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
    if profile_to is not None and profile_to.exists():
        import pstats

        stats = pstats.Stats(str(profile_to))
        stats.sort_stats("tottime").print_stats(25)
        stats.sort_stats("cumulative").print_stats(40)
    offline = out / "bench_offline.json"
    offline_rps = json.loads(offline.read_text())["W1"]["req_per_s"] if offline.exists() else None
    print_table(rows, offline_rps)
    return 0


def print_table(rows: list[dict], offline_rps) -> None:
    import torch

    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    print(f"\nserved W1 on {gpu}, {os.environ.get('BENCH_DATE', time.strftime('%Y-%m-%d'))}")
    print(f"{'rate':>6} {'done':>5} {'fail':>4} {'req/s':>7} {'out tok/s':>10} {'TTFT p50':>9} {'TTFT p99':>9} "
          f"{'TPOT p50':>9} {'ITL p50':>8}")
    for r in rows:
        print(f"{r['rate']:>6} {r['completed']:>5} {r['failed']:>4} {r['req_per_s']:>7.1f} {r['output_tok_per_s']:>10.0f} "
              f"{r['ttft_p50_ms'] or 0:>9.1f} {r['ttft_p99_ms'] or 0:>9.1f} {r['tpot_p50_ms'] or 0:>9.2f} "
              f"{r['itl_p50_ms'] or 0:>8.2f}")
    unlimited = [r for r in rows if math.isinf(r["rate"])]
    if unlimited and offline_rps:
        print(f"unlimited rate: {unlimited[0]['req_per_s']:.1f} req/s = {unlimited[0]['req_per_s'] / offline_rps:.0%} "
              f"of the offline engine's W1 ({offline_rps:.1f} req/s)")


if __name__ == "__main__":
    raise SystemExit(main())

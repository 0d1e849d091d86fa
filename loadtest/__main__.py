"""`asyncengine bench serve` (installed) and `python -m loadtest` (checkout): the command-line front of
`run_benchmark`.

Exit status: 0 when at least one request completed, 1 when none did (or the `bench` extra is missing), 2 on a
usage error (argparse). Building the parser needs nothing beyond the core install; running needs aiohttp (and
matplotlib for --plot), the `bench` extra: without it the command says so in one line.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import math
import os
import sys

from .config import CHAT_COMPLETIONS, COMPLETIONS, DATASETS, LEN_DISTS, BenchmarkConfig, parse_goodput

MISSING_EXTRA = "needs the 'bench' extra ({module} is not installed): pip install 'asyncengine[bench]'"

DESCRIPTION = ("Stream completions from an OpenAI-compatible server under a chosen load and report TTFT, TPOT, "
               "ITL, end-to-end latency, throughput and goodput.")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m loadtest", description=DESCRIPTION,
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_arguments(p)
    return p


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The load generator's flags, on any parser (`asyncengine bench serve` adds them to its subcommand)."""
    _add_target_args(p.add_argument_group("target"))
    _add_dataset_args(p.add_argument_group("prompts"))
    _add_load_args(p.add_argument_group("load"))
    _add_output_args(p.add_argument_group("output"))


def _add_target_args(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--base-url", default="http://127.0.0.1:8000")
    g.add_argument("--endpoint", default=COMPLETIONS, choices=[COMPLETIONS, CHAT_COMPLETIONS])
    g.add_argument("--model", default=None, help="when omitted: the first id from GET /v1/models")
    g.add_argument("--api-key", default=None, help="bearer token; when omitted: $OPENAI_API_KEY if set")


def _add_dataset_args(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--dataset", default="random", choices=DATASETS)
    g.add_argument("--dataset-path", default=None, help="JSONL file: one {'prompt': ..., 'max_tokens': ...} a line")
    g.add_argument("--num-prompts", type=int, default=100)
    g.add_argument("--input-len", type=int, default=200, help="mean input tokens (random dataset)")
    g.add_argument("--output-len", type=int, default=128, help="mean max_tokens (jsonl: default max_tokens)")
    g.add_argument("--len-dist", default="fixed", choices=LEN_DISTS)
    g.add_argument("--range-ratio", type=float, default=0.5, help="uniform: lengths in len*(1 +- ratio)")
    g.add_argument("--prompt-token-ids", action="store_true", help="send prompts as token-id lists (exact lengths)")
    g.add_argument("--vocab-size", type=int, default=32000, help="token ids are drawn from [0, vocab-size)")
    g.add_argument("--seed", type=int, default=0)


def _add_load_args(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--request-rate", type=float, default=math.inf, help="Poisson arrivals, req/s; inf: all at once")
    g.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight")
    g.add_argument("--max-connections", type=int, default=None, help="HTTP pool size (default: never a wait)")
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false", help="omit ignore_eos: true")
    g.add_argument("--extra-body", type=json.loads, default={}, help="JSON object merged into each request body")
    g.add_argument("--timeout", type=float, default=300.0, help="per request, seconds")
    g.add_argument("--duration", type=float, default=None, help="stop the whole run after this many seconds")
    g.add_argument("--workers", type=int, default=1,
                   help="client processes sharing the requests (for rates one Python process cannot parse)")


def _add_output_args(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--goodput", nargs="+", default=[], metavar="METRIC:MS", help="SLOs, e.g. ttft:200 tpot:50")
    g.add_argument("--percentiles", default="50,90,99", help="comma-separated, reported with the mean")
    g.add_argument("--result-json", default=None, help="write metrics, config and per-request records here")
    g.add_argument("--plot", default=None, help="write a PNG of latencies over time and their distributions")
    g.add_argument("--no-progress", dest="progress", action="store_false")


def config_from_args(args: argparse.Namespace) -> BenchmarkConfig:
    """The BenchmarkConfig named by parsed arguments (ValueError when they are inconsistent)."""
    fields = {k: v for k, v in vars(args).items() if k not in ("result_json", "plot", "goodput", "percentiles")}
    fields["api_key"] = args.api_key or os.environ.get("OPENAI_API_KEY")
    try:
        percentiles = tuple(float(p) for p in args.percentiles.split(",") if p.strip())
    except ValueError:
        raise ValueError(f"--percentiles must be comma-separated numbers, got {args.percentiles!r}") from None
    return BenchmarkConfig(**fields, goodput=parse_goodput(args.goodput), percentiles=percentiles)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    return run(parser, parser.parse_args(argv))


def run(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """Run the benchmark that parsed `args` name; `parser` reports usage errors."""
    try:
        config = config_from_args(args)
    except ValueError as exc:
        parser.error(str(exc))
    needed = ["aiohttp", *(["matplotlib"] if args.plot else [])]
    missing = [name for name in needed if importlib.util.find_spec(name) is None]
    if missing:
        print(f"{parser.prog}: error: {MISSING_EXTRA.format(module=missing[0])}", file=sys.stderr)
        return 1
    from .report import format_table, write_json, write_plot
    from .runner import run_benchmark

    try:
        result = asyncio.run(run_benchmark(config))
    except (RuntimeError, OSError, ValueError) as exc:  # unreachable server, unreadable dataset, ...
        print(f"{parser.prog}: {exc}", file=sys.stderr)
        return 1
    print(format_table(result))
    if args.result_json:
        print(f"wrote {write_json(result, args.result_json)}")
    if args.plot:
        print(f"wrote {write_plot(result, args.plot)}")
    return 0 if result.metrics.completed else 1


if __name__ == "__main__":
    sys.exit(main())

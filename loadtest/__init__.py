"""asyncengine's load generator: drives any OpenAI-compatible server over SSE and reports serving metrics.

Library use (inside a running event loop)::

    from loadtest import BenchmarkConfig, run_benchmark      # from a checkout
    from asyncengine.loadtest import BenchmarkConfig, ...    # from the installed package (pip install asyncengine[bench])
    result = await run_benchmark(BenchmarkConfig(base_url="http://127.0.0.1:8000", num_prompts=50))
    print(format_table(result))

Command line: ``asyncengine bench serve --help`` (installed) or ``python -m loadtest --help`` (checkout); both
are the same parser. Modules, in dependency order: config -> records -> datasets, arrivals -> client -> metrics
-> runner -> report -> __main__. They import each other relatively, so the folder works under both names.

The names below are imported on first use, so that importing `config` (to build the command line) does not
need the `bench` extra's aiohttp.
"""

from importlib import import_module

_EXPORTS = {
    "BenchmarkConfig": "config", "parse_goodput": "config",
    "BenchmarkMetrics": "metrics", "LatencyStats": "metrics",
    "RequestRecord": "records",
    "format_table": "report", "write_json": "report", "write_plot": "report",
    "BenchmarkResult": "runner", "run_benchmark": "runner",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(f".{_EXPORTS[name]}", __name__), name)

"""asyncengine's load generator: drives any OpenAI-compatible server over SSE and reports serving metrics.

Library use (inside a running event loop)::

    from loadtest import BenchmarkConfig, run_benchmark
    result = await run_benchmark(BenchmarkConfig(base_url="http://127.0.0.1:8000", num_prompts=50))
    print(format_table(result))

Command line: ``python -m loadtest --help``. Modules, in dependency order: config -> records -> datasets,
arrivals -> client -> metrics -> runner -> report -> __main__.
"""

from loadtest.config import BenchmarkConfig, parse_goodput
from loadtest.metrics import BenchmarkMetrics, LatencyStats
from loadtest.records import RequestRecord
from loadtest.report import format_table, write_json, write_plot
from loadtest.runner import BenchmarkResult, run_benchmark

__all__ = [
    "BenchmarkConfig", "BenchmarkMetrics", "BenchmarkResult", "LatencyStats", "RequestRecord",
    "format_table", "parse_goodput", "run_benchmark", "write_json", "write_plot",
]

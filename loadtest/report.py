"""Presenting a `BenchmarkResult`: a text table, a JSON file and a PNG of latencies over time.

The JSON is strict (no NaN/Infinity): non-finite floats become the strings "inf"/"-inf" or null. Its keys:
`config`, `model`, `started_at`, `metrics` (see metrics.BenchmarkMetrics; latencies in ms) and `requests`
(one RequestRecord each; times in seconds, rounded to microseconds).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict
from pathlib import Path

import numpy as np

from .config import BenchmarkConfig
from .metrics import LATENCY_METRICS, error_counts, latency_samples, rolling_percentile, tpot_s
from .runner import BenchmarkResult

RULE = "-" * 72
MAX_ERRORS_SHOWN = 5


# ----------------------------------------------------------------------------------------------- table

def format_table(result: BenchmarkResult) -> str:
    """A human-readable summary of the run: what was sent, what came back, and latency statistics."""
    return "\n".join(_header_lines(result) + [RULE] + _latency_lines(result) + _error_lines(result))


def _header_lines(result: BenchmarkResult) -> list[str]:
    c, m = result.config, result.metrics
    rows = [
        ("model", result.model),
        ("endpoint", c.url),
        ("load", _load_text(c)),
        ("requests", f"{m.completed} completed, {m.failed} failed, {m.cancelled} cancelled"),
        ("duration", f"{m.duration_s:.2f} s"),
        ("request rate", f"{m.request_throughput:.2f} req/s"),
        ("input tokens", f"{m.total_input_tokens} ({m.input_throughput:.1f} tok/s)"),
        ("output tokens", f"{m.total_output_tokens} ({m.output_throughput:.1f} tok/s)"),
        ("total tokens", f"{m.total_input_tokens + m.total_output_tokens} ({m.total_token_throughput:.1f} tok/s)"),
    ]
    if m.good_requests is not None:
        slos = ", ".join(f"{k}<={v:g}ms" for k, v in m.goodput_slos_ms.items())
        rows.append(("goodput", f"{m.request_goodput:.2f} req/s ({m.good_requests} requests within {slos})"))
    title = "== asyncengine loadtest ".ljust(len(RULE), "=")
    return [title] + [f"{name:<15}{value}" for name, value in rows]


def _load_text(c: BenchmarkConfig) -> str:
    rate = "all at once" if math.isinf(c.request_rate) else f"Poisson {c.request_rate:g} req/s"
    concurrency = f", max concurrency {c.max_concurrency}" if c.max_concurrency else ""
    source = (f"random {c.len_dist} in={c.input_len} out={c.output_len}" if c.dataset == "random"
              else f"jsonl {c.dataset_path}")
    return f"{c.num_prompts} prompts ({source}), {rate}{concurrency}"


def _latency_lines(result: BenchmarkResult) -> list[str]:
    stats = result.metrics.latency
    keys = list(stats["ttft"].percentiles)
    labels = ["median" if k == "p50" else k for k in keys]
    lines = [f"{'latency (ms)':<14}" + "".join(f"{h:>10}" for h in ["mean", *labels, "samples"])]
    for name in LATENCY_METRICS:
        s = stats[name]
        cells = [s.mean, *(s.percentiles[k] for k in keys)]
        lines.append(f"{name.upper():<14}" + "".join(f"{_num(v):>10}" for v in cells) + f"{s.count:>10}")
    return lines


def _error_lines(result: BenchmarkResult) -> list[str]:
    errors = error_counts(result.records)
    if not errors:
        return []
    lines = [RULE, "errors  (count  text)"]
    lines += [f"{count:>6}  {text[:100]}" for text, count in errors[:MAX_ERRORS_SHOWN]]
    if len(errors) > MAX_ERRORS_SHOWN:
        lines.append(f"   ... and {len(errors) - MAX_ERRORS_SHOWN} more distinct errors")
    return lines


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


# ------------------------------------------------------------------------------------------------ JSON

def result_to_dict(result: BenchmarkResult) -> dict:
    """The whole result as strict-JSON-ready data."""
    return _jsonable({
        "config": asdict(result.config),
        "model": result.model,
        "started_at": result.started_at,
        "metrics": result.metrics.to_dict(),
        "requests": [_rounded(r.to_dict()) for r in result.records],
    })


def write_json(result: BenchmarkResult, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result_to_dict(result), indent=1, allow_nan=False) + "\n")
    return path


def _rounded(record: dict) -> dict:
    out = {}
    for key, value in record.items():
        if isinstance(value, float):
            value = round(value, 6)
        elif isinstance(value, list):
            value = [round(v, 6) for v in value]
        out[key] = value
    return out


def _jsonable(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


# ------------------------------------------------------------------------------------------------ plot

def write_plot(result: BenchmarkResult, path: str | Path) -> Path:
    """A 2x3 PNG. Top: TTFT, TPOT and E2EL of each request against its send time, with rolling p50 and p99.
    Bottom: histograms of TTFT and of TPOT/ITL, and CDFs of all four latencies (log scale)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 3, figsize=(16, 9), constrained_layout=True)
    ok = [r for r in result.records if r.ok]
    _over_time(axes[0][0], ok, lambda r: r.ttft_s, "TTFT")
    _over_time(axes[0][1], ok, tpot_s, "TPOT")
    _over_time(axes[0][2], ok, lambda r: r.e2el_s, "E2EL")
    samples_ms = {k: [v * 1000.0 for v in vs] for k, vs in latency_samples(result.records).items()}
    _histogram(axes[1][0], {"TTFT": samples_ms["ttft"]}, "TTFT distribution")
    _histogram(axes[1][1], {"TPOT": samples_ms["tpot"], "ITL": samples_ms["itl"]}, "TPOT / ITL distribution")
    _cdfs(axes[1][2], samples_ms)
    m = result.metrics
    fig.suptitle(f"{result.model} @ {result.config.url}: {m.completed} ok, {m.failed} failed, "
                 f"{m.request_throughput:.2f} req/s, {m.output_throughput:.0f} output tok/s")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _over_time(ax, records, metric_s, name: str) -> None:
    points = [(r.start_s, metric_s(r) * 1000.0) for r in records if metric_s(r) is not None]
    ax.set(title=f"{name} over time", xlabel="send time (s since start)", ylabel=f"{name} (ms)")
    if not points:
        ax.text(0.5, 0.5, "no data", ha="center", transform=ax.transAxes)
        return
    times, values = zip(*points)
    ax.scatter(times, values, s=6, alpha=0.3, color="grey", label="request")
    window = max(5, len(values) // 20)
    for q, style in ((50, "-"), (99, "--")):
        x, y = rolling_percentile(list(times), list(values), q, window)
        ax.plot(x, y, style, label=f"rolling p{q} ({window} req)")
    ax.legend(fontsize="small")


def _histogram(ax, series_ms: dict[str, list[float]], title: str) -> None:
    """Density histograms on shared bins, so series with very different sample counts stay comparable."""
    ax.set(title=title, xlabel="ms", ylabel="density")
    present = {label: values for label, values in series_ms.items() if values}
    if not present:
        ax.text(0.5, 0.5, "no data", ha="center", transform=ax.transAxes)
        return
    bins = np.histogram_bin_edges(np.concatenate(list(present.values())), bins=50)
    for label, values in present.items():
        ax.hist(values, bins=bins, density=True, histtype="stepfilled", alpha=0.45, label=label)
    ax.legend(fontsize="small")


def _cdfs(ax, samples_ms: dict[str, list[float]]) -> None:
    ax.set(title="CDF", xlabel="ms (log)", ylabel="fraction of samples")
    for name in LATENCY_METRICS:
        values = np.sort(np.asarray(samples_ms[name]))
        values = values[values > 0]
        if len(values):
            ax.step(values, np.arange(1, len(values) + 1) / len(values), where="post", label=name.upper())
    if ax.lines:
        ax.set_xscale("log")
        ax.legend(fontsize="small")
    ax.grid(True, alpha=0.3)

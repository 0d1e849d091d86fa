"""Benchmark metrics from request records: pure functions, no I/O, no clocks.

Definitions (the usual serving-benchmark semantics; latencies reported in ms):
  - only successful requests (`status == OK`) enter latencies, token counts, throughput and goodput;
  - TTFT: send -> first content chunk. E2EL: send -> end of stream.
  - TPOT of a request: (E2EL - TTFT) / (output_tokens - 1). Undefined for a 1-token request, which is then left
    out of the TPOT statistics but meets any TPOT SLO (it produced no second token to be late).
  - ITL: every gap between consecutive content chunks, pooled over all requests.
  - throughput = totals / duration; goodput = requests meeting every SLO / duration.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np

from .records import CANCELLED, FAILED, RequestRecord

LATENCY_METRICS = ("ttft", "tpot", "itl", "e2el")


@dataclass
class LatencyStats:
    """Summary of one latency metric in ms; all None when there were no samples."""

    count: int
    mean: float | None
    std: float | None
    percentiles: dict[str, float | None] = field(default_factory=dict)  # "p50" -> ms

    @property
    def median(self) -> float | None:
        return self.percentiles.get("p50")


@dataclass
class BenchmarkMetrics:
    completed: int
    failed: int
    cancelled: int
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float
    input_throughput: float
    output_throughput: float
    total_token_throughput: float
    goodput_slos_ms: dict[str, float]
    good_requests: int | None  # None when no SLO was given
    request_goodput: float | None
    latency: dict[str, LatencyStats]  # keys: LATENCY_METRICS

    def to_dict(self) -> dict:
        return asdict(self)


def percentile_key(q: float) -> str:
    """90.0 -> "p90", 99.9 -> "p99.9"."""
    return f"p{q:g}"


def tpot_s(record: RequestRecord) -> float | None:
    """Time per output token after the first, in seconds; None for a failed or 1-token request."""
    if not record.ok or record.output_tokens < 2:
        return None
    return (record.e2el_s - record.ttft_s) / (record.output_tokens - 1)


def latency_stats(values_s: list[float], percentiles: tuple[float, ...]) -> LatencyStats:
    """Mean, std and percentiles (linear interpolation) of `values_s`, converted to ms."""
    keys = [percentile_key(q) for q in percentiles]
    if not values_s:
        return LatencyStats(0, None, None, dict.fromkeys(keys))
    ms = np.asarray(values_s, dtype=float) * 1000.0
    values = np.percentile(ms, percentiles).tolist() if percentiles else []
    return LatencyStats(len(ms), float(ms.mean()), float(ms.std()), dict(zip(keys, values)))


def meets_slos(record: RequestRecord, slos_ms: dict[str, float]) -> bool:
    """True when a successful request is within every SLO (ms); a 1-token request meets any TPOT SLO."""
    if not record.ok:
        return False
    observed_s = {"ttft": record.ttft_s, "tpot": tpot_s(record) or 0.0, "e2el": record.e2el_s}
    return all(observed_s[name] * 1000.0 <= slo for name, slo in slos_ms.items())


def latency_samples(records: list[RequestRecord]) -> dict[str, list[float]]:
    """Per-metric samples in seconds over the successful records (ITL pooled over all of them)."""
    ok = [r for r in records if r.ok]
    tpots = [tpot_s(r) for r in ok]
    return {
        "ttft": [r.ttft_s for r in ok],
        "tpot": [t for t in tpots if t is not None],
        "itl": [gap for r in ok for gap in r.itl_s],
        "e2el": [r.e2el_s for r in ok],
    }


def summarize(
    records: list[RequestRecord],
    duration_s: float,
    slos_ms: dict[str, float] | None = None,
    percentiles: tuple[float, ...] = (50.0, 90.0, 99.0),
) -> BenchmarkMetrics:
    """All run-level metrics from the records of one run that lasted `duration_s` seconds (> 0)."""
    if duration_s <= 0:
        raise ValueError(f"duration_s must be > 0, got {duration_s}")
    slos_ms = dict(slos_ms or {})
    ok = [r for r in records if r.ok]
    input_tokens = sum(r.prompt_len for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    good = sum(meets_slos(r, slos_ms) for r in ok) if slos_ms else None
    samples = latency_samples(records)
    return BenchmarkMetrics(
        completed=len(ok),
        failed=sum(r.status == FAILED for r in records),
        cancelled=sum(r.status == CANCELLED for r in records),
        duration_s=duration_s,
        total_input_tokens=input_tokens,
        total_output_tokens=output_tokens,
        request_throughput=len(ok) / duration_s,
        input_throughput=input_tokens / duration_s,
        output_throughput=output_tokens / duration_s,
        total_token_throughput=(input_tokens + output_tokens) / duration_s,
        goodput_slos_ms=slos_ms,
        good_requests=good,
        request_goodput=None if good is None else good / duration_s,
        latency={name: latency_stats(samples[name], percentiles) for name in LATENCY_METRICS},
    )


def error_counts(records: list[RequestRecord]) -> list[tuple[str, int]]:
    """Distinct error texts of failed requests with their counts, most frequent first."""
    counts: dict[str, int] = {}
    for r in records:
        if r.status == FAILED:
            counts[r.error or "unknown"] = counts.get(r.error or "unknown", 0) + 1
    return sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))


def rolling_percentile(times: list[float], values: list[float], q: float, window: int) -> tuple[list, list]:
    """Percentile `q` of `values` over a sliding window of `window` consecutive samples ordered by `times`.

    Returns (x, y): for each full window, the time of its last sample and the window's percentile. Fewer
    samples than `window` give a single point over all of them (nothing for no samples).
    """
    if not values:
        return [], []
    order = np.argsort(times, kind="stable")
    t = np.asarray(times, dtype=float)[order]
    v = np.asarray(values, dtype=float)[order]
    window = max(1, min(window, len(v)))
    windows = np.lib.stride_tricks.sliding_window_view(v, window)
    return t[window - 1:].tolist(), np.percentile(windows, q, axis=1).tolist()

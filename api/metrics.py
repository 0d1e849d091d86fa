"""Prometheus metrics under vLLM's names, in a registry of their own (several apps may share a process).

    gauges, read at scrape time      vllm:num_requests_running, vllm:num_requests_waiting, vllm:kv_cache_usage_perc
    counters, read at scrape time    vllm:num_preemptions_total, vllm:prefix_cache_queries_total,
                                     vllm:prefix_cache_hits_total (the engine's own running totals)
    fed by the engine's step stats   vllm:prompt_tokens_total, vllm:generation_tokens_total,
                                     vllm:request_success_total{finished_reason},
                                     vllm:time_to_first_token_seconds, vllm:inter_token_latency_seconds,
                                     vllm:e2e_request_latency_seconds (histograms)
Every series carries a `model_name` label. The stats listener runs on the event loop after every step, so it
only does a few counter and histogram updates; it holds the Metrics weakly, so a dropped app costs nothing.
"""

from __future__ import annotations

import weakref

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from asyncengine.async_engine import AsyncLLMEngine
from asyncengine.engine import StepStats

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 120.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)
_E2E_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0, 600.0)


class EngineCollector:
    """Reads the engine's stats snapshot (AsyncLLMEngine.stats()) when Prometheus scrapes."""

    def __init__(self, engine: AsyncLLMEngine, model_name: str):
        self.engine = engine
        self.model_name = model_name

    def describe(self):
        return []  # the families are produced dynamically; nothing to pre-register

    def collect(self):
        stats, labels = self.engine.stats(), [self.model_name]
        yield _gauge("vllm:num_requests_running", "Requests running on the engine.", stats.num_running, labels)
        yield _gauge("vllm:num_requests_waiting", "Requests waiting to run.", stats.num_waiting, labels)
        yield _gauge("vllm:kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0 to 1).",
                     stats.kv_cache_usage, labels)
        yield _counter("vllm:num_preemptions", "Preemptions since start.", stats.num_preemptions, labels)
        yield _counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                       stats.prefix_cache_queries, labels)
        yield _counter("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.",
                       stats.prefix_cache_hits, labels)


def _gauge(name: str, doc: str, value: float, labels: list[str]) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, doc, labels=["model_name"])
    family.add_metric(labels, value)
    return family


def _counter(name: str, doc: str, value: float, labels: list[str]) -> CounterMetricFamily:
    family = CounterMetricFamily(name, doc, labels=["model_name"])
    family.add_metric(labels, value)
    return family


class Metrics:
    """The app's registry: engine collector plus counters and histograms fed by `engine.add_stats_listener`."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, engine: AsyncLLMEngine, model_name: str):
        self.registry = CollectorRegistry()
        self.registry.register(EngineCollector(engine, model_name))
        reg, labels = self.registry, ["model_name"]
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prefilled prompt tokens.", labels, registry=reg)
        self.generation_tokens = Counter("vllm:generation_tokens", "Generated tokens.", labels, registry=reg)
        self.request_success = Counter("vllm:request_success", "Finished requests by finish reason.",
                                       ["model_name", "finished_reason"], registry=reg)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token.", labels,
                              buckets=_TTFT_BUCKETS, registry=reg)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Time between consecutive tokens.", labels,
                             buckets=_ITL_BUCKETS, registry=reg)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Arrival to finish, per sequence.", labels,
                             buckets=_E2E_BUCKETS, registry=reg)
        self.model_name = model_name
        self._bind()
        engine.add_stats_listener(_weak_listener(self))

    def _bind(self) -> None:
        name = self.model_name
        self._prompt, self._generation = self.prompt_tokens.labels(name), self.generation_tokens.labels(name)
        self._ttft, self._itl, self._e2e = self.ttft.labels(name), self.itl.labels(name), self.e2e.labels(name)

    def observe(self, stats: StepStats) -> None:
        if stats.prompt_tokens:
            self._prompt.inc(stats.prompt_tokens)
        if stats.generation_tokens:
            self._generation.inc(stats.generation_tokens)
        for value in stats.time_to_first_token:
            self._ttft.observe(value)
        for value in stats.inter_token_latency:
            self._itl.observe(value)
        for value in stats.e2e_latency:
            self._e2e.observe(value)
        for reason in stats.finished_reasons:
            self.request_success.labels(self.model_name, reason or "unknown").inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


def _weak_listener(metrics: Metrics):
    ref = weakref.ref(metrics)

    def listener(stats: StepStats) -> None:
        target = ref()
        if target is not None:
            target.observe(stats)

    return listener

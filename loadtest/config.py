"""`BenchmarkConfig`: everything one load-test run needs, as one flat, validated dataclass.

Contract: a `BenchmarkConfig` that was constructed without a `ValueError` describes a run that always ends by
itself (`num_prompts` is finite, every request has a `timeout`, `duration` optionally caps the whole run).
Units: seconds for times given to the tool, milliseconds for SLOs (as latencies are reported in ms).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

COMPLETIONS = "/v1/completions"
CHAT_COMPLETIONS = "/v1/chat/completions"
LEN_DISTS = ("fixed", "uniform", "sharegpt-like")
DATASETS = ("random", "jsonl")
SLO_METRICS = ("ttft", "tpot", "e2el")


@dataclass
class BenchmarkConfig:
    """One load-test run against an OpenAI-compatible server.

    Request source: `dataset="random"` draws `num_prompts` synthetic prompts (lengths from `len_dist` around
    `input_len` / `output_len`, seeded by `seed`); `dataset="jsonl"` reads `dataset_path`.
    Arrivals: Poisson at `request_rate` req/s (`math.inf`: all at t=0), optionally gated by `max_concurrency`
    requests in flight. `goodput` maps "ttft" / "tpot" / "e2el" to an upper bound in ms.
    """

    base_url: str = "http://127.0.0.1:8000"
    endpoint: str = COMPLETIONS
    model: str | None = None  # None: the first id that GET /v1/models returns
    api_key: str | None = None

    dataset: str = "random"
    dataset_path: str | None = None
    num_prompts: int = 100
    input_len: int = 200
    output_len: int = 128
    len_dist: str = "fixed"
    range_ratio: float = 0.5  # uniform: lengths in [len*(1-r), len*(1+r)]
    prompt_token_ids: bool = False  # send `prompt` as a list of token ids (exact input lengths)
    vocab_size: int = 32000
    seed: int = 0

    request_rate: float = math.inf
    max_concurrency: int | None = None
    max_connections: int | None = None  # None: enough that no request ever waits for a pooled connection

    temperature: float = 0.0
    ignore_eos: bool = True
    extra_body: dict = field(default_factory=dict)  # merged into every request body

    timeout: float = 300.0  # per request, seconds, from send to the last byte
    duration: float | None = None  # cap on the whole run, seconds
    # Client processes: each sends every workers-th request at its time, with max_concurrency and the pool split
    # between them, so that one Python process's parsing does not become the latency it measures.
    workers: int = 1
    goodput: dict[str, float] = field(default_factory=dict)  # metric -> SLO in ms
    percentiles: tuple[float, ...] = (50.0, 90.0, 99.0)
    progress: bool = True

    def __post_init__(self) -> None:
        self.base_url = self.base_url.rstrip("/")
        self.percentiles = tuple(float(p) for p in self.percentiles)
        _check(self.endpoint in (COMPLETIONS, CHAT_COMPLETIONS),
               f"endpoint must be {COMPLETIONS} or {CHAT_COMPLETIONS}, got {self.endpoint!r}")
        _check(self.dataset in DATASETS, f"dataset must be one of {DATASETS}, got {self.dataset!r}")
        _check(self.dataset != "jsonl" or bool(self.dataset_path), "dataset 'jsonl' needs dataset_path")
        _check(self.len_dist in LEN_DISTS, f"len_dist must be one of {LEN_DISTS}, got {self.len_dist!r}")
        _check(self.num_prompts >= 1, f"num_prompts must be >= 1, got {self.num_prompts}")
        _check(self.input_len >= 1 and self.output_len >= 1,
               f"input_len and output_len must be >= 1, got {self.input_len} and {self.output_len}")
        _check(0.0 <= self.range_ratio < 1.0, f"range_ratio must be in [0, 1), got {self.range_ratio}")
        _check(self.vocab_size >= 2, f"vocab_size must be >= 2, got {self.vocab_size}")
        _check(not (self.prompt_token_ids and self.is_chat),
               "prompt_token_ids works only with /v1/completions (chat messages are text)")
        _check(self.request_rate > 0, f"request_rate must be > 0 (inf for all at once), got {self.request_rate}")
        _check(self.max_concurrency is None or self.max_concurrency >= 1,
               f"max_concurrency must be >= 1, got {self.max_concurrency}")
        _check(self.max_connections is None or self.max_connections >= 1,
               f"max_connections must be >= 1, got {self.max_connections}")
        _check(isinstance(self.extra_body, dict), f"extra_body must be a JSON object, got {self.extra_body!r}")
        _check(self.temperature >= 0, f"temperature must be >= 0, got {self.temperature}")
        _check(0 < self.timeout < math.inf, f"timeout must be a finite number of seconds > 0, got {self.timeout}")
        _check(self.duration is None or self.duration > 0, f"duration must be > 0, got {self.duration}")
        _check(1 <= self.workers <= self.num_prompts, f"workers must be in [1, num_prompts], got {self.workers}")
        _check(all(0 <= p <= 100 for p in self.percentiles), f"percentiles must be in [0, 100]: {self.percentiles}")
        for name, slo in self.goodput.items():
            _check(name in SLO_METRICS, f"goodput metric must be one of {SLO_METRICS}, got {name!r}")
            _check(slo > 0, f"goodput SLO for {name} must be > 0 ms, got {slo}")

    @property
    def is_chat(self) -> bool:
        return self.endpoint == CHAT_COMPLETIONS

    @property
    def url(self) -> str:
        return self.base_url + self.endpoint

    def pool_size(self) -> int:
        """Connections the client may open: the explicit limit, else the most requests that can be in flight."""
        if self.max_connections is not None:
            return self.max_connections
        return min(self.num_prompts, self.max_concurrency or self.num_prompts)


def parse_goodput(items: list[str]) -> dict[str, float]:
    """Parse ["ttft:200", "tpot:50"] into {"ttft": 200.0, "tpot": 50.0} (ms); ValueError on bad items."""
    slos: dict[str, float] = {}
    for item in items:
        name, sep, value = item.partition(":")
        _check(bool(sep), f"goodput item must look like 'ttft:200', got {item!r}")
        try:
            slos[name.strip().lower()] = float(value)
        except ValueError:
            raise ValueError(f"goodput value must be a number of ms, got {item!r}") from None
    return slos


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)

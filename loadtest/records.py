"""`RequestRecord`: what the client measured for one request. Shared by client, metrics and report.

All times are seconds from `time.perf_counter()`, made relative: `start_s` is relative to the start of the
benchmark, every other time is relative to `start_s` (the moment the request was sent).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

OK = "ok"
FAILED = "failed"
CANCELLED = "cancelled"  # still in flight when the --duration cap ended the run: neither ok nor failed


@dataclass
class RequestRecord:
    """Timing of one streamed request.

    Invariants once the request ended: `status == OK` implies `ttft_s` and `e2el_s` are set, `output_tokens >= 1`,
    and `len(itl_s) == chunks - 1` (one gap between each pair of consecutive content chunks).
    `output_tokens` comes from the server's usage report when it sent one, else it equals `chunks`.
    """

    index: int
    prompt_len: int  # estimated (text) or exact (token ids) input tokens; replaced by the server's usage count
    max_tokens: int
    start_s: float = 0.0
    status: str = FAILED
    error: str | None = None
    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    e2el_s: float | None = None
    chunks: int = 0
    output_tokens: int = 0
    usage_reported: bool = False

    @property
    def ok(self) -> bool:
        return self.status == OK

    def to_dict(self) -> dict:
        return asdict(self)

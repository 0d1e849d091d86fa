"""SamplingParams: how one request samples and when it stops.

Every field is validated in `__post_init__`; a bad value raises ValueError naming the field and the range it
must lie in. The semantics follow vLLM (and through it the OpenAI API):

- temperature 0 means greedy; top_k -1 (or 0) means "all tokens"; top_p 1 and min_p 0 disable those filters.
- presence/frequency penalties are OpenAI's additive penalties over *generated* tokens; repetition_penalty is the
  CTRL-style multiplicative penalty over prompt and generated tokens (divide positive logits, multiply negative).
- max_tokens None means "the rest of max_model_len"; min_tokens suppresses EOS and stop_token_ids until reached.
- stop strings are cut from the text unless include_stop_str_in_output.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Optional


class RequestOutputKind(enum.Enum):
    """What each output of a streaming request carries."""

    CUMULATIVE = 0  # all text / tokens so far
    DELTA = 1  # only what is new since the previous output
    FINAL_ONLY = 2  # a single output when the request finishes


_MAX_SEED = 2**63 - 1


def _check(condition: bool, field_name: str, message: str) -> None:
    if not condition:
        raise ValueError(f"{field_name} {message}")


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: Optional[int] = None
    stop: Optional[list[str] | str] = None
    stop_token_ids: Optional[list[int]] = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: Optional[int] = None
    min_tokens: int = 0
    logprobs: Optional[int] = None
    logit_bias: Optional[dict[int, float]] = None
    skip_special_tokens: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or []) if isinstance(self.stop, (list, tuple, type(None))) else self.stop
        self.stop_token_ids = list(self.stop_token_ids or [])
        self._check_types()
        if self.logit_bias:
            self.logit_bias = self._parse_logit_bias(self.logit_bias)
        if self.top_k == 0:
            self.top_k = -1
        self._validate()

    @staticmethod
    def _parse_logit_bias(bias: dict) -> dict[int, float]:
        """Keys may be ints or decimal strings (as JSON sends them); values numbers."""
        parsed = {}
        for key, value in bias.items():
            try:
                token_id = int(key)
            except (TypeError, ValueError):
                raise ValueError(f"logit_bias keys must be token ids (integers), got {key!r}") from None
            _check(isinstance(value, (int, float)) and not isinstance(value, bool), "logit_bias",
                   f"values must be numbers, got {value!r}")
            parsed[token_id] = float(value)
        return parsed

    _INT_FIELDS = ("n", "top_k", "min_tokens")
    _FLOAT_FIELDS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")

    def _check_types(self) -> None:
        for name in self._INT_FIELDS:
            value = getattr(self, name)
            _check(isinstance(value, int) and not isinstance(value, bool), name, f"must be an integer, got {value!r}")
        for name in self._FLOAT_FIELDS:
            value = getattr(self, name)
            _check(
                isinstance(value, (int, float)) and not isinstance(value, bool), name, f"must be a number, got {value!r}"
            )
        for name in ("max_tokens", "seed", "logprobs"):
            value = getattr(self, name)
            _check(
                value is None or (isinstance(value, int) and not isinstance(value, bool)),
                name,
                f"must be an integer or null, got {value!r}",
            )
        _check(isinstance(self.stop, (list, tuple)), "stop", f"must be a string or a list of strings, got {self.stop!r}")
        _check(self.logit_bias is None or isinstance(self.logit_bias, dict), "logit_bias", "must be a mapping of token id to bias")

    def _validate(self) -> None:
        self._check_types()
        _check(1 <= self.n <= 128, "n", f"must be an integer in [1, 128], got {self.n!r}")
        _check(0.0 <= self.temperature <= 100.0, "temperature", f"must be in [0, 100], got {self.temperature}")
        _check(0.0 < self.top_p <= 1.0, "top_p", f"must be in (0, 1], got {self.top_p}")
        _check(
            isinstance(self.top_k, int) and (self.top_k == -1 or self.top_k >= 1),
            "top_k",
            f"must be -1 (disabled) or a positive integer, got {self.top_k!r}",
        )
        _check(0.0 <= self.min_p <= 1.0, "min_p", f"must be in [0, 1], got {self.min_p}")
        _check(-2.0 <= self.presence_penalty <= 2.0, "presence_penalty", f"must be in [-2, 2], got {self.presence_penalty}")
        _check(
            -2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty", f"must be in [-2, 2], got {self.frequency_penalty}"
        )
        _check(
            0.0 < self.repetition_penalty <= 10.0,
            "repetition_penalty",
            f"must be in (0, 10], got {self.repetition_penalty}",
        )
        _check(
            self.seed is None or (isinstance(self.seed, int) and -_MAX_SEED <= self.seed <= _MAX_SEED),
            "seed",
            f"must be an integer in [-2**63+1, 2**63-1], got {self.seed!r}",
        )
        _check(
            self.max_tokens is None or (isinstance(self.max_tokens, int) and self.max_tokens >= 1),
            "max_tokens",
            f"must be at least 1, got {self.max_tokens!r}",
        )
        _check(isinstance(self.min_tokens, int) and self.min_tokens >= 0, "min_tokens", f"must be >= 0, got {self.min_tokens!r}")
        _check(
            self.max_tokens is None or self.min_tokens <= self.max_tokens,
            "min_tokens",
            f"must be <= max_tokens={self.max_tokens}, got {self.min_tokens}",
        )
        _check(
            self.logprobs is None or (isinstance(self.logprobs, int) and 0 <= self.logprobs <= 20),
            "logprobs",
            f"must be in [0, 20], got {self.logprobs!r}",
        )
        _check(all(isinstance(s, str) and s for s in self.stop), "stop", "must be a list of non-empty strings")
        _check(len(self.stop) <= 16, "stop", f"may hold at most 16 strings, got {len(self.stop)}")
        _check(
            all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
            "stop_token_ids",
            "must be a list of non-negative integers",
        )
        for token_id, bias in (self.logit_bias or {}).items():
            _check(-100.0 <= bias <= 100.0, "logit_bias", f"values must be in [-100, 100], got {bias} for token {token_id}")
            _check(token_id >= 0, "logit_bias", f"keys must be non-negative token ids, got {token_id}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def needs_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    def validate_for_model(self, vocab_size: int) -> None:
        """Checks that need the model: token ids must exist in the vocabulary."""
        for name, ids in (("stop_token_ids", self.stop_token_ids), ("logit_bias", list(self.logit_bias or {}))):
            bad = [t for t in ids if t >= vocab_size]
            _check(not bad, name, f"holds token ids {bad[:5]} outside the vocabulary [0, {vocab_size})")

    def clone(self) -> "SamplingParams":
        import copy

        return copy.deepcopy(self)

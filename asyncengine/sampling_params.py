"""SamplingParams: how one request samples and when it stops.

Every field is validated in `__post_init__`; a bad value raises ValueError naming the field and the range it
must lie in. The semantics follow vLLM (and through it the OpenAI API):

- temperature 0 means greedy; top_k -1 (or 0) means "all tokens"; top_p 1 and min_p 0 disable those filters.
- presence/frequency penalties are OpenAI's additive penalties over *generated* tokens; repetition_penalty is the
  CTRL-style multiplicative penalty over prompt and generated tokens (divide positive logits, multiply negative).
- max_tokens None means "the rest of max_model_len"; min_tokens suppresses EOS and stop_token_ids until reached.
- stop strings are cut from the text unless include_stop_str_in_output.
- structured_outputs (StructuredOutputsParams, vLLM's shape) constrains the output to a JSON schema, any JSON
  object, a regular expression, a choice among strings or an EBNF grammar (asyncengine.structured_output); with
  after_thinking (ThinkingTokens) it constrains only the answer that follows a reasoning model's thinking.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Optional

GREEDY_TEMPERATURE = 1e-5  # temperatures below this sample greedily (SamplingParams.greedy)


class RequestOutputKind(enum.Enum):
    """What each output of a streaming request carries."""

    CUMULATIVE = 0  # all text / tokens so far
    DELTA = 1  # only what is new since the previous output
    FINAL_ONLY = 2  # a single output when the request finishes


_MAX_SEED = 2**63 - 1


@dataclass(frozen=True)
class ThinkingTokens:
    """Where a reasoning model's thinking ends, for a constraint that applies only to the answer after it (the
    server sets it from --reasoning-parser; api/reasoning.py). The thinking itself is free.

    end: the token that closes the thinking (`</think>`); the constraint starts with the token after it.
    start: None when the output begins inside the thinking (DeepSeek-R1: the prompt opened it); else the token that
    opens it, which starts a thinking only as the output's first token (Qwen3: a first token other than it begins
    the answer, so that first token may be `start` or anything the constraint allows)."""

    end: int
    start: Optional[int] = None

    def __post_init__(self) -> None:
        for name in ("end", "start"):
            value = getattr(self, name)
            _check(value is None and name == "start" or isinstance(value, int) and not isinstance(value, bool)
                   and value >= 0, f"structured_outputs.after_thinking.{name}", f"must be a token id, got {value!r}")

    def token_ids(self) -> list[int]:
        return [self.end] if self.start is None else [self.start, self.end]


@dataclass
class StructuredOutputsParams:
    """A constraint on the output, in vLLM's shape: exactly one of json (a JSON schema, as a dict or a JSON
    string), regex, choice (a list of strings), grammar (EBNF / GBNF) or json_object=True (any JSON object).

    disable_any_whitespace: whether JSON may hold free whitespace between its tokens. Unlike vLLM, the default
    (None) is compact JSON (separators ", " and ": "): free whitespace lets a weak model spend all of max_tokens
    on blanks (the default model does, at temperature 1, in every sample). False asks for free whitespace.

    after_thinking: None constrains the whole output; ThinkingTokens constrain only the answer after the thinking
    (not part of vLLM's request shape: vLLM takes the reasoning parser as an engine option)."""

    json: Optional[dict | str] = None
    regex: Optional[str] = None
    choice: Optional[list[str]] = None
    grammar: Optional[str] = None
    json_object: Optional[bool] = None
    disable_any_whitespace: Optional[bool] = None
    after_thinking: Optional[ThinkingTokens] = None

    _KINDS = ("json", "regex", "choice", "grammar", "json_object")

    def __post_init__(self) -> None:
        given = [k for k in self._KINDS if getattr(self, k) not in (None, False)]
        _check(len(given) == 1, "structured_outputs",
               f"must set exactly one of {', '.join(self._KINDS)}, got {', '.join(given) or 'none'}")
        name = "structured_outputs." + given[0]
        if self.json is not None:
            _check(isinstance(self.json, (dict, str)), name, "must be a JSON schema (an object or a JSON string)")
            if isinstance(self.json, str):
                import json

                try:
                    json.loads(self.json)
                except ValueError as exc:
                    raise ValueError(f"{name} is not valid JSON: {exc}") from None
        for field_name in ("regex", "grammar"):
            value = getattr(self, field_name)
            _check(value is None or (isinstance(value, str) and value), f"structured_outputs.{field_name}",
                   "must be a non-empty string")
        if self.choice is not None:
            _check(isinstance(self.choice, (list, tuple)) and self.choice
                   and all(isinstance(c, str) and c for c in self.choice), name,
                   "must be a non-empty list of non-empty strings")
            self.choice = list(self.choice)
        _check(self.json_object in (None, True, False), "structured_outputs.json_object", "must be a boolean")
        _check(self.disable_any_whitespace in (None, True, False), "structured_outputs.disable_any_whitespace",
               "must be a boolean")
        _check(self.after_thinking is None or isinstance(self.after_thinking, ThinkingTokens),
               "structured_outputs.after_thinking", "must be ThinkingTokens or None")

    @property
    def any_whitespace(self) -> bool:
        return self.disable_any_whitespace is False

    @property
    def kind(self) -> str:
        return next(k for k in self._KINDS if getattr(self, k) not in (None, False))

    @property
    def value(self):
        return getattr(self, self.kind)

    def key(self) -> tuple:
        """What identifies the compiled grammar (the compile cache's key; after_thinking does not change it)."""
        import json

        value = self.value
        if isinstance(value, dict):
            value = json.dumps(value, sort_keys=True)
        elif isinstance(value, list):
            value = tuple(value)
        return self.kind, value, self.any_whitespace


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
    structured_outputs: Optional[StructuredOutputsParams] = None

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
        if self.structured_outputs is not None:
            _check(isinstance(self.structured_outputs, StructuredOutputsParams), "structured_outputs",
                   "must be a StructuredOutputsParams")
            # The grammar ends the output with EOS; these would forbid it.
            _check(not self.ignore_eos, "ignore_eos", "cannot be combined with structured_outputs")
            _check(self.min_tokens == 0, "min_tokens", "cannot be combined with structured_outputs")

    @property
    def greedy(self) -> bool:
        """Temperature below GREEDY_TEMPERATURE samples as greedy (vLLM's rule): dividing logits by a temperature
        that small overflows them to inf, and the NaN probabilities that follow picked token 0 every time."""
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def needs_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    def validate_for_model(self, vocab_size: int) -> None:
        """Checks that need the model: token ids must exist in the vocabulary."""
        thinking = self.structured_outputs.after_thinking if self.structured_outputs is not None else None
        for name, ids in (("stop_token_ids", self.stop_token_ids), ("logit_bias", list(self.logit_bias or {})),
                          ("structured_outputs.after_thinking", thinking.token_ids() if thinking else [])):
            bad = [t for t in ids if t >= vocab_size]
            _check(not bad, name, f"holds token ids {bad[:5]} outside the vocabulary [0, {vocab_size})")

    def clone(self) -> "SamplingParams":
        import copy

        return copy.deepcopy(self)

"""PoolingParams: what one pooling request (an embedding, or a cross-encoder's score) asks for, and the outputs
it gets back (shaped as vLLM's).

Fields (validated in `__post_init__`, then against the model by `check_for_model`):
- task: "embed" (embedding models) or "score" (cross-encoders: the input is a text pair; LLM.score, /score and
  /rerank set it). A task the model cannot do is a ValueError.
- second_text_start (score): where the pair's second text starts in the token ids; from there on the tokens have
  token type 1 (as the tokenizer's token_type_ids say). None: every token has type 0.
- dimensions (embed): keep the first `dimensions` values of the embedding, then renormalise it (models trained for it
  only: Matryoshka; see pooler.py). None: the model's full width.
- normalize (embed): override the checkpoint's normalisation (None: as the checkpoint says).
- truncate_prompt_tokens: an input longer than this is cut to this many tokens instead of being refused: text
  through the tokenizer's own truncation (special tokens kept), token ids by keeping the last ones (as vLLM).
  -1 means the model's maximum length. None: inputs longer than the model allows are a ValueError.
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass
from typing import Any, Literal, Optional, Union

import torch
import torch.nn.functional as F

from asyncengine.pooler import PoolerConfig
from asyncengine.sampling_params import RequestOutputKind

PromptType = Union[str, list[int]]


PoolingTask = Literal["embed", "score"]


@dataclass
class PoolingParams:
    dimensions: Optional[int] = None
    normalize: Optional[bool] = None
    truncate_prompt_tokens: Optional[int] = None
    task: PoolingTask = "embed"
    second_text_start: Optional[int] = None
    # The engine's streams give a pooling request exactly one output, when it is done.
    output_kind: RequestOutputKind = RequestOutputKind.FINAL_ONLY

    def __post_init__(self) -> None:
        if self.dimensions is not None and (not isinstance(self.dimensions, int) or self.dimensions < 1):
            raise ValueError(f"dimensions must be a positive integer, got {self.dimensions!r}")
        t = self.truncate_prompt_tokens
        if t is not None and (not isinstance(t, int) or (t < 1 and t != -1)):
            raise ValueError(f"truncate_prompt_tokens must be a positive integer or -1, got {t!r}")
        if self.output_kind != RequestOutputKind.FINAL_ONLY:
            raise ValueError("output_kind of a pooling request must be FINAL_ONLY")
        if self.task not in ("embed", "score"):
            raise ValueError(f"task must be 'embed' or 'score', got {self.task!r}")
        if self.task == "score" and (self.dimensions is not None or self.normalize is not None):
            raise ValueError("dimensions and normalize apply to embeddings, not to scores")
        start = self.second_text_start
        if start is not None and (self.task != "score" or not isinstance(start, int) or start < 1):
            raise ValueError(f"second_text_start must be a positive integer of a score request, got {start!r}")

    def check_for_model(self, pooler: PoolerConfig, hidden_size: int) -> None:
        """ValueError when the model cannot give what is asked (naming `dimensions`, or saying which task the
        model does)."""
        if self.task == "embed" and pooler.scores:
            raise ValueError("this model is a cross-encoder: it scores text pairs (LLM.score, /score, /rerank) and "
                             "does not embed")
        if self.task == "score" and not pooler.scores:
            raise ValueError("scoring text pairs needs a cross-encoder (BertForSequenceClassification); this model "
                             "embeds")
        d = self.dimensions
        if d is None:
            return
        if not pooler.matryoshka:
            raise ValueError("dimensions is not supported by this model (it was not trained for truncated "
                             "embeddings: its config.json has no is_matryoshka / matryoshka_dimensions)")
        if pooler.matryoshka_dimensions and d not in pooler.matryoshka_dimensions:
            raise ValueError(f"dimensions must be one of {list(pooler.matryoshka_dimensions)} for this model, got {d}")
        if d > hidden_size:
            raise ValueError(f"dimensions must be at most the model's embedding size ({hidden_size}), got {d}")

    def truncation_length(self, max_model_len: int) -> Optional[int]:
        """Tokens an input is cut to, or None when inputs are not cut."""
        t = self.truncate_prompt_tokens
        if t is None:
            return None
        return max_model_len if t == -1 else min(t, max_model_len)


@dataclass
class EmbeddingOutput:
    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class ScoringOutput:
    score: float  # after the model's activation (sigmoid unless its files say otherwise)


@dataclass
class PoolingRequestOutput:
    """One pooling request's result (vLLM's PoolingRequestOutput). `outputs` is None and `finish_reason` "abort"
    when the request was aborted before its pass ran."""

    request_id: str
    outputs: Optional[Union[EmbeddingOutput, ScoringOutput]]
    prompt_token_ids: list[int]
    finished: bool = True
    prompt: Optional[str] = None
    finish_reason: str = "stop"


class EmbeddingRequestOutput(PoolingRequestOutput):
    """An embedding request's result: `outputs` is an EmbeddingOutput (or None, aborted)."""


class ScoringRequestOutput(PoolingRequestOutput):
    """A text pair's score from a cross-encoder: `outputs` is a ScoringOutput (or None, aborted)."""


def pooling_token_ids(tokenizer, prompts: list[PromptType], params: PoolingParams, max_model_len: int
                      ) -> list[list[int]]:
    """Token ids of text or id prompts, cut as params.truncate_prompt_tokens says (see PoolingParams): texts
    through the tokenizer's own truncation (one batch call), ids by keeping the last ones."""
    limit = params.truncation_length(max_model_len)
    texts = [p for p in prompts if isinstance(p, str)]
    encoded = iter(encode_texts(tokenizer, texts, limit) if texts else ())
    return [next(encoded) if isinstance(p, str) else (list(p)[-limit:] if limit is not None else list(p))
            for p in prompts]


def encode_texts(tokenizer, texts: list[str], limit: Optional[int]) -> list[list[int]]:
    """The ids `tokenizer(texts, truncation=True, max_length=limit).input_ids` gives (limit None: not cut). A fast
    tokenizer's Rust backend is called directly, through a copy configured for `limit` (encode_batch_fast: no
    offsets, no attention masks or token types; measured 1.25x faster than the transformers call, which is most of
    an embedding's host time); other tokenizers through transformers."""
    backend = _backend_cut_at(tokenizer, limit)
    if backend is None:
        cut = {} if limit is None else {"truncation": True, "max_length": limit}
        return tokenizer(texts, **cut).input_ids
    encode = getattr(backend, "encode_batch_fast", backend.encode_batch)  # tokenizers < 0.21: no _fast
    return [encoding.ids for encoding in encode(texts, add_special_tokens=True)]


# tokenizer -> {limit: its backend copy truncating there}; copies, so the shared backend's settings never change
_BACKENDS_BY_LIMIT: "weakref.WeakKeyDictionary[Any, dict[Optional[int], Any]]" = weakref.WeakKeyDictionary()
_BACKENDS_LOCK = threading.Lock()


def _backend_cut_at(tokenizer, limit: Optional[int]):
    """A copy of a fast tokenizer's `tokenizers.Tokenizer` that truncates as transformers would at `limit`
    (longest first, on the tokenizer's truncation side, special tokens kept) and never pads; None for a tokenizer
    without one. Made once per (tokenizer, limit)."""
    backend = getattr(tokenizer, "_tokenizer", None)
    if not getattr(tokenizer, "is_fast", False) or backend is None:
        return None
    with _BACKENDS_LOCK:
        by_limit = _BACKENDS_BY_LIMIT.setdefault(tokenizer, {})
        if limit not in by_limit:
            copy = type(backend).from_str(backend.to_str())
            copy.no_padding()
            if limit is None:
                copy.no_truncation()
            else:
                copy.enable_truncation(limit, stride=0, strategy="longest_first",
                                       direction=getattr(tokenizer, "truncation_side", "right"))
            by_limit[limit] = copy
        return by_limit[limit]


@dataclass(frozen=True)
class PoolingLimits:
    """What validating a pooling request needs to know of the model: kept by the engine, and sent by an engine
    process to the server's side at start-up (so the server validates before it sends)."""

    pooler: PoolerConfig
    hidden_size: int
    vocab_size: int
    max_model_len: int
    # The model is served to generate and pools alongside (last-token pooling in the generation scheduler;
    # LLMEngine): generation requests are valid too.
    generates: bool = False

    @property
    def task(self) -> str:
        """"score" for a cross-encoder, else "embed"."""
        return "score" if self.pooler.scores else "embed"

    def check(self, prompt_ids: list[int], params: PoolingParams) -> None:
        """ValueError when the input or the params cannot run on this model; the message names the field."""
        if self.generates and isinstance(params, PoolingParams) and self.pooler.mode != "last":
            raise ValueError(f"this model's {self.pooler.mode} pooling (its sentence-transformers config) is not "
                             "supported while it is served to generate, where a prompt may be split across chunks "
                             "and the prefix cache: serve it with --runner pooling (runner='pooling') to embed")
        if not isinstance(params, PoolingParams):
            raise ValueError("this model is served with the pooling runner: it embeds or scores (encode / embed / "
                             "score, /v1/embeddings, /score) and cannot generate")
        if not prompt_ids:
            raise ValueError("input must not be empty")
        vocab = self.vocab_size
        if any(not isinstance(t, int) or t < 0 or t >= vocab for t in prompt_ids):
            raise ValueError(f"input token ids must be integers in [0, {vocab})")
        if len(prompt_ids) > self.max_model_len:
            raise ValueError(f"input is {len(prompt_ids)} tokens but this model takes at most {self.max_model_len}; "
                             "pass truncate_prompt_tokens to cut it")
        params.check_for_model(self.pooler, self.hidden_size)
        if params.second_text_start is not None and params.second_text_start > len(prompt_ids):
            raise ValueError(f"second_text_start ({params.second_text_start}) is beyond the input's "
                             f"{len(prompt_ids)} tokens")


def finish_embedding(vector: torch.Tensor, pooler: PoolerConfig, params: PoolingParams) -> list[float]:
    """The request's view of a pooled vector [hidden] (pooled as `pooler` says): its first `dimensions` values,
    then (re)normalised when the model normalises (or the request asks to)."""
    normalize = pooler.normalize if params.normalize is None else params.normalize
    if params.dimensions is not None:
        vector = vector[: params.dimensions]
    elif normalize == pooler.normalize:
        return vector.tolist()  # pooled as asked
    if normalize:
        vector = F.normalize(vector, p=2, dim=-1)
    return vector.tolist()

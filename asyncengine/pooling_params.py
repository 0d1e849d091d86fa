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

from dataclasses import dataclass
from typing import Literal, Optional, Union

from asyncengine.pooler import PoolerConfig
from asyncengine.sampling_params import RequestOutputKind


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

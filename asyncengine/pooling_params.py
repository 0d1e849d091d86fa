"""PoolingParams: what one embedding request asks for, and the outputs it gets back (shaped as vLLM's).

Fields (validated in `__post_init__`, then against the model by `check_for_model`):
- dimensions: keep the first `dimensions` values of the embedding, then renormalise it (models trained for it
  only: Matryoshka; see pooler.py). None: the model's full width.
- normalize: override the checkpoint's normalisation (None: as the checkpoint says).
- truncate_prompt_tokens: an input longer than this is cut to this many tokens instead of being refused: text
  through the tokenizer's own truncation (special tokens kept), token ids by keeping the last ones (as vLLM).
  -1 means the model's maximum length. None: inputs longer than the model allows are a ValueError.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from asyncengine.pooler import PoolerConfig
from asyncengine.sampling_params import RequestOutputKind


@dataclass
class PoolingParams:
    dimensions: Optional[int] = None
    normalize: Optional[bool] = None
    truncate_prompt_tokens: Optional[int] = None
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

    def check_for_model(self, pooler: PoolerConfig, hidden_size: int) -> None:
        """ValueError (naming `dimensions`) when the model cannot give what is asked."""
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
class EmbeddingRequestOutput:
    """One embedding request's result (vLLM's PoolingRequestOutput[EmbeddingOutput]). `outputs` is None and
    `finish_reason` "abort" when the request was aborted before its pass ran."""

    request_id: str
    outputs: Optional[EmbeddingOutput]
    prompt_token_ids: list[int]
    finished: bool = True
    prompt: Optional[str] = None
    finish_reason: str = "stop"

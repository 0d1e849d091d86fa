"""The pooling wire protocols as msgspec Structs: OpenAI's `POST /v1/embeddings` (with vLLM's
`truncate_prompt_tokens`), and vLLM's `POST /score` and `/rerank` for cross-encoders. Kept apart from protocol.py;
the conventions are the same (unknown request fields ignored, wrong types a 400 naming the field).
"""

from __future__ import annotations

import time
from typing import Annotated, Literal, Optional, Union

from msgspec import Meta, Struct, field

# A string, a list of strings, a list of token ids, or a list of token-id lists. msgspec allows one array type per
# union, so the list's items are a union checked further in api/embeddings.py.
EmbeddingInput = Union[str, list[Union[str, int, list[int]]]]


class EmbeddingRequest(Struct, kw_only=True):
    input: EmbeddingInput
    model: Optional[str] = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Optional[int] = None
    user: Optional[str] = None
    # vLLM extension: cut longer inputs to this many tokens (-1: the model's maximum) instead of refusing them
    truncate_prompt_tokens: Optional[int] = None


class Embedding(Struct, kw_only=True):
    index: int
    embedding: Union[list[float], str]  # floats, or base64 of little-endian float32 bytes
    object: str = "embedding"


class EmbeddingUsage(Struct, kw_only=True):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(Struct, kw_only=True):
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage
    object: str = "list"


# -- vLLM's /score and /rerank (cross-encoders) ---------------------------------------------------------------
Text = Annotated[str, Meta(min_length=1)]
Texts = Union[Text, Annotated[list[Text], Meta(min_length=1)]]
# a positive number of tokens, or -1 (the model's maximum)
TruncateTokens = Annotated[int, Meta(ge=-1, extra_json_schema={"not": {"const": 0}})]


class ScoreRequest(Struct, kw_only=True):
    """Scores text_1 against each text of text_2 (1:N), or text_1[i] against text_2[i] (N:N)."""

    text_1: Texts
    text_2: Texts
    model: Optional[str] = None
    truncate_prompt_tokens: Optional[TruncateTokens] = None  # cut each pair to this many tokens


class ScoreData(Struct, kw_only=True):
    index: int
    score: float
    object: str = "score"


class PoolingUsage(Struct, kw_only=True):
    prompt_tokens: int
    total_tokens: int
    completion_tokens: int = 0


class ScoreResponse(Struct, kw_only=True):
    id: str
    model: str
    data: list[ScoreData]
    usage: PoolingUsage
    object: str = "list"
    created: int = field(default_factory=lambda: int(time.time()))


class RerankRequest(Struct, kw_only=True):
    """Ranks documents by their score against the query; top_n 0 (default) returns them all."""

    query: Text
    documents: Annotated[list[Text], Meta(min_length=1)]
    model: Optional[str] = None
    top_n: Annotated[int, Meta(ge=0)] = 0
    truncate_prompt_tokens: Optional[TruncateTokens] = None


class RerankDocument(Struct, kw_only=True):
    text: str


class RerankResult(Struct, kw_only=True):
    index: int  # the document's position in the request
    document: RerankDocument
    relevance_score: float


class RerankUsage(Struct, kw_only=True):
    prompt_tokens: int
    total_tokens: int


class RerankResponse(Struct, kw_only=True):
    id: str
    model: str
    usage: RerankUsage
    results: list[RerankResult]  # best first


POOLING_REQUEST_TYPES = (EmbeddingRequest, ScoreRequest, RerankRequest)
POOLING_RESPONSE_TYPES = (EmbeddingResponse, ScoreResponse, RerankResponse)

"""The embeddings wire protocol (OpenAI's `POST /v1/embeddings`, with vLLM's `truncate_prompt_tokens`), as msgspec
Structs. Kept apart from protocol.py; the conventions are the same (unknown request fields ignored, wrong types
a 400 naming the field).
"""

from __future__ import annotations

from typing import Literal, Optional, Union

from msgspec import Struct

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

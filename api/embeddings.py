"""`POST /v1/embeddings`: OpenAI's request turned into pooling requests, and their embeddings into OpenAI's answer.

Contract: `create` either returns an EmbeddingResponse or raises APIError (400 naming the field for bad input,
429 / 503 from the engine). The engine's add_request is the one validation of each input; the inputs of one
request are queued all or none, and all are aborted if the caller goes away (the task is cancelled) first.
"""

from __future__ import annotations

import base64
import uuid
from typing import Optional

import numpy as np

from asyncengine.api.errors import APIError, bad_request, from_engine_error
from asyncengine.api.inputs import text_or_token_batch
from asyncengine.api.protocol_embeddings import Embedding, EmbeddingRequest, EmbeddingResponse, EmbeddingUsage
from asyncengine.async_engine import AsyncLLMEngine, RequestStream
from asyncengine.pooling_params import PoolingParams

MAX_EMBEDDING_INPUTS = 2048  # inputs in one request, as OpenAI allows
# ValueError messages of PoolingParams and the pooling engine start with one of these request fields.
EMBEDDING_FIELDS = ("input", "dimensions", "truncate_prompt_tokens")


def embedding_inputs(request: EmbeddingRequest) -> list:
    """The request's inputs as a list of strings or token-id lists (400 naming `input` otherwise)."""
    items = text_or_token_batch(request.input, "input", MAX_EMBEDDING_INPUTS)
    if any(len(item) == 0 for item in items):
        raise bad_request("input must not contain empty strings or empty token lists", "input")
    return items


def pooling_params(request: EmbeddingRequest) -> PoolingParams:
    try:
        return PoolingParams(dimensions=request.dimensions, truncate_prompt_tokens=request.truncate_prompt_tokens)
    except ValueError as exc:
        raise from_engine_error(exc, EMBEDDING_FIELDS) from exc


def encode_embedding(vector: list[float], encoding_format: str):
    """floats as they are, or base64 of their little-endian float32 bytes (what OpenAI's clients decode)."""
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")
    return vector


class EmbeddingServing:
    def __init__(self, engine: AsyncLLMEngine):
        self.engine = engine

    async def create(self, request: EmbeddingRequest, model: str) -> EmbeddingResponse:
        engine = self.engine
        if not engine.pooling:
            raise APIError(400, f"the model `{model}` does not support embeddings (it is served to generate; start "
                                "the server with --runner pooling to embed with it)", param="model",
                           code="model_not_supported")
        params = pooling_params(request)
        items = embedding_inputs(request)
        token_lists = await engine.pooling_prompt_ids(items, params)
        streams = await self._add(token_lists, params)
        vectors = await self._collect(streams)
        data = [Embedding(index=i, embedding=encode_embedding(v, request.encoding_format))
                for i, v in enumerate(vectors)]
        tokens = sum(len(ids) for ids in token_lists)
        return EmbeddingResponse(data=data, model=model, usage=EmbeddingUsage(prompt_tokens=tokens,
                                                                              total_tokens=tokens))

    async def _add(self, token_lists: list[list[int]], params: PoolingParams) -> list[RequestStream]:
        """One engine request per input, all or none (400 naming the field, 429 / 503 from the engine)."""
        streams: list[RequestStream] = []
        base = f"embd-{uuid.uuid4().hex}"
        try:
            for i, ids in enumerate(token_lists):
                streams.append(await self.engine.add_request(ids, params, f"{base}-{i}"))
        except Exception as exc:
            await self._abort(streams)
            raise from_engine_error(exc, EMBEDDING_FIELDS) from exc
        return streams

    async def _collect(self, streams: list[RequestStream]) -> list[list[float]]:
        vectors: list[Optional[list[float]]] = []
        try:
            for stream in streams:
                output = await stream.get()
                if output.outputs is None:  # aborted (the server is shutting down)
                    raise APIError(503, "the request was aborted before its embeddings were computed")
                vectors.append(output.outputs.embedding)
        except BaseException as exc:
            await self._abort(streams)
            if isinstance(exc, Exception):
                raise from_engine_error(exc) from exc
            raise
        return vectors

    async def _abort(self, streams: list[RequestStream]) -> None:
        for stream in streams:
            if not stream.finished:
                await self.engine.abort(stream.request_id)

"""`POST /v1/embeddings`: OpenAI's request turned into pooling requests, and their embeddings into OpenAI's answer.

Contract: `create` either returns an EmbeddingResponse or raises APIError (400 naming the field for bad input,
429 / 503 from the engine). The engine's add_request is the one validation of each input; the inputs of one
request are queued all or none, and all are aborted if the caller goes away (the task is cancelled) first
(`PoolingServing`, which /score and /rerank share: scoring.py).
"""

from __future__ import annotations

import base64
import uuid
from typing import Iterable, Mapping, Optional, Union

import numpy as np

from asyncengine.api.errors import APIError, bad_request, from_engine_error
from asyncengine.api.inputs import text_or_token_batch
from asyncengine.api.protocol_embeddings import Embedding, EmbeddingRequest, EmbeddingResponse, EmbeddingUsage
from asyncengine.async_engine import AsyncLLMEngine, RequestStream
from asyncengine.pooling_params import EmbeddingOutput, PoolingParams, ScoringOutput

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


_TASK_ROUTES = {"embed": "/v1/embeddings", "score": "/score and /rerank"}


def check_pooling_task(engine: AsyncLLMEngine, task: str, model: str) -> None:
    """400 naming `model` when the served model does not do `task` ("embed" or "score")."""
    served = engine.pooling_task
    if served == task or (task == "embed" and engine.embeds):  # a decoder served to generate embeds too
        return
    does = ("is served to generate; start the server with --runner pooling to pool with it" if served is None
            else f"serves {_TASK_ROUTES[served]}")
    what = "embeddings" if task == "embed" else "scoring (it needs a cross-encoder)"
    raise APIError(400, f"the model `{model}` does not support {what}: it {does}", param="model",
                   code="model_not_supported")


class PoolingServing:
    """Runs the pooling requests of one HTTP request: added all or none, collected in order, all aborted when the
    caller goes away."""

    request_prefix = "pool"

    def __init__(self, engine: AsyncLLMEngine):
        self.engine = engine

    async def run(self, requests: list[tuple[list[int], PoolingParams]], fields: Iterable[str],
                  renames: Optional[Mapping[str, str]] = None) -> list[Union[EmbeddingOutput, ScoringOutput]]:
        """Each (token ids, params) through the engine; their outputs in order. `fields`, `renames`: how an
        engine ValueError names the request's field (errors.from_engine_error)."""
        streams = await self._add(requests, fields, renames)
        return await self._collect(streams)

    async def _add(self, requests: list[tuple[list[int], PoolingParams]], fields: Iterable[str],
                   renames: Optional[Mapping[str, str]]) -> list[RequestStream]:
        """One engine request per input, all or none (400 naming the field, 429 / 503 from the engine)."""
        streams: list[RequestStream] = []
        base = f"{self.request_prefix}-{uuid.uuid4().hex}"
        try:
            for i, (ids, params) in enumerate(requests):
                streams.append(await self.engine.add_request(ids, params, f"{base}-{i}"))
        except Exception as exc:
            await self._abort(streams)
            raise from_engine_error(exc, fields, renames) from exc
        return streams

    async def _collect(self, streams: list[RequestStream]) -> list[Union[EmbeddingOutput, ScoringOutput]]:
        results = []
        try:
            for stream in streams:
                output = await stream.get()
                if output.outputs is None:  # aborted (the server is shutting down)
                    raise APIError(503, "the request was aborted before its result was computed")
                results.append(output.outputs)
        except BaseException as exc:
            await self._abort(streams)
            if isinstance(exc, Exception):
                raise from_engine_error(exc) from exc
            raise
        return results

    async def _abort(self, streams: list[RequestStream]) -> None:
        for stream in streams:
            if not stream.finished:
                await self.engine.abort(stream.request_id)


class EmbeddingServing(PoolingServing):
    request_prefix = "embd"

    async def create(self, request: EmbeddingRequest, model: str) -> EmbeddingResponse:
        check_pooling_task(self.engine, "embed", model)
        params = pooling_params(request)
        items = embedding_inputs(request)
        token_lists = await self.engine.pooling_prompt_ids(items, params)
        outputs = await self.run([(ids, params) for ids in token_lists], EMBEDDING_FIELDS)
        data = [Embedding(index=i, embedding=encode_embedding(o.embedding, request.encoding_format))
                for i, o in enumerate(outputs)]
        tokens = sum(len(ids) for ids in token_lists)
        return EmbeddingResponse(data=data, model=model, usage=EmbeddingUsage(prompt_tokens=tokens,
                                                                              total_tokens=tokens))

"""vLLM's `POST /score` and `POST /rerank` (also under /v1/) for cross-encoders: text pairs in, one score each.

Contract: `score` / `rerank` return a ScoreResponse / RerankResponse or raise APIError: 400 naming the field for
bad input (an empty text or list, lengths that do not pair, a pair longer than the model takes without
truncate_prompt_tokens) and naming `model` when the served model is not a cross-encoder; 429 / 503 from the engine.
Each pair is one pooling request (PoolingServing: all or none, aborted when the caller goes away); its tokens are
the tokenizer's text-pair encoding ("[CLS] a [SEP] b [SEP]", token type 1 from b on), as sentence-transformers'
CrossEncoder builds them.
"""

from __future__ import annotations

import uuid
from dataclasses import replace
from typing import Optional

from asyncengine.api.embeddings import PoolingServing, check_pooling_task
from asyncengine.api.errors import bad_request, from_engine_error
from asyncengine.api.protocol_embeddings import (PoolingUsage, RerankDocument, RerankRequest, RerankResponse,
                                                 RerankResult, RerankUsage, ScoreData, ScoreRequest, ScoreResponse)
from asyncengine.pooling_engine import TextPair, pair_texts
from asyncengine.pooling_params import PoolingParams

MAX_SCORE_PAIRS = 2048  # pairs in one request, as MAX_EMBEDDING_INPUTS
SCORE_FIELDS = ("text_1", "text_2", "truncate_prompt_tokens")
RERANK_FIELDS = ("query", "documents", "top_n", "truncate_prompt_tokens")


class ScoreServing(PoolingServing):
    request_prefix = "score"

    async def score(self, request: ScoreRequest, model: str) -> ScoreResponse:
        check_pooling_task(self.engine, "score", model)
        pairs = _pairs(request.text_1, request.text_2, ("text_1", "text_2"))
        scores, tokens = await self._score(pairs, request.truncate_prompt_tokens, SCORE_FIELDS, "text_2")
        return ScoreResponse(id=f"score-{uuid.uuid4().hex}", model=model,
                             data=[ScoreData(index=i, score=s) for i, s in enumerate(scores)],
                             usage=PoolingUsage(prompt_tokens=tokens, total_tokens=tokens))

    async def rerank(self, request: RerankRequest, model: str) -> RerankResponse:
        check_pooling_task(self.engine, "score", model)
        pairs = _pairs(request.query, request.documents, ("query", "documents"))
        scores, tokens = await self._score(pairs, request.truncate_prompt_tokens, RERANK_FIELDS, "documents")
        ranked = sorted(range(len(scores)), key=lambda i: -scores[i])
        if request.top_n:
            ranked = ranked[: request.top_n]
        results = [RerankResult(index=i, document=RerankDocument(text=request.documents[i]),
                                relevance_score=scores[i]) for i in ranked]
        return RerankResponse(id=f"rerank-{uuid.uuid4().hex}", model=model, results=results,
                              usage=RerankUsage(prompt_tokens=tokens, total_tokens=tokens))

    async def _score(self, pairs: list[TextPair], truncate_prompt_tokens: Optional[int], fields: tuple,
                     second_field: str) -> tuple[list[float], int]:
        """Each pair's score, and the tokens of all pairs. An over-long pair is named by the second field (it is
        the part that varies per pair)."""
        try:
            params = PoolingParams(task="score", truncate_prompt_tokens=truncate_prompt_tokens)
        except ValueError as exc:
            raise from_engine_error(exc, fields) from exc
        encoded = await self.engine.pair_prompt_ids(pairs, params)
        requests = [(ids, replace(params, second_text_start=start)) for ids, start in encoded]
        outputs = await self.run(requests, fields, renames={"input": second_field})
        return [o.score for o in outputs], sum(len(ids) for ids, _ in encoded)


def _pairs(first, second, names: tuple[str, str]) -> list[TextPair]:
    """pooling_engine.pair_texts, its ValueError as a 400 naming the field; at most MAX_SCORE_PAIRS pairs."""
    try:
        pairs = pair_texts(first, second, names)
    except ValueError as exc:
        raise bad_request(str(exc), param=str(exc).split(" ", 1)[0]) from exc
    if len(pairs) > MAX_SCORE_PAIRS:
        raise bad_request(f"{names[1]} must hold at most {MAX_SCORE_PAIRS} texts, got {len(pairs)}", names[1])
    return pairs

"""PoolingRequests: the embedding requests that an LLMEngine serves alongside generation, in its scheduler.

A model served to generate (a decoder) embeds too, with last-token pooling: an embedding request becomes a
prefill-only Request (max_tokens 1, `pooling_params` set) in the same scheduler, budget, chunks and KV blocks as
generation; the step that computes its last prompt token pools it (ScheduledRequest.pools), and booking that step
finishes it (Scheduler.update frees its blocks). This class is the one place that knows about those requests; the
engine calls it at each point of their life, in this order:

    limits / tokenize / check   what validating a request needs (None / ValueError when the checkpoint's pooling
                                config cannot be served here), its token ids, the check itself
    add                         queue a checked request into the scheduler (the engine checked its id is free)
    book(requests, pooled)      after the step's Scheduler.update: each pooled state [hidden] becomes the request's
                                final output (normalised, `dimensions` applied); requests aborted meanwhile are
                                skipped
    emit(stats, now)            the outputs booked since the last emit, each exactly once, with their latencies
    abort(request_id)           take a live request out of the scheduler; its "abort" output, or None when the id
                                is not a live pooling request

State it owns (nobody else writes it): the live requests (id -> Request and its prompt text) and the outputs booked
but not yet emitted. `unfinished` is True while either holds anything.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import torch

from asyncengine.pooler import PoolerConfig, load_pooler_config
from asyncengine.pooling_params import (EmbeddingOutput, EmbeddingRequestOutput, PoolingLimits, PoolingParams,
                                        PromptType, finish_embedding, pooling_token_ids)
from asyncengine.request import Request, RequestStatus
from asyncengine.sampling_params import SamplingParams

if TYPE_CHECKING:  # engine.py imports this module
    from asyncengine.engine import StepStats
    from asyncengine.scheduler import Scheduler


class PoolingRequests:
    def __init__(self, pooler: Optional[PoolerConfig], pooler_error: Optional[str], tokenizer, scheduler: "Scheduler",
                 hidden_size: int, vocab_size: int, max_model_len: int):
        """pooler: the pooling the checkpoint asks for, or None with `pooler_error` saying why it cannot embed."""
        self.pooler = pooler
        self.pooler_error = pooler_error
        self.tokenizer = tokenizer
        self.scheduler = scheduler
        self.hidden_size = hidden_size
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.live: dict[str, tuple[Request, Optional[str]]] = {}  # request id -> (request, its prompt text)
        self._booked: list[tuple[EmbeddingRequestOutput, float]] = []  # not emitted yet: (output, arrival time)

    @classmethod
    def for_checkpoint(cls, folder: Path, hf_config, tokenizer, scheduler: "Scheduler", hidden_size: int,
                       vocab_size: int, max_model_len: int) -> "PoolingRequests":
        """The pooling a decoder's embeddings follow (its sentence-transformers config, else last token,
        normalised); a config asking for what we cannot do leaves the engine unable to embed, not failing."""
        try:
            pooler, error = load_pooler_config(Path(folder), False, hf_config), None
        except ValueError as exc:
            pooler, error = None, str(exc)
        return cls(pooler, error, tokenizer, scheduler, hidden_size, vocab_size, max_model_len)

    # -- validation -------------------------------------------------------------------------------------------
    @property
    def max_len(self) -> int:
        """The longest input an embedding takes: max_model_len, lowered to sentence-transformers' max_seq_length
        when the checkpoint has one (as the pooling runner does unless max_model_len is given)."""
        limit = self.pooler.max_seq_length if self.pooler is not None else None
        return min(self.max_model_len, limit) if limit else self.max_model_len

    @property
    def limits(self) -> Optional[PoolingLimits]:
        """What validating an embedding request needs (generates=True: generation requests are valid too); None
        when the checkpoint's pooling config cannot be served (check says why)."""
        if self.pooler is None:
            return None
        return PoolingLimits(self.pooler, self.hidden_size, self.vocab_size, self.max_len, generates=True)

    def tokenize(self, prompts: list[PromptType], params: PoolingParams) -> list[list[int]]:
        """Token ids of pooling prompts (see pooling_params.pooling_token_ids)."""
        return pooling_token_ids(self.tokenizer, prompts, params, self.max_len)

    def check(self, prompt_ids: list[int], params: PoolingParams) -> None:
        """ValueError (naming the field) when this pooling request cannot run here: PoolingLimits.check."""
        if self.pooler is None:
            raise ValueError(f"this model cannot embed: {self.pooler_error}")
        self.limits.check(prompt_ids, params)

    # -- life of a request ------------------------------------------------------------------------------------
    def has(self, request_id: str) -> bool:
        return request_id in self.live

    @property
    def unfinished(self) -> bool:
        return bool(self.live or self._booked)

    def add(self, request_id: str, prompt: Optional[str], prompt_token_ids: list[int], params: PoolingParams,
            arrival_time: Optional[float]) -> None:
        """Queue a checked request under a free id: a prefill-only Request in the scheduler."""
        request = Request(request_id, list(prompt_token_ids), SamplingParams(), max_tokens=1,
                          arrival_time=arrival_time if arrival_time is not None else time.monotonic())
        request.pooling_params = params
        self.live[request_id] = (request, prompt)
        self.scheduler.add(request)

    def book(self, requests: tuple[Request, ...], pooled: torch.Tensor, stats: "StepStats") -> None:
        """A step's pooled states (pooled: [P, hidden] float32 on the host, one row per request of `requests`)
        become final outputs; requests aborted meanwhile are skipped. Their prompt tokens count in `stats`."""
        if self.pooler.normalize:
            pooled = torch.nn.functional.normalize(pooled, p=2, dim=-1)
        for request, vector in zip(requests, pooled):
            entry = self.live.pop(request.request_id, None)
            if entry is None or entry[0] is not request or request.status != RequestStatus.FINISHED_STOPPED:
                continue
            embedding = finish_embedding(vector, self.pooler, request.pooling_params)
            output = EmbeddingRequestOutput(request.request_id, EmbeddingOutput(embedding), request.prompt_token_ids,
                                            True, entry[1])
            self._booked.append((output, request.arrival_time))
            stats.prompt_tokens += request.num_prompt_tokens

    def emit(self, stats: "StepStats", now: float) -> list[EmbeddingRequestOutput]:
        """The outputs booked since the last emit (each once); their end-to-end latency and finish reason go into
        `stats` (an embedding's first and only output is its last: time to first token = latency)."""
        booked, self._booked = self._booked, []
        for _, arrival in booked:
            stats.e2e_latency.append(now - arrival)
            stats.time_to_first_token.append(now - arrival)
            stats.finished_reasons.append("stop")
        return [output for output, _ in booked]

    def abort(self, request_id: str) -> Optional[EmbeddingRequestOutput]:
        """Take a live pooling request out of the scheduler (its blocks freed now); its final "abort" output, or
        None when `request_id` is not a live pooling request."""
        entry = self.live.pop(request_id, None)
        if entry is None:
            return None
        request, prompt = entry
        self.scheduler.abort([request])
        return EmbeddingRequestOutput(request_id, None, request.prompt_token_ids, True, prompt, "abort")

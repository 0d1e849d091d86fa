"""AsyncLLMEngine: one event loop owns the engine; `generate()` is an async iterator of outputs.

It validates each request once (request.validate_request), keeps one output stream per request, and drives an
engine through the EngineClient contract (engine_client.py), of one of two kinds:
  - InProcessClient (default): the engine's step task runs on the loop that first uses it, its device work in a
    thread (StepPipeline turns: book, apply aborts, prepare and launch, emit while the device works);
  - EngineCoreClient (config.engine_process): the engine steps in a child process (engine_core.py) and its
    outputs come back over a pipe, read by a thread and handed to this loop.
Either way each step's outputs reach `_deliver` on the loop, and a failed engine reaches `_fail_all`.

Back-pressure: each request has one output slot. When its reader is slow, DELTA outputs merge into the slot
(text and tokens concatenate) and CUMULATIVE / FINAL_ONLY outputs replace it, so memory per request stays bounded
and the step loop never waits for a reader.

Cancellation: when the consumer of `generate()` stops early (break, task cancelled, stream closed), the request is
aborted (the engine frees it before its next step). Errors: if a step raises, every in-flight request receives
EngineDeadError, the engine reports itself dead, and new requests fail at once. The engine installs no signal
handlers.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import uuid
from typing import AsyncIterator, Callable, Optional

from asyncengine.config import EngineConfig
from asyncengine.engine import EngineStats, PromptType, StepStats
from asyncengine.engine_client import EngineClient, InProcessClient
from asyncengine.engine_core import EngineCoreClient
from asyncengine.outputs import CompletionOutput, RequestOutput
from asyncengine.pooling_engine import PoolingLimits, TextPair, pair_token_ids, pooling_token_ids
from asyncengine.pooling_params import EmbeddingRequestOutput, PoolingParams
from asyncengine.request import validate_request
from asyncengine.sampling_params import RequestOutputKind, SamplingParams
from asyncengine.tokenizer import apply_chat_template

logger = logging.getLogger(__name__)

_OFF_LOOP_CHARS = 4096  # prompts longer than this are tokenized in a worker thread


class EngineDeadError(RuntimeError):
    """The engine's step loop failed or was shut down; no request can be served."""


class QueueFullError(RuntimeError):
    """The waiting queue is at max_queue_len; retry later."""


def merge_outputs(old: RequestOutput, new: RequestOutput) -> RequestOutput:
    """Fold a newer DELTA output into an unread one: texts, token ids and logprobs concatenate."""
    by_index = {c.index: c for c in old.outputs}
    merged = []
    for c in new.outputs:
        prev = by_index.pop(c.index, None)
        if prev is None:
            merged.append(c)
            continue
        merged.append(CompletionOutput(
            index=c.index,
            text=prev.text + c.text,
            token_ids=prev.token_ids + c.token_ids,
            cumulative_logprob=c.cumulative_logprob,
            logprobs=(prev.logprobs or []) + (c.logprobs or []) if c.logprobs is not None else None,
            finish_reason=c.finish_reason,
            stop_reason=c.stop_reason,
        ))
    merged.extend(by_index.values())
    merged.sort(key=lambda c: c.index)
    new.outputs = merged
    return new


class RequestStream:
    """One bounded output slot for one request; written by the step loop, read by the consumer."""

    def __init__(self, request_id: str, kind: RequestOutputKind):
        self.request_id = request_id
        self.kind = kind
        self._slot: Optional[RequestOutput] = None
        self._error: Optional[BaseException] = None
        self._ready = asyncio.Event()
        self.finished = False  # the final output has been put

    def put(self, output: RequestOutput) -> None:
        if self._slot is not None and self.kind == RequestOutputKind.DELTA:
            output = merge_outputs(self._slot, output)
        self._slot = output
        self.finished = output.finished
        self._ready.set()

    def put_error(self, error: BaseException) -> None:
        self._error = error
        self.finished = True
        self._ready.set()

    async def get(self) -> RequestOutput:
        """The unread output, else the error (an output put before the error is read first)."""
        await self._ready.wait()
        if self._slot is None and self._error is not None:
            raise self._error
        output, self._slot = self._slot, None
        if self._error is None:  # an error stays ready for the next get
            self._ready.clear()
        return output


class AsyncLLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.client: EngineClient = EngineCoreClient(config) if config.engine_process else InProcessClient(config)
        # The pooling runner (embedding models, cross-encoders): its requests are validated against these limits
        # (dimensions, the checkpoint's max length, the task), known in this process either way.
        self._pooling: Optional[PoolingLimits] = self.client.pooling
        # Loading a model leaves millions of long-lived objects; a full garbage collection over them stalls the
        # loop for a few hundred ms. Move them out of the collector's sight (as vLLM does after start-up).
        gc.collect()
        gc.freeze()
        self._streams: dict[str, RequestStream] = {}
        self._dead: Optional[BaseException] = None
        self._shutting_down = False

    # -- facts for the API layer ------------------------------------------------------------------------------
    @property
    def tokenizer(self):
        return self.client.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.client.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.client.vocab_size

    @property
    def model_name(self) -> str:
        return self.config.model_name

    @property
    def pooling(self) -> bool:
        """Served with the pooling runner (embeddings or scores), not to generate."""
        return self._pooling is not None and not self._pooling.generates

    @property
    def embeds(self) -> bool:
        """Serves embeddings: an embedding model, or a decoder served to generate that pools alongside."""
        return self._pooling is not None and self._pooling.task == "embed"

    @property
    def pooling_task(self) -> Optional[str]:
        """What pooling requests this engine serves: "embed" (embedding models), "score" (cross-encoders), or
        None (a model served to generate)."""
        return self._pooling.task if self.pooling else None

    @property
    def errored(self) -> bool:
        if self._dead is None and not self._shutting_down:
            dead = self.client.check_alive()
            if dead is not None:
                self._fail_all(dead)
        return self._dead is not None

    @property
    def num_unfinished_requests(self) -> int:
        return len(self._streams)

    def stats(self) -> EngineStats:
        """The engine's state after its latest step (queue lengths, KV usage, running totals)."""
        return self.client.stats()

    def add_stats_listener(self, listener: Callable[[StepStats], None]) -> None:
        self.client.stats_listeners.append(listener)

    def check_health(self) -> None:
        """Raise EngineDeadError if the engine can no longer serve."""
        if self.errored:
            raise EngineDeadError(f"engine is dead: {self._dead!r}") from self._dead

    # -- tokenization, off the loop for long inputs -----------------------------------------------------------
    async def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        def run() -> list[int]:
            return self.tokenizer(text, add_special_tokens=add_special_tokens).input_ids

        if len(text) > _OFF_LOOP_CHARS:
            return await asyncio.get_running_loop().run_in_executor(None, run)
        return run()

    async def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> str:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(
            None, lambda: apply_chat_template(self.tokenizer, messages, add_generation_prompt, **kwargs)
        )

    # -- requests ---------------------------------------------------------------------------------------------
    async def generate(
        self,
        prompt: PromptType,
        sampling_params: Optional[SamplingParams] = None,
        request_id: Optional[str] = None,
    ) -> AsyncIterator[RequestOutput]:
        """Yield outputs as tokens arrive; the last has finished=True. Raises (at the first iteration)
        ValueError for bad input, QueueFullError when the queue is full, EngineDeadError when the engine cannot
        serve. Stopping early aborts the request."""
        stream = await self.add_request(prompt, sampling_params, request_id)
        async for output in self.iterate(stream):
            yield output

    async def encode(
        self,
        prompt: PromptType,
        pooling_params: Optional[PoolingParams] = None,
        request_id: Optional[str] = None,
    ) -> AsyncIterator[EmbeddingRequestOutput]:
        """Embed one prompt (text or token ids); yields one EmbeddingRequestOutput (vLLM's shape:
        `.outputs.embedding`, `.prompt_token_ids`). On a model served to generate, the request is prefill-only in
        the generation scheduler (LLMEngine). Raises (at the first iteration) ValueError for bad input or a model
        that cannot embed, QueueFullError and EngineDeadError as generate() does. Stopping early aborts the
        request."""
        if self._pooling is None:
            raise ValueError("encode: this model cannot embed (its pooling config is not supported; see the "
                             "server's log), or it runs a pooling engine that does not report its limits")
        params = pooling_params or PoolingParams()
        [prompt_ids] = await self.pooling_prompt_ids([prompt], params)
        stream = await self.add_request(prompt_ids, params, request_id)
        async for output in self.iterate(stream):
            yield output

    @property
    def _max_pooling_len(self) -> int:
        """The longest input a pooling request takes (on a generating engine it may be below max_model_len: the
        checkpoint's sentence-transformers max_seq_length)."""
        return self._pooling.max_model_len if self._pooling is not None else self.max_model_len

    async def pooling_prompt_ids(self, prompts: list[PromptType], params: PoolingParams) -> list[list[int]]:
        """The token ids each pooling prompt embeds, truncated as params ask; tokenized off the loop when the texts
        are long or many."""
        def run() -> list[list[int]]:
            return pooling_token_ids(self.tokenizer, prompts, params, self._max_pooling_len)

        if sum(len(p) for p in prompts if isinstance(p, str)) > _OFF_LOOP_CHARS:
            return await asyncio.get_running_loop().run_in_executor(None, run)
        return run()

    async def pair_prompt_ids(self, pairs: list[TextPair], params: PoolingParams
                              ) -> list[tuple[list[int], Optional[int]]]:
        """A cross-encoder's inputs (see pooling_engine.pair_token_ids); tokenized off the loop when long or many."""
        def run():
            return pair_token_ids(self.tokenizer, pairs, params, self._max_pooling_len)

        if sum(len(a) + len(b) for a, b in pairs) > _OFF_LOOP_CHARS:
            return await asyncio.get_running_loop().run_in_executor(None, run)
        return run()

    def _validate(self, prompt_ids: list[int], params) -> None:
        """The one validation of a request at the edge: ValueError naming the field."""
        if isinstance(params, PoolingParams):
            if self._pooling is None:
                raise ValueError("this model cannot embed: its sentence-transformers pooling config is not "
                                 "supported (the server's log says why)")
            self._pooling.check(prompt_ids, params)
        elif self.pooling:
            self._pooling.check(prompt_ids, params)  # refuses SamplingParams: the pooling runner cannot generate
        else:
            validate_request(prompt_ids, params, self.vocab_size, self.max_model_len)

    async def add_request(
        self, prompt: PromptType, sampling_params: Optional[SamplingParams] = None, request_id: Optional[str] = None
    ) -> RequestStream:
        """Validate (ValueError, the server's one validation of a request) and queue a request now; read its
        outputs with `iterate(stream)`. For callers (the API) that must know the request is accepted before they
        start answering."""
        self.check_health()
        if self._shutting_down:
            raise EngineDeadError("engine is shutting down")
        request_id = request_id or uuid.uuid4().hex
        params = sampling_params or SamplingParams()
        limit = self.config.max_queue_len
        if limit is not None and self.client.stats().num_waiting >= limit:
            raise QueueFullError(f"the waiting queue is full ({limit} requests); retry later")
        prompt_ids = await self.tokenize(prompt) if isinstance(prompt, str) else list(prompt)
        self._validate(prompt_ids, params)
        if isinstance(params, SamplingParams) and params.structured_outputs is not None:
            # compile (cached) off the loop; ValueError if it cannot
            await asyncio.get_running_loop().run_in_executor(None, self.client.check_structured_outputs, params)
        self.client.start(asyncio.get_running_loop(), self._deliver_all, self._fail_all)
        try:
            self.client.add_request(request_id, prompt if isinstance(prompt, str) else None, prompt_ids, params)
        except BrokenPipeError as exc:  # an engine process that exited since check_health()
            raise EngineDeadError("the engine process has exited") from exc
        stream = RequestStream(request_id, params.output_kind)
        self._streams[request_id] = stream
        return stream

    async def iterate(self, stream: RequestStream) -> AsyncIterator[RequestOutput]:
        """Outputs of an added request until it finishes; leaving early (break, cancel, close) aborts it."""
        finished = False
        try:
            while not finished:
                output = await stream.get()
                finished = output.finished
                yield output
        finally:
            if not finished:
                self._streams.pop(stream.request_id, None)
                self.client.abort_request([stream.request_id])

    async def abort(self, request_id: str) -> None:
        """End the request with finish_reason "abort"; its reader gets a final output. Unknown ids are ignored.
        Never suspends: the engine applies the abort before its next step."""
        if request_id in self._streams:
            self.client.abort_request([request_id])

    def _deliver_all(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:
                continue
            stream.put(output)
            if output.finished:
                del self._streams[output.request_id]

    def _fail_all(self, exc: BaseException) -> None:
        self._dead = exc
        error = EngineDeadError(f"engine step failed: {exc!r}")
        error.__cause__ = exc
        for stream in self._streams.values():
            stream.put_error(error)
        self._streams.clear()

    async def abort_all(self) -> None:
        """Abort every in-flight request (readers get finish_reason "abort")."""
        if self._streams:
            self.client.abort_request(list(self._streams))

    async def wait_until_idle(self, timeout: Optional[float] = None) -> bool:
        """Wait until no request is in flight (True), or the timeout passes (False)."""
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        while self._streams or self.client.has_unfinished_requests():
            if self.errored or (deadline is not None and loop.time() >= deadline):
                return not (self._streams or self.client.has_unfinished_requests())
            await asyncio.sleep(0.01)
        return True

    async def shutdown(self, timeout: float = 0.0) -> None:
        """Stop accepting requests, give in-flight ones `timeout` seconds, abort the rest, stop the engine."""
        self._shutting_down = True
        if timeout > 0:
            await self.wait_until_idle(timeout)
        await self.abort_all()
        await self.wait_until_idle(5.0)
        self.client.close()
        if self._dead is None:
            self._dead = EngineDeadError("engine was shut down")

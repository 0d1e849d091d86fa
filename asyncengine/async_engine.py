"""AsyncLLMEngine: one event loop owns the engine; `generate()` is an async iterator of outputs.

The step task runs on the loop that first uses the engine:

    while requests remain:
        apply pending aborts                      (frees their KV blocks before the next step)
        got = engine.book(last step)              on the loop: tokens and token-decided stops
        next step prepared and launched           on the loop / in the device thread, so the device is busy while
        engine.emit(got) -> stream.put(output)    ... the loop detokenizes; put never blocks (bounded, merging slot)
        await the device thread                   its call collects a step's tokens (engine.StepPipeline: on CUDA
                                                  the step before the one it launched)
    then sleep on an event until a request arrives (no polling)

Back-pressure: each request has one output slot. When its reader is slow, DELTA outputs merge into the slot
(text and tokens concatenate) and CUMULATIVE / FINAL_ONLY outputs replace it, so memory per request stays bounded
and the step loop never waits for a reader.

Cancellation: when the consumer of `generate()` stops early (break, task cancelled, stream closed), the request is
marked for abort and the step loop frees it before its next step. Errors: if a step raises, every in-flight
request receives EngineDeadError, the engine reports itself dead, and new requests fail at once. The engine
installs no signal handlers.

With config.engine_process the engine runs in a child process instead (engine_core.py: the same step loop there;
its outputs come back over a pipe, read by a thread and handed to this loop); everything above holds, aborts go
to the core at once, and the loop's time goes to the readers.

Thread safety: the device thread only reads the scheduled requests of its own step; everything that changes
engine state runs on the loop, and aborts are applied between steps.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import AsyncIterator, Callable, Optional

from asyncengine.config import EngineConfig
from asyncengine.engine import LLMEngine, PromptType, StepPipeline, StepStats
from asyncengine.engine_core import EngineCoreClient
from asyncengine.outputs import CompletionOutput, RequestOutput
from asyncengine.sampling_params import RequestOutputKind, SamplingParams

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
        # config.engine_process: the engine runs in a child process (engine_core.py) and this loop only
        # receives its outputs; the client answers to the same names as an LLMEngine.
        self._remote = config.engine_process
        self.engine = EngineCoreClient(config) if self._remote else LLMEngine(config)
        # Loading a model leaves millions of long-lived objects; a full garbage collection over them stalls the
        # loop for a few hundred ms. Move them out of the collector's sight (as vLLM does after start-up).
        gc.collect()
        gc.freeze()
        self._streams: dict[str, RequestStream] = {}
        self._pending_aborts: set[str] = set()
        # the step loop's device thread (an engine process has its own)
        self._device_thread = None if self._remote else ThreadPoolExecutor(1, thread_name_prefix="asyncengine-step")
        self._step_task: Optional[asyncio.Task] = None
        self._wakeup: Optional[asyncio.Event] = None
        self._dead: Optional[BaseException] = None
        self._shutting_down = False

    @classmethod
    def from_config(cls, config: EngineConfig) -> "AsyncLLMEngine":
        return cls(config)

    # -- facts for the API layer ------------------------------------------------------------------------------
    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def model_name(self) -> str:
        return self.config.model_name

    @property
    def errored(self) -> bool:
        self._notice_a_dead_engine_process()
        return self._dead is not None

    def _notice_a_dead_engine_process(self) -> None:
        """An engine process that dies while no request runs sends nothing: ask the OS (cheap: waitpid)."""
        if self._remote and self._dead is None and not self._shutting_down and not self.engine.alive:
            exc = RuntimeError(f"the engine process exited (status {self.engine.process.exitcode})")
            logger.error("the engine is dead: %s", exc)
            self._fail_all(exc)

    @property
    def num_running(self) -> int:
        return self.engine.num_running

    @property
    def num_waiting(self) -> int:
        return self.engine.num_waiting

    @property
    def num_unfinished_requests(self) -> int:
        return len(self._streams)

    @property
    def kv_cache_usage(self) -> float:
        return self.engine.kv_cache_usage

    @property
    def num_preemptions(self) -> int:
        """Preemptions since start (running total)."""
        return self.engine.num_preemptions

    @property
    def prefix_cache_queries(self) -> int:
        """Prompt tokens looked up in the prefix cache since start."""
        return self.engine.prefix_cache_queries

    @property
    def prefix_cache_hits(self) -> int:
        """Prompt tokens found in the prefix cache since start."""
        return self.engine.prefix_cache_hits

    @property
    def vocab_size(self) -> int:
        return self.engine.vocab_size

    def add_stats_listener(self, listener: Callable[[StepStats], None]) -> None:
        self.engine.stats_listeners.append(listener)

    def check_health(self) -> None:
        """Raise EngineDeadError if the engine can no longer serve."""
        if self.errored:
            raise EngineDeadError(f"engine is dead: {self._dead!r}") from self._dead

    # -- tokenization, off the loop for long inputs -----------------------------------------------------------
    async def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        def run() -> list[int]:
            return self.engine.tokenizer(text, add_special_tokens=add_special_tokens).input_ids

        if len(text) > _OFF_LOOP_CHARS:
            return await asyncio.get_running_loop().run_in_executor(None, run)
        return run()

    async def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> str:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(
            None, lambda: self.engine.apply_chat_template(messages, add_generation_prompt, **kwargs)
        )

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """ValueError now (before streaming starts) if the request cannot run."""
        self.engine.check_prompt(prompt_token_ids, params)

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

    async def add_request(
        self, prompt: PromptType, sampling_params: Optional[SamplingParams] = None, request_id: Optional[str] = None
    ) -> RequestStream:
        """Validate and queue a request now; read its outputs with `iterate(stream)`. For callers (the API) that
        must know the request is accepted before they start answering."""
        self.check_health()
        if self._shutting_down:
            raise EngineDeadError("engine is shutting down")
        request_id = request_id or uuid.uuid4().hex
        params = sampling_params or SamplingParams()
        limit = self.config.max_queue_len
        if limit is not None and self.engine.num_waiting >= limit:
            raise QueueFullError(f"the waiting queue is full ({limit} requests); retry later")
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        prompt_ids = await self.encode(prompt) if isinstance(prompt, str) else list(prompt)
        try:
            self.engine.add_request(request_id, prompt, params, prompt_token_ids=prompt_ids)
        except BrokenPipeError as exc:  # an engine process that exited since check_health()
            raise EngineDeadError("the engine process has exited") from exc
        stream = RequestStream(request_id, params.output_kind)
        self._streams[request_id] = stream
        self._ensure_step_task()
        if self._wakeup is not None:
            self._wakeup.set()
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
                self._request_abort(stream.request_id)

    async def abort(self, request_id: str) -> None:
        """End the request with finish_reason "abort"; its reader gets a final output. Unknown ids are ignored.
        Never suspends: the abort is queued for the step loop, which applies it before its next step."""
        if request_id in self._streams:
            self._request_abort(request_id, keep_stream=True)

    def _request_abort(self, request_id: str, keep_stream: bool = False) -> None:
        if not keep_stream:
            self._streams.pop(request_id, None)
        self._pending_aborts.add(request_id)
        if self._remote:  # the core applies it between its steps
            self._apply_aborts()
        elif self._wakeup is not None:
            self._wakeup.set()

    def _apply_aborts(self) -> None:
        if not self._pending_aborts:
            return
        ids, self._pending_aborts = self._pending_aborts, set()
        for output in self.engine.abort_request(ids):
            self._deliver(output)

    def _deliver(self, output: RequestOutput) -> None:
        stream = self._streams.get(output.request_id)
        if stream is None:
            return
        stream.put(output)
        if output.finished:
            del self._streams[output.request_id]

    # -- the step loop ----------------------------------------------------------------------------------------
    def _deliver_all(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            self._deliver(output)

    def _ensure_step_task(self) -> None:
        if self._remote:  # no step task: the core's outputs arrive through a reader on this loop
            self.engine.start(asyncio.get_running_loop(), self._deliver_all, self._fail_all)
            return
        if self._step_task is None or self._step_task.done():
            self._wakeup = asyncio.Event()
            self._step_task = asyncio.get_running_loop().create_task(self._step_loop(), name="asyncengine-step-loop")

    async def _step_loop(self) -> None:
        """Pipelined (engine.StepPipeline): while the device thread runs the next step, the loop books, detokenizes
        and delivers the last one."""
        loop = asyncio.get_running_loop()
        pipeline = StepPipeline(self.engine)
        done = None
        try:
            while True:
                got = pipeline.book(done)
                self._apply_aborts()  # before scheduling: aborted requests' blocks are free for the next step
                call = pipeline.next_call()
                pending = loop.run_in_executor(self._device_thread, call) if call is not None else None
                for output in self.engine.emit(got):
                    self._deliver(output)
                if pending is None and not self.engine.has_unfinished_requests():
                    self._wakeup.clear()
                    await self._wakeup.wait()
                done = await pending if pending is not None else None
                await asyncio.sleep(0)  # let readers and new requests run between steps
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # noqa: BLE001 - any failure kills the engine, loudly
            logger.exception("engine step failed; the engine is now dead")
            self._fail_all(exc)

    def _fail_all(self, exc: BaseException) -> None:
        self._dead = exc
        error = EngineDeadError(f"engine step failed: {exc!r}")
        error.__cause__ = exc
        for stream in self._streams.values():
            stream.put_error(error)
        self._streams.clear()

    async def abort_all(self) -> None:
        """Abort every in-flight request (readers get finish_reason "abort")."""
        for request_id in list(self._streams):
            await self.abort(request_id)
        if self._step_task is None and self.engine.has_unfinished_requests():
            self._apply_aborts()

    async def wait_until_idle(self, timeout: Optional[float] = None) -> bool:
        """Wait until no request is in flight (True), or the timeout passes (False)."""
        deadline = None if timeout is None else asyncio.get_running_loop().time() + timeout
        while self._streams or self.engine.has_unfinished_requests():
            if self.errored or (deadline is not None and asyncio.get_running_loop().time() >= deadline):
                return not (self._streams or self.engine.has_unfinished_requests())
            await asyncio.sleep(0.01)
        return True

    async def shutdown(self, timeout: float = 0.0) -> None:
        """Stop accepting requests, give in-flight ones `timeout` seconds, abort the rest, stop the step loop."""
        self._shutting_down = True
        if timeout > 0:
            await self.wait_until_idle(timeout)
        await self.abort_all()
        await self.wait_until_idle(5.0)
        if self._step_task is not None:
            self._step_task.cancel()
            try:
                await self._step_task
            except (asyncio.CancelledError, Exception):
                pass
        if self._remote:
            self.engine.close()
        else:
            self._device_thread.shutdown(wait=True)
        if self._dead is None:
            self._dead = EngineDeadError("engine was shut down")

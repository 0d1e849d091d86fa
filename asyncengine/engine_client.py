"""The contract between AsyncLLMEngine and the engine it drives (`EngineClient`), and its in-process kind.

Two kinds keep it: `InProcessClient` (an LLMEngine, or a PoolingEngine for embedding models and cross-encoders,
stepped by a task on the caller's event loop, its device work in a thread) and `engine_core.EngineCoreClient`
(either engine in a process of its own). AsyncLLMEngine holds one and never asks which.
"""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Optional, Protocol, Union

from asyncengine.config import EngineConfig
from asyncengine.engine import EngineStats, LLMEngine, StepPipeline, StepStats
from asyncengine.outputs import RequestOutput
from asyncengine.pooling_engine import PoolingEngine, PoolingLimits, build_engine_on_its_thread
from asyncengine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

OnOutputs = Callable[[list[RequestOutput]], None]
OnDead = Callable[[BaseException], None]


class EngineClient(Protocol):
    """What AsyncLLMEngine asks of an engine; every method is called on the event loop's thread. `tokenizer`,
    `max_model_len`, `vocab_size` and `pooling` (a pooling engine's limits; None for one that generates) are fixed
    once constructed; each of `stats_listeners` is called on the loop with every step's StepStats."""

    tokenizer: object
    max_model_len: int
    vocab_size: int
    pooling: Optional[PoolingLimits]
    stats_listeners: list[Callable[[StepStats], None]]

    def start(self, loop: asyncio.AbstractEventLoop, on_outputs: OnOutputs, on_dead: OnDead) -> None:
        """From now on deliver each step's outputs on `loop` through on_outputs, in step order, a request's last
        with finished=True; if the engine fails, call on_dead(exc) once and deliver nothing more. Idempotent for
        the same loop; a new loop takes delivery over."""

    def add_request(self, request_id: str, prompt: Optional[str], prompt_token_ids: list[int],
                    params: SamplingParams) -> None:
        """Queue a request that has passed validate_request. ValueError for an id in use; BrokenPipeError when an
        engine process has exited."""

    def check_structured_outputs(self, params: SamplingParams) -> None:
        """ValueError (naming structured_outputs) when the request's constraint does not compile. Blocks while it
        compiles (cached by constraint): call it off the event loop."""

    def abort_request(self, request_ids: list[str]) -> None:
        """End these requests before the engine's next step (finish_reason "abort"); their final outputs come
        through on_outputs. Unknown or finished ids are ignored. Never blocks."""

    def has_unfinished_requests(self) -> bool:
        """True while a request added here has not delivered its final output."""

    def stats(self) -> EngineStats:
        """The engine's state after its latest step (num_waiting also counts requests it has not seen yet)."""

    def check_alive(self) -> Optional[BaseException]:
        """None while the engine can serve, else why not. Cheap: health checks call it."""

    def close(self) -> None:
        """Stop stepping and release the engine (device thread or process). Idempotent."""


class InProcessClient:
    """An LLMEngine on the caller's event loop: a step task runs StepPipeline turns on the loop, the device work
    in a thread of its own. Aborts are applied between steps (before the next prepare), so their blocks are free
    for that step."""

    def __init__(self, config: EngineConfig):
        # pooling: the same stepping; built on the thread that steps it (pooling_engine.build_engine_on_its_thread)
        self.engine: Union[LLMEngine, PoolingEngine]
        self.engine, self._device_thread = build_engine_on_its_thread(config, "asyncengine-step")
        self.tokenizer = self.engine.tokenizer
        self.max_model_len = self.engine.max_model_len
        self.vocab_size = self.engine.vocab_size
        self.pooling = self.engine.limits  # also a generating engine's, which embeds alongside (generates=True)
        self.stats_listeners = self.engine.stats_listeners
        self._pending_aborts: set[str] = set()
        self._task: Optional[asyncio.Task] = None
        self._wakeup: Optional[asyncio.Event] = None
        self._dead: Optional[BaseException] = None

    def start(self, loop: asyncio.AbstractEventLoop, on_outputs: OnOutputs, on_dead: OnDead) -> None:
        self._on_outputs, self._on_dead = on_outputs, on_dead
        if self._task is None or self._task.done() or self._task.get_loop() is not loop:
            self._wakeup = asyncio.Event()
            self._task = loop.create_task(self._step_loop(), name="asyncengine-step-loop")

    def add_request(self, request_id: str, prompt: Optional[str], prompt_token_ids: list[int],
                    params: SamplingParams) -> None:
        self.engine.enqueue(request_id, prompt, prompt_token_ids, params)
        self._wake()

    def check_structured_outputs(self, params: SamplingParams) -> None:
        self.engine.check_structured_outputs(params)

    def abort_request(self, request_ids: list[str]) -> None:
        self._pending_aborts.update(request_ids)
        if self._task is None or self._task.done():  # no step loop to apply them: do it now
            self._on_outputs(self._apply_aborts())
        self._wake()

    def has_unfinished_requests(self) -> bool:
        return self.engine.has_unfinished_requests() or bool(self._pending_aborts)

    def stats(self) -> EngineStats:
        return self.engine.stats()

    def check_alive(self) -> Optional[BaseException]:
        if self._dead is None:
            failure = self.engine.failure()  # a TP worker that died while idle
            if failure is not None:
                self._dead = failure
                self._on_dead(failure)
        return self._dead

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        self._device_thread.shutdown(wait=True)
        self.engine.close()

    def _wake(self) -> None:
        if self._wakeup is not None:
            self._wakeup.set()

    def _apply_aborts(self) -> list[RequestOutput]:
        ids, self._pending_aborts = self._pending_aborts, set()
        return self.engine.abort_request(ids) if ids else []

    async def _step_loop(self) -> None:
        """StepPipeline turns: while the device thread runs the next step, the loop books, detokenizes and
        delivers the last one; sleeps on an event (no polling) while there is no request."""
        loop = asyncio.get_running_loop()
        pipeline = StepPipeline(self.engine)
        done = None
        try:
            while True:
                pending, outputs = pipeline.turn(
                    done, lambda call: loop.run_in_executor(self._device_thread, call), self._apply_aborts)
                self._on_outputs(outputs)
                if pending is None and pipeline.idle and not self._pending_aborts:
                    self._wakeup.clear()
                    await self._wakeup.wait()
                done = await pending if pending is not None else None
                await asyncio.sleep(0)  # let readers and new requests run between steps
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # noqa: BLE001 - any failure kills the engine, loudly
            logger.exception("engine step failed; the engine is now dead")
            self.engine.close(graceful=False)  # TP workers: no process left behind
            self._dead = exc
            self._on_dead(exc)

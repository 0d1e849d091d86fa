"""The engine in a process of its own: `EngineCoreClient` (in the caller's process) and `core_main` (the child).

Why: with hundreds of streams, a server's event loop spends longer framing and sending SSE chunks than the
engine spends on a step (loadtest/RESULTS.md, run 13: about 15 ms of loop time per step against an 11.7 ms
step), and on one thread the two add up. In two processes they overlap: the core steps at the GPU's pace, and
the server, when it falls behind, finds several steps' tokens merged in each request's output slot, so it sends
fewer, larger chunks instead of slowing the engine down (vLLM splits its API server and engine core likewise).

    caller's process (AsyncLLMEngine, its loop)          core process (core_main)
    EngineCoreClient.add_request / abort_request          inbox thread: pipe -> queue
        ── ("add", ...) / ("abort", ids) / ("shutdown",) ──▶
                                                            loop: book, apply messages, launch (device thread),
        ◀── ("outputs", [wire output], [StepStats], EngineStats, adds) ── emit (detokenize, stop strings), send
    receiver thread: pipe -> loop.call_soon_threadsafe -> outputs -> RequestStream.put

Contracts:
  - The core owns all scheduling state. The client keeps the EngineClient contract (engine_client.py): it knows
    the facts sent once at start-up (`CoreFacts`) and the engine's `EngineStats` sent with each step's outputs;
    `has_unfinished_requests` counts the requests it sent that have not finished yet, and its stats' num_waiting
    adds the ones the core has not read yet (so max_queue_len holds in a burst).
  - Outputs travel as tuples (`_to_wire`), about 10x cheaper to pickle and unpickle than the dataclasses (256
    one-token outputs: 0.2 ms against 2.1 ms here), and without the prompt, which the client fills back in.
  - A pooling model (embeddings, cross-encoder scores) runs here too (build_engine picks the PoolingEngine): its
    outputs travel as `_pooling_to_wire` tuples (the embedding as float32 bytes), and its PoolingLimits come with
    the facts, so that the server validates pooling requests before it sends them.
  - Validation runs once, before the client (AsyncLLMEngine.add_request); the core queues what it is sent.
  - The core stops on ("shutdown",) or when the pipe closes (its parent died). When a step raises it sends
    ("dead", message) and exits with status 1; when it exits without a word (killed), the client sees the pipe
    close. Either way the client reports the engine dead and fails every stream (on_dead); a core that dies
    while idle is noticed by AsyncLLMEngine.errored (waitpid). The core ignores SIGINT and SIGTERM: its server
    decides when it stops.
"""

from __future__ import annotations

import atexit
import gc
import logging
import multiprocessing
import os
import queue
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, replace
from typing import Callable, Optional

import numpy as np
import torch

from asyncengine.config import EngineConfig
from asyncengine.engine import EngineStats, LLMEngine, StepPipeline, StepStats
from asyncengine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from asyncengine.pooling_engine import PoolingLimits, build_engine_on_its_thread
from asyncengine.pooling_params import (EmbeddingOutput, EmbeddingRequestOutput, PoolingRequestOutput, ScoringOutput,
                                        ScoringRequestOutput)
from asyncengine.sampling_params import SamplingParams
from asyncengine.structured_output import StructuredOutputManager
from asyncengine.tokenizer import load_tokenizer

logger = logging.getLogger(__name__)

IDLE_CHECK_S = 0.5  # while idle, how often the core checks that its tensor-parallel workers live
# Once the engine is known broken (a tensor-parallel rank died or hung), how long a step still running may take to
# fail by itself before the core reports the engine dead without it: a CUDA kernel waiting for a peer that is gone
# (a collective in a graph replay, a symmetric-memory barrier) may never return.
STUCK_STEP_GRACE_S = 5.0
STARTUP_POLL_S = 0.5  # how often the client checks that a starting core is still alive
SHUTDOWN_WAIT_S = 10.0  # how long the client waits for the core to exit before killing it


@dataclass(frozen=True)
class CoreFacts:
    """What the client needs to know of the loaded model, sent once when the core is ready."""

    max_model_len: int
    vocab_size: int
    pooling: Optional[PoolingLimits] = None  # the engine's pooling limits (generates=True: it generates too)


# -- the wire form of an output -----------------------------------------------------------------------------------
def _to_wire(output: RequestOutput) -> tuple:
    completions = [(c.index, c.text, c.token_ids, c.cumulative_logprob, c.logprobs, c.finish_reason, c.stop_reason)
                   for c in output.outputs]
    m = output.metrics
    metrics = None if m is None else (m.arrival_time, m.first_scheduled_time, m.first_token_time, m.last_token_time,
                                      m.finished_time, m.num_preemptions)
    return output.request_id, completions, output.finished, metrics, output.num_cached_tokens


_POOLING_WIRE = "pooling"  # first item of a pooling output's wire tuple (a request id is never this object)


def _pooling_to_wire(output: PoolingRequestOutput) -> tuple:
    """(marker, request id, kind, result, finish_reason): result is a score, an embedding's float32 bytes (a
    quarter of its pickled floats), or None (aborted)."""
    result = output.outputs
    if isinstance(result, EmbeddingOutput):
        kind, value = "embed", np.asarray(result.embedding, dtype=np.float32).tobytes()
    elif isinstance(result, ScoringOutput):
        kind, value = "score", result.score
    else:
        kind, value = ("score" if isinstance(output, ScoringRequestOutput) else "embed"), None
    return _POOLING_WIRE, output.request_id, kind, value, output.finish_reason


def _pooling_from_wire(wire: tuple, prompt: Optional[str], prompt_ids: list[int]) -> PoolingRequestOutput:
    _, request_id, kind, value, finish_reason = wire
    if kind == "score":
        return ScoringRequestOutput(request_id, None if value is None else ScoringOutput(value), prompt_ids, True,
                                    prompt, finish_reason)
    embedding = None if value is None else EmbeddingOutput(np.frombuffer(value, dtype=np.float32).tolist())
    return EmbeddingRequestOutput(request_id, embedding, prompt_ids, True, prompt, finish_reason)


def _any_to_wire(output) -> tuple:
    return _pooling_to_wire(output) if isinstance(output, PoolingRequestOutput) else _to_wire(output)


def _from_wire(wire: tuple, prompt: Optional[str], prompt_ids: list[int]) -> RequestOutput:
    request_id, completions, finished, metrics, num_cached = wire
    return RequestOutput(
        request_id=request_id,
        prompt=prompt,
        prompt_token_ids=prompt_ids,
        outputs=[CompletionOutput(*c) for c in completions],
        finished=finished,
        metrics=None if metrics is None else RequestMetrics(*metrics),
        num_cached_tokens=num_cached,
    )


# -- the core process ---------------------------------------------------------------------------------------------
def leave_a_core_for_the_event_loop(config) -> None:
    """On CPU with the engine in the server's process, torch's threads would take every core and the event loop
    (HTTP, SSE, detokenization) would wait for them; one core fewer serves more tokens (measured:
    loadtest/RESULTS.md). OMP_NUM_THREADS still wins. The engine process does not call this: its event loop is in
    the other process, and all cores for the model served 1.6x the tokens of cores - 1 there (issue 17)."""
    cores = os.cpu_count() or 1
    if config.torch_device().type == "cpu" and "OMP_NUM_THREADS" not in os.environ and cores > 1:
        torch.set_num_threads(cores - 1)


API_CPU_PRIORITIES = ("normal", "idle")


def check_api_cpu_priority(config: EngineConfig, choice: str) -> None:
    """ValueError naming api_cpu_priority unless `choice` can be had: "normal", or "idle" (the server's threads
    under Linux's SCHED_IDLE) beside an engine process.

    What idle buys and costs (loadtest/RESULTS.md, session 20; 2 cores, the default model on CPU, 64 streams): the
    engine process's torch threads meet at a barrier after every operation, so a server thread that holds a core
    for a burst of SSE writes (~3.5 ms a step) stalls both, and the scheduler does not preempt it for them (nice
    19 did not help). Under SCHED_IDLE the server runs only on CPU time no normal thread wants. Served / offline,
    medians of 5 trials: 0.83 with server and load generator at normal priority, 0.85 with the server idle, 0.86
    with the load generator idle, **0.97** with both idle (the load generator then stands for clients on other
    machines, whose CPU the engine does not share). But any other busy process of the same session or container
    takes the cores first: with two spinning processes beside it the server fell to 1/3 of normal priority's tokens/s
    and /health took up to 27 s (another session's: level tokens/s, /health up to 0.7 s against 0.05 s). Hence
    opt-in, for a machine that does nothing but serve; and an unprivileged process cannot return to normal. (Since
    session 21 the engine's own OpenMP threads spin between operations, so an engine on CPU must be told to wait
    passively beside an idle server: `let_a_cpu_engine_process_wait_passively`; the figures above predate that.)"""
    if choice not in API_CPU_PRIORITIES:
        raise ValueError(f"api_cpu_priority must be one of {', '.join(API_CPU_PRIORITIES)}, got {choice!r}")
    if choice == "idle" and not hasattr(os, "SCHED_IDLE"):
        raise ValueError("api_cpu_priority 'idle' needs Linux's SCHED_IDLE, which this platform lacks")
    if choice == "idle" and not config.engine_process:
        raise ValueError("api_cpu_priority 'idle' needs the engine in a process of its own (engine_process): in "
                         "the server's process the model's threads would run idle too")


# libgomp's settings for how a waiting OpenMP thread waits: a user who set either keeps it
OPENMP_WAIT_SETTINGS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")


def let_a_cpu_engine_process_wait_passively(config: EngineConfig, choice: str) -> bool:
    """Under api_cpu_priority "idle" with the engine on CPU, have the engine process that starts next wait
    passively: OMP_WAIT_POLICY=PASSIVE in this process's environment, which the spawned engine process (and its
    tensor-parallel ranks) inherits. True if it was set; a user's OMP_WAIT_POLICY or GOMP_SPINCOUNT is left alone.

    Why: torch's OpenMP threads spin between operations (libgomp's default, ~300,000 pauses) while waiting for
    each other, so an engine process on CPU never leaves a core idle, and a server under SCHED_IDLE then gets
    none: once the pipe of outputs it does not read is full, the engine stalls too. Measured on 2 cores, 64
    streams (loadtest/RESULTS.md, session 25): served / offline 0.10 with the engine spinning, 0.71 (clients at
    idle priority) and 0.66 (at normal) with it passive, against 0.65 for the default normal priority. This
    process's own libgomp read its environment when torch loaded, so the server is unaffected."""
    if choice != "idle" or config.torch_device().type != "cpu":
        return False
    if any(name in os.environ for name in OPENMP_WAIT_SETTINGS):
        return False
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    return True


def run_threads_at_idle_priority(thread_ids: Optional[list[int]] = None) -> None:
    """Put these threads (native ids; default: every thread of this process) under SCHED_IDLE; threads they
    start later inherit it, and so would a process they start: an unprivileged process cannot leave SCHED_IDLE,
    so call this only after the engine process has started."""
    ids = thread_ids if thread_ids is not None else [int(t) for t in os.listdir("/proc/self/task")]
    for tid in ids:
        try:
            os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
        except ProcessLookupError:  # a thread that ended meanwhile
            pass


def core_main(config: EngineConfig, inbox_conn, outbox_conn, log_level: int) -> None:
    """The child's entry point: load the engine, report ready (or why not), then step until told to stop.

    It ignores SIGINT and SIGTERM: a Ctrl-C in a terminal (or a supervisor signalling the whole process group)
    reaches it too, and the server, which drains its streams first, tells it when to stop; if the server dies
    instead, the pipe's end stops it."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s[core]: %(message)s")
    try:
        # torch's threads: every core (see leave_a_core_for_the_event_loop). An LLMEngine, or a PoolingEngine for a
        # pooling model, built on the thread that will step it (pooling_engine.build_engine_on_its_thread says why)
        engine, device = build_engine_on_its_thread(config, "asyncengine-step")
        gc.collect()  # as AsyncLLMEngine does: keep the model's long-lived objects out of the collector's sight
        gc.freeze()
    except BaseException as exc:  # noqa: BLE001 - the parent must hear why the engine could not start
        outbox_conn.send(("failed", f"{type(exc).__name__}: {exc}"))
        raise SystemExit(2)
    pooling = engine.limits  # a generating engine's too: it embeds alongside (PoolingLimits.generates)
    outbox_conn.send(("ready", CoreFacts(engine.max_model_len, engine.vocab_size, pooling)))
    inbox: queue.Queue = queue.Queue()
    threading.Thread(target=_pump_inbox, args=(inbox_conn, inbox), name="asyncengine-core-inbox", daemon=True).start()
    try:
        _step_until_shutdown(engine, device, inbox, outbox_conn)
    except BrokenPipeError:  # the server is gone mid-send: nobody is left to report to
        logger.warning("the server went away; the engine core exits")
    except BaseException as exc:  # noqa: BLE001 - any failure kills the engine, loudly
        logger.exception("engine step failed; the engine core exits")
        engine.close(graceful=False)  # the tensor-parallel world may be broken: kill the workers
        try:
            outbox_conn.send(("dead", f"{type(exc).__name__}: {exc}"))
        finally:
            if isinstance(exc, _StuckStep):  # its thread cannot be joined: leave without waiting for it
                os._exit(1)
            raise SystemExit(1)
    finally:
        engine.close()  # the tensor-parallel workers, if any


def _pump_inbox(conn, inbox: queue.Queue) -> None:
    """Move messages from the pipe to the queue, so the client's sends never wait for a step to end."""
    try:
        while True:
            inbox.put(conn.recv())
    except (EOFError, OSError):  # the parent closed the pipe or died
        inbox.put(("shutdown",))


class _Shutdown(Exception):
    """The client asked the core to stop (or its pipe ended)."""


class _StuckStep(RuntimeError):
    """The engine broke and its step in flight did not end within STUCK_STEP_GRACE_S."""


def _step_until_shutdown(engine: LLMEngine, device: ThreadPoolExecutor, inbox: queue.Queue, outbox_conn) -> None:
    """The core's step loop: StepPipeline turns on `device` (the thread the engine was built on), with the pipe in
    place of request streams."""
    pipeline = StepPipeline(engine)
    stats: list[StepStats] = []
    engine.stats_listeners.append(stats.append)
    last_sent = (EngineStats(), 0)
    adds_applied = 0

    def apply_messages() -> list[RequestOutput]:
        nonlocal adds_applied
        messages = _drain(inbox, block=pipeline.idle, failure=engine.failure)
        adds_applied += sum(m[0] == "add" for m in messages)
        return _apply_messages(engine, messages)

    done = None
    try:
        while True:
            try:
                pending, outputs = pipeline.turn(done, device.submit, apply_messages)
            except _Shutdown:
                return
            state = (engine.stats(), adds_applied)
            if outputs or state != last_sent or any(s.prompt_tokens or s.generation_tokens for s in stats):
                outbox_conn.send(("outputs", [_any_to_wire(o) for o in outputs], stats[:], *state))
                last_sent = state
            stats.clear()
            done = _step_result(pending, engine.failure) if pending is not None else None
    finally:
        device.shutdown(wait=False)  # a stuck step's thread is never joined here


def _step_result(pending, failure: Callable[[], Optional[BaseException]]):
    """The device call's result, or _StuckStep when the engine broke meanwhile (`failure()`) and the call has not
    ended (returned or raised) STUCK_STEP_GRACE_S later."""
    broken_at = None
    while True:
        try:
            return pending.result(timeout=IDLE_CHECK_S)
        except FutureTimeout:
            exc = failure()
            if exc is None:
                continue
            broken_at = broken_at if broken_at is not None else time.monotonic()
            if time.monotonic() - broken_at > STUCK_STEP_GRACE_S:
                raise _StuckStep(f"{exc} (its step in flight did not end)") from exc


def _drain(inbox: queue.Queue, block: bool, failure: Callable[[], Optional[BaseException]]) -> list[tuple]:
    """The inbox's messages; with `block`, waits for one, raising `failure()` if the engine breaks meanwhile
    (a tensor-parallel worker that dies while no request runs)."""
    messages = []
    while block and not messages:
        try:
            messages.append(inbox.get(timeout=IDLE_CHECK_S))
        except queue.Empty:
            if (exc := failure()) is not None:
                raise exc
    while True:
        try:
            messages.append(inbox.get_nowait())
        except queue.Empty:
            return messages


def _apply_messages(engine: LLMEngine, messages: list[tuple]) -> list[RequestOutput]:
    """Apply adds and aborts in order; returns the aborted requests' final outputs. _Shutdown on shutdown."""
    outputs: list[RequestOutput] = []
    for message in messages:
        kind = message[0]
        if kind == "add":
            engine.enqueue(*message[1:])  # validated before it was sent; the client keeps ids unique
        elif kind == "abort":
            outputs += engine.abort_request(message[1])
        elif kind == "shutdown":
            raise _Shutdown
    return outputs


# -- the client ---------------------------------------------------------------------------------------------------
class EngineCoreClient:
    """An EngineClient (engine_client.py) whose engine runs in a child process.

    Start-up blocks until the child has loaded the model (ValueError/RuntimeError with the child's reason if it
    could not). `start(loop, on_outputs, on_dead)` attaches the pipe to an event loop; from then on each step's
    outputs arrive through `on_outputs(list[RequestOutput])` on that loop."""

    def __init__(self, config: EngineConfig):
        self.config = config
        self.tokenizer = load_tokenizer(config.tokenizer or config.model)
        self.stats_listeners: list[Callable[[StepStats], None]] = []
        self._stats = EngineStats()
        self._adds_sent = 0
        self._adds_applied = 0  # by the core, as of its last outputs
        self._prompts: dict[str, tuple[Optional[str], list[int]]] = {}  # live requests: their prompts
        self._loop = None
        self._receiver: Optional[threading.Thread] = None
        self._received: list[tuple] = []  # messages read by the receiver thread, not yet handled on the loop
        self._received_lock = threading.Lock()
        self._dead: Optional[BaseException] = None
        self._closing = False
        context = multiprocessing.get_context("spawn")  # CUDA cannot be used in a forked child
        self._to_core, core_inbox = context.Pipe(duplex=False)[::-1]
        core_outbox, self._from_core = context.Pipe(duplex=False)[::-1]
        self.process = context.Process(
            target=core_main, args=(config, core_inbox, core_outbox, logging.getLogger().getEffectiveLevel()),
            name="asyncengine-core", daemon=True,
        )
        self.process.start()
        core_inbox.close()
        core_outbox.close()
        # The core ignores SIGTERM, so multiprocessing's own exit handler (terminate, then join) would wait for it
        # forever if the caller exits without shutting down; this handler runs first (atexit is last-in,
        # first-out) and stops it through the pipe.
        atexit.register(self.close)
        try:
            facts = self._wait_until_ready()
        except BaseException:
            self.close()
            raise
        self.max_model_len = facts.max_model_len
        self.vocab_size = facts.vocab_size
        self.pooling = facts.pooling
        # Compiles constraints here only to validate them before the request is accepted (the core compiles
        # its own copy, from its cache or in its background pool).
        self.structured = StructuredOutputManager(self.tokenizer, self.vocab_size,
                                                  [t for t in [self.tokenizer.eos_token_id] if t is not None])

    def _wait_until_ready(self) -> CoreFacts:
        while not self._from_core.poll(STARTUP_POLL_S):
            if not self.process.is_alive():
                raise RuntimeError(f"the engine core process exited with status {self.process.exitcode} while "
                                   "starting (see its log above)")
        try:
            kind, payload = self._from_core.recv()
        except EOFError:
            self.process.join(SHUTDOWN_WAIT_S)
            raise RuntimeError(f"the engine core process exited with status {self.process.exitcode} while "
                               "starting (see its log above)") from None
        if kind == "failed":
            self.process.join(SHUTDOWN_WAIT_S)
            raise ValueError(f"the engine could not start: {payload}")
        return payload

    # -- the EngineClient contract ------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: Optional[str], prompt_token_ids: list[int],
                    params: SamplingParams) -> None:
        """Send the request; the core queues it before its next step."""
        if request_id in self._prompts:
            raise ValueError(f"request id {request_id!r} is already in use")
        arrival = time.monotonic()  # system-wide clock on Linux: the core's timings start here
        self._to_core.send(("add", request_id, prompt, prompt_token_ids, params, arrival))
        self._prompts[request_id] = (prompt, prompt_token_ids)
        self._adds_sent += 1

    def check_structured_outputs(self, params: SamplingParams) -> None:
        if params.structured_outputs is not None:
            self.structured.compile(params.structured_outputs)

    def abort_request(self, request_ids: list[str]) -> None:
        """Send the abort; the final outputs come back with the core's next outputs."""
        ids = [i for i in request_ids if i in self._prompts]
        if ids:
            try:
                self._to_core.send(("abort", ids))
            except BrokenPipeError:  # the core has exited, and its requests with it
                pass

    def has_unfinished_requests(self) -> bool:
        return bool(self._prompts)

    def stats(self) -> EngineStats:
        """The core's stats at its last step; num_waiting adds the requests sent since that it had not read yet:
        exact for max_queue_len even in a burst that arrives between two steps."""
        unread = self._adds_sent - self._adds_applied
        return replace(self._stats, num_waiting=self._stats.num_waiting + unread) if unread else self._stats

    def check_alive(self) -> Optional[BaseException]:
        """An engine process that dies while no request runs sends nothing: ask the OS (cheap: waitpid)."""
        if self._dead is None and not self._closing and not self.process.is_alive():
            self._dead = RuntimeError(f"the engine process exited (status {self.process.exitcode})")
            logger.error("the engine is dead: %s", self._dead)
        return self._dead

    # -- the pipe, read by a thread, handed to the event loop ----------------------------------------------------
    def start(self, loop, on_outputs: Callable[[list[RequestOutput]], None],
              on_dead: Callable[[BaseException], None]) -> None:
        """Deliver the core's messages on `loop` from now on (idempotent for the same loop; a new loop takes the
        pipe over, as an in-process engine's step task follows the loop that uses it).

        A thread reads the pipe with blocking reads and queues whole messages for the loop. (Not
        loop.add_reader: uvloop makes the descriptor non-blocking, and Connection.recv then fails mid-message
        with BlockingIOError once a message outgrows what the pipe holds.)"""
        if self._loop is loop:
            return
        self._loop, self._on_outputs, self._on_dead = loop, on_outputs, on_dead
        if self._receiver is None:
            self._receiver = threading.Thread(target=self._receive, name="asyncengine-core-outbox", daemon=True)
            self._receiver.start()
        loop.call_soon(self._drain_received)

    def _receive(self) -> None:
        """The receiver thread: whole messages into the queue; wake the loop when the queue was empty."""
        while True:
            try:
                message = self._from_core.recv()
            except (EOFError, OSError):
                message = ("closed",)
            with self._received_lock:
                wake = not self._received
                self._received.append(message)
            if wake:
                try:
                    self._loop.call_soon_threadsafe(self._drain_received)
                except RuntimeError:  # that loop is closed; the next start() drains the queue
                    pass
            if message[0] == "closed":
                return

    def _drain_received(self) -> None:
        with self._received_lock:
            messages, self._received = self._received, []
        for message in messages:
            if self._dead is not None:
                return
            if message[0] == "outputs":
                self._on_outputs(self._receive_outputs(*message[1:]))
                continue
            if message[0] == "closed" and self._closing:
                return
            if message[0] == "dead":
                self._dead = RuntimeError(f"engine core step failed: {message[1]}")
            else:  # "closed": the pipe ended without a word (the core was killed, or crashed)
                self.process.join(1.0)
                self._dead = RuntimeError(f"the engine core process exited (status {self.process.exitcode})")
            logger.error("the engine is dead: %s", self._dead)
            self._on_dead(self._dead)

    def _receive_outputs(self, wires: list[tuple], stats: list[StepStats], engine_stats: EngineStats,
                         adds_applied: int) -> list[RequestOutput]:
        self._stats, self._adds_applied = engine_stats, adds_applied
        for step_stats in stats:
            for listener in self.stats_listeners:
                listener(step_stats)
        outputs = []
        for wire in wires:
            if wire[0] == _POOLING_WIRE:  # a pooling request has one output, its last
                prompt, prompt_ids = self._prompts.pop(wire[1], (None, []))
                outputs.append(_pooling_from_wire(wire, prompt, prompt_ids))
                continue
            request_id, finished = wire[0], wire[2]
            prompt, prompt_ids = (self._prompts.pop if finished else self._prompts.get)(request_id, (None, []))
            outputs.append(_from_wire(wire, prompt, prompt_ids))
        return outputs

    def close(self) -> None:
        """Stop the core (it finishes its step first) and wait for it; kill it if it does not exit. Idempotent."""
        if self._closing:
            return
        self._closing = True  # the pipe's end is expected now, not a death
        atexit.unregister(self.close)
        try:
            self._to_core.send(("shutdown",))
        except (OSError, ValueError):  # already gone
            pass
        self.process.join(SHUTDOWN_WAIT_S)
        if self.process.is_alive():
            logger.warning("the engine core did not stop within %.0f s; killing it", SHUTDOWN_WAIT_S)
            self.process.kill()
            self.process.join()
        self._to_core.close()
        if self._receiver is not None:
            self._receiver.join(SHUTDOWN_WAIT_S)  # it ends at the pipe's end, which the core's exit closes
        self._from_core.close()

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
        ◀── ("outputs", [wire output], [StepStats], Snapshot) ── emit (detokenize, stop strings), send
    receiver thread: pipe -> loop.call_soon_threadsafe -> outputs -> RequestStream.put

Contracts:
  - The core owns all scheduling state. The client knows the facts sent once at start-up (`CoreFacts`) and the
    `Snapshot` (queue lengths, KV usage, counters) sent with each step's outputs; `has_unfinished_requests`
    counts the requests it sent that have not finished yet, and `num_waiting` adds the ones the core has not
    read yet (so max_queue_len holds in a burst).
  - Outputs travel as tuples (`_to_wire`), about 10x cheaper to pickle and unpickle than the dataclasses (256
    one-token outputs: 0.2 ms against 2.1 ms here), and without the prompt, which the client fills back in.
  - Validation (prompt length, token ids, sampling parameters against the vocabulary) runs in the client, so a
    bad request fails at `add_request` exactly as with an in-process engine.
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
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from asyncengine.config import EngineConfig
from asyncengine.engine import LLMEngine, PromptType, StepPipeline, StepStats, check_prompt
from asyncengine.faults import fault_after_steps_from_env, install_fault_hook
from asyncengine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from asyncengine.sampling_params import SamplingParams
from asyncengine.tokenizer import apply_chat_template, load_tokenizer

logger = logging.getLogger(__name__)

STARTUP_POLL_S = 0.5  # how often the client checks that a starting core is still alive
SHUTDOWN_WAIT_S = 10.0  # how long the client waits for the core to exit before killing it


@dataclass(frozen=True)
class CoreFacts:
    """What the client needs to know of the loaded model, sent once when the core is ready."""

    max_model_len: int
    vocab_size: int
    num_kv_blocks: int


@dataclass(frozen=True)
class Snapshot:
    """The core's state after a step (running totals since start for the counters)."""

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    num_preemptions: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    adds_applied: int = 0  # "add" messages the core has read (with num_waiting: the client's exact queue length)


def _snapshot(engine: LLMEngine, adds_applied: int) -> Snapshot:
    return Snapshot(engine.num_running, engine.num_waiting, engine.kv_cache_usage, engine.num_preemptions,
                    engine.prefix_cache_queries, engine.prefix_cache_hits, adds_applied)


# -- the wire form of an output -----------------------------------------------------------------------------------
def _to_wire(output: RequestOutput) -> tuple:
    completions = [(c.index, c.text, c.token_ids, c.cumulative_logprob, c.logprobs, c.finish_reason, c.stop_reason)
                   for c in output.outputs]
    m = output.metrics
    metrics = None if m is None else (m.arrival_time, m.first_scheduled_time, m.first_token_time, m.last_token_time,
                                      m.finished_time, m.num_preemptions)
    return output.request_id, completions, output.finished, metrics, output.num_cached_tokens


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
    """On CPU, torch's threads would take every core and the event loop (HTTP, SSE, detokenization; in the other
    process with engine_process) would wait for them; one core fewer serves more tokens (measured:
    loadtest/RESULTS.md). OMP_NUM_THREADS still wins."""
    cores = os.cpu_count() or 1
    if config.torch_device().type == "cpu" and "OMP_NUM_THREADS" not in os.environ and cores > 1:
        torch.set_num_threads(cores - 1)


def core_main(config: EngineConfig, inbox_conn, outbox_conn, log_level: int) -> None:
    """The child's entry point: load the engine, report ready (or why not), then step until told to stop.

    It ignores SIGINT and SIGTERM: a Ctrl-C in a terminal (or a supervisor signalling the whole process group)
    reaches it too, and the server, which drains its streams first, tells it when to stop; if the server dies
    instead, the pipe's end stops it."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s[core]: %(message)s")
    try:
        leave_a_core_for_the_event_loop(config)
        engine = LLMEngine(config)
        fault_after = fault_after_steps_from_env()
        if fault_after is not None:
            install_fault_hook(engine, fault_after)
        gc.collect()  # as AsyncLLMEngine does: keep the model's long-lived objects out of the collector's sight
        gc.freeze()
    except BaseException as exc:  # noqa: BLE001 - the parent must hear why the engine could not start
        outbox_conn.send(("failed", f"{type(exc).__name__}: {exc}"))
        raise SystemExit(2)
    outbox_conn.send(("ready", CoreFacts(engine.max_model_len, engine.vocab_size, engine.runner.num_blocks)))
    inbox: queue.Queue = queue.Queue()
    threading.Thread(target=_pump_inbox, args=(inbox_conn, inbox), name="asyncengine-core-inbox", daemon=True).start()
    try:
        _step_until_shutdown(engine, inbox, outbox_conn)
    except BrokenPipeError:  # the server is gone mid-send: nobody is left to report to
        logger.warning("the server went away; the engine core exits")
    except BaseException as exc:  # noqa: BLE001 - any failure kills the engine, loudly
        logger.exception("engine step failed; the engine core exits")
        try:
            outbox_conn.send(("dead", f"{type(exc).__name__}: {exc}"))
        finally:
            raise SystemExit(1)


def _pump_inbox(conn, inbox: queue.Queue) -> None:
    """Move messages from the pipe to the queue, so the client's sends never wait for a step to end."""
    try:
        while True:
            inbox.put(conn.recv())
    except (EOFError, OSError):  # the parent closed the pipe or died
        inbox.put(("shutdown",))


def _step_until_shutdown(engine: LLMEngine, inbox: queue.Queue, outbox_conn) -> None:
    """The core's step loop: the async engine's, with the pipe in place of request streams."""
    pipeline = StepPipeline(engine)
    stats: list[StepStats] = []
    engine.stats_listeners.append(stats.append)
    last_sent = Snapshot()
    adds_applied = 0
    done = None
    with ThreadPoolExecutor(1, thread_name_prefix="asyncengine-step") as device:
        while True:
            got = pipeline.book(done)
            idle = pipeline.in_flight is None and not engine.has_unfinished_requests()
            messages = _drain(inbox, block=idle)
            outputs = _apply_messages(engine, messages)
            if outputs is None:  # shutdown
                return
            adds_applied += sum(m[0] == "add" for m in messages)
            call = pipeline.next_call()
            pending = device.submit(call) if call is not None else None
            outputs += engine.emit(got)
            snapshot = _snapshot(engine, adds_applied)
            if outputs or snapshot != last_sent or any(s.prompt_tokens or s.generation_tokens for s in stats):
                outbox_conn.send(("outputs", [_to_wire(o) for o in outputs], stats[:], snapshot))
                last_sent = snapshot
            stats.clear()
            done = pending.result() if pending is not None else None


def _drain(inbox: queue.Queue, block: bool) -> list[tuple]:
    messages = [inbox.get()] if block else []
    while True:
        try:
            messages.append(inbox.get_nowait())
        except queue.Empty:
            return messages


def _apply_messages(engine: LLMEngine, messages: list[tuple]) -> Optional[list[RequestOutput]]:
    """Apply adds and aborts in order; returns the aborted requests' final outputs, or None on shutdown."""
    outputs: list[RequestOutput] = []
    for message in messages:
        kind = message[0]
        if kind == "add":
            _, request_id, prompt, prompt_ids, params, arrival = message
            try:
                engine.add_request(request_id, prompt, params, arrival_time=arrival, prompt_token_ids=prompt_ids)
            except ValueError as exc:  # the client validated it; reaching here is a bug worth a loud abort
                logger.error("request %s refused by the core: %s", request_id, exc)
                outputs.append(_refused(request_id, params))
        elif kind == "abort":
            outputs += engine.abort_request(message[1])
        elif kind == "shutdown":
            return None
    return outputs


def _refused(request_id: str, params: SamplingParams) -> RequestOutput:
    completions = [CompletionOutput(index=i, text="", token_ids=[], finish_reason="abort") for i in range(params.n)]
    return RequestOutput(request_id, None, [], completions, finished=True)


# -- the client ---------------------------------------------------------------------------------------------------
class EngineCoreClient:
    """Stands in for an LLMEngine inside AsyncLLMEngine (the same names), with the engine in a child process.

    Start-up blocks until the child has loaded the model (ValueError/RuntimeError with the child's reason if it
    could not). `start(loop, on_outputs, on_dead)` attaches the pipe to an event loop; from then on each step's
    outputs arrive through `on_outputs(list[RequestOutput])` on that loop."""

    def __init__(self, config: EngineConfig):
        self.config = config
        self.tokenizer = load_tokenizer(config.tokenizer or config.model)
        self.stats_listeners: list[Callable[[StepStats], None]] = []
        self._snapshot = Snapshot()
        self._adds_sent = 0
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
        self.num_kv_blocks = facts.num_kv_blocks

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

    # -- what AsyncLLMEngine asks of an engine ----------------------------------------------------------------
    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> str:
        return apply_chat_template(self.tokenizer, messages, add_generation_prompt, **kwargs)

    def check_prompt(self, prompt_ids: list[int], params: SamplingParams) -> None:
        check_prompt(prompt_ids, params, self.vocab_size, self.max_model_len)

    def add_request(self, request_id: str, prompt: PromptType, params: Optional[SamplingParams] = None,
                    arrival_time: Optional[float] = None, prompt_token_ids: Optional[list[int]] = None) -> None:
        """Validate here (ValueError), then send; the core queues it before its next step."""
        if request_id in self._prompts:
            raise ValueError(f"request id {request_id!r} is already in use")
        params = params.clone() if params is not None else SamplingParams()
        text = prompt if isinstance(prompt, str) else None
        if prompt_token_ids is None:
            prompt_token_ids = self.tokenizer(prompt).input_ids if isinstance(prompt, str) else list(prompt)
        self.check_prompt(prompt_token_ids, params)
        arrival = arrival_time if arrival_time is not None else time.monotonic()  # system-wide clock on Linux
        self._to_core.send(("add", request_id, text, prompt_token_ids, params, arrival))
        self._prompts[request_id] = (text, prompt_token_ids)
        self._adds_sent += 1

    def abort_request(self, request_ids) -> list[RequestOutput]:
        """Send the abort; the final outputs come back with the core's next outputs, not from this call."""
        ids = [request_ids] if isinstance(request_ids, str) else [i for i in request_ids if i in self._prompts]
        if ids:
            try:
                self._to_core.send(("abort", ids))
            except BrokenPipeError:  # the core has exited, and its requests with it
                pass
        return []

    def has_unfinished_requests(self) -> bool:
        return bool(self._prompts)

    @property
    def alive(self) -> bool:
        return self.process.is_alive()

    @property
    def num_running(self) -> int:
        return self._snapshot.num_running

    @property
    def num_waiting(self) -> int:
        """The core's queue at its last step plus the requests sent since that it had not read yet: exact for
        max_queue_len even in a burst that arrives between two steps."""
        return self._snapshot.num_waiting + self._adds_sent - self._snapshot.adds_applied

    @property
    def kv_cache_usage(self) -> float:
        return self._snapshot.kv_cache_usage

    @property
    def num_preemptions(self) -> int:
        return self._snapshot.num_preemptions

    @property
    def prefix_cache_queries(self) -> int:
        return self._snapshot.prefix_cache_queries

    @property
    def prefix_cache_hits(self) -> int:
        return self._snapshot.prefix_cache_hits

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

    def _receive_outputs(self, wires: list[tuple], stats: list[StepStats], snapshot: Snapshot) -> list[RequestOutput]:
        self._snapshot = snapshot
        for step_stats in stats:
            for listener in self.stats_listeners:
                listener(step_stats)
        outputs = []
        for wire in wires:
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

"""LLMEngine: the synchronous, sans-IO core (`add_request`, `abort_request`, `step()`), and StepPipeline, the one
step driver that every loop runs (LLM.generate, the async engine's step task, the engine process).

A step has five phases; the same words name them in code and in docs/design.md:
    prepare   scheduler.schedule() + model_runner.prepare()   which tokens each request computes now; inputs
    launch    model_runner.launch()                          queue the forward pass and sampling on the device
    collect   model_runner.collect()                         wait for the step and read its sampled tokens
    book      scheduler.update() + output_processor.record_token()   append tokens, token-decided stops, timing
    emit      output_processor.detokenize() + make_outputs()  text deltas, stop strings, RequestOutputs
`step()` runs them in order. launch and collect are the device work: they read no engine state, so a driver runs
them in a device thread. `StepPipeline.turn` is one turn of every driver's loop:
  - plain: step N+1 is prepared once step N is booked; N's emit overlaps N+1's device work;
  - lookahead (default on CUDA): step N+1 is prepared and launched before N's tokens are collected, its decode
    inputs taken from N's sampled tokens on the device, so the host's work (book, emit, prepare) overlaps the
    GPU's and the GPU does not wait for it. A request that an EOS or a stop string ends runs one step too many;
    that token is discarded. Penalties count a token still in flight on the device (sampler.PenaltyBatch).
"""
from __future__ import annotations

import itertools
import logging
import time
from concurrent.futures import FIRST_COMPLETED, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Optional, Union

from asyncengine.block_manager import BlockManager
from asyncengine.config import EngineConfig, load_model_config, resolve_max_model_len
from asyncengine.model_runner import LaunchedStep, ModelRunner, StepInputs, StepResult
from asyncengine.output_processor import OutputProcessor, UserRequest
from asyncengine.outputs import RequestOutput
from asyncengine.pooling_params import PoolingLimits, PoolingParams, PromptType
from asyncengine.pooling_requests import PoolingRequests
from asyncengine.request import Request, RequestStatus, validate_request
from asyncengine.sampling_params import SamplingParams
from asyncengine.scheduler import Scheduler, SchedulerOutput
from asyncengine.structured_output import RequestGrammar, StructuredOutputManager
from asyncengine.tokenizer import IncrementalDetokenizer, load_tokenizer

logger = logging.getLogger(__name__)

GRAMMAR_POLL_S = 0.005  # with nothing to run but requests awaiting their grammar, wait this long for one


@dataclass
class PreparedStep:
    sched: SchedulerOutput
    inputs: StepInputs
    launched: Optional[LaunchedStep] = None


@dataclass(frozen=True)
class EngineStats:
    """The engine's state after a step: the one snapshot that /metrics, the API and the engine process read.
    Counters are running totals since start."""

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0  # fraction of KV blocks in use, 0 to 1
    num_preemptions: int = 0
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int = 0  # prompt tokens found there


@dataclass
class StepStats:
    """Observations of one step, for metrics listeners (seconds)."""

    prompt_tokens: int = 0
    generation_tokens: int = 0
    time_to_first_token: list[float] = field(default_factory=list)
    inter_token_latency: list[float] = field(default_factory=list)
    e2e_latency: list[float] = field(default_factory=list)
    finished_reasons: list[str] = field(default_factory=list)


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        device = config.torch_device()
        self.model_config = load_model_config(config, device)
        self.max_model_len = self._max_model_len()
        self.vocab_size = self.model_config.vocab_size
        self.eos_token_ids = frozenset(self.model_config.eos_token_ids)
        self.tokenizer = load_tokenizer(config.tokenizer or config.model)
        self.runner = ModelRunner(config, self.model_config, self.max_model_len)
        try:
            self._check_cache_fits(config)
        except BaseException:
            self.runner.close(graceful=False)  # the tensor-parallel workers, if any
            raise
        self.block_manager = BlockManager(self.runner.num_blocks, config.block_size, config.enable_prefix_caching,
                                          self.runner.kv_sliding_window)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens,
                                   self.max_model_len, config.enable_chunked_prefill, config.min_prefill_batch)
        self.output_processor = OutputProcessor(self.tokenizer, self.scheduler.stop, config.stream_interval)
        self.structured = StructuredOutputManager(self.tokenizer, self.vocab_size, self.model_config.eos_token_ids)
        self.awaiting_grammar: list[Request] = []  # constrained requests whose grammar is compiling (not scheduled)
        self.stats_listeners: list[Callable[[StepStats], None]] = []
        self._stats = StepStats()  # observations since the last emit
        self._ids = itertools.count()
        # embedding requests served alongside generation (last-token pooling in this scheduler)
        self.pooling = PoolingRequests.for_checkpoint(Path(config.model), self.model_config.hf_config, self.tokenizer,
                                                      self.scheduler, self.model_config.hidden_size, self.vocab_size,
                                                      self.max_model_len)
        logger.info("engine ready: %s on %s, %d KV blocks (%s, %d bytes each)", self.model_config.architecture, device,
                    self.runner.num_blocks, str(self.runner.kv_cache_dtype).removeprefix("torch."),
                    self.runner.bytes_per_block())

    def _check_cache_fits(self, config: EngineConfig) -> None:
        """ValueError when the KV cache cannot hold one sequence, or the step budget one prompt."""
        one_sequence = self.runner.tokens_one_sequence_holds()
        if self.runner.num_blocks * config.block_size < one_sequence:
            what = (f"max_model_len ({self.max_model_len})" if one_sequence == self.max_model_len else
                    f"the {one_sequence} tokens one sequence holds at once (its sliding window and two steps)")
            raise ValueError(
                f"the KV cache holds {self.runner.num_blocks} blocks x {config.block_size} tokens = "
                f"{self.runner.num_blocks * config.block_size} tokens, fewer than {what}: give more KV memory "
                "(num_kv_blocks / kv_cache_memory_gb / gpu_memory_utilization) or lower max_model_len"
            )
        if not config.enable_chunked_prefill and config.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"without chunked prefill max_num_batched_tokens ({config.max_num_batched_tokens}) must be >= "
                f"max_model_len ({self.max_model_len}), or a long prompt could never be scheduled"
            )

    def _max_model_len(self) -> int:
        return resolve_max_model_len(self.config, self.model_config)

    # -- pooling requests (embeddings), served next to generation: see PoolingRequests ----------------------
    @property
    def limits(self) -> Optional[PoolingLimits]:
        """What validating an embedding request needs (PoolingRequests.limits)."""
        return self.pooling.limits

    def tokenize(self, prompts: list[PromptType], params: PoolingParams) -> list[list[int]]:
        """Token ids of pooling prompts (see pooling_params.pooling_token_ids)."""
        return self.pooling.tokenize(prompts, params)

    def check_prompt(self, prompt_ids: list[int], params: PoolingParams) -> None:
        """ValueError (naming the field) when this pooling request cannot run here: PoolingLimits.check."""
        self.pooling.check(prompt_ids, params)

    # -- requests ---------------------------------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: Optional[SamplingParams] = None,
        arrival_time: Optional[float] = None,
        prompt_token_ids: Optional[list[int]] = None,
    ) -> None:
        """Validate (ValueError on bad input) and queue a request: the offline engine's edge. prompt: text, or
        token ids (prompt_token_ids, when given, are the text's tokens)."""
        params = params if params is not None else SamplingParams()
        if isinstance(params, PoolingParams):
            if prompt_token_ids is None:
                prompt_token_ids = self.tokenize([prompt], params)[0]
            self.check_prompt(prompt_token_ids, params)
        else:
            if prompt_token_ids is None:
                prompt_token_ids = self.tokenizer(prompt).input_ids if isinstance(prompt, str) else list(prompt)
            validate_request(prompt_token_ids, params, self.vocab_size, self.max_model_len)
        self.enqueue(request_id, prompt if isinstance(prompt, str) else None, prompt_token_ids, params, arrival_time)

    def enqueue(self, request_id: str, prompt: Optional[str], prompt_token_ids: list[int], params: SamplingParams,
                arrival_time: Optional[float] = None) -> None:
        """Queue a request that has passed validate_request (PoolingParams: check_prompt): fan it out into
        params.n children and hand them to the scheduler (a pooling request: PoolingRequests.add). ValueError
        for a request id that is in use. `params` is not modified."""
        if request_id in self.output_processor.user_requests or self.pooling.has(request_id):
            raise ValueError(f"request id {request_id!r} is already in use")
        if isinstance(params, PoolingParams):
            return self.pooling.add(request_id, prompt, prompt_token_ids, params, arrival_time)
        compiled = None
        if params.structured_outputs is not None:  # compiles in the background; a failure known now is raised now
            compiled = self.structured.submit(params.structured_outputs)
            if compiled.done() and compiled.exception() is not None:
                raise compiled.exception()
        max_tokens = params.max_tokens or (self.max_model_len - len(prompt_token_ids))
        arrival = arrival_time if arrival_time is not None else time.monotonic()
        children = [self._make_child(request_id, i, params, prompt_token_ids, max_tokens, arrival)
                    for i in range(params.n)]
        for child in children if compiled is not None else ():
            child.grammar = RequestGrammar(compiled, params.structured_outputs.after_thinking)  # a matcher per child
        self.output_processor.add(UserRequest(request_id, prompt, prompt_token_ids, params.output_kind, children))
        for child in children:
            if child.grammar is not None and not child.grammar.ready:
                self.awaiting_grammar.append(child)  # scheduled once compiled (_admit_compiled)
            else:
                self.scheduler.add(child)

    def _make_child(self, parent_id, index, params, prompt_ids, max_tokens, arrival) -> Request:
        child_params = params
        if params.n > 1 and params.seed is not None:  # distinct but reproducible samples
            child_params = params.clone()
            child_params.seed = params.seed + index
        child_id = parent_id if params.n == 1 else f"{parent_id}#{index}#{next(self._ids)}"
        child = Request(child_id, prompt_ids, child_params, max_tokens, parent_id=parent_id, index=index,
                        arrival_time=arrival, eos_token_ids=self.eos_token_ids)
        if child_params.seed is not None:
            child.generator = self.runner.make_generator(child_params.seed)
        child.detokenizer = IncrementalDetokenizer(self.tokenizer, len(prompt_ids), child_params)
        return child

    def check_structured_outputs(self, params: SamplingParams) -> None:
        """ValueError (naming structured_outputs) if the request's constraint does not compile. Blocks while it
        compiles (cached): call it off the event loop."""
        if params.structured_outputs is not None:
            self.structured.compile(params.structured_outputs)

    def _admit_compiled(self) -> None:
        """Move constrained requests whose grammar is ready into the scheduler; fail those that did not compile
        (callers validate first with check_structured_outputs, so this is the rare background failure)."""
        still = []
        for request in self.awaiting_grammar:
            if request.finished:
                continue
            if not request.grammar.ready:
                still.append(request)
            elif request.grammar.failure() is not None:
                logger.error("request %s: %s", request.request_id, request.grammar.failure())
                request.status = RequestStatus.FINISHED_ABORTED
                request.stop_reason = str(request.grammar.failure())
                self.output_processor.user_requests[request.parent_id].changed = True
            else:
                self.scheduler.add(request)
        self.awaiting_grammar = still
        if still and not self.scheduler.has_unfinished():
            wait([r.grammar.compiled for r in still], timeout=GRAMMAR_POLL_S, return_when=FIRST_COMPLETED)

    def abort_request(self, request_ids: Union[str, Iterable[str]]) -> list[RequestOutput]:
        """Finish the given requests with finish_reason "abort" and free their blocks now. Unknown ids are
        ignored. Returns their final outputs."""
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        outputs = []
        for request_id in request_ids:
            pooled = self.pooling.abort(request_id)
            if pooled is not None:
                outputs.append(pooled)
                continue
            user = self.output_processor.user_requests.get(request_id)
            if user is None:
                continue
            for child in user.children:
                if child in self.awaiting_grammar:  # not in the scheduler yet
                    self.awaiting_grammar.remove(child)
                    child.status = RequestStatus.FINISHED_ABORTED
            self.scheduler.abort(c for c in user.children if not c.finished)
            outputs.append(self.output_processor.output(user))
            self.output_processor.forget(user)
        return outputs

    def has_unfinished_requests(self) -> bool:
        return bool(self.output_processor.user_requests or self.pooling.unfinished)

    # -- the step ---------------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One whole step, serially: schedule, run the model, book the tokens, emit outputs."""
        step = self.prepare_step()
        if step is None:
            return self.emit([])
        return self.emit(self.book(step, self.run(step)))

    def prepare_step(self) -> Optional[PreparedStep]:
        """Schedule and build the step's inputs (host work, on the caller's thread); None if nothing to run."""
        if self.awaiting_grammar:
            self._admit_compiled()
        sched = self.scheduler.schedule()
        if sched.is_empty:
            return None
        return PreparedStep(sched, self.runner.prepare(sched))

    def run(self, step: PreparedStep) -> StepResult:
        """The device work of a step, launched and collected; reads no engine state, so it may run in another
        thread."""
        return self.collect(self.launch(step))

    def launch(self, step: PreparedStep) -> PreparedStep:
        """Queue the step's device work (thread-safe like run()). Steps are launched in the order prepared."""
        step.launched = self.runner.launch(step.inputs)
        return step

    def collect(self, step: PreparedStep) -> StepResult:
        """Wait for a launched step and read its tokens (thread-safe like run())."""
        return self.runner.collect(step.launched)

    def book(self, step: PreparedStep, result: StepResult) -> list[Request]:
        """Account for a collected step: computed tokens, sampled tokens, token-decided stops (which free blocks),
        timing and logprobs. Returns the requests that got a token, for emit(). Must run before the next
        prepare_step()."""
        now = time.monotonic()
        got_token = self.scheduler.update(step.sched, result.tokens)
        for request in got_token:
            self.output_processor.record_token(request, result.logprobs.get(request.request_id), now, self._stats)
        self._stats.generation_tokens += len(got_token)
        if step.inputs.pooling_requests:
            self.pooling.book(step.inputs.pooling_requests, result.pooled, self._stats)
        return got_token

    def emit(self, got_token: list[Request]) -> list[RequestOutput]:
        """Detokenize the new tokens (stop strings may finish requests) and build outputs; tell the stats
        listeners. May overlap the next step's device work: a request a stop string ends here has its in-flight
        token discarded by book()."""
        for request in got_token:
            self.output_processor.detokenize(request)
        stats, self._stats = self._stats, StepStats()
        now = time.monotonic()
        outputs = self.output_processor.make_outputs(stats, now) + self.pooling.emit(stats, now)
        for listener in self.stats_listeners:
            listener(stats)
        return outputs

    def run_pipelined(self, executor, lookahead: Optional[bool] = None) -> Iterator[list[RequestOutput]]:
        """Steps until no request is left, with the device work in `executor` (a single-thread
        concurrent.futures executor). Yields each step's outputs."""
        pipeline = StepPipeline(self, lookahead)
        done = None
        while True:
            pending, outputs = pipeline.turn(done, executor.submit)
            yield outputs
            if pending is None and not self.has_unfinished_requests():
                return
            done = pending.result() if pending is not None else None

    # -- introspection ----------------------------------------------------------------------------------------
    def stats(self) -> EngineStats:
        return EngineStats(
            num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting + len(self.awaiting_grammar),
            kv_cache_usage=self.block_manager.usage,
            num_preemptions=self.scheduler.num_preemptions,
            prefix_cache_queries=self.block_manager.prefix_queries,
            prefix_cache_hits=self.block_manager.prefix_hits,
        )

    def failure(self) -> Optional[BaseException]:
        """Why the engine cannot step any more without having run a step yet (a tensor-parallel worker died),
        or None. Cheap: health checks call it."""
        return self.runner.failure()

    def close(self, graceful: bool = True) -> None:
        """Release what the engine started (the tensor-parallel workers: told to stop when `graceful`, else
        killed, as after a failed step, whose world may be broken). Idempotent."""
        self.runner.close(graceful)

    def reset_prefix_cache(self) -> None:
        """Forget every cached prompt block that no unfinished request holds, so the next prompts are computed
        in full (a benchmark repeating the same prompts measures cold runs this way)."""
        self.block_manager.reset_prefix_cache()


DeviceCall = Callable[[], Optional[tuple[PreparedStep, StepResult]]]


class StepPipeline:
    """The step driver: plans the device calls of a step loop. Every loop (LLMEngine.run_pipelined, the async
    engine's step task, the engine process) repeats, on its own thread:

        pending, outputs = pipeline.turn(done, submit, before_prepare)
        <hand outputs on>; done = <wait for pending>

    plain mode: each device call launches and collects the step just prepared.
    lookahead mode: each device call launches the step just prepared, then collects the one before it, so the
    device always has the next step queued while the host books, emits and prepares. At most one step is in
    flight between calls. Default: lookahead on CUDA, plain on CPU (where launching computes, and looking ahead
    would only delay every token by a step).
    """

    def __init__(self, engine: LLMEngine, lookahead: Optional[bool] = None):
        self.engine = engine
        if lookahead is None:
            lookahead = engine.config.async_scheduling
        if lookahead is None:
            lookahead = engine.runner.device.type == "cuda"
        self.lookahead = lookahead
        self.in_flight: Optional[PreparedStep] = None  # launched by the last call, not collected

    @property
    def idle(self) -> bool:
        """Nothing in flight and no request left: the driver may sleep until a request arrives."""
        return self.in_flight is None and not self.engine.has_unfinished_requests()

    def turn(self, done: Optional[tuple[PreparedStep, StepResult]], submit: Callable[[DeviceCall], Any],
             before_prepare: Optional[Callable[[], list[RequestOutput]]] = None) -> tuple[Any, list[RequestOutput]]:
        """One turn of a step loop: book `done` (what the last device call returned; None: nothing), call
        `before_prepare` (a driver's aborts and new requests; it returns the outputs of what it aborted), prepare
        the next step and pass its device call to `submit` (which starts it in the device thread and returns a
        handle), then emit while the device works. Returns (the handle, None when there was no device work; the
        outputs)."""
        got = self.engine.book(*done) if done is not None else []
        outputs = before_prepare() if before_prepare is not None else []
        call = self._next_call()
        pending = submit(call) if call is not None else None
        return pending, outputs + self.engine.emit(got)

    def _next_call(self) -> Optional[DeviceCall]:
        engine = self.engine
        step = engine.prepare_step() if engine.has_unfinished_requests() else None
        if not self.lookahead:
            return (lambda: (step, engine.run(step))) if step is not None else None
        previous, self.in_flight = self.in_flight, step
        if step is None and previous is None:
            return None

        def launch_then_collect_previous():
            if step is not None:
                engine.launch(step)
            return (previous, engine.collect(previous)) if previous is not None else None

        return launch_then_collect_previous

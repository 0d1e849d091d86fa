"""LLMEngine: the synchronous, sans-IO core. `add_request`, `abort_request`, `step()`.

A request's life, top to bottom:
    add_request    validate, tokenize, fan out n children (Request), queue them in the scheduler
    step           scheduler.schedule()       -> which tokens each request computes now
                   model_runner.launch()      -> one forward pass + sampling (the only device work); collect()
                   scheduler.update()         -> append tokens, token-decided stops, free finished blocks
                   _detokenize()              -> text deltas, stop strings (which finish requests too)
                   _make_outputs()            -> RequestOutput per user request, by its output kind
`step()` is split into `prepare_step()` (host), `launch()` + `collect()` (device work, thread-safe; `run()` does
both), `book()` (tokens and token-decided stops) and `emit()` (detokenization, outputs). `StepPipeline` drives
them with the device work in a worker thread, for `run_pipelined` and the async engine's loop alike:
  - plain: step N+1 is prepared once step N is booked; N's emit() overlaps N+1's device work;
  - lookahead (default on CUDA): step N+1 is prepared and launched before N's tokens are read back, its decode
    inputs taken from N's sampled tokens on the device, so the host's work (book, emit, prepare) overlaps the
    GPU's and the GPU does not wait for it. A request that an EOS or a stop string ends runs one step too many;
    that token is discarded. Penalties count a token still in flight on the device (sampler.PenaltyBatch).
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator, Optional, Union

from asyncengine.block_manager import BlockManager
from asyncengine.config import EngineConfig, load_model_config, resolve_max_model_len
from asyncengine.model_runner import LaunchedStep, ModelRunner, StepInputs, StepResult
from asyncengine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from asyncengine.request import Request, RequestStatus
from asyncengine.sampling_params import RequestOutputKind, SamplingParams
from asyncengine.scheduler import Scheduler, SchedulerOutput
from asyncengine.tokenizer import IncrementalDetokenizer, apply_chat_template, load_tokenizer

logger = logging.getLogger(__name__)

PromptType = Union[str, list[int]]


@dataclass
class PreparedStep:
    sched: SchedulerOutput
    inputs: StepInputs
    launched: Optional[LaunchedStep] = None


@dataclass
class StepStats:
    """Observations of one step, for metrics listeners (seconds)."""

    prompt_tokens: int = 0
    generation_tokens: int = 0
    time_to_first_token: list[float] = field(default_factory=list)
    inter_token_latency: list[float] = field(default_factory=list)
    e2e_latency: list[float] = field(default_factory=list)
    finished_reasons: list[str] = field(default_factory=list)


class _UserRequest:
    """A user's request: n children and what has been reported of them so far (for DELTA outputs)."""

    def __init__(self, request_id: str, prompt: Optional[str], prompt_ids: list[int], kind: RequestOutputKind,
                 children: list[Request]):
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_ids = prompt_ids
        self.kind = kind
        self.children = children
        self.sent_text = [0] * len(children)
        self.sent_tokens = [0] * len(children)
        self.changed = False

    @property
    def finished(self) -> bool:
        if len(self.children) == 1:  # the common case, asked for every request every step
            return self.children[0].finished
        return all(c.finished for c in self.children)


def check_prompt(prompt_ids: list[int], params: SamplingParams, vocab_size: int, max_model_len: int) -> None:
    """ValueError when the prompt or its max_tokens cannot fit the model; the message states the numbers."""
    if not prompt_ids:
        raise ValueError("prompt must not be empty")
    if any(not isinstance(t, int) or t < 0 or t >= vocab_size for t in prompt_ids):
        raise ValueError(f"prompt token ids must be integers in [0, {vocab_size})")
    if len(prompt_ids) >= max_model_len:
        raise ValueError(
            f"prompt is {len(prompt_ids)} tokens but max_model_len is {max_model_len}: "
            "at least one token must remain for generation"
        )
    if params.max_tokens is not None and len(prompt_ids) + params.max_tokens > max_model_len:
        raise ValueError(
            f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) = "
            f"{len(prompt_ids) + params.max_tokens} exceeds max_model_len ({max_model_len})"
        )
    params.validate_for_model(vocab_size)


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        device = config.torch_device()
        self.model_config = load_model_config(config, device)
        self.max_model_len = self._max_model_len()
        self.tokenizer = load_tokenizer(config.tokenizer or config.model)
        self.runner = ModelRunner(config, self.model_config, self.max_model_len)
        if self.runner.num_blocks * config.block_size < self.max_model_len:
            raise ValueError(
                f"the KV cache holds {self.runner.num_blocks} blocks x {config.block_size} tokens = "
                f"{self.runner.num_blocks * config.block_size} tokens, fewer than max_model_len ({self.max_model_len}): "
                "give more KV memory (num_kv_blocks / kv_cache_memory_gb / gpu_memory_utilization) or lower max_model_len"
            )
        if not config.enable_chunked_prefill and config.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"without chunked prefill max_num_batched_tokens ({config.max_num_batched_tokens}) must be >= "
                f"max_model_len ({self.max_model_len}), or a long prompt could never be scheduled"
            )
        self.block_manager = BlockManager(self.runner.num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(
            self.block_manager,
            config.max_num_seqs,
            config.max_num_batched_tokens,
            self.max_model_len,
            config.enable_chunked_prefill,
            config.min_prefill_batch,
        )
        self.user_requests: dict[str, _UserRequest] = {}
        self.children: dict[str, Request] = {}
        self.stats_listeners: list[Callable[[StepStats], None]] = []
        self._stats = StepStats()  # observations since the last emit()
        self._ids = itertools.count()
        logger.info("engine ready: %s on %s, %d KV blocks", self.model_config.architecture, device, self.runner.num_blocks)

    @classmethod
    def from_config(cls, config: EngineConfig) -> "LLMEngine":
        return cls(config)

    def _max_model_len(self) -> int:
        max_len = resolve_max_model_len(self.config, self.model_config)
        window = getattr(self.model_config.hf_config, "sliding_window", None)
        uses_window = getattr(self.model_config.hf_config, "use_sliding_window", True)
        if window and uses_window and window < max_len:
            logger.warning("sliding window %d < max_model_len %d: limiting max_model_len to the window", window, max_len)
            max_len = window
        return max_len

    # -- requests ---------------------------------------------------------------------------------------------
    def encode(self, prompt: str) -> list[int]:
        return self.tokenizer(prompt).input_ids

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> str:
        return apply_chat_template(self.tokenizer, messages, add_generation_prompt, **kwargs)

    def check_prompt(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """ValueError when the prompt or its max_tokens cannot fit; the message states the numbers."""
        check_prompt(prompt_ids, params, self.model_config.vocab_size, self.max_model_len)

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: Optional[SamplingParams] = None,
        arrival_time: Optional[float] = None,
        prompt_token_ids: Optional[list[int]] = None,
    ) -> None:
        """Queue a request. prompt: text, or token ids. Raises ValueError on bad input or a duplicate live id."""
        if request_id in self.user_requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        params = params.clone() if params is not None else SamplingParams()
        text = prompt if isinstance(prompt, str) else None
        if prompt_token_ids is None:
            prompt_token_ids = self.encode(prompt) if isinstance(prompt, str) else list(prompt)
        self.check_prompt(prompt_token_ids, params)
        params._eos_token_ids = list(self.model_config.eos_token_ids)
        max_tokens = params.max_tokens or (self.max_model_len - len(prompt_token_ids))
        arrival = arrival_time if arrival_time is not None else time.monotonic()
        children = [self._make_child(request_id, i, params, prompt_token_ids, max_tokens, text, arrival)
                    for i in range(params.n)]
        self.user_requests[request_id] = _UserRequest(request_id, text, prompt_token_ids, params.output_kind, children)
        for child in children:
            self.children[child.request_id] = child
            self.scheduler.add(child)

    def _make_child(self, parent_id, index, params, prompt_ids, max_tokens, text, arrival) -> Request:
        child_params = params
        if params.n > 1 and params.seed is not None:  # distinct but reproducible samples
            child_params = params.clone()
            child_params.seed = params.seed + index
        child_id = parent_id if params.n == 1 else f"{parent_id}#{index}#{next(self._ids)}"
        child = Request(child_id, prompt_ids, child_params, max_tokens, parent_id=parent_id, index=index,
                        prompt=text, arrival_time=arrival)
        if child_params.seed is not None:
            child.generator = self.runner.make_generator(child_params.seed)
        child.detokenizer = IncrementalDetokenizer(self.tokenizer, len(prompt_ids), child_params)
        return child

    def abort_request(self, request_ids: Union[str, Iterable[str]]) -> list[RequestOutput]:
        """Finish the given requests with finish_reason "abort" and free their blocks now. Unknown ids are
        ignored. Returns their final outputs."""
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        outputs = []
        for request_id in request_ids:
            user = self.user_requests.get(request_id)
            if user is None:
                continue
            self.scheduler.abort(c for c in user.children if not c.finished)
            user.changed = True
            outputs.append(self._output(user))
            self._forget(user)
        return outputs

    def _forget(self, user: _UserRequest) -> None:
        del self.user_requests[user.request_id]
        for child in user.children:
            self.children.pop(child.request_id, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self.user_requests)

    # -- the step ---------------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One whole step, serially: schedule, run the model, book the tokens, emit outputs."""
        step = self.prepare_step()
        if step is None:
            return self.emit([])
        return self.emit(self.book(step, self.run(step)))

    def prepare_step(self) -> Optional[PreparedStep]:
        """Schedule and build the step's inputs (host work, on the caller's thread); None if nothing to run."""
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
        """Account for a finished step: computed tokens, sampled tokens, token-decided stops (which free blocks).
        Returns the requests that got a token, for emit(). Must run before the next prepare_step()."""
        now = time.monotonic()
        got_token = self.scheduler.update(step.sched, result.tokens)
        for request in got_token:
            self._record_token(request, result, now, self._stats)
        self._stats.generation_tokens += len(got_token)
        return got_token

    def emit(self, got_token: list[Request]) -> list[RequestOutput]:
        """Detokenize the new tokens (stop strings may finish requests) and build outputs. May overlap the next
        step's device work: a request a stop string ends here has its in-flight token ignored by book()."""
        for request in got_token:
            if request.parent_id in self.user_requests:
                self._detokenize(request)
        stats, self._stats = self._stats, StepStats()
        outputs = self._make_outputs(stats, time.monotonic())
        for listener in self.stats_listeners:
            listener(stats)
        return outputs

    def run_pipelined(self, executor, lookahead: Optional[bool] = None) -> Iterator[list[RequestOutput]]:
        """Steps until no request is left, with the device work in `executor` (a single-thread
        concurrent.futures executor), overlapping host and device work as StepPipeline does. Yields outputs."""
        pipeline = StepPipeline(self, lookahead)
        done = None
        while True:
            got = pipeline.book(done)
            call = pipeline.next_call()
            pending = executor.submit(call) if call is not None else None
            yield self.emit(got)
            if pending is None and not self.has_unfinished_requests():
                return
            done = pending.result() if pending is not None else None

    def _record_token(self, request: Request, result: StepResult, now: float, stats: StepStats) -> None:
        if request.first_token_time is None:
            request.first_token_time = now
            stats.prompt_tokens += request.num_prompt_tokens
            stats.time_to_first_token.append(now - request.arrival_time)
        else:
            stats.inter_token_latency.append(now - request.last_token_time)
        request.last_token_time = now
        entry = result.logprobs.get(request.request_id)
        if entry is not None:  # (token_ids[-1] is the token just booked: in-flight ones are not in token_ids)
            for token_id, logprob in entry.items():
                logprob.decoded_token = self.tokenizer.decode([token_id])
            request.logprobs.append(entry)
            request.cumulative_logprob += entry[request.token_ids[-1]].logprob
        self.user_requests[request.parent_id].changed = True

    def _detokenize(self, request: Request) -> None:
        detok = request.detokenizer
        ended_by_token = request.finished and request.status == RequestStatus.FINISHED_STOPPED
        if ended_by_token and not request.params.include_stop_str_in_output:
            return  # EOS / stop token: its text is not part of the output
        stop = detok.update(request.token_ids, final=request.finished)
        if stop is None:
            return
        request.stop_reason = stop
        if request.finished:  # the last allowed token completed the stop string: it is still a stop
            request.status = RequestStatus.FINISHED_STOPPED
        else:
            self.scheduler.finish(request, RequestStatus.FINISHED_STOPPED)

    def _make_outputs(self, stats: StepStats, now: float) -> list[RequestOutput]:
        outputs = []
        for user in [u for u in self.user_requests.values() if u.changed]:
            user.changed = False
            finished = user.finished
            if user.kind == RequestOutputKind.FINAL_ONLY and not finished:
                continue
            outputs.append(self._output(user, finished))
            if finished:
                for child in user.children:
                    stats.e2e_latency.append(now - child.arrival_time)
                    stats.finished_reasons.append(child.finish_reason)
                self._forget(user)
        return outputs

    def _output(self, user: _UserRequest, finished: Optional[bool] = None) -> RequestOutput:
        """The user request's output now: for DELTA, only what was not reported before. Runs for every request
        that got a token, every step: slices start where the last report ended, never copy whole sequences."""
        finished = user.finished if finished is None else finished
        delta = user.kind == RequestOutputKind.DELTA
        completions = []
        for i, child in enumerate(user.children):
            detok = child.detokenizer
            visible = detok.visible_len(child.finished)
            text_from = user.sent_text[i] if delta else 0
            tokens_from = user.sent_tokens[i] if delta else 0
            num_out = child.num_output_tokens
            wants_logprobs = child.params.logprobs is not None
            completions.append(CompletionOutput(
                index=child.index,
                text=detok.text[text_from:visible],
                token_ids=child.token_ids[child.num_prompt_tokens + tokens_from :],
                cumulative_logprob=child.cumulative_logprob if wants_logprobs else None,
                logprobs=child.logprobs[tokens_from:] if wants_logprobs else None,
                finish_reason=child.finish_reason,
                stop_reason=child.stop_reason,
            ))
            user.sent_text[i], user.sent_tokens[i] = max(visible, user.sent_text[i]), num_out
        first = user.children[0]
        metrics = RequestMetrics(
            arrival_time=first.arrival_time,
            first_scheduled_time=first.first_scheduled_time,
            first_token_time=first.first_token_time,
            last_token_time=first.last_token_time,
            finished_time=time.monotonic() if finished else None,
            num_preemptions=sum(c.num_preemptions for c in user.children),
        )
        return RequestOutput(
            request_id=user.request_id,
            prompt=user.prompt,
            prompt_token_ids=user.prompt_ids,
            outputs=completions,
            finished=finished,
            metrics=metrics,
            num_cached_tokens=first.num_cached_tokens,
        )

    # -- introspection ----------------------------------------------------------------------------------------
    @property
    def num_running(self) -> int:
        return self.scheduler.num_running

    @property
    def num_waiting(self) -> int:
        return self.scheduler.num_waiting

    @property
    def kv_cache_usage(self) -> float:
        return self.block_manager.usage

    @property
    def num_preemptions(self) -> int:
        """Preemptions since start (running total)."""
        return self.scheduler.num_preemptions

    @property
    def prefix_cache_queries(self) -> int:
        """Prompt tokens looked up in the prefix cache since start."""
        return self.block_manager.prefix_queries

    @property
    def prefix_cache_hits(self) -> int:
        """Prompt tokens found in the prefix cache since start."""
        return self.block_manager.prefix_hits

    def reset_prefix_cache(self) -> None:
        """Forget every cached prompt block that no unfinished request holds, so the next prompts are computed
        in full (a benchmark repeating the same prompts measures cold runs this way)."""
        self.block_manager.reset_prefix_cache()

    @property
    def vocab_size(self) -> int:
        return self.model_config.vocab_size


DeviceCall = Callable[[], Optional[tuple[PreparedStep, StepResult]]]


class StepPipeline:
    """Plans the device calls of a step loop. A driver repeats, on its own thread:

        got = pipeline.book(done)         book the step the last device call collected (None: nothing)
        call = pipeline.next_call()       prepare the next step, if any; None when there is no device work
        done = <run call in the device thread>, meanwhile engine.emit(got)

    plain mode: each call launches and collects the step just prepared.
    lookahead mode: each call launches the step just prepared, then collects the one before it, so the device
    always has the next step queued while the host books, emits and prepares. At most one step is in flight
    between calls. Default: lookahead on CUDA, plain on CPU (where launching computes, and looking ahead would
    only delay every token by a step).
    """

    def __init__(self, engine: LLMEngine, lookahead: Optional[bool] = None):
        self.engine = engine
        if lookahead is None:
            lookahead = engine.config.async_scheduling
        if lookahead is None:
            lookahead = engine.runner.device.type == "cuda"
        self.lookahead = lookahead
        self.in_flight: Optional[PreparedStep] = None  # launched by the last call, not collected

    def book(self, done: Optional[tuple[PreparedStep, StepResult]]) -> list[Request]:
        return self.engine.book(*done) if done is not None else []

    def next_call(self) -> Optional[DeviceCall]:
        engine = self.engine
        step = None
        if engine.has_unfinished_requests():
            step = engine.prepare_step()
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

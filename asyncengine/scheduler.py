"""Continuous batching under a per-step token budget, with chunked prefill and preemption by recompute.

Each step, `schedule()` decides how many new tokens every request computes:

1. RUNNING requests first, oldest first: a decoding request needs 1 token; one in the middle of a chunked
   prefill needs the rest of its prompt, cut to what is left of the budget. If its blocks cannot be allocated,
   the newest running request is preempted (blocks freed, progress dropped, put back at the head of the queue)
   until they can: possibly the request itself.
2. Then WAITING requests in arrival order while budget, sequence slots and blocks last. A waiting request first
   adopts the longest cached prefix of its tokens, then computes the rest, chunked to the budget. The queue is
   strictly FIFO: if its head cannot get blocks, nothing behind it jumps ahead. While requests are running,
   admission waits until min_prefill_batch slots are free (or the whole queue fits), for at most
   MAX_ADMISSION_DELAY_STEPS steps: a full batch otherwise admits one small prefill nearly every step as
   requests finish, and every such mixed step runs eagerly instead of as a CUDA-graph decode step.

Since decodes are scheduled before any prefill chunk, a long prompt never stalls running requests: it advances
by the budget left over each step.

Pooling requests (embeddings on a model served to generate, Request.pooling_params) are prefill-only: scheduled
like any prompt (same budget, chunks, blocks), they never sample; the step that computes their last token pools
it (ScheduledRequest.pools), and booking that step finishes them and frees their blocks.

`schedule()` books a step's effect on each request at once: `num_computed_tokens` advances, and a request that
samples counts one more token in flight. So the next step can be scheduled before this one's tokens are known
(lookahead): a decoding request's next input is then the in-flight token, which the model runner takes from the
previous step's output on the device. A request whose in-flight tokens already reach max_tokens or max_model_len
is not scheduled again. `update()` books the sampled tokens when the step is done, registers the blocks it
filled with the prefix cache, and finishes requests whose stop condition a token alone decides (stops.py). A request that an EOS ends has at most one more step in flight; its token is
discarded (its KV lands in blocks that the GPU's stream order lets no later step see).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Iterable, Optional

from asyncengine.block_manager import BlockManager
from asyncengine.request import Request, RequestStatus
from asyncengine.stops import reaches_length_limit, token_stop

MAX_ADMISSION_DELAY_STEPS = 16  # bounds the extra queueing min_prefill_batch may cause (~16 decode steps)


@dataclass
class ScheduledRequest:
    """One request's share of a step: tokens [start, start + num_new_tokens) of it. `samples` is True when the
    step reaches the request's last token, so its logits give the next token; for a pooling request (never
    samples) `pools` is True instead: the step's hidden state at that token is its embedding. All default to the
    request's state at construction (the scheduler builds items before it advances the request)."""

    request: Request
    num_new_tokens: int
    start: int = -1
    samples: Optional[bool] = None
    pools: bool = False

    def __post_init__(self) -> None:
        if self.start < 0:
            self.start = self.request.num_computed_tokens
        if self.samples is None:
            reaches_end = self.start + self.num_new_tokens == self.request.num_tokens
            self.pools = reaches_end and self.request.pooling_params is not None
            self.samples = reaches_end and not self.pools


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        enable_chunked_prefill: bool = True,
        min_prefill_batch: int = 1,
    ):
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.enable_chunked_prefill = enable_chunked_prefill
        self.min_prefill_batch = min_prefill_batch
        self._admission_delayed_steps = 0
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    # -- admission ---------------------------------------------------------------------------------------------
    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, request: Request, status: RequestStatus) -> None:
        """End a request (any state) and free its blocks; a no-op for one already finished."""
        if request.finished:
            return
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        request.status = status
        self.block_manager.free_request(request)

    # -- scheduling --------------------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        budget = self._schedule_running(out, budget)
        if not out.preempted:
            self._schedule_waiting(out, budget)
        for item in out.scheduled:  # the step's effect, booked now so the next step can be planned ahead
            item.request.num_computed_tokens += item.num_new_tokens
            item.request.num_inflight += item.samples
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            if request.num_inflight and reaches_length_limit(request, self.max_model_len):
                i += 1  # its last token is in flight: nothing more to compute
                continue
            if request.num_computed_tokens == request.num_tokens:
                i += 1  # a pooling request whose pass is scheduled (lookahead): finished when booked
                continue
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            while not self.block_manager.allocate(request, request.num_computed_tokens + num_new):
                victim = self.running[-1]
                self._preempt(victim, out)
                if victim is request:
                    return budget
            out.scheduled.append(ScheduledRequest(request, num_new))
            budget -= num_new
            i += 1
        return budget

    def _admission_deferred(self) -> bool:
        """True when this step admits nothing so that admissions come in groups (see the module docstring)."""
        if not self.running or not self.waiting:
            return False
        wanted = min(self.min_prefill_batch, len(self.waiting))
        if self.max_num_seqs - len(self.running) >= wanted or self._admission_delayed_steps >= MAX_ADMISSION_DELAY_STEPS:
            self._admission_delayed_steps = 0
            return False
        self._admission_delayed_steps += 1
        return True

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        if self._admission_deferred():
            return
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            if request.num_inflight:  # preempted with a token in flight: readmit once it is booked
                break
            cached = self.block_manager.find_cached_prefix(request)
            num_cached = len(cached) * self.block_manager.block_size
            remaining = request.num_tokens - num_cached
            if remaining > budget and not self.enable_chunked_prefill:
                break
            num_new = min(remaining, budget)
            if not self.block_manager.allocate(request, num_cached + num_new, cached):
                break
            self.waiting.popleft()
            if request.num_preemptions == 0:
                request.num_cached_tokens = num_cached
                self.block_manager.record_prefix_lookup(request.num_prompt_tokens, num_cached)
            request.num_computed_tokens = num_cached
            request.status = RequestStatus.RUNNING
            if request.first_scheduled_time is None:
                request.first_scheduled_time = time.monotonic()
            self.running.append(request)
            out.scheduled.append(ScheduledRequest(request, num_new))
            budget -= num_new

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        """Recompute later: drop the request's KV and put it at the head of the queue."""
        self.running.remove(request)
        self.block_manager.free_request(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)
        out.preempted.append(request)

    # -- after the forward pass --------------------------------------------------------------------------------
    def update(self, out: SchedulerOutput, sampled: dict[str, int]) -> list[Request]:
        """Book a finished step: register the blocks it filled with the prefix cache and append the sampled
        tokens (request_id -> token id); returns the requests that got a token. Finishes those whose new token
        ends them (EOS, stop_token_ids, max_tokens, max_model_len). Steps are booked in the order scheduled."""
        got_token = []
        for item in out.scheduled:
            request = item.request
            if request.finished:  # aborted or stopped while the step ran: its token is discarded
                continue
            if request.status == RequestStatus.RUNNING:  # not preempted since
                self.block_manager.register_full_blocks(request, item.start + item.num_new_tokens)
            if item.pools:  # its pass is done: the engine takes the pooled state, the KV is not needed any more
                self.finish(request, RequestStatus.FINISHED_STOPPED)
                continue
            if not item.samples:
                continue
            token = sampled.get(request.request_id)
            if token is None:
                raise RuntimeError(f"step produced no token for {request.request_id!r}, which samples")
            request.num_inflight -= 1
            request.append_token(token)
            got_token.append(request)
            stop = token_stop(request, token, self.max_model_len)
            if stop is not None:
                request.stop_reason = stop[1]
                self.finish(request, stop[0])
        return got_token

    def stop(self, request: Request, stop_string: str) -> None:
        """End a request that a stop string ended (found by the output processor). A request that a length limit
        ended in the same step is a stop too: its last token completed the stop string."""
        request.stop_reason = stop_string
        if request.finished:
            request.status = RequestStatus.FINISHED_STOPPED
        else:
            self.finish(request, RequestStatus.FINISHED_STOPPED)

    def abort(self, requests: Iterable[Request]) -> None:
        for request in requests:
            self.finish(request, RequestStatus.FINISHED_ABORTED)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

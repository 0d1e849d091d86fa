"""A request's state machine and token lists.

One `Request` is one sequence being generated. A user request with n > 1 becomes n Requests (children) that
share a parent id; the engine gathers their outputs.

Life of a request:

    WAITING --schedule--> RUNNING --finish--> FINISHED_STOPPED | FINISHED_LENGTH | FINISHED_ABORTED
                 ^            |
                 +--preempt---+   (PREEMPTED: blocks freed, num_computed_tokens reset to 0, recomputed later)

Invariants:
- `token_ids` = prompt + generated tokens whose values are known on the host. `num_inflight` more tokens (0, 1 or
  2) are being sampled by steps that were scheduled but not yet booked; `num_tokens` counts them too.
- `num_computed_tokens` counts the tokens whose KV is in the cache or is being written by a scheduled step (the
  scheduler advances it when it schedules, not when the step ends), in the blocks of `block_table` (in order).
- A RUNNING request with num_computed_tokens == num_tokens - 1 is decoding: its next step computes the last token
  and samples one more. When that last token is still in flight, the step takes its value on the device from the
  previous step's sampled tokens (row `inflight_row` there), so scheduling can run one step ahead (lookahead).

Who writes what (everything else reads; the engine only creates the Request):
- the scheduler: status, stop_reason, num_computed_tokens, num_inflight, token_ids (append_token), num_cached_tokens,
  num_preemptions, first_scheduled_time
- the block manager: block_table, block_hashes, num_registered_blocks, num_released_blocks
- the model runner: inflight_row
- the output processor: logprobs, cumulative_logprob, first_token_time, last_token_time (and the detokenizer's own
  state)
"""

from __future__ import annotations

import enum
import time
from typing import Optional

import torch

from asyncengine.outputs import Logprob
from asyncengine.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED)


class Request:
    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        max_tokens: int,
        *,
        parent_id: Optional[str] = None,
        index: int = 0,
        arrival_time: Optional[float] = None,
        eos_token_ids: frozenset[int] = frozenset(),
    ):
        self.request_id = request_id
        self.parent_id = parent_id if parent_id is not None else request_id
        self.index = index
        self.params = params
        self.max_tokens = max_tokens
        self.eos_token_ids = eos_token_ids  # the model's EOS ids (stops.py decides what they end)
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_inflight = 0  # sampled tokens of scheduled, not yet booked steps
        self.inflight_row = -1  # row of this request among the sampled tokens of the last prepared step
        self.num_cached_tokens = 0  # prompt tokens found in the prefix cache at first scheduling
        self.block_table: list[int] = []
        self.block_hashes: list[int] = []  # hash chain of this request's full blocks, extended as they fill
        self.num_registered_blocks = 0  # leading blocks of block_table already offered to the prefix cache
        # leading blocks of block_table given back because no layer's window can see them any more (their ids
        # stay in the table, stale, so that positions keep their block index; the kernels never read them)
        self.num_released_blocks = 0
        self.status = RequestStatus.WAITING
        self.stop_reason: Optional[int | str] = None
        self.logprobs: list[dict[int, Logprob]] = []
        self.cumulative_logprob = 0.0
        self.num_preemptions = 0
        self.arrival_time = arrival_time if arrival_time is not None else time.monotonic()
        self.first_scheduled_time: Optional[float] = None
        self.first_token_time: Optional[float] = None
        self.last_token_time: Optional[float] = None
        self.generator: Optional[torch.Generator] = None  # per-request RNG when params.seed is set
        self.detokenizer = None  # set at creation by the engine (tokenizer.IncrementalDetokenizer)
        self.grammar = None  # structured_output.RequestGrammar when params.structured_outputs is set
        # set for a pooling request (an embedding) served by the generation engine: prefill-only, it never
        # samples; the step that computes its last prompt token pools there instead, and that step's booking
        # finishes it (its blocks freed at once). `params` is then unused defaults.
        self.pooling_params = None  # pooling_params.PoolingParams

    @property
    def num_tokens(self) -> int:
        """Known tokens plus those in flight: what the scheduler plans with."""
        return len(self.token_ids) + self.num_inflight

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def finished(self) -> bool:
        return self.status.finished

    @property
    def finish_reason(self) -> Optional[str]:
        return self.status.value if self.status.finished else None

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, {self.status.name}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens}, blocks={len(self.block_table)})"
        )


def validate_request(prompt_ids: list[int], params: SamplingParams, vocab_size: int, max_model_len: int) -> None:
    """The one validation of a request against the model, run once at the edge (LLMEngine.add_request for the
    offline engine, AsyncLLMEngine.add_request for the server): ValueError, naming the numbers, when the prompt or
    its max_tokens cannot fit or a token id is outside the vocabulary. (SamplingParams checks its own fields.)"""
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

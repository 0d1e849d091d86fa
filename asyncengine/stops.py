"""Every rule that ends a request, in one module.

    token-decided (booked by the scheduler, Scheduler.update):
        EOS (the model's ids, unless ignore_eos) and stop_token_ids, once min_tokens are out -> "stop"
        max_tokens or max_model_len reached                                                    -> "length"
    text-decided (found by the detokenizer, applied by the output processor through Scheduler.stop):
        a stop string completed by the new text                                                -> "stop"
    caller-decided: abort                                                                      -> "abort"

Before min_tokens, the sampler bans the token-decided stop ids (`banned_ids`), so they cannot be sampled at all.
"""

from __future__ import annotations

from typing import Optional

from asyncengine.request import Request, RequestStatus


def banned_ids(request: Request) -> list[int]:
    """Ids the sampler must not produce as the request's next token: while min_tokens are not out (counting the
    tokens booked and any earlier one in flight), stop_token_ids and EOS (unless ignore_eos); sorted."""
    params = request.params
    if request.num_output_tokens + max(request.num_inflight - 1, 0) >= params.min_tokens:
        return []
    return sorted(set(params.stop_token_ids) | (set() if params.ignore_eos else request.eos_token_ids))


def token_stop(request: Request, token: int, max_model_len: int) -> Optional[tuple[RequestStatus, Optional[int]]]:
    """(status, stop_reason) when the token just booked ends the request, else None. stop_reason is the stop
    token id for stop_token_ids, None for EOS and length."""
    params = request.params
    if request.num_output_tokens >= params.min_tokens:
        if not params.ignore_eos and token in request.eos_token_ids:
            return RequestStatus.FINISHED_STOPPED, None
        if token in params.stop_token_ids:
            return RequestStatus.FINISHED_STOPPED, token
    if request.num_output_tokens >= request.max_tokens or len(request.token_ids) >= max_model_len:
        return RequestStatus.FINISHED_LENGTH, None
    return None


def reaches_length_limit(request: Request, max_model_len: int) -> bool:
    """True when the tokens known and in flight already end the request (max_tokens, max_model_len): the
    scheduler schedules it no further."""
    num_output = request.num_tokens - request.num_prompt_tokens
    return num_output >= request.max_tokens or request.num_tokens >= max_model_len

"""OutputProcessor: from booked tokens to `RequestOutput`s, on the engine's thread (book and emit phases). It owns
the user requests (n `Request` children each), detokenization (text deltas; a stop string found ends the request
through the `stop` callback, Scheduler.stop), logprob decoding, token timing and each output kind's outputs.

Stream interval: a streamed (DELTA or CUMULATIVE) request's output is made at its first token, at its end, and in
between once `stream_interval` tokens have come since the last one it was sent (any child's count); the tokens
held back meanwhile arrive in the next output (DELTA slices start where the last report ended)."""

from __future__ import annotations

import time
from typing import Callable, Optional

from asyncengine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from asyncengine.request import Request, RequestStatus
from asyncengine.sampling_params import RequestOutputKind


class UserRequest:
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


class OutputProcessor:
    def __init__(self, tokenizer, stop: Callable[[Request, str], None], stream_interval: int = 1):
        self.tokenizer = tokenizer
        self._stop = stop
        self.stream_interval = stream_interval
        self.user_requests: dict[str, UserRequest] = {}
        self.children: dict[str, Request] = {}

    def add(self, user: UserRequest) -> None:
        self.user_requests[user.request_id] = user
        for child in user.children:
            self.children[child.request_id] = child

    def forget(self, user: UserRequest) -> None:
        del self.user_requests[user.request_id]
        for child in user.children:
            self.children.pop(child.request_id, None)

    def record_token(self, request: Request, logprobs: Optional[dict], now: float, stats) -> None:
        """A token was booked for `request` (its last in token_ids): timing, decoded logprobs (the step's entry
        for this request, or None), and mark its user request for the next outputs. `stats`: a StepStats."""
        if request.first_token_time is None:
            request.first_token_time = now
            stats.prompt_tokens += request.num_prompt_tokens
            stats.time_to_first_token.append(now - request.arrival_time)
        else:
            stats.inter_token_latency.append(now - request.last_token_time)
        request.last_token_time = now
        if logprobs is not None:
            for token_id, logprob in logprobs.items():
                logprob.decoded_token = self.tokenizer.decode([token_id])
            request.logprobs.append(logprobs)
            request.cumulative_logprob += logprobs[request.token_ids[-1]].logprob
        self.user_requests[request.parent_id].changed = True

    def detokenize(self, request: Request) -> None:
        """Extend the request's text by its new tokens; a stop string found there ends the request."""
        if request.parent_id not in self.user_requests:  # aborted since
            return
        ended_by_token = request.finished and request.status == RequestStatus.FINISHED_STOPPED
        if ended_by_token and not request.params.include_stop_str_in_output:
            return  # EOS / stop token: its text is not part of the output
        stop = request.detokenizer.update(request.token_ids, final=request.finished)
        if stop is not None:
            self._stop(request, stop)

    def make_outputs(self, stats, now: float) -> list[RequestOutput]:
        """Outputs of every user request that changed since the last call (FINAL_ONLY: once finished); finished
        user requests are recorded in `stats` (a StepStats) and forgotten."""
        outputs = []
        for user in [u for u in self.user_requests.values() if u.changed]:
            user.changed = False
            finished = user.finished
            if not finished and not self._due(user):
                continue
            outputs.append(self.output(user, finished))
            if finished:
                for child in user.children:
                    stats.e2e_latency.append(now - child.arrival_time)
                    stats.finished_reasons.append(child.finish_reason)
                self.forget(user)
        return outputs

    def _due(self, user: UserRequest) -> bool:
        """Whether an unfinished user request's output is made this step (see the module docstring)."""
        if user.kind == RequestOutputKind.FINAL_ONLY:
            return False
        if self.stream_interval == 1 or not any(user.sent_tokens):  # every token / the first token
            return True
        return any(c.num_output_tokens - sent >= self.stream_interval
                   for c, sent in zip(user.children, user.sent_tokens))

    def output(self, user: UserRequest, finished: Optional[bool] = None) -> RequestOutput:
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
            user.sent_text[i], user.sent_tokens[i] = max(visible, user.sent_text[i]), child.num_output_tokens
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

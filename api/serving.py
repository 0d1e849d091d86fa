"""Running completions and chat requests on the engine, for both HTTP (SSE or JSON) and WebSocket.

`OpenAIServing.completion()` / `.chat()` validate a decoded request, add it to the engine and return a
`Generation`, or raise APIError *before anything is sent* (400 bad input, 404 unknown model, 429 queue full, 503
engine dead). A Generation is then read exactly once, as stream chunks (`chunks()`) or as one response
(`collect()`); `aclose()` (idempotent) aborts whatever is still running. Leaving `chunks()` early (the reader
disconnected, its task was cancelled) aborts the engine requests too: the engine's `iterate()` does it when closed.

A batch of prompts is one engine request per prompt; their outputs are merged as they come (one pending read per
prompt, so memory stays bounded: a slow reader only makes the engine merge deltas in each request's slot).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import AsyncIterator, Optional, Sequence

from asyncengine.api.errors import CONTEXT_LENGTH_EXCEEDED, APIError, from_engine_error
from asyncengine.api.formatting import ChatFormatter, Chunk, CompletionFormatter, Formatter, RequestInfo
from asyncengine.api.inputs import (
    CHAT_RENAMES,
    PARAM_FIELDS,
    EnginePrompt,
    SamplingPolicy,
    chat_params,
    chat_prompt,
    completion_params,
    completion_prompts,
    structured_renames,
)
from asyncengine.api.protocol import ChatCompletionRequest, CompletionRequest
from asyncengine.api.reasoning import REASONING_PARSERS
from asyncengine.api.tool_calls import TOOL_PARSERS, TOOL_RENAMES, ForcedToolCalls, tool_call_mode
from asyncengine.async_engine import AsyncLLMEngine, RequestStream
from asyncengine.outputs import RequestOutput
from asyncengine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class Generation:
    """One accepted API request: its engine requests (one per prompt) and the formatter of its answer."""

    def __init__(self, engine: AsyncLLMEngine, streams: list[RequestStream], formatter: Formatter):
        self.engine = engine
        self.streams = streams
        self.formatter = formatter
        self.request_ids = [s.request_id for s in streams]

    async def outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(prompt index, DELTA output) until every prompt's request has finished."""
        if len(self.streams) == 1:
            async with aclosing(self.engine.iterate(self.streams[0])) as outputs:
                async for output in outputs:
                    yield 0, output
            return
        async with aclosing(_merge([self.engine.iterate(s) for s in self.streams])) as merged:
            async for item in merged:
                yield item

    async def chunks(self) -> AsyncIterator[Chunk]:
        """Every stream chunk of the answer, the usage chunk (if asked for) last. Raises APIError if the engine
        fails midway (the caller turns it into an error event)."""
        fmt = self.formatter
        for chunk in fmt.first_chunks():
            yield chunk
        try:
            async with aclosing(self.outputs()) as outputs:
                async for index, output in outputs:
                    for chunk in fmt.delta_chunks(index, output):
                        yield chunk
        except (asyncio.CancelledError, GeneratorExit):
            raise
        except Exception as exc:  # noqa: BLE001 - the engine died under us: report it in-band
            raise from_engine_error(exc) from exc
        if fmt.info.include_usage:
            yield fmt.usage_chunk()

    async def collect(self):
        """The whole non-streamed response (CompletionResponse or ChatCompletionResponse)."""
        try:
            async with aclosing(self.outputs()) as outputs:
                async for index, output in outputs:
                    self.formatter.absorb(index, output)
        except (asyncio.CancelledError, GeneratorExit):
            raise
        except Exception as exc:  # noqa: BLE001
            raise from_engine_error(exc) from exc
        return self.formatter.response()

    async def abort(self) -> None:
        """End every unfinished request with finish_reason "abort"; its reader still gets the final chunks."""
        for request_id in self.request_ids:
            await self.engine.abort(request_id)

    async def aclose(self) -> None:
        """Abort what is still running. Idempotent, and safe in cleanup code: the engine's abort only marks the
        request (applied before the next step) and does not suspend."""
        await self.abort()


async def _merge(iterators: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Merge async iterators as their items arrive, yielding (iterator index, item).

    One read is pending per live iterator at all times (re-armed before yielding), so when this generator is
    closed or cancelled every remaining iterator is inside a pending read: cancelling those reads runs the
    iterators' cleanup (which aborts the engine requests)."""
    pending: dict[asyncio.Future, int] = {asyncio.ensure_future(_next(it)): i for i, it in enumerate(iterators)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in sorted(done, key=pending.__getitem__):
                i = pending.pop(task)
                exhausted, item = task.result()
                if exhausted:
                    continue
                pending[asyncio.ensure_future(_next(iterators[i]))] = i
                yield i, item
    finally:
        for task in pending:
            task.cancel()


async def _next(iterator: AsyncIterator) -> tuple[bool, object]:
    try:
        return False, await iterator.__anext__()
    except StopAsyncIteration:
        return True, None


@dataclass
class ServingOptions:
    """The OpenAI front end's settings (`asyncengine serve`'s --chat-template, --generation-config,
    --max-logprobs, --enable-log-requests). chat_template: the template text (not a path) that replaces the
    tokenizer's for chat and /tokenize; None keeps the tokenizer's."""

    chat_template: Optional[str] = None
    policy: SamplingPolicy = field(default_factory=SamplingPolicy)
    log_requests: bool = False


class OpenAIServing:
    """Validates requests and starts Generations on one engine, under the served model names."""

    def __init__(self, engine: AsyncLLMEngine, model_names: Sequence[str], options: Optional[ServingOptions] = None,
                 tool_parser: Optional[str] = None, reasoning_parser: Optional[str] = None):
        """tool_parser: the tool-call parser (a TOOL_PARSERS name) that tool_choice "auto" reads calls with; None:
        "auto" with tools is a 400."""
        if tool_parser is not None and tool_parser not in TOOL_PARSERS:
            raise ValueError(f"tool_parser must be one of {', '.join(TOOL_PARSERS)}, got {tool_parser!r}")
        self.engine = engine
        self.model_names = list(model_names)
        self.options = options or ServingOptions()
        self.tool_parser = tool_parser
        if reasoning_parser is not None and reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f"reasoning_parser must be one of {', '.join(REASONING_PARSERS)}, got "
                             f"{reasoning_parser!r}")
        self.reasoning = REASONING_PARSERS[reasoning_parser] if reasoning_parser else None
        self.thinking = self.reasoning.thinking_tokens(engine.tokenizer, reasoning_parser) if self.reasoning else None

    @property
    def model_name(self) -> str:
        return self.model_names[0]

    def check_model(self, name: Optional[str]) -> str:
        """The model name to answer with; 404 when `name` is not served."""
        if name is None or name == "":
            return self.model_name
        if name not in self.model_names:
            raise APIError(404, f"The model `{name[:200]}` does not exist.", param="model", code="model_not_found")
        return name

    async def completion(self, request: CompletionRequest, response_id: Optional[str] = None,
                         stream: Optional[bool] = None) -> Generation:
        model = self.check_model(request.model)
        params = completion_params(request, self.options.policy)
        prompts = await completion_prompts(self.engine, request)
        params = self._default_max_tokens(params, prompts)
        renames = structured_renames(request)
        info = self._info(response_id or f"cmpl-{uuid.uuid4().hex}", model, params, prompts, request, stream)
        streams = await self._add(info.response_id, prompts, params, renames)
        if request.echo:  # decoded once the engine has accepted (validated) the ids
            info.echo_texts = [p.text if p.text is not None else self.engine.tokenizer.decode(p.token_ids)
                               for p in prompts]
        return Generation(self.engine, streams, CompletionFormatter(info, self.engine.tokenizer))

    async def chat(self, request: ChatCompletionRequest, response_id: Optional[str] = None,
                   stream: Optional[bool] = None) -> Generation:
        model = self.check_model(request.model)
        tools = tool_call_mode(request, self.tool_parser)
        forced = isinstance(tools, ForcedToolCalls)
        tool_renames = TOOL_RENAMES if forced else {}
        params = chat_params(request, self.options.policy, tools.constraint if forced else None, tool_renames)
        if self.thinking is not None and params.structured_outputs is not None:  # constrain the answer only
            params = dataclasses.replace(params, structured_outputs=dataclasses.replace(
                params.structured_outputs, after_thinking=self.thinking))
        prompt = await self.chat_prompt(request.messages, request.add_generation_prompt,
                                        request.chat_template_kwargs, tools=request.tools)
        params = self._default_max_tokens(params, [prompt])
        renames = {**structured_renames(request), **CHAT_RENAMES, **tool_renames}
        if request.max_completion_tokens is not None:
            renames["max_tokens"] = "max_completion_tokens"
        info = self._info(response_id or f"chatcmpl-{uuid.uuid4().hex}", model, params, [prompt], request, stream)
        streams = await self._add(info.response_id, [prompt], params, renames)
        return Generation(self.engine, streams, ChatFormatter(info, self.engine.tokenizer, tools, self.reasoning))

    async def chat_prompt(self, messages, add_generation_prompt: bool = True, kwargs: Optional[dict] = None,
                          add_special_tokens: bool = False, tools=None) -> EnginePrompt:
        """The messages (and tools, if any) rendered with the server's chat template (or the tokenizer's), as
        token ids."""
        return await chat_prompt(self.engine, messages, add_generation_prompt, kwargs, add_special_tokens,
                                 chat_template=self.options.chat_template, tools=tools)

    def _default_max_tokens(self, params: SamplingParams, prompts: list[EnginePrompt]) -> SamplingParams:
        if params.max_tokens is not None:
            return params
        default = self.options.policy.default_max_tokens(prompts, self.engine.max_model_len)
        if default is None:
            return params
        return dataclasses.replace(params, max_tokens=max(default, params.min_tokens))  # min_tokens: its own 400

    def _info(self, response_id, model, params: SamplingParams, prompts: list[EnginePrompt], request,
              stream: Optional[bool]) -> RequestInfo:
        streaming = request.stream if stream is None else stream
        options = request.stream_options
        return RequestInfo(
            response_id=response_id,
            created=int(time.time()),
            model=model,
            n=params.n,
            num_prompts=len(prompts),
            prompt_tokens=sum(len(p.token_ids) for p in prompts),
            logprobs=params.logprobs,
            include_usage=bool(streaming and options is not None and options.include_usage),
        )

    async def _add(self, response_id: str, prompts: list[EnginePrompt], params: SamplingParams,
                   renames: dict) -> list[RequestStream]:
        """Add one engine request per prompt, all or none (400 with the numbers for a prompt or max_tokens that
        cannot fit, 429 / 503 from the engine): the engine's add_request is the one validation."""
        streams: list[RequestStream] = []
        base = f"{str(response_id)[:64]}-{uuid.uuid4().hex[:8]}"
        if self.options.log_requests:
            logger.info("request %s: %d prompt(s) of %s tokens, %s", base, len(prompts),
                        ", ".join(str(len(p.token_ids)) for p in prompts), params)
        try:
            for i, prompt in enumerate(prompts):
                streams.append(await self.engine.add_request(prompt.token_ids, params, f"{base}-{i}"))
        except Exception as exc:
            for stream in streams:
                await self.engine.abort(stream.request_id)
            error = from_engine_error(exc, PARAM_FIELDS, renames)
            if isinstance(exc, ValueError) and "max_model_len" in str(exc):
                error.code = CONTEXT_LENGTH_EXCEEDED  # OpenAI's code; /openapi.json cannot state it (counts tokens)
            raise error from exc
        return streams

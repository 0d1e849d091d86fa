"""Engine outputs -> OpenAI responses and stream chunks, for completions and chat.

A formatter is fed the engine's DELTA outputs of one API request (one engine request per prompt; a prompt's n
samples are its CompletionOutputs) and produces either stream chunks (`delta_chunks`) or, after `absorb`ing
everything, one response (`response`). Choice indices are `prompt_index * n + sample_index`, as vLLM numbers a
batch. In streaming mode nothing but counters is kept per choice, so a long stream holds constant memory.

Stream shapes, as OpenAI sends them:
    chat:         {"delta": {"role": "assistant", "content": ""}} per choice, then {"delta": {"content": ...}}
                  chunks, then {"delta": {}, "finish_reason": ...} per choice, then (include_usage) one chunk
                  with "choices": [] and "usage"; every other chunk then carries "usage": null.
    completions:  text chunks, a {"text": "", "finish_reason": ...} chunk per choice, then the usage chunk.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Union

import msgspec

from asyncengine.api.protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatLogprobToken,
    ChatMessage,
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    DeltaMessage,
    TopLogprob,
    UsageInfo,
)
from asyncengine.api.reasoning import ReasoningParser, ReasoningStream, split_reasoning
from asyncengine.api.tool_calls import AutoToolCalls, ForcedToolCalls
from asyncengine.outputs import CompletionOutput, Logprob, RequestOutput
from asyncengine.tokenizer import byte_level_table

Chunk = Union[CompletionResponse, ChatCompletionChunk]
LogprobEntries = list[tuple[int, dict[int, Logprob]]]  # (chosen token id, {token id: Logprob}) per position


@dataclass
class ChoiceState:
    """One choice's progress. `text` and `entries` fill only when absorbing (non-streaming)."""

    num_tokens: int = 0
    text: list[str] = field(default_factory=list)
    entries: LogprobEntries = field(default_factory=list)
    text_offset: int = 0  # completions logprobs: where the next token starts in the choice's text
    finish_reason: Optional[str] = None
    stop_reason: Union[int, str, None] = None
    finished: bool = False


@dataclass
class RequestInfo:
    """What every chunk and response of one API request shares."""

    response_id: str
    created: int
    model: str
    n: int
    num_prompts: int
    prompt_tokens: int
    logprobs: Optional[int]  # top-N per position; None: no logprobs
    include_usage: bool = False
    echo_texts: Optional[list[str]] = None  # completions echo: each prompt's text


class TokenBytes:
    """A token's UTF-8 bytes (OpenAI's `bytes`): exact for byte-level BPE tokenizers (the engine's id -> bytes
    table, built once per tokenizer), else the bytes of its decoded text."""

    def __init__(self, tokenizer):
        table = byte_level_table(tokenizer)
        self._pieces = table[0] if table is not None else None

    def __call__(self, token_id: int, decoded: str) -> list[int]:
        if self._pieces is not None and 0 <= token_id < len(self._pieces) and self._pieces[token_id] is not None:
            return list(self._pieces[token_id])
        return list(decoded.encode("utf-8"))


def _decoded(tokenizer, token_id: int, logprob: Logprob) -> str:
    return logprob.decoded_token if logprob.decoded_token is not None else tokenizer.decode([token_id])


def _entries(c: CompletionOutput) -> LogprobEntries:
    if c.logprobs is None:
        return []
    return list(zip(c.token_ids, c.logprobs))


class Formatter:
    """Shared bookkeeping: choice states, usage, and the order chunks are made in."""

    def __init__(self, info: RequestInfo, tokenizer):
        self.info = info
        self.tokenizer = tokenizer
        self.states = [ChoiceState() for _ in range(info.n * info.num_prompts)]
        self._usage_field = None if info.include_usage else msgspec.UNSET

    def usage(self) -> UsageInfo:
        completion = sum(s.num_tokens for s in self.states)
        return UsageInfo(prompt_tokens=self.info.prompt_tokens, completion_tokens=completion,
                         total_tokens=self.info.prompt_tokens + completion)

    def first_chunks(self) -> list[Chunk]:
        return []

    def delta_chunks(self, prompt_index: int, output: RequestOutput) -> list[Chunk]:
        """Chunks for one DELTA output: one per choice with new text (or logprobs), then one per choice that
        just finished. Choices are interleaved in index order."""
        chunks = []
        for c in output.outputs:
            index = prompt_index * self.info.n + c.index
            state = self.states[index]
            state.num_tokens += len(c.token_ids)
            entries = _entries(c) if self.info.logprobs is not None else []
            if c.text or entries:
                chunk = self._content_chunk(index, c.text, entries, state)
                if chunk is not None:
                    chunks.append(chunk)
            if c.finish_reason is not None and not state.finished:
                state.finished = True
                chunks.extend(self._flush_chunks(index))
                chunks.append(self._finish_chunk(index, c.finish_reason, c.stop_reason))
        return chunks

    def absorb(self, prompt_index: int, output: RequestOutput) -> None:
        """Accumulate one DELTA output for a non-streamed response."""
        for c in output.outputs:
            state = self.states[prompt_index * self.info.n + c.index]
            state.num_tokens += len(c.token_ids)
            state.text.append(c.text)
            state.entries.extend(_entries(c))
            if c.finish_reason is not None:
                state.finish_reason, state.stop_reason, state.finished = c.finish_reason, c.stop_reason, True

    def _echo(self, index: int) -> str:
        texts = self.info.echo_texts
        return texts[index // self.info.n] if texts else ""

    def _content_chunk(self, index: int, text: str, entries: LogprobEntries,
                       state: ChoiceState) -> Optional[Chunk]:
        """The chunk carrying a choice's new text (None: nothing to send yet)."""
        raise NotImplementedError

    def _flush_chunks(self, index: int) -> list[Chunk]:
        """What a choice held back, sent just before its finish chunk."""
        return []

    def _finish_chunk(self, index: int, finish_reason: str, stop_reason) -> Chunk:
        raise NotImplementedError

    def usage_chunk(self) -> Chunk:
        raise NotImplementedError


class CompletionFormatter(Formatter):
    def _chunk(self, choices: list[CompletionChoice], usage=None) -> CompletionResponse:
        info = self.info
        return CompletionResponse(id=info.response_id, created=info.created, model=info.model, choices=choices,
                                  usage=self._usage_field if usage is None else usage)

    def first_chunks(self) -> list[Chunk]:
        if not self.info.echo_texts:
            return []
        chunks = []
        for index, state in enumerate(self.states):
            echo = self._echo(index)
            state.text_offset = len(echo)
            chunks.append(self._chunk([CompletionChoice(index=index, text=echo)]))
        return chunks

    def _content_chunk(self, index, text, entries, state) -> Chunk:
        logprobs = self._logprobs(entries, state) if self.info.logprobs is not None else None
        return self._chunk([CompletionChoice(index=index, text=text, logprobs=logprobs)])

    def _finish_chunk(self, index, finish_reason, stop_reason) -> Chunk:
        return self._chunk([CompletionChoice(index=index, text="", finish_reason=finish_reason,
                                             stop_reason=stop_reason)])

    def usage_chunk(self) -> Chunk:
        return self._chunk([], usage=self.usage())

    def _logprobs(self, entries: LogprobEntries, state: ChoiceState) -> CompletionLogprobs:
        tokens, token_logprobs, tops, offsets = [], [], [], []
        for token_id, entry in entries:
            chosen = entry[token_id]
            token = _decoded(self.tokenizer, token_id, chosen)
            tokens.append(token)
            token_logprobs.append(chosen.logprob)
            tops.append({_decoded(self.tokenizer, t, lp): lp.logprob for t, lp in entry.items()})
            offsets.append(state.text_offset)
            state.text_offset += len(token)
        return CompletionLogprobs(text_offset=offsets, token_logprobs=token_logprobs, tokens=tokens,
                                  top_logprobs=tops)

    def response(self) -> CompletionResponse:
        choices = []
        for index, state in enumerate(self.states):
            echo = self._echo(index)
            state.text_offset = len(echo)
            logprobs = self._logprobs(state.entries, state) if self.info.logprobs is not None else None
            choices.append(CompletionChoice(index=index, text=echo + "".join(state.text), logprobs=logprobs,
                                            finish_reason=state.finish_reason, stop_reason=state.stop_reason))
        info = self.info
        return CompletionResponse(id=info.response_id, created=info.created, model=info.model, choices=choices,
                                  usage=self.usage())


class ChatFormatter(Formatter):
    """tools: how the request's tool calls are read from its choices' text (tool_calls.py: forced calls, or calls
    parsed under tool_choice "auto"); a choice that made calls ends with finish_reason "tool_calls" where the
    engine said "stop"."""

    def __init__(self, info: RequestInfo, tokenizer, tools: Union[ForcedToolCalls, AutoToolCalls, None] = None,
                 reasoning: Optional[ReasoningParser] = None):
        super().__init__(info, tokenizer)
        self.reasoning = reasoning
        self.reasoning_streams = [ReasoningStream(reasoning) for _ in self.states] if reasoning else None
        self.token_bytes = TokenBytes(tokenizer) if info.logprobs is not None else None
        self.tools = tools
        self.tool_streams = [tools.stream() for _ in self.states] if tools is not None else None

    def _chunk(self, choices: list[ChatChunkChoice], usage=None) -> ChatCompletionChunk:
        info = self.info
        return ChatCompletionChunk(id=info.response_id, created=info.created, model=info.model, choices=choices,
                                   usage=self._usage_field if usage is None else usage)

    def first_chunks(self) -> list[Chunk]:
        return [self._chunk([ChatChunkChoice(index=i, delta=DeltaMessage(role="assistant", content=""))])
                for i in range(len(self.states))]

    def _content_chunk(self, index, text, entries, state) -> Optional[Chunk]:
        logprobs = self._logprobs(entries) if self.info.logprobs is not None else None
        reasoning = ""
        if self.reasoning_streams is not None:
            reasoning, text = self.reasoning_streams[index].feed(text)
        if self.tool_streams is None and self.reasoning_streams is None:
            delta = DeltaMessage(content=text)
        else:
            content, fragments = self.tool_streams[index].feed(text) if self.tool_streams else (text, [])
            if not reasoning and not content and not fragments and logprobs is None:
                return None
            delta = DeltaMessage(content=content or None, tool_calls=fragments or None,
                                 reasoning_content=reasoning or None)
        return self._chunk([ChatChunkChoice(index=index, delta=delta, logprobs=logprobs)])

    def _flush_chunks(self, index) -> list[Chunk]:
        reasoning, text = self.reasoning_streams[index].finish() if self.reasoning_streams else ("", "")
        content, fragments = self.tool_streams[index].feed(text) if self.tool_streams else (text, [])
        if self.tool_streams is not None:
            more_content, more_fragments = self.tool_streams[index].finish()
            content, fragments = content + more_content, fragments + more_fragments
        if not reasoning and not content and not fragments:
            return []
        delta = DeltaMessage(content=content or None, tool_calls=fragments or None,
                             reasoning_content=reasoning or None)
        return [self._chunk([ChatChunkChoice(index=index, delta=delta)])]

    @staticmethod
    def _finish_reason(finish_reason: Optional[str], called: bool) -> Optional[str]:
        return "tool_calls" if called and finish_reason == "stop" else finish_reason

    def _finish_chunk(self, index, finish_reason, stop_reason) -> Chunk:
        called = self.tool_streams is not None and self.tool_streams[index].called  # set by _flush_chunks
        return self._chunk([ChatChunkChoice(index=index, delta=DeltaMessage(),
                                            finish_reason=self._finish_reason(finish_reason, called))])

    def usage_chunk(self) -> Chunk:
        return self._chunk([], usage=self.usage())

    def _logprobs(self, entries: LogprobEntries) -> ChatLogprobs:
        top_n = self.info.logprobs or 0
        content = []
        for token_id, entry in entries:
            chosen = entry[token_id]
            ranked = sorted((lp.rank or 0, t, lp) for t, lp in entry.items() if (lp.rank or 0) <= top_n)
            content.append(ChatLogprobToken(
                token=_decoded(self.tokenizer, token_id, chosen),
                logprob=chosen.logprob,
                bytes=self._bytes(token_id, chosen),
                top_logprobs=[TopLogprob(token=_decoded(self.tokenizer, t, lp), logprob=lp.logprob,
                                         bytes=self._bytes(t, lp)) for _, t, lp in ranked[:top_n]],
            ))
        return ChatLogprobs(content=content)

    def _bytes(self, token_id: int, logprob: Logprob) -> list[int]:
        return self.token_bytes(token_id, _decoded(self.tokenizer, token_id, logprob))

    def _message(self, text: str) -> ChatMessage:
        reasoning = msgspec.UNSET
        if self.reasoning is not None:
            reasoning, text = split_reasoning(self.reasoning, text)
        if self.tools is None:
            return ChatMessage(content=text, reasoning_content=reasoning)
        content, calls = self.tools.message(text)
        return ChatMessage(content=content, tool_calls=calls if calls else msgspec.UNSET, reasoning_content=reasoning)

    def response(self) -> ChatCompletionResponse:
        choices = []
        for index, state in enumerate(self.states):
            logprobs = self._logprobs(state.entries) if self.info.logprobs is not None else None
            message = self._message("".join(state.text))
            choices.append(ChatChoice(index=index, message=message, logprobs=logprobs,
                                      finish_reason=self._finish_reason(state.finish_reason,
                                                                        message.tool_calls is not msgspec.UNSET),
                                      stop_reason=state.stop_reason))
        info = self.info
        return ChatCompletionResponse(id=info.response_id, created=info.created, model=info.model, choices=choices,
                                      usage=self.usage())

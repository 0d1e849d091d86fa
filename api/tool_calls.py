"""Tool calling on /v1/chat/completions: which tool calls a request forces, the constraint that guarantees them,
and reading the constrained output back as OpenAI `tool_calls` (whole, or as streamed `delta.tool_calls`).

Forced calls (`tool_choice` "required" or a named function) are decoded under a JSON schema (the engine's
structured outputs, compiled by xgrammar) whose instances are exactly the valid calls:

    one call:        {"name": <a tool's name>, "arguments": <that tool's parameters schema>}
    parallel calls:  [<one call>, ...]   (at least one; `parallel_tool_calls` true, the default, and "required")

Keys come out in that order (xgrammar follows the schema's property order) and the JSON is compact by default, but
the reader below accepts any whitespace.

Reading calls back, forced or parsed from free text under tool_choice "auto" (Hermes, Llama 3 JSON, Mistral), is
one incremental reader (ToolCallStream) over a CallFormat: content streams as it comes, a call's id and name go
out as soon as they are read, then its arguments as the model writes them. A call's `arguments` string is the
raw text the model produced for it, and the non-streamed answer is the same reader fed the whole text at once, so
the streamed fragments reassemble to exactly the non-streamed calls. Nothing is lost when max_tokens cuts a call
short: its arguments so far are returned (finish_reason "length"), and an output cut before any call could be
read is returned as content.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Literal, Optional, Union

import regex

from asyncengine.api.errors import bad_request
from asyncengine.api.protocol import (
    ChatCompletionRequest,
    DeltaFunctionCall,
    DeltaToolCall,
    FunctionCall,
    ToolCall,
)
from asyncengine.sampling_params import StructuredOutputsParams

# Errors about the forced calls' constraint name `tools` (the schemas come from there).
TOOL_RENAMES = {"structured_outputs": "tools", "structured_outputs.json": "tools"}


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


# -- the request ----------------------------------------------------------------------------------------------
def tool_schemas(request: ChatCompletionRequest) -> dict[str, dict]:
    """{tool name: its parameters schema (an object schema)}; 400 naming `tools` for a duplicate name or a
    parameters schema that is not an object schema. (A schema xgrammar cannot compile is a 400 naming `tools` too,
    when the engine compiles it: see TOOL_RENAMES.)"""
    schemas: dict[str, dict] = {}
    for i, tool in enumerate(request.tools or []):
        name = tool.function.name
        if not name or name in schemas:
            raise bad_request(f"tools[{i}].function.name must be a unique non-empty name, got {name[:64]!r}", "tools")
        params = tool.function.parameters
        if params is None:  # OpenAI: omitted parameters mean a function without arguments
            params = {"type": "object", "properties": {}, "additionalProperties": False}
        elif params.get("type", "object") != "object":
            raise bad_request(f"tools[{i}].function.parameters must be an object schema "
                              f"(type \"object\"), got type {str(params.get('type'))[:40]!r}", "tools")
        schemas[name] = {"type": "object", **params}
    return schemas


def forced_tool_names(request: ChatCompletionRequest, schemas: dict[str, dict], auto: bool = False
                      ) -> Union[list[str], Literal["auto"], None]:
    """The tools one of which every call must name, "auto" (the model decides; only when `auto` is allowed) or
    None ("none"). 400 naming `tool_choice` for a choice that needs tools when there are none, an unknown name,
    or "auto" on a server without --enable-auto-tool-choice."""
    choice = request.tool_choice
    if choice is None:
        choice = "auto" if schemas else "none"
    if choice == "none":
        return None
    if not schemas:
        raise bad_request("tool_choice other than \"none\" needs tools", "tool_choice")
    if choice == "required":
        return list(schemas)
    if choice == "auto" and auto:
        return "auto"
    if choice == "auto":
        raise bad_request('tool_choice "auto" needs a server started with --enable-auto-tool-choice and '
                          '--tool-call-parser; use "required", a named function or "none"', "tool_choice")
    name = choice.function.name
    if name not in schemas:
        raise bad_request(f"tool_choice names the function {name[:64]!r}, which is not among the tools",
                          "tool_choice")
    return [name]


def call_schema(names: list[str], schemas: dict[str, dict]) -> dict:
    """The JSON schema of one call of one of `names`."""
    options = [{
        "type": "object",
        "properties": {"name": {"const": name}, "arguments": schemas[name]},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    } for name in names]
    return options[0] if len(options) == 1 else {"anyOf": options}


@dataclass
class ToolCallReader:
    """Reads a choice's calls (and any content) out of its text: whole (`message`) or streamed (`stream`)."""

    format: "CallFormat"
    parallel: bool  # false: only the first call is returned

    def message(self, text: str) -> tuple[Optional[str], list[ToolCall]]:
        """(content, None when empty; the calls)."""
        stream = self.stream()
        content, fragments = stream.feed(text)
        more_content, more_fragments = stream.finish()
        return (content + more_content) or None, calls_of_fragments(fragments + more_fragments)

    def stream(self) -> "ToolCallStream":
        return ToolCallStream(self.format, self.parallel)


@dataclass
class ForcedToolCalls(ToolCallReader):
    """A request with forced calls: the constraint on its output, whose text is all calls (content null,
    finish_reason "tool_calls" when it ended normally; content only when max_tokens cut it before a call's name
    was complete)."""

    constraint: Optional[StructuredOutputsParams] = None


@dataclass
class AutoToolCalls(ToolCallReader):
    """tool_choice "auto" with a parser: content and calls are read from free text. With parallel_tool_calls
    false only the first call is returned (the model cannot be held to one without a constraint)."""


def tool_call_mode(request: ChatCompletionRequest, auto_parser: Optional[str] = None
                   ) -> Union[ForcedToolCalls, AutoToolCalls, None]:
    """How a chat request's output is read: forced calls (constrained), calls parsed from free text with the
    server's `auto_parser` (tool_choice "auto"; None: the server has none, and "auto" is a 400), or None (plain
    content). Raises APIError(400) naming the field."""
    schemas = tool_schemas(request)
    names = forced_tool_names(request, schemas, auto_parser is not None)
    if names is None:
        return None
    if names == "auto":
        return AutoToolCalls(TOOL_PARSERS[auto_parser](), request.parallel_tool_calls is not False)
    if request.response_format is not None and request.response_format.type != "text" \
            or request.structured_outputs is not None:
        raise bad_request("a forced tool call (tool_choice) and response_format / structured_outputs exclude "
                          "each other", "tool_choice")
    if request.min_tokens or request.ignore_eos:  # SamplingParams would say "structured_outputs", not sent here
        field_name = "min_tokens" if request.min_tokens else "ignore_eos"
        raise bad_request(f"{field_name} cannot be combined with a forced tool call (tool_choice \"required\" or a "
                          "named function): its output ends with EOS", field_name)
    one = call_schema(names, schemas)
    # A named function is one call; "required" may be several unless parallel_tool_calls is false.
    parallel = request.tool_choice == "required" and request.parallel_tool_calls is not False
    schema = {"type": "array", "items": one, "minItems": 1} if parallel else one
    return ForcedToolCalls(ForcedCallFormat(parallel), parallel, StructuredOutputsParams(json=schema))


# -- reading the output ---------------------------------------------------------------------------------------
_NAME = r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")'  # a call object's start, up to its name (group 1)


@dataclass
class ScannedCall:
    name: str
    arguments: str  # the raw text so far (complete once `complete`)
    complete: bool


def _object_end(text: str, start: int, memo: Optional[dict] = None) -> Optional[int]:
    """Index just past the JSON object starting at text[start] ("{"), or None if the text ends first. Only
    braces outside strings count. memo: where an earlier call on a prefix of the same text stopped, by `start`
    (the scan resumes there, so a streamed object costs time linear in its length)."""
    memo = memo if memo is not None else {}
    if ("end", start) in memo:
        return memo["end", start]
    pos, depth, in_string, escaped = memo.get(start, (start, 0, False, False))
    for i in range(pos, len(text)):
        ch = text[i]
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 0:
                memo["end", start] = i + 1
                return i + 1
    memo[start] = (len(text), depth, in_string, escaped)
    return None


class CallFormat:
    """Where calls lie in a text: in runs, each starting at a start marker, then `opener`, then call objects
    `{"name": ..., <arguments_key>: {...}}` (any whitespace) separated by `separator`, then `closer`. Text
    outside runs is content. A run in which no call can be read (its first call object does not start as one)
    is content too, and so is its marker. Subclasses name their format in their docstring.

    trusted: the text was constrained to valid calls, so a call counts as soon as its name is read (a call cut
    right after its name keeps it, with empty arguments); otherwise only once its arguments' "{" has come."""

    start_marker = ""
    opener = ""
    separator: Optional[str] = None  # None: one call per run
    closer: Optional[str] = None  # None: the run ends after its last call
    arguments_key = "arguments"
    trusted = False

    def __init__(self):
        self._name = regex.compile(_NAME)
        self._arguments = regex.compile(r'\s*,\s*"' + re.escape(self.arguments_key) + r'"\s*:\s*\{')
        self._opener = regex.compile(r"\s*" + re.escape(self.opener))
        after = [re.escape(m) for m in (self.separator, self.closer) if m]
        self._after = regex.compile(r"\s*(?:(" + "|".join(after) + "))") if after else None

    def find_start(self, text: str, pos: int) -> tuple[Optional[int], int, int]:
        """(where the next run at or after `pos` starts, or None; where its body starts (after the marker); how
        many trailing characters to hold back while there is none, because they may still begin one)."""
        index = text.find(self.start_marker, pos)
        if index >= 0:
            return index, index + len(self.start_marker), 0
        marker = self.start_marker
        for size in range(min(len(marker) - 1, len(text) - pos), 0, -1):
            if marker.startswith(text[len(text) - size:]):
                return None, 0, size
        return None, 0, 0

    def scan_run(self, text: str, body: int, memo: Optional[dict] = None) -> tuple[list[ScannedCall], Optional[int]]:
        """The calls read so far of the run whose body starts at text[body] (names whole, arguments so far), and
        where the run ends (None: not decided yet; more text may continue it). On a longer text the result only
        grows: the same calls, arguments longer, names unchanged. Partial regex matches tell "not yet" (the text
        ends inside a match) from "no" (it cannot match). memo: kept by the caller across growing prefixes of
        one text, so that objects are not rescanned from their start (see _object_end)."""
        calls: list[ScannedCall] = []
        opener = self._opener.match(text, body, partial=True)
        if opener is None or opener.partial:
            return calls, None if opener is not None else body
        pos = opener.end()
        while True:
            name = self._name.match(text, pos, partial=True)
            if name is None or name.partial:
                return calls, None if name is not None else pos
            try:
                call = ScannedCall(json.loads(name.group(1)), "", False)
            except ValueError:
                return calls, pos
            if self.trusted:
                calls.append(call)
            arguments = self._arguments.match(text, name.end(), partial=True)
            if arguments is None or arguments.partial:
                return calls, None if arguments is not None else pos
            if not self.trusted:
                calls.append(call)
            start = arguments.end() - 1  # the arguments' "{"
            end = _object_end(text, start, memo)
            call.arguments, call.complete = text[start:end], end is not None
            call_end = _object_end(text, text.index("{", pos), memo) if end is not None else None
            if call_end is None:
                return calls, None
            after = self._after.match(text, call_end, partial=True) if self._after is not None else None
            if after is None or after.partial:
                return calls, None if after is not None else call_end
            if self.separator is None or after.group(1) != self.separator:
                return calls, after.end()  # the closer
            pos = after.end()


class ForcedCallFormat(CallFormat):
    """A forced output: one call object, or (parallel) a JSON array of them; the whole text is the run."""

    trusted = True

    def __init__(self, parallel: bool):
        if parallel:
            self.opener, self.separator, self.closer = "[", ",", "]"
        super().__init__()

    def find_start(self, text, pos):
        return (0, 0, 0) if pos == 0 else (None, 0, 0)


def scan_calls(text: str, parallel: bool) -> list[ScannedCall]:
    """The calls in (a prefix of) a forced output: each call whose name is complete, with its arguments so far."""
    return ForcedCallFormat(parallel).scan_run(text, 0)[0]


def calls_of_fragments(fragments: list[DeltaToolCall]) -> list[ToolCall]:
    """The calls that streamed fragments reassemble to."""
    calls: list[ToolCall] = []
    for fragment in fragments:
        if fragment.id is not None:
            calls.append(ToolCall(id=fragment.id, function=FunctionCall(name=fragment.function.name, arguments="")))
        calls[fragment.index].function.arguments += fragment.function.arguments or ""
    return calls


@dataclass
class ToolCallStream:
    """One choice's calls, read as its text comes: fed text deltas, returns (content, new `delta.tool_calls`
    fragments). Content goes out as soon as it is known not to start a run; a call's first fragment carries its
    id, type and name, the next ones pieces of its arguments. On each delta only the open run is scanned again,
    its call heads by regex and its objects from where the last scan stopped (memo): linear in the output."""

    format: CallFormat
    parallel: bool = True
    text: str = ""
    pos: int = 0  # everything before it is decided (sent as content, or a finished run)
    run: Optional[tuple[int, int, int]] = None  # the open run: (start, body start, calls before it)
    memo: dict = field(default_factory=dict)  # the open run's scan state (scan_run's memo)
    ids: list[str] = field(default_factory=list)
    sent: list[int] = field(default_factory=list)  # characters of each call's arguments already sent

    @property
    def called(self) -> bool:
        return bool(self.ids)

    def feed(self, delta: str) -> tuple[str, list[DeltaToolCall]]:
        self.text += delta
        return self._advance(final=False)

    def finish(self) -> tuple[str, list[DeltaToolCall]]:
        """What is left at the end of the output (an open run ends there, with what it holds)."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> tuple[str, list[DeltaToolCall]]:
        content: list[str] = []
        fragments: list[DeltaToolCall] = []
        while True:
            if self.run is None:
                start, body, hold = self.format.find_start(self.text, self.pos)
                end = start if start is not None else len(self.text) - (0 if final else hold)
                content.append(self.text[self.pos:max(end, self.pos)])
                self.pos = max(end, self.pos)
                if start is None:
                    return "".join(content), fragments
                self.run = (start, body, len(self.ids))
            start, body, before = self.run
            calls, end = self.format.scan_run(self.text, body, self.memo)
            fragments += self._fragments(calls, before)
            if end is None and not final:
                return "".join(content), fragments
            self.run, self.memo = None, {}
            if calls:
                self.pos = len(self.text) if end is None else end
            else:  # not a run: its marker is content, and runs are looked for after it
                self.pos = max(body, start + 1)
                content.append(self.text[start:self.pos])

    def _fragments(self, calls: list[ScannedCall], before: int) -> list[DeltaToolCall]:
        fragments = []
        for offset, call in enumerate(calls):
            index = before + offset
            if index > 0 and not self.parallel:
                break
            if index == len(self.ids):
                self.ids.append(new_call_id())
                self.sent.append(0)
                fragments.append(DeltaToolCall(index=index, id=self.ids[index], type="function",
                                               function=DeltaFunctionCall(name=call.name, arguments="")))
            piece = call.arguments[self.sent[index]:]
            if piece:
                self.sent[index] = len(call.arguments)
                fragments.append(DeltaToolCall(index=index, function=DeltaFunctionCall(arguments=piece)))
        return fragments


# -- tool_choice "auto": the models' formats ------------------------------------------------------------------
class HermesToolParser(CallFormat):
    """Hermes / Qwen2.5 / Qwen3: each call is `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (JSON
    between the tags, whitespace around it allowed); content may come before, between and after the calls. The
    last call may lack its closing tag (the model stopped on EOS right after the JSON)."""

    start_marker = "<tool_call>"
    closer = "</tool_call>"


class Llama3JsonToolParser(CallFormat):
    """Llama 3.1 / 3.2 JSON tool calling: the output starts (after blanks, and optionally `<|python_tag|>`) with
    a call `{"name": ..., "parameters": {...}}`, or several separated by `;`. Any other output is content, and
    so is text after the calls."""

    separator = ";"
    arguments_key = "parameters"
    _PREFIX = "<|python_tag|>"

    def find_start(self, text, pos):
        if pos > 0:
            return None, 0, 0
        stripped = text.lstrip()
        lead = len(text) - len(stripped)
        if stripped.startswith(self._PREFIX):  # the leading blanks belong to the run
            return 0, lead + len(self._PREFIX), 0
        if stripped.startswith("{"):
            return 0, 0, 0
        undecided = not stripped or self._PREFIX.startswith(stripped)
        return None, 0, len(text) if undecided else 0


class MistralToolParser(CallFormat):
    """Mistral: content, then `[TOOL_CALLS]` and a JSON array of `{"name": ..., "arguments": {...}}`. (Mistral's
    tokenizer makes [TOOL_CALLS] a special token: such a model needs skip_special_tokens false for the marker to
    reach the text.)"""

    start_marker = "[TOOL_CALLS]"
    opener, separator, closer = "[", ",", "]"


TOOL_PARSERS: dict[str, type[CallFormat]] = {
    "hermes": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
    "mistral": MistralToolParser,
}

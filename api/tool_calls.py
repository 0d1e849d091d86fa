"""Tool calling on /v1/chat/completions: which tool calls a request forces, the constraint that guarantees them,
and reading the constrained output back as OpenAI `tool_calls` (whole, or as streamed `delta.tool_calls`).

Forced calls (`tool_choice` "required" or a named function) are decoded under a JSON schema (the engine's
structured outputs, compiled by xgrammar) whose instances are exactly the valid calls:

    one call:        {"name": <a tool's name>, "arguments": <that tool's parameters schema>}
    parallel calls:  [<one call>, ...]   (at least one; `parallel_tool_calls` true, the default, and "required")

Keys come out in that order (xgrammar follows the schema's property order) and the JSON is compact by default, but
the reader below accepts any whitespace. A call's `arguments` string is the raw text the model produced for it,
both when streamed and not, so the streamed fragments reassemble to exactly the non-streamed call.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Literal, Optional, Union

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
class ForcedToolCalls:
    """What a request with forced calls needs: the constraint on its output, and whether it is an array. The
    output is all calls: content null, finish_reason "tool_calls" when it ended normally."""

    constraint: StructuredOutputsParams
    parallel: bool

    def message(self, text: str) -> tuple[Optional[str], list[ToolCall]]:
        return None, tool_calls_of(text, self.parallel)

    def stream(self) -> ToolCallStream:
        return ToolCallStream(self.parallel)


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
    one = call_schema(names, schemas)
    # A named function is one call; "required" may be several unless parallel_tool_calls is false.
    parallel = request.tool_choice == "required" and request.parallel_tool_calls is not False
    schema = {"type": "array", "items": one, "minItems": 1} if parallel else one
    return ForcedToolCalls(StructuredOutputsParams(json=schema), parallel)


# -- reading the output ---------------------------------------------------------------------------------------
_CALL_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:\s*')
_SEPARATOR = re.compile(r"\s*,")


@dataclass
class ScannedCall:
    name: str
    arguments: str  # the raw text so far (complete once `complete`)
    complete: bool


def _object_end(text: str, start: int) -> Optional[int]:
    """Index just past the JSON object starting at text[start] ("{"), or None if the text ends first. Only
    braces outside strings count (the text is valid JSON so far: the grammar guarantees it)."""
    depth, in_string, escaped = 0, False, False
    for i in range(start, len(text)):
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
                return i + 1
    return None


def scan_calls(text: str, parallel: bool) -> list[ScannedCall]:
    """The calls in (a prefix of) a forced output: each call whose name is complete, with its arguments so far.
    On a prefix, the result only grows: names appear whole, arguments only get longer."""
    calls: list[ScannedCall] = []
    pos = 0
    if parallel:
        stripped = len(text) - len(text.lstrip())
        if not text[stripped:stripped + 1] == "[":
            return calls
        pos = stripped + 1
    while True:
        head = _CALL_HEAD.match(text, pos)
        if head is None:
            return calls
        name = json.loads(head.group(1))
        start = head.end()
        end = _object_end(text, start) if text[start:start + 1] == "{" else None
        calls.append(ScannedCall(name, text[start:end] if end is not None else text[start:], end is not None))
        if end is None or not parallel:
            return calls
        close = text.find("}", end)  # the call object's own closing brace
        if close < 0:
            return calls
        separator = _SEPARATOR.match(text, close + 1)
        if separator is None:
            return calls
        pos = separator.end()


def tool_calls_of(text: str, parallel: bool) -> list[ToolCall]:
    """The non-streamed answer's tool calls (a call cut short by max_tokens keeps its partial arguments, as its
    streamed fragments would)."""
    return [ToolCall(id=new_call_id(), function=FunctionCall(name=c.name, arguments=c.arguments))
            for c in scan_calls(text, parallel)]


@dataclass
class ToolCallStream:
    """One streamed choice's forced calls: fed the text deltas, returns the `delta.tool_calls` fragments that are
    new (a call's id, type and name once, then pieces of its arguments)."""

    parallel: bool
    text: str = ""
    ids: list[str] = field(default_factory=list)
    sent: list[int] = field(default_factory=list)  # characters of each call's arguments already sent

    called: bool = True  # a forced output is all calls

    def feed(self, delta: str) -> tuple[str, list[DeltaToolCall]]:
        """(content: always empty here, new fragments)."""
        self.text += delta  # outputs of forced calls are short (a few hundred tokens); rescanning is cheap
        fragments = []
        for index, call in enumerate(scan_calls(self.text, self.parallel)):
            if index == len(self.ids):
                self.ids.append(new_call_id())
                self.sent.append(0)
                fragments.append(DeltaToolCall(index=index, id=self.ids[index], type="function",
                                               function=DeltaFunctionCall(name=call.name, arguments="")))
            piece = call.arguments[self.sent[index]:]
            if piece:
                self.sent[index] = len(call.arguments)
                fragments.append(DeltaToolCall(index=index, function=DeltaFunctionCall(arguments=piece)))
        return "", fragments

    def finish(self) -> tuple[str, list[DeltaToolCall]]:
        return "", []  # every fragment went out as it came


# -- tool_choice "auto": calls parsed from free text ----------------------------------------------------------
class ToolParser:
    """Reads one model family's tool-call format out of free text. Subclasses give the format in their docstring.

    extract(text) -> (content, calls): `content` is the text outside the calls (exactly, unstripped), `calls`
    (name, arguments as a JSON string). Text that starts a call but does not parse is all content (no calls),
    as vLLM does. tool_start(text) -> where the first call starts, or None; hold(text) -> how many trailing
    characters may still become a start marker (streaming holds them back)."""

    start_marker = ""

    def extract(self, text: str) -> tuple[str, list[tuple[str, str]]]:
        raise NotImplementedError

    def tool_start(self, text: str) -> Optional[int]:
        index = text.find(self.start_marker)
        return index if index >= 0 else None

    def hold(self, text: str) -> int:
        for size in range(min(len(self.start_marker) - 1, len(text)), 0, -1):
            if self.start_marker.startswith(text[-size:]):
                return size
        return 0


def _call(obj, arguments_key: str = "arguments") -> tuple[str, str]:
    """(name, arguments JSON) of a parsed call object; ValueError when it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        raise ValueError("a call must be an object with a string name")
    arguments = obj.get(arguments_key, {})
    if not isinstance(arguments, dict):
        raise ValueError("a call's arguments must be an object")
    return obj["name"], json.dumps(arguments, ensure_ascii=False)


class HermesToolParser(ToolParser):
    """Hermes / Qwen2.5 / Qwen3: each call is `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (JSON
    between the tags, whitespace around it allowed); content may come before, between and after the calls. The
    last call may lack its closing tag (the model stopped on EOS right after the JSON)."""

    start_marker = "<tool_call>"
    _BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)

    def extract(self, text):
        if self.tool_start(text) is None:
            return text, []
        try:
            calls = [_call(json.loads(m.group(1))) for m in self._BLOCK.finditer(text)]
        except ValueError:
            return text, []
        return self._BLOCK.sub("", text), calls


class Llama3JsonToolParser(ToolParser):
    """Llama 3.1 / 3.2 JSON tool calling: the whole output is one JSON object `{"name": ..., "parameters":
    {...}}` (optionally after `<|python_tag|>`), or several separated by `;`. Anything else is content."""

    _PREFIX = "<|python_tag|>"

    def tool_start(self, text):
        stripped = text.lstrip()
        body = stripped[len(self._PREFIX):] if stripped.startswith(self._PREFIX) else stripped
        return 0 if body.lstrip().startswith("{") else None

    def hold(self, text):
        stripped = text.lstrip()
        # all of it while it is blank or may still become the prefix / a leading "{"
        return len(text) if not stripped or self._PREFIX.startswith(stripped) or \
            (stripped.startswith(self._PREFIX) and not stripped[len(self._PREFIX):].strip()) else 0

    def extract(self, text):
        if self.tool_start(text) is None:
            return text, []
        body = text.strip()
        body = body[len(self._PREFIX):] if body.startswith(self._PREFIX) else body
        try:
            calls = [_call(json.loads(part), "parameters") for part in body.split(";") if part.strip()]
        except ValueError:
            return text, []
        return "", calls


class MistralToolParser(ToolParser):
    """Mistral: content, then `[TOOL_CALLS]` and a JSON array of `{"name": ..., "arguments": {...}}` as the rest
    of the output. (Mistral's tokenizer makes [TOOL_CALLS] a special token: such a model needs
    skip_special_tokens false for the marker to reach the text.)"""

    start_marker = "[TOOL_CALLS]"

    def extract(self, text):
        start = self.tool_start(text)
        if start is None:
            return text, []
        try:
            array = json.loads(text[start + len(self.start_marker):])
            calls = [_call(obj) for obj in (array if isinstance(array, list) else [array])]
        except ValueError:
            return text, []
        return text[:start], calls


TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
    "mistral": MistralToolParser,
}


@dataclass
class AutoToolCalls:
    """tool_choice "auto" with a parser: content and calls are read from free text. With parallel_tool_calls
    false only the first call is returned (the model cannot be held to one without a constraint)."""

    parser: ToolParser
    parallel: bool

    def message(self, text: str) -> tuple[Optional[str], list[ToolCall]]:
        content, calls = self.parser.extract(text)
        calls = calls if self.parallel else calls[:1]
        return content or None, [ToolCall(id=new_call_id(), function=FunctionCall(name=n, arguments=a))
                                 for n, a in calls]

    def stream(self) -> AutoToolCallStream:
        return AutoToolCallStream(self)


@dataclass
class AutoToolCallStream:
    """One streamed choice under tool_choice "auto": content streams as it comes, except trailing characters
    that may begin a start marker; from the first start marker on, the text is buffered and read at the end
    (`finish`), which sends the rest of the content and each call whole (id, type, name and all its arguments).
    The streamed content and calls are exactly the non-streamed ones."""

    mode: AutoToolCalls
    text: str = ""
    sent: int = 0  # characters of content sent
    in_call: bool = False
    called: bool = False

    def feed(self, delta: str) -> tuple[str, list[DeltaToolCall]]:
        self.text += delta
        if not self.in_call:
            start = self.mode.parser.tool_start(self.text)
            self.in_call = start is not None
            end = start if start is not None else len(self.text) - self.mode.parser.hold(self.text)
            if end > self.sent:
                piece, self.sent = self.text[self.sent:end], end
                return piece, []
        return "", []

    def finish(self) -> tuple[str, list[DeltaToolCall]]:
        content, calls = self.mode.message(self.text)
        content = content or ""
        self.called = bool(calls)
        fragments = [DeltaToolCall(index=i, id=c.id, type="function",
                                   function=DeltaFunctionCall(name=c.function.name, arguments=c.function.arguments))
                     for i, c in enumerate(calls)]
        return content[self.sent:], fragments

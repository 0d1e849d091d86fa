"""The OpenAI (and vLLM-extension) wire protocol as msgspec Structs.

Requests are decoded with msgspec: unknown fields are ignored (as OpenAI does), wrong types and values outside the
`Meta` bounds are a 400 naming the field. Responses are encoded from the same kind of Structs, and /openapi.json is
generated from all of them, so the document states exactly the bounds the decoder enforces.

Bounds that depend on the model or the server (the vocabulary, max_model_len, --max-logprobs) are marked with `MODEL_BOUND` in the JSON schema;
`openapi.py` fills them in when the app is created, and the server checks them after decoding (the engine's
`check_prompt`, `SamplingParams.validate_for_model`, the /detokenize handler). Rules between fields that JSON
Schema can state (one of prompt or messages; top_logprobs needs logprobs) are `BODY_RULES`, checked in inputs.py
and the handlers. Two rules it cannot state (they count the prompt's tokens, or compare two numbers) are in the
fields' descriptions and answered with a 400 that says so: prompt + max_tokens within max_model_len (code
"context_length_exceeded"), min_tokens <= max_tokens. The single-field bounds repeat SamplingParams' own (the
engine's contract for embedding callers), so an API request never reaches the engine with a value it refuses.

Conventions:
- `Optional[X] = None` request fields mean "not given"; the server applies OpenAI's defaults.
- Response fields that OpenAI sends as `null` are plain `Optional` (always present). Fields that OpenAI omits
  unless asked for (`usage` in stream chunks) default to `msgspec.UNSET`, which msgspec never encodes.
- `DeltaMessage` omits its unset fields, so a content delta is `{"content": "..."}` and a finish delta is `{}`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Optional, Union

import msgspec
from msgspec import UNSET, Meta, Struct, UnsetType

# --------------------------------------------------------------------------------------------------------------
# Bounded values (the decoder enforces them; the document publishes them)
# --------------------------------------------------------------------------------------------------------------

MODEL_BOUND = "x-model-bound"
"""A JSON-schema key naming a bound that openapi.py fills in from the model: "token_id" (maximum: vocab_size - 1),
"token_id_key" (a decimal token id as an object key below vocab_size), "output_tokens" (maximum: max_model_len - 1),
"prompt_tokens" (maxItems: max_model_len - 1)."""

SCHEMA_OVERRIDE = "x-schema"
"""A JSON-schema key whose value replaces the schema msgspec generates (which for a union cannot say which list
shapes are allowed); openapi.py applies it."""

MAX_SEED = 2**63 - 1
MAX_BATCH_PROMPTS = 1024  # prompts in one /v1/completions request
MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 16

TokenId = Annotated[int, Meta(ge=0, extra_json_schema={MODEL_BOUND: "token_id"})]
TokenIdKey = Annotated[str, Meta(pattern="^(0|[1-9][0-9]*)$", extra_json_schema={MODEL_BOUND: "token_id_key"})]
OutputTokens = Annotated[int, Meta(ge=1, extra_json_schema={MODEL_BOUND: "output_tokens"})]
PromptTokenIds = Annotated[list[TokenId], Meta(min_length=1, extra_json_schema={MODEL_BOUND: "prompt_tokens"})]
StopString = Annotated[str, Meta(min_length=1)]
NonEmptyText = Annotated[str, Meta(min_length=1)]
Logprobs = Annotated[int, Meta(ge=0, le=MAX_LOGPROBS, extra_json_schema={MODEL_BOUND: "logprobs"})]  # --max-logprobs
Penalty = Annotated[float, Meta(ge=-2.0, le=2.0)]

# --------------------------------------------------------------------------------------------------------------
# Requests
# --------------------------------------------------------------------------------------------------------------


class StreamOptions(Struct, kw_only=True):
    include_usage: bool = False


class _GenerationRequest(Struct, kw_only=True):
    """Fields shared by /v1/completions and /v1/chat/completions (OpenAI's, then vLLM's extras)."""

    model: Optional[str] = None
    n: Annotated[int, Meta(ge=1, le=128)] = 1
    temperature: Optional[Annotated[float, Meta(ge=0.0, le=100.0)]] = None
    top_p: Optional[Annotated[float, Meta(gt=0.0, le=1.0)]] = None
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    stop: Union[StopString, Annotated[list[StopString], Meta(max_length=MAX_STOP_STRINGS)], None] = None
    seed: Optional[Annotated[int, Meta(ge=-MAX_SEED, le=MAX_SEED)]] = None
    logit_bias: Optional[dict[TokenIdKey, Annotated[float, Meta(ge=-100.0, le=100.0)]]] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    user: Optional[str] = None
    # vLLM extensions
    top_k: Optional[Annotated[int, Meta(ge=-1, description="-1 or 0: all tokens")]] = None
    min_p: Optional[Annotated[float, Meta(ge=0.0, le=1.0)]] = None
    repetition_penalty: Optional[Annotated[float, Meta(gt=0.0, le=10.0)]] = None
    min_tokens: Annotated[int, Meta(ge=0, description="at most max_tokens (400 otherwise)")] = 0
    ignore_eos: bool = False
    stop_token_ids: Optional[list[TokenId]] = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # structured outputs (see the block "Structured outputs" below)
    response_format: Optional[ResponseFormat] = None
    structured_outputs: Optional[StructuredOutputsRequest] = None


# --------------------------------------------------------------------------------------------------------------
# Structured outputs: OpenAI's response_format and vLLM's structured_outputs extra body
# --------------------------------------------------------------------------------------------------------------


class JsonSchemaFormat(Struct, kw_only=True):
    """OpenAI's response_format.json_schema. The output is always constrained to `schema` (strict or not)."""

    name: str
    description: Optional[str] = None
    schema: Optional[dict[str, Any]] = None
    strict: Optional[bool] = None


class ResponseFormat(Struct, kw_only=True):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JsonSchemaFormat] = None


class StructuredOutputsRequest(Struct, kw_only=True):
    """vLLM's structured_outputs: exactly one of json (a schema), regex, choice, grammar (EBNF), json_object."""

    json: Union[dict[str, Any], str, None] = None  # a string must hold JSON: checked after decoding
    regex: Optional[NonEmptyText] = None
    choice: Optional[Annotated[list[NonEmptyText], Meta(min_length=1)]] = None
    grammar: Optional[NonEmptyText] = None
    json_object: Optional[bool] = None
    disable_any_whitespace: Optional[bool] = None  # default: compact JSON (see SamplingParams' StructuredOutputsParams)


# --------------------------------------------------------------------------------------------------------------
# Tool calling (requests: tools, tool_choice; responses: message.tool_calls, delta.tool_calls). See tool_calls.py.
# --------------------------------------------------------------------------------------------------------------


class FunctionDefinition(Struct, kw_only=True):
    name: str
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None  # a JSON schema of an object; None: no arguments
    strict: Optional[bool] = None  # the arguments are always constrained to `parameters` when a call is forced


class ChatCompletionTool(Struct, kw_only=True):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(Struct, kw_only=True):
    name: str


class NamedToolChoice(Struct, kw_only=True):
    """tool_choice {"type": "function", "function": {"name": ...}}: exactly one call of that function."""

    type: Literal["function"] = "function"
    function: NamedFunction


class FunctionCall(Struct, kw_only=True):
    name: str
    arguments: str  # JSON text, exactly as the model wrote it


class ToolCall(Struct, kw_only=True):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class DeltaFunctionCall(Struct, kw_only=True, omit_defaults=True):
    name: Optional[str] = None
    arguments: Optional[str] = None


class DeltaToolCall(Struct, kw_only=True, omit_defaults=True):
    """One fragment of a streamed call: the first has id, type and function.name; later ones argument pieces."""

    index: int
    id: Optional[str] = None
    type: Optional[Literal["function"]] = None
    function: Optional[DeltaFunctionCall] = None


# A completions prompt: a string, a list of strings (a batch), a list of token ids, or a list of token-id lists.
# msgspec allows one array type per union, so it decodes the list's items as a union and inputs.py checks that
# the list is one of the four shapes; the schema states the four shapes.
_PROMPT_SHAPES = [
    {"type": "string"},
    {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": MAX_BATCH_PROMPTS},
    msgspec.json.schema(PromptTokenIds),
    {"type": "array", "items": msgspec.json.schema(PromptTokenIds), "minItems": 1, "maxItems": MAX_BATCH_PROMPTS},
]
PromptInput = Annotated[Union[str, list[Union[str, TokenId, list[TokenId]]]],
                        Meta(extra_json_schema={SCHEMA_OVERRIDE: {"anyOf": _PROMPT_SHAPES}})]


class CompletionRequest(_GenerationRequest, kw_only=True):
    prompt: PromptInput
    max_tokens: Optional[OutputTokens] = 16  # null: the rest of max_model_len
    logprobs: Optional[Logprobs] = None
    echo: bool = False
    best_of: Optional[Annotated[int, Meta(ge=1, le=1, description="only 1: like vLLM's V1 engine, no best-of")]] = None
    suffix: None = None  # not supported: only null is accepted


class ContentPart(Struct, kw_only=True):
    type: Literal["text"]
    text: str


class ChatMessageParam(Struct, kw_only=True):
    role: Literal["system", "user", "assistant", "tool"]
    content: Union[str, list[ContentPart], None] = None
    name: Optional[str] = None
    tool_calls: Optional[list[ToolCall]] = None  # an assistant's calls (content may then be null)
    tool_call_id: Optional[str] = None  # a "tool" message: the call it answers


class ChatCompletionRequest(_GenerationRequest, kw_only=True):
    messages: Annotated[list[ChatMessageParam], Meta(min_length=1)]
    max_tokens: Optional[OutputTokens] = None  # deprecated by OpenAI in favour of max_completion_tokens
    max_completion_tokens: Optional[OutputTokens] = None
    logprobs: bool = False
    top_logprobs: Optional[Logprobs] = None
    # vLLM extensions
    add_generation_prompt: bool = True
    chat_template_kwargs: Optional[dict[str, Any]] = None
    # tool calling (see the block "Tool calling" below)
    tools: Optional[list[ChatCompletionTool]] = None
    tool_choice: Union[Literal["none", "auto", "required"], NamedToolChoice, None] = None
    parallel_tool_calls: Optional[bool] = None


class TokenizeRequest(Struct, kw_only=True):
    """vLLM's /tokenize: exactly one of `prompt` (completions style) or `messages` (chat style)."""

    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Optional[Annotated[list[ChatMessageParam], Meta(min_length=1)]] = None
    tools: Optional[list[ChatCompletionTool]] = None  # rendered by the chat template, as in chat requests
    add_special_tokens: Optional[bool] = None  # default: True for prompt, False for messages
    add_generation_prompt: bool = True
    chat_template_kwargs: Optional[dict[str, Any]] = None
    return_token_strs: bool = False


class DetokenizeRequest(Struct, kw_only=True):
    model: Optional[str] = None
    tokens: list[TokenId]


# Rules between fields of a request body, in JSON Schema (the server checks each one where named).
# StructuredOutputsParams (sampling_params.py): exactly one kind of constraint set (not null, not false).
_ONE_CONSTRAINT = {"anyOf": [{"type": "null"}, {
    "oneOf": [{"required": [kind], "properties": {kind: {"not": {"enum": [None, False]}}}}
              for kind in ("json", "regex", "choice", "grammar", "json_object")],
    "properties": {"choice": {"anyOf": [{"type": "null"}, {"type": "array", "minItems": 1,
                                                          "items": {"type": "string", "minLength": 1}}]}}}]}
# SamplingParams: a constraint ends the output with EOS, so it excludes min_tokens and ignore_eos.
_CONSTRAINED = {"anyOf": [
    {"required": ["structured_outputs"], "properties": {"structured_outputs": {"type": "object"}}},
    {"required": ["response_format"], "properties": {"response_format": {
        "type": "object", "required": ["type"], "properties": {"type": {"enum": ["json_object", "json_schema"]}}}}}]}
# structured_outputs(): json_schema needs its schema; response_format or structured_outputs, not both.
_FORMAT = {"anyOf": [{"type": "null"}, {
    "if": {"properties": {"type": {"const": "json_schema"}}},
    "then": {"required": ["json_schema"], "properties": {"json_schema": {
        "type": "object", "required": ["schema"], "properties": {"schema": {"type": "object"}}}}}}]}
_ONE_WAY = {"not": {"allOf": _CONSTRAINED["anyOf"]}}
# tool_call_mode(): tool_choice other than "none" needs tools; with tools it must be "none", "required" or a named
# function ("auto" needs --enable-auto-tool-choice, a per-server setting).
_TOOL_CHOICE = {
    "if": {"required": ["tools"], "properties": {"tools": {"type": "array", "minItems": 1}}},
    "then": {"required": ["tool_choice"], "properties": {"tool_choice": {
        "anyOf": [{"enum": ["none", "required"]}, {"type": "object"}]}}},
    "else": {"properties": {"tool_choice": {"anyOf": [{"const": "none"}, {"type": "null"}]}}}}
_NO_EOS_SUPPRESSION = {"properties": {"min_tokens": {"const": 0}, "ignore_eos": {"const": False}}}
_EOS_FREE = {"if": _CONSTRAINED, "then": _NO_EOS_SUPPRESSION}
# tool_call_mode(): a forced call ("required" or a named function, with tools) is constrained output too.
_FORCED_CALL = {"required": ["tools", "tool_choice"], "properties": {
    "tools": {"type": "array", "minItems": 1}, "tool_choice": {"anyOf": [{"const": "required"}, {"type": "object"}]}}}
_CHAT_EOS_FREE = {"if": {"anyOf": [*_CONSTRAINED["anyOf"], _FORCED_CALL]}, "then": _NO_EOS_SUPPRESSION}
BODY_RULES: dict[type, dict] = {
    # completion_params(): prompt logprobs are not computed
    CompletionRequest: {"not": {"required": ["echo", "logprobs"],
                                "properties": {"echo": {"const": True}, "logprobs": {"type": "integer"}}},
                        "properties": {"structured_outputs": _ONE_CONSTRAINT, "response_format": _FORMAT},
                        "allOf": [_EOS_FREE, _ONE_WAY],
                        "description": "echo cannot be combined with logprobs; one structured-output constraint"},
    # chat_params(), tool_calls.tool_call_mode()
    ChatCompletionRequest: {
        "if": {"required": ["top_logprobs"], "properties": {"top_logprobs": {"type": "integer"}}},
        "then": {"required": ["logprobs"], "properties": {"logprobs": {"const": True}}},
        "properties": {"structured_outputs": _ONE_CONSTRAINT, "response_format": _FORMAT},
        "allOf": [_CHAT_EOS_FREE, _ONE_WAY, _TOOL_CHOICE],
        "description": "top_logprobs needs logprobs: true; tool_choice needs tools, and with tools it must be given "
                       "(\"auto\", its default, needs a server started with --enable-auto-tool-choice), a named "
                       "function must be one of the tools, and a forced call excludes a structured-output "
                       "constraint; a constrained output (a structured-output constraint or a forced call) ends "
                       "with EOS, so it excludes min_tokens and ignore_eos"},
    # Routes.tokenize()
    TokenizeRequest: {"oneOf": [{"required": ["prompt"], "properties": {"prompt": {"type": "string"}}},
                                {"required": ["messages"], "properties": {"messages": {"type": "array"}}}],
                      "description": "exactly one of prompt or messages"},
}


class WebSocketEnvelope(Struct, kw_only=True):
    """What the WebSocket handler reads first from each client message, to route it."""

    type: Optional[str] = None  # "completion" | "chat.completion" | "cancel"; None: routed by `messages`
    id: Union[str, int, None] = None
    messages: msgspec.Raw = msgspec.Raw()  # left undecoded; empty when absent


# --------------------------------------------------------------------------------------------------------------
# Responses
# --------------------------------------------------------------------------------------------------------------


class UsageInfo(Struct, kw_only=True):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(Struct, kw_only=True):
    text_offset: list[int]
    token_logprobs: list[Optional[float]]
    tokens: list[str]
    top_logprobs: list[Optional[dict[str, float]]]


class CompletionChoice(Struct, kw_only=True):
    index: int
    text: str
    logprobs: Optional[CompletionLogprobs] = None
    finish_reason: Optional[str] = None  # "stop" | "length" | "abort"
    stop_reason: Union[int, str, None] = None  # vLLM: the stop string or token id that ended the choice


class CompletionResponse(Struct, kw_only=True):
    """A completion, and (same shape, as OpenAI streams it) one streamed chunk of one."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Union[UsageInfo, None, UnsetType] = UNSET
    system_fingerprint: Optional[str] = None


class TopLogprob(Struct, kw_only=True):
    token: str
    logprob: float
    bytes: Optional[list[int]] = None


class ChatLogprobToken(Struct, kw_only=True):
    token: str
    logprob: float
    bytes: Optional[list[int]] = None
    top_logprobs: list[TopLogprob] = []


class ChatLogprobs(Struct, kw_only=True):
    content: Optional[list[ChatLogprobToken]] = None
    refusal: Optional[list[ChatLogprobToken]] = None


class ChatMessage(Struct, kw_only=True):
    role: str = "assistant"
    content: Optional[str] = None
    refusal: Optional[str] = None
    tool_calls: Union[list[ToolCall], UnsetType] = UNSET  # sent only when the model called tools
    reasoning_content: Union[str, None, UnsetType] = UNSET  # sent only by a server with --reasoning-parser


class ChatChoice(Struct, kw_only=True):
    index: int
    message: ChatMessage
    logprobs: Optional[ChatLogprobs] = None
    finish_reason: Optional[str] = None
    stop_reason: Union[int, str, None] = None


class ChatCompletionResponse(Struct, kw_only=True):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    system_fingerprint: Optional[str] = None


class DeltaMessage(Struct, kw_only=True, omit_defaults=True):
    role: Optional[str] = None
    content: Optional[str] = None
    tool_calls: Optional[list[DeltaToolCall]] = None
    reasoning_content: Optional[str] = None


class ChatChunkChoice(Struct, kw_only=True):
    index: int
    delta: DeltaMessage
    logprobs: Optional[ChatLogprobs] = None
    finish_reason: Optional[str] = None


class ChatCompletionChunk(Struct, kw_only=True):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Union[UsageInfo, None, UnsetType] = UNSET
    system_fingerprint: Optional[str] = None


class ModelCard(Struct, kw_only=True):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "asyncengine"
    root: Optional[str] = None
    max_model_len: Optional[int] = None


class ModelList(Struct, kw_only=True):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(Struct, kw_only=True):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: Optional[list[str]] = None


class DetokenizeResponse(Struct, kw_only=True):
    prompt: str


class VersionResponse(Struct, kw_only=True):
    version: str


class ErrorInfo(Struct, kw_only=True):
    message: str
    type: str
    param: Optional[str] = None
    code: Union[str, int, None] = None


class ErrorResponse(Struct, kw_only=True):
    error: ErrorInfo


class WebSocketDone(Struct, kw_only=True):
    """Sent once per WebSocket request, after its last chunk (or its error)."""

    id: Union[str, int, None]
    type: Literal["done"] = "done"


class WebSocketError(Struct, kw_only=True):
    """An error for one WebSocket request (the socket stays open)."""

    id: Union[str, int, None]
    error: ErrorInfo
    type: Literal["error"] = "error"


REQUEST_TYPES = (CompletionRequest, ChatCompletionRequest, TokenizeRequest, DetokenizeRequest)
RESPONSE_TYPES = (
    CompletionResponse,
    ChatCompletionResponse,
    ChatCompletionChunk,
    ModelList,
    TokenizeResponse,
    DetokenizeResponse,
    VersionResponse,
    ErrorResponse,
    WebSocketDone,
    WebSocketError,
)

encoder = msgspec.json.Encoder()
_decoders: dict[type, msgspec.json.Decoder] = {}


def decode_body(data: bytes, kind: type):
    """`data` (JSON) decoded and validated as the request Struct `kind`; msgspec errors propagate.

    JSON Schema counts 3.0 as an integer, and vLLM (pydantic) accepts it, so a body refused for a float where an
    int belongs is decoded again with its integral floats as ints (floats are still refused where they are not
    whole; float fields take ints anyway). Only that rare path pays for the second pass."""
    decoder = _decoders.get(kind)
    if decoder is None:
        decoder = _decoders[kind] = msgspec.json.Decoder(kind)
    try:
        return decoder.decode(data)
    except msgspec.ValidationError as exc:
        if "got `float`" not in str(exc):
            raise
    return msgspec.convert(_whole_floats_as_ints(msgspec.json.decode(data)), kind)


def _whole_floats_as_ints(value):
    if isinstance(value, float):
        return int(value) if value.is_integer() else value
    if isinstance(value, list):
        return [_whole_floats_as_ints(item) for item in value]
    if isinstance(value, dict):
        return {key: _whole_floats_as_ints(item) for key, item in value.items()}
    return value

"""The OpenAI (and vLLM-extension) wire protocol as msgspec Structs.

Requests are decoded with msgspec: unknown fields are ignored (as OpenAI does), wrong types are a 400 naming the
field. Responses are encoded from the same kind of Structs, and /openapi.json is generated from all of them.

Conventions:
- `Optional[X] = None` request fields mean "not given"; the server applies OpenAI's defaults.
- Response fields that OpenAI sends as `null` are plain `Optional` (always present). Fields that OpenAI omits
  unless asked for (`usage` in stream chunks) default to `msgspec.UNSET`, which msgspec never encodes.
- `DeltaMessage` omits its unset fields, so a content delta is `{"content": "..."}` and a finish delta is `{}`.
"""

from __future__ import annotations

from typing import Any, Literal, Optional, Union

import msgspec
from msgspec import UNSET, Struct, UnsetType

# --------------------------------------------------------------------------------------------------------------
# Requests
# --------------------------------------------------------------------------------------------------------------


class StreamOptions(Struct, kw_only=True):
    include_usage: bool = False


class _GenerationRequest(Struct, kw_only=True):
    """Fields shared by /v1/completions and /v1/chat/completions (OpenAI's, then vLLM's extras)."""

    model: Optional[str] = None
    n: int = 1
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stop: Union[str, list[str], None] = None
    seed: Optional[int] = None
    logit_bias: Optional[dict[str, float]] = None  # token id (as a string) -> bias in [-100, 100]
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    user: Optional[str] = None
    # vLLM extensions
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    repetition_penalty: Optional[float] = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: Optional[list[int]] = None
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

    json: Union[dict[str, Any], str, None] = None
    regex: Optional[str] = None
    choice: Optional[list[str]] = None
    grammar: Optional[str] = None
    json_object: Optional[bool] = None
    disable_any_whitespace: Optional[bool] = None  # default: compact JSON (see SamplingParams' StructuredOutputsParams)


# A completions prompt: a string, a list of strings (a batch), a list of token ids, or a list of token-id lists.
# msgspec allows one array type per union, so the list's items are a union checked further in inputs.py.
PromptInput = Union[str, list[Union[str, int, list[int]]]]


class CompletionRequest(_GenerationRequest, kw_only=True):
    prompt: PromptInput
    max_tokens: Optional[int] = 16
    logprobs: Optional[int] = None
    echo: bool = False
    best_of: Optional[int] = None
    suffix: Optional[str] = None


class ContentPart(Struct, kw_only=True):
    type: str
    text: Optional[str] = None


class ChatMessageParam(Struct, kw_only=True):
    role: str
    content: Union[str, list[ContentPart], None] = None
    name: Optional[str] = None


class ChatCompletionRequest(_GenerationRequest, kw_only=True):
    messages: list[ChatMessageParam]
    max_tokens: Optional[int] = None  # deprecated by OpenAI in favour of max_completion_tokens
    max_completion_tokens: Optional[int] = None
    logprobs: bool = False
    top_logprobs: Optional[int] = None
    # vLLM extensions
    add_generation_prompt: bool = True
    chat_template_kwargs: Optional[dict[str, Any]] = None
    # tool calling (not supported yet: a request with tools is a 400, never a silent ignore)
    tools: Optional[list[dict[str, Any]]] = None
    tool_choice: Union[str, dict[str, Any], None] = None
    parallel_tool_calls: Optional[bool] = None


class TokenizeRequest(Struct, kw_only=True):
    """vLLM's /tokenize: exactly one of `prompt` (completions style) or `messages` (chat style)."""

    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Optional[list[ChatMessageParam]] = None
    add_special_tokens: Optional[bool] = None  # default: True for prompt, False for messages
    add_generation_prompt: bool = True
    chat_template_kwargs: Optional[dict[str, Any]] = None
    return_token_strs: bool = False


class DetokenizeRequest(Struct, kw_only=True):
    model: Optional[str] = None
    tokens: list[int]


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

"""Turning a decoded request into what the engine takes: prompts (token ids) and SamplingParams.

Contract: every function here either returns engine inputs or raises APIError(400) naming the offending field;
nothing is added to the engine yet. SamplingParams' own ValueErrors name their field first ("top_k must be ..."),
which becomes the error's `param`. Bounds on single fields are already enforced by the decoder (protocol.py's
`Meta`); what is checked here is what msgspec cannot: the prompt's shape and the rules between fields
(protocol.BODY_RULES states those that JSON Schema can).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Union

import msgspec

from asyncengine.api.errors import APIError, bad_request, from_engine_error
from asyncengine.api.protocol import (
    MAX_BATCH_PROMPTS, MAX_LOGPROBS, ChatCompletionRequest, ChatCompletionTool, ChatMessageParam, CompletionRequest,
    ToolCall,
)
from asyncengine.async_engine import AsyncLLMEngine
from asyncengine.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams

MAX_TOP_LOGPROBS = MAX_LOGPROBS  # what the engine returns at most

# SamplingParams fields; a ValueError starting with one of these names it as the error's `param`.
PARAM_FIELDS = (
    "n", "temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty",
    "seed", "stop", "stop_token_ids", "max_tokens", "min_tokens", "logprobs", "logit_bias", "prompt", "ignore_eos",
    "structured_outputs", "structured_outputs.json", "structured_outputs.regex", "structured_outputs.choice",
    "structured_outputs.grammar", "structured_outputs.json_object",
)
CHAT_RENAMES = {"logprobs": "top_logprobs", "prompt": "messages"}
# chat_template_kwargs may not override how the template is called, only feed it variables.
_RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "tools", "documents", "chat_template", "add_generation_prompt", "continue_final_message",
    "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict", "tokenizer_kwargs",
    "return_assistant_tokens_mask",
})


# generation_config.json fields that become request defaults (vLLM's list); max_new_tokens is max_tokens
GENERATION_CONFIG_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_new_tokens")


@dataclass
class SamplingPolicy:
    """The server's values for sampling fields a request leaves unset, and its cap on logprobs.

    `defaults` maps SamplingParams field names (temperature, top_p, top_k, min_p, repetition_penalty, max_tokens)
    to values; a request's own value always wins. A default max_tokens is cut to what the longest prompt leaves
    of max_model_len (as vLLM does), so it never turns a request that fits into a 400. max_logprobs: most
    `logprobs` (completions) or `top_logprobs` (chat) a request may ask for; more gets a 400."""

    defaults: dict = field(default_factory=dict)
    max_logprobs: int = MAX_TOP_LOGPROBS

    def __post_init__(self) -> None:
        if self.max_logprobs == -1:  # vLLM's "no cap": the engine's own limit is the only one
            self.max_logprobs = MAX_TOP_LOGPROBS
        if not 0 <= self.max_logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"max_logprobs must be in [0, {MAX_TOP_LOGPROBS}] or -1 (the engine returns at most "
                             f"{MAX_TOP_LOGPROBS}), got {self.max_logprobs}")
        try:  # bad defaults fail at startup, not as a puzzling 400 on every request
            SamplingParams(**self.defaults)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"generation_config: the defaults {self.defaults} are not valid: {exc}") from None

    @classmethod
    def from_generation_config(cls, generation_config: str, model_path: str,
                               max_logprobs: int = MAX_TOP_LOGPROBS) -> "SamplingPolicy":
        """vLLM's --generation-config: 'auto' takes the defaults from the model folder's generation_config.json
        (if it has one), 'vllm' ignores it, any other value names a folder holding one. Only the fields the file
        sets to something other than transformers' defaults count (GenerationConfig.to_diff_dict, as in vLLM)."""
        if generation_config == "vllm":
            return cls(max_logprobs=max_logprobs)
        folder = Path(model_path if generation_config == "auto" else generation_config)
        if generation_config != "auto" and not (folder / "generation_config.json").is_file():
            raise ValueError(f"generation_config must be 'auto', 'vllm' or a folder with a generation_config.json; "
                             f"{generation_config!r} is none of these")
        if not (folder / "generation_config.json").is_file():
            return cls(max_logprobs=max_logprobs)
        from transformers import GenerationConfig

        try:
            diff = GenerationConfig.from_pretrained(str(folder), local_files_only=True).to_diff_dict()
        except Exception as exc:  # noqa: BLE001 - transformers raises many kinds; name the file and the cause
            raise ValueError(f"generation_config: cannot read {folder / 'generation_config.json'}: {exc}") from exc
        defaults = {("max_tokens" if k == "max_new_tokens" else k): diff[k]
                    for k in GENERATION_CONFIG_FIELDS if diff.get(k) is not None}
        return cls(defaults=defaults, max_logprobs=max_logprobs)

    def value(self, name: str, requested, fallback):
        """The request's value, else the server's default, else the engine's."""
        if requested is not None:
            return requested
        return self.defaults.get(name, fallback)

    def check_logprobs(self, requested: Optional[int], param: str) -> None:
        if requested is not None and requested > self.max_logprobs:
            raise bad_request(f"{param} must be at most {self.max_logprobs} on this server (--max-logprobs), "
                              f"got {requested}", param)

    def default_max_tokens(self, prompts: list["EnginePrompt"], max_model_len: int) -> Optional[int]:
        """The default max_tokens for a request that sets none, cut to the room the longest prompt leaves;
        None (the rest of max_model_len) when there is no default or no room."""
        default = self.defaults.get("max_tokens")
        if default is None:
            return None
        room = max_model_len - max(len(p.token_ids) for p in prompts)
        return min(default, room) if room >= 1 else None


@dataclass
class EnginePrompt:
    token_ids: list[int]
    text: Optional[str]  # the prompt as text (for echo); None when given as ids and not needed


def sampling_params(request: Union[CompletionRequest, ChatCompletionRequest], policy: SamplingPolicy, *,
                    max_tokens: Optional[int], logprobs: Optional[int], renames: Optional[dict] = None,
                    constraint: Optional[StructuredOutputsParams] = None) -> SamplingParams:
    """SamplingParams with output_kind DELTA (the server streams deltas; slow readers merge them); fields the
    request leaves unset take the policy's defaults. max_tokens None: filled in later (SamplingPolicy).
    constraint: the output's constraint when not the request's own (response_format / structured_outputs)."""
    try:
        return SamplingParams(
            n=request.n,
            temperature=policy.value("temperature", request.temperature, 1.0),
            top_p=policy.value("top_p", request.top_p, 1.0),
            top_k=policy.value("top_k", request.top_k, -1),
            min_p=policy.value("min_p", request.min_p, 0.0),
            presence_penalty=request.presence_penalty,
            frequency_penalty=request.frequency_penalty,
            repetition_penalty=policy.value("repetition_penalty", request.repetition_penalty, 1.0),
            seed=request.seed,
            stop=request.stop,
            stop_token_ids=request.stop_token_ids,
            include_stop_str_in_output=request.include_stop_str_in_output,
            ignore_eos=request.ignore_eos,
            max_tokens=max_tokens,
            min_tokens=request.min_tokens,
            logprobs=logprobs,
            logit_bias=_logit_bias(request.logit_bias),
            skip_special_tokens=request.skip_special_tokens,
            output_kind=RequestOutputKind.DELTA,
            structured_outputs=constraint if constraint is not None else structured_outputs(request),
        )
    except ValueError as exc:
        raise from_engine_error(exc, PARAM_FIELDS, {**structured_renames(request), **(renames or {})}) from exc


# -- structured outputs ---------------------------------------------------------------------------------------
def structured_outputs(request: Union[CompletionRequest, ChatCompletionRequest]) -> Optional[StructuredOutputsParams]:
    """The request's constraint, from OpenAI's response_format or vLLM's structured_outputs (not both); None for
    none or response_format {"type": "text"}. Raises ValueError naming the field (turned into a 400)."""
    fmt, body = request.response_format, request.structured_outputs
    if body is not None:
        if fmt is not None and fmt.type != "text":
            raise bad_request("give response_format or structured_outputs, not both", "structured_outputs")
        return StructuredOutputsParams(json=body.json, regex=body.regex, choice=body.choice, grammar=body.grammar,
                                       json_object=body.json_object,
                                       disable_any_whitespace=body.disable_any_whitespace)
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return StructuredOutputsParams(json_object=True)
    if fmt.json_schema is None or fmt.json_schema.schema is None:
        raise bad_request('response_format of type "json_schema" needs json_schema.schema', "response_format")
    return StructuredOutputsParams(json=fmt.json_schema.schema)


def structured_renames(request: Union[CompletionRequest, ChatCompletionRequest]) -> dict[str, str]:
    """Errors about the constraint name response_format when that is where it came from."""
    fmt = request.response_format
    if fmt is None or fmt.type == "text" or request.structured_outputs is not None:
        return {}
    return {name: "response_format" for name in PARAM_FIELDS if name.startswith("structured_outputs")}


def _logit_bias(bias: Optional[dict[str, float]]) -> Optional[dict[int, float]]:
    """Keys are decimal token ids (protocol.TokenIdKey); the engine checks them against the vocabulary."""
    return {int(key): value for key, value in bias.items()} if bias else None


# -- completions ----------------------------------------------------------------------------------------------
def completion_params(request: CompletionRequest, policy: SamplingPolicy) -> SamplingParams:
    if request.echo and request.logprobs is not None:
        raise bad_request("echo with logprobs is not supported (prompt logprobs are not computed)", "echo")
    policy.check_logprobs(request.logprobs, "logprobs")
    return sampling_params(request, policy, max_tokens=request.max_tokens, logprobs=request.logprobs)


def text_or_token_batch(raw, field: str, limit: int) -> list:
    """OpenAI's four input shapes (a string, a list of strings, a list of token ids, a list of token-id lists) as a
    list of strings or token-id lists; anything else, or more than `limit` items, is a 400 naming `field`."""
    if isinstance(raw, str):
        items: list = [raw]
    elif raw and all(isinstance(t, int) for t in raw):
        items = [list(raw)]
    elif raw and (all(isinstance(p, str) for p in raw) or all(isinstance(p, list) for p in raw)):
        items = list(raw)
    else:
        raise bad_request(f"{field} must be a string, a list of strings, a list of token ids or a list of such lists, "
                          "not empty and not mixed", field)
    if len(items) > limit:
        raise bad_request(f"at most {limit} {field}s per request, got {len(items)}", field)
    return items


async def completion_prompts(engine: AsyncLLMEngine, request: CompletionRequest) -> list[EnginePrompt]:
    """The request's prompts as token ids: a string, a batch of strings, token ids, or a batch of token ids."""
    items = text_or_token_batch(request.prompt, "prompt", MAX_BATCH_PROMPTS)
    prompts = []
    for item in items:
        if isinstance(item, str):
            prompts.append(EnginePrompt(await engine.tokenize(item), item))
        else:
            prompts.append(EnginePrompt(item, None))  # text decoded later, for echo, once the ids are validated
    return prompts


# -- chat -----------------------------------------------------------------------------------------------------
def chat_params(request: ChatCompletionRequest, policy: SamplingPolicy,
                constraint: Optional[StructuredOutputsParams] = None, extra_renames: Optional[dict] = None
                ) -> SamplingParams:
    """constraint: one that replaces the request's own (a forced tool call's, see tool_calls.py), errors about it
    renamed by extra_renames."""
    top = request.top_logprobs
    if top is not None and not request.logprobs:
        raise bad_request("top_logprobs requires logprobs to be true", "top_logprobs")
    policy.check_logprobs(top, "top_logprobs")
    max_tokens, renames = request.max_tokens, dict(CHAT_RENAMES)
    if request.max_completion_tokens is not None:
        max_tokens = request.max_completion_tokens
        renames["max_tokens"] = "max_completion_tokens"
    renames.update(extra_renames or {})
    logprobs = (top or 0) if request.logprobs else None
    return sampling_params(request, policy, max_tokens=max_tokens, logprobs=logprobs, renames=renames,
                           constraint=constraint)


def chat_messages(messages: list[ChatMessageParam]) -> list[dict]:
    """Messages as the chat template wants them; text content parts are joined by newlines (the decoder has
    already refused other parts and an empty list)."""
    out = []
    for message in messages:
        content = message.content
        if isinstance(content, list):
            content = "\n".join(part.text for part in content)
        entry = {"role": message.role, "content": content or ""}
        if message.name is not None:
            entry["name"] = message.name
        if message.tool_calls is not None:
            entry["tool_calls"] = [_template_call(call) for call in message.tool_calls]
        if message.tool_call_id is not None:
            entry["tool_call_id"] = message.tool_call_id
        out.append(entry)
    return out


def _template_call(call: ToolCall) -> dict:
    """A history call as chat templates expect it: OpenAI's shape with `arguments` parsed into an object (as
    transformers' templates and vLLM take it); arguments that are not JSON stay the string they are (templates
    such as Qwen's render a string as is; one that cannot is the template's 400)."""
    try:
        arguments = json.loads(call.function.arguments)
    except ValueError:
        arguments = call.function.arguments
    return {"id": call.id, "type": call.type, "function": {"name": call.function.name, "arguments": arguments}}


def template_tools(tools: Optional[list[ChatCompletionTool]]) -> Optional[list[dict]]:
    """The request's tools as the chat template's `tools` (OpenAI's JSON shape, fields not given left out);
    None when there are none."""
    if not tools:
        return None
    return [{"type": tool.type, "function": {key: value for key, value in msgspec.to_builtins(tool.function).items()
                                             if value is not None}} for tool in tools]


def template_kwargs(kwargs: Optional[dict]) -> dict:
    bad = sorted(set(kwargs or {}) & _RESERVED_TEMPLATE_KWARGS)
    if bad:
        raise bad_request(f"chat_template_kwargs may not set {', '.join(bad)}", "chat_template_kwargs")
    return dict(kwargs or {})


async def chat_prompt(engine: AsyncLLMEngine, messages: list[ChatMessageParam], add_generation_prompt: bool = True,
                      kwargs: Optional[dict] = None, add_special_tokens: bool = False,
                      chat_template: Optional[str] = None,
                      tools: Optional[list[ChatCompletionTool]] = None) -> EnginePrompt:
    """Render the chat template (the server's `chat_template` if given, else the tokenizer's; with `tools` when
    given, which a template may ignore) and tokenize it (the template adds BOS itself: by default no special
    tokens are added)."""
    template = {} if chat_template is None else {"chat_template": chat_template}
    kwargs = template_kwargs(kwargs)
    if tools:
        kwargs["tools"] = template_tools(tools)
    try:
        text = await engine.apply_chat_template(chat_messages(messages), add_generation_prompt, **kwargs,
                                                **template)
    except APIError:
        raise
    except ValueError as exc:
        raise bad_request(str(exc), "messages") from exc
    return EnginePrompt(await engine.tokenize(text, add_special_tokens=add_special_tokens), text)

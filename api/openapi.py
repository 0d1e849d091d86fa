"""The OpenAPI 3.1 document served at /openapi.json, generated from the protocol Structs the server decodes with.

The contract: every request the document allows is one the server accepts (unless it needs more room than
max_model_len leaves after the prompt, which depends on tokenization: 400 with the numbers), every request it
forbids is refused with a 4xx in OpenAI's error envelope, and every response has the documented status, media type
and shape. Schemathesis checks exactly that (tests/test_openapi_fuzz.py).

- Bounds: the msgspec `Meta` constraints of protocol.py, plus the model's bounds (`ModelLimits`), filled in where
  protocol.py marks them with `MODEL_BOUND`, and the rules between fields (`BODY_RULES`).
- Security: only when the server has an API key; then every operation but the public ones (/health) declares
  bearer auth.
- Streaming: a generation's 200 is `application/json`, or `text/event-stream` with `"stream": true`. As OpenAPI
  3.2 reads a sequential media type's schema (and Schemathesis does for 3.1), the schema is one event: its `data`
  is a JSON chunk (`contentSchema`; or an error envelope if the engine fails midway), then the literal `[DONE]`.
- The WebSocket /v1/ws: OpenAPI 3.1 has no WebSocket operation, so it is the top-level extension `x-websockets`
  (its description, and its client and server messages as references to the same component schemas). Not a GET
  path with a 101 response: that would promise that an HTTP GET succeeds, which it cannot without the upgrade
  handshake, and HTTP tools (client generators, fuzzers) would call it as plain HTTP (it answers 426).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Iterable, Optional

import msgspec

from asyncengine.api import protocol as p
from asyncengine.api import protocol_embeddings as pe

_REF = "#/components/schemas/{name}"


@dataclass(frozen=True)
class ModelLimits:
    """What the document's model-dependent bounds come from (known when the app is created)."""

    vocab_size: int  # token ids lie in [0, vocab_size)
    max_model_len: int  # prompt + generated tokens
    max_logprobs: int = p.MAX_LOGPROBS  # the server's --max-logprobs cap on logprobs / top_logprobs


def openapi_schema(limits: ModelLimits, *, api_key: bool = False, public_paths: Iterable[str] = (),
                   title: str = "asyncengine", version: str = "0", pooling_task: Optional[str] = None) -> dict:
    """The document for a server over a model with `limits`; `api_key`: whether the server requires one
    (then every path but `public_paths` declares bearer auth). pooling_task ("embed" / "score"; None: a model
    served to generate): a pooling server's document has its pooling routes instead of the generation ones."""
    bodies = [Annotated[kind, msgspec.Meta(extra_json_schema=p.BODY_RULES[kind])] if kind in p.BODY_RULES else kind
              for kind in p.REQUEST_TYPES]
    schemas, components = msgspec.json.schema_components(bodies + list(p.RESPONSE_TYPES), ref_template=_REF)
    body = dict(zip(p.REQUEST_TYPES, schemas))
    paths = _paths(body)
    if pooling_task is not None:
        paths = _pooling_server_paths(paths, components, pooling_task)
    if api_key:
        for path in public_paths:
            for operation in paths.get(path, {}).values():
                operation["security"] = []
        for path, item in paths.items():
            if path not in public_paths:
                for operation in item.values():
                    operation["responses"].update(_errors(401))
    document = {
        "openapi": "3.1.0",
        "info": {"title": title, "version": version,
                 "description": "OpenAI-compatible API (with vLLM's extensions) over one model."},
        "paths": paths,
        "components": {"schemas": components},
        "x-websockets": {"/v1/ws": _websocket()},
    }
    if pooling_task is not None:
        del document["x-websockets"]  # the WebSocket streams generations only
    if api_key:
        document["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
        document["security"] = [{"bearer": []}]
    return _resolve_markers(document, limits)


# -- paths ----------------------------------------------------------------------------------------------------
def _paths(body: dict) -> dict:
    return {
        "/v1/completions": _generation("Create a completion", body[p.CompletionRequest], p.CompletionResponse,
                                       p.CompletionResponse),
        "/v1/chat/completions": _generation("Create a chat completion", body[p.ChatCompletionRequest],
                                            p.ChatCompletionResponse, p.ChatCompletionChunk),
        "/tokenize": _post("Tokenize a prompt or chat messages", body[p.TokenizeRequest], p.TokenizeResponse,
                           errors=(400, 404, 413)),
        "/detokenize": _post("Detokenize token ids", body[p.DetokenizeRequest], p.DetokenizeResponse,
                             errors=(400, 404, 413)),
        "/v1/models": _get("List the served models", _json(_ref(p.ModelList))),
        "/version": _get("The server's version", _json(_ref(p.VersionResponse))),
        "/health": _get("200 (no body) while serving", {}, errors=(503,),
                        description="503 when the engine is dead or the server is shutting down"),
        "/metrics": _get("Prometheus metrics", {"content": {"text/plain": {"schema": {"type": "string"}}}}),
    }


def _ref(struct) -> dict:
    return {"$ref": _REF.format(name=struct.__name__)}


def _json(schema: dict) -> dict:
    return {"content": {"application/json": {"schema": schema}}}


def _errors(*statuses: int) -> dict:
    return {str(s): {"description": _ERROR_TEXT[s], **_json(_ref(p.ErrorResponse))} for s in statuses}


_ERROR_TEXT = {
    400: "invalid request (the message names the field in `param`)",
    401: "missing or wrong API key",
    404: "unknown model",
    413: "request body too large",
    429: "the waiting queue is full; retry later",
    503: "the engine is dead or the server is shutting down",
}


def _post(summary: str, request: dict, response, errors: tuple, stream=None) -> dict:
    ok = {"description": "OK", **_json(_ref(response))}
    if stream is not None:
        ok["content"]["text/event-stream"] = {"schema": _sse_event(stream)}
    return {"post": {
        "summary": summary,
        "requestBody": {"required": True, **_json(request)},
        "responses": {"200": ok, **_errors(*errors)},
    }}


def _sse_event(chunk) -> dict:
    """One server-sent event of a stream: `data: <chunk JSON>`, or `data: [DONE]` last."""
    payload = {"contentMediaType": "application/json", "contentSchema": {"anyOf": [_ref(chunk), _ref(p.ErrorResponse)]}}
    return {"type": "object", "required": ["data"],
            "properties": {"data": {"type": "string", "if": {"const": "[DONE]"}, "else": payload}},
            "description": "one event; the stream ends with `data: [DONE]`"}


def _generation(summary: str, request: dict, response, chunk) -> dict:
    return _post(summary + " (\"stream\": true: server-sent events)", request, response,
                 errors=(400, 404, 413, 429, 503), stream=chunk)


def _get(summary: str, ok: dict, errors: tuple = (), description: str = "") -> dict:
    operation = {"summary": summary, "responses": {"200": {"description": "OK", **ok}, **_errors(*errors)}}
    if description:
        operation["description"] = description
    return {"get": operation}


def _websocket() -> dict:
    cancel = {"type": "object", "required": ["type", "id"],
              "properties": {"type": {"const": "cancel"}, "id": {"type": ["string", "integer"]}}}
    return {
        "summary": "Many streamed completion and chat requests over one WebSocket connection",
        "description": "Send one JSON object per message: a completion or chat body with a client-chosen `id` (and "
                       "`\"type\": \"completion\"` or `\"chat.completion\"`; a body with `messages` is a chat "
                       "request), or a cancel. Every request streams: its chunks come back with `id` set, then "
                       "`{\"id\": ..., \"type\": \"done\"}`; an error for one request is "
                       "`{\"id\": ..., \"type\": \"error\", \"error\": {...}}` and the socket stays open. With an "
                       "API key, browsers may give it as `?api_key=`. A plain HTTP GET is answered 426.",
        "client": {"oneOf": [_ref(p.CompletionRequest), _ref(p.ChatCompletionRequest), cancel]},
        "server": {"oneOf": [_ref(p.CompletionResponse), _ref(p.ChatCompletionChunk), _ref(p.WebSocketDone),
                             _ref(p.WebSocketError)]},
    }


# -- a pooling server (embedding models, cross-encoders) -----------------------------------------------------
_GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")
_POOLING_ERRORS = (400, 404, 413, 429, 503)


def _pooling_server_paths(paths: dict, components: dict, task: str) -> dict:
    """`paths` without the generation routes (a pooling model refuses every body there), with the routes of
    `task`: /v1/embeddings ("embed"), or /score and /rerank, also under /v1 ("score"). Adds their schemas to
    `components`."""
    kinds = pe.POOLING_REQUEST_TYPES + pe.POOLING_RESPONSE_TYPES
    schemas, pooling_components = msgspec.json.schema_components(kinds, ref_template=_REF)
    clash = set(pooling_components) & set(components)
    if clash:
        raise ValueError(f"schema names defined twice: {sorted(clash)}")
    components.update(pooling_components)
    body = dict(zip(kinds, schemas))
    kept = {path: item for path, item in paths.items() if path not in _GENERATION_PATHS}
    if task == "embed":
        kept["/v1/embeddings"] = _post("Create embeddings", body[pe.EmbeddingRequest], pe.EmbeddingResponse,
                                       _POOLING_ERRORS)
        return kept
    for prefix in ("", "/v1"):
        kept[f"{prefix}/score"] = _post("Score text pairs with a cross-encoder (vLLM's /score)",
                                        body[pe.ScoreRequest], pe.ScoreResponse, _POOLING_ERRORS)
        kept[f"{prefix}/rerank"] = _post("Rank documents against a query with a cross-encoder (vLLM's /rerank)",
                                         body[pe.RerankRequest], pe.RerankResponse, _POOLING_ERRORS)
    return kept


# -- protocol.py's markers: shapes msgspec cannot state, the model's bounds -----------------------------------
def _resolve_markers(node, limits: ModelLimits):
    """Apply every `SCHEMA_OVERRIDE` and replace every `MODEL_BOUND` marker (see protocol.py) with the JSON-schema
    bound it names."""
    if isinstance(node, list):
        return [_resolve_markers(item, limits) for item in node]
    if not isinstance(node, dict):
        return node
    if p.SCHEMA_OVERRIDE in node:
        kept = {key: node[key] for key in ("title", "description", "default") if key in node}
        node = {**node[p.SCHEMA_OVERRIDE], **kept}
    out = {key: _resolve_markers(value, limits) for key, value in node.items() if key != p.MODEL_BOUND}
    bound = node.get(p.MODEL_BOUND)
    if bound == "token_id":
        out["maximum"] = limits.vocab_size - 1
    elif bound == "token_id_key":
        out["pattern"] = decimal_below_pattern(limits.vocab_size)
    elif bound == "output_tokens":
        out["maximum"] = limits.max_model_len - 1
    elif bound == "prompt_tokens":
        out["maxItems"] = limits.max_model_len - 1
    elif bound == "logprobs":
        out["maximum"] = limits.max_logprobs
    elif bound is not None:
        raise ValueError(f"unknown {p.MODEL_BOUND} {bound!r}")
    return out


def decimal_below_pattern(limit: int) -> str:
    """A regular expression matching exactly the decimal integers in [0, limit), without sign or leading zeros
    (how protocol.TokenIdKey writes a token id)."""
    if limit < 1:
        raise ValueError(f"limit must be at least 1, got {limit}")
    top = str(limit - 1)
    options = ["0"] if top != "0" else []
    if len(top) > 1:  # every number with fewer digits than `top`
        options.append("[1-9]" + (f"[0-9]{{0,{len(top) - 2}}}" if len(top) > 2 else ""))
    for i, digit in enumerate(top):  # same length as `top`: equal up to position i, then a smaller digit
        low, high = (1 if i == 0 else 0), int(digit) - 1
        if high >= low:
            rest = len(top) - i - 1
            options.append(top[:i] + (f"[{low}-{high}]" if high > low else str(low))
                           + {0: "", 1: "[0-9]"}.get(rest, f"[0-9]{{{rest}}}"))
    options.append(top)
    return "^(" + "|".join(options) + ")$"


"""The OpenAPI 3.1 document served at /openapi.json, generated from the protocol Structs."""

from __future__ import annotations

import msgspec

from asyncengine.api import protocol as p

_REF = "#/components/schemas/{name}"


def _ref(struct) -> dict:
    return {"$ref": _REF.format(name=struct.__name__)}


def _json(schema: dict) -> dict:
    return {"content": {"application/json": {"schema": schema}}}


def _errors(*statuses: int) -> dict:
    return {str(s): {"description": "error", **_json(_ref(p.ErrorResponse))} for s in statuses}


def _post(summary: str, request, response, stream=None) -> dict:
    ok = _json(_ref(response))
    if stream is not None:
        ok["content"]["text/event-stream"] = {"schema": {"type": "string"},
                                              "x-chunk-schema": _ref(stream)}
    return {"post": {
        "summary": summary,
        "requestBody": {"required": True, **_json(_ref(request))},
        "responses": {"200": {"description": "OK", **ok}, **_errors(400, 401, 404, 413, 429, 503)},
    }}


def _get(summary: str, response=None, content_type: str = "application/json") -> dict:
    ok: dict = {"description": "OK"}
    if response is not None:
        ok.update(_json(_ref(response)))
    elif content_type != "application/json":
        ok["content"] = {content_type: {"schema": {"type": "string"}}}
    return {"get": {"summary": summary, "responses": {"200": ok, **_errors(401, 503)}}}


def openapi_schema(title: str = "asyncengine", version: str = "0", root_path: str = "") -> dict:
    """The document; with a root_path (a proxy's prefix) it names that as the server URL, as FastAPI does."""
    _, components = msgspec.json.schema_components(p.REQUEST_TYPES + p.RESPONSE_TYPES, ref_template=_REF)
    paths = {
        "/v1/completions": _post("Create a completion (stream=true: SSE of chunks)", p.CompletionRequest,
                                 p.CompletionResponse, p.CompletionResponse),
        "/v1/chat/completions": _post("Create a chat completion (stream=true: SSE of chunks)",
                                      p.ChatCompletionRequest, p.ChatCompletionResponse, p.ChatCompletionChunk),
        "/tokenize": _post("Tokenize a prompt or chat messages", p.TokenizeRequest, p.TokenizeResponse),
        "/detokenize": _post("Detokenize token ids", p.DetokenizeRequest, p.DetokenizeResponse),
        "/v1/models": _get("List served models", p.ModelList),
        "/version": _get("Server version", p.VersionResponse),
        "/health": _get("200 when serving; 503 when the engine is dead or shutting down"),
        "/metrics": _get("Prometheus metrics", content_type="text/plain"),
    }
    servers = {"servers": [{"url": root_path}]} if root_path else {}
    return {
        "openapi": "3.1.0",
        **servers,
        "info": {"title": title, "version": version,
                 "description": "OpenAI-compatible API. WebSocket at /v1/ws: send completion or chat bodies "
                                "with a client-chosen `id`; chunks come back tagged with it."},
        "paths": paths,
        "components": {
            "schemas": components,
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
        "security": [{"bearer": []}],
    }

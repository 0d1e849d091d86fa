"""Errors in OpenAI's envelope: {"error": {"message", "type", "param", "code"}}.

Every failure a client can cause maps to a 4xx here, never a 500:
    ValueError (SamplingParams / engine validation)  -> 400, `param` = the field the message names
    msgspec ValidationError (wrong type)             -> 400, `param` = the JSON path's field
    msgspec DecodeError / bad UTF-8                  -> 400
    QueueFullError                                   -> 429
    EngineDeadError / shutting down                  -> 503
Messages are capped at MAX_MESSAGE_CHARS so a huge bad input cannot echo itself back.
"""

from __future__ import annotations

import re
from typing import Iterable, Mapping, Optional

import msgspec
from starlette.responses import Response

from asyncengine.api.protocol import ErrorInfo, ErrorResponse, encoder
from asyncengine.async_engine import EngineDeadError, QueueFullError

MAX_MESSAGE_CHARS = 500
CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"  # OpenAI's code for a prompt + max_tokens beyond the context

_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    426: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable",
}
_PATH_FIELD = re.compile(r"`\$\.([A-Za-z_][A-Za-z0-9_]*)")  # "- at `$.stop[0]`", "- at `key` in `$.logit_bias`"
_MISSING_FIELD = re.compile(r"^Object missing required field `([A-Za-z_][A-Za-z0-9_]*)`$")  # at the top level


class APIError(Exception):
    """An error answered to the client with `status` and OpenAI's envelope."""

    def __init__(self, status: int, message: str, *, param: Optional[str] = None, code: Optional[str] = None,
                 type: Optional[str] = None):
        message = cap(message)
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _TYPES.get(status, "invalid_request_error")

    def info(self) -> ErrorInfo:
        return ErrorInfo(message=self.message, type=self.type, param=self.param, code=self.code)

    def body(self) -> bytes:
        return encoder.encode(ErrorResponse(error=self.info()))

    def response(self, headers: Optional[Mapping[str, str]] = None) -> Response:
        return Response(self.body(), status_code=self.status, media_type="application/json", headers=headers)


def cap(message: str) -> str:
    if len(message) <= MAX_MESSAGE_CHARS:
        return message
    return message[: MAX_MESSAGE_CHARS - 3] + "..."


def bad_request(message: str, param: Optional[str] = None) -> APIError:
    return APIError(400, message, param=param)


def unavailable(message: str = "the server is shutting down") -> APIError:
    return APIError(503, message)


def from_decode_error(exc: Exception) -> APIError:
    """msgspec ValidationError / DecodeError / UnicodeDecodeError -> 400 (naming the field when known)."""
    if isinstance(exc, msgspec.ValidationError):
        match = _PATH_FIELD.search(str(exc)) or _MISSING_FIELD.match(str(exc))
        return bad_request(f"invalid request: {exc}", param=match.group(1) if match else None)
    if isinstance(exc, UnicodeDecodeError):
        return bad_request("request body is not valid UTF-8")
    return bad_request(f"request body is not valid JSON: {exc}")


def from_engine_error(exc: BaseException, fields: Iterable[str] = (), renames: Optional[Mapping[str, str]] = None
                      ) -> APIError:
    """Map what the engine raises when a request is added or fails.

    `fields`: request field names a ValueError message may start with ("top_k must be ..."); the first word of
    the message, renamed through `renames` (e.g. max_tokens -> max_completion_tokens), becomes `param`.
    """
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, QueueFullError):
        return APIError(429, str(exc), code="queue_full")
    if isinstance(exc, EngineDeadError):
        return APIError(503, str(exc), code="engine_unavailable")
    if isinstance(exc, ValueError):
        return bad_request(str(exc), param=_param_of(str(exc), fields, renames or {}))
    return APIError(500, f"internal error: {type(exc).__name__}")


def _param_of(message: str, fields: Iterable[str], renames: Mapping[str, str]) -> Optional[str]:
    first = message.split(" ", 1)[0].strip(":,")
    if first == "prompt" and "max_tokens" in message:
        first = "max_tokens"  # "prompt (N tokens) + max_tokens (M) = ... exceeds max_model_len"
    if first in fields or first in renames:
        return renames.get(first, first)
    return None

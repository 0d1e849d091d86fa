"""API-key authentication as a small ASGI middleware.

With an api_key set, every HTTP request and WebSocket handshake must carry `Authorization: Bearer <key>`;
WebSocket handshakes may give `?api_key=<key>` instead (browsers cannot set headers on WebSockets). Keys are
compared with `hmac.compare_digest`. Exempt paths (default: /health, for load balancers) pass through.
Refusals: HTTP 401 with OpenAI's envelope; a WebSocket handshake is refused with an HTTP 401 response when the
server supports the `websocket.http.response` extension (hypercorn does), else closed with code 1008.
"""

from __future__ import annotations

import hmac
from typing import Iterable, Optional
from urllib.parse import parse_qs

from asyncengine.api.errors import APIError


class APIKeyMiddleware:
    def __init__(self, app, api_key: Optional[str] = None, exempt_paths: Iterable[str] = ("/health",)):
        self.app = app
        self.key = api_key.encode() if api_key else None
        self.exempt = frozenset(exempt_paths)

    async def __call__(self, scope, receive, send) -> None:
        kind = scope["type"]
        if self.key is None or kind not in ("http", "websocket") or _route_path(scope) in self.exempt:
            return await self.app(scope, receive, send)
        if self._authorized(scope):
            return await self.app(scope, receive, send)
        error = APIError(401, "Incorrect or missing API key: send it as 'Authorization: Bearer <key>'.",
                         code="invalid_api_key")
        if kind == "http":
            await error.response(headers={"www-authenticate": "Bearer"})(scope, receive, send)
        else:
            await _refuse_websocket(scope, receive, send, error)

    def _authorized(self, scope) -> bool:
        given = _bearer(scope)
        if given is None and scope["type"] == "websocket":
            values = parse_qs(scope.get("query_string", b"").decode("latin-1")).get("api_key")
            given = values[-1].encode("latin-1", "replace") if values else None
        return given is not None and hmac.compare_digest(given, self.key)


def _route_path(scope) -> str:
    """The path inside this app (without the prefix it is mounted under)."""
    path, root = scope.get("path", ""), scope.get("root_path", "")
    return path[len(root):] if root and path.startswith(root) else path


def _bearer(scope) -> Optional[bytes]:
    for name, value in scope.get("headers", ()):
        if name == b"authorization":
            scheme, _, token = value.partition(b" ")
            if scheme.lower() == b"bearer":
                return token.strip()
    return None


async def _refuse_websocket(scope, receive, send, error: APIError) -> None:
    message = await receive()  # websocket.connect
    if message["type"] != "websocket.connect":
        return
    if "websocket.http.response" in scope.get("extensions", {}):
        await send({"type": "websocket.http.response.start", "status": error.status,
                    "headers": [(b"content-type", b"application/json")]})
        await send({"type": "websocket.http.response.body", "body": error.body()})
    else:
        await send({"type": "websocket.close", "code": 1008})

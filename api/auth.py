"""API-key authentication and the WebSocket Origin check, as two small ASGI middlewares.

APIKeyMiddleware, with an api_key set: every HTTP request and WebSocket handshake must carry the key as
    `Authorization: Bearer <key>`                          (any client that can set headers), or, on a handshake only,
    `Sec-WebSocket-Protocol: asyncengine.v1, bearer.<key>`  (browsers: they cannot set headers on a WebSocket), or
    `?api_key=<key>`                                       (kept for older clients; a URL may end up in proxy logs).
At least one credential must be present and every credential present must be right: a right header does not
excuse a wrong `bearer.` subprotocol. Keys are compared with `hmac.compare_digest`. The `bearer.` subprotocols are
removed from the scope before the app runs (with or without an api_key), so a key is never selected and echoed
back as the answered subprotocol, and never reaches a handler or a log; the app answers `asyncengine.v1`.
Exempt paths (default: /health, for load balancers) and path prefixes (the chat page's assets) pass through.

WebSocketOriginMiddleware, with allowed_origins set: a WebSocket handshake whose `Origin` header is not in the
list is refused (403). Browsers do not apply CORS to WebSockets, so without this check any web page a user visits
could open a socket to the server; "*" allows every origin. Two handshakes always pass: one without `Origin`
(only browsers send it, and a non-browser client could send any value anyway), and a same-origin one, whose
`Origin` names the host it connects to (the `Host` header): the server's own chat page, as same-origin HTTP
requests pass CORS.

Refusals: HTTP 401 / 403 with OpenAI's envelope; a WebSocket handshake is refused with an HTTP response when the
server supports the `websocket.http.response` extension (hypercorn does), else closed with code 1008.
"""

from __future__ import annotations

import hmac
from typing import Iterable, Optional, Sequence
from urllib.parse import parse_qs, urlsplit

from asyncengine.api.errors import APIError

BEARER_SUBPROTOCOL_PREFIX = "bearer."


class APIKeyMiddleware:
    def __init__(self, app, api_key: Optional[str] = None, exempt_paths: Iterable[str] = ("/health",),
                 exempt_prefixes: Iterable[str] = ()):
        self.app = app
        self.key = api_key.encode() if api_key else None
        self.exempt = frozenset(exempt_paths)
        self.exempt_prefixes = tuple(exempt_prefixes)

    async def __call__(self, scope, receive, send) -> None:
        kind = scope["type"]
        subprotocol_keys: list[bytes] = []
        if kind == "websocket":
            scope, subprotocol_keys = _without_bearer_subprotocols(scope)
        if self.key is None or kind not in ("http", "websocket") or self._exempt(_route_path(scope)):
            return await self.app(scope, receive, send)
        if self._authorized(scope, subprotocol_keys):
            return await self.app(scope, receive, send)
        error = APIError(401, "Incorrect or missing API key: send it as 'Authorization: Bearer <key>' (or, on the "
                              "WebSocket, as the subprotocol 'bearer.<key>' next to 'asyncengine.v1').",
                         code="invalid_api_key")
        if kind == "http":
            await error.response(headers={"www-authenticate": "Bearer"})(scope, receive, send)
        else:
            await refuse_websocket(scope, receive, send, error)

    def _exempt(self, path: str) -> bool:
        return path in self.exempt or (bool(self.exempt_prefixes) and path.startswith(self.exempt_prefixes))

    def _authorized(self, scope, subprotocol_keys: list[bytes]) -> bool:
        given = list(subprotocol_keys)
        header = _bearer(scope)
        if header is not None:
            given.append(header)
        if scope["type"] == "websocket":
            query = parse_qs(scope.get("query_string", b"").decode("latin-1")).get("api_key", [])
            given.extend(value.encode("latin-1", "replace") for value in query)
        # every credential is compared (no early exit), so the time taken does not depend on which one is wrong
        results = [hmac.compare_digest(value, self.key) for value in given]
        return bool(results) and all(results)


class WebSocketOriginMiddleware:
    def __init__(self, app, allowed_origins: Optional[Sequence[str]] = None):
        self.app = app
        self.allowed = None if allowed_origins is None else frozenset(_normal_origin(o) for o in allowed_origins)

    async def __call__(self, scope, receive, send) -> None:
        if self.allowed is None or scope["type"] != "websocket" or "*" in self.allowed:
            return await self.app(scope, receive, send)
        origin = _header(scope, b"origin")
        if origin is None or self._allowed(origin.decode("latin-1"), _header(scope, b"host")):
            return await self.app(scope, receive, send)
        error = APIError(403, "this WebSocket's Origin is not allowed (see --allowed-origins)",
                         code="origin_not_allowed")
        await refuse_websocket(scope, receive, send, error)


    def _allowed(self, origin: str, host: Optional[bytes]) -> bool:
        origin = _normal_origin(origin)
        same_origin = host is not None and urlsplit(origin).netloc == host.decode("latin-1").strip().lower()
        return same_origin or origin in self.allowed


def _normal_origin(origin: str) -> str:
    """Origins compare as browsers serialize them: scheme://host[:port], lower case, no trailing slash."""
    return origin.strip().rstrip("/").lower()


def _without_bearer_subprotocols(scope) -> tuple[dict, list[bytes]]:
    """The scope without its `bearer.<key>` subprotocols (in `subprotocols` and in the Sec-WebSocket-Protocol
    header), and the keys they carried."""
    offered = scope.get("subprotocols") or []
    keys = [p[len(BEARER_SUBPROTOCOL_PREFIX):].encode("utf-8", "replace") for p in offered
            if p.startswith(BEARER_SUBPROTOCOL_PREFIX)]
    if not keys:
        return scope, []
    kept = [p for p in offered if not p.startswith(BEARER_SUBPROTOCOL_PREFIX)]
    headers = [(name, value) for name, value in scope.get("headers", ()) if name != b"sec-websocket-protocol"]
    if kept:
        headers.append((b"sec-websocket-protocol", ", ".join(kept).encode("latin-1")))
    return {**scope, "subprotocols": kept, "headers": headers}, keys


def _route_path(scope) -> str:
    """The path inside this app (without the prefix it is mounted under)."""
    path, root = scope.get("path", ""), scope.get("root_path", "")
    return path[len(root):] if root and path.startswith(root) else path


def _header(scope, name: bytes) -> Optional[bytes]:
    for key, value in scope.get("headers", ()):
        if key == name:
            return value
    return None


def _bearer(scope) -> Optional[bytes]:
    value = _header(scope, b"authorization")
    if value is None:
        return None
    scheme, _, token = value.partition(b" ")
    return token.strip() if scheme.lower() == b"bearer" else None


async def refuse_websocket(scope, receive, send, error: APIError) -> None:
    """Refuse a WebSocket handshake with `error` (before it is accepted)."""
    message = await receive()  # websocket.connect
    if message["type"] != "websocket.connect":
        return
    if "websocket.http.response" in scope.get("extensions", {}):
        await send({"type": "websocket.http.response.start", "status": error.status,
                    "headers": [(b"content-type", b"application/json")]})
        await send({"type": "websocket.http.response.body", "body": error.body()})
    else:
        await send({"type": "websocket.close", "code": 1008})

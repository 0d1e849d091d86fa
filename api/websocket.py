"""The /v1/ws WebSocket: several concurrent completion / chat requests over one connection.

Client -> server, one JSON object per message:
    {"id": <str|int>, "type": "completion" | "chat.completion", ...the body of the matching POST route...}
        ("type" may be left out: a body with "messages" is a chat request); always streamed.
    {"type": "cancel", "id": <id>}      ends that request with finish_reason "abort" (its final chunks still come).
Server -> client:
    the same chunk objects as the SSE stream, with `"id"` set to the client's id; then {"id": <id>, "type": "done"}.
    An error for one request is {"id": <id>, "type": "error", "error": {...}}, then its "done"; the socket stays
    open. A message refused before it becomes a request (no id, an id already in flight, too many requests on
    this connection, unreadable JSON) gets the error only, with "id": null when none could be read.
Subprotocol: a client that offers `asyncengine.v1` (browsers authenticate with `Sec-WebSocket-Protocol:
asyncengine.v1, bearer.<key>`, see auth.py) gets it back as the selected subprotocol; the `bearer.` one never is.
Closing the socket aborts every request it started. On server shutdown the socket is closed with code 1001 once
in-flight requests have finished or been aborted.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Optional, Union

import msgspec
from starlette.websockets import WebSocket

from asyncengine.api.errors import APIError, from_decode_error, from_engine_error
from asyncengine.api.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    WebSocketDone,
    WebSocketEnvelope,
    WebSocketError,
    decode_body,
    encoder,
)
from asyncengine.api.serving import Generation

if TYPE_CHECKING:
    from asyncengine.api.app import ServerState

logger = logging.getLogger(__name__)

ClientId = Union[str, int]
_KINDS = {"completion": CompletionRequest, "chat.completion": ChatCompletionRequest}
_MAX_ID_CHARS = 256
SUBPROTOCOL = "asyncengine.v1"


class _Closed(Exception):
    """The socket is gone; the request's task ends quietly."""


class WebSocketSession:
    """One connection: a reader loop dispatching messages, and one task per in-flight request."""

    def __init__(self, websocket: WebSocket, state: "ServerState"):
        self.ws = websocket
        self.state = state
        self.tasks: dict[ClientId, asyncio.Task] = {}
        self.generations: dict[ClientId, Generation] = {}
        self._send_lock = asyncio.Lock()
        self._closed = False

    async def run(self) -> None:
        offered = self.ws.scope.get("subprotocols") or []
        await self.ws.accept(subprotocol=SUBPROTOCOL if SUBPROTOCOL in offered else None)
        closing = asyncio.ensure_future(self.state.closing.wait())
        try:
            await self._read_loop(closing)
        except _Closed:
            pass
        finally:
            self._closed = True
            closing.cancel()
            tasks = list(self.tasks.values())
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _read_loop(self, closing: asyncio.Future) -> None:
        while True:
            receive = asyncio.ensure_future(self.ws.receive())
            await asyncio.wait({receive, closing}, return_when=asyncio.FIRST_COMPLETED)
            if not receive.done():  # the server is closing
                receive.cancel()
                await self._close(1001)
                return
            message = receive.result()
            if message["type"] == "websocket.disconnect":
                return
            data = message.get("text")
            data = data.encode() if data is not None else message.get("bytes") or b""
            await self._dispatch(data)

    async def _dispatch(self, data: bytes) -> None:
        if len(data) > self.state.max_body_bytes:
            return await self._send_error(None, APIError(413, f"message exceeds {self.state.max_body_bytes} bytes"))
        try:
            envelope = msgspec.json.decode(data, type=WebSocketEnvelope)
        except (msgspec.DecodeError, UnicodeDecodeError) as exc:
            return await self._send_error(None, from_decode_error(exc))
        client_id = envelope.id
        if envelope.type == "cancel":
            generation = self.generations.get(client_id)
            if generation is not None:
                await generation.abort()
            return
        error = self._refusal(envelope)
        if error is not None:
            return await self._send_error(client_id, error)
        kind = envelope.type or ("chat.completion" if len(envelope.messages) else "completion")
        self.tasks[client_id] = asyncio.ensure_future(self._serve(client_id, _KINDS[kind], data))

    def _refusal(self, envelope: WebSocketEnvelope) -> Optional[APIError]:
        if envelope.type is not None and envelope.type not in _KINDS:
            return APIError(400, f"unknown message type {envelope.type[:40]!r}; use completion, chat.completion "
                                 "or cancel", param="type")
        if envelope.id is None or (isinstance(envelope.id, str) and len(envelope.id) > _MAX_ID_CHARS):
            return APIError(400, f"every request needs an \"id\" (string of at most {_MAX_ID_CHARS} chars or "
                                 "integer)", param="id")
        if envelope.id in self.tasks:
            return APIError(400, f"id {envelope.id!r} is already in use on this connection", param="id")
        if len(self.tasks) >= self.state.max_ws_requests:
            return APIError(429, f"at most {self.state.max_ws_requests} concurrent requests per connection")
        return None

    async def _serve(self, client_id: ClientId, kind, data: bytes) -> None:
        generation: Optional[Generation] = None
        release = None
        try:
            request = decode_body(data, kind)
            self.state.check_accepting()
            release = self.state.track()
            start = self.state.serving.chat if kind is ChatCompletionRequest else self.state.serving.completion
            generation = await start(request, response_id=client_id, stream=True)
            self.generations[client_id] = generation
            async for chunk in generation.chunks():
                await self._send(encoder.encode(chunk))
        except _Closed:
            return
        except APIError as exc:
            await self._send_error_quietly(client_id, exc)
        except (msgspec.DecodeError, UnicodeDecodeError) as exc:
            await self._send_error_quietly(client_id, from_decode_error(exc))
        except Exception as exc:  # noqa: BLE001 - one request's failure must not close the socket
            logger.exception("websocket request %r failed", client_id)
            await self._send_error_quietly(client_id, from_engine_error(exc))
        finally:
            self.tasks.pop(client_id, None)
            self.generations.pop(client_id, None)
            if generation is not None:
                await generation.aclose()
            if release is not None:
                release()
        try:
            await self._send(encoder.encode(WebSocketDone(id=client_id)))
        except _Closed:
            pass

    async def _send_error(self, client_id: Optional[ClientId], error: APIError) -> None:
        await self._send(encoder.encode(WebSocketError(id=client_id, error=error.info())))

    async def _send_error_quietly(self, client_id: Optional[ClientId], error: APIError) -> None:
        try:
            await self._send_error(client_id, error)
        except _Closed:
            pass

    async def _send(self, data: bytes) -> None:
        if self._closed:
            raise _Closed()
        async with self._send_lock:
            try:
                await self.ws.send_text(data.decode())
            except Exception as exc:  # noqa: BLE001 - the peer went away between our check and the send
                self._closed = True
                raise _Closed() from exc

    async def _close(self, code: int) -> None:
        if self._closed:
            return
        self._closed = True
        async with self._send_lock:
            try:
                await self.ws.close(code)
            except Exception:  # noqa: BLE001 - already closed by the peer
                pass

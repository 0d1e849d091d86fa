"""Server-sent events for OpenAI streams, as a plain ASGI response.

`sse_frames(chunks)` turns chunk Structs into `data: {...}\\n\\n` frames and always ends with `data: [DONE]`; if the
chunk iterator raises after the stream has started, an `data: {"error": {...}}` frame comes before [DONE].

`SSEResponse` sends those frames, and runs three things side by side:
  - the pump (frames -> send), which ends the response when the frames end;
  - a disconnect watcher: on `http.disconnect` the pump is cancelled, which closes the frame generator and so
    the engine's `iterate()`, which aborts the request before the next engine step;
  - a closing watcher: when the app shuts down (`closing` set) the stream is ended by the app itself, since
    hypercorn does not end streaming responses on shutdown.
A pinger sends `: ping` comments when nothing was sent for `ping_interval` seconds; a lock keeps pings and frames
from interleaving. Departures from sse-starlette, on purpose: no `event:`/`id:` fields (OpenAI sends bare `data:`),
no send timeout (a slow reader only makes the engine merge deltas), shutdown driven by the app, not by uvicorn.
So sse-starlette itself is not used: its drain hooks uvicorn's exit (process-global state), every send runs in a
timeout scope, and its framing differs; what is left of it would be a layer around this pump (pyproject.toml).
"""

from __future__ import annotations

import asyncio
import logging
from typing import AsyncIterator, Awaitable, Callable, Optional

from asyncengine.api.errors import APIError, from_engine_error
from asyncengine.api.protocol import ErrorResponse, encoder

logger = logging.getLogger(__name__)

DONE_FRAME = b"data: [DONE]\n\n"
PING_FRAME = b": ping\n\n"


def frame(obj) -> bytes:
    return b"data: " + encoder.encode(obj) + b"\n\n"


async def sse_frames(chunks: AsyncIterator) -> AsyncIterator[bytes]:
    """Frames of every chunk, an error frame if the chunks fail midway, then [DONE]."""
    try:
        async for chunk in chunks:
            yield frame(chunk)
    except Exception as exc:  # noqa: BLE001 - reported in-band: the status line has been sent already
        error = exc if isinstance(exc, APIError) else from_engine_error(exc)
        logger.warning("stream ended by an error: %s", error.message)
        yield frame(ErrorResponse(error=error.info()))
    finally:
        close = getattr(chunks, "aclose", None)
        if close is not None:
            await close()
    yield DONE_FRAME


class SSEResponse:
    """An ASGI response streaming pre-encoded SSE frames; see the module docstring for its contract."""

    media_type = "text/event-stream"

    def __init__(
        self,
        frames: AsyncIterator[bytes],
        *,
        closing: Optional[asyncio.Event] = None,
        ping_interval: Optional[float] = 15.0,
        on_close: Optional[Callable[[], Awaitable[None]]] = None,
    ):
        self.frames = frames
        self.closing = closing
        self.ping_interval = ping_interval
        self.on_close = on_close
        self._lock = asyncio.Lock()
        self._last_send = 0.0

    async def __call__(self, scope, receive, send) -> None:
        loop = asyncio.get_running_loop()
        self._last_send = loop.time()
        pump = asyncio.ensure_future(self._pump(send))
        disconnect = asyncio.ensure_future(_wait_disconnect(receive))
        others = [disconnect]
        if self.closing is not None:
            others.append(asyncio.ensure_future(self.closing.wait()))
        if self.ping_interval:
            others.append(asyncio.ensure_future(self._ping(send)))
        try:
            await send({
                "type": "http.response.start",
                "status": 200,
                "headers": [
                    (b"content-type", b"text/event-stream; charset=utf-8"),
                    (b"cache-control", b"no-cache"),
                    (b"x-accel-buffering", b"no"),
                ],
            })
            await asyncio.wait([pump, *others], return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (pump, *others):
                task.cancel()
            await asyncio.gather(pump, *others, return_exceptions=True)
            if self.on_close is not None:
                await self.on_close()
        if pump.done() and not pump.cancelled() and pump.exception() is not None:
            logger.error("SSE stream failed", exc_info=pump.exception())
        if disconnect.cancelled():  # the client is still there: end the response properly
            await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _pump(self, send) -> None:
        try:
            async for data in self.frames:
                await self._send(send, data)
        finally:
            await self.frames.aclose()  # closed while suspended in send: run its cleanup (abort) now

    async def _ping(self, send) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(max(self._last_send + self.ping_interval - loop.time(), 0.0))
            if loop.time() - self._last_send >= self.ping_interval:
                await self._send(send, PING_FRAME)

    async def _send(self, send, data: bytes) -> None:
        async with self._lock:
            await send({"type": "http.response.body", "body": data, "more_body": True})
            self._last_send = asyncio.get_running_loop().time()


async def _wait_disconnect(receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return

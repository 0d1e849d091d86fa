"""`create_app(engine)`: the OpenAI-compatible Starlette app, mountable in any ASGI application.

    POST /v1/completions, /v1/chat/completions     JSON, or SSE with "stream": true
    WS   /v1/ws                                    many streamed requests per connection (see websocket.py);
                                                   a plain GET there is 426
    GET  /v1/models, /version, /metrics
    GET  /openapi.json                             the contract: what the server accepts and returns (openapi.py)
    POST /v1/embeddings                            float or base64 (models served with the pooling runner)
    POST /score, /rerank (and /v1/...)             vLLM's shapes (cross-encoders; scoring.py)
    POST /tokenize, /detokenize                    vLLM's shapes
    GET  /health                                   200, or 503 when the engine is dead or the server stopping
    GET  /, /ui/...                                the chat page (api/static/; `ui=False` leaves it out)

Lifecycle: `ServerState` counts in-flight generations. `await app.state.server.shutdown(timeout)` refuses new
requests (503), lets in-flight ones finish for up to `timeout` seconds, aborts the rest (their streams end with
finish_reason "abort"), then sets `closing`, which ends any stream or socket still open. The CLI calls it on
SIGTERM / SIGINT before hypercorn stops; an embedding application calls it from its own shutdown.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Callable, Optional, Sequence, Union

import msgspec
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Mount, Route, WebSocketRoute
from starlette.staticfiles import StaticFiles
from starlette.websockets import WebSocket

import asyncengine
from asyncengine.api.auth import APIKeyMiddleware, WebSocketOriginMiddleware
from asyncengine.api.embeddings import EmbeddingServing
from asyncengine.api.errors import APIError, bad_request, from_decode_error, unavailable
from asyncengine.api.metrics import Metrics
from asyncengine.api.openapi import ModelLimits, openapi_schema
from asyncengine.api.protocol_embeddings import EmbeddingRequest, RerankRequest, ScoreRequest
from asyncengine.api.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
    VersionResponse,
    decode_body,
    encoder,
)
from asyncengine.api.scoring import ScoreServing
from asyncengine.api.serving import Generation, OpenAIServing, ServingOptions
from asyncengine.api.sse import SSEResponse, _wait_disconnect, sse_frames
from asyncengine.api.websocket import WebSocketSession
from asyncengine.async_engine import AsyncLLMEngine

DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024
DEFAULT_PING_INTERVAL = 15.0
DEFAULT_MAX_WS_REQUESTS = 256


class ServerState:
    """What the handlers share: the engine, the serving logic, limits, and the shutdown state."""

    def __init__(self, engine: AsyncLLMEngine, serving: OpenAIServing, metrics: Metrics, *, max_body_bytes: int,
                 ping_interval: Optional[float], max_ws_requests: int):
        self.engine = engine
        self.serving = serving
        self.metrics = metrics
        self.max_body_bytes = max_body_bytes
        self.ping_interval = ping_interval
        self.max_ws_requests = max_ws_requests
        self.accepting = True
        self.closing = asyncio.Event()  # set at the end of shutdown: open streams and sockets end now
        self.inflight = 0
        self._idle = asyncio.Event()
        self._idle.set()

    @property
    def healthy(self) -> bool:
        return self.accepting and not self.engine.errored

    def check_accepting(self) -> None:
        """503 while shutting down or once the engine is dead."""
        if not self.accepting:
            raise unavailable("the server is shutting down")
        if self.engine.errored:
            raise unavailable("the engine is not available (a step failed); restart the server")

    def track(self) -> Callable[[], None]:
        """Count one in-flight generation; returns its (idempotent) release."""
        self.inflight += 1
        self._idle.clear()
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self.inflight -= 1
                if self.inflight == 0:
                    self._idle.set()

        return release

    async def shutdown(self, timeout: float) -> None:
        """Stop accepting, drain for up to `timeout` s, abort the rest, then end whatever is still open."""
        self.accepting = False
        await self._wait_idle(timeout)
        await self.engine.abort_all()
        await self._wait_idle(5.0)  # aborted streams send their last chunks and [DONE]
        self.closing.set()

    async def _wait_idle(self, timeout: float) -> bool:
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
            return True
        except asyncio.TimeoutError:
            return False


class Routes:
    """The HTTP handlers, bound to one ServerState."""

    def __init__(self, state: ServerState, openapi_document: dict):
        self.state = state
        self.created = int(time.time())
        self._document = openapi_document
        self._openapi: dict[str, bytes] = {}  # encoded, by root_path

    # -- generation -------------------------------------------------------------------------------------------
    async def completions(self, request: Request) -> Response:
        body = await self._decode(request, CompletionRequest)
        return await self._generate(request, lambda: self.state.serving.completion(body), body.stream)

    async def chat_completions(self, request: Request) -> Response:
        body = await self._decode(request, ChatCompletionRequest)
        return await self._generate(request, lambda: self.state.serving.chat(body), body.stream)

    async def _generate(self, request: Request, start, stream: bool):
        state = self.state
        state.check_accepting()
        release = state.track()
        try:
            generation: Generation = await start()
        except BaseException:
            release()
            raise
        if stream:
            async def on_close() -> None:
                await generation.aclose()
                release()

            return SSEResponse(sse_frames(generation.chunks()), closing=state.closing,
                               ping_interval=state.ping_interval, on_close=on_close)
        try:
            result = await _until_disconnect(request, generation.collect())
        finally:
            await generation.aclose()
            release()
        if result is None:
            return Response(status_code=499)  # the client left; nobody reads this
        return _json(result)

    # -- pooling: embeddings, scores ----------------------------------------------------------------------------
    async def embeddings(self, request: Request) -> Response:
        return await self._pool(request, EmbeddingRequest, lambda body, model: EmbeddingServing(
            self.state.engine).create(body, model))

    async def score(self, request: Request) -> Response:
        return await self._pool(request, ScoreRequest, lambda body, model: ScoreServing(
            self.state.engine).score(body, model))

    async def rerank(self, request: Request) -> Response:
        return await self._pool(request, RerankRequest, lambda body, model: ScoreServing(
            self.state.engine).rerank(body, model))

    async def _pool(self, request: Request, kind, run) -> Response:
        """Decode a `kind` body, check its model, and answer run(body, model) (499 if the client left)."""
        body = await self._decode(request, kind)
        state = self.state
        model = state.serving.check_model(body.model)
        state.check_accepting()
        release = state.track()
        try:
            result = await _until_disconnect(request, run(body, model))
        finally:
            release()
        if result is None:
            return Response(status_code=499)  # the client left; nobody reads this
        return _json(result)

    # -- the rest ---------------------------------------------------------------------------------------------
    async def models(self, request: Request) -> Response:
        engine = self.state.engine
        cards = [ModelCard(id=name, created=self.created, root=engine.config.model, max_model_len=engine.max_model_len)
                 for name in self.state.serving.model_names]
        return _json(ModelList(data=cards))

    async def tokenize(self, request: Request) -> Response:
        body = await self._decode(request, TokenizeRequest)
        self.state.serving.check_model(body.model)
        engine = self.state.engine
        if (body.prompt is None) == (body.messages is None):
            raise bad_request("give exactly one of prompt or messages", "prompt")
        if body.prompt is not None:
            add_special = True if body.add_special_tokens is None else body.add_special_tokens
            ids = await engine.tokenize(body.prompt, add_special_tokens=add_special)
        else:
            prompt = await self.state.serving.chat_prompt(body.messages, body.add_generation_prompt,
                                                          body.chat_template_kwargs, bool(body.add_special_tokens),
                                                          tools=body.tools)
            ids = prompt.token_ids
        strs = engine.tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None
        return _json(TokenizeResponse(count=len(ids), max_model_len=engine.max_model_len, tokens=ids,
                                      token_strs=strs))

    async def detokenize(self, request: Request) -> Response:
        body = await self._decode(request, DetokenizeRequest)
        self.state.serving.check_model(body.model)
        engine = self.state.engine
        vocab = engine.vocab_size  # the bound /openapi.json states (ids the tokenizer lacks decode to nothing)
        bad = [t for t in body.tokens if t >= vocab]  # negative ids: refused by the decoder
        if bad:
            raise bad_request(f"tokens {bad[:5]} are outside the vocabulary [0, {vocab})", "tokens")
        return _json(DetokenizeResponse(prompt=engine.tokenizer.decode(body.tokens)))

    async def health(self, request: Request) -> Response:
        self.state.check_accepting()  # 503 while shutting down or with a dead engine
        return Response(status_code=200)

    async def version(self, request: Request) -> Response:
        return _json(VersionResponse(version=asyncengine.__version__))

    async def metrics(self, request: Request) -> Response:
        return Response(self.state.metrics.render(), media_type=self.state.metrics.content_type)

    async def openapi(self, request: Request) -> Response:
        root_path = request.scope.get("root_path", "")  # the prefix a proxy serves us under (--root-path)
        if root_path not in self._openapi:
            self._openapi[root_path] = encoder.encode({"servers": [{"url": root_path}], **self._document}
                                                      if root_path else self._document)
        return Response(self._openapi[root_path], media_type="application/json")

    async def websocket_without_upgrade(self, request: Request) -> Response:
        raise APIError(426, "/v1/ws is a WebSocket: send an upgrade request (e.g. with a WebSocket client)")

    async def websocket(self, websocket: WebSocket) -> None:
        await WebSocketSession(websocket, self.state).run()

    async def _decode(self, request: Request, kind):
        data = await read_body(request, self.state.max_body_bytes)
        try:
            return decode_body(data, kind)
        except (msgspec.DecodeError, UnicodeDecodeError) as exc:
            raise from_decode_error(exc) from exc


def _json(obj, status: int = 200) -> Response:
    return Response(encoder.encode(obj), status_code=status, media_type="application/json")


async def read_body(request: Request, limit: int) -> bytes:
    """The request body; 413 when Content-Length or the bytes actually streamed exceed `limit`."""
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.isdigit():
            raise bad_request("invalid Content-Length header")
        if int(declared) > limit:
            raise APIError(413, f"request body of {declared} bytes exceeds the limit of {limit} bytes")
    parts, total = [], 0
    try:
        async for part in request.stream():
            total += len(part)
            if total > limit:
                raise APIError(413, f"request body exceeds the limit of {limit} bytes")
            parts.append(part)
    except ClientDisconnect:
        raise APIError(400, "the client disconnected while sending the body") from None
    return b"".join(parts)


async def _until_disconnect(request: Request, work):
    """Await `work`; if the client disconnects first, cancel it (aborting its requests) and return None."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_disconnect(request.receive))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
        await asyncio.gather(task, watcher, return_exceptions=True)
    if task.cancelled():
        return None
    return task.result()


# The chat page is plain files (api/static/), shipped as package data. It must load without a key (it asks for
# one); the CSP keeps it to its own origin, so it works offline and cannot pull in anything from elsewhere.
_PAGE_HEADERS = {
    "content-security-policy": "default-src 'self'; connect-src 'self'; img-src 'self' data:; "
                               "frame-ancestors 'none'; base-uri 'none'; form-action 'none'",
    "x-content-type-options": "nosniff",
    "cache-control": "no-cache",
}
_UI_PREFIX = "/ui/"


def _chat_page_routes() -> list:
    """`/` (the page) and `/ui/*` (its script and style sheet)."""
    static = StaticFiles(packages=[("asyncengine.api", "static")])
    page = (Path(static.all_directories[0]) / "index.html").read_bytes()

    async def index(request: Request) -> Response:
        return Response(page, media_type="text/html; charset=utf-8", headers=_PAGE_HEADERS)

    return [Route("/", index, methods=["GET"]), Mount(_UI_PREFIX.rstrip("/"), app=static)]


async def _api_error(request, exc: APIError) -> Response:
    return exc.response()


async def _http_error(request, exc: HTTPException) -> Response:
    return APIError(exc.status_code, str(exc.detail)).response(headers=exc.headers)


async def _server_error(request, exc: Exception) -> Response:
    return APIError(500, f"internal server error: {type(exc).__name__}").response()


def _cors(allowed_origins: Optional[Sequence[str]]) -> list[Middleware]:
    if allowed_origins is None:
        return []
    return [Middleware(CORSMiddleware, allow_origins=list(allowed_origins), allow_methods=["*"], allow_headers=["*"])]


def create_app(
    engine: AsyncLLMEngine,
    *,
    api_key: Optional[str] = None,
    served_model_name: Union[str, Sequence[str], None] = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    ping_interval: Optional[float] = DEFAULT_PING_INTERVAL,
    max_ws_requests: int = DEFAULT_MAX_WS_REQUESTS,
    ui: bool = True,
    allowed_origins: Optional[Sequence[str]] = None,
    options: Optional[ServingOptions] = None,
    enable_auto_tool_choice: bool = False,
    tool_call_parser: Optional[str] = None,
    reasoning_parser: Optional[str] = None,
) -> Starlette:
    """The OpenAI-compatible app over `engine` (which it does not own: shut the engine down yourself).

    served_model_name: the name(s) clients use as `model` (default: the engine's model name); the first is the
    one reported. api_key: required on every route except /health and the chat page (see auth.py).
    ping_interval: seconds of silence after which an SSE stream gets a `: ping` comment (None: never).
    ui: serve the chat page at `/`. allowed_origins: the browser origins (besides the server's own) that may use
    the API ("*": any; None: no CORS headers and no WebSocket check): they get CORS headers (CORSMiddleware,
    outside the API-key check so that preflight requests get their answer), and a WebSocket handshake from any
    other origin is refused (see auth.py). options: the front end's chat template, sampling defaults, logprobs
    cap, request logging. enable_auto_tool_choice, tool_call_parser (a name in
    tool_calls.TOOL_PARSERS): tool_choice "auto" reads calls from the text with that parser (vLLM's flags).
    reasoning_parser (qwen3 | deepseek_r1): <think> blocks go to reasoning_content (reasoning.py).
    """
    if enable_auto_tool_choice and tool_call_parser is None:
        raise ValueError("enable_auto_tool_choice needs a tool_call_parser")
    names = [served_model_name] if isinstance(served_model_name, str) else list(served_model_name or [])
    names = names or [engine.model_name]
    metrics = Metrics(engine, names[0])
    serving = OpenAIServing(engine, names, options, tool_call_parser if enable_auto_tool_choice else None,
                            reasoning_parser)
    state = ServerState(engine, serving, metrics, max_body_bytes=max_body_bytes,
                        ping_interval=ping_interval, max_ws_requests=max_ws_requests)
    limits = ModelLimits(vocab_size=engine.vocab_size, max_model_len=engine.max_model_len,
                         max_logprobs=state.serving.options.policy.max_logprobs)
    public_paths = ("/health", "/") if ui else ("/health",)  # open without a key (load balancers, the page)
    document = openapi_schema(limits, api_key=bool(api_key), public_paths=public_paths, title="asyncengine",
                              version=asyncengine.__version__, pooling_task=engine.pooling_task)
    routes = Routes(state, document)
    app = Starlette(
        routes=[
            Route("/v1/completions", routes.completions, methods=["POST"]),
            Route("/v1/chat/completions", routes.chat_completions, methods=["POST"]),
            Route("/v1/embeddings", routes.embeddings, methods=["POST"]),
            *(Route(path, routes.score, methods=["POST"]) for path in ("/score", "/v1/score")),
            *(Route(path, routes.rerank, methods=["POST"]) for path in ("/rerank", "/v1/rerank")),
            Route("/v1/models", routes.models, methods=["GET"]),
            Route("/tokenize", routes.tokenize, methods=["POST"]),
            Route("/detokenize", routes.detokenize, methods=["POST"]),
            Route("/health", routes.health, methods=["GET"]),
            Route("/version", routes.version, methods=["GET"]),
            Route("/metrics", routes.metrics, methods=["GET"]),
            Route("/openapi.json", routes.openapi, methods=["GET"]),
            WebSocketRoute("/v1/ws", routes.websocket),
            Route("/v1/ws", routes.websocket_without_upgrade, methods=["GET"]),
            *(_chat_page_routes() if ui else []),
        ],
        middleware=[
            *_cors(allowed_origins),
            Middleware(WebSocketOriginMiddleware, allowed_origins=allowed_origins),
            Middleware(APIKeyMiddleware, api_key=api_key, exempt_paths=public_paths,
                       exempt_prefixes=(_UI_PREFIX,) if ui else ()),
        ],
        exception_handlers={APIError: _api_error, HTTPException: _http_error, Exception: _server_error},
    )
    app.state.server = state
    return app

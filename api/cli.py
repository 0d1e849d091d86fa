"""`asyncengine serve [MODEL]`: the OpenAI-compatible server on hypercorn + uvloop.

Flags follow vLLM's spelling. Startup prints `asyncengine serving on http://HOST:PORT` (the bound port, so
`--port 0` works). Shutdown: the CLI, never the engine, installs SIGTERM / SIGINT handlers. The first signal stops
accepting (new requests get 503), lets in-flight requests finish for up to --shutdown-timeout seconds, aborts the
rest (their streams end with finish_reason "abort"), then stops hypercorn and the engine and exits 0. A second
signal skips the wait.

Engine failure: when a step fails the engine is dead for good. In-flight streams get an `data: {"error": ...}`
event and `[DONE]`, /health and new requests get 503 at once; the CLI notices within ENGINE_WATCH_INTERVAL,
keeps answering 503 for ENGINE_DEAD_LINGER seconds (probes and load balancers see the state), drains the
in-flight requests (which end at once: they already have their error) and exits with status 1, so that a
supervisor restarts the server rather than keeping a process that can never serve.

"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import socket
import sys
from typing import Optional, Sequence

from asyncengine.api.app import DEFAULT_MAX_BODY_BYTES, DEFAULT_PING_INTERVAL, create_app
from asyncengine.engine_core import leave_a_core_for_the_event_loop

logger = logging.getLogger("asyncengine.api")

ENGINE_WATCH_INTERVAL = 0.1  # seconds between checks of the engine's health
ENGINE_DEAD_LINGER = 1.0  # seconds of 503s after the engine died, before the server shuts down
ENGINE_DEAD_DRAIN = 2.0  # then at most this long for in-flight responses to finish sending their error
EXIT_ENGINE_DEAD = 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="asyncengine", description="asyncengine: LLM inference and serving")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    serve = commands.add_parser("serve", help="serve a model over the OpenAI-compatible HTTP / WebSocket API")
    serve.add_argument("model", nargs="?", default=None,
                       help="local Hugging Face checkpoint folder (default: the model shipped with the package)")
    server = serve.add_argument_group("server")
    server.add_argument("--host", default="0.0.0.0", help="address to listen on (default: all interfaces)")
    server.add_argument("--port", type=int, default=8000, help="port (0: any free port)")
    server.add_argument("--api-key", default=None, help="require 'Authorization: Bearer <key>' (all but /health)")
    server.add_argument("--served-model-name", nargs="+", default=None, help="model name(s) clients use")
    server.add_argument("--shutdown-timeout", type=float, default=10.0,
                        help="seconds in-flight requests may run on after SIGTERM before they are aborted")
    server.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
                        help="largest request body (and WebSocket message)")
    server.add_argument("--ping-interval", type=float, default=DEFAULT_PING_INTERVAL,
                        help="seconds of silence before an SSE ': ping' comment (0: never)")
    server.add_argument("--no-ui", action="store_true", help="do not serve the chat page at /")
    server.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    engine = serve.add_argument_group("engine")
    engine.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16", "half", "float"])
    engine.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    engine.add_argument("--seed", type=int, default=0)
    engine.add_argument("--max-model-len", type=int, default=None)
    engine.add_argument("--max-num-seqs", type=int, default=None, help="default: 256 on CUDA, 64 on CPU")
    engine.add_argument("--max-num-batched-tokens", type=int, default=None, help="default: 8192 on CUDA, 2048 on CPU")
    engine.add_argument("--block-size", type=int, default=16)
    engine.add_argument("--num-kv-blocks", type=int, default=None)
    engine.add_argument("--max-queue-len", type=int, default=None, help="waiting requests beyond this get 429")
    engine.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    engine.add_argument("--min-prefill-batch", type=int, default=None,
                        help="a nearly full batch admits waiting requests in groups of this many (default: "
                             "max-num-seqs / 16; 1: as soon as a slot frees)")
    engine.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                        help="prepare and launch the next step before the last one's tokens are read back "
                             "(default: on CUDA)")
    engine.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=None,
                        help="run the engine in a process of its own, so HTTP framing and the engine's steps use "
                             "two cores (measured: 1.1-1.25x the requests/s of one process under load on an H100, "
                             "1.1x the tokens/s on 2 CPU cores; loadtest/RESULTS.md). Default: on, except with "
                             "the pooling runner, which does not support it")
    engine.add_argument("--runner", default="auto", choices=["auto", "generate", "pooling"],
                        help="generate text, or pool embeddings (/v1/embeddings); auto: pooling for encoder "
                             "checkpoints (BERT) and sentence-transformers checkpoints, else generate")
    return parser


def engine_config(args: argparse.Namespace):
    from asyncengine.config import EngineConfig
    from asyncengine.pooling_engine import pooling_runner_for

    config = EngineConfig(
        model=args.model,
        served_model_name=args.served_model_name[0] if args.served_model_name else None,
        dtype=args.dtype,
        device=args.device,
        seed=args.seed,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        block_size=args.block_size,
        num_kv_blocks=args.num_kv_blocks,
        max_queue_len=args.max_queue_len,
        enable_prefix_caching=args.enable_prefix_caching,
        min_prefill_batch=args.min_prefill_batch,
        async_scheduling=args.async_scheduling,
        engine_process=bool(args.engine_process),
        runner=args.runner,
    )
    if args.engine_process is None:
        config.engine_process = not pooling_runner_for(config)
    return config


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket (bound now, so the real port is known before serving)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.create_server((host, port), family=family, backlog=2048)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def url_of(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def hypercorn_config(sock: socket.socket, *, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES):
    """Hypercorn settings for serving on `sock`, which is handed over (detached) to hypercorn."""
    from hypercorn.config import Config

    config = Config()
    config.bind = [f"fd://{sock.detach()}"]
    config.backlog = 2048
    config.graceful_timeout = 5.0
    config.websocket_max_message_size = max_body_bytes
    config.accesslog = None
    config.errorlog = logging.getLogger("hypercorn.error")  # through the application's logging, not a 2nd handler
    return config


async def serve_app(app, sock: socket.socket, stop: asyncio.Event, *, shutdown_timeout: float = 10.0,
                    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> None:
    """Serve `app` (from create_app) on `sock` until `stop` is set; then drain the app
    (`app.state.server.shutdown`) and only then let hypercorn stop, so streams end with their last chunks."""
    from hypercorn.asyncio import serve

    async def shutdown_trigger() -> None:
        await stop.wait()
        logger.info("shutting down: draining in-flight requests for up to %.1f s", shutdown_timeout)
        await app.state.server.shutdown(shutdown_timeout)
        logger.info("in-flight requests ended; stopping the HTTP server")

    await serve(app, hypercorn_config(sock, max_body_bytes=max_body_bytes), shutdown_trigger=shutdown_trigger)


async def _watch_engine(engine, app, stop: asyncio.Event, died: asyncio.Event) -> None:
    """Once the engine is dead: set `died`, linger, then stop the server with a short drain (the in-flight
    requests already hold their error; only a client that does not read could keep them open)."""
    while not engine.errored:
        await asyncio.sleep(ENGINE_WATCH_INTERVAL)
    died.set()
    logger.error("the engine died; answering 503 for %.1f s, then shutting down with exit status %d",
                 ENGINE_DEAD_LINGER, EXIT_ENGINE_DEAD)
    await asyncio.sleep(ENGINE_DEAD_LINGER)
    stop.set()
    await app.state.server.shutdown(ENGINE_DEAD_DRAIN)


async def _serve_until_signal(app, engine, sock: socket.socket, args: argparse.Namespace) -> int:
    """Serve until a signal (returns 0) or the engine's death (returns EXIT_ENGINE_DEAD)."""
    loop = asyncio.get_running_loop()
    stop, died = asyncio.Event(), asyncio.Event()

    def on_signal() -> None:
        if stop.is_set():  # second signal: stop waiting for in-flight requests
            loop.create_task(app.state.server.shutdown(0.0))
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal)
    watcher = loop.create_task(_watch_engine(engine, app, stop, died), name="asyncengine-engine-watch")
    try:
        await serve_app(app, sock, stop, shutdown_timeout=args.shutdown_timeout, max_body_bytes=args.max_body_bytes)
    finally:
        watcher.cancel()
        await asyncio.gather(watcher, return_exceptions=True)
        await engine.shutdown()  # handlers still installed: a second Ctrl-C here is not a KeyboardInterrupt
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
        logger.info("stopped")
    return EXIT_ENGINE_DEAD if died.is_set() else 0


def _run(coro):
    try:
        import uvloop
    except ImportError:  # e.g. Windows
        return asyncio.run(coro)
    return uvloop.run(coro)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from asyncengine.async_engine import AsyncLLMEngine

    try:
        config = engine_config(args)
        if not config.engine_process:  # an engine process does this itself
            leave_a_core_for_the_event_loop(config)
        engine = AsyncLLMEngine(config)
        sock = bind_socket(args.host, args.port)
    except (ValueError, OSError, RuntimeError) as exc:  # RuntimeError: an engine process that died starting
        print(f"asyncengine: error: {exc}", file=sys.stderr)
        return 2
    app = create_app(engine, api_key=args.api_key, served_model_name=args.served_model_name,
                     max_body_bytes=args.max_body_bytes, ping_interval=args.ping_interval or None,
                     ui=not args.no_ui)
    print(f"asyncengine serving on {url_of(sock)}", flush=True)
    return _run(_serve_until_signal(app, engine, sock, args))


if __name__ == "__main__":
    sys.exit(main())

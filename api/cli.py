"""The `asyncengine` command line: `serve`, `generate` and `bench serve`, the same from `asyncengine ...`,
`python -m asyncengine ...` and `python -m asyncengine.api ...`.

    asyncengine serve [MODEL] [--model MODEL] ...   the OpenAI-compatible server (hypercorn + uvloop)
    asyncengine generate [--prompt P ...] ...       continue prompts with the offline engine and print the text
    asyncengine bench serve --base-url URL ...      the load generator against any OpenAI-compatible server
    asyncengine [--prompt P ...]                     no subcommand: `generate` (the README's first command)

`serve`'s flags follow vLLM's spelling, and each does what vLLM's does (see serve_parser). Startup prints
`asyncengine serving on http(s)://HOST:PORT` (the bound port, so `--port 0` works). Shutdown: the CLI, never
the engine, installs SIGTERM / SIGINT handlers. The first signal stops accepting (new requests get 503), lets
in-flight requests finish for up to --shutdown-timeout seconds, aborts the rest (their streams end with
finish_reason "abort"), then stops hypercorn and the engine and exits 0. A second signal skips the wait.

Engine failure: when a step fails the engine is dead for good. In-flight streams get an `data: {"error": ...}`
event and `[DONE]`, /health and new requests get 503 at once; the CLI notices within ENGINE_WATCH_INTERVAL,
keeps answering 503 for ENGINE_DEAD_LINGER seconds (probes and load balancers see the state), drains the
in-flight requests (which end at once: they already have their error) and exits with status 1, so that a
supervisor restarts the server rather than keeping a process that can never serve.

"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import signal
import socket
import sys
import time
from typing import Optional, Sequence

import asyncengine
from asyncengine.api.app import DEFAULT_MAX_BODY_BYTES, DEFAULT_PING_INTERVAL, create_app
from asyncengine.api.reasoning import REASONING_PARSERS
from asyncengine.api.tool_calls import TOOL_PARSERS
from asyncengine.engine_core import (API_CPU_PRIORITIES, check_api_cpu_priority, leave_a_core_for_the_event_loop,
                                     let_a_cpu_engine_process_wait_passively, run_threads_at_idle_priority)
from asyncengine.quantization import QUANTIZATION_CHOICES

logger = logging.getLogger("asyncengine.api")

PROG = "asyncengine"
ENGINE_WATCH_INTERVAL = 0.1  # seconds between checks of the engine's health
ENGINE_DEAD_LINGER = 1.0  # seconds of 503s after the engine died, before the server shuts down
ENGINE_DEAD_DRAIN = 2.0  # then at most this long for in-flight responses to finish sending their error
EXIT_ENGINE_DEAD = 1
# Seconds an idle HTTP/1.1 connection stays open (hypercorn's own default, like uvicorn's, is 5). When the server
# closes an idle connection at the very moment a client reuses it, the client's request is reset (httpx ReadError)
# and a POST is not retried. Clients' pools drop idle connections after 5 s (httpx) to 15 s (aiohttp), so a longer
# server timeout leaves the closing to them; it also covers a client whose event loop stalls for seconds between
# connecting and sending (a burst of 1,000 requests from one process; hypercorn starts this timer at accept). 75 s
# is nginx's default.
DEFAULT_TIMEOUT_KEEP_ALIVE = 75.0
LOG_LEVELS = ["critical", "error", "warning", "info", "debug", "trace"]  # uvicorn's; trace logs as debug
DEMO_PROMPTS = ["ROMEO:", "In the beginning", "To be, or not to be,"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description="asyncengine: LLM inference and serving. With no "
                                     "subcommand, runs `generate` (the offline demo).")
    parser.add_argument("-v", "--version", action="version", version=f"%(prog)s {asyncengine.__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    serve = commands.add_parser("serve", help="serve a model over the OpenAI-compatible HTTP / WebSocket API",
                                description="Serve a model over the OpenAI-compatible HTTP / WebSocket API.")
    serve_parser(serve)
    _ray_args(serve.add_argument_group("Ray Serve replicas (needs the 'ray' extra: pip install 'asyncengine[ray]')"))
    generate_parser(commands.add_parser("generate", help="continue prompts with the offline engine (the demo)",
                                        description="Continue a few prompts with the offline engine and print "
                                                    "the text."))
    bench = commands.add_parser("bench", help="benchmarks (needs the 'bench' extra)")
    bench_commands = bench.add_subparsers(dest="bench_command", required=True, metavar="BENCHMARK")
    bench_serve = bench_commands.add_parser(
        "serve", help="stream completions from a running server under load; report TTFT, TPOT, ITL, throughput",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    from asyncengine.loadtest.__main__ import DESCRIPTION, add_arguments  # needs only the core install

    bench_serve.description = DESCRIPTION
    add_arguments(bench_serve)
    bench_serve.set_defaults(bench_parser=bench_serve)  # run() reports usage errors through it
    return parser


def serve_parser(serve: argparse.ArgumentParser) -> None:
    serve.add_argument("model", nargs="?", default=None,
                       help="local Hugging Face checkpoint folder (default: the model shipped with the package)")
    serve.add_argument("--model", dest="model_option", metavar="MODEL", default=None,
                       help="the same as the positional MODEL (vLLM's older spelling)")
    _server_args(serve.add_argument_group("server"))
    _frontend_args(serve.add_argument_group("OpenAI front end"))
    _engine_args(serve.add_argument_group("engine"))


def _server_args(server) -> None:
    server.add_argument("--host", default="0.0.0.0", help="address to listen on (default: all interfaces)")
    server.add_argument("--port", type=int, default=8000, help="port (0: any free port)")
    server.add_argument("--api-key", default=None, help="require 'Authorization: Bearer <key>' (all but /health)")
    server.add_argument("--shutdown-timeout", type=float, default=10.0,
                        help="seconds in-flight requests may run on after SIGTERM before they are aborted")
    server.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
                        help="largest request body (and WebSocket message)")
    server.add_argument("--timeout-keep-alive", type=float, default=DEFAULT_TIMEOUT_KEEP_ALIVE,
                        help="seconds an idle keep-alive connection stays open (longer than clients' pools keep "
                             "theirs, so that the server never closes one a client is reusing)")
    server.add_argument("--ping-interval", type=float, default=DEFAULT_PING_INTERVAL,
                        help="seconds of silence before an SSE ': ping' comment (0: never)")
    server.add_argument("--no-ui", action="store_true", help="do not serve the chat page at /")
    server.add_argument("--log-level", "--uvicorn-log-level", dest="log_level", default="info", choices=LOG_LEVELS)
    server.add_argument("--allowed-origins", type=_json_list, default=None, metavar="JSON",
                        help='origins allowed to use the API from a browser (CORS headers; WebSocket handshakes '
                             'from other origins than these and our own get a 403), a JSON list such as '
                             '\'["https://app.example"]\' or \'["*"]\' (default: no CORS headers; vLLM\'s default '
                             'is ["*"])')
    server.add_argument("--ssl-keyfile", default=None, help="serve HTTPS with this private key (PEM)")
    server.add_argument("--ssl-certfile", default=None, help="... and this certificate chain (PEM)")
    server.add_argument("--root-path", default="", help="the path prefix a proxy serves us under (ASGI root_path); "
                        "requests work with or without it, /openapi.json names it as the server URL")


def _frontend_args(front) -> None:
    front.add_argument("--served-model-name", nargs="+", default=None, help="model name(s) clients use")
    front.add_argument("--chat-template", default=None,
                       help="chat template for /v1/chat/completions: a file, or the template itself (Jinja)")
    front.add_argument("--generation-config", default="auto",
                       help="sampling defaults for requests that leave them unset: 'auto' reads the model's "
                            "generation_config.json (temperature, top_p, top_k, min_p, repetition_penalty, "
                            "max_new_tokens), 'vllm' ignores it, a folder reads that folder's")
    front.add_argument("--max-logprobs", type=int, default=20,
                       help="most logprobs (top_logprobs for chat) a request may ask for; more gets a 400 "
                            "(at most 20, the engine's limit; -1: that limit)")
    logs = front.add_mutually_exclusive_group()
    logs.add_argument("--enable-log-requests", dest="log_requests", action="store_true", default=False,
                      help="log one line per request: id, prompt tokens, sampling parameters")
    logs.add_argument("--disable-log-requests", dest="log_requests", action="store_false",
                      help="do not log requests (the default)")
    front.add_argument("--enable-auto-tool-choice", action="store_true",
                       help='answer tool_choice "auto" (needs --tool-call-parser), as vLLM')
    front.add_argument("--tool-call-parser", default=None, choices=sorted(TOOL_PARSERS),
                       help='the format tool calls are read from under tool_choice "auto"')
    front.add_argument("--reasoning-parser", default=None, choices=sorted(REASONING_PARSERS),
                       help="send <think> blocks as reasoning_content")


def _engine_args(engine) -> None:
    engine.add_argument("--tokenizer", default=None, help="tokenizer folder (default: the model's)")
    engine.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16", "half", "float"])
    engine.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    engine.add_argument("--seed", type=int, default=0)
    engine.add_argument("--max-model-len", type=int, default=None)
    engine.add_argument("--max-num-seqs", type=int, default=None, help="default: 256 on CUDA, 64 on CPU")
    engine.add_argument("--max-num-batched-tokens", type=int, default=None, help="default: 8192 on CUDA, 2048 on CPU")
    engine.add_argument("--block-size", type=int, default=16)
    engine.add_argument("--num-kv-blocks", type=int, default=None)
    engine.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                        help="fraction of the GPU's memory the engine may use (weights, activations, KV cache)")
    engine.add_argument("--enforce-eager", action="store_true", help="never capture CUDA graphs")
    engine.add_argument("--quantization", "-q", default=None, choices=list(QUANTIZATION_CHOICES),
                        help="weight format (default: the checkpoint's quantization_config); fp8 (and int8, on CPU) "
                             "on an unquantized checkpoint quantize its weights at load time; awq_marlin and "
                             "gptq_marlin (vLLM's names) load AWQ and GPTQ checkpoints on our own int4 kernels")
    engine.add_argument("--kv-cache-dtype", default="auto",
                        help="KV cache storage: auto (the model's dtype), fp8 or fp8_e4m3 (e4m3 with the "
                             "checkpoint's per-layer k/v scales, else 1.0: half the memory of bf16, twice the "
                             "blocks; GPUs of compute capability 8.9+ and CPU)")
    engine.add_argument("--max-queue-len", type=int, default=None, help="waiting requests beyond this get 429")
    engine.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    engine.add_argument("--min-prefill-batch", type=int, default=None,
                        help="a nearly full batch admits waiting requests in groups of this many (default: "
                             "max-num-seqs / 16; 1: as soon as a slot frees)")
    engine.add_argument("--stream-interval", type=int, default=1, metavar="N",
                        help="stream each request's tokens in groups of N (its first token and its end at once): "
                             "1/N of the host work per token for coarser streams (default 1: every token)")
    engine.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                        help="prepare and launch the next step before the last one's tokens are read back "
                             "(default: on CUDA)")
    engine.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=True,
                        help="run the engine in a process of its own, so HTTP framing and the engine's steps use "
                             "two cores (measured: 1.1-1.25x the requests/s of one process under load on an H100, "
                             "1.1x the tokens/s on 2 CPU cores; loadtest/RESULTS.md). Default: on")
    engine.add_argument("--api-cpu-priority", default="normal", choices=API_CPU_PRIORITIES,
                        help="the server's CPU priority beside its engine process. idle (Linux SCHED_IDLE): HTTP "
                             "and SSE work runs only on CPU time no other thread wants, and an engine on CPU "
                             "waits passively (OMP_WAIT_POLICY=PASSIVE unless set); on a machine that only serves "
                             "on CPU, 64 streams from clients elsewhere kept 0.71 of the offline tokens/s against "
                             "0.65 (2 cores), but any other busy process in the same session or container starves "
                             "the server. Default: normal")
    _parallel_args(engine)
    engine.add_argument("--runner", default="auto", choices=["auto", "generate", "pooling"],
                        help="generate text, or pool (/v1/embeddings; /score and /rerank for cross-encoders); "
                             "auto: pooling for encoder checkpoints (BERT) and sentence-transformers checkpoints, "
                             "else generate")


def _ray_args(ray) -> None:
    """Flags of `serve --ray-replicas N` (asyncengine/ray_serve.py); the rest of `serve`'s flags mean the same
    there. The JSON options pass through to Ray Serve unchanged."""
    ray.add_argument("--ray-replicas", type=_replicas, default=None, metavar="N",
                     help="serve N replicas of the engine behind one route with Ray Serve ('auto' with "
                          "--ray-autoscaling-config: let Ray Serve scale them)")
    ray.add_argument("--ray-autoscaling-config", type=_json_object, default=None, metavar="JSON",
                     help="Ray Serve's autoscaling_config, e.g. '{\"min_replicas\": 1, \"max_replicas\": 4}'")
    ray.add_argument("--ray-actor-options", type=_json_object, default=None, metavar="JSON",
                     help="Ray's ray_actor_options of each replica, e.g. '{\"num_cpus\": 1, \"num_gpus\": 1}' "
                          "(default: one GPU each where this machine has CUDA and --device is not cpu)")
    ray.add_argument("--ray-max-ongoing-requests", type=int, default=None, metavar="N",
                     help="Ray Serve's max_ongoing_requests per replica (default: 256, so that continuous "
                          "batching sees the load; Ray Serve's own default is 5)")
    ray.add_argument("--ray-address", default=None,
                     help="the Ray cluster to deploy on ('auto': the one started with `ray start`; default: "
                          "start a private single-node Ray on this machine, stopped on exit). Where Serve already "
                          "runs on that cluster, its proxy keeps the host and port it was started with")


def _replicas(text: str):
    """argparse type of --ray-replicas: a positive number, or 'auto' (Ray Serve's num_replicas)."""
    if text == "auto":
        return text
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a number of replicas (1 or more) or 'auto', got {text!r}")
    return int(text)


def _json_object(text: str) -> dict:
    """argparse type of the Ray options: a JSON object."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        value = None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object such as '{{\"num_cpus\": 1}}', got {text!r}")
    return value


def _parallel_args(group) -> None:
    group.add_argument("-tp", "--tensor-parallel-size", type=int, default=1,
                       help="split the model's layers over N ranks (one GPU each on CUDA, one process each on CPU)")
    group.add_argument("--distributed-executor-backend", default="mp", choices=["mp", "ray"],
                       help="start ranks 1..N-1 as processes of our own (mp) or as Ray actors in a placement group "
                            "(ray: pip install 'asyncengine[ray]')")
    group.add_argument("--step-timeout", type=float, default=300.0, metavar="SECONDS",
                       help="with -tp > 1: a step unfinished this long means a hung rank, and the engine dies "
                            "(its workers killed; /health then answers 503). Default: 300, as vLLM's "
                            "VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS (the first step, whose kernels may still compile, "
                            "gets 600; loading and CUDA-graph capture are not timed by it)")


def _json_list(text: str) -> list[str]:
    """argparse type of --allowed-origins: a JSON list of strings (as vLLM takes it)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        value = None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise argparse.ArgumentTypeError(f"expected a JSON list of strings such as '[\"*\"]', got {text!r}")
    return value


def generate_parser(generate: argparse.ArgumentParser) -> None:
    generate.add_argument("--model", default=None, help="local HF checkpoint folder (default: the embedded model)")
    generate.add_argument("--prompt", action="append", help="a prompt (repeatable); default: a few demo prompts")
    generate.add_argument("--max-tokens", type=int, default=64)
    generate.add_argument("--temperature", type=float, default=0.8)
    generate.add_argument("--top-p", type=float, default=0.95)
    generate.add_argument("--seed", type=int, default=0)
    generate.add_argument("--max-model-len", type=int, default=None)
    generate.add_argument("--dtype", default="auto")
    _parallel_args(generate)


def engine_config(args: argparse.Namespace):
    """The EngineConfig that `serve`'s arguments name (ValueError when they are inconsistent)."""
    from asyncengine.config import EngineConfig

    if args.model_option is not None and args.model is not None and args.model_option != args.model:
        raise ValueError(f"model given twice: {args.model!r} and --model {args.model_option!r}")
    config = EngineConfig(
        model=args.model or args.model_option,
        tokenizer=args.tokenizer,
        served_model_name=args.served_model_name[0] if args.served_model_name else None,
        dtype=args.dtype,
        device=args.device,
        seed=args.seed,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        block_size=args.block_size,
        num_kv_blocks=args.num_kv_blocks,
        gpu_memory_utilization=args.gpu_memory_utilization,
        enforce_eager=args.enforce_eager,
        quantization=args.quantization,
        kv_cache_dtype=args.kv_cache_dtype,
        max_queue_len=args.max_queue_len,
        enable_prefix_caching=args.enable_prefix_caching,
        min_prefill_batch=args.min_prefill_batch,
        stream_interval=args.stream_interval,
        async_scheduling=args.async_scheduling,
        engine_process=args.engine_process,
        runner=args.runner,
        tensor_parallel_size=args.tensor_parallel_size,
        distributed_executor_backend=args.distributed_executor_backend,
        step_timeout_s=args.step_timeout,
    )
    return config


def serving_options(args: argparse.Namespace, model_path: str):
    """The OpenAI front end's settings that `serve`'s arguments name (ValueError naming a bad flag)."""
    from asyncengine.api.inputs import SamplingPolicy
    from asyncengine.api.serving import ServingOptions
    from asyncengine.tokenizer import resolve_chat_template

    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")
    return ServingOptions(
        chat_template=resolve_chat_template(args.chat_template) if args.chat_template is not None else None,
        policy=SamplingPolicy.from_generation_config(args.generation_config, model_path, args.max_logprobs),
        log_requests=args.log_requests,
    )


def app_for_args(engine, args: argparse.Namespace, options):
    """The OpenAI app over `engine` with the front end and server settings that `serve`'s arguments name
    (options: from serving_options). The one place `serve`'s flags meet create_app (the CLI's server and each
    Ray Serve replica use it)."""
    if options.policy.defaults:  # as vLLM says it: a request's unset fields no longer mean the engine's defaults
        logger.info("sampling defaults from the generation config (--generation-config %s): %s",
                    args.generation_config, options.policy.defaults)
    return create_app(engine, api_key=args.api_key, served_model_name=args.served_model_name,
                      max_body_bytes=args.max_body_bytes, ping_interval=args.ping_interval or None,
                      ui=not args.no_ui, allowed_origins=args.allowed_origins, options=options,
                      enable_auto_tool_choice=args.enable_auto_tool_choice, tool_call_parser=args.tool_call_parser,
                      reasoning_parser=args.reasoning_parser)


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket (bound now, so the real port is known before serving)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.create_server((host, port), family=family, backlog=2048)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def url_of(sock: socket.socket, scheme: str = "http") -> str:
    host, port = sock.getsockname()[:2]
    return f"{scheme}://[{host}]:{port}" if ":" in host else f"{scheme}://{host}:{port}"


def close_connections_at_peer_eof() -> None:
    """Make hypercorn close a connection as soon as its client has closed it (idempotent).

    hypercorn (0.17-0.18) runs each connection in a task group with an idle timer (`keep_alive_timeout`) and closes
    the socket only when every task of the group has ended. When the client closes an idle keep-alive connection,
    the read loop ends at EOF but the timer runs on, so the socket stays in CLOSE_WAIT, with its descriptor, its
    tasks and its buffers, for the whole timeout: 75 s here (DEFAULT_TIMEOUT_KEEP_ALIVE). Clients close idle
    connections all the time (httpx's pool after 5 s; any client without keep-alive after each response), so they
    piled up: ~300 sockets and ~1,000 tasks under the soak test's load, the API server's RSS creep of 1.6-3 MiB a
    minute, and at a few tens of new connections a second a process's 1,024 descriptors. After EOF no request can
    come on the connection, so ending the timer there loses nothing; a response still being sent had already been
    told of the disconnect by hypercorn itself. tests/test_server_connections.py checks both sides."""
    from hypercorn.asyncio.tcp_server import TCPServer

    if getattr(TCPServer, "_closes_at_peer_eof", False):
        return
    if not hasattr(TCPServer, "_read_data"):  # another hypercorn: tests/test_server_connections.py fails
        logger.warning("this hypercorn has no TCPServer._read_data: connections its clients closed stay open until "
                       "--timeout-keep-alive ends them")
        return
    read_until_eof = TCPServer._read_data

    async def read_then_end_idle_timer(self) -> None:
        await read_until_eof(self)  # returns at EOF or a read error, after telling the protocol `Closed()`
        await self.idle_task.stop()

    TCPServer._read_data = read_then_end_idle_timer
    TCPServer._closes_at_peer_eof = True


def hypercorn_config(sock: socket.socket, *, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
                     ssl_keyfile: Optional[str] = None, ssl_certfile: Optional[str] = None, root_path: str = "",
                     timeout_keep_alive: float = DEFAULT_TIMEOUT_KEEP_ALIVE):
    """Hypercorn settings for serving on `sock`, which is handed over (detached) to hypercorn. With a key and
    a certificate, hypercorn wraps the socket in TLS (and speaks HTTP/2 to clients that offer it)."""
    from hypercorn.config import Config

    close_connections_at_peer_eof()
    config = Config()
    config.bind = [f"fd://{sock.detach()}"]
    config.backlog = 2048
    config.graceful_timeout = 5.0
    config.keep_alive_timeout = timeout_keep_alive  # see DEFAULT_TIMEOUT_KEEP_ALIVE
    config.websocket_max_message_size = max_body_bytes
    config.accesslog = None
    config.errorlog = logging.getLogger("hypercorn.error")  # through the application's logging, not a 2nd handler
    config.keyfile, config.certfile = ssl_keyfile, ssl_certfile
    config.root_path = root_path
    return config


def check_tls(args: argparse.Namespace) -> None:
    """Both TLS files or neither, and readable: hypercorn would only fail once serving."""
    if (args.ssl_keyfile is None) != (args.ssl_certfile is None):
        raise ValueError("--ssl-keyfile and --ssl-certfile go together: give both or neither")
    if args.ssl_keyfile is not None:
        import ssl

        try:
            ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(args.ssl_certfile, args.ssl_keyfile)
        except (OSError, ssl.SSLError) as exc:
            raise ValueError(f"--ssl-certfile / --ssl-keyfile: cannot load them: {exc}") from None


async def serve_app(app, sock: socket.socket, stop: asyncio.Event, *, shutdown_timeout: float = 10.0,
                    **hypercorn_options) -> None:
    """Serve `app` (from create_app) on `sock` until `stop` is set; then drain the app
    (`app.state.server.shutdown`) and only then let hypercorn stop, so streams end with their last chunks.
    hypercorn_options: keyword arguments of hypercorn_config."""
    from hypercorn.asyncio import serve

    async def shutdown_trigger() -> None:
        await stop.wait()
        logger.info("shutting down: draining in-flight requests for up to %.1f s", shutdown_timeout)
        await app.state.server.shutdown(shutdown_timeout)
        logger.info("in-flight requests ended; stopping the HTTP server")

    await serve(app, hypercorn_config(sock, **hypercorn_options), shutdown_trigger=shutdown_trigger)


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
        await serve_app(app, sock, stop, shutdown_timeout=args.shutdown_timeout, max_body_bytes=args.max_body_bytes,
                        ssl_keyfile=args.ssl_keyfile, ssl_certfile=args.ssl_certfile, root_path=args.root_path,
                        timeout_keep_alive=args.timeout_keep_alive)
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


def serve(args: argparse.Namespace) -> int:
    """`asyncengine serve`: exit status 0 after a signal, 1 when the engine died, 2 on bad flags."""
    level = "DEBUG" if args.log_level == "trace" else args.log_level.upper()
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from asyncengine.async_engine import AsyncLLMEngine

    if args.ray_replicas is not None:
        from asyncengine.ray_serve import serve_with_ray

        return serve_with_ray(args)
    try:
        check_tls(args)
        if args.enable_auto_tool_choice and args.tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")
        if not args.timeout_keep_alive > 0:
            raise ValueError(f"--timeout-keep-alive must be a positive number of seconds, got {args.timeout_keep_alive}")
        config = engine_config(args)
        options = serving_options(args, config.model)
        if not config.engine_process:  # an engine process keeps every core: its event loop is elsewhere
            leave_a_core_for_the_event_loop(config)
        check_api_cpu_priority(config, args.api_cpu_priority)
        let_a_cpu_engine_process_wait_passively(config, args.api_cpu_priority)
        engine = AsyncLLMEngine(config)
        sock = bind_socket(args.host, args.port)
        if args.api_cpu_priority == "idle":  # after the engine process started: it must not inherit the policy
            run_threads_at_idle_priority()
    except (ValueError, OSError, RuntimeError) as exc:  # RuntimeError: an engine process that died starting
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    app = app_for_args(engine, args, options)
    scheme = "https" if args.ssl_certfile else "http"
    print(f"asyncengine serving on {url_of(sock, scheme)}", flush=True)
    return _run(_serve_until_signal(app, engine, sock, args))


def generate(args: argparse.Namespace) -> int:
    """`asyncengine generate`: continue the prompts (or the demo's) and print each text, then the speed."""
    from asyncengine import LLM, SamplingParams

    try:
        llm = LLM(args.model, dtype=args.dtype, max_model_len=args.max_model_len, seed=args.seed,
                  tensor_parallel_size=args.tensor_parallel_size,
                  distributed_executor_backend=args.distributed_executor_backend,
                  step_timeout_s=args.step_timeout)
        params = SamplingParams(temperature=args.temperature, top_p=args.top_p, max_tokens=args.max_tokens,
                                seed=args.seed)
    except ValueError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    prompts = args.prompt or DEMO_PROMPTS
    start = time.perf_counter()
    try:
        outputs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
    finally:
        llm.close()
    tokens = 0
    for out in outputs:
        completion = out.outputs[0]
        tokens += len(completion.token_ids)
        print(f"--- {out.prompt!r}\n{out.prompt}{completion.text}\n")
    print(f"[{len(outputs)} prompts, {tokens} tokens in {elapsed:.2f} s: {tokens / elapsed:.0f} tokens/s on "
          f"{llm.engine.runner.device}, model {llm.engine.config.model}]")
    return 0


def with_default_command(argv: Sequence[str]) -> list[str]:
    """`generate` when no subcommand is named: nothing at all, or options first (`asyncengine --prompt X`)."""
    argv = list(argv)
    if not argv or (argv[0].startswith("-") and argv[0] not in ("-h", "--help", "-v", "--version")):
        return ["generate", *argv]
    return argv


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(with_default_command(sys.argv[1:] if argv is None else argv))
    if args.command == "serve":
        return serve(args)
    if args.command == "generate":
        return generate(args)
    from asyncengine.loadtest.__main__ import run

    bench_args = {k: v for k, v in vars(args).items() if k not in ("command", "bench_command", "bench_parser")}
    return run(args.bench_parser, argparse.Namespace(**bench_args))


if __name__ == "__main__":
    sys.exit(main())

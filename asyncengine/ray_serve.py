"""Ray Serve replicas of the engine behind one OpenAI-compatible route (needs `pip install 'asyncengine[ray]'`).

    serve run asyncengine.ray_serve:build_app model=/path/to/model num_replicas=2 api-key=KEY
    asyncengine serve /path/to/model --ray-replicas 2 [any other `serve` flag]

Each replica is a Ray Serve deployment replica that holds an AsyncLLMEngine in its own process (its engine core
in a child process, as `serve`'s default --engine-process does) and serves the same Starlette app as
`asyncengine serve` through Ray Serve's ASGI ingress: chat/completions, SSE streaming, /v1/models, the API key,
the WebSocket /v1/ws.
Ray Serve's HTTP proxy routes each request to a replica; every response carries the replica that answered in
the `x-asyncengine-replica` header (Ray's full replica id, also the name of its actor in the "serve" namespace).

What is Ray Serve's and not ours: routing and queueing (max_ongoing_requests per replica), autoscaling
(autoscaling_config), placement (ray_actor_options), health checks (each replica's `check_health` raises once
its engine is dead, and Ray replaces the replica), restarts of replicas that die, graceful shutdown.

Arguments: the engine and front-end arguments are `asyncengine serve`'s, parsed by its own parser (api/cli.py),
so each flag means the same in a replica. `build_app` takes them as Serve's `key=value` arguments, spelled with
dashes or underscores (`max-num-seqs=32`, `enable_prefix_caching=false`), plus the deployment options
DEPLOYMENT_OPTIONS under Ray Serve's own names. Where the proxy listens (host, port, TLS) is Ray Serve's
http_options, not a replica's: build_app refuses those flags, and `serve --ray-replicas` hands them to Serve.
On the private Ray that `serve --ray-replicas` starts, nothing listens beyond loopback but that proxy (where --host
says): Serve's gRPC proxy stays off (GRPC_OFF) and each replica's gRPC server moves to loopback
(bind_internal_grpc_to).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import socket
import sys
from typing import Any, Optional

logger = logging.getLogger(__name__)

RAY_EXTRA = "pip install 'asyncengine[ray]'"
APP_NAME = "asyncengine"
DEPLOYMENT_NAME = "AsyncEngine"
REPLICA_HEADER = "x-asyncengine-replica"
# Ray Serve's own default is 5 ongoing requests per replica, which would starve continuous batching: the engine
# batches up to max_num_seqs (64 on CPU, 256 on CUDA) and queues more itself.
DEFAULT_MAX_ONGOING_REQUESTS = 256
# Ray Serve's default is a health check every 10 s; ours only asks whether the engine is alive (no I/O), so a
# shorter period lets Ray replace a replica whose engine died sooner (meanwhile it answers 503).
HEALTH_CHECK_PERIOD_S = 2.0
# Ray Serve's names of the deployment options build_app passes through (`serve run ... num_replicas=2`).
DEPLOYMENT_OPTIONS = ("num_replicas", "autoscaling_config", "ray_actor_options", "max_ongoing_requests")
# `serve` flags that belong to Ray Serve's HTTP proxy (http_options), not to a replica.
PROXY_FLAGS = ("host", "port", "ssl_keyfile", "ssl_certfile", "root_path")
# Serve's gRPC proxy, stated off: Ray Serve starts it only for registered servicer functions, and the OpenAI API
# is HTTP (SSE, WebSocket), so we register none; only the HTTP proxy listens, where --host and --port say.
GRPC_OFF = {"grpc_servicer_functions": []}
LOOPBACK = "127.0.0.1"
# A private Ray's object store: requests and outputs travel over HTTP and Ray's RPCs, not through the store,
# so the default (30% of the machine's memory) would only reserve shared memory nobody uses.
PRIVATE_OBJECT_STORE_BYTES = 256 * 1024 * 1024


def import_serve():
    """`ray.serve`, or ImportError naming the extra to install."""
    try:
        from ray import serve
    except ImportError as exc:
        raise ImportError(f"Ray Serve replicas need Ray, which is not installed: {RAY_EXTRA}") from exc
    return serve


# -- one replica ------------------------------------------------------------------------------------------------
class ReplicaHeader:
    """ASGI middleware: every HTTP response and WebSocket handshake names the replica that answered."""

    def __init__(self, app, replica: str):
        self.app = app
        self.header = (REPLICA_HEADER.encode(), replica.encode())

    async def __call__(self, scope, receive, send):
        if scope["type"] not in ("http", "websocket"):
            return await self.app(scope, receive, send)

        async def send_with_header(message):
            if message["type"] in ("http.response.start", "websocket.accept"):
                message = {**message, "headers": [*message.get("headers", []), self.header]}
            await send(message)

        await self.app(scope, receive, send_with_header)


class EngineReplica:
    """One Ray Serve replica: an AsyncLLMEngine in this process and the OpenAI app over it.

    Ray Serve builds the app after the constructor (`__serve_build_asgi_app__`, the ingress's late binding),
    calls `check_health` every health_check_period_s (an exception marks the replica unhealthy and Ray replaces
    it), and `__del__` on graceful shutdown, after its own drain of ongoing requests."""

    def __init__(self, args: argparse.Namespace, internal_grpc_host: Optional[str] = None):
        from ray import serve

        from asyncengine.api.cli import engine_config, serving_options
        from asyncengine.async_engine import AsyncLLMEngine

        if internal_grpc_host is not None:
            bind_internal_grpc_to(internal_grpc_host)
        self.args = args
        config = engine_config(args)
        self.options = serving_options(args, config.model)
        self.engine = AsyncLLMEngine(config)  # torch's threads: Ray sets OMP_NUM_THREADS from num_cpus
        self.replica = serve.get_replica_context().replica_id.to_full_id_str()
        self.openai_app = None  # not `app`: Ray's ingress wrapper owns that name

    def __serve_build_asgi_app__(self):
        from asyncengine.api.cli import app_for_args

        self.openai_app = app_for_args(self.engine, self.args, self.options)
        self.openai_app.add_middleware(ReplicaHeader, replica=self.replica)
        return self.openai_app

    def check_health(self) -> None:
        """Raise (EngineDeadError) once the engine can no longer serve, so that Ray replaces this replica."""
        self.engine.check_health()

    async def __del__(self):
        app, engine = getattr(self, "openai_app", None), getattr(self, "engine", None)  # None: __init__ failed
        if app is not None:  # Ray has drained what it could: end the rest, then stop the engine
            await app.state.server.shutdown(0.0)
        if engine is not None:
            await engine.shutdown()


def bind_internal_grpc_to(host: str) -> None:
    """Make this replica's gRPC server for calls between deployments listen on `host`, not every interface.

    Ray Serve (2.60 and the versions before it) starts that server on "[::]:0", hard-coded and not configurable,
    right after the replica's constructor returns (ray/serve/_private/replica.py: `_on_initialized`). On our
    private single-node Ray, whose own servers listen on loopback, nothing calls it from another machine (and Serve's
    proxy calls replicas through Ray's actor calls unless RAY_SERVE_USE_GRPC_BY_DEFAULT=1), so it may listen on
    loopback too: the address the replica module passes to Ray's `add_port_to_grpc_server` is rewritten here,
    in this replica's process only. A Ray whose replica module has no such name is left as it is."""
    from ray.serve._private import replica as serve_replica

    add_port = getattr(serve_replica, "add_port_to_grpc_server", None)
    if add_port is None or getattr(add_port, "asyncengine_host", None) is not None:
        return

    def add_port_on_host(server, address: str):
        if address.startswith("[::]:"):
            address = f"{host}:{address[len('[::]:'):]}"
        return add_port(server, address)

    add_port_on_host.asyncengine_host = host
    serve_replica.add_port_to_grpc_server = add_port_on_host


def deployment(args: argparse.Namespace, **options: Any):
    """The Ray Serve deployment of EngineReplica, with Ray Serve's deployment options (num_replicas,
    autoscaling_config, ray_actor_options, max_ongoing_requests, ...) and the graceful shutdown and log level
    that `args` names. ImportError naming the extra without Ray."""
    serve = import_serve()
    options.setdefault("max_ongoing_requests", DEFAULT_MAX_ONGOING_REQUESTS)
    options.setdefault("health_check_period_s", HEALTH_CHECK_PERIOD_S)
    level = "DEBUG" if args.log_level == "trace" else args.log_level.upper()
    return serve.deployment(
        serve.ingress()(EngineReplica), name=DEPLOYMENT_NAME, graceful_shutdown_timeout_s=args.shutdown_timeout,
        logging_config={"log_level": level}, **options,
    )


# -- `serve run asyncengine.ray_serve:build_app key=value ...` ---------------------------------------------------
class _Parser(argparse.ArgumentParser):
    """`serve`'s parser that raises ValueError instead of exiting (we run inside Ray Serve's builder call)."""

    def error(self, message: str):
        raise ValueError(f"{self.prog}: {message}")


def parse_serve_args(values: dict[str, Any]) -> argparse.Namespace:
    """`asyncengine serve`'s arguments from Serve's `key=value` pairs (ValueError naming a bad one).
    A value of true / false is a switch (`--flag` / `--no-flag`), a list repeats the value."""
    from asyncengine.api.cli import serve_parser

    parser = _Parser(prog="asyncengine.ray_serve:build_app", add_help=False)
    serve_parser(parser)
    known_flags = parser._option_string_actions  # argparse keeps no public list of its option strings
    argv: list[str] = []
    for key, value in values.items():
        name = key.replace("-", "_")
        if name in PROXY_FLAGS:
            raise ValueError(f"{key}: where Ray Serve's proxy listens is its http_options (a Serve config file's, "
                             f"`serve start --http-host/--http-port` before `serve run`, or `asyncengine serve "
                             f"--ray-replicas` with --host/--port), not a replica's argument")
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool) or str(value).lower() in ("true", "false"):
            on = value if isinstance(value, bool) else value.lower() == "true"
            if on or "--no-" + flag[2:] in known_flags:
                argv.append(flag if on else "--no-" + flag[2:])
            elif flag not in known_flags:
                argv.append(flag)  # argparse names it as unrecognized
            # else: a plain switch (--enable-auto-tool-choice) that is off: its default
        elif isinstance(value, (list, tuple)):
            argv += [flag, *map(str, value)]
        else:
            argv += [flag, str(value)]
    return parser.parse_args(argv)


def _json_option(name: str, value: Any) -> Any:
    """A deployment option given on `serve run`'s command line arrives as a string: JSON, or an integer."""
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError:
        if name == "num_replicas" and value == "auto":
            return value
        raise ValueError(f"{name}: expected JSON (an object, or a number), got {value!r}") from None


def build_app(cli_args: dict[str, Any]):
    """Ray Serve's application builder (`serve run asyncengine.ray_serve:build_app model=... num_replicas=2`):
    the deployment options in DEPLOYMENT_OPTIONS go to Ray Serve, every other key is a `serve` flag."""
    options = {k: _json_option(k, v) for k, v in cli_args.items() if k in DEPLOYMENT_OPTIONS}
    args = parse_serve_args({k: v for k, v in cli_args.items() if k not in DEPLOYMENT_OPTIONS})
    check_replica_args(args)
    return deployment(args, **options).bind(args)


# -- `asyncengine serve --ray-replicas N ...` -------------------------------------------------------------------
class _Stop(BaseException):
    """Raised in the main thread by the first SIGTERM / SIGINT: leave whatever it was doing and shut down."""


def deployment_options(args: argparse.Namespace) -> dict[str, Any]:
    """Ray Serve's deployment options that `serve --ray-*` flags name (ValueError naming a flag)."""
    check_replica_args(args)
    options: dict[str, Any] = {}
    replicas = args.ray_replicas
    if args.ray_autoscaling_config is not None:
        if replicas != "auto":
            raise ValueError("--ray-autoscaling-config lets Ray Serve choose the number of replicas: give "
                             "--ray-replicas auto with it")
        options["autoscaling_config"] = args.ray_autoscaling_config
    elif replicas == "auto":
        raise ValueError("--ray-replicas auto needs --ray-autoscaling-config (its min_replicas, max_replicas)")
    options["num_replicas"] = replicas
    if args.ray_max_ongoing_requests is not None:
        options["max_ongoing_requests"] = args.ray_max_ongoing_requests
    options["ray_actor_options"] = args.ray_actor_options if args.ray_actor_options is not None else (
        _default_actor_options(args.device, args.tensor_parallel_size))
    return options


def _default_actor_options(device: str, tensor_parallel_size: int) -> dict[str, Any]:
    """One GPU per rank of a replica (its ranks are processes of its own, on its node: -tp N takes N GPUs) where
    this machine has CUDA and the engine may use it (without num_gpus Ray hides the GPUs from the replica, whose
    engine would then run on CPU); Ray's defaults otherwise."""
    import torch

    return {"num_gpus": tensor_parallel_size} if device != "cpu" and torch.cuda.is_available() else {}


def check_replica_args(args: argparse.Namespace) -> None:
    """ValueError naming the flag for what a replica cannot run: tensor parallelism other than the `mp`
    backend's processes (Ray actors of a placement group of their own would not hold the replica's GPUs), and an
    idle CPU priority."""
    if args.tensor_parallel_size > 1 and args.distributed_executor_backend != "mp":
        raise ValueError("--distributed-executor-backend ray is not supported inside a Ray Serve replica: a "
                         "replica's ranks are processes of its own (mp, the default), on the GPUs Ray gives it "
                         "(--ray-actor-options num_gpus, by default -tp N of them)")
    if args.api_cpu_priority == "idle":
        raise ValueError("--api-cpu-priority idle is not supported with Ray Serve replicas: a replica is a Ray "
                         "worker whose own threads (its heartbeats among them) must not wait for idle CPU time")


def _check_local_args(args: argparse.Namespace) -> None:
    """Fail before starting Ray on flags a replica would refuse (the model, the engine's and front end's flags);
    on a cluster (--ray-address) the model's path may exist only on its nodes, so the replicas check it there."""
    from asyncengine.api.cli import engine_config, serving_options

    if args.ray_address is None:
        serving_options(args, engine_config(args).model)


def free_port(host: str) -> int:
    """A port free on `host` now (Ray Serve's proxy cannot bind port 0 and report it; a race with another
    process taking it in between is possible, and then Serve's start fails with its error)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def _http_options(args: argparse.Namespace) -> dict[str, Any]:
    """Serve's http_options from `serve`'s --host, --port and --ssl-* (ValueError naming a flag)."""
    from asyncengine.api.cli import check_tls

    if args.root_path:
        raise ValueError("--root-path is not supported with --ray-replicas (Ray Serve's root_path mounts the "
                         "routes under the prefix, which is not what the flag means here)")
    check_tls(args)
    port = args.port or free_port(args.host)
    return {"host": args.host, "port": port, "ssl_keyfile": args.ssl_keyfile, "ssl_certfile": args.ssl_certfile}


def _handle_signals() -> None:
    signal.signal(signal.SIGINT, _on_signal)
    signal.signal(signal.SIGTERM, _on_signal)


def _on_signal(signum, frame) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # one shutdown; a second signal must not interrupt it
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise _Stop


def serve_with_ray(args: argparse.Namespace) -> int:
    """`asyncengine serve --ray-replicas N`: deploy the replicas, print the address, serve until SIGTERM /
    SIGINT, then shut Ray Serve down (it drains each replica for up to --shutdown-timeout) and, if this command
    started it, Ray. Exit status 0 after a signal, 2 on bad flags, a missing extra, or replicas that fail to
    start."""
    from asyncengine.api.cli import PROG

    level = "DEBUG" if args.log_level == "trace" else args.log_level.upper()
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.ray_address is None:
        # A private Ray takes no other nodes: with Ray's cluster mode off (read once, when ray is imported, and
        # inherited by every process it starts), its servers (GCS, raylet, workers) listen on loopback, not on
        # the machine's address. Serve's proxy listens where --host says. (Not configurable: Ray Serve 2.60 binds
        # each replica's gRPC server for calls between deployments to every interface.)
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    try:
        serve = import_serve()
        options = deployment_options(args)
        http_options = _http_options(args)
        _check_local_args(args)
    except (ImportError, ValueError, OSError) as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    import ray

    _handle_signals()
    try:
        _start_ray(ray, args.ray_address)
        _handle_signals()  # again: ray.init installs its own SIGTERM handler (it aborts the process)
        return _serve_until_signal(serve, args, options, http_options)
    except _Stop:
        return 0
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        _stop_ray(ray, serve, private=args.ray_address is None)


def _start_ray(ray, address: Optional[str]) -> None:
    if address is not None:
        ray.init(address=address)
        return
    # A private single-node Ray for this server, without the dashboard, never joined to a cluster that happens to
    # run here (address="local"). Its own ports are chosen free; RAY_TMPDIR moves its files (default /tmp/ray).
    ray.init(address="local", include_dashboard=False, object_store_memory=PRIVATE_OBJECT_STORE_BYTES)


def _serve_until_signal(serve, args: argparse.Namespace, options: dict, http_options: dict) -> int:
    import threading

    from asyncengine.api.cli import PROG

    serve.start(http_options=http_options, grpc_options=GRPC_OFF)
    # On our private Ray (one node, its servers on loopback) the replicas' internal gRPC servers listen on
    # loopback too; on a cluster they stay where Ray Serve puts them (other nodes call them).
    internal_grpc_host = LOOPBACK if args.ray_address is None else None
    try:
        serve.run(deployment(args, **options).bind(args, internal_grpc_host), name=APP_NAME, route_prefix="/")
    except RuntimeError as exc:  # Ray Serve's report of replicas that failed to start (bad model, flags)
        print(f"{PROG}: error: the replicas did not start: {exc}", file=sys.stderr)
        return 2
    scheme = "https" if args.ssl_certfile else "http"
    host = f"[{args.host}]" if ":" in args.host else args.host
    print(f"asyncengine serving on {scheme}://{host}:{http_options['port']}", flush=True)
    threading.Event().wait()  # until _on_signal raises _Stop here
    return 0


def _stop_ray(ray, serve, private: bool) -> None:
    """Delete our application first, while Serve's proxy still carries the streams in flight: each replica drains
    them for up to --shutdown-timeout (Serve's graceful_shutdown_timeout_s; a stream still running then is cut
    when Ray stops the replica), then its engine stops. Then, on our private Ray, Serve and Ray themselves; on a
    cluster, only disconnect (others may serve there). `serve.shutdown()` alone would stop the proxy at once and
    cut every stream."""
    if ray.is_initialized():
        try:
            if serve.status().applications.get(APP_NAME) is not None:
                serve.delete(APP_NAME)
            if private:
                serve.shutdown()
        finally:
            ray.shutdown()
    logger.info("stopped")

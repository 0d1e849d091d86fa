"""Ranks 1..N-1 of a tensor-parallel engine: how they start, what they run, and how each step reaches them.

Rank 0 is the engine's own ModelRunner: it schedules, samples and drives the steps. Every other rank is a
`follower`: a ModelRunner of its own (its shards of the weights, its heads' KV cache, its CUDA graphs) that loops
over `StepChannel.receive` and runs the same forward pass, its collectives meeting rank 0's.

    rank 0 (engine)                                   rank r (worker)
    WorkerGroup.start: spawn workers, join the world  run_worker: join the world, build ModelRunner(rank=r)
    ModelRunner.launch: StepChannel.send(inputs)  ->  StepChannel.receive() -> forward (+ logits: the gather)
    ModelRunner.close: StepChannel.send_stop()    ->  return

A step reaches the workers as two broadcasts: a fixed header [8] int64 (its sizes), on the host over the control
group (parallel_state: no timeout, since a worker waits on it as long as the engine is idle), and one packed int64
tensor on the device (ids, positions, slots, query starts, lengths, block tables, logits rows) - no pickling.

Backends: `mp` starts each worker as a subprocess of ours (`python -m asyncengine.distributed.worker`, its
arguments pickled on stdin; stdin stays open, and its end tells the worker that rank 0 is gone), rendezvous on
127.0.0.1. `ray` starts them as Ray actors, one per bundle of a placement group, rendezvous on the driver's
address. Either way a watchdog thread notices a worker that exits; it records the failure (the engine then
reports itself dead: `WorkerGroup.failure`) and stops the other workers, so no process is left behind. A rank
that dies breaks rank 0's next collective (gloo) or is aborted (NCCL).

A rank that hangs (stopped, deadlocked, a GPU that stopped answering) does not exit: the watchdog also reads
rank 0's `StepClock`, and when steps are in flight and none has finished for `step_timeout_s` it records the
failure and kills every worker the same way (a stopped process too), which breaks or aborts rank 0's pending
collective. Only steps are timed: loading, the KV-cache profile and CUDA-graph capture come before the first step,
under the process group's `distributed_timeout_s`, and the first step (whose kernels may still compile) gets that
longer limit as well.
"""

from __future__ import annotations

import atexit
import logging
import os
import pickle
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Optional

import torch

from asyncengine.distributed import parallel_state
from asyncengine.kernels.cpu import make_decode_mirror, plan_attention
from asyncengine.models.layers import AttentionMetadata

logger = logging.getLogger(__name__)

STOP_WAIT_S = 10.0  # a worker that has not exited this long after the stop message is killed
WATCH_INTERVAL_S = 0.2

# -- the step channel ---------------------------------------------------------------------------------------------
_OP_STOP, _OP_STEP = 0, 1
# header: op, T tokens, B sequences, block table width, S logits rows, graph size (0: eager), max_query_len, max_seq_len
_HEADER_LEN = 8


@dataclass
class FollowerStep:
    """One step as a worker sees it: what the forward pass needs, nothing of sampling."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    metadata: AttentionMetadata
    logits_indices: torch.Tensor
    graph_size: Optional[int]


class StepChannel:
    """Rank 0 sends each step's forward inputs; the other ranks receive them (both over the process group)."""

    def __init__(self, device: torch.device, block_size: int, kv_cache_dtype: torch.dtype = torch.float32):
        self.device, self.block_size = device, block_size
        # a worker's decode mirror (kernels/cpu.py), where its CPU attention needs one
        self.cpu_mirror = make_decode_mirror(kv_cache_dtype) if device.type == "cpu" else None
        self._header_in_flight: Optional[tuple[Any, torch.Tensor]] = None  # rank 0: (its pending send, header)

    def send(self, input_ids, positions, metadata: AttentionMetadata, logits_indices, graph_size) -> None:
        """Rank 0: broadcast one step (device tensors as built by ModelRunner.prepare, ids with the in-flight
        tokens filled in)."""
        tables = metadata.block_tables
        self._send_header([_OP_STEP, input_ids.shape[0], tables.shape[0], tables.shape[1], logits_indices.shape[0],
                           graph_size or 0, metadata.max_query_len, metadata.max_seq_len])
        payload = torch.cat([input_ids, positions, metadata.slot_mapping, metadata.query_start_loc.long(),
                             metadata.seq_lens.long(), tables.long().reshape(-1), logits_indices.long()])
        parallel_state.broadcast(payload)

    def send_stop(self) -> None:
        self._send_header([_OP_STOP] + [0] * (_HEADER_LEN - 1))
        self._wait_for_header()

    def _send_header(self, values: list[int]) -> None:
        """The header goes over the control group (the workers wait on it without a timeout while the engine is
        idle), asynchronously: rank 0 goes on with the step while gloo sends it; one header is in flight at most."""
        self._wait_for_header()
        header = torch.tensor(values, dtype=torch.int64)
        self._header_in_flight = (parallel_state.broadcast_control(header, async_op=True), header)

    def _wait_for_header(self) -> None:
        if self._header_in_flight is not None:
            work, _ = self._header_in_flight
            self._header_in_flight = None
            work.wait()

    def receive(self) -> Optional[FollowerStep]:
        """Other ranks: the next step, or None when rank 0 says stop."""
        header = parallel_state.broadcast_control(torch.empty(_HEADER_LEN, dtype=torch.int64))
        op, t, b, width, s, graph, max_q, max_s = header.tolist()
        if op == _OP_STOP:
            return None
        sizes = [t, t, t, b + 1, b, b * width, s]
        payload = parallel_state.broadcast(torch.empty(sum(sizes), dtype=torch.int64, device=self.device))
        ids, positions, slots, qsl, seq_lens, tables, logits_idx = payload.split(sizes)
        host = payload.cpu()  # the *_cpu fields (and the CPU attention plan) come from the host copy
        _, _, _, qsl_cpu, lens_cpu, tables_cpu, _ = host.split(sizes)
        qsl_cpu, lens_cpu = qsl_cpu.int(), lens_cpu.int()
        tables_cpu = tables_cpu.int().view(b, width)
        metadata = AttentionMetadata(
            query_start_loc=qsl.int(), seq_lens=seq_lens.int(), block_tables=tables.int().view(b, width),
            slot_mapping=slots, query_start_loc_cpu=qsl_cpu, seq_lens_cpu=lens_cpu,
            max_query_len=max_q, max_seq_len=max_s,
            cpu_plan=(plan_attention(qsl_cpu.numpy(), lens_cpu.numpy(), tables_cpu.numpy(), self.block_size,
                                     mirror=self.cpu_mirror) if self.device.type == "cpu" else None),
        )
        return FollowerStep(ids, positions, metadata, logits_idx, graph or None)


# -- the workers' side --------------------------------------------------------------------------------------------
@dataclass
class WorkerSpec:
    """What a worker needs to become rank `rank` (pickled to it)."""

    config: Any  # EngineConfig
    model_config: Any  # ModelConfig
    max_model_len: int
    rank: int
    init_method: str
    device: str  # e.g. "cpu", "cuda:3"


def run_worker(spec: WorkerSpec) -> None:
    """Join the world as spec.rank, load this rank's model and follow rank 0's steps until it says stop."""
    from asyncengine.model_runner import ModelRunner
    from asyncengine.plugins import load_plugins

    load_plugins()  # out-of-tree model families
    device = torch.device(spec.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    elif "OMP_NUM_THREADS" not in os.environ:  # the ranks share the host's cores
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // spec.config.tensor_parallel_size))
    parallel_state.init_tensor_parallel(spec.rank, spec.config.tensor_parallel_size, spec.init_method, device,
                                        spec.config.distributed_timeout_s)
    stopped = False
    try:
        runner = ModelRunner(spec.config, spec.model_config, spec.max_model_len, rank=spec.rank, device=device)
        runner.follow()
        stopped = True  # rank 0 said stop: every rank leaves together
    finally:
        parallel_state.destroy_tensor_parallel(orderly=stopped)


# -- rank 0's side ------------------------------------------------------------------------------------------------
class StepClock:
    """Rank 0's steps in flight (launched, not yet collected) and when one last made progress. Thread-safe: the
    device thread calls started/finished, the watchdog calls overdue."""

    def __init__(self, step_timeout_s: float, first_step_timeout_s: float):
        self.step_timeout_s, self.first_step_timeout_s = step_timeout_s, first_step_timeout_s
        self._lock = threading.Lock()
        self._in_flight = 0
        self._finished_any = False
        self._since = 0.0  # monotonic time of the last progress (a step started with none in flight, or finished)

    def started(self) -> None:
        with self._lock:
            if self._in_flight == 0:
                self._since = time.monotonic()
            self._in_flight += 1

    def finished(self) -> None:
        """A step was collected (or its launch failed)."""
        with self._lock:
            self._in_flight = max(0, self._in_flight - 1)
            self._finished_any = True
            self._since = time.monotonic()

    def limit(self) -> float:
        return self.step_timeout_s if self._finished_any else max(self.step_timeout_s, self.first_step_timeout_s)

    def overdue(self) -> bool:
        """Steps are in flight and none has made progress within the limit."""
        with self._lock:
            return self._in_flight > 0 and time.monotonic() - self._since > self.limit()


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class WorkerGroup:
    """Ranks 1..N-1, started by rank 0 before it builds its model. `start` returns once rank 0 has joined the
    world (every worker joined too). `failure` is None while every worker runs. `stop` is idempotent."""

    def __init__(self, config, model_config, max_model_len: int):
        self.config, self.model_config, self.max_model_len = config, model_config, max_model_len
        self.size = config.tensor_parallel_size
        self.failure: Optional[BaseException] = None
        self.rendezvous: Optional[tuple[str, int]] = None  # where rank 0's store listens, once started
        self.clock = StepClock(config.step_timeout_s, config.distributed_timeout_s)
        self._stopping = threading.Event()
        self._backend = _MpWorkers() if config.distributed_executor_backend == "mp" else _RayWorkers(self.size)
        self.rank0_device = self._backend.rank0_device(config.torch_device())

    def start(self) -> None:
        host = self._backend.rendezvous_host()
        # rank 0's store listens on the rendezvous host only (a port bound here, handed to it), not every interface
        listener = socket.create_server((host, 0), family=socket.AF_INET6 if ":" in host else socket.AF_INET)
        port = listener.getsockname()[1]
        init_method = f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"
        self.rendezvous = (host, port)
        specs = [WorkerSpec(self.config, self.model_config, self.max_model_len, rank, init_method,
                            self._backend.worker_device(rank, self.rank0_device)) for rank in range(1, self.size)]
        self._backend.spawn(specs)
        atexit.register(self.stop)
        threading.Thread(target=self._watch, name="asyncengine-tp-watchdog", daemon=True).start()
        try:
            parallel_state.init_tensor_parallel(0, self.size, init_method, self.rank0_device,
                                                self.config.distributed_timeout_s, listen_fd=listener.detach())
        except BaseException:
            self.stop()
            raise

    def _watch(self) -> None:
        """Until stop: the first worker that exits, or a step overdue on the clock, is a failure; every worker is
        then killed (rank 0's pending or next collective then fails, and the engine dies; `stop` still has to be
        called to leave the world)."""
        while not self._stopping.is_set():
            dead = self._backend.exited(timeout=WATCH_INTERVAL_S)
            if self._stopping.is_set():
                return
            if dead is not None:
                return self._fail(RuntimeError(f"tensor-parallel worker (rank {dead[0]}) exited: {dead[1]}"))
            if self.clock.overdue():
                return self._fail(TimeoutError(
                    f"no tensor-parallel step finished in {self.clock.limit():g} s: a rank is hung "
                    "(the limit is step_timeout_s, --step-timeout)"))

    def _fail(self, failure: BaseException) -> None:
        self.failure = failure
        logger.error("%s; stopping the other ranks", failure)
        self._abort_collectives()
        self._backend.stop(0.0)

    def _abort_collectives(self) -> None:
        """NCCL waits forever for a dead peer: abort the group so rank 0's pending collective fails now (gloo
        fails by itself when the peer's socket closes)."""
        if self.rank0_device.type == "cuda":
            abort = getattr(torch.distributed.distributed_c10d, "_abort_process_group", None)
            if abort is not None:
                try:
                    abort()
                except Exception:  # noqa: BLE001 - best effort; the timeout remains
                    logger.exception("could not abort the process group")

    def stop(self, graceful: bool = True, channel: Optional[StepChannel] = None) -> None:
        """Tell the workers to stop (through `channel` when graceful, given and the world is whole), wait for them,
        kill what remains, and leave the world. Idempotent."""
        if self._stopping.is_set():
            return
        self._stopping.set()
        atexit.unregister(self.stop)
        graceful = graceful and channel is not None and self.failure is None
        if graceful:
            try:
                channel.send_stop()
            except Exception:  # noqa: BLE001 - a broken world: the kill below ends them
                logger.warning("could not send stop to the workers", exc_info=True)
                graceful = False
        if graceful and self.rank0_device.type == "cuda":
            # The workers leave the world on the stop message, and NCCL's destroy waits for every rank: rank 0
            # leaves now, with them, not after they exited (or were killed).
            parallel_state.destroy_tensor_parallel(orderly=True)
        self._backend.stop(STOP_WAIT_S if graceful else 0.0)
        parallel_state.destroy_tensor_parallel()


class _MpWorkers:
    """Workers as subprocesses of this process, on this host (one GPU each on CUDA: rank r on cuda:r)."""

    def __init__(self):
        self.procs: list[tuple[int, subprocess.Popen]] = []

    @staticmethod
    def rank0_device(device: torch.device) -> torch.device:
        return torch.device("cuda", 0) if device.type == "cuda" else device

    @staticmethod
    def rendezvous_host() -> str:
        return "127.0.0.1"

    @staticmethod
    def worker_device(rank: int, rank0_device: torch.device) -> str:
        return f"cuda:{rank}" if rank0_device.type == "cuda" else "cpu"

    def spawn(self, specs: list[WorkerSpec]) -> None:
        for spec in specs:
            proc = subprocess.Popen([sys.executable, "-m", "asyncengine.distributed.worker"], stdin=subprocess.PIPE)
            proc.stdin.write(pickle.dumps(spec))
            proc.stdin.flush()  # stdin stays open: its end tells the worker that rank 0 is gone
            self.procs.append((spec.rank, proc))

    def exited(self, timeout: float):
        """(rank, why) of a worker that has exited, or None after `timeout` seconds."""
        for rank, proc in self.procs:
            if proc.poll() is not None:
                return rank, f"exit status {proc.returncode}"
        threading.Event().wait(timeout)
        return None

    def stop(self, wait_s: float) -> None:
        for _, proc in self.procs:
            try:
                proc.stdin.close()
            except OSError:
                pass
        for _, proc in self.procs:
            try:
                proc.wait(wait_s)
            except subprocess.TimeoutExpired:
                pass
            if proc.poll() is None:
                proc.kill()
                proc.wait()


class _RayWorkers:
    """Workers as Ray actors, one per bundle of a placement group. Bundle 0 (on this node) is held by a
    placeholder actor for rank 0, which runs in this process on the GPU Ray gave that bundle."""

    def __init__(self, size: int):
        try:
            import ray
            from ray.util.placement_group import placement_group
        except ImportError:
            raise ValueError("--distributed-executor-backend ray needs Ray: pip install 'asyncengine[ray]'") from None
        self.ray = ray
        if not ray.is_initialized():
            ray.init(include_dashboard=False)
        self.on_gpu = torch.cuda.is_available()
        node_ip = ray.util.get_node_ip_address()
        bundle = {"GPU": 1} if self.on_gpu else {"CPU": 1}
        self.pg = placement_group([{**bundle, f"node:{node_ip}": 0.001}] + [dict(bundle)] * (size - 1))
        if not self._ready(timeout=60):
            ray.util.remove_placement_group(self.pg)
            raise ValueError(f"--tensor-parallel-size {size}: the Ray cluster cannot place {size} bundles of {bundle} "
                             f"(resources: {ray.cluster_resources()})")
        self.node_ip = node_ip
        self.actors: list[tuple[int, Any, Any]] = []  # (rank, actor, its run() ref)
        self.placeholder = self._actor_class().options(**self._placement(0)).remote()

    def _ready(self, timeout: float) -> bool:
        ready, _ = self.ray.wait([self.pg.ready()], timeout=timeout)
        return bool(ready)

    def _placement(self, bundle: int) -> dict:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        return dict(num_gpus=1 if self.on_gpu else 0, num_cpus=0 if self.on_gpu else 1,
                    scheduling_strategy=PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=bundle))

    def _actor_class(self):
        return self.ray.remote(_RayWorker)

    def rank0_device(self, device: torch.device) -> torch.device:
        if device.type != "cuda":
            return device
        gpu_ids = self.ray.get(self.placeholder.gpu_ids.remote())
        return torch.device("cuda", int(gpu_ids[0]))

    def rendezvous_host(self) -> str:
        return self.node_ip

    @staticmethod
    def worker_device(rank: int, rank0_device: torch.device) -> str:
        return "cuda:0" if rank0_device.type == "cuda" else "cpu"  # Ray sets CUDA_VISIBLE_DEVICES to its GPU

    def spawn(self, specs: list[WorkerSpec]) -> None:
        for spec in specs:
            actor = self._actor_class().options(**self._placement(spec.rank)).remote()
            self.actors.append((spec.rank, actor, actor.run.remote(spec)))

    def exited(self, timeout: float):
        refs = [ref for _, _, ref in self.actors]
        if not refs:
            threading.Event().wait(timeout)
            return None
        done, _ = self.ray.wait(refs, num_returns=1, timeout=timeout)
        if not done:
            return None
        rank = next(r for r, _, ref in self.actors if ref == done[0])
        try:
            self.ray.get(done[0])
            return rank, "returned"
        except Exception as exc:  # noqa: BLE001 - the actor died or raised: that is the report
            return rank, f"{type(exc).__name__}: {exc}"

    def stop(self, wait_s: float) -> None:
        if wait_s > 0 and self.actors:
            self.ray.wait([ref for _, _, ref in self.actors], num_returns=len(self.actors), timeout=wait_s)
        if self.pg is None:
            return
        for _, actor, _ in self.actors:
            self.ray.kill(actor)
        self.ray.kill(self.placeholder)
        self.ray.util.remove_placement_group(self.pg)
        self.pg = None


class _RayWorker:
    """The Ray actor of one rank (and, with no run() call, rank 0's placeholder)."""

    def gpu_ids(self) -> list:
        import ray

        return ray.get_gpu_ids()

    def run(self, spec: WorkerSpec) -> None:
        logging.basicConfig(level=logging.INFO)
        run_worker(spec)


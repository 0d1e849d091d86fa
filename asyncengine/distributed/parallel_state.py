"""The tensor-parallel world of this process: its rank, the world's size, and the collectives the layers call.

Layers read `tp_rank()` / `tp_size()` when they are built (to size their slice of a weight) and call
`all_reduce` / `all_gather` in forward. Until `init_tensor_parallel` is called the world has one rank and every
collective returns its input unchanged, so `tensor_parallel_size=1` runs with no process group and no copies.

With more ranks the world is torch.distributed's default process group: NCCL on CUDA (collectives run on the
current stream, so CUDA graphs capture them), gloo on CPU. Gloo reduces CPU tensors of half precision poorly (or
not at all), so on CPU the collectives run in float32 and cast back.

On CUDA, `all_reduce` of up to SYMMETRIC_BYTES goes through torch's symmetric memory instead of NCCL: every rank
registers one buffer that the others can read and write over NVLink, and `two_shot_all_reduce_` sums in it (a
barrier at its start and end, so one buffer serves every all-reduce in order). Measured on two H200s in a CUDA
graph (issue 13): 6.3 us for a decode step's [1, 4096] bf16 against NCCL's 20.6, 19.7 against 51.7 at
[256, 8192]; a Llama-3-8B decode step has 64 of them. Larger inputs (prefill) stay with NCCL. Every rank checks
the path at start-up and all take the same decision (a rank that cannot use it turns it off for all, logged);
ASYNCENGINE_SYMMETRIC_ALLREDUCE=0 turns it off.

Beside the world, a gloo group on the host, the control group, carries what must wait without a bound: the header of
rank 0's next step (`broadcast_control`). A worker waits on it for as long as the engine is idle; a collective of
the world, by contrast, fails after `timeout_s` (so an idle engine would lose its workers after that long).
"""

from __future__ import annotations

import datetime
import logging
import os
import threading
import urllib.parse
from typing import Optional

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

_RANK, _SIZE = 0, 1
_DEVICE: Optional[torch.device] = None
_CONTROL: Optional[dist.ProcessGroup] = None
# How long a worker may wait for rank 0's next step: as long as the engine stays idle, so unbounded in practice.
# A rank 0 that is gone ends its workers by other means (executor.py: the mp pipe's end, Ray's actor kill).
CONTROL_TIMEOUT = datetime.timedelta(days=365)
SYMMETRIC_BYTES = 8 * 2**20  # the symmetric buffer: [256, 8192] bf16 is 4 MiB
ABORT_WAIT_S = 10.0  # how long leaving a CUDA world waits for NCCL's destroy or abort before going on without it
_LEAVING: Optional[threading.Thread] = None  # a destroy or abort that had not returned within ABORT_WAIT_S


class _SymmetricAllReduce:
    """Sum over the ranks through one symmetric-memory buffer (CUDA, NVLink peers)."""

    def __init__(self, device: torch.device):
        import torch.distributed._symmetric_memory as symm_mem

        self.group = dist.group.WORLD.group_name
        self.buffer = symm_mem.empty(SYMMETRIC_BYTES, dtype=torch.uint8, device=device)
        symm_mem.rendezvous(self.buffer, self.group)

    def takes(self, x: torch.Tensor) -> bool:
        nbytes = x.numel() * x.element_size()
        return (x.dtype in (torch.bfloat16, torch.float16, torch.float32) and x.is_contiguous()
                and nbytes <= SYMMETRIC_BYTES and nbytes % 16 == 0)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x summed over the ranks, in place (x contiguous, `takes(x)`)."""
        staged = self.buffer[: x.numel() * x.element_size()].view(x.dtype)
        staged.copy_(x.view(-1))
        torch.ops.symm_mem.two_shot_all_reduce_(staged, "sum", self.group)
        return x.copy_(staged.view(x.shape))

    def works(self, device: torch.device) -> bool:
        """A sum of every rank's (rank + 1) in each dtype comes out right here."""
        for dtype in (torch.bfloat16, torch.float32):
            x = torch.full((4096,), float(_RANK + 1), dtype=dtype, device=device)
            if not bool((self(x) == _SIZE * (_SIZE + 1) / 2).all()):
                return False
        return True


_SYMMETRIC: Optional[_SymmetricAllReduce] = None


def tp_rank() -> int:
    return _RANK


def tp_size() -> int:
    return _SIZE


def init_tensor_parallel(rank: int, size: int, init_method: str, device: torch.device,
                         timeout_s: float = 1800.0, listen_fd: Optional[int] = None) -> None:
    """Join the world of `size` ranks as `rank` (blocks until every rank has joined). `init_method` is a
    rendezvous URL such as tcp://127.0.0.1:PORT, the same on every rank: rank 0 serves its store there. Rank 0 may
    give `listen_fd`, a socket it bound to that host and port and owns no more: the store then listens only there
    (by itself it would listen on every interface). With size 1 nothing is created."""
    global _RANK, _SIZE, _DEVICE, _CONTROL
    if _SIZE > 1:
        raise RuntimeError("this process is already a rank of a tensor-parallel engine: close() that engine (LLM.close, "
                           "AsyncLLMEngine.shutdown) before starting another")
    if _LEAVING is not None and _LEAVING.is_alive():
        raise RuntimeError("this process's previous tensor-parallel world has not finished leaving (NCCL's destroy "
                           "or abort did not return): start the next engine in a new process")
    if size > 1:
        backend = "nccl" if device.type == "cuda" else "gloo"
        timeout = datetime.timedelta(seconds=timeout_s)
        url = urllib.parse.urlsplit(init_method)
        store = dist.TCPStore(url.hostname, url.port, size, is_master=rank == 0, timeout=timeout,
                              wait_for_workers=False, master_listen_fd=listen_fd)
        dist.init_process_group(backend, store=store, rank=rank, world_size=size, timeout=timeout,
                                device_id=device if device.type == "cuda" else None)
        _CONTROL = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
    _RANK, _SIZE, _DEVICE = rank, size, device
    if size > 1 and device.type == "cuda" and os.environ.get("ASYNCENGINE_SYMMETRIC_ALLREDUCE", "1") != "0":
        _init_symmetric_all_reduce(device)


def _init_symmetric_all_reduce(device: torch.device) -> None:
    """Use symmetric memory for small all-reduces if it works on every rank (all ranks decide alike)."""
    global _SYMMETRIC
    candidate, why = None, ""
    try:
        candidate = _SymmetricAllReduce(device)
        ok = candidate.works(device)
        why = "a test sum came out wrong" if not ok else ""
    except Exception as e:  # noqa: BLE001 - reported below; every rank still joins the vote
        ok, why = False, repr(e)[:300]
    if all_reduce_min(int(ok)) == 1:
        _SYMMETRIC = candidate
        if _RANK == 0:
            logger.info("all-reduce: symmetric memory up to %d MiB, NCCL above", SYMMETRIC_BYTES // 2**20)
    else:
        logger.warning("all-reduce: NCCL for every size (symmetric memory is not usable%s)",
                       f" on rank {_RANK}: {why}" if why else " on another rank")


def destroy_tensor_parallel(orderly: bool = False, wait_s: float = ABORT_WAIT_S) -> None:
    """Leave the world (idempotent); the process is back to one rank. Never waits for another rank for long.

    On CUDA, `orderly` (every rank leaving together, on rank 0's stop) destroys the communicators, which waits for
    every peer to destroy too; otherwise (a peer may be gone) they are aborted (the control group's too). NCCL's
    abort is not purely local either: within a node it may wait for the other ranks (it frees memory they map):
    rank 0 hung in `_abort_process_group` after its worker was killed (run 89, two H200s), and an abort on every
    rank at once still did not return (run 90). So either runs in a daemon thread for at most `wait_s` seconds:
    past that it is left running (logged), the process goes on with one rank, and a new world in this process is
    refused (init_tensor_parallel)."""
    global _RANK, _SIZE, _DEVICE, _SYMMETRIC, _CONTROL, _LEAVING
    _SYMMETRIC = None
    if _LEAVING is not None and not _LEAVING.is_alive():
        _LEAVING = None
    if dist.is_initialized() and _LEAVING is None:
        if _DEVICE is not None and _DEVICE.type == "cuda":
            leave = dist.destroy_process_group if orderly else dist.distributed_c10d._abort_process_group
            _LEAVING = threading.Thread(target=leave, name="nccl-leave", daemon=True)
            _LEAVING.start()
            _LEAVING.join(wait_s)
            if _LEAVING.is_alive():
                logger.warning("rank %d: NCCL's %s did not return within %.0f s; leaving it running", _RANK,
                               "destroy" if orderly else "abort", wait_s)
            else:
                _LEAVING = None
        else:
            dist.destroy_process_group()  # the control group too
    _RANK, _SIZE, _DEVICE, _CONTROL = 0, 1, None, None


def _wire(x: torch.Tensor) -> torch.Tensor:
    """The tensor a collective sends: float32 for CPU half-precision floats (gloo), x itself otherwise."""
    if x.device.type == "cpu" and x.dtype in (torch.float16, torch.bfloat16):
        return x.float()
    return x


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum of x over the ranks (x itself with one rank). May reduce in place."""
    if _SIZE == 1:
        return x
    if _SYMMETRIC is not None and _SYMMETRIC.takes(x):
        return _SYMMETRIC(x)
    wire = _wire(x)
    dist.all_reduce(wire)
    return wire if wire is x else wire.to(x.dtype)


def all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Every rank's x concatenated along `dim`, in rank order (x itself with one rank). Every rank's x has the
    same shape."""
    if _SIZE == 1:
        return x
    wire = _wire(x).contiguous()
    out = wire.new_empty((_SIZE * wire.shape[0], *wire.shape[1:]))  # ranks stacked along dim 0
    (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(out, wire)
    dim = dim % x.dim()
    if dim != 0:  # [N * d0, ...] -> [N, d0, ...] -> rank blocks side by side along dim
        out = torch.cat(out.chunk(_SIZE, dim=0), dim=dim)
    return out if wire is x else out.to(x.dtype)


def broadcast(x: torch.Tensor) -> torch.Tensor:
    """Rank 0's x, in place on every rank."""
    if _SIZE > 1:
        dist.broadcast(x, src=0)
    return x


def broadcast_control(x: torch.Tensor, async_op: bool = False):
    """Rank 0's x (a host tensor), in place on every rank, over the control group: no timeout. With async_op
    (rank 0 sending), returns the pending work (wait() on it before x is reused or freed), else x."""
    if _SIZE == 1:
        return None if async_op else x
    work = dist.broadcast(x, src=0, group=_CONTROL, async_op=async_op)
    return work if async_op else x


def all_reduce_min(value: int) -> int:
    """The smallest of every rank's `value` (e.g. KV blocks that fit: the rank with least memory decides)."""
    if _SIZE == 1:
        return value
    t = torch.tensor([value], dtype=torch.int64, device=_DEVICE)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())

"""The tensor-parallel world of this process: its rank, the world's size, and the collectives the layers call.

Layers read `tp_rank()` / `tp_size()` when they are built (to size their slice of a weight) and call
`all_reduce` / `all_gather` in forward. Until `init_tensor_parallel` is called the world has one rank and every
collective returns its input unchanged, so `tensor_parallel_size=1` runs with no process group and no copies.

With more ranks the world is torch.distributed's default process group: NCCL on CUDA (collectives run on the
current stream, so CUDA graphs capture them), gloo on CPU. Gloo reduces CPU tensors of half precision poorly (or
not at all), so on CPU the collectives run in float32 and cast back.
"""

from __future__ import annotations

import datetime
from typing import Optional

import torch
import torch.distributed as dist

_RANK, _SIZE = 0, 1
_DEVICE: Optional[torch.device] = None


def tp_rank() -> int:
    return _RANK


def tp_size() -> int:
    return _SIZE


def init_tensor_parallel(rank: int, size: int, init_method: str, device: torch.device,
                         timeout_s: float = 1800.0) -> None:
    """Join the world of `size` ranks as `rank` (blocks until every rank has joined). `init_method` is a
    rendezvous URL such as tcp://127.0.0.1:PORT, the same on every rank. With size 1 nothing is created."""
    global _RANK, _SIZE, _DEVICE
    if _SIZE > 1:
        raise RuntimeError("this process is already a rank of a tensor-parallel engine: close() that engine (LLM.close, "
                           "AsyncLLMEngine.shutdown) before starting another")
    if size > 1:
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=size,
                                timeout=datetime.timedelta(seconds=timeout_s),
                                device_id=device if device.type == "cuda" else None)
    _RANK, _SIZE, _DEVICE = rank, size, device


def destroy_tensor_parallel() -> None:
    """Leave the world (idempotent); the process is back to one rank."""
    global _RANK, _SIZE, _DEVICE
    if dist.is_initialized():
        dist.destroy_process_group()
    _RANK, _SIZE, _DEVICE = 0, 1, None


def _wire(x: torch.Tensor) -> torch.Tensor:
    """The tensor a collective sends: float32 for CPU half-precision floats (gloo), x itself otherwise."""
    if x.device.type == "cpu" and x.dtype in (torch.float16, torch.bfloat16):
        return x.float()
    return x


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum of x over the ranks (x itself with one rank). May reduce in place."""
    if _SIZE == 1:
        return x
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


def all_reduce_min(value: int) -> int:
    """The smallest of every rank's `value` (e.g. KV blocks that fit: the rank with least memory decides)."""
    if _SIZE == 1:
        return value
    t = torch.tensor([value], dtype=torch.int64, device=_DEVICE)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())

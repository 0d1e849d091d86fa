"""The tensor-parallel world of this process: its rank, the world's size, and the collectives the layers call.

Layers read `tp_rank()` / `tp_size()` when they are built (to size their slice of a weight) and call
`all_reduce` / `all_gather` in forward. Until `init_tensor_parallel` is called the world has one rank and every
collective returns its input unchanged, so `tensor_parallel_size=1` runs with no process group and no copies.
"""

from __future__ import annotations

import torch

_RANK, _SIZE = 0, 1


def tp_rank() -> int:
    return _RANK


def tp_size() -> int:
    return _SIZE


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum of x over the ranks (x itself with one rank)."""
    if _SIZE == 1:
        return x
    raise NotImplementedError("tensor parallelism (tp_size > 1) is not built yet")


def all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Every rank's x concatenated along `dim`, in rank order (x itself with one rank)."""
    if _SIZE == 1:
        return x
    raise NotImplementedError("tensor parallelism (tp_size > 1) is not built yet")

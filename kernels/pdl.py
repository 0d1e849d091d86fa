"""Programmatic dependent launch (PDL, Hopper and later): the one place that decides whether our kernels use it.

A kernel launched with PDL (Triton's `launch_pdl=True`) may be scheduled while the kernel before it on the stream
is still running; under CUDA-graph capture the dependency becomes a programmatic edge of the graph. The kernel's
launch, and any prologue that reads only data no earlier kernel writes (a GEMV's weights), then overlap the
previous kernel's tail instead of following it. `griddepcontrol.wait` (`wait_for_prior_grids` below) blocks until
the previous grid has COMPLETED and its memory writes are visible.

The rule every PDL kernel of this package keeps (and a new one must keep):
  1. Before `wait_for_prior_grids` a program reads only tensors that no kernel of the forward pass writes
     (weights, constant tables) and writes nothing at all: no stores, no atomics (an output buffer may be memory
     the previous kernel is still reading: the caching allocator reuses it in stream order).
     One exception, argued from rule 2: a program may read before its wait what kernels *before its immediate
     predecessor* wrote (and what the host copied in before the forward pass). This kernel's programs start only
     once every program of the predecessor has called launch_dependents, which each does after its own wait, i.e.
     after everything before the predecessor completed. What the predecessor itself writes is read after the
     wait. The split-KV decode (attention.py) uses it: it preloads the step's metadata and the first block of
     each segment's earlier keys, and reads the step's newest key (which the cache-writing kernel before it
     writes) after the wait.
  2. Every program calls `wait_for_prior_grids` on every path, early exits included (the wait comes before any
     `return`), even one that reads nothing an earlier kernel wrote.
Why 2 matters: a kernel C that reads what kernel A wrote, with B in between, only waits for B. B's grid completes
only after every program of B has passed its own wait, i.e. after A completed; so "C waited for B" implies "A is
done" exactly when no program of B can finish without waiting. A kernel launched without PDL (cuBLAS, a torch op,
a memcpy) starts only after its predecessor completes, which keeps the chain intact too.

  3. A kernel may let its dependents launch before its own wait (`wait_for_prior_grids_early`) when no kernel
     that can follow it reads, before its own wait, anything a kernel of this forward pass wrote, i.e. when its
     successors keep to rule 1 without its exception (which argues from the predecessor's launch_dependents
     coming after its wait). The next kernel is then scheduled while this
     one's predecessor still runs, and its prologue (a GEMV's weight prefetch) overlaps that kernel too, not only
     this one. The small kernels between the big ones do it (`EARLY_LAUNCH_KERNELS`): the RMSNorms and
     silu_and_mul, followed by a GEMV, FP8 GEMM, quantization, router or the library's product, and the rotary +
     cache write, followed by the split-KV decode, whose pre-wait reads are the host's metadata and keys that
     earlier steps wrote. Measured on an H200 (runs 118-120, loadtest/RESULTS.md): the 8B shape's bf16 W3
     4.40 -> 4.32 ms and 4.48 -> 4.40, the MoE shape level; FP8 was slower by as much (2.80 -> 2.88) where the
     norm and silu_and_mul write an FP8 copy for the W8A8 GEMM, which waits first and has no prologue to overlap:
     those two kernels keep the trigger after their wait when they write the copy (QUANT), and FP8 is level.
     Rule 2 still holds for their successors: each waits, so "C waited for B" still implies "A is done" (B
     itself waits for A before it can complete).

`launch_dependents` is called right after the wait: it lets the next kernel be scheduled as soon as every program
of this one has started (all of them are then resident, so the dependents' waiting programs cannot starve this
grid); the next kernel's own wait still waits for this grid's completion, so the hint is never unsafe.

PDL is used only on CUDA devices of compute capability 9.0 or more, never under Triton's interpreter, and not when
the environment sets ASYNCENGINE_PDL=0 (read at every launch, so a benchmark or test can compare both; a CUDA
graph keeps the choice made when it was captured).
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from . import interpreting

ENV_SWITCH = "ASYNCENGINE_PDL"


@functools.cache
def _capable(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def enabled(device: torch.device) -> bool:
    """Should kernels launched on `device` use PDL? (CUDA, capability >= 9, no interpreter, ASYNCENGINE_PDL != 0)"""
    if device.type != "cuda" or interpreting() or os.environ.get(ENV_SWITCH, "1") == "0":
        return False
    return _capable(device.index if device.index is not None else torch.cuda.current_device())


@triton.jit
def wait_for_prior_grids(USE_PDL: tl.constexpr):
    """With USE_PDL: wait until the previous kernel on the stream has completed (its writes visible), then let the
    next kernel launch. Without it: nothing (stream order already waited). See the module docstring's rule."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


# The kernels that launch their dependents before their wait (rule 3; the norm and silu_and_mul only without their
# FP8 copy), named for the rule's audit.
EARLY_LAUNCH_KERNELS = ("norm._rms_norm_kernel", "norm._fused_add_rms_norm_kernel",
                        "activation._silu_and_mul_kernel", "rotary_cache._rotary_cache_kernel")
NOT_EARLY_WITH_FP8_COPY = ("norm._fused_add_rms_norm_kernel", "activation._silu_and_mul_kernel")  # QUANT=True


@triton.jit
def wait_for_prior_grids_early(USE_PDL: tl.constexpr, EARLY: tl.constexpr):
    """Rule 3 where EARLY: let the next kernel launch now, then wait until the previous kernel has completed.
    Without EARLY: `wait_for_prior_grids` (wait, then let the next kernel launch)."""
    if USE_PDL:
        if EARLY:
            tl.extra.cuda.gdc_launch_dependents()
            tl.extra.cuda.gdc_wait()
        else:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()

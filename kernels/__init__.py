"""Triton kernels of asyncengine, one family per module, and their pure-torch references.

    norm.py        rms_norm, fused_add_rms_norm
    activation.py  silu_and_mul
    rotary.py      rotary_embedding (neox style, in place)
    cache.py       reshape_and_cache (paged KV write, slot < 0 skipped)
    rotary_cache.py  rotary_and_cache (rotary of q and k fused with the paged KV write)
    attention.py   paged_attention (2D kernel for prefill / mixed batches, split-KV kernel for decode)
    moe.py         fused_moe (mixture of experts: tokens grouped by expert, one grouped GEMM per projection)
    reference.py   the torch definition of every kernel above
    pdl.py         whether launches use programmatic dependent launch (Hopper+), and the rule its kernels keep

Each Triton module has the signature of its counterpart in `reference.py`. Nothing in this package imports the
engine; `asyncengine.ops` is the adapter that picks a Triton kernel or the reference per call. Importing a Triton
module needs Triton; `reference` needs only torch.
"""

from __future__ import annotations

import functools
import os


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def available() -> bool:
    """True when the Triton kernels can run here: Triton imports and CUDA is there, or the interpreter is on."""
    try:
        import triton  # noqa: F401
        import torch
    except Exception:  # Triton missing or broken
        return False
    return interpreting() or torch.cuda.is_available()


@functools.cache
def sm_count(device_index) -> int:
    """Streaming multiprocessors of a CUDA device (asked once: kernels size split-K grids by it on every call)."""
    import torch

    return torch.cuda.get_device_properties(device_index if device_index is not None else 0).multi_processor_count

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
import sys


def _hand_over_the_top_level_name() -> None:
    """This folder is importable as a top-level package `kernels` only from a source checkout whose root is on
    sys.path (`python -m asyncengine` or `python -m pytest` run in the repository). That name belongs to Hugging
    Face's `kernels`, a dependency of transformers 5.25+, which imports it at start-up: this folder must not shadow
    it. Load the next `kernels` on sys.path in this module's place (the import system returns what sys.modules
    holds). Where there is none, this module stays what the bare name imports, as it always was: transformers
    5.23 probes a `kernels` without metadata by importing it (version "N/A": not used), and an import error there
    would break `import transformers`."""
    import importlib.machinery
    import importlib.util
    from pathlib import Path

    checkout = Path(__file__).resolve().parent.parent
    others = [entry for entry in sys.path if Path(entry or ".").resolve() != checkout]
    spec = importlib.machinery.PathFinder.find_spec("kernels", others)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules["kernels"] = module
    spec.loader.exec_module(module)


if __name__ == "kernels":
    _hand_over_the_top_level_name()


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


_arrival_counters: dict = {}


def arrival_counters(owner: str, device, slots: int):
    """A zeroed int32 buffer [slots] of arrival counters for the kernels of `owner` on `device` (split-K and split-KV
    reductions done by the last program to arrive, which resets its counter: the kernels leave the buffer zeroed).
    Made by the first call, which must run eagerly: zeros made inside a CUDA-graph capture would only be zeroed when
    that graph is replayed."""
    import torch

    key = (owner, device.type, device.index)
    if key not in _arrival_counters:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"{owner}: the first call on a device must run outside CUDA-graph capture (it makes "
                               "the arrival counters); run the model once eagerly before capturing")
        _arrival_counters[key] = torch.zeros(slots, dtype=torch.int32, device=device)
    return _arrival_counters[key]


@functools.cache
def compute_capability(device_index) -> tuple[int, int]:
    """(major, minor) of a CUDA device (asked once: kernels pick instructions by it on every call)."""
    import torch

    return torch.cuda.get_device_capability(device_index if device_index is not None else 0)


@functools.cache
def sm_count(device_index) -> int:
    """Streaming multiprocessors of a CUDA device (asked once: kernels size split-K grids by it on every call)."""
    import torch

    return torch.cuda.get_device_properties(device_index if device_index is not None else 0).multi_processor_count


@functools.cache
def device_name(device_index) -> str:
    """A CUDA device's name as torch reports it ("NVIDIA H100 80GB HBM3", "NVIDIA H200"): the key of the per-GPU
    rows of the tuned tile tables (asked once)."""
    import torch

    return torch.cuda.get_device_name(device_index if device_index is not None else 0)

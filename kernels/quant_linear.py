"""The CUDA side of the linear layers' own kernels: one entry per format, and the per-shape choice between our
decode GEMV and the library's product, made once per shape at start-up.

    int_weight_matmul  4-bit: quant_gemv.int4_gemv (split-K GEMV) for M <= 16, quant_int4's dequantizing GEMM
                       above; other widths have no kernel (asyncengine rejects them on CUDA at start-up)
    fp8_linear         quant_fp8: per-token quantization + torch._scaled_mm (per-tensor form when it applies)
    dense_gemv         quant_gemv: bf16/fp16 or FP8 (weight-only) weights at M <= 64 (where measured faster)
    (the GEMV's tiles per shape: quant_gemv_configs.TUNED, filled from `bench_kernels --gemv-sweep`)
    gemv_max_m         measures dense_gemv against the library per decode batch size
Same signatures as kernels/quant_reference.py.
"""

from __future__ import annotations

import logging
import statistics
from typing import Callable

import torch

from .quant_fp8 import fp8_linear
from .quant_gemv import MAX_M, dense_gemv
from .quant_int4 import int_weight_matmul

__all__ = ["dense_gemv", "fp8_linear", "gemv_max_m", "int_weight_matmul"]

logger = logging.getLogger(__name__)
DECODE_SIZES = (1, 2, 4, 8, 16, 32, 64)  # the batch sizes measured; a choice holds up to the next one
MEASURE_ROUNDS = 3  # alternating (ours, library) measurements per batch size; the medians decide
L2_FLUSH_BYTES = 256 << 20  # larger than any GPU's L2 (H100: 50 MB, H200: 60 MB)
SPIN_CYCLES = 350_000  # ~200 us at ~1.7 GHz: longer than a GEMV wrapper's host time
_chosen: dict[tuple, int] = {}


def gemv_max_m(key: tuple, ours: Callable, library: Callable, k: int, dtype: torch.dtype, device) -> int:
    """The largest decode batch size M (of DECODE_SIZES, up to MAX_M) for which `ours(x)` beat `library(x)` on
    x [M, k] at every size up to it (0: never). Measured once per `key` (the shape and format: layers of one shape
    share it) with `device_time_ms`, medians of alternating rounds, and logged."""
    if key in _chosen:
        return _chosen[key]
    chosen, timings = 0, []
    for m in DECODE_SIZES:
        x = torch.randn(m, k, dtype=dtype, device=device)
        rounds = [(device_time_ms(lambda: ours(x)), device_time_ms(lambda: library(x))) for _ in range(MEASURE_ROUNDS)]
        t_ours, t_library = (statistics.median(times) for times in zip(*rounds))
        timings.append(f"M={m}: {t_ours * 1e3:.1f} vs {t_library * 1e3:.1f} us")
        if t_ours >= t_library:
            break
        chosen = m
    _chosen[key] = min(chosen, MAX_M)
    logger.info("decode GEMV for %s: ours up to M=%d (%s)", key, chosen, "; ".join(timings))
    return _chosen[key]


def device_time_ms(fn: Callable, reps: int = 25, dirty_flush: bool = False) -> float:
    """Median GPU time of one fn() call, as a CUDA graph replay sees it: weights out of L2 (a flush before each call)
    and without the host's launch cost. Before each call the GPU is kept busy (a flush, then a spin of ~200 us)
    while the host enqueues the timing events and fn's kernels, so a wrapper's Python time does not show up as an
    idle GPU between the events. triton's do_bench timed that idle gap too: at start-up it charged our GEMV's
    Python wrapper (tens of microseconds) against cuBLAS's C++ one and picked cuBLAS for shapes where the sweep,
    in CUDA graphs, has ours 4-8% faster (runs 45 and 48).

    The flush *reads* a buffer larger than L2 (a sum), leaving L2 full of clean lines, as the previous kernel of a
    decode step leaves it (it read its weights). A flush that wrote the buffer (zero_, until session 10) left L2
    full of dirty lines, whose write-back to memory the timed kernel then paid for: start-up timed cuBLAS at
    35.1 us on the 70B TP=2 qkv shard where the sweep (graphs, clean L2) has 26.5, and the choice between two
    kernels became a draw of which one the write-back hurt more (session 9: bf16 o and down stayed on cuBLAS
    although the sweep has ours 5-20% faster). `dirty_flush`: flush by writing, the old way (for
    `bench_kernels --gemv-sweep --startup-check`, which compares the two)."""
    flush = torch.ones(L2_FLUSH_BYTES // 4, dtype=torch.float32, device="cuda")
    sink = torch.empty((), dtype=torch.float32, device="cuda")
    fn()  # compile / warm up
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if dirty_flush:
            flush.fill_(1.0)
        else:
            torch.sum(flush, dim=0, out=sink)
        torch.cuda._sleep(SPIN_CYCLES)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)

"""The CUDA side of the linear layers' own kernels: one entry per format, and the per-shape choice between our
decode GEMV and the library's product, made once per shape at start-up.

    int_weight_matmul  4-bit: quant_gemv.int4_gemv (split-K GEMV) for M <= 64, above it quant_int4.dequantize +
                       the library's GEMM; other widths have no kernel (asyncengine rejects them on CUDA at start-up)
    fp8_linear         quant_fp8: per-token quantization + torch._scaled_mm (per-tensor form when it applies)
    fp8_gemm_linear    quant_fp8: the same product through our W8A8 GEMM (fp8_gemm.py), for decode-sized batches
    dense_gemv         quant_gemv: bf16/fp16 or FP8 (weight-only) weights at M <= 64 (where measured faster), FP8
                       with group scales (block-wise checkpoints) too
    fp8_group_linear   quant_fp8: FP8 with group scales above the GEMV's sizes: dequantize, then the library's GEMM
    (the GEMV's tiles per shape: quant_gemv_configs.TUNED, filled from `bench_kernels --gemv-sweep`)
    gemv_max_m         measures dense_gemv against the library per decode batch size (graph_time_us)
    fp8_gemm_max_m     the same for fp8_gemm_linear against fp8_linear, at M = 16 ... 512
Same signatures as kernels/quant_reference.py.
"""

from __future__ import annotations

import logging
import statistics
from typing import Callable

import torch

from .fp8_gemm import MAX_M as FP8_GEMM_MAX_M
from .quant_fp8 import fp8_gemm_linear, fp8_group_linear, fp8_linear
from .quant_gemv import MAX_M, dense_gemv
from .quant_int4 import int_weight_matmul

__all__ = ["dense_gemv", "fp8_gemm_linear", "fp8_gemm_max_m", "fp8_group_linear", "fp8_linear", "gemv_max_m",
           "int_weight_matmul"]

logger = logging.getLogger(__name__)
DECODE_SIZES = (1, 2, 4, 8, 16, 32, 64)  # the batch sizes measured; a choice holds up to the next one
GEMM_SIZES = (16, 32, 64, 128, 256, 512)  # fp8_gemm_max_m's: the FP8 GEMM's token tiles (fp8_gemm.m_bucket)
MEASURE_ROUNDS = 2  # alternating (ours, library) measurements per batch size; the medians decide
L2_DEFEAT_BYTES = 256 << 20  # weight copies cycled per timed graph: several times any GPU's L2 (H200: 60 MB)
_chosen: dict[tuple, int] = {}


def gemv_max_m(key: tuple, ours: Callable, library: Callable, weights: tuple, k: int, dtype: torch.dtype,
               device) -> int:
    """The largest decode batch size M (of DECODE_SIZES, up to MAX_M) for which `ours(x, w)` beat `library(x, w)`
    on x [M, k] at every size up to it (0: never); w: `weights` (the layer's weight tensors, e.g. (weight, scale)),
    or a copy of them. Measured once per `key` (the shape and format: layers of one shape share it) with
    `graph_time_us` over copies of the weights, the medians of alternating rounds, and logged.

    Why graphs: decode steps replay CUDA graphs, where each kernel's launch and tail overlap its neighbours'
    (programmatic dependent launch). Timing one call between events (sessions 8-9) charged our GEMV a fixed ~3 us
    that graphs hide: on an H200 it timed the 8B `o` GEMV at 15.2 us against cuBLAS's 14.6 and kept cuBLAS, where
    in graphs ours takes 12.1 us and cuBLAS 14.5 (run 60). End to end the graphs' choices were no faster than the
    single-call ones (run 67, one H200: 8B bf16 W3 4.62 against 4.53 ms; FP8 3.07 against 3.09): at margins of a
    few percent an isolated kernel's time does not predict its cost inside the step's graph."""
    return _largest_m_beating(key, ours, library, weights, k, dtype, device, DECODE_SIZES, MAX_M, "decode GEMV")


def fp8_gemm_max_m(key: tuple, ours: Callable, library: Callable, weights: tuple, k: int, dtype: torch.dtype,
                   device) -> int:
    """As gemv_max_m, for our W8A8 GEMM (`ours`, fp8_gemm_linear) against the library's (`library`, fp8_linear) at
    the batch sizes of GEMM_SIZES: the largest M up to which ours won at every size (0: it lost the first). Run 91
    (one H100, 8B shapes, graphs): at M = 128 cuBLASLt's row-wise FP8 GEMM read the weights at 40-60% of the copy
    bandwidth."""
    return _largest_m_beating(key, ours, library, weights, k, dtype, device, GEMM_SIZES, FP8_GEMM_MAX_M, "FP8 GEMM")


def _largest_m_beating(key: tuple, ours: Callable, library: Callable, weights: tuple, k: int, dtype: torch.dtype,
                       device, sizes: tuple, cap: int, what: str) -> int:
    """The largest M of `sizes` (at most `cap`) up to which ours(x, w) beat library(x, w) at every size, 0 if it lost
    the first; measured once per (what, key) and logged (gemv_max_m says how)."""
    key = (what, *key)
    if key in _chosen:
        return _chosen[key]
    copies = _copies(weights)
    chosen, timings = 0, []
    for m in sizes:
        x = torch.randn(m, k, dtype=dtype, device=device)
        rounds = [(graph_time_us(lambda w: ours(x, w), copies), graph_time_us(lambda w: library(x, w), copies))
                  for _ in range(MEASURE_ROUNDS)]
        t_ours, t_library = (statistics.median(times) for times in zip(*rounds))
        timings.append(f"M={m}: {t_ours:.1f} vs {t_library:.1f} us")
        if t_ours >= t_library:
            break
        chosen = m
    del copies
    torch.cuda.empty_cache()  # the copies' memory back before the KV cache is sized
    _chosen[key] = min(chosen, cap)
    logger.info("%s for %s: ours up to M=%d (%s)", what, key[1:], chosen, "; ".join(timings))
    return _chosen[key]


def _copies(weights: tuple) -> list[tuple]:
    """`weights` and enough clones of it that cycling through them reads past L2 (at most 64 in all)."""
    nbytes = sum(t.numel() * t.element_size() for t in weights)
    count = max(1, min(64, L2_DEFEAT_BYTES // max(nbytes, 1) + 1))
    return [weights] + [tuple(t.clone() for t in weights) for _ in range(count - 1)]


def graph_time_us(call: Callable, copies: list, replays: int = 10) -> float:
    """GPU time of one call(w), from a CUDA graph of call(w) over every weight copy in `copies` in turn (at least 8
    calls; the copies defeat L2, so each call reads its weights from memory as a decode step's does): the median
    of `replays` timed replays, over the calls per replay. The host's time (a wrapper's Python) is outside the
    graph; neighbouring calls overlap their launches and tails as in a decode step's graph."""
    order = [copies[i % len(copies)] for i in range(max(8, len(copies)))]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        call(order[0])  # compile / warm up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for w in order:
            call(w)
    graph.replay()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / len(order))
    del graph
    return statistics.median(times)

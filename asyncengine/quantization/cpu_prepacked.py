"""Weights laid out for the CPU's GEMM (issue 17).

`F.linear(x, W)` with W stored [N, K] row-major asks the BLAS for x @ W^T; with the same W stored column-major
(the [K, N] matrix W^T contiguous, W a transposed view of it) the BLAS reads W^T directly. On this project's CPU
machines (AMD EPYC, AVX2, torch's MKL) the second is faster at decode sizes and the same at prefill sizes, and the
results are bit-identical (the same products summed in the same order): measured at 64 rows x (256 -> 512, 1408,
256; 704 -> 256; 256 -> 8192) 1.03-1.04x for the layers and 1.14x for an LM head of 8,192 rows.

The weight keeps its logical shape [N, K], so loaders, state dicts and every reader see the same tensor; only the
strides change. MKL's packed sgemm (`torch.ops.mkl._mkl_linear`) was no faster than the transposed layout except
the LM head (1.18x), and is not used.

oneDNN's packed format (`torch.ops.mkldnn._linear_pointwise` on a weight reordered once) depends on the machine:
on session 6's AVX2 EPYC it measured 0.82-0.99x on these shapes, on session 14's (AMD EPYC with AVX-512, 2 cores)
1.04-1.36x on the layers and 1.42x on an LM head of 8,192 rows. So each shape is timed once per machine
(`onednn_is_faster`; recorded on disk by asyncengine.measured_choices, so that every process there makes the same
choice and sums in the same order) and a layer keeps a packed copy beside its weight only where oneDNN won; its sums are in
another order than MKL's (about 5e-7 relative apart) and do not depend on the batch's size (a row's result is the
same alone or among 200, measured), which the engine's batch invariance needs. oneDNN caches a primitive per input
shape, so it only sees a few batch sizes (`onednn_rows`).
"""

from __future__ import annotations

import functools
import logging
import time

import torch
import torch.nn.functional as F

from asyncengine.measured_choices import MeasuredChoices

logger = logging.getLogger(__name__)
DECODE_ROWS = 64  # the batch the choice is timed at: a decode step of the CPU benchmark (issue 17)
MIN_GAIN = 1.05  # oneDNN must be this much faster to be worth its copy of the weight
ROW_STEP, MAX_ROWS = 16, 256  # oneDNN's batch sizes: multiples of 16 up to 256 (onednn_rows); larger: MKL


def use_cpu_gemm_layout(weight: torch.Tensor) -> None:
    """Re-store a 2-D CPU floating-point weight [N, K] column-major, in place (same values, same shape);
    anything else is left as it is. Its old storage is freed once nothing else refers to it."""
    if weight.device.type != "cpu" or weight.dim() != 2 or not weight.is_floating_point():
        return
    if weight.t().is_contiguous():  # already column-major
        return
    weight.data = weight.data.t().contiguous().t()


def is_cpu_gemm_layout(weight: torch.Tensor) -> bool:
    return weight.dim() == 2 and weight.t().is_contiguous()


def onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


def onednn_pack(weight: torch.Tensor) -> torch.Tensor:
    """A float32 weight [N, K] reordered once into oneDNN's blocked layout (an opaque tensor for `onednn_linear`)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), DECODE_ROWS)


def onednn_rows(m: int) -> int:
    """The rows oneDNN multiplies for a batch of m (0: too many, use MKL): m rounded up to a multiple of ROW_STEP,
    up to MAX_ROWS. oneDNN builds (and keeps) a primitive of ~0.5 MB for every input shape it sees: 600 distinct
    batch sizes grew the RSS by 354 MiB (1.3 GiB on a second pass), which the soak test caught as +246 MiB/min. With
    rows rounded so, each weight shape has at most MAX_ROWS / ROW_STEP primitives."""
    if m > MAX_ROWS:
        return 0
    return -(-m // ROW_STEP) * ROW_STEP


def onednn_linear(x: torch.Tensor, packed: torch.Tensor, bias=None) -> torch.Tensor:
    """F.linear(x, W, bias) with W as `onednn_pack` made it; x [M, K] float32 with M <= MAX_ROWS (`onednn_rows`):
    x's rows are padded with zeros to the rounded count, and the result cut back (a row's result does not depend
    on the rows beside it)."""
    m = x.shape[0]
    rows = onednn_rows(m)
    if rows != m:
        x = torch.cat((x, x.new_zeros(rows - m, x.shape[1])))
    out = torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    return out if rows == m else out[:m]


@functools.cache
def onednn_is_faster(n: int, k: int, threads: int) -> bool:
    """Whether oneDNN's packed product beats F.linear on the column-major layout by MIN_GAIN at DECODE_ROWS rows
    of float32 for a weight [n, k] on this machine with `threads` threads: timed once per machine (`_time_onednn`)
    and recorded on disk (asyncengine.measured_choices), then read by every later process."""
    if not onednn_available():
        return False
    key = f"onednn faster than MKL: {n}x{k}, {DECODE_ROWS} rows, {threads} threads, gain {MIN_GAIN}"
    return bool(MeasuredChoices("cpu_gemm").get_or_measure(key, lambda: _time_onednn(n, k)))


def _time_onednn(n: int, k: int) -> bool:
    """onednn_is_faster's measurement: random values, medians of 5 rounds of 20 calls each, alternating; logged."""
    weight = torch.randn(k, n).t()  # column-major, as use_cpu_gemm_layout stores it
    packed = onednn_pack(weight)
    x = torch.randn(DECODE_ROWS, k)
    calls = {"mkl": lambda: F.linear(x, weight), "onednn": lambda: onednn_linear(x, packed)}
    times: dict[str, list[float]] = {name: [] for name in calls}
    for call in calls.values():
        call()
    for _ in range(5):
        for name, call in calls.items():
            start = time.perf_counter()
            for _ in range(20):
                call()
            times[name].append(time.perf_counter() - start)
    mkl, onednn = (sorted(times[name])[2] for name in ("mkl", "onednn"))
    faster = mkl / onednn >= MIN_GAIN
    logger.info("CPU GEMM for %dx%d at %d rows: %s (MKL %.0f us, oneDNN %.0f us; recorded for this machine)", n, k,
                DECODE_ROWS, "oneDNN" if faster else "MKL", mkl / 20 * 1e6, onednn / 20 * 1e6)
    return faster


def cpu_onednn_weight(weight: torch.Tensor, with_bias: bool = False):
    """The packed copy a CPU float32 layer should multiply with (None: F.linear on `weight`). `with_bias`: whether
    the layer's products carry a bias; the primitives of its every row count are built now (build_primitives)."""
    if weight.device.type != "cpu" or weight.dtype != torch.float32 or weight.dim() != 2:
        return None
    if not onednn_is_faster(*weight.shape, torch.get_num_threads()):
        return None
    packed = onednn_pack(weight)
    build_primitives(packed, *weight.shape, with_bias)
    return packed


_BUILT: set[tuple[int, int, bool]] = set()  # (n, k, with_bias) whose primitives this process has built


def build_primitives(packed: torch.Tensor, n: int, k: int, with_bias: bool) -> None:
    """Have oneDNN build, now, its primitive for every row count `onednn_rows` gives (ROW_STEP to MAX_ROWS) for a
    packed weight [n, k], with or without a bias (another primitive); once per process and shape.

    oneDNN builds a primitive the first time it sees an input shape and keeps it, about 0.55 MiB each (16 row counts
    of the default model's five shapes: +45 MiB, then flat; a bias doubles it). Built lazily, they raised a server's
    RSS for minutes, as rarer batch sizes came, and the CI soak read that as a slope of 3-6 MiB/min (stop 41); built
    here, at load, the memory is there before the first request, which pays no build."""
    if (n, k, with_bias) in _BUILT:
        return
    bias = torch.zeros(n) if with_bias else None
    for rows in range(ROW_STEP, MAX_ROWS + 1, ROW_STEP):
        onednn_linear(torch.zeros(rows, k), packed, bias)
    _BUILT.add((n, k, with_bias))

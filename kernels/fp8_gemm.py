"""W8A8 FP8 GEMM for decode-sized batches: y = (x8 * x_scale) @ (w8 * w_scale)^T (+ bias), e4m3 on the tensor cores.

Why our own: at the batch sizes of a loaded server's decode steps (M of 16-256 tokens), cuBLASLt's FP8 GEMM
(`torch._scaled_mm`) streams the weight far below the memory bandwidth. Run 91 (one H100, the 8B shapes, CUDA
graphs): at M = 128 the row-wise form takes 21.4 us on qkv (4096 -> 6144) and 47.1 us on down (14336 -> 4096),
where reading their 25 MB and 59 MB of e4m3 weights takes ~8 and ~19 us. A W1 decode step (M ~115) spends
~60% of its GPU time in these products.

Layout: each program owns BLOCK_N output channels of BLOCK_M tokens and one of SPLIT_K slices of K. The product is
computed swapped, acc [BLOCK_N, BLOCK_M] = W's tile [BLOCK_N, BLOCK_K] @ x's tile^T, so that the weight's rows fill
the tensor core's wide side (Hopper's wgmma needs 64 rows) and the few tokens its narrow one (8-256). Both operands
are K-major, as FP8 MMA requires. Scales in the epilogue: per output channel (w_scale [N], or one for the tensor)
times per token (x_scale [M], or one). Split-K as the decode GEMV does it (quant_gemv.py): each slice stores float32
partial sums and bumps a per-tile arrival counter; the last slice to arrive sums the slices in a fixed order,
finishes the tile and resets its counter (calls must not overlap on two streams).

The reference is `quant_reference.fp8_scaled_mm` (float32 sums of exact e4m3 products; the tensor cores' FP8
accumulation is not IEEE float32, hence the tests' bf16-level tolerances). Tiles per shape: FP8_GEMM_TUNED, filled
from `python -m loadtest.bench_kernels --fp8-gemm-sweep`, else `default_config`.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import triton
import triton.language as tl

from . import arrival_counters, interpreting, sm_count
from .pdl import enabled as pdl_enabled, wait_for_prior_grids

MAX_M = 512  # the largest batch this kernel takes (above it cuBLASLt's GEMM is compute bound and fast)
_COUNTER_SLOTS = 1 << 16  # one int32 counter per (M tile, N tile)


@dataclasses.dataclass(frozen=True)
class Fp8GemmConfig:
    """One launch configuration: block_n output channels by block_k inputs per weight tile, split_k K slices
    (1: y written directly), block_m tokens per program (0: the batch's bucket, `block_m_for`)."""

    block_n: int
    block_k: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 4
    block_m: int = 0

    def __post_init__(self):
        for name in ("block_n", "block_k"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"Fp8GemmConfig.{name} must be a power of two >= 16, got {value}")
        if self.block_m and (self.block_m < 16 or self.block_m & (self.block_m - 1)):
            raise ValueError(f"Fp8GemmConfig.block_m must be 0 or a power of two >= 16, got {self.block_m}")
        if self.split_k < 1:
            raise ValueError(f"Fp8GemmConfig.split_k must be >= 1, got {self.split_k}")


@triton.jit
def _fp8_gemm_kernel(
    out_ptr,  # [M, N] out dtype
    partial_ptr,  # [SPLIT_K, M, N] float32 (PARTIAL)
    counter_ptr,  # [>= M tiles * N tiles] int32, zero between calls (PARTIAL)
    x_ptr,  # [M, K] e4m3, unit stride along K
    w_ptr,  # [N, K] e4m3, unit stride along K
    x_scale_ptr,  # [M] float32 (stride_xs 1) or one value (stride_xs 0)
    w_scale_ptr,  # [N] float32 (stride_ws 1) or one value (stride_ws 0)
    bias_ptr,  # [N] (HAS_BIAS)
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_xs,
    stride_ws,
    k_per_split,  # a multiple of BLOCK_K
    split_k,
    HAS_BIAS: tl.constexpr,
    PARTIAL: tl.constexpr,  # split_k > 1
    EVEN_K: tl.constexpr,  # every K slice is whole BLOCK_K tiles: no mask along K
    DOT_FP32: tl.constexpr,  # Triton's interpreter: the dot in float32 on the exact e4m3 values
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_PDL: tl.constexpr,  # launched with PDL (kernels/pdl.py)
):
    pid_n, pid_m, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    wait_for_prior_grids(USE_PDL)  # x is the previous kernel's output; the counters its previous user's
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # output channels: W's rows
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # tokens: x's rows
    col_mask, row_mask = cols < N, rows < M
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    w_rows = w_ptr + cols[:, None].to(tl.int64) * stride_wn
    x_rows = x_ptr + rows[:, None].to(tl.int64) * stride_xm
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        if EVEN_K:
            w = tl.load(w_rows + ks[None, :], mask=col_mask[:, None], other=0.0)  # [BN, BK]
            x = tl.load(x_rows + ks[None, :], mask=row_mask[:, None], other=0.0)  # [BM, BK]
        else:
            k_mask = (ks < k_end)[None, :]
            w = tl.load(w_rows + ks[None, :], mask=col_mask[:, None] & k_mask, other=0.0)
            x = tl.load(x_rows + ks[None, :], mask=row_mask[:, None] & k_mask, other=0.0)
        if DOT_FP32:
            acc = tl.dot(w.to(tl.float32), tl.trans(x.to(tl.float32)), acc, input_precision="ieee",
                         out_dtype=tl.float32)
        else:
            acc = tl.dot(w, tl.trans(x), acc, out_dtype=tl.float32)
    offsets = rows[None, :] * N + cols[:, None]  # [BN, BM] into one [M, N] slice
    mask = col_mask[:, None] & row_mask[None, :]
    if PARTIAL:
        tl.store(partial_ptr + pid_k * M * N + offsets, acc, mask=mask)
        tl.debug_barrier()  # every thread's partial sums stored before the (release) atomic below
        tile = pid_m * tl.num_programs(0) + pid_n
        arrived = tl.atomic_add(counter_ptr + tile, 1, sem="acq_rel")
        if arrived == split_k - 1:  # the last slice of this tile: reduce in slice order, finish, reset the counter
            total = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
            for s in range(0, split_k):
                total += tl.load(partial_ptr + s * M * N + offsets, mask=mask, other=0.0, cache_modifier=".cg")
            _store(out_ptr, total, x_scale_ptr, w_scale_ptr, bias_ptr, rows, cols, row_mask, col_mask, offsets,
                   mask, stride_xs, stride_ws, HAS_BIAS)
            tl.atomic_xchg(counter_ptr + tile, 0)
    else:
        _store(out_ptr, acc, x_scale_ptr, w_scale_ptr, bias_ptr, rows, cols, row_mask, col_mask, offsets, mask,
               stride_xs, stride_ws, HAS_BIAS)


@triton.jit
def _store(out_ptr, acc, x_scale_ptr, w_scale_ptr, bias_ptr, rows, cols, row_mask, col_mask, offsets, mask,
           stride_xs, stride_ws, HAS_BIAS: tl.constexpr):
    """acc [BN, BM] float32 * w_scale[cols] * x_scale[rows] (+ bias[cols]) -> y[rows, cols] in y's dtype."""
    w_scale = tl.load(w_scale_ptr + cols * stride_ws, mask=col_mask, other=0.0)
    x_scale = tl.load(x_scale_ptr + rows * stride_xs, mask=row_mask, other=0.0)
    acc = acc * w_scale[:, None] * x_scale[None, :]
    if HAS_BIAS:
        acc = acc + tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[:, None]
    tl.store(out_ptr + offsets, acc.to(out_ptr.dtype.element_ty), mask=mask)


# -- configuration ------------------------------------------------------------------------------------------

def block_m_for(m: int) -> int:
    """Tokens per program: the batch's power-of-two bucket, 16 to 256 (a larger batch takes several M tiles, each
    reading the weight again)."""
    return min(256, max(16, triton.next_power_of_2(m)))


def m_bucket(m: int) -> int:
    """The config table's batch key: the next power of two of m, at least 16."""
    return max(16, triton.next_power_of_2(m))


def split_k_for(n: int, k: int, m_tiles: int, block_n: int, block_k: int, num_sms: int) -> int:
    """No split when the tiles alone give every SM a program; else enough K slices (of whole K tiles) for about
    one program per SM (each program streams its slice once; more would only add partial sums)."""
    tiles = triton.cdiv(n, block_n) * m_tiles
    if tiles >= num_sms:
        return 1
    return max(1, min(triton.cdiv(num_sms, tiles), k // block_k))


def default_config(m: int, n: int, k: int, num_sms: int) -> Fp8GemmConfig:
    """Untuned tiles: 128 channels by 128 inputs, the split from `split_k_for`."""
    block_n, block_k = 128, 128
    m_tiles = triton.cdiv(m, block_m_for(m))
    return Fp8GemmConfig(block_n, block_k, split_k_for(n, k, m_tiles, block_n, block_k, num_sms))


def config_for(m: int, n: int, k: int, num_sms: int) -> Fp8GemmConfig:
    """The tuned config of this shape and batch bucket (fp8_gemm_configs.FP8_GEMM_TUNED), or the default one."""
    from .fp8_gemm_configs import FP8_GEMM_TUNED

    return FP8_GEMM_TUNED.get((n, k, m_bucket(m))) or default_config(m, n, k, num_sms)


def _scale_arg(scale: torch.Tensor, length: int, name: str) -> tuple[torch.Tensor, int]:
    """(a float32 tensor, its stride): per-row scales [length] / [length, 1] (stride 1), or one value (stride 0)."""
    if scale.dtype != torch.float32:
        raise ValueError(f"fp8_gemm: {name} must be float32, got {scale.dtype}")
    if scale.numel() == 1:
        return scale.reshape(1), 0
    if scale.numel() != length:
        raise ValueError(f"fp8_gemm: {name} has {scale.numel()} values for {length} rows")
    flat = scale.reshape(-1)
    return (flat if flat.stride(0) == 1 else flat.contiguous()), 1


def fp8_gemm(x8: torch.Tensor, x_scale: torch.Tensor, w8: torch.Tensor, w_scale: torch.Tensor,
             out_dtype: torch.dtype, bias: Optional[torch.Tensor] = None, config: Optional[Fp8GemmConfig] = None,
             num_sms: Optional[int] = None) -> torch.Tensor:
    """x8 [M, K] e4m3 (M <= MAX_M) with x_scale [M, 1] or [], w8 [N, K] e4m3 with w_scale [N, 1], [N] or [] ->
    [M, N] in out_dtype. Same contract as quant_reference.fp8_scaled_mm. config: tiles for this call (default:
    `config_for`)."""
    m, k = x8.shape
    n = w8.shape[0]
    if x8.dtype != torch.float8_e4m3fn or w8.dtype != torch.float8_e4m3fn:
        raise ValueError(f"fp8_gemm: x and the weight must be float8_e4m3fn, got {x8.dtype} and {w8.dtype}")
    if w8.shape[1] != k:
        raise ValueError(f"fp8_gemm: x has {k} inputs, the weight {w8.shape[1]}")
    if m > MAX_M:
        raise ValueError(f"fp8_gemm takes at most {MAX_M} rows, got {m}")
    if x8.stride(1) != 1 or w8.stride(1) != 1:
        raise ValueError("fp8_gemm: x and the weight must have unit stride along K")
    if m == 0:
        return torch.empty((0, n), device=x8.device, dtype=out_dtype)
    if num_sms is None:
        num_sms = sm_count(x8.device.index) if x8.is_cuda else 4
    if config is None:
        config = config_for(m, n, k, num_sms)
    xs, stride_xs = _scale_arg(x_scale, m, "x_scale")
    ws, stride_ws = _scale_arg(w_scale, n, "w_scale")
    block_m = config.block_m or block_m_for(m)
    m_tiles, n_tiles = triton.cdiv(m, block_m), triton.cdiv(n, config.block_n)
    if m_tiles * n_tiles > _COUNTER_SLOTS:
        raise ValueError(f"fp8_gemm: {m_tiles * n_tiles} tiles exceed {_COUNTER_SLOTS} (raise block_n)")
    block_k = min(config.block_k, max(16, triton.next_power_of_2(k)))
    k_per_split = triton.cdiv(triton.cdiv(k, config.split_k), block_k) * block_k
    split_k = triton.cdiv(k, k_per_split)
    out = torch.empty((m, n), device=x8.device, dtype=out_dtype)
    partial = split_k > 1
    workspace = torch.empty((split_k, m, n), device=x8.device, dtype=torch.float32) if partial else out
    counters = arrival_counters("the FP8 GEMM", x8.device, _COUNTER_SLOTS)
    pdl = pdl_enabled(x8.device)
    _fp8_gemm_kernel[(n_tiles, m_tiles, split_k)](
        out, workspace, counters, x8, w8, xs, ws, bias if bias is not None else out, m, n, k, x8.stride(0),
        w8.stride(0), stride_xs, stride_ws, k_per_split, split_k,
        HAS_BIAS=bias is not None, PARTIAL=partial, EVEN_K=k % k_per_split == 0 and k_per_split % block_k == 0,
        DOT_FP32=interpreting(), BLOCK_M=block_m, BLOCK_N=config.block_n, BLOCK_K=block_k, USE_PDL=pdl,
        num_warps=config.num_warps, num_stages=config.num_stages, launch_pdl=pdl)
    return out

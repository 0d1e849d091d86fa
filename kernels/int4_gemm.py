"""int4 weight-only GEMM for mid-sized batches (M of 65-512 tokens): y = x @ W (+ bias), W in the engine's packed
int4 layout (quant_reference.py: qweight [K / 8, N] int32, eight inputs per word; scales / zeros [G, N]).

Why: above the decode GEMV's 64 rows (quant_gemv.py) the int4 product dequantized W into a bf16 buffer and called
cuBLAS (quant_int4.py), paying a full bf16 pass over the weight plus the dequantization's own: an AWQ model served
0.82-0.86x the bf16 engine's W1 requests/s (runs 87, 102), where the weight's bytes alone would allow more.

Layout: each program owns BLOCK_N output channels of BLOCK_M tokens and one of SPLIT_K slices of K, and reads its
packed weight tiles once. The product is computed swapped, acc [BLOCK_N, BLOCK_M] = W^T's tile @ x's tile^T, so the
weight tile made in registers is the tensor core's A operand (which Hopper's wgmma may take from registers) and x's
tile, loaded from memory, the B operand. No float math per weight: the nibbles become the exact half-precision
codes BIAS + q (one OR under the exponent whose unit in the last place is 1: BIAS = 128 for bf16, 1024 for fp16),
and per K tile (one group: BLOCK_K divides group_size)
    sum_k x (q - z) s = s * (codes @ x - (BIAS + z) * sum_k x),
as the GEMV's tl.dot path does (quant_gemv._dot_step). Split-K as the FP8 GEMM (fp8_gemm.py): float32 partial
sums, a per-tile arrival counter, the last slice to arrive sums the slices in a fixed order and writes y.

The reference is quant_reference.int_weight_matmul (float32 sums of the dequantized weight); bf16 / fp16 x only.
Tiles: `default_config`, or INT4_GEMM_TUNED (from `python -m loadtest.bench_kernels --int4-gemm-sweep`).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import triton
import triton.language as tl

from . import arrival_counters, interpreting, sm_count
from .pdl import enabled as pdl_enabled, wait_for_prior_grids

MAX_M = 512  # the largest batch this kernel takes
_COUNTER_SLOTS = 1 << 16  # one int32 counter per (M tile, N tile)


@dataclasses.dataclass(frozen=True)
class Int4GemmConfig:
    """block_n output channels by block_k inputs per weight tile (block_k divides the group size), split_k K slices
    (1: y written directly), block_m tokens per program."""

    block_n: int = 128
    block_k: int = 64
    block_m: int = 64
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self):
        for name in ("block_n", "block_k", "block_m"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"Int4GemmConfig.{name} must be a power of two >= 16, got {value}")
        if self.split_k < 1:
            raise ValueError(f"Int4GemmConfig.split_k must be >= 1, got {self.split_k}")


@triton.jit
def _int4_codes_nk(w_ptr, k0, cols, col_mask, N, X_FP16: tl.constexpr, BLOCK_K: tl.constexpr,
                   BLOCK_N: tl.constexpr):
    """W^T's tile [BLOCK_N, BLOCK_K] at input k0 as exact half-precision codes BIAS + q (channel n, input k0 + k at
    [n, k]); each packed word is loaded once."""
    words_k = k0 // 8 + tl.arange(0, BLOCK_K // 8)  # [BK / 8] rows of qweight
    words = tl.load(w_ptr + words_k[None, :].to(tl.int64) * N + cols[:, None], mask=col_mask[:, None],
                    other=0)  # [BN, BK / 8] int32
    nibbles = (words[:, :, None] >> (tl.arange(0, 8) * 4)[None, None, :]) & 0xF  # [BN, BK / 8, 8]: input 8 r + j
    if X_FP16:
        codes = (nibbles | 0x6400).to(tl.int16).to(tl.float16, bitcast=True)
    else:
        codes = (nibbles | 0x4300).to(tl.int16).to(tl.bfloat16, bitcast=True)
    return tl.reshape(codes, (BLOCK_N, BLOCK_K))


@triton.jit
def _int4_gemm_kernel(
    out_ptr,  # [M, N] in x's dtype
    partial_ptr,  # [SPLIT_K, M, N] float32 (PARTIAL)
    counter_ptr,  # [>= M tiles * N tiles] int32, zero between calls (PARTIAL)
    x_ptr,  # [M, K] bf16 / fp16, unit stride along K
    w_ptr,  # [K // 8, N] int32
    scale_ptr,  # [G, N]
    zero_ptr,  # [G, N]
    bias_ptr,  # [N] (HAS_BIAS)
    M,
    N,
    K,
    stride_xm,
    group_size,  # a multiple of BLOCK_K
    k_per_split,  # a multiple of BLOCK_K
    split_k,
    HAS_BIAS: tl.constexpr,
    PARTIAL: tl.constexpr,  # split_k > 1
    X_FP16: tl.constexpr,  # x in fp16 (else bf16)
    DOT_FP32: tl.constexpr,  # Triton's interpreter: the dot in float32 (the codes and x are exact there)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_PDL: tl.constexpr,  # launched with PDL (kernels/pdl.py)
):
    pid_n, pid_m, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    wait_for_prior_grids(USE_PDL)  # x is the previous kernel's output; the counters its previous user's
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # output channels
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # tokens
    col_mask, row_mask = cols < N, rows < M
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    x_rows = x_ptr + rows[:, None].to(tl.int64) * stride_xm
    bias_code = 1024.0 if X_FP16 else 128.0
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        codes = _int4_codes_nk(w_ptr, k0, cols, col_mask, N, X_FP16, BLOCK_K, BLOCK_N)  # [BN, BK]
        x = tl.load(x_rows + (k0 + tl.arange(0, BLOCK_K))[None, :], mask=row_mask[:, None], other=0.0)  # [BM, BK]
        if DOT_FP32:
            part = tl.dot(codes.to(tl.float32), tl.trans(x.to(tl.float32)), input_precision="ieee",
                          out_dtype=tl.float32)
        else:
            part = tl.dot(codes, tl.trans(x), out_dtype=tl.float32)  # [BN, BM]
        group = k0 // group_size
        scale = tl.load(scale_ptr + group * N + cols, mask=col_mask, other=0.0).to(tl.float32)  # [BN]
        zero = tl.load(zero_ptr + group * N + cols, mask=col_mask, other=0.0).to(tl.float32) + bias_code
        x_sum = tl.sum(x.to(tl.float32), axis=1)  # [BM]
        acc += (part - zero[:, None] * x_sum[None, :]) * scale[:, None]
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
            _store(out_ptr, total, bias_ptr, cols, col_mask, offsets, mask, HAS_BIAS)
            tl.atomic_xchg(counter_ptr + tile, 0)
    else:
        _store(out_ptr, acc, bias_ptr, cols, col_mask, offsets, mask, HAS_BIAS)


@triton.jit
def _store(out_ptr, acc, bias_ptr, cols, col_mask, offsets, mask, HAS_BIAS: tl.constexpr):
    """acc [BN, BM] float32 (+ bias[cols]) -> y[rows, cols] in y's dtype."""
    if HAS_BIAS:
        acc = acc + tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[:, None]
    tl.store(out_ptr + offsets, acc.to(out_ptr.dtype.element_ty), mask=mask)


# -- configuration ------------------------------------------------------------------------------------------

def m_bucket(m: int) -> int:
    """The config table's batch key: the next power of two of m, at least 16."""
    return max(16, triton.next_power_of_2(m))


def split_k_for(n: int, k: int, m_tiles: int, block_n: int, block_k: int, num_sms: int) -> int:
    """No split when the tiles alone give every SM a program; else enough K slices for about one program per SM."""
    tiles = triton.cdiv(n, block_n) * m_tiles
    if tiles >= num_sms:
        return 1
    return max(1, min(triton.cdiv(num_sms, tiles), k // block_k))


def default_config(m: int, n: int, k: int, num_sms: int) -> Int4GemmConfig:
    """Untuned tiles: 128 channels by 64 inputs by 64 tokens (128 above 64), the split from `split_k_for`."""
    block_m = 64 if m <= 64 else 128
    base = Int4GemmConfig(block_m=block_m)
    return dataclasses.replace(base, split_k=split_k_for(n, k, triton.cdiv(m, block_m), base.block_n,
                                                         base.block_k, num_sms))


def config_for(m: int, n: int, k: int, num_sms: int) -> Int4GemmConfig:
    """The tuned config of this shape and batch bucket (int4_gemm_configs.INT4_GEMM_TUNED), or the default one."""
    try:
        from .int4_gemm_configs import INT4_GEMM_TUNED
    except ImportError:
        INT4_GEMM_TUNED = {}
    return INT4_GEMM_TUNED.get((n, k, m_bucket(m))) or default_config(m, n, k, num_sms)


def supports(x: torch.Tensor, k: int, group_size: int, config: Int4GemmConfig) -> bool:
    """Whether this kernel takes x [M, K] (bf16 / fp16, M <= MAX_M) with these tiles: K and the group size whole
    multiples of block_k."""
    return (x.dtype in (torch.bfloat16, torch.float16) and x.shape[0] <= MAX_M and k % config.block_k == 0
            and group_size % config.block_k == 0)


def int4_gemm(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
              bias: Optional[torch.Tensor] = None, config: Optional[Int4GemmConfig] = None,
              num_sms: Optional[int] = None) -> torch.Tensor:
    """x [M, K] (bf16 / fp16, M <= MAX_M) @ W (+ bias) -> [M, N] in x's dtype, W packed int4 (qweight [K / 8, N],
    scales / zeros [G, N]). Same contract as quant_reference.int_weight_matmul with bits = 4. config: tiles for this
    call (default: `config_for`); `supports` must hold."""
    m, k = x.shape
    n = qweight.shape[1]
    if qweight.shape[0] * 8 != k:
        raise ValueError(f"int4_gemm: x has {k} inputs, the packed weight {qweight.shape[0] * 8}")
    if num_sms is None:
        num_sms = sm_count(x.device.index) if x.is_cuda else 4
    if config is None:
        config = config_for(m, n, k, num_sms)
    if not supports(x, k, group_size, config):
        raise ValueError(f"int4_gemm: x {tuple(x.shape)} {x.dtype} with group size {group_size} does not fit "
                         f"(bf16/fp16, at most {MAX_M} rows, K and the group size multiples of {config.block_k})")
    if x.stride(1) != 1:
        x = x.contiguous()
    out = torch.empty((m, n), device=x.device, dtype=x.dtype)
    if m == 0:
        return out
    m_tiles, n_tiles = triton.cdiv(m, config.block_m), triton.cdiv(n, config.block_n)
    if m_tiles * n_tiles > _COUNTER_SLOTS:
        raise ValueError(f"int4_gemm: {m_tiles * n_tiles} tiles exceed {_COUNTER_SLOTS} (raise block_n)")
    k_per_split = triton.cdiv(triton.cdiv(k, config.split_k), config.block_k) * config.block_k
    split_k = triton.cdiv(k, k_per_split)
    partial = split_k > 1
    workspace = torch.empty((split_k, m, n), device=x.device, dtype=torch.float32) if partial else out
    counters = arrival_counters("the int4 GEMM", x.device, _COUNTER_SLOTS)
    pdl = pdl_enabled(x.device)
    _int4_gemm_kernel[(n_tiles, m_tiles, split_k)](
        out, workspace, counters, x, qweight, scales, zeros, bias if bias is not None else out, m, n, k, x.stride(0),
        group_size, k_per_split, split_k, HAS_BIAS=bias is not None, PARTIAL=partial,
        X_FP16=x.dtype == torch.float16, DOT_FP32=interpreting(), BLOCK_M=config.block_m, BLOCK_N=config.block_n,
        BLOCK_K=config.block_k, USE_PDL=pdl, num_warps=config.num_warps, num_stages=config.num_stages,
        launch_pdl=pdl)
    return out

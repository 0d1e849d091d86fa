"""Decode GEMV for small batches (M <= 64): y = x @ W^T (+ bias), one kernel for every weight format of a decode
step, each read once from memory in its stored form:

    dense  weight [N, K] in bf16 / fp16 / fp32, or FP8 e4m3 with one float32 scale per output channel ([N, 1] or
           []; weight-only: x stays in its dtype)
    int4   the engine's packed layout (quant_reference.py): qweight [K / 8, N] int32, eight 4-bit inputs per
           word along K; scales / zeros [G, N], group g covering inputs g * group_size ... AWQ and GPTQ
           checkpoints (each with its own packing order) are converted to this layout at load time, so one
           kernel reads both.

Each program owns BLOCK_N outputs of all M rows and one of SPLIT_K slices of K, streaming its [BLOCK_K, BLOCK_N]
tiles of W once. An int4 tile never crosses a group (BLOCK_K divides group_size), so a tile reads its group's
scales and zeros once ([BLOCK_N] each) and each packed word once.
  M == 1 (config.dot false): FMA, no 16-row MMA tile of which 15 rows are padding: each step sums the products
      of each 16-byte vector of a W row (an int4 word) in-thread into a [BLOCK_K / VEC, BLOCK_N] float32 tile,
      reduced over K once after the loop.
  M > 1 (or config.dot): tl.dot on one tile of x of 16, 32 or 64 rows (the M bucket).
Split-K without an extra launch: each slice stores its float32 partial sums, then bumps a per-N-tile counter; the
slice that arrives last sums the partials, applies the scale and bias, writes y and resets the counter to zero
(so the next call, or a CUDA-graph replay, finds it zeroed). Calls must not overlap on two streams.

Tile sizes per shape come from quant_gemv_configs.TUNED (filled from `python -m loadtest.bench_kernels
--gemv-sweep` on the GPU), else from `default_config`.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import triton
import triton.language as tl

from . import arrival_counters, interpreting, sm_count
from .pdl import enabled as pdl_enabled, wait_for_prior_grids

MAX_M = 64
# Weight bytes each program asks L2 for before its PDL wait: at two programs per SM (the split-K rule) about 8 MB
# on an H100, what its bandwidth moves in the few microseconds of a previous kernel's tail, well inside its L2.
PREFETCH_BYTES = 32 * 1024
_COUNTER_SLOTS = 1 << 16  # one int32 counter per N tile: N / BLOCK_N <= 65536


@dataclasses.dataclass(frozen=True)
class GemvConfig:
    """One launch configuration. split_k: K slices (1: y written directly). dot: at M == 1, multiply through a
    16-row tl.dot anyway (M > 1 always does)."""

    block_n: int
    block_k: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3
    dot: bool = False

    def __post_init__(self):
        for name in ("block_n", "block_k"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise ValueError(f"GemvConfig.{name} must be a power of two, got {value}")
        if self.split_k < 1:
            raise ValueError(f"GemvConfig.split_k must be >= 1, got {self.split_k}")


# -- the kernel ---------------------------------------------------------------------------------------------

@triton.jit
def _int4_words(w_ptr, k0, cols, col_mask, N, K, BLOCK_K: tl.constexpr):
    """The [BLOCK_K // 8, BLOCK_N] packed words of W's tile at input k0 (each loaded once), and the nibble
    extracted from each for [BLOCK_K // 8, 8, BLOCK_N] (input k0 + 8 * r + j at [r, j, :]), still in place: the
    callers OR a magic exponent onto it instead of converting integers to floats (a slow instruction)."""
    words_k = k0 // 8 + tl.arange(0, BLOCK_K // 8)  # [BK / 8] rows of qweight
    words = tl.load(w_ptr + words_k[:, None].to(tl.int64) * N + cols[None, :],
                    mask=(words_k < K // 8)[:, None] & col_mask[None, :], other=0)  # [BK / 8, BN] int32
    shifts = tl.arange(0, 8) * 4
    return (words[:, None, :] >> shifts[None, :, None]) & 0xF  # the mask undoes the sign extension


@triton.jit
def _group_params(scale_ptr, zero_ptr, k0, cols, col_mask, N, group_size):
    """The scales and zero points [BLOCK_N] (float32) of the group holding inputs k0 ... (a tile never crosses a
    group)."""
    group = k0 // group_size
    scale = tl.load(scale_ptr + group * N + cols, mask=col_mask, other=0.0).to(tl.float32)
    zero = tl.load(zero_ptr + group * N + cols, mask=col_mask, other=0.0).to(tl.float32)
    return scale, zero


@triton.jit
def _int4_tile_f32(w_ptr, scale_ptr, zero_ptr, k0, cols, col_mask, N, K, group_size,
                   BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """The dequantized [BLOCK_K // 8, 8, BLOCK_N] float32 tile of W: (q - z) * s, exact like the reference.
    2**23 + q is q's bits under float32's exponent of 2**23 (one OR), and 2**23 + z is exact too."""
    nibbles = _int4_words(w_ptr, k0, cols, col_mask, N, K, BLOCK_K)
    scale, zero = _group_params(scale_ptr, zero_ptr, k0, cols, col_mask, N, group_size)
    q_plus = (nibbles | 0x4B000000).to(tl.float32, bitcast=True)  # 8388608 + q
    return (q_plus - (zero + 8388608.0)[None, None, :]) * scale[None, None, :]


@triton.jit
def _int4_codes(w_ptr, k0, cols, col_mask, N, K, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
                FP16: tl.constexpr):
    """W's tile as [BLOCK_K, BLOCK_N] exact half-precision values BIAS + q (BIAS = 1024 for fp16, 128 for bf16:
    the nibble ORed under the exponent whose unit in the last place is 1), for tl.dot; the caller subtracts
    (BIAS + z) * sum(x) and multiplies by s per tile."""
    nibbles = _int4_words(w_ptr, k0, cols, col_mask, N, K, BLOCK_K)
    if FP16:
        codes = (nibbles | 0x6400).to(tl.int16).to(tl.float16, bitcast=True)
    else:
        codes = (nibbles | 0x4300).to(tl.int16).to(tl.bfloat16, bitcast=True)
    return tl.reshape(codes, (BLOCK_K, BLOCK_N))


@triton.jit
def _dot_step(acc, x_ptr, w_ptr, scale_ptr, zero_ptr, k0, rows, row_mask, cols, col_mask, N, K, stride_xm,
              stride_wn, group_size, INT4: tl.constexpr, DOT_FP32: tl.constexpr, X_HALF: tl.constexpr,
              X_FP16: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """acc [BM, BN] plus x's rows times W's tile at input k0, through tl.dot."""
    ks = k0 + tl.arange(0, BLOCK_K)
    x = tl.load(x_ptr + rows[:, None] * stride_xm + ks[None, :], mask=row_mask[:, None] & (ks < K)[None, :],
                other=0.0)  # [BM, BK]
    if INT4 and X_HALF:
        # sum_k x (q - z) s = s * (x @ (BIAS + q) - (BIAS + z) * sum_k x) per tile (one group): no float math per
        # weight. (float32 x dequantizes instead: BIAS * sum_k x would cost it digits.)
        codes = _int4_codes(w_ptr, k0, cols, col_mask, N, K, BLOCK_K, BLOCK_N, X_FP16)  # [BK, BN]
        scale, zero = _group_params(scale_ptr, zero_ptr, k0, cols, col_mask, N, group_size)
        if DOT_FP32:  # Triton's interpreter
            part = tl.dot(x.to(tl.float32), codes.to(tl.float32), input_precision="ieee", out_dtype=tl.float32)
        else:
            part = tl.dot(x, codes, out_dtype=tl.float32)  # [BM, BN]
        if X_FP16:
            zero = zero + 1024.0
        else:
            zero = zero + 128.0
        x_sum = tl.sum(x.to(tl.float32), axis=1)  # [BM]
        return acc + (part - x_sum[:, None] * zero[None, :]) * scale[None, :]
    if INT4:
        w = _int4_tile_f32(w_ptr, scale_ptr, zero_ptr, k0, cols, col_mask, N, K, group_size, BLOCK_K, BLOCK_N)
        return acc + tl.dot(x.to(tl.float32), tl.reshape(w, (BLOCK_K, BLOCK_N)), input_precision="ieee",
                            out_dtype=tl.float32)
    w = tl.load(w_ptr + cols[None, :].to(tl.int64) * stride_wn + ks[:, None],
                mask=(ks < K)[:, None] & col_mask[None, :], other=0.0)  # W^T's tile [BK, BN]
    if DOT_FP32:
        return acc + tl.dot(x.to(tl.float32), w.to(tl.float32), input_precision="ieee", out_dtype=tl.float32)
    return acc + tl.dot(x, w.to(x_ptr.dtype.element_ty), out_dtype=tl.float32)


@triton.jit
def _fma_step(acc, x_ptr, w_ptr, scale_ptr, zero_ptr, k0, cols, col_mask, N, K, stride_wn, group_size,
              INT4: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, VEC: tl.constexpr):
    """acc [BK / VEC, BN] plus x's row 0 times W's tile at input k0 as [BK / VEC, VEC, BN]: the products of each
    VEC inputs (an int4 word; 16 bytes of a dense row) summed in-thread, the rest left for after the loop."""
    kv = k0 + tl.arange(0, BLOCK_K // VEC)[:, None] * VEC + tl.arange(0, VEC)[None, :]  # [BK / VEC, VEC]
    x = tl.load(x_ptr + kv, mask=kv < K, other=0.0).to(tl.float32)
    if INT4:  # VEC == 8: W's tile [BK / 8, 8, BN] in the same input order
        w = _int4_tile_f32(w_ptr, scale_ptr, zero_ptr, k0, cols, col_mask, N, K, group_size, BLOCK_K, BLOCK_N)
    else:
        w = tl.load(w_ptr + cols[None, None, :].to(tl.int64) * stride_wn + kv[:, :, None],
                    mask=(kv < K)[:, :, None] & col_mask[None, None, :], other=0.0).to(tl.float32)
    return acc + tl.sum(w * x[:, :, None], axis=1)


@triton.jit
def _prefetch_weights(w_ptr, pid_n, k_start, k_end, N, K, stride_wn, INT4: tl.constexpr, BLOCK_N: tl.constexpr,
                      PF_ROWS: tl.constexpr, PF_LINES: tl.constexpr, PF_STEP: tl.constexpr):
    """Ask L2 for the start of this program's weight slice (inputs k_start ... k_end), one `prefetch.global.L2`
    per 128-byte line: PF_LINES lines of PF_STEP elements along each of PF_ROWS contiguous rows (about
    PREFETCH_BYTES, `_prefetch_shape`). Called before the PDL wait: no kernel of the forward pass writes weights
    (kernels/pdl.py, rule 1), so this part of the weight stream overlaps the previous kernel's tail."""
    rows = tl.arange(0, PF_ROWS)
    lines = tl.arange(0, PF_LINES) * PF_STEP
    if INT4:  # qweight [K / 8, N]: rows along K, lines along N
        rows = k_start // 8 + rows
        cols = pid_n * BLOCK_N + lines
        valid = (rows < tl.minimum(k_end, K) // 8)[:, None] & (cols < N)[None, :]
        offsets = rows[:, None].to(tl.int64) * N + cols[None, :]
    else:  # W [N, K]: rows along N, lines along K
        rows = pid_n * BLOCK_N + rows
        ks = k_start + lines
        valid = (rows < N)[:, None] & (ks < tl.minimum(k_end, K))[None, :]
        offsets = rows[:, None].to(tl.int64) * stride_wn + ks[None, :]
    addresses = (w_ptr + tl.where(valid, offsets, 0)).to(tl.int64, bitcast=True)
    tl.inline_asm_elementwise("prefetch.global.L2 [$1]; // $0 unused", "=r,l", [addresses], dtype=tl.int32,
                              is_pure=False, pack=1)


@triton.jit
def _store_output(out_ptr, acc, scale_ptr, stride_scale, bias_ptr, rows, cols, row_mask, col_mask, N,
                  HAS_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr):
    """acc [BM, BN] float32 (* the weight's scale, + bias) -> y[rows, cols] in y's dtype."""
    if HAS_SCALE:
        acc = acc * tl.load(scale_ptr + cols * stride_scale, mask=col_mask, other=0.0)[None, :]
    if HAS_BIAS:
        acc = acc + tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + rows[:, None] * N + cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=row_mask[:, None] & col_mask[None, :])


@triton.jit
def _gemv_kernel(
    out_ptr,  # [M, N] in x's dtype
    partial_ptr,  # [SPLIT_K, M, N] float32 (PARTIAL)
    counter_ptr,  # [>= cdiv(N, BLOCK_N)] int32, zero between calls (PARTIAL)
    x_ptr,  # [M, K], unit stride along K
    w_ptr,  # dense: [N, K] (row stride stride_wn); INT4: [K // 8, N] int32
    scale_ptr,  # dense: [N] float32 (HAS_SCALE); INT4: [G, N]
    zero_ptr,  # INT4: [G, N]
    bias_ptr,  # [N] (HAS_BIAS)
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_scale,  # dense: 1 (per-channel scales) or 0 (one scale for the tensor)
    group_size,
    k_per_split,  # a multiple of BLOCK_K
    split_k,
    INT4: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    PARTIAL: tl.constexpr,  # split_k > 1
    USE_DOT: tl.constexpr,
    DOT_FP32: tl.constexpr,  # tl.dot in float32 (float32 x, or Triton's interpreter), else in x's dtype
    X_HALF: tl.constexpr,  # x in bf16 or fp16
    X_FP16: tl.constexpr,  # x in fp16
    BLOCK_M: tl.constexpr,  # 16, 32 or 64 (>= M) with USE_DOT, else 1
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    VEC: tl.constexpr,  # FMA path: inputs summed in-thread per step (8 bf16 / 16 fp8 / 4 fp32: 16 bytes; int4: 8)
    USE_PDL: tl.constexpr,  # launched with PDL (kernels/pdl.py): weights are prefetched into L2 before the wait
    PF_ROWS: tl.constexpr,  # the prefetch's shape (_prefetch_weights)
    PF_LINES: tl.constexpr,
    PF_STEP: tl.constexpr,
):
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    if USE_PDL:
        _prefetch_weights(w_ptr, pid_n, pid_k * k_per_split, (pid_k + 1) * k_per_split, N, K, stride_wn, INT4,
                          BLOCK_N, PF_ROWS, PF_LINES, PF_STEP)
    # The loop loads x (the previous kernel's output) with each weight tile, and the split-K counters may only be
    # touched once the previous GEMV has finished with them: wait here.
    wait_for_prior_grids(USE_PDL)
    rows = tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask, col_mask = rows < M, cols < N
    if USE_DOT:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_K // VEC, BLOCK_N), dtype=tl.float32)
    k_start = pid_k * k_per_split
    for k0 in range(k_start, tl.minimum(k_start + k_per_split, K), BLOCK_K):
        if USE_DOT:
            acc = _dot_step(acc, x_ptr, w_ptr, scale_ptr, zero_ptr, k0, rows, row_mask, cols, col_mask, N, K,
                            stride_xm, stride_wn, group_size, INT4, DOT_FP32, X_HALF, X_FP16, BLOCK_K, BLOCK_N)
        else:
            acc = _fma_step(acc, x_ptr, w_ptr, scale_ptr, zero_ptr, k0, cols, col_mask, N, K, stride_wn,
                            group_size, INT4, BLOCK_K, BLOCK_N, VEC)
    if not USE_DOT:
        acc = tl.sum(acc, axis=0)[None, :]  # [1, BN]
    scaled = HAS_SCALE and not INT4  # int4 applied its group scales per tile
    if PARTIAL:
        offsets = rows[:, None] * N + cols[None, :]
        mask = row_mask[:, None] & col_mask[None, :]
        tl.store(partial_ptr + pid_k * M * N + offsets, acc, mask=mask)
        tl.debug_barrier()  # every thread's partial sums stored before the (release) atomic below
        arrived = tl.atomic_add(counter_ptr + pid_n, 1, sem="acq_rel")
        if arrived == split_k - 1:  # the last slice of this N tile: reduce, finish, reset the counter
            total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for s in range(0, split_k):
                total += tl.load(partial_ptr + s * M * N + offsets, mask=mask, other=0.0, cache_modifier=".cg")
            _store_output(out_ptr, total, scale_ptr, stride_scale, bias_ptr, rows, cols, row_mask, col_mask, N,
                          scaled, HAS_BIAS)
            tl.atomic_xchg(counter_ptr + pid_n, 0)
    else:
        _store_output(out_ptr, acc, scale_ptr, stride_scale, bias_ptr, rows, cols, row_mask, col_mask, N, scaled,
                      HAS_BIAS)


# -- configuration ------------------------------------------------------------------------------------------

def weight_format(weight: torch.Tensor) -> str:
    """The config table's name for a dense weight's dtype: bf16, fp16, fp32 or fp8."""
    names = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.float8_e4m3fn: "fp8"}
    if weight.dtype not in names:
        raise ValueError(f"dense_gemv: weight dtype {weight.dtype} is not supported (supported: {list(names)})")
    return names[weight.dtype]


def m_bucket(m: int) -> int:
    """The config table's batch key and the tl.dot tile's rows: 1 (the FMA path), else 16 (M of 2..16), 32 or 64."""
    return 1 if m == 1 else max(16, triton.next_power_of_2(m))


def split_k_for(n: int, k: int, block_n: int, block_k: int, num_sms: int) -> int:
    """No split when the N tiles alone give every SM two programs; else enough K slices (of whole K tiles) for
    about two programs per SM."""
    tiles = triton.cdiv(n, block_n)
    if tiles >= 2 * num_sms:
        return 1
    return max(1, min(triton.cdiv(2 * num_sms, tiles), triton.cdiv(k, block_k)))


def default_config(fmt: str, m: int, n: int, k: int, num_sms: int) -> GemvConfig:
    """Untuned tiles: wide K strips for dense weights (contiguous along K), wide N rows for int4 (contiguous
    along N), and the split from `split_k_for`."""
    dot = m > 1
    if fmt == "int4":
        block_n, block_k = (64, 128) if not dot else (64, 64)
    else:
        block_n, block_k = (32, 512 if fmt == "fp8" else 256) if not dot else (32, 128)
    return GemvConfig(block_n, block_k, split_k_for(n, k, block_n, block_k, num_sms), num_warps=4, num_stages=3,
                      dot=dot)


def config_for(fmt: str, m: int, n: int, k: int, num_sms: int) -> GemvConfig:
    """The tuned config of this shape (quant_gemv_configs.TUNED) or the default one."""
    from .quant_gemv_configs import TUNED

    return TUNED.get((fmt, n, k, m_bucket(m))) or default_config(fmt, m, n, k, num_sms)


@dataclasses.dataclass(frozen=True)
class _Launch:
    """A config fitted to one call: the K slice length and the number of slices it really gives."""

    config: GemvConfig
    block_k: int
    k_per_split: int
    split_k: int


def _fit(config: GemvConfig, k: int, group_size: Optional[int]) -> _Launch:
    block_k = config.block_k
    if group_size is not None:  # an int4 tile stays in one group
        if group_size % 16:
            raise ValueError(f"int4 GEMV: group size {group_size} is not a multiple of 16")
        while group_size % block_k:
            block_k //= 2
    block_k = max(block_k, 16)
    k_per_split = triton.cdiv(triton.cdiv(k, config.split_k), block_k) * block_k
    return _Launch(config, block_k, k_per_split, triton.cdiv(k, k_per_split))


def _counter_buffer(device: torch.device) -> torch.Tensor:
    """The split-K arrival counters of a device: zeroed once, left zeroed by every call (kernel docstring); the
    first call must run eagerly (`kernels.arrival_counters`)."""
    return arrival_counters("the decode GEMV", device, _COUNTER_SLOTS)


def _launch(x2: torch.Tensor, weight: torch.Tensor, n: int, scale, zeros, bias, group_size: Optional[int],
            config: GemvConfig) -> torch.Tensor:
    m, k = x2.shape
    if m > MAX_M:
        raise ValueError(f"the decode GEMV takes at most {MAX_M} rows, got {m}")
    fit = _fit(config, k, group_size)
    use_dot = config.dot or m > 1
    tiles = triton.cdiv(n, config.block_n)
    if tiles > _COUNTER_SLOTS:
        raise ValueError(f"decode GEMV: {tiles} N tiles exceed {_COUNTER_SLOTS} (raise block_n)")
    partial = fit.split_k > 1
    out = torch.empty((m, n), device=x2.device, dtype=x2.dtype)
    workspace = torch.empty((fit.split_k, m, n), device=x2.device, dtype=torch.float32) if partial else out
    counters = _counter_buffer(x2.device)  # made on the first call, split or not (see _counter_buffer)
    int4 = group_size is not None
    stride_scale = 1 if int4 or scale is None else scale.stride(0)
    pdl = pdl_enabled(x2.device)
    prefetch = _prefetch_shape(weight, int4, config.block_n, fit.k_per_split)
    _gemv_kernel[(tiles, fit.split_k)](
        out, workspace, counters, x2, weight, scale if scale is not None else out,
        zeros if zeros is not None else out, bias if bias is not None else out, m, n, k, x2.stride(0),
        0 if int4 else weight.stride(0), stride_scale, group_size or 1,
        fit.k_per_split, fit.split_k,
        INT4=int4, HAS_SCALE=scale is not None, HAS_BIAS=bias is not None, PARTIAL=partial, USE_DOT=use_dot,
        DOT_FP32=x2.dtype == torch.float32 or interpreting(), X_HALF=x2.dtype in (torch.bfloat16, torch.float16),
        X_FP16=x2.dtype == torch.float16, BLOCK_M=max(16, m_bucket(m)) if use_dot else 1,
        BLOCK_N=config.block_n, BLOCK_K=fit.block_k, VEC=8 if int4 else min(16 // weight.element_size(), fit.block_k),
        USE_PDL=pdl, PF_ROWS=prefetch[0], PF_LINES=prefetch[1], PF_STEP=prefetch[2], num_warps=config.num_warps,
        num_stages=config.num_stages, launch_pdl=pdl)
    return out


def _prefetch_shape(weight: torch.Tensor, int4: bool, block_n: int, k_per_split: int) -> tuple[int, int, int]:
    """(rows, lines per row, elements per line) of the 128-byte lines that start a program's weight slice, about
    PREFETCH_BYTES of them (powers of two): int4 rows run along K (packed rows of block_n words), dense rows along
    N (block_n rows, lines along K)."""
    per_line = 128 // weight.element_size()
    if int4:
        rows = max(1, min(k_per_split // 8, PREFETCH_BYTES // (block_n * 4)))
        return _floor_pow2(rows), max(1, block_n // per_line), per_line
    lines = max(1, min(k_per_split // per_line, PREFETCH_BYTES // (block_n * 128)))
    return block_n, _floor_pow2(lines), per_line


def _floor_pow2(n: int) -> int:
    return 1 << (n.bit_length() - 1)


def _rows(x: torch.Tensor) -> torch.Tensor:
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def _num_sms(x: torch.Tensor, num_sms: Optional[int]) -> int:
    if num_sms is not None:
        return num_sms
    return sm_count(x.device.index) if x.is_cuda else 4


# -- entry points -------------------------------------------------------------------------------------------

def dense_gemv(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
               w_scale: Optional[torch.Tensor] = None, num_sms: Optional[int] = None,
               config: Optional[GemvConfig] = None) -> torch.Tensor:
    """x [M, K] (M <= 64) @ (weight [N, K] * w_scale [N, 1] or [])^T (+ bias) -> [M, N] in x's dtype.
    Same contract as quant_reference.dense_gemv. config: tiles for this call (default: `config_for`)."""
    x2 = _rows(x)
    n, k = weight.shape
    if weight.stride(1) != 1:
        raise ValueError("dense_gemv: the weight must have unit stride along K")
    if config is None:
        config = config_for(weight_format(weight), x2.shape[0], n, k, _num_sms(x, num_sms))
    scale = None
    if w_scale is not None:  # [N] float32, or one value read with stride 0 (no copy per call)
        scale = w_scale.float().reshape(-1) if w_scale.numel() == n else w_scale.float().reshape(1).expand(n)
    out = _launch(x2, weight, n, scale, None, bias, None, config)
    return out.reshape(*x.shape[:-1], n)


def int4_gemv(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
              bias: Optional[torch.Tensor] = None, num_sms: Optional[int] = None,
              config: Optional[GemvConfig] = None) -> torch.Tensor:
    """x [M, K] (M <= 64) @ W (+ bias) -> [M, N] in x's dtype, W in the engine's packed int4 layout (module
    docstring). Same contract as quant_reference.int_weight_matmul with bits=4."""
    x2 = _rows(x)
    k, n = x2.shape[1], qweight.shape[1]
    if qweight.shape[0] * 8 != k:
        raise ValueError(f"int4 GEMV: qweight has {qweight.shape[0]} rows of 8 inputs, x has {k} inputs")
    if config is None:
        config = config_for("int4", x2.shape[0], n, k, _num_sms(x, num_sms))
    out = _launch(x2, qweight, n, scales.contiguous(), zeros.contiguous(), bias, group_size, config)
    return out.reshape(*x.shape[:-1], n)

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
      reduced over K once after the loop. int4's word math is about three instructions per weight
      (`_int4_centered`: one LOP3 ORs the nibble under a float32 exponent, one subtraction leaves q - z exactly;
      one FMA), the scale once per word; config.half_fma sums each word's products in bf16x2 instead
      (`_int4_tile_math`, ~2.3). The whole K loop on sm_90, loads, x and addresses included, issues 4.2 and
      3.4 instructions per weight at the 8B shapes' tiles (`scripts/gemv_sass.py`, session 32).
      FP8 with config.fp8_words: W read as 32-bit words of 4 weights, converted in registers (`_e4m3_floats`).
      config.load_ahead: each step loads the next tile (int4: x's inputs too) before its own math
      (`_dense_load_ahead_step`, `_int4_ahead_step`).
  M > 1 (or config.dot): tl.dot on one tile of x of 16, 32 or 64 rows (the M bucket); int4 with config.slot_dot:
      one dot per nibble slot on exact q - z codes (`_int4_slot_dot_step`).
Under PDL (kernels/pdl.py) each program asks L2 for the start of its weight slice and, on the M == 1 FMA paths,
loads its first tile into registers before it waits for the previous kernel (FIRST_TILE_BEFORE_WAIT).
Split-K without an extra launch: each slice stores its float32 partial sums, then bumps a per-N-tile counter; the
slice that arrives last sums the partials, applies the scale and bias, writes y and resets the counter to zero
(so the next call, or a CUDA-graph replay, finds it zeroed). Calls must not overlap on two streams.

Tile sizes per shape come from quant_gemv_configs.TUNED (filled from `python -m loadtest.bench_kernels
--gemv-sweep` on the GPU): the row measured on this GPU model, else the row for any GPU, else `default_config`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import torch
import triton
import triton.language as tl

from . import arrival_counters, compute_capability, device_name, interpreting, sm_count
from .pdl import enabled as pdl_enabled, wait_for_prior_grids
from .quant_reference import check_fp8_group_scales

MAX_M = 64
MMA_MAX_M = 8  # GemvConfig.mma: B's eight columns are x's rows
# Weight bytes each program asks L2 for before its PDL wait: at two programs per SM (the split-K rule) about 8 MB
# on an H100, what its bandwidth moves in the few microseconds of a previous kernel's tail, well inside its L2.
PREFETCH_BYTES = 32 * 1024
_COUNTER_SLOTS = 1 << 16  # one int32 counter per N tile: N / BLOCK_N <= 65536
# The FMA paths (M == 1: int4, FP8 words, dense weights with load_ahead) load their first weight tile into
# registers before the PDL wait, not after it (bf16 W3 on an H100, 8B shape: 4.5 us a layer faster, session 28).
# A switch so that scripts/decode_ablation.py can measure both in one tree (variant first_tile_after_wait); read
# at each launch (a CUDA graph keeps the value it was captured with).
FIRST_TILE_BEFORE_WAIT = True


@dataclasses.dataclass(frozen=True)
class GemvConfig:
    """One launch configuration. split_k: K slices (1: y written directly). dot: at M == 1, multiply through a
    16-row tl.dot anyway (M > 1 always does). slot_dot: int4 with half-precision x on the tl.dot path, block_k
    >= 128 after `_fit`: one dot per nibble slot on exact q - z codes (`_int4_slot_dot_step`). half_fma: int4 at
    M == 1 on the FMA path, where `half_fma_ok(x)`: each word's 8 products summed in bf16x2 (`_int4_tile_math`);
    elsewhere the float32 FMA path. Its cost in accuracy: a relative error (norm of y) of ~3e-3 against the float32
    reference at the Llama-3-8B shapes (run 48; the float32 FMA path ~3e-9, the M > 1 tl.dot path in bf16 ~4e-3);
    the tests hold every bf16 path to 1e-2.
    fp8_words: FP8 weights at M == 1 on the FMA path, read as 32-bit words of 4 weights and converted in registers
    (`_fp8_words_step`); exact like the default path. Needs K % 4 == 0 and a weight row stride and base address
    that are multiples of 4 bytes (checked per call: a ValueError). load_ahead: at M == 1 on the FMA path (dense,
    fp8_words or not, and int4, where x's inputs are loaded ahead too: `_int4_ahead_step`): each step issues the
    next tile's loads before its own math (two tiles in flight per thread).
    mma: int4 at M <= 8 with bf16 x (`mma_ok`): the tensor-core path (`_int4_mma_kernel`): block_n must be 32 or
    64 * num_warps (a warp owns 32 or 64 columns, a thread 4 or 8), block_k a multiple of 32 (chunks of 32
    inputs a step), and each step loads the next tile ahead; dot, slot_dot, half_fma, fp8_words and load_ahead do
    not apply. Its sums are float32 products of exact bf16 operands (~1e-6 relative to the float32 reference).
    With other x, or a group size below 32, it is the float32 FMA path (M == 1) or tl.dot (M > 1) with the same
    tiles."""

    block_n: int
    block_k: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3
    dot: bool = False
    slot_dot: bool = False
    half_fma: bool = False
    fp8_words: bool = False
    load_ahead: bool = False
    mma: bool = False

    def __post_init__(self):
        for name in ("block_n", "block_k"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise ValueError(f"GemvConfig.{name} must be a power of two, got {value}")
        if self.split_k < 1:
            raise ValueError(f"GemvConfig.split_k must be >= 1, got {self.split_k}")
        if self.mma:
            if self.block_n not in (32 * self.num_warps, 64 * self.num_warps):
                raise ValueError(f"GemvConfig.mma needs block_n = 32 or 64 * num_warps (a warp owns 32 or 64 "
                                 f"columns), got block_n={self.block_n}, num_warps={self.num_warps}")
            if self.block_k < 32:
                raise ValueError(f"GemvConfig.mma needs block_k >= 32 (32-input chunks), got {self.block_k}")
            others = [name for name in ("dot", "slot_dot", "half_fma", "fp8_words", "load_ahead")
                      if getattr(self, name)]
            if others:
                raise ValueError(f"GemvConfig.mma is a path of its own: {', '.join(others)} cannot be set with it")


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
def group_scale(scale_ptr, k0, cols, col_mask, N, group_size):
    """The float32 scales [BLOCK_N] of columns `cols` in the group holding inputs k0 ... of a dense W with group
    scales [G, N] at scale_ptr (the MoE kernels read each expert's the same way)."""
    return tl.load(scale_ptr + (k0 // group_size) * N + cols, mask=col_mask, other=0.0)


@triton.jit
def _group_params(scale_ptr, zero_ptr, k0, cols, col_mask, N, group_size):
    """The scales and zero points [BLOCK_N] (float32) of the group holding inputs k0 ... (a tile never crosses a
    group)."""
    group = k0 // group_size
    scale = tl.load(scale_ptr + group * N + cols, mask=col_mask, other=0.0).to(tl.float32)
    zero = tl.load(zero_ptr + group * N + cols, mask=col_mask, other=0.0).to(tl.float32)
    return scale, zero


@triton.jit
def codes_minus_zero(nibbles, zero):
    """int32 codes q in 0 ... 15 (any shape) -> q - z in float32, exactly, with no int-to-float conversion (a
    quarter of the FMA rate on sm_90): 2**23 + q is q's bits under float32's exponent of 2**23 (one OR), and
    2**23 + z is exact too (z an integer below 2**23). zero: float32, broadcastable to nibbles."""
    q_plus = (nibbles | 0x4B000000).to(tl.float32, bitcast=True)  # 8388608 + q
    return q_plus - (zero + 8388608.0)


@triton.jit
def _int4_tile_f32(w_ptr, scale_ptr, zero_ptr, k0, cols, col_mask, N, K, group_size,
                   BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """The dequantized [BLOCK_K // 8, 8, BLOCK_N] float32 tile of W: (q - z) * s, exact like the reference."""
    nibbles = _int4_words(w_ptr, k0, cols, col_mask, N, K, BLOCK_K)
    scale, zero = _group_params(scale_ptr, zero_ptr, k0, cols, col_mask, N, group_size)
    return codes_minus_zero(nibbles, zero[None, None, :]) * scale[None, None, :]


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
              X_FP16: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_SCALE: tl.constexpr):
    """acc [BM, BN] plus x's rows times W's tile at input k0, through tl.dot. GROUP_SCALE: a dense (FP8) W with
    group scales [G, N]: the tile's product (one group: a tile never crosses one) times its group's scales."""
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
        part = tl.dot(x.to(tl.float32), w.to(tl.float32), input_precision="ieee", out_dtype=tl.float32)
    else:
        part = tl.dot(x, w.to(x_ptr.dtype.element_ty), out_dtype=tl.float32)  # e4m3 -> bf16 / fp16: exact
    if GROUP_SCALE:
        part = part * group_scale(scale_ptr, k0, cols, col_mask, N, group_size)[None, :]
    return acc + part


# The float32 exponent fields that make a nibble at bit offset p (0, 4, ..., 16) an integer: ORed under the exponent
# of 2**(23 - p), whose unit in the last place is 2**-p, the nibble's bits read 2**(23 - p) + q exactly.
_NIBBLE_FLOAT_ASM = tl.constexpr("""{
    .reg .b32 high;
    shr.u32 high, $8, 20;
    lop3.b32 $0, $8, 0x0000000f, 0x4b000000, 0xea;
    lop3.b32 $1, $8, 0x000000f0, 0x49000000, 0xea;
    lop3.b32 $2, $8, 0x00000f00, 0x47000000, 0xea;
    lop3.b32 $3, $8, 0x0000f000, 0x45000000, 0xea;
    lop3.b32 $4, $8, 0x000f0000, 0x43000000, 0xea;
    lop3.b32 $5, high, 0x0000000f, 0x4b000000, 0xea;
    lop3.b32 $6, high, 0x000000f0, 0x49000000, 0xea;
    lop3.b32 $7, high, 0x00000f00, 0x47000000, 0xea;
}""")  # lop3 0xea: (a & b) | c, one instruction per nibble (Triton's own & and | give two)


@triton.jit
def _nibble_floats(words, ASM: tl.constexpr):
    """The 8 nibbles of each packed word [R, C] as float32 tensors 2**(23 - p_j) + q_j (p_j = 4 * (j % 5): nibbles
    5..7 are read from the word shifted right by 20, since a mantissa has 23 bits), j = 0 ... 7 in input order."""
    if ASM:
        parts = tl.inline_asm_elementwise(_NIBBLE_FLOAT_ASM, "=r,=r,=r,=r,=r,=r,=r,=r,r", [words],
                                          dtype=(tl.int32,) * 8, is_pure=True, pack=1)
    else:
        high = words >> 20  # the sign-extended bits above bit 11 are masked off below
        parts = ()
        for j in tl.static_range(8):
            offset = 4 * (j % 5)
            parts = parts + (((words if j < 5 else high) & (0xF << offset)) | ((150 - offset) << 23),)
    floats = ()
    for j in tl.static_range(8):
        floats = floats + (parts[j].to(tl.float32, bitcast=True),)
    return floats


# One packed word's 8 products summed in bf16x2 arithmetic (sm_80+): the word's nibbles taken two at a time,
# (j, j + 4) from the two 16-bit halves (one shift and one LOP3: q ORed under the bf16 exponent of 128, whose unit in
# the last place is 1), an FMA by one minus (128 + z) leaving q - z exactly, an FMA into the two lanes' sums with the
# inputs (x_j, x_j+4); the lanes added in float32 at the end. $1: the word; $2: -(128 + z) in both halves; $3 ... $6:
# (x_j, x_j+4) for j = 0 ... 3, bf16x2. About 2.3 instructions per weight; each product and lane sum rounded to bf16.
_HALF_FMA_WORD_ASM = tl.constexpr("""{
    .reg .b32 one, minus_zero, nib, d, acc, shifted;
    .reg .b16 lo, hi;
    .reg .f32 flo, fhi, total;
    mov.b32 one, 0x3f803f80;
    mov.b32 minus_zero, 0x80008000;
    lop3.b32 nib, $1, 0x000f000f, 0x43004300, 0xea;
    fma.rn.bf16x2 d, nib, one, $2;
    fma.rn.bf16x2 acc, d, $3, minus_zero;
    shr.u32 shifted, $1, 4;
    lop3.b32 nib, shifted, 0x000f000f, 0x43004300, 0xea;
    fma.rn.bf16x2 d, nib, one, $2;
    fma.rn.bf16x2 acc, d, $4, acc;
    shr.u32 shifted, $1, 8;
    lop3.b32 nib, shifted, 0x000f000f, 0x43004300, 0xea;
    fma.rn.bf16x2 d, nib, one, $2;
    fma.rn.bf16x2 acc, d, $5, acc;
    shr.u32 shifted, $1, 12;
    lop3.b32 nib, shifted, 0x000f000f, 0x43004300, 0xea;
    fma.rn.bf16x2 d, nib, one, $2;
    fma.rn.bf16x2 acc, d, $6, acc;
    mov.b32 {lo, hi}, acc;
    cvt.f32.bf16 flo, lo;
    cvt.f32.bf16 fhi, hi;
    add.f32 total, flo, fhi;
    mov.b32 $0, total;
}""")


@triton.jit
def _x_pair_vectors(x_ptr, words_k, row_mask):
    """bf16 x's inputs 8 w ... 8 w + 7 of the words w in words_k [R] (x at a 4-byte aligned address) as their four
    int32 pairs (x01, x23, x45, x67), [R] each: each word's 16 bytes one vector load, split in registers (a load
    per pair issued four loads a word, most of a step's loads: 909 -> 866 SASS instructions a step at the 8B
    gate_up tile, and the MoE's decode kernels alike)."""
    pair_ptr = x_ptr.to(tl.pointer_type(tl.int32), bitcast=True)
    if len(pair_ptr.shape) == 1:  # one pointer a row (the MMA path's lanes each read their own row of x)
        pair_ptr = pair_ptr[:, None]
    return _split_four(tl.load(pair_ptr + 4 * words_k[:, None] + tl.arange(0, 4)[None, :], mask=row_mask[:, None],
                               other=0))


@triton.jit
def _split_four(values):
    """[R, 4] (one thread's vector per row) -> its 4 columns as tensors [R]."""
    first_two, last_two = tl.split(tl.reshape(values, (values.shape[0], 2, 2)))  # columns (0, 2), (1, 3)
    v0, v2 = tl.split(first_two)
    v1, v3 = tl.split(last_two)
    return v0, v1, v2, v3


@triton.jit
def _x_half_pairs(x_ptr, words_k, row_mask):
    """bf16 x's inputs of the words words_k [R] (x at a 4-byte aligned address) as the bf16x2 pairs (x_j, x_j+4),
    j = 0 ... 3, that `_HALF_FMA_WORD_ASM` takes: 4 int32 tensors [R]."""
    return _nibble_pairs(*_x_pair_vectors(x_ptr, words_k, row_mask))


@triton.jit
def _nibble_pairs(x01, x23, x45, x67):
    """x's bf16 pairs (x_2i, x_2i+1) as int32 -> the pairs (x_j, x_j+4), j = 0 ... 3: a word's nibbles j and j + 4
    sit in its two 16-bit halves, which `_HALF_FMA_WORD_ASM` multiplies together."""
    x04 = (x01 & 0xFFFF) | (x45 << 16)
    x15 = ((x01 >> 16) & 0xFFFF) | (x45 & -65536)
    x26 = (x23 & 0xFFFF) | (x67 << 16)
    x37 = ((x23 >> 16) & 0xFFFF) | (x67 & -65536)
    return x04, x15, x26, x37


@triton.jit
def _half_fma_word_sums(words, zero, x04, x15, x26, x37):
    """Each packed word's 8 products with x summed in bf16x2 (`_HALF_FMA_WORD_ASM`), as float32 [R, C]. words: int32
    [R, C]; zero: their zero points (float32), and x04 ... x37 (`_x_half_pairs`), each broadcastable to words."""
    bits = (-128.0 - zero).to(tl.bfloat16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF  # -(128 + z), exact
    return tl.inline_asm_elementwise(
        _HALF_FMA_WORD_ASM, "=r,r,r,r,r,r,r", [words, bits | (bits << 16), x04, x15, x26, x37], dtype=tl.int32,
        is_pure=True, pack=1).to(tl.float32, bitcast=True)


@triton.jit
def _int4_tile_words(w_ptr, k0, cols, col_mask, N, K, BLOCK_K: tl.constexpr):
    """(words_k [BK / 8]: qweight's rows at input k0, their mask, W's packed words [BK / 8, BN] int32)."""
    words_k = k0 // 8 + tl.arange(0, BLOCK_K // 8)
    row_mask = words_k < K // 8
    words = tl.load(w_ptr + words_k[:, None].to(tl.int64) * N + cols[None, :],
                    mask=row_mask[:, None] & col_mask[None, :], other=0)
    return words_k, row_mask, words


@triton.jit
def _int4_tile(w_ptr, scale_ptr, zero_ptr, k0, cols, col_mask, N, K, group_size, BLOCK_K: tl.constexpr):
    """W's int4 tile at input k0 as loaded: (words_k [BK / 8], their row mask, the packed words [BK / 8, BN] int32,
    the group's scales and zero points [BN] float32). Weights only: a program may load it before its PDL wait."""
    words_k, row_mask, words = _int4_tile_words(w_ptr, k0, cols, col_mask, N, K, BLOCK_K)
    scale, zero = _group_params(scale_ptr, zero_ptr, k0, cols, col_mask, N, group_size)
    return words_k, row_mask, words, scale, zero


@triton.jit
def _int4_centered(words, zero, ASM: tl.constexpr):
    """Packed int4 words [R, C] as q - z, exactly, in float32: a tuple of 8 tensors [R, C], element j for the word's
    input j. zero: the words' zero points, float32, broadcastable to words ([1, BN] for the GEMV's [BK / 8, BN]
    tiles, [BN, 1] for the MoE decode kernels' [BN, BK / 8]).

    Two instructions per weight: one LOP3 makes the float 2**(23 - p) + q of a nibble (`_nibble_floats`), one
    subtraction of 2**(23 - p) + z (per column and tile; exact, z being an integer below 16) leaves q - z."""
    zeros = (zero + 8388608.0, zero + 524288.0, zero + 32768.0, zero + 2048.0,
             zero + 128.0)  # z + 2**(23 - p) per bit offset p = 0, 4, 8, 12, 16
    nibbles = _nibble_floats(words, ASM)
    centered = ()
    for j in tl.static_range(8):
        centered = centered + (nibbles[j] - zeros[j % 5],)
    return centered


@triton.jit
def _int4_x(x_ptr, words_k, row_mask, HALF_FMA: tl.constexpr, X_BF16_PAIRS: tl.constexpr):
    """x's inputs of the words words_k [R] (masked where not row_mask) as the int4 FMA math takes them: the bf16x2
    pairs (x_j, x_j+4), j = 0 ... 3 (HALF_FMA, `_x_half_pairs`), else the 8 float32 inputs 8 w + j (`_x_words`)."""
    if HALF_FMA:  # a constexpr: one branch is compiled, so xs has one type (a return in each would not compile)
        xs = _x_half_pairs(x_ptr, words_k, row_mask)
    else:
        xs = _x_words(x_ptr, words_k, row_mask, X_BF16_PAIRS)
    return xs


@triton.jit
def _int4_tile_math(acc, int4_tile, xs, HALF_FMA: tl.constexpr, ASM: tl.constexpr):
    """acc [BK / 8, BN] plus x's row 0 times a loaded int4 tile (`_int4_tile`: words [BK / 8, BN], scale and zero
    [BN] float32), x's inputs loaded by `_int4_x`; the group's scale multiplies each word's sum once (a tile never
    crosses a group).
    Float32 (HALF_FMA off): about three instructions per weight, two in `_int4_centered` and one FMA into the word's
    8-input sum; exact products. HALF_FMA (bf16 x at a 4-byte aligned address on CUDA): each word's 8 products
    summed in bf16x2 (`_HALF_FMA_WORD_ASM`); each product and each lane's 4-term sum rounds to bf16 (8 significant
    bits): ~3e-3 relative error in y (GemvConfig)."""
    words_k, row_mask, words, scale, zero = int4_tile
    if HALF_FMA:
        word_sums = _half_fma_word_sums(words, zero[None, :], xs[0][:, None], xs[1][:, None], xs[2][:, None],
                                        xs[3][:, None])
    else:
        word_sums = _f32_word_sums(_int4_centered(words, zero[None, :], ASM), xs)
    return acc + word_sums * scale[None, :]


@triton.jit
def _f32_word_sums(centered, xs):
    """Each word's 8 products summed in float32 [BK / 8, BN]: centered, the words' q - z (`_int4_centered`),
    xs, x's 8 inputs of each word row [BK / 8] (`_x_words`)."""
    word_sums = xs[0][:, None] * centered[0]
    for j in tl.static_range(1, 8):
        word_sums += xs[j][:, None] * centered[j]
    return word_sums


@triton.jit
def _int4_slot_dot_step(acc, x_ptr, w_ptr, scale_ptr, zero_ptr, k0, rows, row_mask, cols, col_mask, N, K,
                        stride_xm, group_size, DOT_FP32: tl.constexpr, BLOCK_K: tl.constexpr, ASM: tl.constexpr):
    """acc [BM, BN] plus x's rows times W's int4 tile at input k0 (BLOCK_K >= 128), as 8 tl.dot of K = BLOCK_K / 8:
    slot j multiplies x's inputs 8 w + j by the words' nibble j, made q - z exactly (`_int4_centered`) and rounded
    to x's half type (exact: |q - z| < 16). No 3D reshuffle of the nibbles, no x-sum correction; the group's scale
    multiplies the tile's sum once. (Making the codes in bf16 by PTX instead cut instructions but measured slower
    at M = 16 in run 51, together with 2-slice reduction rounds; both reverted.)"""
    words_k, word_mask, words, scale, zero = _int4_tile(w_ptr, scale_ptr, zero_ptr, k0, cols, col_mask, N, K,
                                                        group_size, BLOCK_K)
    codes = _int4_centered(words, zero[None, :], ASM)
    part = tl.zeros(acc.shape, dtype=tl.float32)
    for j in tl.static_range(8):
        x_j = tl.load(x_ptr + rows[:, None] * stride_xm + (8 * words_k + j)[None, :],
                      mask=row_mask[:, None] & word_mask[None, :], other=0.0)  # [BM, BK / 8]
        if DOT_FP32:  # Triton's interpreter
            part = tl.dot(x_j.to(tl.float32), codes[j], part, input_precision="ieee", out_dtype=tl.float32)
        else:
            part = tl.dot(x_j, codes[j].to(x_ptr.dtype.element_ty), part, out_dtype=tl.float32)
    return acc + part * scale[None, :]


@triton.jit
def _x_words(x_ptr, words_k, row_mask, BF16_PAIRS: tl.constexpr):
    """x's inputs 8 w + j (w in words_k [R], j = 0 ... 7) as 8 float32 tensors [R]. BF16_PAIRS: x is bf16 at a
    4-byte aligned address, read as one 16-byte vector a word (`_x_pair_vectors`), each input widened by one shift
    or AND (a bf16 is the top half of its float32)."""
    xs = ()
    if BF16_PAIRS:
        pairs = _x_pair_vectors(x_ptr, words_k, row_mask)
        for i in tl.static_range(4):
            pair = pairs[i]  # [R] inputs 8 w + 2 i, 8 w + 2 i + 1
            xs = xs + ((pair << 16).to(tl.float32, bitcast=True), (pair & -65536).to(tl.float32, bitcast=True))
    else:
        for j in tl.static_range(8):
            xs = xs + (tl.load(x_ptr + 8 * words_k + j, mask=row_mask, other=0.0).to(tl.float32),)
    return xs


@triton.jit
def _fma_step(acc, x_ptr, w_ptr, k0, cols, col_mask, K, stride_wn, BLOCK_K: tl.constexpr, VEC: tl.constexpr):
    """acc [BK / VEC, BN] plus x's row 0 times a dense W's tile at input k0 as [BK / VEC, VEC, BN]: the products of
    each 16 bytes of a W row (VEC inputs) summed in-thread, the rest left for after the loop."""
    kv = k0 + tl.arange(0, BLOCK_K // VEC)[:, None] * VEC + tl.arange(0, VEC)[None, :]  # [BK / VEC, VEC]
    x = tl.load(x_ptr + kv, mask=kv < K, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols[None, None, :].to(tl.int64) * stride_wn + kv[:, :, None],
                mask=(kv < K)[:, :, None] & col_mask[None, None, :], other=0.0).to(tl.float32)
    return acc + tl.sum(w * x[:, :, None], axis=1)


# e4m3 has no infinities; its NaNs (0x7f, 0xff) never occur in quantized weights (quantize_fp8 clamps to +-448),
# so the conversions below need not preserve them. Its bits s eeee mmm are those of a float32 under the exponent
# bias 127 instead of 7 once moved to sign | (eeee mmm) << 20: that float32 is the weight times 2**-120, exactly,
# subnormals included (float32's exponent 1 ... 15 and its subnormals cover e4m3's 0 ... 15 times 2**-120).
_E4M3_UNBIAS = tl.constexpr(2.0 ** 120)

# On sm_89+: a 32-bit word's 4 e4m3 codes (byte j = input 4 w + j) to 4 float32, exactly: two hardware conversions
# of a byte pair to f16x2 (one instruction each) and four f16 -> f32 (1.5 instructions per weight, no bias left).
_E4M3_WORD_ASM = tl.constexpr("""{
    .reg .b16 lo, hi, a, b, c, d;
    .reg .b32 h01, h23;
    .reg .f32 f0, f1, f2, f3;
    mov.b32 {lo, hi}, $4;
    cvt.rn.f16x2.e4m3x2 h01, lo;
    cvt.rn.f16x2.e4m3x2 h23, hi;
    mov.b32 {a, b}, h01;
    mov.b32 {c, d}, h23;
    cvt.f32.f16 f0, a;
    cvt.f32.f16 f1, b;
    cvt.f32.f16 f2, c;
    cvt.f32.f16 f3, d;
    mov.b32 $0, f0;
    mov.b32 $1, f1;
    mov.b32 $2, f2;
    mov.b32 $3, f3;
}""")  # the float32 bits as int32 outputs ("=r"), bitcast by the caller


@triton.jit
def _e4m3_floats(words, PTX: tl.constexpr):
    """The 4 e4m3 codes of each 32-bit word [R, C] (byte j at bits 8 j ... 8 j + 7) as 4 float32 tensors [R, C],
    exactly (NaN codes excepted, see above). PTX: `_E4M3_WORD_ASM` (sm_89+); else shifts and masks
    (sign | (eeee mmm) << 20, then the 2**120 put back: Triton's interpreter and older GPUs)."""
    if PTX:
        bits = tl.inline_asm_elementwise(_E4M3_WORD_ASM, "=r,=r,=r,=r,r", [words], dtype=(tl.int32,) * 4,
                                         is_pure=True, pack=1)
        return (bits[0].to(tl.float32, bitcast=True), bits[1].to(tl.float32, bitcast=True),
                bits[2].to(tl.float32, bitcast=True), bits[3].to(tl.float32, bitcast=True))
    floats = ()
    for j in tl.static_range(4):
        byte = (words >> (8 * j)) & 0xFF
        bits = ((byte & 0x80) << 24) | ((byte & 0x7F) << 20)
        floats = floats + (bits.to(tl.float32, bitcast=True) * _E4M3_UNBIAS,)
    return floats


@triton.jit
def _fp8_tile_words(w_ptr, k0, k_end, cols, col_mask, stride_wn, BLOCK_K: tl.constexpr):
    """An FP8 W's tile at input k0 as int32 words [BK / 4, BN] of 4 inputs each (K % 4 == 0, stride_wn and the base
    4-byte aligned: `_check_fp8_words`); inputs from k_end on read as 0 (their loads not issued)."""
    words_k = k0 // 4 + tl.arange(0, BLOCK_K // 4)  # [BK / 4] words along K
    word_ptr = w_ptr.to(tl.pointer_type(tl.int32), bitcast=True)
    return tl.load(word_ptr + cols[None, :].to(tl.int64) * (stride_wn // 4) + words_k[:, None],
                   mask=(words_k < k_end // 4)[:, None] & col_mask[None, :], other=0)


@triton.jit
def _fp8_words_step(acc, words, x_ptr, w_ptr, scale_ptr, k0, k_end, cols, col_mask, N, K, stride_wn, group_size,
                    BLOCK_K: tl.constexpr, PTX: tl.constexpr, LOAD_AHEAD: tl.constexpr, GROUP_SCALE: tl.constexpr):
    """(acc [BK / 4, BN] plus x's row 0 times an FP8 W's tile at input k0, the next words). The tile's words
    (`_fp8_tile_words`) converted by `_e4m3_floats`, each word's 4 products summed in float32 in-thread. LOAD_AHEAD:
    `words` holds this tile already (loaded one step ahead, so two tiles' loads are in flight per thread: the FMA
    path's loads are not software-pipelined by Triton) and the next tile's are issued before this one's math."""
    if LOAD_AHEAD:
        next_words = _fp8_tile_words(w_ptr, k0 + BLOCK_K, k_end, cols, col_mask, stride_wn, BLOCK_K)
    else:
        words = _fp8_tile_words(w_ptr, k0, k_end, cols, col_mask, stride_wn, BLOCK_K)
        next_words = words
    return (_fp8_words_math(acc, words, x_ptr, scale_ptr, k0, cols, col_mask, N, K, group_size, BLOCK_K, PTX,
                            GROUP_SCALE), next_words)


@triton.jit
def _fp8_words_math(acc, words, x_ptr, scale_ptr, k0, cols, col_mask, N, K, group_size, BLOCK_K: tl.constexpr,
                    PTX: tl.constexpr, GROUP_SCALE: tl.constexpr):
    """acc [BK / 4, BN] plus x's row 0 times an FP8 W's loaded tile of words (`_fp8_tile_words`) at input k0.
    GROUP_SCALE: W has group scales [G, N] (the tile lies in one group): each word's 4 products are summed first,
    then added times the group's scale (one more instruction per word)."""
    weights = _e4m3_floats(words, PTX)
    kv = k0 + tl.arange(0, BLOCK_K // 4)[:, None] * 4 + tl.arange(0, 4)[None, :]  # [BK / 4, 4]: a word's inputs
    x = tl.load(x_ptr + kv, mask=kv < K, other=0.0).to(tl.float32)  # one 4-input vector per word
    x_even, x_odd = tl.split(tl.reshape(x, (BLOCK_K // 4, 2, 2)))  # inputs 4 w + {0, 2}, 4 w + {1, 3}
    x0, x2 = tl.split(x_even)
    x1, x3 = tl.split(x_odd)
    if GROUP_SCALE:
        words_sum = x0[:, None] * weights[0] + x1[:, None] * weights[1] + x2[:, None] * weights[2] \
            + x3[:, None] * weights[3]
        return acc + words_sum * group_scale(scale_ptr, k0, cols, col_mask, N, group_size)[None, :]
    acc += x0[:, None] * weights[0]
    acc += x1[:, None] * weights[1]
    acc += x2[:, None] * weights[2]
    acc += x3[:, None] * weights[3]
    return acc


@triton.jit
def _dense_tile(w_ptr, k0, k_end, cols, col_mask, stride_wn, BLOCK_K: tl.constexpr, VEC: tl.constexpr):
    """A dense W's tile at input k0 as stored, [BK / VEC, VEC, BN] (input k0 + VEC r + j at [r, j, :]); inputs from
    k_end on read as 0 (their loads not issued)."""
    kv = k0 + tl.arange(0, BLOCK_K // VEC)[:, None] * VEC + tl.arange(0, VEC)[None, :]  # [BK / VEC, VEC]
    return tl.load(w_ptr + cols[None, None, :].to(tl.int64) * stride_wn + kv[:, :, None],
                   mask=(kv < k_end)[:, :, None] & col_mask[None, None, :], other=0.0)


@triton.jit
def _dense_load_ahead_step(acc, w, x_ptr, w_ptr, k0, k_end, cols, col_mask, K, stride_wn, BLOCK_K: tl.constexpr,
                         VEC: tl.constexpr):
    """`_fma_step` on a tile `w` loaded one step ahead (`_dense_tile`): returns (acc plus x's row 0 times w, the
    next tile), the next tile's loads issued before this one's math, so two tiles are in flight per thread (the FMA
    path's loads are not software-pipelined by Triton)."""
    next_w = _dense_tile(w_ptr, k0 + BLOCK_K, k_end, cols, col_mask, stride_wn, BLOCK_K, VEC)
    kv = k0 + tl.arange(0, BLOCK_K // VEC)[:, None] * VEC + tl.arange(0, VEC)[None, :]
    x = tl.load(x_ptr + kv, mask=kv < K, other=0.0).to(tl.float32)
    return acc + tl.sum(w.to(tl.float32) * x[:, :, None], axis=1), next_w


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
def _sum_partials(partial_ptr, offsets, mask, M, N, split_k, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  CHUNK: tl.constexpr):
    """The [BM, BN] sum over the split_k slices of the partial sums at `offsets` ([BM, BN] into one slice's
    [M, N]), CHUNK slices loaded at once: independent loads in flight instead of one round trip to L2 per slice
    (the last program of an N tile waits on these alone). Slices summed in a fixed order for a given split_k."""
    total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if CHUNK == 1:
        for s in range(0, split_k):
            total += tl.load(partial_ptr + s * M * N + offsets, mask=mask, other=0.0, cache_modifier=".cg")
    else:
        chunk = tl.arange(0, CHUNK)
        for s0 in range(0, split_k, CHUNK):
            slices = s0 + chunk  # [CHUNK]
            tile = tl.load(partial_ptr + (slices * M * N)[:, None, None] + offsets[None, :, :],
                           mask=(slices < split_k)[:, None, None] & mask[None, :, :], other=0.0,
                           cache_modifier=".cg")  # [CHUNK, BM, BN]
            total += tl.sum(tile, axis=0)
    return total


@triton.jit
def _int4_fma_math(acc, x_ptr, int4_tile, HALF_FMA: tl.constexpr, ASM: tl.constexpr, X_BF16_PAIRS: tl.constexpr):
    """acc plus x's row 0 times a loaded int4 tile (`_int4_tile`), x loaded here: on the bf16x2 or the float32 FMA
    path (`_int4_tile_math`)."""
    words_k, row_mask, words, scale, zero = int4_tile
    if HALF_FMA:
        return _int4_tile_math(acc, int4_tile, _x_half_pairs(x_ptr, words_k, row_mask), HALF_FMA, ASM)
    # The float32 path makes q - z before x's loads: in this order its loop compiles to 1,072 SASS instructions a
    # step at the 8B qkv tile, 1,113 with x's loads first (scripts/gemv_sass.py).
    centered = _int4_centered(words, zero[None, :], ASM)
    word_sums = _f32_word_sums(centered, _x_words(x_ptr, words_k, row_mask, X_BF16_PAIRS))
    return acc + word_sums * scale[None, :]


@triton.jit
def _int4_ahead_step(acc, int4_tile, xs, x_ptr, w_ptr, scale_ptr, zero_ptr, k0, k_end, cols, col_mask, N,
                     group_size, BLOCK_K: tl.constexpr, HALF_FMA: tl.constexpr, ASM: tl.constexpr,
                     X_BF16_PAIRS: tl.constexpr):
    """One step of the int4 load-ahead loop (GemvConfig.load_ahead): the next tile's words, scales, zero points and
    x (inputs k0 + BLOCK_K ...) are loaded before this tile's math, so that they are in flight during it. Returns
    (acc, the next tile, its x). Past the slice (from k_end on) the words and x are masked, so the last step reads
    nothing new (its scales come from the slice's last group, already cached; that tile is never used)."""
    k_next = k0 + BLOCK_K
    words_k, row_mask, words = _int4_tile_words(w_ptr, k_next, cols, col_mask, N, k_end, BLOCK_K)
    scale, zero = _group_params(scale_ptr, zero_ptr, tl.minimum(k_next, k_end - 1), cols, col_mask, N, group_size)
    next_xs = _int4_x(x_ptr, words_k, row_mask, HALF_FMA, X_BF16_PAIRS)
    acc = _int4_tile_math(acc, int4_tile, xs, HALF_FMA, ASM)
    return acc, (words_k, row_mask, words, scale, zero), next_xs


@triton.jit
def _first_tile(w_ptr, scale_ptr, zero_ptr, k_start, k_end, cols, col_mask, N, K, stride_wn, group_size,
                INT4_FMA: tl.constexpr, FP8_WORDS: tl.constexpr, LOAD_AHEAD: tl.constexpr, BLOCK_K: tl.constexpr,
                BLOCK_N: tl.constexpr, VEC: tl.constexpr):
    """(the dense load-ahead and FP8 word paths' first tile, the int4 FMA path's first tile): the paths that do not
    take one get a placeholder of the same kind that loads nothing. Weights only (no kernel writes them)."""
    if FP8_WORDS:  # loaded ahead, or the peeled first step's
        tile = _fp8_tile_words(w_ptr, k_start, k_end, cols, col_mask, stride_wn, BLOCK_K)
    elif LOAD_AHEAD:
        tile = _dense_tile(w_ptr, k_start, k_end, cols, col_mask, stride_wn, BLOCK_K, VEC)
    else:  # unread
        tile = tl.zeros((BLOCK_K // VEC, VEC, BLOCK_N), dtype=tl.float32)
    if INT4_FMA:
        int4_tile = _int4_tile(w_ptr, scale_ptr, zero_ptr, k_start, cols, col_mask, N, K, group_size, BLOCK_K)
    else:  # unread
        words_k = tl.arange(0, BLOCK_K // 8)
        int4_tile = (words_k, words_k < 0, tl.zeros((BLOCK_K // 8, BLOCK_N), dtype=tl.int32),
                     tl.zeros((BLOCK_N,), dtype=tl.float32), tl.zeros((BLOCK_N,), dtype=tl.float32))
    return tile, int4_tile


@triton.jit
def _gemv_kernel(
    out_ptr,  # [M, N] in x's dtype
    partial_ptr,  # [SPLIT_K, M, N] float32 (PARTIAL)
    counter_ptr,  # [>= cdiv(N, BLOCK_N)] int32, zero between calls (PARTIAL)
    x_ptr,  # [M, K], unit stride along K
    w_ptr,  # dense: [N, K] (row stride stride_wn); INT4: [K // 8, N] int32
    scale_ptr,  # dense: [N] float32 (HAS_SCALE), or [G, N] (GROUP_SCALE); INT4: [G, N]
    zero_ptr,  # INT4: [G, N]
    bias_ptr,  # [N] (HAS_BIAS)
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_scale,  # dense: 1 (per-channel scales) or 0 (one scale for the tensor)
    group_size: tl.constexpr,  # INT4 / GROUP_SCALE (else 1): a constant, so a tile's group is a shift, not a division
    k_per_split,  # a multiple of BLOCK_K
    split_k,
    INT4: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    PARTIAL: tl.constexpr,  # split_k > 1
    USE_DOT: tl.constexpr,
    DOT_FP32: tl.constexpr,  # tl.dot in float32 (float32 x, or Triton's interpreter), else in x's dtype
    X_HALF: tl.constexpr,  # x in bf16 or fp16
    ASM: tl.constexpr,  # PTX inline assembly allowed (not in Triton's interpreter)
    X_BF16_PAIRS: tl.constexpr,  # x in bf16 at a 4-byte aligned address (INT4 FMA path: read in pairs)
    SLOT_DOT: tl.constexpr,  # INT4 tl.dot path: one dot per nibble slot (`_int4_slot_dot_step`; BLOCK_K >= 128)
    HALF_FMA: tl.constexpr,  # INT4 FMA path: each word's products summed in bf16x2 (`_int4_tile_math`)
    REDUCE_CHUNK: tl.constexpr,  # PARTIAL: K slices summed per load round by the last program (`_sum_partials`)
    X_FP16: tl.constexpr,  # x in fp16
    FP8_WORDS: tl.constexpr,  # FP8 W on the FMA path read as words of 4 (`_fp8_words_step`)
    LOAD_AHEAD: tl.constexpr,  # FMA paths (dense and INT4): each step loads the next tile before its math
    E4M3_PTX: tl.constexpr,  # FP8_WORDS: e4m3 converted by inline PTX (`e4m3_ptx_ok`)
    BLOCK_M: tl.constexpr,  # 16, 32 or 64 (>= M) with USE_DOT, else 1
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    VEC: tl.constexpr,  # FMA path: inputs summed in-thread per step (8 bf16 / 16 fp8 / 4 fp32: 16 bytes; int4: 8;
    # FP8_WORDS: 4)
    USE_PDL: tl.constexpr,  # launched with PDL (kernels/pdl.py): weights are prefetched into L2 before the wait
    INT4_FMA: tl.constexpr,  # INT4 and not USE_DOT
    EARLY_TILE: tl.constexpr,  # the FMA paths' first tile loaded before the PDL wait (FIRST_TILE_BEFORE_WAIT)
    PF_ROWS: tl.constexpr,  # the prefetch's shape (_prefetch_weights)
    PF_LINES: tl.constexpr,
    PF_STEP: tl.constexpr,
    GROUP_SCALE: tl.constexpr,  # dense (FP8) W with group scales [G, N] (FP8_WORDS or USE_DOT), applied per tile
):
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    rows = tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask, col_mask = rows < M, cols < N
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    if USE_PDL:
        _prefetch_weights(w_ptr, pid_n, k_start, k_start + k_per_split, N, K, stride_wn, INT4, BLOCK_N, PF_ROWS,
                          PF_LINES, PF_STEP)
    # The FMA paths' first weight tile (k_start < k_end always), in registers before the wait when EARLY_TILE
    # (weights only, kernels/pdl.py rule 1): at the wait its bytes are here, not one more round trip away. The
    # load-ahead loops start from it; the int4 and the plain FP8 word paths peel their first step to use it.
    if EARLY_TILE:
        tile, int4_tile = _first_tile(w_ptr, scale_ptr, zero_ptr, k_start, k_end, cols, col_mask, N, K,
                                      stride_wn, group_size, INT4_FMA, FP8_WORDS, LOAD_AHEAD, BLOCK_K, BLOCK_N, VEC)
    # The loop loads x (the previous kernel's output) with each weight tile, and the split-K counters may only be
    # touched once the previous GEMV has finished with them: wait here.
    wait_for_prior_grids(USE_PDL)
    if not EARLY_TILE:
        tile, int4_tile = _first_tile(w_ptr, scale_ptr, zero_ptr, k_start, k_end, cols, col_mask, N, K,
                                      stride_wn, group_size, INT4_FMA, FP8_WORDS, LOAD_AHEAD, BLOCK_K, BLOCK_N, VEC)
    if USE_DOT:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_K // VEC, BLOCK_N), dtype=tl.float32)
    k_loop = k_start
    if INT4_FMA and LOAD_AHEAD:  # the whole slice here: each step loads the next tile, x included, before its math
        xs = _int4_x(x_ptr, int4_tile[0], int4_tile[1], HALF_FMA, X_BF16_PAIRS)
        for k0 in range(k_start, k_end, BLOCK_K):
            acc, int4_tile, xs = _int4_ahead_step(acc, int4_tile, xs, x_ptr, w_ptr, scale_ptr, zero_ptr, k0, k_end,
                                                  cols, col_mask, N, group_size, BLOCK_K, HALF_FMA, ASM,
                                                  X_BF16_PAIRS)
        k_loop = k_end  # the loop below has nothing left
    elif INT4_FMA:  # the first tile's math, peeled (the loop's steps load their own tiles)
        acc = _int4_fma_math(acc, x_ptr, int4_tile, HALF_FMA, ASM, X_BF16_PAIRS)
        k_loop = k_start + BLOCK_K
    elif FP8_WORDS and not LOAD_AHEAD:  # likewise
        acc = _fp8_words_math(acc, tile, x_ptr, scale_ptr, k_start, cols, col_mask, N, K, group_size, BLOCK_K,
                              E4M3_PTX, GROUP_SCALE)
        k_loop = k_start + BLOCK_K
    for k0 in range(k_loop, k_end, BLOCK_K):
        if USE_DOT and INT4 and X_HALF and SLOT_DOT:
            acc = _int4_slot_dot_step(acc, x_ptr, w_ptr, scale_ptr, zero_ptr, k0, rows, row_mask, cols, col_mask, N,
                                      K, stride_xm, group_size, DOT_FP32, BLOCK_K, ASM)
        elif USE_DOT:
            acc = _dot_step(acc, x_ptr, w_ptr, scale_ptr, zero_ptr, k0, rows, row_mask, cols, col_mask, N, K,
                            stride_xm, stride_wn, group_size, INT4, DOT_FP32, X_HALF, X_FP16, BLOCK_K, BLOCK_N,
                            GROUP_SCALE)
        elif INT4:
            acc = _int4_fma_math(acc, x_ptr, _int4_tile(w_ptr, scale_ptr, zero_ptr, k0, cols, col_mask, N, K,
                                                        group_size, BLOCK_K), HALF_FMA, ASM, X_BF16_PAIRS)
        elif FP8_WORDS:
            acc, tile = _fp8_words_step(acc, tile, x_ptr, w_ptr, scale_ptr, k0, k_end, cols, col_mask, N, K,
                                        stride_wn, group_size, BLOCK_K, E4M3_PTX, LOAD_AHEAD, GROUP_SCALE)
        elif LOAD_AHEAD:  # dense (int4's load-ahead ran above)
            acc, tile = _dense_load_ahead_step(acc, tile, x_ptr, w_ptr, k0, k_end, cols, col_mask, K, stride_wn,
                                             BLOCK_K, VEC)
        else:
            acc = _fma_step(acc, x_ptr, w_ptr, k0, cols, col_mask, K, stride_wn, BLOCK_K, VEC)
    if not USE_DOT:
        acc = tl.sum(acc, axis=0)[None, :]  # [1, BN]
    scaled = HAS_SCALE and not INT4 and not GROUP_SCALE  # group scales were applied per tile
    if PARTIAL:
        offsets = rows[:, None] * N + cols[None, :]
        mask = row_mask[:, None] & col_mask[None, :]
        tl.store(partial_ptr + pid_k * M * N + offsets, acc, mask=mask)
        tl.debug_barrier()  # every thread's partial sums stored before the (release) atomic below
        arrived = tl.atomic_add(counter_ptr + pid_n, 1, sem="acq_rel")
        if arrived == split_k - 1:  # the last slice of this N tile: reduce, finish, reset the counter
            total = _sum_partials(partial_ptr, offsets, mask, M, N, split_k, BLOCK_M, BLOCK_N, REDUCE_CHUNK)
            _store_output(out_ptr, total, scale_ptr, stride_scale, bias_ptr, rows, cols, row_mask, col_mask, N,
                          scaled, HAS_BIAS)
            tl.atomic_xchg(counter_ptr + pid_n, 0)
    else:
        _store_output(out_ptr, acc, scale_ptr, stride_scale, bias_ptr, rows, cols, row_mask, col_mask, N, scaled,
                      HAS_BIAS)


# -- the int4 tensor-core path for up to 8 rows (GemvConfig.mma) -------------------------------------------------
#
# The FMA paths above issue 3.4-4.2 instructions per weight at the 8B shapes (scripts/gemv_sass.py): the int4 W3
# target needs about one. This path hands the products to the tensor cores, one warp-wide
# `mma.sync.m16n8k16` (bf16 in, float32 sums) per 16 x 16 block of W, without staging anything in shared memory:
# each thread's own packed words already hold its A fragment, once K is read in a thread-specific order.
#
# The fragments (PTX ISA, "Matrix Fragments for mma.m16n8k16"; lane l, g = l // 4, c = l % 4): A's registers hold
# the pairs (row g, k-pair c), (row g + 8, k-pair c), (row g, k-pair c + 4), (row g + 8, k-pair c + 4); B's hold
# (k-pairs c and c + 4, column g); D's (row g, columns 2c, 2c + 1), (row g + 8, the same columns). A product sums
# over k, so the 16 logical k of an MMA may be any 16 real inputs, taken in the same order for A and B. Here lane
# c of a quad takes the packed word c of a 32-input chunk (inputs 8c ... 8c + 7, one word of each of its rows):
# the first MMA's k-pairs c and c + 4 are the word's nibbles (0, 4) and (1, 5), the second MMA's (2, 6) and
# (3, 7); one LOP3 ORs a pair (j, j + 4) of a word shifted right by 4j under bf16's exponent of 128, whose unit
# in the last place is 1: the exact bf16 pair (128 + q_j, 128 + q_j+4). x's matching pairs are `_nibble_pairs`'.
# B's eight columns are x's rows (lane (g, c) loads row g; rows at or past M read as zeros), so D's (row, column)
# is output n's sum for batch row 2c or 2c + 1: one MMA serves M up to 8 at the cost of M = 1.
#
# No q - z per weight: the MMAs sum (128 + q) x exactly in float32, one more MMA per chunk with A all ones sums
# each row of x, and each step (a tile never crosses a group) adds scale * (sum - (128 + z) * sum(x)) per output.
# Per packed word (8 weights): 4 LOP3, 3 shifts and half of one MMA, against ~19 instructions on the bf16x2 FMA
# path; the whole K loop 1.8 instructions a weight at 8 columns a thread and block_k 128 (sm_90 SASS, session 33).
#
# A thread holds COLS = 4 or 8 columns of W, COLS / 2 MMA row tiles sharing x's loads: thread (g, c) holds the words
# of columns COLS g ... COLS g + COLS - 1 of its warp's 8 COLS (tile t's rows g and g + 8 are columns COLS g + 2t
# and + 2t + 1), so its loads are 16 or 32 contiguous bytes of one qweight row. Every tensor below is one value
# per thread ([32 * num_warps], element i on lane i % 32 of warp i // 32: Triton's layout of a 1-D tensor of that
# size; a test reads it from the compiled layouts), which is what lets inline assembly address the lanes. In Triton's
# interpreter (no lanes, no PTX) `_mma_rows` and `_mma_x_sum` compute the same D from each warp's lanes, reshaped.

_MMA_ROWS_ASM = tl.constexpr("""{
    .reg .b32 a0, a1, a2, a3, s0, s1;
    .reg .f32 t0, t1, t2, t3;
    lop3.b32 a0, $4, 0x000f000f, 0x43004300, 0xea;
    lop3.b32 a1, $5, 0x000f000f, 0x43004300, 0xea;
    shr.u32 s0, $4, 4;
    shr.u32 s1, $5, 4;
    lop3.b32 a2, s0, 0x000f000f, 0x43004300, 0xea;
    lop3.b32 a3, s1, 0x000f000f, 0x43004300, 0xea;
    mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32
        {t0, t1, t2, t3}, {a0, a1, a2, a3}, {$6, $7}, {$10, $11, $12, $13};
    shr.u32 s0, $4, 8;
    shr.u32 s1, $5, 8;
    lop3.b32 a0, s0, 0x000f000f, 0x43004300, 0xea;
    lop3.b32 a1, s1, 0x000f000f, 0x43004300, 0xea;
    shr.u32 s0, $4, 12;
    shr.u32 s1, $5, 12;
    lop3.b32 a2, s0, 0x000f000f, 0x43004300, 0xea;
    lop3.b32 a3, s1, 0x000f000f, 0x43004300, 0xea;
    mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32
        {$0, $1, $2, $3}, {a0, a1, a2, a3}, {$8, $9}, {t0, t1, t2, t3};
}""")

_MMA_X_SUM_ASM = tl.constexpr("""{
    .reg .b32 one;
    .reg .f32 t0, t1, t2, t3;
    mov.b32 one, 0x3f803f80;
    mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32
        {t0, t1, t2, t3}, {one, one, one, one}, {$4, $5}, {$8, $9, $10, $11};
    mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32
        {$0, $1, $2, $3}, {one, one, one, one}, {$6, $7}, {t0, t1, t2, t3};
}""")


# x's bf16 pairs of a packed word, (x_2i, x_2i+1) as int32 -> the pairs (x_j, x_j+4) its nibbles j and j + 4 take
# (`_nibble_pairs`' result): one PRMT each, from the low or the high halves of two pairs.
_X_MMA_PAIRS_ASM = tl.constexpr("""
    prmt.b32 $0, $4, $6, 0x5410;
    prmt.b32 $1, $4, $6, 0x7632;
    prmt.b32 $2, $5, $7, 0x5410;
    prmt.b32 $3, $5, $7, 0x7632;
""")


@triton.jit
def _mma_x_pairs(xs, ASM: tl.constexpr):
    """(x01, x23, x45, x67), x's bf16 pairs of each thread's word ([T] int32 each) -> (x04, x15, x26, x37)."""
    if ASM:
        pairs = tl.inline_asm_elementwise(_X_MMA_PAIRS_ASM, "=r,=r,=r,=r,r,r,r,r", [xs[0], xs[1], xs[2], xs[3]],
                                          dtype=(tl.int32,) * 4, is_pure=True, pack=1)
    else:
        pairs = _nibble_pairs(xs[0], xs[1], xs[2], xs[3])
    return pairs


@triton.jit
def _warp_product(a_values, x_values, THREADS: tl.constexpr):
    """The interpreter's stand-in for an MMA's D: a_values, x_values (8 tensors [THREADS] each: each lane's 8 inputs
    of its A row and of its B column, in one order) -> (D[g, 2c], D[g, 2c + 1]) for each lane (g, c) of each warp,
    [THREADS] each, where D[g, n] sums a_values of lanes (g, c') times x_values of lanes (n, c') over c' and the 8
    inputs."""
    warps: tl.constexpr = THREADS // 32
    d = tl.zeros((warps, 8, 8), dtype=tl.float32)  # [warp, g, n]
    for i in tl.static_range(8):
        a = tl.reshape(a_values[i], (warps, 8, 1, 4))  # [warp, g, -, c']
        x = tl.reshape(x_values[i], (warps, 1, 8, 4))  # [warp, -, n, c']
        d += tl.sum(a * x, axis=3)
    even, odd = tl.split(tl.reshape(d, (warps, 8, 4, 2)))  # n = 2c + e
    return tl.reshape(even, (THREADS,)), tl.reshape(odd, (THREADS,))


@triton.jit
def _pair_floats(pairs):
    """(x04, x15, x26, x37), bf16 pairs (x_j, x_j+4) as int32 [T] -> x_0 ... x_7 as 8 float32 tensors [T]."""
    lows = ()
    highs = ()
    for j in tl.static_range(4):
        lows = lows + ((pairs[j] << 16).to(tl.float32, bitcast=True),)
        highs = highs + ((pairs[j] & -65536).to(tl.float32, bitcast=True),)
    return lows + highs


@triton.jit
def _mma_rows(word_g, word_g8, pairs, acc, ASM: tl.constexpr, THREADS: tl.constexpr):
    """acc (an MMA row tile's D: rows g and g + 8, batch rows 2c and 2c + 1 each) plus the sums (128 + q) . x over
    one 32-input chunk of the tile's rows g and g + 8 (module notes above). word_g, word_g8: this thread's packed
    word of each row; pairs: x's (x04, x15, x26, x37) of the thread's word and batch row g (`_mma_x_pairs`); all
    [THREADS]."""
    if ASM:  # not pure: a warp-collective instruction the compiler must neither move into divergent code nor merge
        acc = tl.inline_asm_elementwise(
            _MMA_ROWS_ASM, "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f", [word_g, word_g8, pairs[0], pairs[1], pairs[2], pairs[3],
                                                               acc[0], acc[1], acc[2], acc[3]],
            dtype=(tl.float32,) * 4, is_pure=False, pack=1)
    else:
        x_values = _pair_floats(pairs)
        row_g = ()  # 128 + q_j, input j at j
        row_g8 = ()
        for j in tl.static_range(8):
            row_g = row_g + (((word_g >> (4 * j)) & 0xF).to(tl.float32) + 128.0,)
            row_g8 = row_g8 + (((word_g8 >> (4 * j)) & 0xF).to(tl.float32) + 128.0,)
        g_even, g_odd = _warp_product(row_g, x_values, THREADS)
        g8_even, g8_odd = _warp_product(row_g8, x_values, THREADS)
        acc = (acc[0] + g_even, acc[1] + g_odd, acc[2] + g8_even, acc[3] + g8_odd)
    return acc


@triton.jit
def _mma_x_sum(pairs, acc, ASM: tl.constexpr, THREADS: tl.constexpr):
    """acc (as an MMA's D: batch rows 2c, 2c + 1, twice) plus the sum of x's 32 inputs of one chunk per batch row, as
    an MMA with A all ones makes it: the (128 + z) * sum(x) that `_mma_rows`' sums carry beyond sum((q - z) x).
    pairs: `_mma_x_pairs`'."""
    if ASM:  # not pure, as `_mma_rows`' MMAs
        acc = tl.inline_asm_elementwise(_MMA_X_SUM_ASM, "=f,=f,=f,=f,r,r,r,r,f,f,f,f", [pairs[0], pairs[1], pairs[2],
                                                                                     pairs[3], acc[0], acc[1], acc[2],
                                                                                     acc[3]],
                                        dtype=(tl.float32,) * 4, is_pure=False, pack=1)
    else:
        ones = tl.full((THREADS,), 1.0, tl.float32)
        even, odd = _warp_product((ones,) * 8, _pair_floats(pairs), THREADS)
        acc = (acc[0] + even, acc[1] + odd, acc[2] + even, acc[3] + odd)
    return acc


@triton.jit
def _split_columns(values, COLS: tl.constexpr):
    """[T, COLS] (COLS = 4 or 8: one thread's vector per row) -> its COLS columns as tensors [T]."""
    if COLS == 4:
        columns = _split_four(values)
    else:
        low, high = tl.split(tl.reshape(values, (values.shape[0], 2, 4)).permute(0, 2, 1))  # columns 0-3, 4-7
        columns = _split_four(low) + _split_four(high)
    return columns


@triton.jit
def _mma_tile(w_ptr, scale_ptr, zero_ptr, k0, k_end, quad_lane, col0, N, group_size, CHUNKS: tl.constexpr,
              COLS: tl.constexpr):
    """The thread's share of W's tile at inputs k0 ... k0 + 32 CHUNKS (weights only: loadable before the PDL wait):
    (words: CHUNKS tuples of its COLS columns' packed word in word row k0 / 8 + 4 chunk + quad_lane; the columns'
    group scales; their 128 + z), all [THREADS]. Words past k_end (the slice) read as 0; at or past k_end the
    scales and zeros are the slice's last group's (never used)."""
    cols = col0[:, None] + tl.arange(0, COLS)[None, :]  # [T, COLS]
    col_ok = cols < N
    words = ()
    for chunk in tl.static_range(CHUNKS):
        word_row = k0 // 8 + 4 * chunk + quad_lane
        valid = (word_row < k_end // 8)[:, None] & col_ok
        words = words + (_split_columns(tl.load(w_ptr + word_row.to(tl.int64)[:, None] * N + cols, mask=valid,
                                                other=0), COLS),)
    group_offsets = (tl.minimum(k0, k_end - 1) // group_size) * N + cols
    scales = tl.load(scale_ptr + group_offsets, mask=col_ok, other=0.0).to(tl.float32)
    zero_points = tl.load(zero_ptr + group_offsets, mask=col_ok, other=0.0).to(tl.float32) + 128.0
    return words, _split_columns(scales, COLS), _split_columns(zero_points, COLS)


@triton.jit
def _mma_step(totals, tile, x_ptr, stride_xm, x_row, x_ok, k0, k_end, quad_lane, ASM: tl.constexpr,
              CHUNKS: tl.constexpr, COLS: tl.constexpr, ROWS_PER_LANE: tl.constexpr, THREADS: tl.constexpr):
    """totals (the thread's COLS columns' float32 sums for batch rows 2c + e, e < ROWS_PER_LANE: element
    ROWS_PER_LANE j + e; at M = 1 one row of x in every column of B, row 0's only) plus one tile's products with x
    (inputs k0 ...; this lane loads x's row x_row [T], zeros where not x_ok, at or past M). Column col0 + 2t is row
    g of MMA row tile t, col0 + 2t + 1 its row g + 8."""
    words, scales, zero_points = tile
    zero = tl.zeros((THREADS,), dtype=tl.float32)
    tiles = ()  # each MMA row tile's D: (row g, batch row 2c), (g, 2c + 1), (g + 8, 2c), (g + 8, 2c + 1)
    for t in tl.static_range(COLS // 2):
        tiles = tiles + ((zero, zero, zero, zero),)
    x_sum = (zero, zero, zero, zero)
    x_rows = x_ptr + x_row * stride_xm  # [T] (mma_ok: rows at 4-byte aligned addresses)
    for chunk in tl.static_range(CHUNKS):
        word_row = k0 // 8 + 4 * chunk + quad_lane  # x's inputs 8 w ... 8 w + 7 of word row w: 16 bytes
        xs = _x_pair_vectors(x_rows, word_row, (word_row < k_end // 8) & x_ok)
        pairs = _mma_x_pairs(xs, ASM)
        row_words = words[chunk]
        updated = ()
        for t in tl.static_range(COLS // 2):
            updated = updated + (_mma_rows(row_words[2 * t], row_words[2 * t + 1], pairs, tiles[t], ASM, THREADS),)
        tiles = updated
        x_sum = _mma_x_sum(pairs, x_sum, ASM, THREADS)
    out = ()
    for j in tl.static_range(COLS):
        for e in tl.static_range(ROWS_PER_LANE):
            sums = tiles[j // 2][2 * (j % 2) + e]
            out = out + (totals[ROWS_PER_LANE * j + e] + scales[j] * (sums - zero_points[j] * x_sum[e]),)
    return out


@triton.jit
def _int4_mma_kernel(
    out_ptr,  # [M, N] in x's dtype (bf16)
    partial_ptr,  # [SPLIT_K, M, N] float32 (PARTIAL)
    counter_ptr,  # [>= cdiv(N, BLOCK_N)] int32, zero between calls (PARTIAL)
    x_ptr,  # [M, K] bf16, 4-byte aligned rows (stride_xm even)
    w_ptr,  # [K // 8, N] int32
    scale_ptr,  # [G, N]
    zero_ptr,  # [G, N]
    bias_ptr,  # [N] (HAS_BIAS)
    M,  # 1 ... 8
    N,
    K,
    stride_xm,
    k_per_split,  # a multiple of BLOCK_K
    split_k,
    group_size: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    PARTIAL: tl.constexpr,
    ASM: tl.constexpr,  # inline PTX (mma.sync), else the interpreter's stand-in
    REDUCE_CHUNK: tl.constexpr,
    BLOCK_M: tl.constexpr,  # M rounded up to a power of two (the last program's reduction tile)
    THREADS: tl.constexpr,  # 32 * num_warps
    COLS: tl.constexpr,  # columns a thread holds (4 or 8): a warp owns 8 COLS, a program BLOCK_N = THREADS * COLS / 4
    BLOCK_K: tl.constexpr,  # 32 * chunks a step
    USE_PDL: tl.constexpr,
    PF_ROWS: tl.constexpr,
    PF_LINES: tl.constexpr,
    PF_STEP: tl.constexpr,
):
    """y[m, n] = sum_k x[m, k] W[k, n] for the N tile of BLOCK_N columns and K slice of this program (the split-K,
    PDL and reduction contract of `_gemv_kernel`); the MMA notes above."""
    BLOCK_N: tl.constexpr = THREADS * COLS // 4
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    thread = tl.arange(0, THREADS)
    quad_lane = thread % 4  # c: which packed word of a 32-input chunk
    group_id = (thread % 32) // 4  # g: the lane's A rows g, g + 8 and its B column (x's row g)
    col0 = pid_n * BLOCK_N + (thread // 32) * (8 * COLS) + COLS * group_id  # columns col0 + j
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    if USE_PDL:
        _prefetch_weights(w_ptr, pid_n, k_start, k_start + k_per_split, N, K, 0, True, BLOCK_N, PF_ROWS, PF_LINES,
                          PF_STEP)
    tile = _mma_tile(w_ptr, scale_ptr, zero_ptr, k_start, k_end, quad_lane, col0, N, group_size, BLOCK_K // 32, COLS)
    wait_for_prior_grids(USE_PDL)  # x is the previous kernel's output; the counters its to finish with
    zero = tl.zeros((THREADS,), dtype=tl.float32)
    # ROWS_PER_LANE: batch rows 2c, 2c + 1 per lane; at M = 1 every lane loads x's row 0 (B's columns alike) and
    # keeps one sum per column (lanes c > 0 hold copies of it and store nothing)
    ROWS_PER_LANE: tl.constexpr = 1 if BLOCK_M == 1 else 2
    x_row = group_id if BLOCK_M > 1 else tl.zeros((THREADS,), dtype=tl.int32)
    totals = ()  # column col0 + j, batch row 2c + e at ROWS_PER_LANE * j + e
    for j in tl.static_range(ROWS_PER_LANE * COLS):
        totals = totals + (zero,)
    for k0 in range(k_start, k_end, BLOCK_K):  # each step loads the next tile before its own math
        next_tile = _mma_tile(w_ptr, scale_ptr, zero_ptr, k0 + BLOCK_K, k_end, quad_lane, col0, N, group_size,
                              BLOCK_K // 32, COLS)
        totals = _mma_step(totals, tile, x_ptr, stride_xm, x_row, x_row < M, k0, k_end, quad_lane, ASM,
                           BLOCK_K // 32, COLS, ROWS_PER_LANE, THREADS)
        tile = next_tile
    if PARTIAL:
        for j in tl.static_range(COLS):
            for e in tl.static_range(ROWS_PER_LANE):
                row = 2 * quad_lane + e
                tl.store(partial_ptr + pid_k * M * N + row * N + col0 + j, totals[ROWS_PER_LANE * j + e],
                         mask=(row < M) & (col0 + j < N))
        tl.debug_barrier()  # every thread's partial sums stored before the (release) atomic below
        arrived = tl.atomic_add(counter_ptr + pid_n, 1, sem="acq_rel")
        if arrived == split_k - 1:  # the last slice of this N tile: reduce, finish, reset the counter
            rows = tl.arange(0, BLOCK_M)
            cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            offsets = rows[:, None] * N + cols[None, :]
            mask = (rows < M)[:, None] & (cols < N)[None, :]
            total = _sum_partials(partial_ptr, offsets, mask, M, N, split_k, BLOCK_M, BLOCK_N, REDUCE_CHUNK)
            _store_output(out_ptr, total, out_ptr, 0, bias_ptr, rows, cols, rows < M, cols < N, N, False, HAS_BIAS)
            tl.atomic_xchg(counter_ptr + pid_n, 0)
    else:
        for j in tl.static_range(COLS):
            col_ok = col0 + j < N
            bias = tl.zeros((THREADS,), dtype=tl.float32)
            if HAS_BIAS:
                bias = tl.load(bias_ptr + col0 + j, mask=col_ok, other=0.0).to(tl.float32)
            for e in tl.static_range(ROWS_PER_LANE):
                row = 2 * quad_lane + e
                tl.store(out_ptr + row * N + col0 + j,
                         (totals[ROWS_PER_LANE * j + e] + bias).to(out_ptr.dtype.element_ty), mask=(row < M) & col_ok)


# -- configuration ------------------------------------------------------------------------------------------

def weight_format(weight: torch.Tensor) -> str:
    """The config table's name for a dense weight's dtype: bf16, fp16, fp32 or fp8."""
    names = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.float8_e4m3fn: "fp8"}
    if weight.dtype not in names:
        raise ValueError(f"dense_gemv: weight dtype {weight.dtype} is not supported (supported: {list(names)})")
    return names[weight.dtype]


def m_bucket(m: int, fmt: str = "") -> int:
    """The config table's batch key: 1 (the FMA path), else 16 (M of 2..16), 32 or 64; int4 takes 64 rows for every
    M of 17..64 (its 32-row tiles measured slower than its 64-row ones at every 8B shape on an H200, run 86: qkv
    33.3 vs 25.1 us, gate_up 148.1 vs 81.7), and has a key of its own for M of 2..8 (MMA_MAX_M: GemvConfig.mma
    takes them at the cost of one row; `config_for` falls back to the 16 row). The tl.dot tile's rows are
    max(16, bucket)."""
    if fmt == "int4" and m > 16:
        return 64
    if fmt == "int4" and 1 < m <= MMA_MAX_M:
        return MMA_MAX_M
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
    along N), and the split from `split_k_for`. int4 takes the paths that won every 8B shape in run 48 (half_fma
    at M == 1, slot_dot above; each applies only where its conditions hold, see GemvConfig)."""
    dot = m > 1
    if fmt == "int4":
        block_n, block_k = 64, 128
    else:
        block_n, block_k = (32, 512 if fmt == "fp8" else 256) if not dot else (32, 128)
    int4 = fmt == "int4"
    return GemvConfig(block_n, block_k, split_k_for(n, k, block_n, block_k, num_sms), num_warps=4, num_stages=3,
                      dot=dot, slot_dot=int4 and dot, half_fma=int4 and not dot)


def config_for(fmt: str, m: int, n: int, k: int, num_sms: int, gpu: str = "") -> GemvConfig:
    """The tuned config of this shape: quant_gemv_configs.TUNED's row measured on this GPU (`gpu`, its name as
    torch reports it) if there is one, else its row for any GPU (int4 at M of 2..8: those of the M = 16 key next),
    else the default."""
    from .quant_gemv_configs import TUNED

    buckets = [m_bucket(m, fmt)] + ([16] if m_bucket(m, fmt) == MMA_MAX_M else [])  # int4's 2..8, then 16
    for bucket in buckets:
        key = (fmt, n, k, bucket)
        config = TUNED.get(key + (gpu,)) or TUNED.get(key)
        if config:
            return config
    return default_config(fmt, m, n, k, num_sms)


@dataclasses.dataclass(frozen=True)
class _Launch:
    """A config fitted to one call: the K slice length and the number of slices it really gives."""

    config: GemvConfig
    block_k: int
    k_per_split: int
    split_k: int


def _reduce_chunk(block_m: int, config: GemvConfig) -> int:
    """K slices the last program of an N tile loads per round when it sums the partials: at M == 1 up to 8, as many
    as keep about 32 float32 values a thread per round; 1 for the tl.dot tiles (2 a round measured slower at M = 16
    in run 51, with the PTX slot_dot codes; reverted to run 48's state)."""
    if block_m > 1:
        return 1
    per_slice = block_m * config.block_n / (32 * config.num_warps)  # values a thread loads per slice
    return max(1, min(8, 1 << int(math.log2(max(1.0, 32 / per_slice)))))


def half_fma_ok(x2: torch.Tensor) -> bool:
    """Whether the half_fma FMA path can take x: bf16 at a 4-byte aligned address, on CUDA (inline PTX; sm_80+)."""
    return (x2.dtype == torch.bfloat16 and x2.data_ptr() % 4 == 0 and x2.is_cuda and not interpreting()
            and compute_capability(x2.device.index) >= (8, 0))


def _fit(config: GemvConfig, k: int, group_size: Optional[int]) -> _Launch:
    block_k = config.block_k
    if group_size is not None:  # a tile stays in one group (int4, or FP8 with group scales)
        if group_size % 16:
            raise ValueError(f"decode GEMV: group size {group_size} is not a multiple of 16")
        while group_size % block_k:
            block_k //= 2
    block_k = max(block_k, 16)
    k_per_split = triton.cdiv(triton.cdiv(k, config.split_k), block_k) * block_k
    return _Launch(config, block_k, k_per_split, triton.cdiv(k, k_per_split))


def _counter_buffer(device: torch.device) -> torch.Tensor:
    """The split-K arrival counters of a device: zeroed once, left zeroed by every call (kernel docstring); the
    first call must run eagerly (`kernels.arrival_counters`)."""
    return arrival_counters("the decode GEMV", device, _COUNTER_SLOTS)


def _check_fp8_words(weight: torch.Tensor, use_dot: bool) -> None:
    """GemvConfig.fp8_words' conditions, each a ValueError naming the field."""
    if weight.dtype != torch.float8_e4m3fn:
        raise ValueError(f"GemvConfig.fp8_words needs FP8 e4m3 weights, got {weight.dtype}")
    if use_dot:
        raise ValueError("GemvConfig.fp8_words applies at M == 1 on the FMA path (dot=False) only")
    if weight.shape[1] % 4 or weight.stride(0) % 4 or weight.data_ptr() % 4:
        raise ValueError(f"GemvConfig.fp8_words needs K, the weight's row stride and its address in multiples of 4 "
                         f"bytes, got K={weight.shape[1]}, stride {weight.stride(0)}, address {weight.data_ptr()}")


def _launch(x2: torch.Tensor, weight: torch.Tensor, n: int, scale, zeros, bias, group_size: Optional[int],
            config: GemvConfig, int4: bool) -> torch.Tensor:
    """One GEMV launch. int4: `weight` is packed int4 with group scales and zeros; else dense, with `group_size`
    set when `scale` holds FP8 group scales [G, N] (FP8 words or tl.dot paths only)."""
    m, k = x2.shape
    if m > MAX_M:
        raise ValueError(f"the decode GEMV takes at most {MAX_M} rows, got {m}")
    fit = _fit(config, k, group_size)
    use_dot = config.dot or m > 1
    fmt = "int4" if int4 else ""
    block_m = max(16, m_bucket(m, fmt)) if use_dot else 1  # rows of the tl.dot tile, or the FMA path's one
    tiles = triton.cdiv(n, config.block_n)
    if tiles > _COUNTER_SLOTS:
        raise ValueError(f"decode GEMV: {tiles} N tiles exceed {_COUNTER_SLOTS} (raise block_n)")
    if config.fp8_words:
        _check_fp8_words(weight, use_dot)
    group_scale = group_size is not None and not int4
    if group_scale and not (use_dot or config.fp8_words):
        raise ValueError("decode GEMV: FP8 group scales need the FP8 word path at M == 1 (fp8_words) or tl.dot")
    if config.load_ahead and use_dot:
        raise ValueError("GemvConfig.load_ahead applies at M == 1 on the FMA path (dot=False) only")
    if config.mma and (m > MMA_MAX_M or not int4):
        raise ValueError(f"GemvConfig.mma applies to int4 weights at M <= {MMA_MAX_M} only, got M={m}"
                         f"{'' if int4 else ', a dense weight'}")
    if config.mma and mma_ok(x2) and fit.block_k >= 32:
        return _launch_mma(x2, weight, n, scale, zeros, bias, group_size, fit)
    partial = fit.split_k > 1
    out, workspace = _outputs(x2, n, fit.split_k)
    counters = _counter_buffer(x2.device)  # made on the first call, split or not (see _counter_buffer)
    stride_scale = 1 if int4 or group_scale or scale is None else scale.stride(0)
    pdl = pdl_enabled(x2.device)
    prefetch = _prefetch_shape(weight, int4, config.block_n, fit.k_per_split)
    _gemv_kernel[(tiles, fit.split_k)](
        out, workspace, counters, x2, weight, scale if scale is not None else out,
        zeros if zeros is not None else out, bias if bias is not None else out, m, n, k, x2.stride(0),
        0 if int4 else weight.stride(0), stride_scale, group_size or 1,
        fit.k_per_split, fit.split_k,
        INT4=int4, HAS_SCALE=scale is not None, HAS_BIAS=bias is not None, PARTIAL=partial, USE_DOT=use_dot,
        DOT_FP32=x2.dtype == torch.float32 or interpreting(), X_HALF=x2.dtype in (torch.bfloat16, torch.float16),
        X_FP16=x2.dtype == torch.float16, ASM=not interpreting(),
        X_BF16_PAIRS=x2.dtype == torch.bfloat16 and x2.data_ptr() % 4 == 0,
        SLOT_DOT=int4 and config.slot_dot and fit.block_k >= 128,
        HALF_FMA=int4 and config.half_fma and not use_dot and half_fma_ok(x2),
        REDUCE_CHUNK=_reduce_chunk(block_m, config), BLOCK_M=block_m,
        FP8_WORDS=config.fp8_words, LOAD_AHEAD=config.load_ahead, E4M3_PTX=config.fp8_words and e4m3_ptx_ok(x2),
        BLOCK_N=config.block_n, BLOCK_K=fit.block_k, VEC=_vec(config, int4, weight, fit.block_k),
        USE_PDL=pdl, INT4_FMA=int4 and not use_dot, EARLY_TILE=FIRST_TILE_BEFORE_WAIT, PF_ROWS=prefetch[0],
        PF_LINES=prefetch[1], PF_STEP=prefetch[2], GROUP_SCALE=group_scale, num_warps=config.num_warps,
        num_stages=config.num_stages, launch_pdl=pdl)
    return out


def mma_ok(x2: torch.Tensor) -> bool:
    """Whether GemvConfig.mma can take x [M, K]: M <= MMA_MAX_M, bf16 rows at 4-byte aligned addresses, on CUDA of
    compute capability 8.0+ (mma.sync with bf16 operands) or in Triton's interpreter (its stand-in for the MMA)."""
    m = x2.shape[0]
    if m > MMA_MAX_M or x2.dtype != torch.bfloat16 or x2.data_ptr() % 4 or (m > 1 and x2.stride(0) % 2):
        return False
    return interpreting() or (x2.is_cuda and compute_capability(x2.device.index) >= (8, 0))


def _launch_mma(x2: torch.Tensor, qweight: torch.Tensor, n: int, scale: torch.Tensor, zeros: torch.Tensor, bias,
                group_size: int, fit: _Launch) -> torch.Tensor:
    """One launch of the int4 tensor-core path (`_int4_mma_kernel`; x2 [M, K] bf16, `mma_ok`)."""
    m, k = x2.shape
    out, workspace = _outputs(x2, n, fit.split_k)
    constexprs = mma_constexprs(qweight, fit, m, group_size, bias is not None, pdl_enabled(x2.device))
    _int4_mma_kernel[(triton.cdiv(n, fit.config.block_n), fit.split_k)](
        out, workspace, _counter_buffer(x2.device), x2, qweight, scale, zeros, bias if bias is not None else out, m,
        n, k, x2.stride(0) if m > 1 else 0, fit.k_per_split, fit.split_k, **constexprs,
        num_warps=fit.config.num_warps, num_stages=fit.config.num_stages, launch_pdl=constexprs["USE_PDL"])
    return out


def mma_constexprs(qweight, fit: _Launch, m: int, group_size: int, has_bias: bool, pdl: bool) -> dict:
    """`_int4_mma_kernel`'s constexprs for a fitted config (`_launch_mma`; scripts/gemv_sass.py compiles with them).
    qweight: anything with int32's element_size()."""
    config, block_m = fit.config, triton.next_power_of_2(m)  # block_m: the last program's reduction tile
    rows, lines, step = _prefetch_shape(qweight, True, config.block_n, fit.k_per_split)
    return dict(group_size=group_size, HAS_BIAS=has_bias, PARTIAL=fit.split_k > 1, ASM=not interpreting(),
                REDUCE_CHUNK=max(1, _reduce_chunk(1, config) // block_m), BLOCK_M=block_m,
                THREADS=32 * config.num_warps, COLS=config.block_n // (8 * config.num_warps), BLOCK_K=fit.block_k,
                USE_PDL=pdl, PF_ROWS=rows, PF_LINES=lines, PF_STEP=step)


def _outputs(x2: torch.Tensor, n: int, split_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(y [M, N] in x's dtype, the split-K workspace [split_k, M, N] float32, or y itself when K is not split)."""
    m = x2.shape[0]
    out = torch.empty((m, n), device=x2.device, dtype=x2.dtype)
    workspace = torch.empty((split_k, m, n), device=x2.device, dtype=torch.float32) if split_k > 1 else out
    return out, workspace


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



def _vec(config: GemvConfig, int4: bool, weight: torch.Tensor, block_k: int) -> int:
    """The FMA path's inputs per in-thread sum: an int4 word (8), an FP8 word (4, fp8_words), else 16 bytes."""
    if int4:
        return 8
    if config.fp8_words:
        return 4
    return min(16 // weight.element_size(), block_k)


def e4m3_ptx_ok(x: torch.Tensor) -> bool:
    """Whether the FP8 word path may convert e4m3 by inline PTX (`_E4M3_WORD_ASM`) on x's device: CUDA of compute
    capability 8.9+ (cvt.rn.f16x2.e4m3x2), not Triton's interpreter."""
    return x.is_cuda and not interpreting() and compute_capability(x.device.index) >= (8, 9)


def _rows(x: torch.Tensor) -> torch.Tensor:
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def _gpu(x: torch.Tensor) -> str:
    """The name of x's GPU, the key of the tile table's per-GPU rows ("" on a CPU or in the interpreter)."""
    return device_name(x.device.index) if x.is_cuda and not interpreting() else ""


def _num_sms(x: torch.Tensor, num_sms: Optional[int]) -> int:
    if num_sms is not None:
        return num_sms
    return sm_count(x.device.index) if x.is_cuda else 4


# -- entry points -------------------------------------------------------------------------------------------

def dense_gemv(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
               w_scale: Optional[torch.Tensor] = None, num_sms: Optional[int] = None,
               config: Optional[GemvConfig] = None, group_size: Optional[int] = None) -> torch.Tensor:
    """x [M, K] (M <= 64) @ (weight [N, K] * w_scale [N, 1] or [])^T (+ bias) -> [M, N] in x's dtype.
    group_size: FP8 weight with group scales w_scale [G, N] float32 (block-wise checkpoints; a multiple of 16).
    Same contract as quant_reference.dense_gemv. config: tiles for this call (default: `config_for`; with group
    scales at M == 1 the FP8 word path is taken whatever the row says, the only FMA path that applies them, or
    tl.dot where the weight cannot be read in 4-byte words)."""
    x2 = _rows(x)
    n, k = weight.shape
    if weight.stride(1) != 1:
        raise ValueError("dense_gemv: the weight must have unit stride along K")
    if config is None:
        config = config_for(weight_format(weight), x2.shape[0], n, k, _num_sms(x, num_sms), _gpu(x))
    if group_size is not None:
        check_fp8_group_scales(weight, w_scale, group_size, "dense_gemv")
        if x2.shape[0] == 1 and not config.dot and not config.fp8_words:  # the one FMA path with group scales
            words_ok = k % 4 == 0 and weight.stride(0) % 4 == 0 and weight.data_ptr() % 4 == 0
            config = dataclasses.replace(config, fp8_words=words_ok, load_ahead=config.load_ahead and words_ok,
                                         dot=not words_ok)
        scale = w_scale.float().contiguous()  # itself when already so
    elif w_scale is not None:  # [N] float32, or one value read with stride 0 (no copy per call)
        scale = w_scale.float().reshape(-1) if w_scale.numel() == n else w_scale.float().reshape(1).expand(n)
    else:
        scale = None
    out = _launch(x2, weight, n, scale, None, bias, group_size, config, int4=False)
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
        config = config_for("int4", x2.shape[0], n, k, _num_sms(x, num_sms), _gpu(x))
    out = _launch(x2, qweight, n, scales.contiguous(), zeros.contiguous(), bias, group_size, config, int4=True)
    return out.reshape(*x.shape[:-1], n)

"""int4 weight-only matrix product on the engine's packed layout (see quant_reference.py): y = x @ W.

Three paths by the number of rows M of x:
  M <= GEMV_MAX_M        the split-K GEMV of quant_gemv.py (`int4_gemv`): decode batches, memory-bound;
  M < DEQUANT_MIN_M      the dequantizing GEMM here (`dequantizing_gemm`): each program owns a [BLOCK_M, BLOCK_N]
                         tile of y and walks all of K in tiles that never cross a group, so each tile reads its
                         group's scales and zeros once ([BLOCK_N] each);
  M >= DEQUANT_MIN_M     prefill-sized batches: W dequantized once into a [K, N] buffer of x's dtype
                         (`dequantize`, one pass writing 2 bytes a weight) and multiplied by the library's GEMM
                         (cuBLAS), as vLLM does for AWQ above 256 tokens. The GEMM above dequantizes each weight
                         once per BLOCK_M rows of x on the ALUs the tensor cores wait for: on an H200 an 8B prefill
                         of 8,192 tokens took 1,242 ms of int4 GEMMs against 154 ms of bf16 cuBLAS (run 83).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from . import interpreting
from .quant_gemv import int4_gemv

GEMV_MAX_M = 16  # decode batches up to this size take the split-K GEMV (the bound; unmeasured above)
DEQUANT_MIN_M = 256  # from this many rows on: dequantize, then the library's GEMM (module docstring)


@triton.jit
def _int4_matmul_kernel(
    out_ptr,  # [M, N] in x's dtype (PARTIAL false) or [SPLIT_K, M, N] float32 partial sums
    x_ptr,  # [M, K]
    qweight_ptr,  # [K // 8, N] int32
    scales_ptr,  # [G, N]
    zeros_ptr,  # [G, N]
    M,
    N,
    K,
    stride_xm,
    group_size,
    k_per_split,  # a multiple of BLOCK_K
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,  # divides group_size: a tile stays within one group
    DOT_FP32: tl.constexpr,  # multiply in float32 (Triton's interpreter computes bf16 dots wrongly), else x's dtype
    PARTIAL: tl.constexpr,
):
    pid_m, pid_n, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask, col_mask = rows < M, cols < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_start = pid_k * k_per_split
    for k0 in range(k_start, tl.minimum(k_start + k_per_split, K), BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < K
        x = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_xm + ks[None, :],
                    mask=row_mask[:, None] & k_mask[None, :], other=0.0)  # [BM, BK]
        words = tl.load(qweight_ptr + (ks // 8)[:, None].to(tl.int64) * N + cols[None, :],
                        mask=k_mask[:, None] & col_mask[None, :], other=0)  # [BK, BN]
        q = (words >> ((ks % 8) * 4)[:, None]) & 0xF
        group = k0 // group_size
        scale = tl.load(scales_ptr + group * N + cols, mask=col_mask, other=0.0).to(tl.float32)  # [BN]
        zero = tl.load(zeros_ptr + group * N + cols, mask=col_mask, other=0.0).to(tl.float32)
        w = (q.to(tl.float32) - zero[None, :]) * scale[None, :]  # [BK, BN]
        if DOT_FP32:
            acc += tl.dot(x.to(tl.float32), w, input_precision="ieee", out_dtype=tl.float32)
        else:
            acc += tl.dot(x, w.to(x_ptr.dtype.element_ty), out_dtype=tl.float32)
    out = out_ptr + pid_k * M * N + rows[:, None].to(tl.int64) * N + cols[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])


@triton.jit
def _dequantize_kernel(
    out_ptr,  # [K, N] in the output dtype
    qweight_ptr,  # [K // 8, N] int32: input 8 r + j of column n in nibble j of word [r, n]
    scales_ptr,  # [G, N]
    zeros_ptr,  # [G, N]
    N,
    K,
    group_size,
    BLOCK_R: tl.constexpr,  # word rows a program owns (8 inputs each)
    BLOCK_N: tl.constexpr,
):
    """W[k, n] = (q - z) * s of its group, computed in float32 (exact: a 4-bit integer times a 16-bit scale) and
    rounded once to the output dtype: the same bits as quant_reference.dequantize_packed in that dtype."""
    words_r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)  # [BR]
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    mask = (words_r < K // 8)[:, None] & (cols < N)[None, :]
    words = tl.load(qweight_ptr + words_r[:, None].to(tl.int64) * N + cols[None, :], mask=mask, other=0)
    group = (words_r * 8) // group_size  # [BR]; a word's 8 inputs share a group (group_size % 8 == 0)
    params = group[:, None].to(tl.int64) * N + cols[None, :]
    scale = tl.load(scales_ptr + params, mask=mask, other=0.0).to(tl.float32)  # [BR, BN]
    zero = tl.load(zeros_ptr + params, mask=mask, other=0.0).to(tl.float32)
    for j in tl.static_range(8):
        q = ((words >> (4 * j)) & 0xF).to(tl.float32)
        w = (q - zero) * scale
        tl.store(out_ptr + (words_r * 8 + j)[:, None].to(tl.int64) * N + cols[None, :],
                 w.to(out_ptr.dtype.element_ty), mask=mask)


def dequantize(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
               dtype: torch.dtype) -> torch.Tensor:
    """The packed int4 W as [K, N] in `dtype` (a new tensor): quant_reference.dequantize_packed's values, computed
    in float32 and rounded once."""
    if group_size % 8:
        raise ValueError(f"int4 dequantize: group size {group_size} is not a multiple of 8")
    rows, n = qweight.shape
    out = torch.empty((rows * 8, n), device=qweight.device, dtype=dtype)
    block_r, block_n = 16, 128
    grid = (triton.cdiv(rows, block_r), triton.cdiv(n, block_n))
    _dequantize_kernel[grid](out, qweight, scales, zeros, n, rows * 8, group_size, BLOCK_R=block_r,
                             BLOCK_N=block_n)
    return out


def _block_k(group_size: int) -> int:
    for block in (64, 32, 16):
        if group_size % block == 0:
            return block
    raise ValueError(f"int4 kernel: group size {group_size} is not a multiple of 16")


def plan(m: int, n: int, k: int, group_size: int, num_sms: int = 132) -> dict:
    """Tile sizes of the dequantizing GEMM (M > 16; smaller batches take quant_gemv.int4_gemv)."""
    return dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=_block_k(group_size), split_k=1)


def int_weight_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                      group_size: int, bits: int = 4, bias: Optional[torch.Tensor] = None,
                      num_sms: Optional[int] = None) -> torch.Tensor:
    """x [M, K] @ W (+ bias) -> [M, N] in x's dtype; W in the packed int4 layout. Same contract as the reference.
    The path follows M (module docstring): the GEMV, the dequantizing GEMM, or dequantize + the library's GEMM."""
    if bits != 4:
        raise ValueError(f"the int4 kernel got {bits}-bit weights (only 4-bit has a kernel)")
    x2 = x.reshape(-1, x.shape[-1])
    if x2.shape[0] <= GEMV_MAX_M:
        return int4_gemv(x, qweight, scales, zeros, group_size, bias, num_sms)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if x2.shape[0] >= DEQUANT_MIN_M:
        out = x2 @ dequantize(qweight, scales, zeros, group_size, x2.dtype)  # [M, K] @ [K, N]: cuBLAS
    else:
        out = dequantizing_gemm(x2, qweight, scales, zeros, group_size,
                                plan(*x2.shape, qweight.shape[1], group_size))
    if bias is not None:
        out = (out.float() + bias.float()).to(x.dtype)
    return out.reshape(*x.shape[:-1], qweight.shape[1])


def dequantizing_gemm(x2: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                      group_size: int, cfg: dict) -> torch.Tensor:
    """x2 [M, K] (unit stride along K) @ W -> [M, N] in x2's dtype with the tiles of `cfg` (as `plan` gives; the
    benchmark also runs it at decode sizes, the path M <= 16 took before the GEMV)."""
    m, k = x2.shape
    n = qweight.shape[1]
    k_per_split = triton.cdiv(triton.cdiv(k, cfg["split_k"]), cfg["BLOCK_K"]) * cfg["BLOCK_K"]
    split_k = triton.cdiv(k, k_per_split)
    partial = split_k > 1
    out = torch.empty((split_k, m, n) if partial else (m, n), device=x2.device,
                      dtype=torch.float32 if partial else x2.dtype)
    grid = (triton.cdiv(m, cfg["BLOCK_M"]), triton.cdiv(n, cfg["BLOCK_N"]), split_k)
    _int4_matmul_kernel[grid](out, x2, qweight, scales, zeros, m, n, k, x2.stride(0), group_size, k_per_split,
                              BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"],
                              DOT_FP32=x2.dtype == torch.float32 or interpreting(), PARTIAL=partial)
    return out.sum(0).to(x2.dtype) if partial else out

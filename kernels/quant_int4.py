"""int4 weight-only matrix product on the engine's packed layout (see quant_reference.py): y = x @ W.

One kernel serves both shapes: each program owns a [BLOCK_M, BLOCK_N] tile of y and one of SPLIT_K slices of the
input dimension. Prefill-sized batches run it as a dequantizing GEMM (SPLIT_K = 1, tall M tiles); decode-sized
ones (M <= 16) as a split-K GEMV: a 16-row M tile, narrow N tiles, and the K dimension split only when the N
tiles alone cannot fill the GPU (partial sums in float32 reduced afterwards; without a split y is written
directly). A K tile never crosses a group, so each tile reads its
group's scales and zeros once ([BLOCK_N] each) and each packed word once per nibble row it holds.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from . import interpreting, sm_count


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


def _block_k(group_size: int) -> int:
    for block in (64, 32, 16):
        if group_size % block == 0:
            return block
    raise ValueError(f"int4 kernel: group size {group_size} is not a multiple of 16")


def plan(m: int, n: int, k: int, group_size: int, num_sms: int = 132) -> dict:
    """Tile sizes for one shape: the split-K GEMV for M <= 16, the GEMM above."""
    block_k = _block_k(group_size)
    if m <= 16:
        block_n = 16
        tiles = triton.cdiv(n, block_n)
        # No split when the output tiles fill every SM (then y is written directly: no extra launch); else
        # enough K slices for about two waves, each a whole number of K tiles.
        split_k = 1 if tiles >= num_sms else max(1, min(k // block_k, triton.cdiv(2 * num_sms, tiles)))
        return dict(BLOCK_M=16, BLOCK_N=block_n, BLOCK_K=block_k, split_k=split_k)
    return dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=block_k, split_k=1)


def int_weight_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                      group_size: int, bits: int = 4, bias: Optional[torch.Tensor] = None,
                      num_sms: Optional[int] = None) -> torch.Tensor:
    """x [M, K] @ W (+ bias) -> [M, N] in x's dtype; W in the packed int4 layout. Same contract as the reference."""
    if bits != 4:
        raise ValueError(f"the int4 kernel got {bits}-bit weights (only 4-bit has a kernel)")
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m, k = x2.shape
    n = qweight.shape[1]
    if num_sms is None:
        num_sms = sm_count(x.device.index) if x.is_cuda else 4
    cfg = plan(m, n, k, group_size, num_sms)
    k_per_split = triton.cdiv(triton.cdiv(k, cfg["split_k"]), cfg["BLOCK_K"]) * cfg["BLOCK_K"]
    split_k = triton.cdiv(k, k_per_split)
    partial = split_k > 1
    out = torch.empty((split_k, m, n) if partial else (m, n), device=x.device,
                      dtype=torch.float32 if partial else x.dtype)
    grid = (triton.cdiv(m, cfg["BLOCK_M"]), triton.cdiv(n, cfg["BLOCK_N"]), split_k)
    _int4_matmul_kernel[grid](out, x2, qweight, scales, zeros, m, n, k, x2.stride(0), group_size, k_per_split,
                              BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"],
                              DOT_FP32=x.dtype == torch.float32 or interpreting(), PARTIAL=partial)
    if partial:
        out = out.sum(0)
    if bias is not None:
        out = out.float() + bias.float()
    return out.to(x.dtype).reshape(*x.shape[:-1], n)

"""Decode GEMV for small batches (M <= 16): y = x @ (W * scale)^T (+ bias) with W [N, K] stored densely, in bf16 /
fp16 / fp32, or in FP8 e4m3 with one scale per output channel (weight-only: x stays in its dtype).

Each program owns BLOCK_N outputs of all M rows and one of SPLIT_K slices of K, streaming its [BLOCK_N, K_slice]
strip of W once. With enough output tiles to fill the GPU there is no split and the program writes y directly
(no workspace, no extra launch: at batch 1 every launch counts); otherwise float32 partial sums are reduced.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from . import interpreting, sm_count


@triton.jit
def _gemv_kernel(
    out_ptr,  # [M, N] in x's dtype (SPLIT_K == 1) or [SPLIT_K, M, N] float32 partial sums
    x_ptr,  # [M, K]
    w_ptr,  # [N, K]
    scale_ptr,  # [N] float32 (HAS_SCALE)
    bias_ptr,  # [N] (HAS_BIAS, SPLIT_K == 1 only)
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    k_per_split,
    HAS_SCALE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    PARTIAL: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_FP32: tl.constexpr,  # multiply in float32 (float32 inputs, or Triton's interpreter), else in x's dtype
):
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    rows = tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask, col_mask = rows < M, cols < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_start = pid_k * k_per_split
    for k0 in range(k_start, tl.minimum(k_start + k_per_split, K), BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < K
        x = tl.load(x_ptr + rows[:, None] * stride_xm + ks[None, :], mask=row_mask[:, None] & k_mask[None, :],
                    other=0.0)  # [BM, BK]
        w = tl.load(w_ptr + cols[None, :].to(tl.int64) * stride_wn + ks[:, None],
                    mask=k_mask[:, None] & col_mask[None, :], other=0.0)  # [BK, BN]: W^T's tile
        if DOT_FP32:
            acc += tl.dot(x.to(tl.float32), w.to(tl.float32), input_precision="ieee", out_dtype=tl.float32)
        else:
            acc += tl.dot(x, w.to(x_ptr.dtype.element_ty), out_dtype=tl.float32)
    if HAS_SCALE:
        acc = acc * tl.load(scale_ptr + cols, mask=col_mask, other=0.0)[None, :]
    mask = row_mask[:, None] & col_mask[None, :]
    if PARTIAL:
        tl.store(out_ptr + pid_k * M * N + rows[:, None] * N + cols[None, :], acc, mask=mask)
    else:
        if HAS_BIAS:
            acc = acc + tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + rows[:, None] * N + cols[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)


MAX_M = 16
BLOCK_N = 16


def split_k_for(n: int, k: int, num_sms: int, block_k: int = 128) -> int:
    """No split when the output tiles alone give every SM a program; else enough slices for about two waves."""
    tiles = triton.cdiv(n, BLOCK_N)
    if tiles >= num_sms:
        return 1
    return max(1, min(triton.cdiv(k, block_k), triton.cdiv(2 * num_sms, tiles)))


def dense_gemv(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
               w_scale: Optional[torch.Tensor] = None, num_sms: Optional[int] = None) -> torch.Tensor:
    """x [M, K] (M <= 16) @ (weight [N, K] * w_scale [N, 1] or [])^T (+ bias) -> [M, N] in x's dtype.
    Same contract as quant_reference.dense_gemv."""
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m, k = x2.shape
    n = weight.shape[0]
    if m > MAX_M:
        raise ValueError(f"dense_gemv takes at most {MAX_M} rows, got {m}")
    if num_sms is None:
        num_sms = sm_count(x.device.index) if x.is_cuda else 4
    block_k = 128 if k >= 128 else 32
    split_k = split_k_for(n, k, num_sms, block_k)
    k_per_split = triton.cdiv(triton.cdiv(k, split_k), block_k) * block_k
    split_k = triton.cdiv(k, k_per_split)
    partial = split_k > 1
    out = torch.empty((split_k, m, n) if partial else (m, n), device=x.device,
                      dtype=torch.float32 if partial else x.dtype)
    scale = None if w_scale is None else w_scale.float().reshape(-1).expand(n).contiguous()
    _gemv_kernel[(triton.cdiv(n, BLOCK_N), split_k)](
        out, x2, weight, scale if scale is not None else out, bias if bias is not None else out, m, n, k,
        x2.stride(0), weight.stride(0), k_per_split, HAS_SCALE=scale is not None,
        HAS_BIAS=bias is not None and not partial, PARTIAL=partial, BLOCK_M=MAX_M, BLOCK_N=BLOCK_N, BLOCK_K=block_k,
        DOT_FP32=x.dtype == torch.float32 or interpreting())
    if partial:
        out = out.sum(0)
        if bias is not None:
            out = out + bias.float()
        out = out.to(x.dtype)
    return out.reshape(*x.shape[:-1], n)

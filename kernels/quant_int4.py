"""int4 weight-only matrix product on the engine's packed layout (see quant_reference.py): y = x @ W.

Two paths by the number of rows M of x:
  M <= GEMV_MAX_M   the split-K GEMV of quant_gemv.py (`int4_gemv`): decode batches, memory-bound, each packed
                    weight read once (tl.dot tiles of 16 or 64 rows above M = 1);
  M >  GEMV_MAX_M   W dequantized into a [K, N] buffer of x's dtype (`dequantize`: one pass, 4 bits read and 16
                    written a weight) and multiplied by the library's GEMM (cuBLAS), as vLLM does for AWQ at large
                    batches. Run 84 (one H200, the 8B shapes, M = 16 ... 8,192) measured this against the Triton
                    GEMM that dequantized each weight once per 64-row tile of x inside its K loop (removed): faster
                    at every M, from 1.1x (gate_up, M = 32) to 7.4x (gate_up, M = 8,192); at M >= 2,048 at
                    0.9-1.0x the speed of cuBLAS on the bf16 weight. An 8B prefill step of 8,192 tokens in AWQ went
                    1,287 -> 207 ms (bf16: 206 ms). A fused int4 GEMM that beats this at mid-sized M is future work.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .quant_gemv import int4_gemv

# Decode batches up to this size take the split-K GEMV. Run 86 (one H200, 8B shapes), GEMV / dequantize + GEMM:
# 1.2-2x faster at M = 16; at M = 64 (64-row tiles) qkv 25.1 / 31.0 us, o 20.7 / 20.6, gate_up 81.7 / 144.3, down
# 52.2 / 78.3. quant_gemv.MAX_M bounds it.
GEMV_MAX_M = 64


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


def int_weight_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                      group_size: int, bits: int = 4, bias: Optional[torch.Tensor] = None,
                      num_sms: Optional[int] = None) -> torch.Tensor:
    """x [M, K] @ W (+ bias) -> [M, N] in x's dtype; W in the packed int4 layout. Same contract as the reference.
    The path follows M (module docstring): the GEMV, or dequantize + the library's GEMM."""
    if bits != 4:
        raise ValueError(f"the int4 kernel got {bits}-bit weights (only 4-bit has a kernel)")
    x2 = x.reshape(-1, x.shape[-1])
    if x2.shape[0] <= GEMV_MAX_M:
        return int4_gemv(x, qweight, scales, zeros, group_size, bias, num_sms)
    out = x2 @ dequantize(qweight, scales, zeros, group_size, x2.dtype)  # [M, K] @ [K, N]: the library's GEMM
    if bias is not None:
        out = (out.float() + bias.float()).to(x.dtype)
    return out.reshape(*x.shape[:-1], qweight.shape[1])

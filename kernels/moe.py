"""Fused mixture of experts: every token through its top-k gated-MLP experts, in a fixed number of launches.

One call (T tokens, K experts per token, E experts, N = T * K assignments, assignment i = (token i // K, its
(i % K)-th expert)):

    1. align_by_expert   the N assignments sorted by expert, each expert's run padded to a multiple of BLOCK_M:
                         sorted_ids [P] (value N marks padding) and the expert of every M-block, block_expert
                         [P / BLOCK_M] (-1 for blocks past the last expert's run). Torch ops, no host sync; P is
                         an upper bound known from the shapes alone, so the call is CUDA-graph capturable.
    2. grouped GEMM      gate_up [N, 2I] = x[token of each assignment] @ w13[expert]^T, one launch for all experts
    3. silu_and_mul      act [N, I]
    4. grouped GEMM      down [N, H] = act @ w2[expert]^T, times the assignment's routing weight in the epilogue
    5. sum over K        out [T, H]

Routing (`topk_softmax`: softmax, top-k, renormalisation) is one more launch.

Decode-sized batches (at most DECODE_MAX_TOKENS tokens) skip the grouping, whose dozen small launches would cost
more than the products at batch 1: each expert is then hit by about one assignment, so a matrix-vector program per
(assignment, column block) reads each routed expert's weights once, like the grouped GEMM, in two launches:

    1. gate_up_act       act [N, I] = silu(x @ w13[e, :I]^T) * (x @ w13[e, I:]^T), the activation in the epilogue
    2. down_reduce       out [T, H] = sum over the token's K assignments of weight * act @ w2[e]^T

Neither path ever launches one kernel per expert. Both match `reference.fused_moe`, including where it rounds to
the input dtype; tile sizes are fixed heuristics chosen from the number of assignments per expert.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from asyncengine.kernels import activation
from asyncengine.kernels.attention import _dot_f32, _precision


@dataclass(frozen=True)
class TileConfig:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


# Few assignments per expert: rows are mostly padding, so the smallest M tile tl.dot allows and wide K
# tiles that stream the expert's weights; many (prefill): large tiles that reuse each weight tile across rows.
# Chosen by a sweep on an H100 (bf16, GROUP_M 8; medians in ms, reference = one cuBLAS GEMM per expert):
#   Qwen3-30B-A3B T=512 / 4096: 128x128 1.04 / 1.55, 64x128 1.10 / 2.18 (reference 33.6 / 42.0)
#   Mixtral-8x7B  T=512 / 4096: 128x128 2.23 / 7.09, 128x256 2.01 / 6.65, 64x128 2.26 / 9.50 (reference 3.16 / 6.61)
SPARSE_TILES = TileConfig(block_m=16, block_n=64, block_k=128, num_warps=4, num_stages=4)
PREFILL_TILES = TileConfig(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=3)
DENSE_TILES = TileConfig(block_m=128, block_n=256, block_k=64, num_warps=8, num_stages=3)


# float32 tiles take twice the shared memory: the large bf16 ones do not fit (OutOfResources on an H100)
FLOAT32_PREFILL_TILES = TileConfig(block_m=64, block_n=128, block_k=64, num_warps=8, num_stages=3)


def tile_config(num_assignments: int, num_experts: int, element_size: int = 2) -> TileConfig:
    """Tiles for N assignments over E experts (host ints only, so the choice never syncs)."""
    if num_assignments <= 2 * num_experts:
        return SPARSE_TILES
    if element_size > 2:
        return FLOAT32_PREFILL_TILES
    return DENSE_TILES if num_assignments >= 512 * num_experts else PREFILL_TILES


def align_by_expert(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Group the assignments by expert, each group padded to a multiple of block_m.

    topk_ids: [T, K] int. Returns sorted_ids [P] int32 (assignment indices, grouped by expert in ascending order,
    stable within an expert; N = T * K in padding slots) and block_expert [P / block_m] int32 (the expert of each
    block of block_m rows, -1 for blocks after the last group). P = N + min(E, N) * (block_m - 1) rounded up to
    block_m: enough for any routing, known without reading topk_ids on the host.
    """
    flat = topk_ids.reshape(-1).long()  # [N]
    num = flat.numel()
    device = flat.device
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m  # [E]
    padded_end = padded.cumsum(0)  # [E] end of each expert's padded run
    padded_start = padded_end - padded
    order = torch.argsort(flat, stable=True)  # [N] assignments sorted by expert
    sorted_expert = flat[order]
    rank_in_expert = torch.arange(num, device=device) - (counts.cumsum(0) - counts)[sorted_expert]
    max_padded = triton.cdiv(num + min(num_experts, num) * (block_m - 1), block_m) * block_m
    sorted_ids = torch.full((max_padded,), num, dtype=torch.int32, device=device)
    sorted_ids[padded_start[sorted_expert] + rank_in_expert] = order.to(torch.int32)
    block_starts = torch.arange(0, max_padded, block_m, device=device)
    block_expert = torch.searchsorted(padded_end, block_starts, right=True)  # first expert whose run ends later
    block_expert = torch.where(block_expert < num_experts, block_expert, -1).to(torch.int32)
    return sorted_ids, block_expert


@triton.jit
def _grouped_gemm_kernel(
    a_ptr,  # [rows of A, K_DIM]: hidden [T, H] (A_ROW_DIV = top_k) or act [N, I] (A_ROW_DIV = 1)
    b_ptr,  # [E, N_OUT, K_DIM]: w13 or w2
    c_ptr,  # [N, N_OUT], row = assignment
    weights_ptr,  # [N] float32 routing weights (read when MUL_WEIGHT)
    sorted_ids_ptr,  # [P] int32
    block_expert_ptr,  # [P / BLOCK_M] int32
    num_m_blocks,  # P / BLOCK_M
    num_assignments,
    n_out,
    k_dim,
    stride_am,
    stride_be,
    stride_bn,
    stride_cm,
    A_ROW_DIV: tl.constexpr,
    MUL_WEIGHT: tl.constexpr,
    DOT_F32: tl.constexpr,  # upcast tiles to float32 before the product (interpreter, float32 inputs)
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    """One [BLOCK_M, BLOCK_N] tile of C: BLOCK_M assignments of one expert times that expert's weight columns."""
    # Programs run in groups of GROUP_M row blocks sweeping the columns together, so an expert's weight tile is
    # read from memory once per group and from L2 by the others (row-block-major order re-read each expert's whole
    # weight once per row block: 0.4x the reference at Mixtral's 4096-token prefill on an H100).
    pid = tl.program_id(0)
    num_n_blocks = tl.cdiv(n_out, BLOCK_N)
    programs_per_group = GROUP_M * num_n_blocks
    first_m = (pid // programs_per_group) * GROUP_M
    group_rows = tl.minimum(num_m_blocks - first_m, GROUP_M)
    pid_m = first_m + (pid % programs_per_group) % group_rows
    pid_n = (pid % programs_per_group) // group_rows
    expert = tl.load(block_expert_ptr + pid_m)
    if expert < 0:
        return
    assignment = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))  # [BLOCK_M]
    row_valid = assignment < num_assignments
    a_rows = (assignment // A_ROW_DIV).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_valid = cols < n_out
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + a_rows[:, None] * stride_am + ks[None, :]  # [BLOCK_M, BLOCK_K]
    b_ptrs = b_ptr + expert.to(tl.int64) * stride_be + cols[None, :].to(tl.int64) * stride_bn + ks[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k_start in range(0, k_dim, BLOCK_K):
        k_valid = ks < k_dim - k_start
        a = tl.load(a_ptrs, mask=row_valid[:, None] & k_valid[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_valid[:, None] & col_valid[None, :], other=0.0)  # [BLOCK_K, BLOCK_N]
        if DOT_F32:
            acc += tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision=PRECISION)
        else:
            acc += tl.dot(a, b)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    if MUL_WEIGHT:
        weight = tl.load(weights_ptr + assignment, mask=row_valid, other=0.0)
        acc = acc * weight[:, None]
    c_ptrs = c_ptr + assignment.to(tl.int64)[:, None] * stride_cm + cols[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=row_valid[:, None] & col_valid[None, :])


def _grouped_gemm(a, b, c, weights, sorted_ids, block_expert, a_row_div: int, tiles: TileConfig) -> None:
    """c[i] = a[i // a_row_div] @ b[expert of i]^T (* weights[i] when given), for every assignment i."""
    n_out, k_dim = b.shape[1], b.shape[2]
    grid = (block_expert.numel() * triton.cdiv(n_out, tiles.block_n),)
    _grouped_gemm_kernel[grid](
        a, b, c, weights if weights is not None else c, sorted_ids, block_expert, block_expert.numel(), c.shape[0],
        n_out, k_dim,
        a.stride(0), b.stride(0), b.stride(1), c.stride(0),
        A_ROW_DIV=a_row_div, MUL_WEIGHT=weights is not None, DOT_F32=_dot_f32(a), PRECISION=_precision(),
        BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, GROUP_M=8,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )  # fmt: skip


# -- routing --------------------------------------------------------------------------------------------------
@triton.jit
def _topk_softmax_kernel(
    logits_ptr,  # [T, E]
    weights_ptr,  # [T, TOP_K] float32
    ids_ptr,  # [T, TOP_K] int64
    num_experts,
    stride_logits,
    TOP_K: tl.constexpr,
    TOP_K_PAD: tl.constexpr,
    EXPERTS_PAD: tl.constexpr,
    RENORMALIZE: tl.constexpr,
):
    """One token: softmax over its experts in float32, then TOP_K rounds of argmax (the lowest index among ties)."""
    row = tl.program_id(0).to(tl.int64)
    experts = tl.arange(0, EXPERTS_PAD)
    valid = experts < num_experts
    x = tl.load(logits_ptr + row * stride_logits + experts, mask=valid, other=float("-inf")).to(tl.float32)
    p = tl.exp(x - tl.max(x, axis=0))
    p = tl.where(valid, p / tl.sum(p, axis=0), -1.0)  # -1: never chosen
    slots = tl.arange(0, TOP_K_PAD)
    top_weights = tl.zeros((TOP_K_PAD,), dtype=tl.float32)
    top_ids = tl.zeros((TOP_K_PAD,), dtype=tl.int64)
    for k in tl.static_range(TOP_K):
        best = tl.max(p, axis=0)
        chosen = tl.min(tl.where(p == best, experts, EXPERTS_PAD), axis=0)
        top_weights = tl.where(slots == k, best, top_weights)
        top_ids = tl.where(slots == k, chosen.to(tl.int64), top_ids)
        p = tl.where(experts == chosen, -1.0, p)
    if RENORMALIZE:
        top_weights = top_weights / tl.sum(top_weights, axis=0)
    out = slots < TOP_K
    tl.store(weights_ptr + row * TOP_K + slots, top_weights, mask=out)
    tl.store(ids_ptr + row * TOP_K + slots, top_ids, mask=out)


def topk_softmax(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] -> (weights [T, K] float32, ids [T, K] int64), in one launch. As the reference, except
    that among tied probabilities the lowest expert index is chosen first (torch.topk leaves that unspecified)."""
    if router_logits.dim() != 2 or router_logits.stride(1) != 1:
        raise ValueError(f"router_logits must be [T, E] with contiguous rows, got {tuple(router_logits.shape)}")
    tokens, num_experts = router_logits.shape
    if not 0 < top_k <= num_experts:
        raise ValueError(f"top_k {top_k} must be in [1, {num_experts}]")
    weights = torch.empty((tokens, top_k), dtype=torch.float32, device=router_logits.device)
    ids = torch.empty((tokens, top_k), dtype=torch.int64, device=router_logits.device)
    if tokens:
        _topk_softmax_kernel[(tokens,)](
            router_logits, weights, ids, num_experts, router_logits.stride(0), TOP_K=top_k,
            TOP_K_PAD=triton.next_power_of_2(top_k), EXPERTS_PAD=triton.next_power_of_2(num_experts),
            RENORMALIZE=renormalize, num_warps=1 if num_experts <= 256 else 4,
        )  # fmt: skip
    return weights, ids


# -- decode-sized batches: no grouping ----------------------------------------------------------------------------
DECODE_MAX_TOKENS = 16
DECODE_BLOCK_N, DECODE_BLOCK_K = 16, 256


@triton.jit
def _gate_up_act_kernel(
    x_ptr,  # [T, H]
    w13_ptr,  # [E, 2I, H]
    ids_ptr,  # [N] expert of each assignment (topk_ids flattened)
    act_ptr,  # [N, I]
    hidden_size,
    inter,
    stride_x,
    stride_we,
    stride_wn,
    stride_act,
    TOP_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """act[i, cols] for assignment i = (token i // TOP_K, expert ids[i]) and one block of intermediate columns."""
    assignment = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_valid = cols < inter
    expert = tl.load(ids_ptr + assignment).to(tl.int64)
    x_row = x_ptr + (assignment // TOP_K).to(tl.int64) * stride_x
    gate_rows = w13_ptr + expert * stride_we + cols.to(tl.int64)[:, None] * stride_wn  # [BLOCK_N, 1]
    up_rows = gate_rows + inter * stride_wn
    gate = tl.zeros((BLOCK_N,), dtype=tl.float32)
    up = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k_start in range(0, hidden_size, BLOCK_K):
        ks = k_start + tl.arange(0, BLOCK_K)
        k_valid = ks < hidden_size
        x = tl.load(x_row + ks, mask=k_valid, other=0.0).to(tl.float32)[None, :]
        mask = col_valid[:, None] & k_valid[None, :]
        gate += tl.sum(tl.load(gate_rows + ks[None, :], mask=mask, other=0.0).to(tl.float32) * x, axis=1)
        up += tl.sum(tl.load(up_rows + ks[None, :], mask=mask, other=0.0).to(tl.float32) * x, axis=1)
    # Rounded where the reference rounds: the projections' outputs, then silu(gate) (as activation.silu_and_mul).
    dtype = act_ptr.dtype.element_ty
    gate = gate.to(dtype).to(tl.float32)
    up = up.to(dtype).to(tl.float32)
    silu = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    tl.store(act_ptr + assignment.to(tl.int64) * stride_act + cols, (silu * up).to(dtype), mask=col_valid)


@triton.jit
def _down_reduce_kernel(
    act_ptr,  # [N, I]
    w2_ptr,  # [E, H, I]
    ids_ptr,  # [N]
    weights_ptr,  # [N] float32
    out_ptr,  # [T, H]
    hidden_size,
    inter,
    stride_act,
    stride_we,
    stride_wn,
    stride_out,
    TOP_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """out[t, cols] = sum over k of weight[t, k] * (act[t * TOP_K + k] @ w2[ids[t, k]]^T)[cols]."""
    token = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_valid = cols < hidden_size
    total = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k in tl.static_range(TOP_K):
        assignment = token * TOP_K + k
        expert = tl.load(ids_ptr + assignment).to(tl.int64)
        rows = w2_ptr + expert * stride_we + cols.to(tl.int64)[:, None] * stride_wn  # [BLOCK_N, 1]
        act_row = act_ptr + assignment.to(tl.int64) * stride_act
        part = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for j_start in range(0, inter, BLOCK_K):
            js = j_start + tl.arange(0, BLOCK_K)
            j_valid = js < inter
            a = tl.load(act_row + js, mask=j_valid, other=0.0).to(tl.float32)[None, :]
            w = tl.load(rows + js[None, :], mask=col_valid[:, None] & j_valid[None, :], other=0.0).to(tl.float32)
            part += tl.sum(w * a, axis=1)
        # the expert's output rounds to the dtype (as the reference's projection), then weighs in float32
        total += part.to(out_ptr.dtype.element_ty).to(tl.float32) * tl.load(weights_ptr + assignment)
    tl.store(out_ptr + token.to(tl.int64) * stride_out + cols, total.to(out_ptr.dtype.element_ty), mask=col_valid)


def _fused_moe_decode(hidden, w13, w2, weights, ids, top_k: int) -> torch.Tensor:
    """weights, ids: [N] flattened routing. Two launches whatever the routing."""
    tokens, size = hidden.shape
    num, inter = ids.numel(), w2.shape[2]
    act = torch.empty((num, inter), dtype=hidden.dtype, device=hidden.device)
    _gate_up_act_kernel[(num, triton.cdiv(inter, DECODE_BLOCK_N))](
        hidden, w13, ids, act, size, inter, hidden.stride(0), w13.stride(0), w13.stride(1), act.stride(0),
        TOP_K=top_k, BLOCK_N=DECODE_BLOCK_N, BLOCK_K=DECODE_BLOCK_K, num_warps=4,
    )  # fmt: skip
    out = torch.empty((tokens, size), dtype=hidden.dtype, device=hidden.device)
    _down_reduce_kernel[(tokens, triton.cdiv(size, DECODE_BLOCK_N))](
        act, w2, ids, weights, out, size, inter, act.stride(0), w2.stride(0), w2.stride(1), out.stride(0),
        TOP_K=top_k, BLOCK_N=DECODE_BLOCK_N, BLOCK_K=DECODE_BLOCK_K, num_warps=4,
    )  # fmt: skip
    return out


def _check_inputs(hidden, w13, w2, topk_weights, topk_ids) -> None:
    if hidden.dim() != 2 or w13.dim() != 3 or w2.dim() != 3:
        raise ValueError("hidden must be [T, H], w13 [E, 2I, H] and w2 [E, H, I]")
    experts, two_inter, size = w13.shape
    if size != hidden.shape[1] or two_inter % 2 or w2.shape != (experts, size, two_inter // 2):
        raise ValueError(f"expert weights {tuple(w13.shape)} / {tuple(w2.shape)} do not fit hidden "
                         f"{tuple(hidden.shape)}: need w13 [E, 2I, H] and w2 [E, H, I]")  # fmt: skip
    if topk_ids.dim() != 2 or topk_weights.shape != topk_ids.shape or topk_ids.shape[0] != hidden.shape[0]:
        raise ValueError("topk_weights and topk_ids must both be [T, K] for hidden [T, H]")
    contiguous = hidden.stride(1) == 1 and w13.stride(2) == 1 and w2.stride(2) == 1
    if not contiguous or not w13.dtype == hidden.dtype == w2.dtype:
        raise ValueError("hidden and the expert weights need contiguous last dimensions and one dtype")


def fused_moe(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
    """hidden [T, H], w13 [E, 2I, H] ([gate | up]), w2 [E, H, I], topk_weights / topk_ids [T, K] -> new [T, H]."""
    _check_inputs(hidden, w13, w2, topk_weights, topk_ids)
    tokens, top_k = topk_ids.shape
    num_experts, inter, size = w13.shape[0], w13.shape[1] // 2, w13.shape[2]
    num = tokens * top_k
    if tokens == 0:
        return torch.empty((0, size), dtype=hidden.dtype, device=hidden.device)
    weights = topk_weights.reshape(-1).float().contiguous()  # [N]
    if tokens <= DECODE_MAX_TOKENS:
        return _fused_moe_decode(hidden, w13, w2, weights, topk_ids.reshape(-1).contiguous(), top_k)
    tiles = tile_config(num, num_experts, hidden.element_size())
    sorted_ids, block_expert = align_by_expert(topk_ids, num_experts, tiles.block_m)
    gate_up = torch.empty((num, 2 * inter), dtype=hidden.dtype, device=hidden.device)
    _grouped_gemm(hidden, w13, gate_up, None, sorted_ids, block_expert, top_k, tiles)
    act = activation.silu_and_mul(gate_up)  # [N, I]
    down = torch.empty((num, size), dtype=hidden.dtype, device=hidden.device)
    _grouped_gemm(act, w2, down, weights, sorted_ids, block_expert, 1, tiles)
    return down.view(tokens, top_k, size).sum(dim=1)  # [T, H]; sum accumulates in float32, rounds once

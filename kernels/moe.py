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

Routing: `topk_softmax` (softmax, top-k, renormalisation of given logits) is one launch; `route` also does the
router product, in one launch at decode sizes: programs split over experts and K store partial logits, and the
last to arrive sums them (a fixed order), rounds them as the reference does and routes every token.

Decode-sized batches (at most DECODE_MAX_TOKENS tokens) skip the grouping, whose dozen small launches would cost
more than the products at batch 1: each expert is then hit by about one assignment, so matrix-vector programs
read each routed expert's weights once, like the grouped GEMM, in two launches:

    1. gate_up_act       act [N, I] = silu(x @ w13[e, :I]^T) * (x @ w13[e, I:]^T), the activation in the epilogue;
                         one program per (assignment, block of I)
    2. down_reduce       out [T, H] = sum over the token's K assignments of weight * act @ w2[e]^T; one program per
                         (assignment, block of H) stores its weighted part in float32, and the last of a token's K
                         programs to arrive on a column block sums the K parts in the order k = 0 .. K - 1

At batch 1 of Qwen3-30B-A3B (8 assignments, H 2048, I 768) that is N * I / BLOCK_N and N * H / BLOCK_N programs,
enough for every SM, where one program per (token, column block) gave down_reduce only H / BLOCK_N. The arrival
counters (`counters`) are zero before and after every call, so the path is
CUDA-graph capturable; calls must not overlap on two streams. Tiles per shape and batch bucket come from
moe_configs.TUNED (`python -m loadtest.bench_kernels --moe-sweep`), else `default_decode_config`; a tile with
load_ahead issues each loop step's weight loads one step early (the same sums, in the same order).

Neither path ever launches one kernel per expert. Both match `reference.fused_moe`, including where it rounds to
the input dtype; the grouped GEMMs' tile sizes are fixed heuristics chosen from the number of assignments per
expert.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from asyncengine.kernels import activation, arrival_counters, interpreting, sm_count
from asyncengine.kernels.attention import _dot_f32, _precision
from asyncengine.kernels.pdl import enabled as pdl_enabled, wait_for_prior_grids
from asyncengine.kernels.quant_gemv import (_half_fma_word_sums, _int4_centered, _x_half_pairs, _x_words,
                                            codes_minus_zero, group_scale, half_fma_ok)


COUNTER_SLOTS = 1 << 14  # route's one counter, or down_reduce's T * cdiv(H, BLOCK_N)


def counters(device: torch.device) -> torch.Tensor:
    """The arrival counters of route and down_reduce (`kernels.arrival_counters`): their calls run one after
    another on one stream, and each leaves the counters it used at zero."""
    return arrival_counters("the fused MoE", device, COUNTER_SLOTS)


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
    scale_ptr,  # [E, G, N_OUT] group scales of an FP8 b (float32) or an int4 b (a's dtype)
    zero_ptr,  # [E, G, N_OUT] zero points of an int4 b, in its scales' dtype (read when INT4)
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
    stride_se,  # scale_ptr's expert stride
    group_size,  # inputs per scale group (GROUP_SCALE; a multiple of BLOCK_K)
    A_ROW_DIV: tl.constexpr,
    MUL_WEIGHT: tl.constexpr,
    DOT_F32: tl.constexpr,  # upcast tiles to float32 before the product (interpreter, float32 inputs)
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    GROUP_SCALE: tl.constexpr,  # b in FP8 e4m3 with group scales: each K tile's product times its group's scales
    INT4: tl.constexpr,  # b packed int4 [E, N_OUT, K_DIM / 8] int32: each tile dequantized before its product
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
    b_cols = b_ptr + expert.to(tl.int64) * stride_be + cols[None, :].to(tl.int64) * stride_bn  # [1, BLOCK_N]
    b_ptrs = b_cols + ks[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k_start in range(0, k_dim, BLOCK_K):
        k_valid = ks < k_dim - k_start
        a = tl.load(a_ptrs, mask=row_valid[:, None] & k_valid[None, :], other=0.0)
        if INT4:  # dequantized as the reference's weight, in a's dtype
            b = _int4_tile(b_cols, k_start, k_dim, cols, col_valid, scale_ptr + expert.to(tl.int64) * stride_se,
                           zero_ptr + expert.to(tl.int64) * stride_se, group_size, n_out, BLOCK_K,
                           BLOCK_N).to(a.dtype)
        else:
            b = tl.load(b_ptrs, mask=k_valid[:, None] & col_valid[None, :], other=0.0)  # [BLOCK_K, BLOCK_N]
        if DOT_F32:
            part = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision=PRECISION)
        else:
            part = tl.dot(a, b.to(a.dtype))  # e4m3 -> bf16 / fp16 exactly; a no-op for weights in a's dtype
        if GROUP_SCALE:  # a K tile lies in one group
            part = part * group_scale(scale_ptr + expert.to(tl.int64) * stride_se, k_start, cols, col_valid, n_out,
                                      group_size)[None, :]
        acc += part
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    if MUL_WEIGHT:
        weight = tl.load(weights_ptr + assignment, mask=row_valid, other=0.0)
        acc = acc * weight[:, None]
    c_ptrs = c_ptr + assignment.to(tl.int64)[:, None] * stride_cm + cols[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=row_valid[:, None] & col_valid[None, :])


def _grouped_gemm(a, b, c, weights, sorted_ids, block_expert, a_row_div: int, tiles: TileConfig,
                  scales: Optional[torch.Tensor] = None, group_size: int = 0,
                  zeros: Optional[torch.Tensor] = None) -> None:
    """c[i] = a[i // a_row_div] @ b[expert of i]^T (* weights[i] when given), for every assignment i; b in FP8
    with group scales [E, G, N_OUT] when `scales` is given, or packed int4 (int32 [E, N_OUT, K / 8]) with scales
    and `zeros`."""
    int4 = b.dtype == torch.int32
    _, n_out, k_dim = _logical_shape(b)
    grid = (block_expert.numel() * triton.cdiv(n_out, tiles.block_n),)
    _grouped_gemm_kernel[grid](
        a, b, c, weights if weights is not None else c, scales if scales is not None else c,
        zeros if zeros is not None else c, sorted_ids, block_expert, block_expert.numel(), c.shape[0], n_out, k_dim,
        a.stride(0), b.stride(0), b.stride(1), c.stride(0), scales.stride(0) if scales is not None else 0,
        group_size or 1,
        A_ROW_DIV=a_row_div, MUL_WEIGHT=weights is not None, DOT_F32=_dot_f32(a), PRECISION=_precision(),
        BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=_within_group(tiles.block_k, group_size), GROUP_M=8,
        GROUP_SCALE=scales is not None and not int4, INT4=int4, num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
    )  # fmt: skip


def _within_group(block_k: int, group_size: int) -> int:
    """The largest K tile up to block_k that divides group_size (so a tile never crosses a scale group; 0: no
    groups)."""
    while group_size and group_size % block_k:
        block_k //= 2
    return block_k


# -- routing --------------------------------------------------------------------------------------------------
@triton.jit
def _softmax_topk(logits, valid, experts, TOP_K: tl.constexpr, TOP_K_PAD: tl.constexpr,
                  EXPERTS_PAD: tl.constexpr, RENORMALIZE: tl.constexpr):
    """logits [R, EXPERTS_PAD] float32 (any finite value where not `valid`), experts [1, EXPERTS_PAD] their
    indices -> (weights [R, TOP_K_PAD] float32, ids [R, TOP_K_PAD] int64): softmax over the valid experts, then
    TOP_K rounds of argmax (the lowest index among ties), renormalised to sum to one when asked."""
    x = tl.where(valid, logits, float("-inf"))
    p = tl.exp(x - tl.max(x, axis=1)[:, None])
    p = p / tl.sum(p, axis=1)[:, None]  # [R, EXPERTS_PAD], 0 where not valid
    # One reduction per round instead of two (max, then the lowest index holding it): a probability >= 0 orders
    # like its float32 bits read as an integer, so key = bits << 32 | (EXPERTS_PAD - 1 - index) is largest for the
    # largest probability and, among equal ones, the lowest index. -1 (below every key) marks the unavailable.
    keys = (p.to(tl.int32, bitcast=True).to(tl.int64) << 32) | (EXPERTS_PAD - 1 - experts).to(tl.int64)
    keys = tl.where(valid, keys, -1)
    slots = tl.arange(0, TOP_K_PAD)[None, :]
    top_weights = tl.zeros((logits.shape[0], TOP_K_PAD), dtype=tl.float32)
    top_ids = tl.zeros((logits.shape[0], TOP_K_PAD), dtype=tl.int64)
    for k in tl.static_range(TOP_K):
        best = tl.max(keys, axis=1)[:, None]  # [R, 1]
        weight = (best >> 32).to(tl.int32).to(tl.float32, bitcast=True)
        top_weights = tl.where(slots == k, weight, top_weights)
        top_ids = tl.where(slots == k, EXPERTS_PAD - 1 - (best & 0x7FFFFFFF), top_ids)
        keys = tl.where(keys == best, -1, keys)
    if RENORMALIZE:
        top_weights = top_weights / tl.sum(top_weights, axis=1)[:, None]
    return top_weights, top_ids


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
    """One token: softmax over its experts in float32, then its top TOP_K (`_softmax_topk`)."""
    row = tl.program_id(0).to(tl.int64)
    experts = tl.arange(0, EXPERTS_PAD)[None, :]  # [1, EXPERTS_PAD]
    valid = experts < num_experts
    x = tl.load(logits_ptr + row * stride_logits + experts, mask=valid, other=0.0).to(tl.float32)
    top_weights, top_ids = _softmax_topk(x, valid, experts, TOP_K, TOP_K_PAD, EXPERTS_PAD, RENORMALIZE)
    slots = tl.arange(0, TOP_K_PAD)[None, :]
    out = slots < TOP_K
    tl.store(weights_ptr + row * TOP_K + slots, top_weights, mask=out)
    tl.store(ids_ptr + row * TOP_K + slots, top_ids, mask=out)


def _check_top_k(num_experts: int, top_k: int) -> None:
    if not 0 < top_k <= num_experts:
        raise ValueError(f"top_k {top_k} must be in [1, {num_experts}]")


def topk_softmax(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] -> (weights [T, K] float32, ids [T, K] int64), in one launch. As the reference, except
    that among tied probabilities the lowest expert index is chosen first (torch.topk leaves that unspecified)."""
    if router_logits.dim() != 2 or router_logits.stride(1) != 1:
        raise ValueError(f"router_logits must be [T, E] with contiguous rows, got {tuple(router_logits.shape)}")
    tokens, num_experts = router_logits.shape
    _check_top_k(num_experts, top_k)
    weights = torch.empty((tokens, top_k), dtype=torch.float32, device=router_logits.device)
    ids = torch.empty((tokens, top_k), dtype=torch.int64, device=router_logits.device)
    if tokens:
        _topk_softmax_kernel[(tokens,)](
            router_logits, weights, ids, num_experts, router_logits.stride(0), TOP_K=top_k,
            TOP_K_PAD=triton.next_power_of_2(top_k), EXPERTS_PAD=triton.next_power_of_2(num_experts),
            RENORMALIZE=renormalize, num_warps=1 if num_experts <= 256 else 4,
        )  # fmt: skip
    return weights, ids


@triton.jit
def _router_tile(gate_cols, k_start, k_end, expert_valid, BLOCK_K: tl.constexpr):
    """gate_cols: [1, BLOCK_E] pointers to router rows -> their [BLOCK_K, BLOCK_E] tile at inputs k_start ...
    (zeros from k_end on and for experts past the last)."""
    ks = k_start + tl.arange(0, BLOCK_K)
    return tl.load(gate_cols + ks[:, None], mask=(ks < k_end)[:, None] & expert_valid[None, :], other=0.0)


ROUTE_BLOCK_E, ROUTE_BLOCK_K = 16, 128
ROUTE_MAX_EXPERTS = 512  # the last program holds [16, experts] float32 tiles in registers


@triton.jit
def _route_kernel(
    x_ptr,  # [T, H]
    gate_ptr,  # [E, H]
    partial_ptr,  # [split, T, E] float32 workspace: each K slice's logits
    counter_ptr,  # [1] int32 arrival counter, zero before and after every call
    weights_ptr,  # [T, TOP_K] float32
    ids_ptr,  # [T, TOP_K] int64
    tokens,
    hidden_size,
    num_experts,
    stride_x,
    stride_gate,
    k_per_split,
    SPLIT: tl.constexpr,  # K slices (the grid's second axis)
    TOP_K: tl.constexpr,
    TOP_K_PAD: tl.constexpr,
    EXPERTS_PAD: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    DOT_F32: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_T: tl.constexpr,  # 16: the tl.dot tile's rows, tokens beyond T masked
    ROUTE_T: tl.constexpr,  # T rounded up to a power of two: the rows the last program routes
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_PDL: tl.constexpr,  # launched with PDL (kernels/pdl.py): waits first, it reads x
):
    """Program (e, s): the logits of experts e * BLOCK_E ... for every token over K slice s, into the workspace.
    The last program of the grid to arrive sums the slices in the order s = 0 .. SPLIT - 1, rounds the logits to
    x's dtype (where the reference's router product rounds), routes every token (`_softmax_topk`) and resets the
    counter. The sum order depends on the shapes alone, so a token's routing does not depend on the batch."""
    pid_e, pid_s = tl.program_id(0), tl.program_id(1)
    rows = tl.arange(0, BLOCK_T)
    row_valid = rows < tokens
    experts = pid_e * BLOCK_E + tl.arange(0, BLOCK_E)
    expert_valid = experts < num_experts
    gate_cols = gate_ptr + experts.to(tl.int64)[None, :] * stride_gate  # [1, BLOCK_E]
    k_first = pid_s * k_per_split
    k_end = tl.minimum(k_first + k_per_split, hidden_size)
    # No kernel writes the router's weight (kernels/pdl.py rule 1): the slice's first tile is loaded before the
    # wait, off the critical path (at Qwen3-30B-A3B's shape half the slice), and each step loads the next tile
    # before its product (the last step's load is all masked: no memory traffic).
    w = _router_tile(gate_cols, k_first, k_end, expert_valid, BLOCK_K)
    wait_for_prior_grids(USE_PDL)
    acc = tl.zeros((BLOCK_T, BLOCK_E), dtype=tl.float32)
    for k_start in range(k_first, k_end, BLOCK_K):
        ks = k_start + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + rows[:, None] * stride_x + ks[None, :],
                    mask=row_valid[:, None] & (ks < k_end)[None, :], other=0.0)  # [BLOCK_T, BLOCK_K]
        next_w = _router_tile(gate_cols, k_start + BLOCK_K, k_end, expert_valid, BLOCK_K)
        if DOT_F32:
            acc += tl.dot(x.to(tl.float32), w.to(tl.float32), input_precision=PRECISION)
        else:
            acc += tl.dot(x, w)
        w = next_w
    slice_rows = partial_ptr + pid_s * tokens * num_experts + rows[:, None] * num_experts  # [BLOCK_T, 1]
    tl.store(slice_rows + experts[None, :], acc,
             mask=row_valid[:, None] & expert_valid[None, :])
    tl.debug_barrier()  # every thread's logits stored before the (release) atomic below
    arrived = tl.atomic_add(counter_ptr, 1, sem="acq_rel")
    if arrived == tl.num_programs(0) * tl.num_programs(1) - 1:  # every slice of every expert block is stored
        # [ROUTE_T, EXPERTS_PAD] tiles: the top-k rounds' reductions cost per row held, so no 16-row padding
        token_rows = tl.arange(0, ROUTE_T)
        token_valid = token_rows < tokens
        all_experts = tl.arange(0, EXPERTS_PAD)[None, :]  # [1, EXPERTS_PAD]
        valid = token_valid[:, None] & (all_experts < num_experts)
        slices = partial_ptr + token_rows[:, None] * num_experts + all_experts
        total = tl.zeros((ROUTE_T, EXPERTS_PAD), dtype=tl.float32)
        for s in tl.static_range(SPLIT):  # unrolled: the loads are independent, so one L2 round trip, not SPLIT
            total += tl.load(slices + s * tokens * num_experts, mask=valid, other=0.0, cache_modifier=".cg")
        logits = total.to(x_ptr.dtype.element_ty).to(tl.float32)
        top_weights, top_ids = _softmax_topk(logits, all_experts < num_experts, all_experts, TOP_K, TOP_K_PAD,
                                             EXPERTS_PAD, RENORMALIZE)
        slots = tl.arange(0, TOP_K_PAD)[None, :]
        out = token_valid[:, None] & (slots < TOP_K)
        tl.store(weights_ptr + token_rows[:, None] * TOP_K + slots, top_weights, mask=out)
        tl.store(ids_ptr + token_rows[:, None] * TOP_K + slots, top_ids, mask=out)
        tl.atomic_xchg(counter_ptr, 0)


# The last program sums this many slices, in one round trip (128 atomics on one counter cost ~0.1 us). At
# Qwen3-30B-A3B's shape 16 slices of one 128-wide tile each: a program's whole slice of the router is loaded
# before its PDL wait, so after it only x is read (with 8, the second tile came from memory after the wait).
ROUTE_MAX_SPLIT = 16


def route_split(hidden_size: int, num_experts: int, num_sms: int) -> int:
    """K slices of the fused router: up to ROUTE_MAX_SPLIT and about one program per SM, whole K tiles each (host
    ints only, none of them the batch size: a token's logits are summed in the same order whatever the batch)."""
    blocks = triton.cdiv(num_experts, ROUTE_BLOCK_E)
    return max(1, min(triton.cdiv(hidden_size, ROUTE_BLOCK_K), num_sms // blocks, ROUTE_MAX_SPLIT))


def route(hidden: torch.Tensor, gate_weight: torch.Tensor, top_k: int, renormalize: bool,
          num_sms: Optional[int] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The router and the routing: hidden [T, H] @ gate_weight [E, H]^T -> logits [T, E] (rounded to hidden's
    dtype), then softmax, top-k and renormalisation as `topk_softmax` -> (weights [T, K] float32, ids [T, K]
    int64). As reference.route, ties to the lowest expert. Decode-sized batches (up to DECODE_MAX_TOKENS tokens)
    take one launch (`_route_kernel`, split over experts and K); larger ones the library's product, then
    topk_softmax. num_sms: the SMs the split is sized for (default: the device's)."""
    if hidden.dim() != 2 or gate_weight.dim() != 2 or gate_weight.shape[1] != hidden.shape[1]:
        raise ValueError(f"route: hidden must be [T, H] and gate_weight [E, H], got {tuple(hidden.shape)} and "
                         f"{tuple(gate_weight.shape)}")  # fmt: skip
    tokens, num_experts = hidden.shape[0], gate_weight.shape[0]
    _check_top_k(num_experts, top_k)
    fused = 0 < tokens <= DECODE_MAX_TOKENS and num_experts <= ROUTE_MAX_EXPERTS
    if not fused or hidden.stride(1) != 1 or gate_weight.stride(1) != 1 or gate_weight.dtype != hidden.dtype:
        return topk_softmax(F.linear(hidden, gate_weight), top_k, renormalize)
    if num_sms is None:
        num_sms = sm_count(hidden.device.index) if hidden.is_cuda else 4
    size = hidden.shape[1]
    split = route_split(size, num_experts, num_sms)
    k_per_split = triton.cdiv(triton.cdiv(size, split), ROUTE_BLOCK_K) * ROUTE_BLOCK_K
    split = triton.cdiv(size, k_per_split)  # the slices that really hold inputs
    arrivals = counters(hidden.device)  # before anything is launched: it may refuse under capture
    pdl = pdl_enabled(hidden.device)
    partial = torch.empty((split, tokens, num_experts), dtype=torch.float32, device=hidden.device)
    weights = torch.empty((tokens, top_k), dtype=torch.float32, device=hidden.device)
    ids = torch.empty((tokens, top_k), dtype=torch.int64, device=hidden.device)
    # One warp: the last program's reductions then stay within it (shuffles, no shared-memory round trips); with
    # [16, 128] x [128, 16] tiles it needs 164 registers at T = 1 and spills nothing (sm_90, Triton 3.7), where
    # 256-wide tiles spilled.
    _route_kernel[(triton.cdiv(num_experts, ROUTE_BLOCK_E), split)](
        hidden, gate_weight, partial, arrivals, weights, ids, tokens, size, num_experts, hidden.stride(0),
        gate_weight.stride(0), k_per_split, SPLIT=split, TOP_K=top_k, TOP_K_PAD=triton.next_power_of_2(top_k),
        EXPERTS_PAD=triton.next_power_of_2(num_experts), RENORMALIZE=renormalize, DOT_F32=_dot_f32(hidden),
        PRECISION=_precision(), BLOCK_T=16, ROUTE_T=triton.next_power_of_2(tokens), BLOCK_E=ROUTE_BLOCK_E,
        BLOCK_K=ROUTE_BLOCK_K, USE_PDL=pdl, num_warps=1, launch_pdl=pdl,
    )  # fmt: skip
    return weights, ids


# -- decode-sized batches: no grouping ----------------------------------------------------------------------------
DECODE_MAX_TOKENS = 16


@dataclass(frozen=True)
class GemvTiles:
    """One decode kernel's launch: BLOCK_N output columns per program, BLOCK_K inputs per loop step."""

    block_n: int
    block_k: int
    num_warps: int = 4
    load_ahead: bool = False  # each loop step issues the next step's weight loads before its own math
    half_fma: bool = False  # int4 experts with bf16 x on CUDA: each word's 8 products summed in bf16x2

    def __post_init__(self):
        for name in ("block_n", "block_k", "num_warps"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise ValueError(f"GemvTiles.{name} must be a power of two, got {value}")


@dataclass(frozen=True)
class DecodeConfig:
    """The decode path's two launches: gate_up_act's and down_reduce's tiles."""

    gate_up: GemvTiles
    down: GemvTiles


def tokens_bucket(tokens: int) -> int:
    """The config table's batch key: the next power of two (1, 2, 4, 8, 16)."""
    return triton.next_power_of_2(tokens)


def default_decode_config(hidden_size: int, inter: int, top_k: int, tokens: int) -> DecodeConfig:
    """Untuned tiles: narrow column blocks, so that even one token's few assignments give every SM programs
    (gate_up_act: N * I / 16 programs; down_reduce: N * H / 32)."""
    return DecodeConfig(GemvTiles(16, 256, 4), GemvTiles(32, 256, 4))


def decode_config(hidden_size: int, inter: int, top_k: int, tokens: int, int4: bool = False) -> DecodeConfig:
    """The tuned config of this expert shape and batch bucket (moe_configs.TUNED, or TUNED_INT4 for int4 experts),
    else the default. Int4 experts without a row of their own take the bf16 row's tiles with `_int4_block_k`."""
    from .moe_configs import TUNED, TUNED_INT4

    key = (hidden_size, inter, top_k, tokens_bucket(tokens))
    if int4 and key in TUNED_INT4:
        return TUNED_INT4[key]
    config = TUNED.get(key) or default_decode_config(hidden_size, inter, top_k, tokens)
    if not int4:
        return config
    up, down = config.gate_up, config.down
    return DecodeConfig(GemvTiles(up.block_n, _int4_block_k(up, hidden_size), up.num_warps),
                        GemvTiles(down.block_n, _int4_block_k(down, inter), down.num_warps))


@triton.jit
def _weight_tile(rows, k_start, k_dim, row_valid, BLOCK_K: tl.constexpr):
    """rows: [BLOCK_N, 1] pointers to weight rows -> their [BLOCK_N, BLOCK_K] tile at inputs k_start ... (zeros
    past k_dim or outside the valid rows), in the weight's dtype."""
    ks = k_start + tl.arange(0, BLOCK_K)
    return tl.load(rows + ks[None, :], mask=row_valid[:, None] & (ks < k_dim)[None, :], other=0.0)


@triton.jit
def _int4_tile(col_words, k_start, k_dim, cols, col_valid, expert_scales, expert_zeros, group_size, n_out,
               BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """The grouped GEMM's int4 weight tile [BLOCK_K, BLOCK_N] at inputs k_start ... in float32: (q - zero) * scale
    with its group's scales and zero points ([G, n_out] of the expert; the tile lies in one group). col_words:
    [1, BLOCK_N] pointers to the columns' packed rows (8 inputs a word). Whole words are loaded [BLOCK_K / 8,
    BLOCK_N] and unpacked in registers ([BLOCK_K / 8, 8, BLOCK_N], then rows 8 w + j), so no word is loaded twice;
    q - z is made exactly without an int-to-float conversion (quant_gemv.codes_minus_zero)."""
    word = k_start // 8 + tl.arange(0, BLOCK_K // 8)  # [BLOCK_K / 8]
    words = tl.load(col_words + word[:, None], mask=(word * 8 < k_dim)[:, None] & col_valid[None, :], other=0)
    nibbles = tl.arange(0, 8)
    q = (words[:, None, :] >> (nibbles * 4)[None, :, None]) & 0xF  # [BLOCK_K / 8, 8, BLOCK_N]
    scale = group_scale(expert_scales, k_start, cols, col_valid, n_out, group_size).to(tl.float32)
    zero = group_scale(expert_zeros, k_start, cols, col_valid, n_out, group_size).to(tl.float32)
    return codes_minus_zero(tl.reshape(q, (BLOCK_K, BLOCK_N)), zero[None, :]) * scale[None, :]


@triton.jit
def _scaled(w, expert_scales, k_start, group_size, n_out, cols, col_valid, GROUP_SCALE: tl.constexpr):
    """A weight tile [BLOCK_N, BLOCK_K] (rows `cols` of a [n_out, ...] weight, inputs k_start ...) in float32, times
    its group's scales when GROUP_SCALE (expert_scales: the expert's [G, n_out]; the tile lies in one group)."""
    w = w.to(tl.float32)
    if GROUP_SCALE:
        w = w * group_scale(expert_scales, k_start, cols, col_valid, n_out, group_size)[:, None]
    return w


@triton.jit
def _int4_step_loads(row_words, rows, row_valid, x_row, k_start, k_dim, expert_scales, expert_zeros, n_out,
                     BLOCK_K: tl.constexpr, SUB_K: tl.constexpr, GROUP_SUBS: tl.constexpr, WHOLE_SUBS: tl.constexpr,
                     X_BF16_PAIRS: tl.constexpr, HALF_FMA: tl.constexpr):
    """Everything one step of `_int4_rows_times_x` reads, inputs k_start ... k_start + BLOCK_K (masked past k_dim):
    per sub-tile (words [BLOCK_N, SUB_K / 8], scale [BLOCK_N], zero [BLOCK_N], x's inputs: bf16x2 pairs for
    HALF_FMA, else float32; bf16 x read a word's 16 bytes at a time, `quant_gemv._x_pair_vectors`). All loads
    issued here, before any math: written sub-tile by sub-tile with the math between, ptxas kept each sub-tile's
    loads behind the previous one's math (a memory round trip per sub-tile in a row). GROUP_SUBS: sub-tiles per scale group (a
    constant, so the group index is no runtime division: that cost about 50 instructions a sub-tile in SASS).
    WHOLE_SUBS: k_dim is a multiple of SUB_K, so a sub-tile is wholly in or past K: one mask per sub-tile, which
    lets the words' loads be vectorized (a per-word mask did not)."""
    words_k = tl.arange(0, SUB_K // 8)
    loaded = ()
    for sub in tl.static_range(BLOCK_K // SUB_K):
        k0 = k_start + sub * SUB_K  # a multiple of SUB_K: the hint lets the words' loads be vectorized
        word = tl.multiple_of(k0 // 8, SUB_K // 8) + words_k  # [SUB_K / 8]
        if WHOLE_SUBS:
            word_valid = tl.full((SUB_K // 8,), 1, tl.int1) & (k0 < k_dim)
        else:
            word_valid = word * 8 < k_dim
        words = tl.load(row_words + word[None, :], mask=row_valid[:, None] & word_valid[None, :], other=0)
        params = (k0 // SUB_K // GROUP_SUBS) * n_out + rows  # [BLOCK_N]: the sub-tile's group
        params_valid = row_valid & (k0 < k_dim)
        scale = tl.load(expert_scales + params, mask=params_valid, other=0.0).to(tl.float32)
        zero = tl.load(expert_zeros + params, mask=params_valid, other=0.0).to(tl.float32)
        if HALF_FMA:  # bf16 x (X_BF16_PAIRS)
            xs = _x_half_pairs(x_row, word, word_valid)
        else:
            xs = _x_words(x_row, word, word_valid, X_BF16_PAIRS)
        loaded = loaded + ((words, scale, zero, xs),)
    return loaded


@triton.jit
def _int4_step_math(acc, loaded, BLOCK_K: tl.constexpr, SUB_K: tl.constexpr, ASM: tl.constexpr,
                    HALF_FMA: tl.constexpr):
    """acc [BLOCK_N, SUB_K / 8] plus one step's products (`_int4_step_loads`): each word's 8 products summed
    in-thread (float32 or bf16x2), times its group's scale."""
    for sub in tl.static_range(BLOCK_K // SUB_K):
        words, scale, zero, xs = loaded[sub]
        if HALF_FMA:
            sums = _half_fma_word_sums(words, zero[:, None], xs[0][None, :], xs[1][None, :], xs[2][None, :],
                                       xs[3][None, :])
        else:
            centered = _int4_centered(words, zero[:, None], ASM)
            sums = xs[0][None, :] * centered[0]
            for j in tl.static_range(1, 8):
                sums += xs[j][None, :] * centered[j]
        acc += sums * scale[:, None]
    return acc


@triton.jit
def _int4_rows_times_x(w_expert, rows, row_valid, stride_row, x_row, k_dim, expert_scales, expert_zeros, n_out,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SUB_K: tl.constexpr, GROUP_SUBS: tl.constexpr,
                       WHOLE_SUBS: tl.constexpr, ASM: tl.constexpr, X_BF16_PAIRS: tl.constexpr, HALF_FMA: tl.constexpr,
                       LOAD_AHEAD: tl.constexpr):
    """sum over k of W[rows, k] * x[k] -> [BLOCK_N] float32, for an int4 expert weight (w_expert: its int32
    [n_out, k_dim / 8], each row's inputs 8 a word; scales and zero points [G, n_out]). Each loop step covers
    BLOCK_K inputs as BLOCK_K / SUB_K sub-tiles of whole words [BLOCK_N, SUB_K / 8], each within one group (SUB_K
    divides the group size), so it loads its rows' scale and zero point once ([BLOCK_N] each); a step's loads are
    all issued before its math (`_int4_step_loads`), and with LOAD_AHEAD a step ahead of it. A word's 8 products
    are summed in-thread with the dense GEMV's word math (quant_gemv): `_int4_centered` (q - z exactly in float32:
    a LOP3 and a subtraction per weight, no int-to-float conversion) and one FMA, or with HALF_FMA in bf16x2
    (`_half_fma_word_sums`, bf16 x at 4-byte aligned rows on CUDA); each word's sum times its group's scale
    accumulates in float32, reduced over K once at the end."""
    row_words = w_expert + rows.to(tl.int64)[:, None] * stride_row  # [BLOCK_N, 1]
    acc = tl.zeros((BLOCK_N, SUB_K // 8), dtype=tl.float32)
    if LOAD_AHEAD:
        loaded = _int4_step_loads(row_words, rows, row_valid, x_row, 0, k_dim, expert_scales, expert_zeros, n_out,
                                  BLOCK_K, SUB_K, GROUP_SUBS, WHOLE_SUBS, X_BF16_PAIRS, HALF_FMA)
    for k_start in range(0, k_dim, BLOCK_K):
        if LOAD_AHEAD:  # the next step's loads (masked past k_dim) in flight during this step's math
            ahead = _int4_step_loads(row_words, rows, row_valid, x_row, k_start + BLOCK_K, k_dim, expert_scales,
                                     expert_zeros, n_out, BLOCK_K, SUB_K, GROUP_SUBS, WHOLE_SUBS, X_BF16_PAIRS,
                                     HALF_FMA)
        else:
            loaded = _int4_step_loads(row_words, rows, row_valid, x_row, k_start, k_dim, expert_scales,
                                      expert_zeros, n_out, BLOCK_K, SUB_K, GROUP_SUBS, WHOLE_SUBS, X_BF16_PAIRS,
                                      HALF_FMA)
        acc = _int4_step_math(acc, loaded, BLOCK_K, SUB_K, ASM, HALF_FMA)
        if LOAD_AHEAD:
            loaded = ahead
    return tl.sum(acc, axis=1)


@triton.jit
def _gate_up_act_kernel(
    x_ptr,  # [T, H]
    w13_ptr,  # [E, 2I, H], or int4 [E, 2I, H / 8] int32 (INT4)
    ids_ptr,  # [N] expert of each assignment (topk_ids flattened)
    act_ptr,  # [N, I]
    scale_ptr,  # [E, G, 2I] group scales of an FP8 w13 (GROUP_SCALE, float32) or an int4 one (INT4)
    zero_ptr,  # [E, G, 2I] zero points of an int4 w13 (INT4)
    hidden_size,
    inter,
    stride_x,
    stride_we,
    stride_wn,
    stride_act,
    stride_se,
    group_size,
    TOP_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    LOAD_AHEAD: tl.constexpr,  # GemvTiles.load_ahead
    USE_PDL: tl.constexpr,  # launched with PDL (kernels/pdl.py): waits first, it reads ids and x
    GROUP_SCALE: tl.constexpr,  # w13 in FP8 e4m3: each weight tile times its group's scales (BLOCK_K divides one)
    INT4: tl.constexpr,  # w13 packed int4: whole words, each word's products summed in-thread (`_int4_rows_times_x`)
    SUB_K: tl.constexpr,  # INT4: inputs per sub-tile (divides the group size and BLOCK_K)
    GROUP_SUBS: tl.constexpr,  # INT4: sub-tiles per scale group
    WHOLE_SUBS: tl.constexpr,  # INT4: the hidden size is a multiple of SUB_K
    ASM: tl.constexpr,  # INT4: the nibbles made floats by inline PTX (not in Triton's interpreter)
    X_BF16_PAIRS: tl.constexpr,  # INT4: x is bf16 at 4-byte aligned rows, read two inputs a load
    HALF_FMA: tl.constexpr,  # INT4: each word's products summed in bf16x2 (GemvTiles.half_fma)
):
    """act[i, cols] for assignment i = (token i // TOP_K, expert ids[i]) and one block of intermediate columns."""
    wait_for_prior_grids(USE_PDL)
    assignment = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_valid = cols < inter
    expert = tl.load(ids_ptr + assignment).to(tl.int64)
    x_row = x_ptr + (assignment // TOP_K).to(tl.int64) * stride_x
    scales = scale_ptr + expert * stride_se  # this expert's [G, 2I]
    if INT4:  # whole words unpacked in registers
        zeros = zero_ptr + expert * stride_se
        w_expert = w13_ptr + expert * stride_we
        # gate and up rows interleaved (2 c: gate column c, 2 c + 1: up column c) in one tile, so that each x load
        # serves both; the sums split back into [BLOCK_N] each
        pair = tl.arange(0, 2 * BLOCK_N)
        rows = (tl.program_id(1) * BLOCK_N + pair // 2) + (pair % 2) * inter  # [2 BLOCK_N]
        sums = _int4_rows_times_x(w_expert, rows, (pair // 2 + tl.program_id(1) * BLOCK_N) < inter, stride_wn,
                                  x_row, hidden_size, scales, zeros, 2 * inter, 2 * BLOCK_N, BLOCK_K, SUB_K,
                                  GROUP_SUBS, WHOLE_SUBS, ASM, X_BF16_PAIRS, HALF_FMA, LOAD_AHEAD)
        gate_sum, up_sum = tl.split(tl.reshape(sums, (BLOCK_N, 2)))
    else:
        gate_rows = w13_ptr + expert * stride_we + cols.to(tl.int64)[:, None] * stride_wn  # [BLOCK_N, 1]
        up_rows = gate_rows + inter * stride_wn
        # Products summed in-thread over the loop into [BLOCK_N, BLOCK_K] tiles and reduced across threads once at
        # the end: a reduction per step would stall every step on shuffles instead of the next loads.
        gate = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        up = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        # With LOAD_AHEAD the loop carries the next step's weight tiles: their loads are issued before this step's
        # math, two steps in flight per thread (Triton does not software-pipeline loads that feed no tl.dot).
        if LOAD_AHEAD:
            gate_w = _weight_tile(gate_rows, 0, hidden_size, col_valid, BLOCK_K)
            up_w = _weight_tile(up_rows, 0, hidden_size, col_valid, BLOCK_K)
        for k_start in range(0, hidden_size, BLOCK_K):
            ks = k_start + tl.arange(0, BLOCK_K)
            x = tl.load(x_row + ks, mask=ks < hidden_size, other=0.0).to(tl.float32)[None, :]
            if LOAD_AHEAD:
                next_gate = _weight_tile(gate_rows, k_start + BLOCK_K, hidden_size, col_valid, BLOCK_K)
                next_up = _weight_tile(up_rows, k_start + BLOCK_K, hidden_size, col_valid, BLOCK_K)
            else:
                gate_w = _weight_tile(gate_rows, k_start, hidden_size, col_valid, BLOCK_K)
                up_w = _weight_tile(up_rows, k_start, hidden_size, col_valid, BLOCK_K)
            gate += _scaled(gate_w, scales, k_start, group_size, 2 * inter, cols, col_valid, GROUP_SCALE) * x
            up += _scaled(up_w, scales, k_start, group_size, 2 * inter, inter + cols, col_valid, GROUP_SCALE) * x
            if LOAD_AHEAD:
                gate_w, up_w = next_gate, next_up
        gate_sum, up_sum = tl.sum(gate, axis=1), tl.sum(up, axis=1)
    # Rounded where the reference rounds: the projections' outputs, then silu(gate) (as activation.silu_and_mul).
    dtype = act_ptr.dtype.element_ty
    gate_out = gate_sum.to(dtype).to(tl.float32)  # [BLOCK_N]
    up_out = up_sum.to(dtype).to(tl.float32)
    silu = (gate_out / (1.0 + tl.exp(-gate_out))).to(dtype).to(tl.float32)
    tl.store(act_ptr + assignment.to(tl.int64) * stride_act + cols, (silu * up_out).to(dtype), mask=col_valid)


@triton.jit
def _down_reduce_kernel(
    act_ptr,  # [N, I]
    w2_ptr,  # [E, H, I], or int4 [E, H, I / 8] int32 (INT4)
    ids_ptr,  # [N]
    weights_ptr,  # [N] float32
    partial_ptr,  # [N, H] float32 workspace: each assignment's weighted output
    counter_ptr,  # [T * cdiv(H, BLOCK_N)] int32 arrival counters, zero before and after every call
    out_ptr,  # [T, H]
    scale_ptr,  # [E, G, H] group scales of an FP8 w2 (GROUP_SCALE, float32) or an int4 one (INT4)
    zero_ptr,  # [E, G, H] zero points of an int4 w2 (INT4)
    hidden_size,
    inter,
    stride_act,
    stride_we,
    stride_wn,
    stride_out,
    stride_se,
    group_size,
    TOP_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    LOAD_AHEAD: tl.constexpr,  # GemvTiles.load_ahead
    USE_PDL: tl.constexpr,  # launched with PDL (kernels/pdl.py): waits first, it reads ids and act
    GROUP_SCALE: tl.constexpr,  # w2 in FP8 e4m3, as gate_up_act's w13
    INT4: tl.constexpr,  # w2 packed int4, as gate_up_act's w13
    SUB_K: tl.constexpr,  # INT4: as gate_up_act's
    GROUP_SUBS: tl.constexpr,
    WHOLE_SUBS: tl.constexpr,  # INT4: the intermediate size is a multiple of SUB_K
    ASM: tl.constexpr,
    X_BF16_PAIRS: tl.constexpr,  # INT4: act is bf16 at 4-byte aligned rows
    HALF_FMA: tl.constexpr,
):
    """partial[i, cols] = weight[i] * (act[i] @ w2[ids[i]]^T)[cols] for one assignment i; the last of a token's
    TOP_K programs on these columns to arrive sums its partials in the order k = 0 .. TOP_K - 1 (so the result
    does not depend on which arrived last) into out[token, cols] and resets the counter."""
    wait_for_prior_grids(USE_PDL)
    assignment = tl.program_id(0)
    col_block = tl.program_id(1)
    token = assignment // TOP_K
    cols = col_block * BLOCK_N + tl.arange(0, BLOCK_N)
    col_valid = cols < hidden_size
    expert = tl.load(ids_ptr + assignment).to(tl.int64)
    act_row = act_ptr + assignment.to(tl.int64) * stride_act
    scales = scale_ptr + expert * stride_se  # this expert's [G, H]
    if INT4:  # as gate_up_act
        out_sum = _int4_rows_times_x(w2_ptr + expert * stride_we, cols, col_valid, stride_wn, act_row, inter, scales,
                                     zero_ptr + expert * stride_se, hidden_size, BLOCK_N, BLOCK_K, SUB_K, GROUP_SUBS,
                                     WHOLE_SUBS, ASM, X_BF16_PAIRS, HALF_FMA, LOAD_AHEAD)
    else:
        rows = w2_ptr + expert * stride_we + cols.to(tl.int64)[:, None] * stride_wn  # [BLOCK_N, 1]
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)  # reduced once after the loop, as in gate_up_act
        if LOAD_AHEAD:  # each step's tile loaded a step ahead, as in gate_up_act
            w = _weight_tile(rows, 0, inter, col_valid, BLOCK_K)
        for j_start in range(0, inter, BLOCK_K):
            js = j_start + tl.arange(0, BLOCK_K)
            a = tl.load(act_row + js, mask=js < inter, other=0.0).to(tl.float32)[None, :]
            if LOAD_AHEAD:
                next_w = _weight_tile(rows, j_start + BLOCK_K, inter, col_valid, BLOCK_K)
            else:
                w = _weight_tile(rows, j_start, inter, col_valid, BLOCK_K)
            acc += _scaled(w, scales, j_start, group_size, hidden_size, cols, col_valid, GROUP_SCALE) * a
            if LOAD_AHEAD:
                w = next_w
        out_sum = tl.sum(acc, axis=1)
    # the expert's output rounds to the dtype (as the reference's projection), then weighs in float32
    part = out_sum.to(out_ptr.dtype.element_ty).to(tl.float32) * tl.load(weights_ptr + assignment)
    row_offsets = cols.to(tl.int64)  # [BLOCK_N] within one [H] row of partial
    tl.store(partial_ptr + assignment.to(tl.int64) * hidden_size + row_offsets, part, mask=col_valid)
    tl.debug_barrier()  # every thread's partials stored before the (release) atomic below
    counter = counter_ptr + token * tl.num_programs(1) + col_block
    arrived = tl.atomic_add(counter, 1, sem="acq_rel")
    if arrived == TOP_K - 1:  # the token's other assignments on these columns are stored: reduce, reset
        total = tl.zeros((BLOCK_N,), dtype=tl.float32)
        first = token.to(tl.int64) * TOP_K
        for k in tl.static_range(TOP_K):  # unrolled: the loads are independent, so one L2 round trip, not TOP_K
            total += tl.load(partial_ptr + (first + k) * hidden_size + row_offsets, mask=col_valid, other=0.0,
                             cache_modifier=".cg")
        tl.store(out_ptr + token.to(tl.int64) * stride_out + cols, total.to(out_ptr.dtype.element_ty), mask=col_valid)
        tl.atomic_xchg(counter, 0)


def _fused_moe_decode(hidden, w13, w2, weights, ids, top_k: int, config: Optional[DecodeConfig] = None,
                      w13_scale=None, w2_scale=None, group_size: int = 0, w13_zeros=None, w2_zeros=None):
    """weights, ids: [N] flattened routing. Two launches whatever the routing; config: tiles for this call
    (default: `decode_config`; with group scales each K tile cut to divide the group). Calls must not overlap on
    two streams (they share the arrival counters)."""
    int4 = w13.dtype == torch.int32
    tokens, size = hidden.shape
    num, inter = ids.numel(), _logical_shape(w2)[2]
    config = config or decode_config(size, inter, top_k, tokens, int4)
    up, down = config.gate_up, config.down
    col_blocks = triton.cdiv(size, down.block_n)
    if tokens * col_blocks > COUNTER_SLOTS:
        raise ValueError(f"decode MoE: {tokens} tokens x {col_blocks} column blocks exceed {COUNTER_SLOTS} "
                         f"counters (raise the down block_n)")  # fmt: skip
    arrivals = counters(hidden.device)  # before anything is launched: it may refuse under capture
    pdl = pdl_enabled(hidden.device)
    act = torch.empty((num, inter), dtype=hidden.dtype, device=hidden.device)
    grouped = w13_scale is not None
    # int4: a step's K tile (at most the inputs there are) in sub-tiles within one group; FP8: each K tile within
    # one group
    up_k, down_k = ((min(up.block_k, triton.next_power_of_2(size)), min(down.block_k, triton.next_power_of_2(inter)))
                    if int4 else (_within_group(up.block_k, group_size), _within_group(down.block_k, group_size)))
    _gate_up_act_kernel[(num, triton.cdiv(inter, up.block_n))](
        hidden, w13, ids, act, w13_scale if grouped else act, w13_zeros if int4 else act, size, inter,
        hidden.stride(0), w13.stride(0), w13.stride(1), act.stride(0), w13_scale.stride(0) if grouped else 0,
        group_size or 1, TOP_K=top_k, BLOCK_N=up.block_n, BLOCK_K=up_k, LOAD_AHEAD=up.load_ahead, USE_PDL=pdl,
        GROUP_SCALE=grouped and not int4, INT4=int4, **_int4_constants(int4, up, up_k, size, group_size, hidden),
        num_warps=up.num_warps, launch_pdl=pdl,
    )  # fmt: skip
    partial = torch.empty((num, size), dtype=torch.float32, device=hidden.device)
    out = torch.empty((tokens, size), dtype=hidden.dtype, device=hidden.device)
    _down_reduce_kernel[(num, col_blocks)](
        act, w2, ids, weights, partial, arrivals, out, w2_scale if grouped else out, w2_zeros if int4 else out,
        size, inter, act.stride(0), w2.stride(0), w2.stride(1), out.stride(0),
        w2_scale.stride(0) if grouped else 0, group_size or 1, TOP_K=top_k, BLOCK_N=down.block_n,
        BLOCK_K=down_k, LOAD_AHEAD=down.load_ahead, USE_PDL=pdl,
        GROUP_SCALE=grouped and not int4, INT4=int4, **_int4_constants(int4, down, down_k, inter, group_size, act),
        num_warps=down.num_warps, launch_pdl=pdl,
    )  # fmt: skip
    return out


def _int4_constants(int4: bool, tiles: GemvTiles, block_k: int, k_dim: int, group_size: int,
                    x: torch.Tensor) -> dict:
    """A decode kernel's int4 constexprs for a K tile of block_k over k_dim inputs read from x's rows (neutral
    values on bf16 and FP8 experts): the sub-tile, sub-tiles a group, whether K is whole sub-tiles, and how x is
    read (bf16 pairs; bf16x2 sums where the tile asks for them and CUDA can)."""
    pairs = _bf16_pairs(x)
    sub = _int4_sub_k(block_k, group_size) if int4 else 1
    return dict(SUB_K=sub, GROUP_SUBS=group_size // sub if int4 else 1, WHOLE_SUBS=k_dim % sub == 0,
                ASM=not interpreting(), X_BF16_PAIRS=pairs,
                HALF_FMA=int4 and tiles.half_fma and pairs and half_fma_ok(x))


def _bf16_pairs(rows: torch.Tensor) -> bool:
    """Whether every row of a [R, K] tensor is bf16 at a 4-byte aligned address (read two inputs a load)."""
    return rows.dtype == torch.bfloat16 and rows.data_ptr() % 4 == 0 and rows.stride(0) % 2 == 0


def _int4_sub_k(block_k: int, group_size: int) -> int:
    """The int4 decode kernels' sub-tile: the largest power of two that divides the group size, at most block_k."""
    return min(block_k, group_size & -group_size)


def _logical_shape(w: torch.Tensor) -> tuple[int, ...]:
    """An expert weight's logical shape [E, N, K] (packed int4, int32, holds 8 inputs a word along K)."""
    return (*w.shape[:-1], w.shape[-1] * 8) if w.dtype == torch.int32 else tuple(w.shape)


def expert_shapes(w13: torch.Tensor, w2: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The logical shapes [E, 2I, H] and [E, H, I] of the experts' weights."""
    return _logical_shape(w13), _logical_shape(w2)


def _int4_block_k(tiles: GemvTiles, k_dim: int) -> int:
    """The decode kernels' K tile for int4 experts without a tuned row (moe_configs.TUNED_INT4), from the bf16 row's:
    twice its K tile (a quarter of the bytes a weight) where each thread then loads at most 8 words a step, else
    the same, at most k_dim rounded up to a power of two. ptxas (sm_90, Triton 3.7) spilled with 16 words a thread
    at 4 warps and at 32 with 2, and spilled nothing at 8."""
    doubled = 2 * tiles.block_k
    words_per_thread = tiles.block_n * doubled // 8 // (32 * tiles.num_warps)
    return min(doubled if words_per_thread <= 8 else tiles.block_k, triton.next_power_of_2(k_dim))


def _check_inputs(hidden, w13, w2, topk_weights, topk_ids, w13_scale=None, w2_scale=None, group_size=None,
                  w13_zeros=None, w2_zeros=None) -> None:
    if hidden.dim() != 2 or w13.dim() != 3 or w2.dim() != 3:
        raise ValueError("hidden must be [T, H], w13 [E, 2I, H] and w2 [E, H, I]")
    (experts, two_inter, size), w2_shape = expert_shapes(w13, w2)
    if size != hidden.shape[1] or two_inter % 2 or w2_shape != (experts, size, two_inter // 2):
        raise ValueError(f"expert weights {tuple(w13.shape)} / {tuple(w2.shape)} do not fit hidden "
                         f"{tuple(hidden.shape)}: need w13 [E, 2I, H] and w2 [E, H, I] (int4: the last "
                         "dimension packed 8 a word)")  # fmt: skip
    if topk_ids.dim() != 2 or topk_weights.shape != topk_ids.shape or topk_ids.shape[0] != hidden.shape[0]:
        raise ValueError("topk_weights and topk_ids must both be [T, K] for hidden [T, H]")
    contiguous = hidden.stride(1) == 1 and w13.stride(2) == 1 and w2.stride(2) == 1
    if w13.dtype == torch.int32 or w2.dtype == torch.int32:
        _check_group_scales(w13, w2, w13_scale, w2_scale, group_size, torch.int32, hidden.dtype)
        _check_group_scales(w13, w2, w13_zeros, w2_zeros, group_size, torch.int32, hidden.dtype, "zeros")
    elif w13_scale is not None:
        _check_group_scales(w13, w2, w13_scale, w2_scale, group_size, torch.float8_e4m3fn, torch.float32)
    elif not w13.dtype == hidden.dtype == w2.dtype:
        raise ValueError("hidden and the expert weights need one dtype (or FP8 or int4 weights with group scales)")
    if not contiguous:
        raise ValueError("hidden and the expert weights need contiguous last dimensions")


def _check_group_scales(w13, w2, w13_scale, w2_scale, group_size, weight_dtype, scale_dtype,
                        what: str = "scale") -> None:
    """Quantized experts: weights in weight_dtype (e4m3, or int32 words of packed int4), group scales (or int4's
    zero points) in scale_dtype, w13 [E, ceil(H / g), 2I] and w2 [E, ceil(I / g), H], g a multiple of 16; each a
    ValueError naming what is wrong."""
    (experts, two_inter, size), _ = expert_shapes(w13, w2)
    if w13.dtype != weight_dtype or w2.dtype != weight_dtype:
        kind = "FP8 e4m3" if weight_dtype == torch.float8_e4m3fn else "int4 (int32 words)"
        raise ValueError(f"group {what}s apply to {kind} expert weights, got {w13.dtype} / {w2.dtype}")
    if not group_size or group_size % 16:
        raise ValueError(f"the experts' scale group size must be a multiple of 16, got {group_size}")
    expected = {f"w13_{what}": (experts, triton.cdiv(size, group_size), two_inter),
                f"w2_{what}": (experts, triton.cdiv(two_inter // 2, group_size), size)}
    for name, scales in ((f"w13_{what}", w13_scale), (f"w2_{what}", w2_scale)):
        if scales is None or tuple(scales.shape) != expected[name] or scales.dtype != scale_dtype \
                or not scales.is_contiguous():
            raise ValueError(f"{name} must be contiguous {str(scale_dtype).removeprefix('torch.')} "
                             f"{list(expected[name])}, got "
                             f"{None if scales is None else (list(scales.shape), scales.dtype)}")


def fused_moe(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, w13_scale: Optional[torch.Tensor] = None,
              w2_scale: Optional[torch.Tensor] = None, group_size: Optional[int] = None,
              w13_zeros: Optional[torch.Tensor] = None, w2_zeros: Optional[torch.Tensor] = None) -> torch.Tensor:
    """hidden [T, H], w13 [E, 2I, H] ([gate | up]), w2 [E, H, I], topk_weights / topk_ids [T, K] -> new [T, H]:
    the decode kernels up to DECODE_MAX_TOKENS tokens, the grouped GEMMs above. FP8 experts: w13 / w2 in e4m3 with
    group scales (reference.fused_moe), applied per weight tile, x unquantized. Int4 experts: w13 / w2 packed
    int4 (int32 [E, 2I, H / 8] and [E, H, I / 8]) with group scales and zero points in hidden's dtype
    (reference.fused_moe), each weight tile dequantized in the kernel."""
    _check_inputs(hidden, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale, group_size, w13_zeros, w2_zeros)
    tokens, top_k = topk_ids.shape
    if tokens == 0:
        return torch.empty((0, hidden.shape[1]), dtype=hidden.dtype, device=hidden.device)
    if tokens <= DECODE_MAX_TOKENS:
        weights = topk_weights.reshape(-1).float().contiguous()  # [N]
        return _fused_moe_decode(hidden, w13, w2, weights, topk_ids.reshape(-1).contiguous(), top_k, None,
                                 w13_scale, w2_scale, group_size or 0, w13_zeros, w2_zeros)
    return fused_moe_grouped(hidden, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale, group_size, w13_zeros,
                             w2_zeros)


def fused_moe_grouped(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                      topk_ids: torch.Tensor, w13_scale: Optional[torch.Tensor] = None,
                      w2_scale: Optional[torch.Tensor] = None, group_size: Optional[int] = None,
                      w13_zeros: Optional[torch.Tensor] = None, w2_zeros: Optional[torch.Tensor] = None
                      ) -> torch.Tensor:
    """As fused_moe, through the grouped GEMMs whatever the batch size (inputs checked by the caller)."""
    tokens, top_k = topk_ids.shape
    (num_experts, two_inter, size), _ = expert_shapes(w13, w2)
    inter = two_inter // 2
    num = tokens * top_k
    weights = topk_weights.reshape(-1).float().contiguous()  # [N]
    tiles = tile_config(num, num_experts, hidden.element_size())
    sorted_ids, block_expert = align_by_expert(topk_ids, num_experts, tiles.block_m)
    gate_up = torch.empty((num, 2 * inter), dtype=hidden.dtype, device=hidden.device)
    _grouped_gemm(hidden, w13, gate_up, None, sorted_ids, block_expert, top_k, tiles, w13_scale, group_size or 0,
                  w13_zeros)
    act = activation.silu_and_mul(gate_up)  # [N, I]
    down = torch.empty((num, size), dtype=hidden.dtype, device=hidden.device)
    _grouped_gemm(act, w2, down, weights, sorted_ids, block_expert, 1, tiles, w2_scale, group_size or 0, w2_zeros)
    return down.view(tokens, top_k, size).sum(dim=1)  # [T, H]; sum accumulates in float32, rounds once

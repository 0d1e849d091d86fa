"""Paged attention over the KV cache for a flat batch of sequences: one launcher, two kernel paths.

Shapes (T = query tokens, B = sequences, H = query heads, KVH = kv heads, G = H / KVH, D = head dim):
    q, out: [T, H, D]              k_cache, v_cache: [NB, BS, KVH, D]     block_tables: [B, MAXB]
    query_start_loc: [B + 1]       seq_lens: [B] (context after this step, new tokens included)

Query row i of sequence b sits at absolute position seq_len - q_len + i and attends to keys 0..that position.
`varlen_attention` (encoders) runs the 2D kernel without the causal mask over k and v seen as one-token pages.

Paths:
  * 2D (prefill, chunked prefill, mixed batches): one program per (tile of query rows of one sequence, kv head).
    A tile holds BLOCK_Q query tokens times the G heads of the kv group (rows = token-major, head-minor), so the
    group shares every K/V load. Tiles are numbered without a host sync: sequence b owns the tile ids from
    query_start_loc[b] // BLOCK_Q + b on, and a program finds its sequence by binary search. The KV loop runs in
    two phases: tiles every row may see (no mask), then the diagonal tiles (causal mask).
  * split-KV decode (every q_len <= 1): one program per (sequence, kv head, KV segment) writes a partial
    (max, sum, unnormalised acc) to a float32 workspace; the last segment of a (sequence, kv head) to finish
    (an atomic arrival counter, reset by it) merges the segments of its heads in split order, as many heads a
    pass as fit (DECODE_MERGE_FLOATS), so decode is one launch (the separate reduction kernel, which merges the
    same way, remains for tests). Batch-1 decode is a chain of dependent loads, so under PDL each program loads
    the metadata and its segment's first block of keys before waiting for the previous kernel (pdl.py, rule 1's
    exception) and patches in the step's newest key after. The number of
    segments is a host-side function of B, KVH and an upper bound of the context length (max_seq_len, else the
    width of block_tables), never of device values, so the launch can be captured in a CUDA graph.

FP8 KV cache (k_cache, v_cache in float8_e4m3fn, constexpr KV_FP8): tiles are loaded as e4m3 and converted to the
dot dtype (exact: every e4m3 value is a bf16/fp16/fp32 value); k_scale is folded into the score scale and v_scale
multiplies the unnormalised output once, which equals dequantizing every element first (`reference.dequantize_kv`)
up to float32 rounding. With KV_FP8 off the code is what it was.

Scores use exp2 with log2(e) folded into the scale. Products run in the input dtype with float32 accumulation;
under Triton's interpreter (whose bf16 arithmetic is wrong) operands are upcast to float32 first.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from asyncengine.kernels import arrival_counters, interpreting
from asyncengine.kernels.pdl import enabled as pdl_enabled, wait_for_prior_grids
from asyncengine.kernels.reference import FP8_KV_DTYPE, is_fp8

LOG2E = 1.4426950408889634
LOG2E_C = tl.constexpr(LOG2E)  # the same, readable inside kernels
# Initial running max: finite, so a row that has seen no visible key yet never computes inf - inf.
NEG_BIG = tl.constexpr(-1.0e30)

# Fixed tile heuristics, from a sweep on an H100 at Llama-3-8B shapes (bf16, D = 128; loadtest/bench_kernels.py
# --sweep) and checked against ptxas on sm_90 (no spills; shared memory under 100 KB for 16-bit inputs).
PREFILL_BLOCK_M = 64  # query rows (tokens x group heads) per 2D tile for head_dim <= 128 and 16-bit inputs
PREFILL_BLOCK_N = 64  # keys per KV step in the 2D kernel, 16-bit inputs
DECODE_BLOCK_N = 64  # keys per KV step in the split-KV kernel
DECODE_MIN_SEGMENT = 64  # fewest keys worth a segment of their own
DECODE_MAX_SPLITS = 32
DECODE_PROGRAMS_PER_SM = 2  # split until about this many programs per multiprocessor
DECODE_COUNTER_SLOTS = 1 << 16  # arrival counters of the fused split-KV reduction, one per (sequence, kv head)
# Partials the merge holds at once (float32 values of [heads, splits, head_dim]): the group's heads are merged in as
# few passes as fit, since each pass is a dependent round trip (load partials, store out). Run 69 (H100, batch 1,
# 1,000 keys, 32 splits): one head a pass 11.8 us (32/8 heads) and 12.9 (32/4); 8K partials 9.3 and 9.3. Run 70
# (with the preload): 8K 8.3 and 10.6 (8 warps), 32K (one pass for 8 heads x 32 splits) 6.9 and 5.9.
DECODE_MERGE_FLOATS = 32768


# --------------------------------------------------------------------------------------------------------------
# JIT helpers
# --------------------------------------------------------------------------------------------------------------


@triton.jit
def _kv_offsets(
    block_table_ptr,  # [MAXB] of one sequence
    keys,  # [BLOCK_N] absolute key positions
    key_mask,  # [BLOCK_N] keys inside the context
    kv_head,
    stride_b,
    stride_s,
    stride_h,
    BLOCK_SIZE: tl.constexpr,
):
    """Element offsets [BLOCK_N] (int64) of (page of key, offset in page, kv_head, 0) in a paged cache."""
    page = tl.load(block_table_ptr + keys // BLOCK_SIZE, mask=key_mask, other=0).to(tl.int64)
    return page * stride_b + (keys % BLOCK_SIZE) * stride_s + kv_head * stride_h


@triton.jit
def _load_kv_tile(
    ptrs,  # [BLOCK_N, HEAD_DIM_PAD] pointers into a paged cache
    key_mask,  # [BLOCK_N] keys inside the context
    dims,  # [HEAD_DIM_PAD]
    MASK_KEYS: tl.constexpr,  # False when every key is known to be inside the context
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
):
    """A [BLOCK_N, HEAD_DIM_PAD] K or V tile, zeros where masked; masks only what may be out of range."""
    if MASK_KEYS:
        if HEAD_DIM == HEAD_DIM_PAD:
            tile = tl.load(ptrs, mask=key_mask[:, None], other=0.0)
        else:
            tile = tl.load(ptrs, mask=key_mask[:, None] & (dims[None, :] < HEAD_DIM), other=0.0)
    else:
        if HEAD_DIM == HEAD_DIM_PAD:
            tile = tl.load(ptrs)
        else:
            tile = tl.load(ptrs, mask=(dims < HEAD_DIM)[None, :], other=0.0)
    return tile


@triton.jit
def _block_keys(start, seq_len, key_lo, BLOCK_N: tl.constexpr, SLIDING_WINDOW: tl.constexpr):
    """Keys [start, start + BLOCK_N) ([BLOCK_N] positions) and which of them exist (inside the context and, with a
    sliding window, from key_lo on: earlier keys are not loaded at all, their blocks may be freed)."""
    keys = start + tl.arange(0, BLOCK_N)
    key_mask = keys < seq_len
    if SLIDING_WINDOW > 0:
        key_mask = key_mask & (keys >= key_lo)
    return keys, key_mask


@triton.jit
def _load_block(
    start,  # first key of this block
    seq_len,
    key_lo,
    k_cache_ptr,  # [NB, BS, KVH, D]
    v_cache_ptr,  # [NB, BS, KVH, D]
    block_table_ptr,  # [MAXB] of this sequence
    kv_head,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    MASKED: tl.constexpr,
    SLIDING_WINDOW: tl.constexpr,
):
    """The block's K and V tiles [BLOCK_N, HEAD_DIM_PAD] as the cache stores them, zeros where no key exists."""
    keys, key_mask = _block_keys(start, seq_len, key_lo, BLOCK_N, SLIDING_WINDOW)
    dims = tl.arange(0, HEAD_DIM_PAD)
    k_off = _kv_offsets(block_table_ptr, keys, key_mask, kv_head, stride_kb, stride_ks, stride_kh, BLOCK_SIZE)
    v_off = _kv_offsets(block_table_ptr, keys, key_mask, kv_head, stride_vb, stride_vs, stride_vh, BLOCK_SIZE)
    k = _load_kv_tile(k_cache_ptr + k_off[:, None] + dims[None, :], key_mask, dims, MASKED, HEAD_DIM, HEAD_DIM_PAD)
    v = _load_kv_tile(v_cache_ptr + v_off[:, None] + dims[None, :], key_mask, dims, MASKED, HEAD_DIM, HEAD_DIM_PAD)
    return k, v


@triton.jit
def _attend_tiles(
    acc,  # [ROWS, HEAD_DIM_PAD] float32, unnormalised output
    m_i,  # [ROWS] float32, running max of scaled scores (log2 domain)
    l_i,  # [ROWS] float32, running sum of exp2(score - m_i)
    q,  # [ROWS, HEAD_DIM_PAD] in the dot dtype
    q_pos,  # [ROWS] absolute position of each query row
    k,  # [BLOCK_N, HEAD_DIM_PAD] the block's keys (_load_block)
    v,  # [BLOCK_N, HEAD_DIM_PAD] its values
    start,  # first key of this block
    seq_len,
    key_lo,  # with SLIDING_WINDOW: the first key any row sees
    qk_scale,  # softmax scale * log2(e)
    BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr,  # False when every key of the block is visible to every row
    DOT_F32: tl.constexpr,  # upcast K/V and P to float32 before the products
    PRECISION: tl.constexpr,  # input_precision of float32 products: "ieee" or "tf32x3" (about fp32 accuracy)
    SLIDING_WINDOW: tl.constexpr,  # > 0: a row sees only keys > q_pos - SLIDING_WINDOW (when MASKED)
    SOFTCAP: tl.constexpr,  # > 0: scores are capped, SOFTCAP * tanh(score / SOFTCAP); qk_scale is then unfolded
):
    """One online-softmax step over the loaded block of keys [start, start + BLOCK_N); returns the updated (acc,
    m_i, l_i)."""
    keys, key_mask = _block_keys(start, seq_len, key_lo, BLOCK_N, SLIDING_WINDOW)
    if DOT_F32:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION)
    else:  # an e4m3 tile becomes q's dtype (a no-op for a cache in q's dtype); its scales are applied outside
        k = k.to(q.dtype)
        v = v.to(q.dtype)
        s = tl.dot(q, tl.trans(k))
    if SOFTCAP > 0:  # qk_scale is the plain softmax scale here; log2(e) is applied after the cap
        s = _tanh(s * (qk_scale / SOFTCAP)) * (SOFTCAP * LOG2E_C)
    else:
        s = s * qk_scale  # [ROWS, BLOCK_N]
    if MASKED:
        visible = (keys[None, :] <= q_pos[:, None]) & key_mask[None, :]
        if SLIDING_WINDOW > 0:
            visible = visible & (keys[None, :] > q_pos[:, None] - SLIDING_WINDOW)
        s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.math.exp2(m_i - m_new)
    p = tl.math.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if DOT_F32:
        pv = tl.dot(p, v, input_precision=PRECISION)
    else:
        pv = tl.dot(p.to(v.dtype), v)
    acc = acc * alpha[:, None] + pv
    return acc, m_new, l_i


@triton.jit
def _attend_block(
    acc,
    m_i,
    l_i,
    q,
    q_pos,
    start,
    seq_len,
    key_lo,
    k_cache_ptr,
    v_cache_ptr,
    block_table_ptr,
    kv_head,
    qk_scale,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    MASKED: tl.constexpr,
    DOT_F32: tl.constexpr,
    PRECISION: tl.constexpr,
    SLIDING_WINDOW: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    """_load_block then _attend_tiles (their arguments, in that order)."""
    k, v = _load_block(start, seq_len, key_lo, k_cache_ptr, v_cache_ptr, block_table_ptr, kv_head, stride_kb,
                       stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, BLOCK_N, BLOCK_SIZE, HEAD_DIM,
                       HEAD_DIM_PAD, MASKED, SLIDING_WINDOW)
    return _attend_tiles(acc, m_i, l_i, q, q_pos, k, v, start, seq_len, key_lo, qk_scale, BLOCK_N, MASKED, DOT_F32,
                         PRECISION, SLIDING_WINDOW, SOFTCAP)


@triton.jit
def _tanh(x):
    """tanh from exp2 (portable to the interpreter): 1 - 2 / (e^(2x) + 1); saturates to +-1 without NaN."""
    return 1.0 - 2.0 / (tl.math.exp2(x * (2.0 * LOG2E_C)) + 1.0)


@triton.jit
def _find_sequence(query_start_loc_ptr, num_seqs, tile, BLOCK_Q: tl.constexpr):
    """The largest b in [0, num_seqs) whose first tile id, query_start_loc[b] // BLOCK_Q + b, is <= tile."""
    lo = tile * 0  # int32 tensors from the start (num_seqs == 1 may arrive as a constant)
    hi = lo + num_seqs - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        first_tile = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        ok = first_tile <= tile
        lo = tl.where(ok, mid, lo)
        hi = tl.where(ok, hi, mid - 1)
    return lo


# --------------------------------------------------------------------------------------------------------------
# 2D kernel: prefill, chunked prefill and mixed batches
# --------------------------------------------------------------------------------------------------------------


# num_seqs and the block-table width (stride_bt) change every step: specializing on them (== 1, divisible by 16)
# would compile new variants in the middle of serving, stalling every request for about a second.
@triton.jit(do_not_specialize=["num_seqs", "stride_bt"])
def _prefill_kernel(
    out_ptr,  # [T, H, D]
    q_ptr,  # [T, H, D]
    k_cache_ptr,  # [NB, BS, KVH, D]
    v_cache_ptr,  # [NB, BS, KVH, D]
    query_start_loc_ptr,  # [B + 1]
    seq_lens_ptr,  # [B]
    block_tables_ptr,  # [B, MAXB]
    qk_scale,  # with KV_FP8, k_scale included
    v_scale,  # read only with KV_FP8
    num_seqs,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_bt,
    GROUP: tl.constexpr,  # query heads per kv head
    GROUP_PAD: tl.constexpr,  # next power of two >= GROUP
    BLOCK_Q: tl.constexpr,  # query tokens per tile
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,  # tokens per cache page
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    DOT_F32: tl.constexpr,
    PRECISION: tl.constexpr,
    CAUSAL: tl.constexpr,  # False: every query sees its sequence's every key (encoders; context is then 0)
    SLIDING_WINDOW: tl.constexpr,  # > 0 (with CAUSAL): a query at p sees keys p - SLIDING_WINDOW < key <= p
    SOFTCAP: tl.constexpr,  # > 0: cap the scores (qk_scale is then the plain scale)
    KV_FP8: tl.constexpr,  # the caches are e4m3: the output is scaled by v_scale
):
    # Last tiles first: they have the most keys under the causal mask, so the grid ends on short work.
    tile = tl.num_programs(0) - 1 - tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = _find_sequence(query_start_loc_ptr, num_seqs, tile, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    first_token = (tile - (q_start // BLOCK_Q + seq)) * BLOCK_Q  # within the sequence's queries
    if (first_token < 0) | (first_token >= q_len):
        return  # spare tile of the upper-bound grid
    seq_len = tl.load(seq_lens_ptr + seq)
    context = seq_len - q_len  # keys cached before this step's queries

    rows = tl.arange(0, BLOCK_Q * GROUP_PAD)
    token = first_token + rows // GROUP_PAD  # [ROWS] query index within the sequence
    head = kv_head * GROUP + rows % GROUP_PAD  # [ROWS]
    row_mask = (token < q_len) & (rows % GROUP_PAD < GROUP)
    dims = tl.arange(0, HEAD_DIM_PAD)
    io_mask = row_mask[:, None] & (dims[None, :] < HEAD_DIM)
    q_rows = (q_start + token).to(tl.int64)
    q_off = q_rows[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :]  # [ROWS, HEAD_DIM_PAD]
    q = tl.load(q_ptr + q_off, mask=io_mask, other=0.0)
    if DOT_F32:
        q = q.to(tl.float32)
    if CAUSAL:
        q_pos = context + token  # [ROWS]; padded rows see at least key 0, so no row is fully masked
    else:
        q_pos = token * 0 + seq_len  # past every key: only the context length masks

    acc = tl.zeros([BLOCK_Q * GROUP_PAD, HEAD_DIM_PAD], dtype=tl.float32)
    m_i = tl.full([BLOCK_Q * GROUP_PAD], NEG_BIG, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_Q * GROUP_PAD], dtype=tl.float32)
    block_table_ptr = block_tables_ptr + seq.to(tl.int64) * stride_bt
    if CAUSAL:
        # Keys <= context + first_token are visible to every row of the tile: no mask for whole blocks of them.
        unmasked_end = (context + first_token + 1) // BLOCK_N * BLOCK_N
        tile_end = context + tl.minimum(first_token + BLOCK_Q, q_len)  # one past the last key any row sees
    else:
        unmasked_end = seq_len // BLOCK_N * BLOCK_N
        tile_end = seq_len
    # Sliding window: blocks before the first row's window are skipped (never read: they may be freed); blocks
    # before the last row's window start are masked, as are the diagonal blocks.
    loop_start = 0
    edge_end = 0
    key_lo = 0  # the first key any row of the tile sees
    if SLIDING_WINDOW > 0:
        key_lo = tl.maximum(context + first_token - SLIDING_WINDOW + 1, 0)
        loop_start = key_lo // BLOCK_N * BLOCK_N
        edge_end = tl.cdiv(tl.maximum(tile_end - SLIDING_WINDOW, 0), BLOCK_N) * BLOCK_N
        edge_end = tl.minimum(edge_end, tl.cdiv(tile_end, BLOCK_N) * BLOCK_N)
        for start in range(loop_start, edge_end, BLOCK_N):
            acc, m_i, l_i = _attend_block(
                acc, m_i, l_i, q, q_pos, start, seq_len, key_lo, k_cache_ptr, v_cache_ptr, block_table_ptr, kv_head,
                qk_scale, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
                BLOCK_N, BLOCK_SIZE, HEAD_DIM, HEAD_DIM_PAD, True, DOT_F32, PRECISION, SLIDING_WINDOW, SOFTCAP,
            )  # fmt: skip
        loop_start = tl.maximum(loop_start, edge_end)
    for start in range(loop_start, unmasked_end, BLOCK_N):
        acc, m_i, l_i = _attend_block(
            acc, m_i, l_i, q, q_pos, start, seq_len, key_lo, k_cache_ptr, v_cache_ptr, block_table_ptr, kv_head,
            qk_scale, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
            BLOCK_N, BLOCK_SIZE, HEAD_DIM, HEAD_DIM_PAD, False, DOT_F32, PRECISION, SLIDING_WINDOW, SOFTCAP,
        )  # fmt: skip
    for start in range(tl.maximum(unmasked_end, loop_start), tile_end, BLOCK_N):
        acc, m_i, l_i = _attend_block(
            acc, m_i, l_i, q, q_pos, start, seq_len, key_lo, k_cache_ptr, v_cache_ptr, block_table_ptr, kv_head,
            qk_scale, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
            BLOCK_N, BLOCK_SIZE, HEAD_DIM, HEAD_DIM_PAD, True, DOT_F32, PRECISION, SLIDING_WINDOW, SOFTCAP,
        )  # fmt: skip
    if KV_FP8:
        acc = acc * v_scale
    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    out_off = q_rows[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :]
    tl.store(out_ptr + out_off, out.to(out_ptr.dtype.element_ty), mask=io_mask)


# --------------------------------------------------------------------------------------------------------------
# Split-KV decode: partial kernel + reduction kernel
# --------------------------------------------------------------------------------------------------------------


@triton.jit
def _segments(seq_len, NUM_SPLITS: tl.constexpr, BLOCK_N: tl.constexpr, SLIDING_WINDOW: tl.constexpr):
    """A sequence's split of its keys: (span_start, key_lo, segment, used). Segments are whole KV blocks, sized
    from the sequence's own span of visible keys (from the window's first block with a sliding window; earlier
    blocks are never read); key_lo is the first key the query sees. Only the first `used` segments hold keys (at
    least one, so that a sequence without keys still gets its zeros): the others' programs store nothing, take no
    part in the arrival count and are not merged, which at batch 1 saves the atomics and the merge's loads of a
    split count sized for the longest context (32 splits of 64 keys each for the first 2,048 keys)."""
    span_start = 0
    key_lo = 0
    if SLIDING_WINDOW > 0:
        key_lo = tl.maximum(seq_len - SLIDING_WINDOW, 0)
        span_start = key_lo // BLOCK_N * BLOCK_N
    segment = tl.cdiv(tl.cdiv(seq_len - span_start, NUM_SPLITS), BLOCK_N) * BLOCK_N
    used = tl.maximum(tl.cdiv(seq_len - span_start, tl.maximum(segment, 1)), 1)
    return span_start, key_lo, segment, used


@triton.jit
def _decode_partial_kernel(
    part_acc_ptr,  # [B, H, NUM_SPLITS, HEAD_DIM_PAD] float32, unnormalised
    part_max_ptr,  # [B, H, NUM_SPLITS] float32 (log2 domain)
    part_sum_ptr,  # [B, H, NUM_SPLITS] float32
    out_ptr,  # [T, H, D] (FUSED_REDUCE)
    counter_ptr,  # [>= B * KVH] int32 arrival counters, zero between calls (FUSED_REDUCE)
    q_ptr,  # [T, H, D]
    k_cache_ptr,  # [NB, BS, KVH, D]
    v_cache_ptr,  # [NB, BS, KVH, D]
    query_start_loc_ptr,  # [B + 1], every q_len <= 1
    seq_lens_ptr,  # [B]
    block_tables_ptr,  # [B, MAXB]
    qk_scale,  # with KV_FP8, k_scale included
    v_scale,  # read only with KV_FP8
    num_heads,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_bt,
    NUM_SPLITS: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_H: tl.constexpr,  # >= GROUP and >= 16 (the smallest dot)
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    DOT_F32: tl.constexpr,
    PRECISION: tl.constexpr,
    SLIDING_WINDOW: tl.constexpr,  # > 0: the query (at seq_len - 1) sees only the last SLIDING_WINDOW keys
    SOFTCAP: tl.constexpr,  # > 0: cap the scores (qk_scale is then the plain scale)
    KV_FP8: tl.constexpr,  # the caches are e4m3: the partial output is scaled by v_scale
    FUSED_REDUCE: tl.constexpr,  # the last split to finish merges the partials (no reduction kernel)
    SPLITS_PAD: tl.constexpr,  # next power of two >= NUM_SPLITS (FUSED_REDUCE)
    MERGE_HEADS: tl.constexpr,  # heads merged per pass (FUSED_REDUCE; merge_heads())
    USE_PDL: tl.constexpr,  # launched with PDL (kernels/pdl.py): the wait comes before the early return
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    # Before the PDL wait (kernels/pdl.py, rule 1's exception): the step's metadata and this segment's first block
    # of keys, which kernels before the previous one wrote, so that their latency overlaps the previous kernel
    # (batch-1 decode is a chain of dependent loads). The newest key (seq_len - 1) is this step's: the previous
    # kernel (rotary + cache write) may still be writing it, so it is read after the wait.
    q_start = tl.load(query_start_loc_ptr + seq)
    has_query = tl.load(query_start_loc_ptr + seq + 1) != q_start
    seq_len = tl.where(has_query, tl.load(seq_lens_ptr + seq), 0)  # no query: nothing to load or attend
    span_start, key_lo, segment, used = _segments(seq_len, NUM_SPLITS, BLOCK_N, SLIDING_WINDOW)
    seg_start = span_start + split * segment
    seg_end = tl.minimum(seg_start + segment, seq_len)
    block_table_ptr = block_tables_ptr + seq.to(tl.int64) * stride_bt
    first_end = tl.where(seg_start < seg_end, seq_len, 0)  # the segment's first block, if it has one
    k_first, v_first = _load_block(seg_start, first_end, key_lo, k_cache_ptr, v_cache_ptr, block_table_ptr, kv_head,
                                   stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, BLOCK_N,
                                   BLOCK_SIZE, HEAD_DIM, HEAD_DIM_PAD, True, SLIDING_WINDOW)
    newest = seq_len - 1
    newest_here = (newest >= seg_start) & (newest < tl.minimum(seg_start + BLOCK_N, seg_end))
    dims = tl.arange(0, HEAD_DIM_PAD)
    newest_row = _kv_offsets(block_table_ptr, newest, newest_here, kv_head, stride_kb, stride_ks, stride_kh,
                             BLOCK_SIZE)
    newest_row_v = _kv_offsets(block_table_ptr, newest, newest_here, kv_head, stride_vb, stride_vs, stride_vh,
                               BLOCK_SIZE)
    wait_for_prior_grids(USE_PDL)
    if not has_query or split >= used:
        return  # no query for this sequence, or no keys in this segment (_segments)

    rows = tl.arange(0, BLOCK_H)
    head = kv_head * GROUP + rows  # [BLOCK_H]
    row_mask = rows < GROUP
    q_mask = row_mask[:, None] & (dims[None, :] < HEAD_DIM)
    q_off = q_start.to(tl.int64) * stride_qt + head[:, None] * stride_qh + dims[None, :]
    q = tl.load(q_ptr + q_off, mask=q_mask, other=0.0)  # [BLOCK_H, HEAD_DIM_PAD]
    if DOT_F32:
        q = q.to(tl.float32)
    q_pos = tl.full([BLOCK_H], 0, dtype=tl.int32) + (seq_len - 1)

    acc = tl.zeros([BLOCK_H, HEAD_DIM_PAD], dtype=tl.float32)
    m_i = tl.full([BLOCK_H], NEG_BIG, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    if seg_start < seg_end:
        # the newest key's row, now written, in place of what the preload read there
        dim_mask = newest_here & (dims < HEAD_DIM)
        newest_k = tl.load(k_cache_ptr + newest_row + dims, mask=dim_mask, other=0.0)
        newest_v = tl.load(v_cache_ptr + newest_row_v + dims, mask=dim_mask, other=0.0)
        is_newest = ((seg_start + tl.arange(0, BLOCK_N)) == newest) & newest_here  # [BLOCK_N]
        k_first = tl.where(is_newest[:, None], newest_k[None, :], k_first)
        v_first = tl.where(is_newest[:, None], newest_v[None, :], v_first)
        acc, m_i, l_i = _attend_tiles(acc, m_i, l_i, q, q_pos, k_first, v_first, seg_start, seq_len, key_lo,
                                      qk_scale, BLOCK_N, True, DOT_F32, PRECISION, SLIDING_WINDOW, SOFTCAP)
    for start in range(seg_start + BLOCK_N, seg_end, BLOCK_N):
        acc, m_i, l_i = _attend_block(
            acc, m_i, l_i, q, q_pos, start, seq_len, key_lo, k_cache_ptr, v_cache_ptr, block_table_ptr, kv_head,
            qk_scale, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
            BLOCK_N, BLOCK_SIZE, HEAD_DIM, HEAD_DIM_PAD, True, DOT_F32, PRECISION, SLIDING_WINDOW, SOFTCAP,
        )  # fmt: skip

    if KV_FP8:
        acc = acc * v_scale
    # Every (row, used split) is written (an empty one as max NEG_BIG, sum 0, acc 0): the merge reads those.
    part = (seq.to(tl.int64) * num_heads + head) * NUM_SPLITS + split  # [BLOCK_H]
    tl.store(part_max_ptr + part, m_i, mask=row_mask)
    tl.store(part_sum_ptr + part, l_i, mask=row_mask)
    tl.store(part_acc_ptr + part[:, None] * HEAD_DIM_PAD + dims[None, :], acc, mask=row_mask[:, None])
    if FUSED_REDUCE:
        # The GEMV's split-K pattern (quant_gemv.py): count arrivals per (sequence, kv head); the last split merges
        # every head of the group and resets the counter, so the next call (or graph replay) finds it zeroed.
        counter = counter_ptr + seq * tl.num_programs(1) + kv_head
        # Every thread's partials stored before the merge reads them back in another thread layout (NUM_SPLITS
        # == 1 too: without this barrier a GPU merged rows not yet written, and run 51 got NaNs from the
        # poisoned buffer) and before the (release) atomic below.
        tl.debug_barrier()
        last = True
        if NUM_SPLITS > 1:
            last = tl.atomic_add(counter, 1, sem="acq_rel") == used - 1
        if last:
            _merge_group(out_ptr, part_acc_ptr, part_max_ptr, part_sum_ptr, seq, kv_head, q_start, num_heads,
                         used, stride_ot, stride_oh, GROUP, MERGE_HEADS, NUM_SPLITS, SPLITS_PAD, HEAD_DIM,
                         HEAD_DIM_PAD)
            if NUM_SPLITS > 1:
                tl.atomic_xchg(counter, 0)


@triton.jit
def _merge_group(
    out_ptr,  # [T, H, D]
    part_acc_ptr,  # [B, H, NUM_SPLITS, HEAD_DIM_PAD] float32
    part_max_ptr,  # [B, H, NUM_SPLITS] float32
    part_sum_ptr,  # [B, H, NUM_SPLITS] float32
    seq,
    kv_head,
    q_start,  # the sequence's query row
    num_heads,
    used,  # the splits that hold keys (_segments): the first `used` partials of each head
    stride_ot,
    stride_oh,
    GROUP: tl.constexpr,  # query heads of the kv head
    MERGE_HEADS: tl.constexpr,  # heads per pass, a power of two
    NUM_SPLITS: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
):
    """out[q_start, h] for the GROUP heads h of kv_head: each head's `used` partials merged in split order
    (one fixed sum: the result depends on nothing but that head's partials). MERGE_HEADS heads a pass: a pass
    loads [MERGE_HEADS, SPLITS_PAD, HEAD_DIM_PAD] partials at once, so a group of G heads costs cdiv(G,
    MERGE_HEADS) dependent round trips instead of G (batch-1 decode is latency-bound: each is ~1 us). Partials are
    read past L1 (.cg): in the fused kernel other programs wrote them."""
    splits = tl.arange(0, SPLITS_PAD)
    dims = tl.arange(0, HEAD_DIM_PAD)
    for first in tl.static_range(0, GROUP, MERGE_HEADS):
        rank = first + tl.arange(0, MERGE_HEADS)  # [MH] head within the group
        head = kv_head * GROUP + rank
        valid = (rank < GROUP)[:, None] & (splits < used)[None, :]  # [MH, SP]
        part = (seq.to(tl.int64) * num_heads + head)[:, None] * NUM_SPLITS + splits[None, :]  # [MH, SP]
        m = tl.load(part_max_ptr + part, mask=valid, other=NEG_BIG, cache_modifier=".cg")
        l = tl.load(part_sum_ptr + part, mask=valid, other=0.0, cache_modifier=".cg")
        acc = tl.load(part_acc_ptr + part[:, :, None] * HEAD_DIM_PAD + dims[None, None, :], mask=valid[:, :, None],
                      other=0.0, cache_modifier=".cg")  # [MH, SP, DP]
        weight = tl.math.exp2(m - tl.max(m, axis=1)[:, None])  # [MH, SP]
        total = tl.sum(weight * l, axis=1)  # [MH]
        out = tl.sum(weight[:, :, None] * acc, axis=1) / tl.where(total > 0.0, total, 1.0)[:, None]  # [MH, DP]
        out_off = q_start.to(tl.int64) * stride_ot + head[:, None] * stride_oh + dims[None, :]
        tl.store(out_ptr + out_off, out.to(out_ptr.dtype.element_ty),
                 mask=(rank < GROUP)[:, None] & (dims < HEAD_DIM)[None, :])


@triton.jit
def _decode_reduce_kernel(
    out_ptr,  # [T, H, D]
    part_acc_ptr,  # [B, H, NUM_SPLITS, HEAD_DIM_PAD] float32
    part_max_ptr,  # [B, H, NUM_SPLITS] float32
    part_sum_ptr,  # [B, H, NUM_SPLITS] float32
    query_start_loc_ptr,  # [B + 1]
    seq_lens_ptr,  # [B]
    num_heads,
    stride_ot,
    stride_oh,
    GROUP: tl.constexpr,
    MERGE_HEADS: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,  # the partial kernel's (for _segments)
    SLIDING_WINDOW: tl.constexpr,
    USE_PDL: tl.constexpr,  # launched with PDL (kernels/pdl.py): the wait comes before the early return
):
    """One program per (sequence, kv head): the fused kernel's merge, the same code, so the same bits."""
    wait_for_prior_grids(USE_PDL)
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    q_start = tl.load(query_start_loc_ptr + seq)
    if tl.load(query_start_loc_ptr + seq + 1) == q_start:
        return
    used = _segments(tl.load(seq_lens_ptr + seq), NUM_SPLITS, BLOCK_N, SLIDING_WINDOW)[3]
    _merge_group(out_ptr, part_acc_ptr, part_max_ptr, part_sum_ptr, seq, kv_head, q_start, num_heads, used,
                 stride_ot, stride_oh, GROUP, MERGE_HEADS, NUM_SPLITS, SPLITS_PAD, HEAD_DIM, HEAD_DIM_PAD)


# --------------------------------------------------------------------------------------------------------------
# Launcher
# --------------------------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _multiprocessors(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _num_sms(device: torch.device) -> int:
    """Multiprocessors of the device (a small stand-in under the interpreter)."""
    if device.type != "cuda":
        return 4
    return _multiprocessors(device.index if device.index is not None else torch.cuda.current_device())


def decode_num_splits(num_seqs: int, num_kv_heads: int, kv_len_bound: int, num_sms: int) -> int:
    """KV segments per (sequence, kv head) for the decode path; a function of host ints only.

    Splits until about DECODE_PROGRAMS_PER_SM programs per multiprocessor, keeping every segment at least
    DECODE_MIN_SEGMENT keys long for the longest possible context, and at most DECODE_MAX_SPLITS.
    """
    programs = max(1, num_seqs * num_kv_heads)
    wanted = triton.cdiv(DECODE_PROGRAMS_PER_SM * num_sms, programs)
    useful = triton.cdiv(max(1, kv_len_bound), DECODE_MIN_SEGMENT)
    return max(1, min(wanted, useful, DECODE_MAX_SPLITS))


def merge_heads(group: int, splits_pad: int, head_dim_pad: int) -> int:
    """Heads merged per pass of the split-KV merge: as many of the group's (a power of two) as fit
    DECODE_MERGE_FLOATS partials, at least one."""
    fit = max(1, DECODE_MERGE_FLOATS // (splits_pad * head_dim_pad))
    return min(triton.next_power_of_2(group), 1 << (fit.bit_length() - 1))


def decode_config(group: int, num_splits: int, head_dim_pad: int, fp32: bool) -> tuple[int, int, int, int]:
    """(heads merged a pass, block_n, num_warps, num_stages) of a split-KV decode launch: the one place that
    derives them (the launcher, and the sweep that reports the engine's choice)."""
    splits_pad = triton.next_power_of_2(num_splits)
    heads_per_pass = merge_heads(group, splits_pad, head_dim_pad)
    return heads_per_pass, *decode_tiles(fp32, heads_per_pass * splits_pad * head_dim_pad)


def _dot_f32(q: torch.Tensor) -> bool:
    """Products in float32: under the interpreter (bf16 arithmetic is wrong there) or for float32 inputs."""
    return interpreting() or q.dtype == torch.float32


def _precision() -> str:
    """Float32 products: exact under the interpreter; three tf32 passes (about float32 accuracy) on a GPU."""
    return "ieee" if interpreting() else "tf32x3"


def _check_inputs(q, k_cache, v_cache, block_tables) -> None:
    if q.dim() != 3 or k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError("q must be [T, H, D]; k_cache and v_cache the same [NB, BS, KVH, D]")
    num_heads, head_dim = q.shape[1], q.shape[2]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    if k_cache.shape[3] != head_dim or num_heads % num_kv_heads:
        raise ValueError(f"head dims differ or H={num_heads} is not a multiple of KVH={num_kv_heads}")
    if block_size & (block_size - 1) or block_size < 1:
        raise ValueError(f"block_size must be a power of two, got {block_size}")
    if q.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1 or block_tables.stride(-1) != 1:
        raise ValueError("q, k_cache, v_cache and block_tables must be contiguous in their last dim")
    if k_cache.dtype != v_cache.dtype or k_cache.dtype not in (q.dtype, FP8_KV_DTYPE):
        raise ValueError(f"KV cache dtypes ({k_cache.dtype}, {v_cache.dtype}) must both be q's dtype {q.dtype} "
                         f"or both {FP8_KV_DTYPE}")


def prefill_tiles(group_pad: int, head_dim_pad: int, max_query_len: int | None, fp32: bool):
    """(rows, block_n, num_warps, num_stages) of the 2D kernel; rows = BLOCK_Q * group_pad.

    Short queries (decodes inside a mixed batch) take smaller row tiles so that less of each tile is padding.
    Wide heads and float32 inputs (tests; tf32x3 products) take smaller tiles to stay within shared memory.
    """
    if fp32:
        rows, block_n, stages = max(16, 4096 // head_dim_pad), PREFILL_BLOCK_N // 2, 2
    elif head_dim_pad <= 128:
        rows, block_n, stages = PREFILL_BLOCK_M, PREFILL_BLOCK_N, 3
    else:
        rows, block_n, stages = PREFILL_BLOCK_M // 2, PREFILL_BLOCK_N, 2
    if max_query_len is not None:
        rows = min(rows, triton.next_power_of_2(max(1, max_query_len) * group_pad))
    rows = max(rows, group_pad, 16)
    if rows * head_dim_pad >= 128 * 128:  # big tiles (many-head groups): more warps, one stage fewer
        return rows, block_n, 8, 2
    return rows, block_n, 8 if head_dim_pad > 128 else 4, stages


def decode_tiles(fp32: bool, merge_partials: int) -> tuple[int, int, int]:
    """(block_n, num_warps, num_stages) of the split-KV kernel, whose merge holds `merge_partials` float32
    partials a pass (merge_heads x splits_pad x head_dim_pad). 8 warps once that is over 128 a thread at 4: run 70
    (H100, batch 1, 32 splits) took 5.9 instead of 7.3 us at 1,000 keys and 9.2 instead of 11.0 at 4,000 for 32/4
    heads (8 heads a kv head), and 4 warps stayed faster where the merge is small (32/8 heads: 6.9 against 7.4 us;
    batch 4, 9 splits: 10.6 against 13.1)."""
    if fp32:
        return DECODE_BLOCK_N // 2, 4, 2
    return DECODE_BLOCK_N, 8 if merge_partials > 128 * 4 * 32 else 4, 3


def _score_scale(scale: float, softcap, k_cache: torch.Tensor, k_scale: float) -> float:
    """The kernels' qk_scale: log2(e) folded into the softmax scale, except under soft-capping (applied after);
    for an FP8 cache times k_scale (q . (k * k_scale) = (q . k) * k_scale)."""
    qk_scale = scale if softcap else scale * LOG2E
    return qk_scale * k_scale if is_fp8(k_cache) else qk_scale


def _launch_prefill(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, scale, max_query_len, out,
                    causal: bool = True, sliding_window=None, softcap=None, k_scale=1.0, v_scale=1.0):
    """The 2D kernel over a grid sized from host values only: cdiv(T, BLOCK_Q) + B tiles per kv head."""
    num_seqs = seq_lens.shape[0]
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    group_pad = triton.next_power_of_2(group)
    head_dim_pad = max(16, triton.next_power_of_2(head_dim))
    rows, block_n, num_warps, num_stages = prefill_tiles(group_pad, head_dim_pad, max_query_len, _dot_f32(q))
    block_q = rows // group_pad
    grid = (triton.cdiv(q.shape[0], block_q) + num_seqs, num_kv_heads)
    _prefill_kernel[grid](
        out, q, k_cache, v_cache, query_start_loc, seq_lens, block_tables,
        _score_scale(scale, softcap, k_cache, k_scale), v_scale, num_seqs,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        GROUP=group, GROUP_PAD=group_pad, BLOCK_Q=block_q, BLOCK_N=block_n,
        BLOCK_SIZE=k_cache.shape[1], HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad, DOT_F32=_dot_f32(q),
        PRECISION=_precision(), CAUSAL=causal, SLIDING_WINDOW=sliding_window or 0, SOFTCAP=float(softcap or 0.0),
        KV_FP8=is_fp8(k_cache), num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip


def _launch_decode(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, scale, num_splits, out,
                   sliding_window=None, softcap=None, k_scale=1.0, v_scale=1.0, fused_reduce=True):
    """Split-KV partial kernel on a (B, KVH, num_splits) grid whose last split per (sequence, kv head) merges the
    partials (fused_reduce, when B * KVH counters fit), else followed by the reduction kernel on (B, KVH). Both
    merge in the same order, to the same bits."""
    num_seqs = seq_lens.shape[0]
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    head_dim_pad = max(16, triton.next_power_of_2(head_dim))
    # One float32 workspace (one allocation): [acc (D_PAD) | max | sum] per (sequence, head, split).
    parts = num_seqs * num_heads * num_splits
    workspace = torch.empty(parts * (head_dim_pad + 2), dtype=torch.float32, device=q.device)
    part_acc = workspace[: parts * head_dim_pad]
    part_max = workspace[parts * head_dim_pad : parts * (head_dim_pad + 1)]
    part_sum = workspace[parts * (head_dim_pad + 1) :]
    pdl = pdl_enabled(q.device)
    fused_reduce = fused_reduce and num_seqs * num_kv_heads <= DECODE_COUNTER_SLOTS
    counters = arrival_counters("split-KV decode", q.device, DECODE_COUNTER_SLOTS) if fused_reduce else part_sum
    splits_pad = triton.next_power_of_2(num_splits)
    heads_per_pass, block_n, num_warps, num_stages = decode_config(group, num_splits, head_dim_pad, _dot_f32(q))
    _decode_partial_kernel[(num_seqs, num_kv_heads, num_splits)](
        part_acc, part_max, part_sum, out, counters, q, k_cache, v_cache, query_start_loc, seq_lens, block_tables,
        _score_scale(scale, softcap, k_cache, k_scale), v_scale, num_heads,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        NUM_SPLITS=num_splits, GROUP=group, BLOCK_H=max(16, triton.next_power_of_2(group)),
        BLOCK_N=block_n, BLOCK_SIZE=k_cache.shape[1], HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad,
        DOT_F32=_dot_f32(q), PRECISION=_precision(), SLIDING_WINDOW=sliding_window or 0,
        SOFTCAP=float(softcap or 0.0), KV_FP8=is_fp8(k_cache), FUSED_REDUCE=fused_reduce, SPLITS_PAD=splits_pad,
        MERGE_HEADS=heads_per_pass, USE_PDL=pdl, num_warps=num_warps, num_stages=num_stages, launch_pdl=pdl,
    )  # fmt: skip
    if not fused_reduce:
        _decode_reduce_kernel[(num_seqs, num_kv_heads)](
            out, part_acc, part_max, part_sum, query_start_loc, seq_lens, num_heads, out.stride(0), out.stride(1),
            GROUP=group, MERGE_HEADS=heads_per_pass, NUM_SPLITS=num_splits, SPLITS_PAD=splits_pad,
            HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad, BLOCK_N=block_n, SLIDING_WINDOW=sliding_window or 0,
            USE_PDL=pdl, num_warps=num_warps, launch_pdl=pdl,
        )  # fmt: skip


def _is_decode(q: torch.Tensor, query_start_loc: torch.Tensor, max_query_len: int | None) -> bool:
    """Every q_len <= 1? Known from max_query_len; else T > B rules it out, and only T <= B costs a host sync."""
    if max_query_len is not None:
        return max_query_len <= 1
    if q.shape[0] > query_start_loc.shape[0] - 1:
        return False
    return bool((query_start_loc[1:] - query_start_loc[:-1]).max() <= 1)


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    *,
    max_query_len: int | None = None,
    max_seq_len: int | None = None,
    out: torch.Tensor | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Causal attention of a mixed batch over the paged KV cache; the semantics of `reference.paged_attention`
    (sliding_window, softcap and an FP8 cache with its k_scale / v_scale included: each is a compile-time flag
    of the kernels).

    q: [T, H, D] (token and head strides free, last dim contiguous); k_cache, v_cache: [NB, BS, KVH, D] in q's
    dtype or both float8_e4m3fn, BS a power of two; query_start_loc: [B + 1], seq_lens: [B], block_tables: [B, MAXB], all int32 or
    int64 on q's device. max_query_len / max_seq_len: host upper bounds; with max_query_len given, no host sync
    happens and, for decode (max_query_len == 1), the launch is CUDA-graph capturable: the split count depends
    only on B, KVH, max_seq_len (else block_tables' width), so a captured graph must be replayed with the same
    max_seq_len it was captured with (pass the model's max length, or None). out: optional [T, H, D] buffer.
    Rows of out that belong to no sequence (T > query_start_loc[B]) are left unwritten. A sequence with
    seq_len 0 and a query gets zeros instead of the reference's NaN. Decode calls share one buffer of arrival
    counters per device, so they must not overlap on two streams of one device (as the decode GEMV's).
    """
    _check_inputs(q, k_cache, v_cache, block_tables)
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    num_seqs = seq_lens.shape[0]
    if q.shape[0] == 0 or num_seqs == 0:
        return out
    if _is_decode(q, query_start_loc, max_query_len):
        kv_bound = max_seq_len if max_seq_len is not None else block_tables.shape[1] * k_cache.shape[1]
        if sliding_window:  # the visible span, plus the partial block it may start in
            kv_bound = min(kv_bound, sliding_window + DECODE_BLOCK_N)
        splits = decode_num_splits(num_seqs, k_cache.shape[2], kv_bound, _num_sms(q.device))
        _launch_decode(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, scale, splits, out,
                       sliding_window=sliding_window, softcap=softcap, k_scale=k_scale, v_scale=v_scale)
    else:
        _launch_prefill(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, scale, max_query_len, out,
                        sliding_window=sliding_window, softcap=softcap, k_scale=k_scale, v_scale=v_scale)
    return out


def paged_attention_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    num_splits: int,
    out: torch.Tensor | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    fused_reduce: bool = True,
) -> torch.Tensor:
    """The split-KV decode path with an explicit split count (tests and benchmarks); every q_len must be <= 1.
    fused_reduce=False: the separate reduction kernel (the same bits, one launch more)."""
    _check_inputs(q, k_cache, v_cache, block_tables)
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if q.shape[0] and seq_lens.shape[0]:
        _launch_decode(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, scale, num_splits, out,
                       sliding_window, softcap, k_scale, v_scale, fused_reduce)
    return out


def varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    *,
    max_len: int,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Bidirectional attention within each sequence of a flat batch, without a KV cache (encoders); the
    semantics of `reference.varlen_attention`.

    q: [T, H, D]; k, v: [T, KVH, D] (token and head strides free, last dim contiguous, e.g. views of a fused qkv);
    query_start_loc: [B + 1] int32 on q's device; max_len: host bound of the longest sequence. The 2D prefill
    kernel runs without its causal mask over k and v seen as a paged cache of one-token pages, so no copy is
    made: page j of sequence b is token query_start_loc[b] + j.
    """
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    num_seqs = query_start_loc.shape[0] - 1
    if q.shape[0] == 0 or num_seqs == 0:
        return out
    k_pages, v_pages = k.unsqueeze(1), v.unsqueeze(1)  # [T, 1, KVH, D]
    seq_lens = (query_start_loc[1:] - query_start_loc[:-1]).to(torch.int32)  # [B]
    pages = torch.arange(max_len, dtype=torch.int32, device=q.device)
    block_tables = (query_start_loc[:-1, None] + pages[None, :]).clamp_(max=q.shape[0] - 1).to(torch.int32)
    _check_inputs(q, k_pages, v_pages, block_tables)
    _launch_prefill(q, k_pages, v_pages, query_start_loc, seq_lens, block_tables, scale, max_len, out, causal=False)
    return out


__all__ = ["paged_attention", "paged_attention_decode", "decode_num_splits", "varlen_attention"]

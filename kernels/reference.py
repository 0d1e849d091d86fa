"""Pure-torch references for every kernel family in this package.

These functions define what each Triton kernel must compute; the engine also runs them directly on CPU.
They favour clarity over speed, but they are vectorised enough to serve a small model on CPU.
Nothing here imports the engine.

Shapes (T = tokens in the flat batch, B = sequences, H = hidden size, D = head dim):
    paged KV cache, per layer: k_cache, v_cache: [num_blocks, block_size, num_kv_heads, D]
    slot = block_id * block_size + offset_in_block; slot < 0 means "padding, write nothing".

FP8 KV cache (caches of dtype float8_e4m3fn): every cache writer stores round(clamp(x * (1 / scale), +-448)) and
every reader sees stored * scale, with one float32 scale per layer for K and one for V (`quantize_kv`,
`dequantize_kv`; vLLM's k_scale / v_scale). Caches of any other dtype ignore the scales.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from .quant_reference import dequantize_fp8_groups, dequantize_packed_rows


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [..., H] (e.g. [T, H] or [T, heads, H]), weight: [H] -> x's shape in promote(x, weight) dtype, each
    row of H normalised. Math in float32, as transformers does."""
    x32 = x.float()
    variance = x32.pow(2).mean(-1, keepdim=True)
    return weight * (x32 * torch.rsqrt(variance + eps)).to(x.dtype)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """residual' = x + residual; returns (rms_norm(residual'), residual'). Shapes [T, H]."""
    new_residual = x + residual
    return rms_norm(new_residual, weight, eps), new_residual


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [T, 2I] laid out as [gate | up] -> silu(gate) * up: [T, I]."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [T, 2I] laid out as [gate | up] -> gelu_tanh(gate) * up: [T, I] (GeGLU, Gemma)."""
    gate, up = x.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def rotary_embedding(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox-style rotary embedding (rotate halves), as HF Llama applies it.

    positions: [T] int; q: [T, num_heads * D]; k: [T, num_kv_heads * D];
    cos_sin_cache: [max_position, D] float32 holding [cos(theta) | sin(theta)], each D/2 wide.
    Returns new (q, k) in the input dtypes; the Triton kernel does the same in place.
    """
    cos, sin = cos_sin_cache[positions.long()].chunk(2, dim=-1)  # [T, D/2] each
    cos = torch.cat((cos, cos), dim=-1).unsqueeze(1)  # [T, 1, D]
    sin = torch.cat((sin, sin), dim=-1).unsqueeze(1)

    def rotate(x: torch.Tensor) -> torch.Tensor:
        xs = x.view(x.shape[0], -1, head_dim)
        x1, x2 = xs.chunk(2, dim=-1)
        rotated = torch.cat((-x2, x1), dim=-1)
        out = xs.float() * cos + rotated.float() * sin
        return out.to(x.dtype).view_as(x)

    return rotate(q), rotate(k)


FP8_KV_DTYPE = torch.float8_e4m3fn
FP8_E4M3_MAX = torch.finfo(FP8_KV_DTYPE).max  # 448: the largest finite e4m3 value; quantization saturates there


def is_fp8(cache: torch.Tensor) -> bool:
    """True for a cache stored in e4m3 (read and written through the layer's k_scale / v_scale)."""
    return cache.dtype == FP8_KV_DTYPE


def quantize_kv(x: torch.Tensor, scale: float, cache_dtype: torch.dtype) -> torch.Tensor:
    """x in the cache's dtype: for an FP8 cache x * (1 / scale) in float32, saturated to +-448, rounded to the
    nearest e4m3 value (ties to even); any other dtype a plain cast. The reciprocal is one float32 number, so the
    Triton kernels compute the very same product."""
    if cache_dtype != FP8_KV_DTYPE:
        return x.to(cache_dtype)
    inv = torch.tensor(1.0 / scale, dtype=torch.float32)
    return (x.float() * inv).clamp_(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(FP8_KV_DTYPE)


def dequantize_kv(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """Cached values as `dtype`: an FP8 cache's values times scale (in float32, then cast); others a plain cast."""
    if x.dtype != FP8_KV_DTYPE:
        return x.to(dtype)
    return (x.float() * scale).to(dtype)


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Write key/value [T, num_kv_heads, D] into the paged caches at slot_mapping [T] (in place).

    Slots < 0 are padding (CUDA-graph batches) and are skipped. An FP8 cache stores `quantize_kv(x, scale)`.
    """
    valid = slot_mapping >= 0
    slots = slot_mapping[valid].long()
    block_size = k_cache.shape[1]
    blocks, offsets = slots // block_size, slots % block_size
    k_cache[blocks, offsets] = quantize_kv(key[valid], k_scale, k_cache.dtype)
    v_cache[blocks, offsets] = quantize_kv(value[valid], v_scale, v_cache.dtype)


def rotary_and_cache(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    *,
    q_norm_weight: Optional[torch.Tensor] = None,
    k_norm_weight: Optional[torch.Tensor] = None,
    eps: Optional[float] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """rotary_embedding of q [T, H, D] and k [T, KVH, D], then reshape_and_cache of the rotated k and v [T, KVH, D];
    returns the rotated (q, k) as new tensors (the Triton kernel rotates them in place).
    q_norm_weight, k_norm_weight [D] and eps (Qwen3): q and k are rms_norm'ed over each head first."""
    if q_norm_weight is not None:
        q, k = rms_norm(q, q_norm_weight, eps), rms_norm(k, k_norm_weight, eps)
    head_dim = q.shape[-1]
    q_rot, k_rot = rotary_embedding(positions, q.flatten(1), k.flatten(1), cos_sin_cache, head_dim)
    q_rot, k_rot = q_rot.view(q.shape), k_rot.view(k.shape)
    reshape_and_cache(k_rot, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    return q_rot, k_rot


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """The first seq_len cached tokens of one sequence: [seq_len, num_kv_heads, D]."""
    block_size = cache.shape[1]
    num_blocks = (seq_len + block_size - 1) // block_size
    blocks = cache[block_table[:num_blocks].long()]  # [n, block_size, kvh, D]
    return blocks.reshape(-1, *cache.shape[2:])[:seq_len]


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    sliding_window: Optional[int] = None,
    softcap: Optional[float] = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Causal attention of a mixed batch over the paged KV cache (new K/V already written).

    q: [T, num_heads, D]; query_start_loc: [B + 1] (sequence b owns q rows qsl[b]:qsl[b+1]);
    seq_lens: [B] tokens in context after this step, new ones included; block_tables: [B, max_blocks].
    Query row i of sequence b sits at position p = seq_len - q_len + i and sees keys 0..p, or with a
    sliding_window W only the last W of them (p - W < key <= p, as transformers' sliding-window mask).
    softcap: scores (after `scale`) become softcap * tanh(score / softcap) before the softmax (Gemma 2).
    Returns [T, num_heads, D] in q's dtype. Grouped-query attention: head h reads kv head h // (H / KVH).
    Decode rows (one query each) are computed together in one padded batch; prefill rows one sequence at a time.
    Blocks wholly outside every query's window are never read (they may have been freed and reused).
    An FP8 cache is read as `dequantize_kv(cache, k_scale / v_scale, q.dtype)`.
    """
    out = torch.empty_like(q)
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    q_lens = [starts[b + 1] - starts[b] for b in range(len(lens))]
    decode = [b for b, n in enumerate(q_lens) if n == 1]
    if decode:
        rows = torch.tensor([starts[b] for b in decode], device=q.device)
        out[rows] = _decode_attention(q[rows], k_cache, v_cache, [lens[b] for b in decode], block_tables[decode],
                                      scale, sliding_window, softcap, k_scale, v_scale)
    for b, seq_len in enumerate(lens):
        if q_lens[b] > 1:
            start, end = starts[b], starts[b + 1]
            out[start:end] = _prefill_attention(q[start:end], k_cache, v_cache, seq_len, block_tables[b], scale,
                                                sliding_window, softcap, k_scale, v_scale)
    return out


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor], scale: float,
           softcap: Optional[float] = None) -> torch.Tensor:
    """softmax(cap(q k^T * scale) masked) v over the last two dims: q [..., Lq, D], k, v [..., Lk, D] (leading
    dims broadcast); mask: bool [..., Lq, Lk], True = visible, or None. Without softcap, one SDPA call."""
    if softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    scores = torch.matmul(q, k.transpose(-1, -2)).float() * scale
    scores = torch.tanh(scores / softcap) * softcap
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1).to(v.dtype), v)


def visible_keys(q_pos: torch.Tensor, key_pos: torch.Tensor, sliding_window: Optional[int]) -> torch.Tensor:
    """Causal (and sliding-window) visibility [Lq, Lk] of keys at key_pos [Lk] to queries at q_pos [Lq]."""
    visible = key_pos[None, :] <= q_pos[:, None]
    if sliding_window is not None:
        visible &= key_pos[None, :] > q_pos[:, None] - sliding_window
    return visible


def first_visible_key(q_pos: int, sliding_window: Optional[int]) -> int:
    """The earliest key position a query at q_pos sees."""
    return 0 if sliding_window is None else max(0, q_pos - sliding_window + 1)


def _expand_kv(x: torch.Tensor, num_heads: int) -> torch.Tensor:
    """[..., S, KVH, D] -> [..., H, S, D], repeating each kv head for its group of query heads."""
    return x.transpose(-3, -2).repeat_interleave(num_heads // x.shape[-2], dim=-3)


def _prefill_attention(q, k_cache, v_cache, seq_len: int, block_table, scale: float,
                       sliding_window: Optional[int], softcap: Optional[float], k_scale: float = 1.0,
                       v_scale: float = 1.0) -> torch.Tensor:
    """One sequence: q [q_len, H, D] over its cached tokens, from the first block any of its queries sees."""
    q_len, num_heads, block_size = q.shape[0], q.shape[1], k_cache.shape[1]
    first_block = first_visible_key(seq_len - q_len, sliding_window) // block_size
    key_start = first_block * block_size
    k = gather_kv(k_cache, block_table[first_block:], seq_len - key_start)  # [S', KVH, D]
    v = gather_kv(v_cache, block_table[first_block:], seq_len - key_start)
    k = dequantize_kv(_expand_kv(k, num_heads), k_scale, q.dtype)  # [H, S', D]
    v = dequantize_kv(_expand_kv(v, num_heads), v_scale, q.dtype)
    q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
    mask = visible_keys(q_pos, torch.arange(key_start, seq_len, device=q.device), sliding_window)  # [q_len, S']
    return attend(q.transpose(0, 1), k, v, mask, scale, softcap).transpose(0, 1)


def _decode_attention(q, k_cache, v_cache, lens: list[int], block_tables, scale: float,
                      sliding_window: Optional[int], softcap: Optional[float], k_scale: float = 1.0,
                      v_scale: float = 1.0) -> torch.Tensor:
    """Bd sequences with one query each: q [Bd, H, D]; each reads from the first block its query sees, keys
    padded to the longest such span and masked."""
    num_heads, block_size = q.shape[1], k_cache.shape[1]
    first_blocks = [first_visible_key(n - 1, sliding_window) // block_size for n in lens]
    num_blocks = max(-(-n // block_size) - f for n, f in zip(lens, first_blocks))
    # table columns first_block .. first_block + num_blocks - 1 of each row (past the row's end: masked anyway)
    cols = torch.tensor(first_blocks, device=q.device)[:, None] + torch.arange(num_blocks, device=q.device)
    tables = block_tables.long().gather(1, cols.clamp(max=block_tables.shape[1] - 1))  # [Bd, nb]
    k = k_cache[tables].flatten(1, 2)  # [Bd, L, KVH, D]
    v = v_cache[tables].flatten(1, 2)
    k = dequantize_kv(_expand_kv(k, num_heads), k_scale, q.dtype)  # [Bd, H, L, D]
    v = dequantize_kv(_expand_kv(v, num_heads), v_scale, q.dtype)
    key_pos = cols[:, :, None] * block_size + torch.arange(block_size, device=q.device)  # [Bd, nb, bs]
    key_pos = key_pos.flatten(1)  # [Bd, L]
    q_pos = torch.tensor(lens, device=q.device)[:, None] - 1  # [Bd, 1]
    valid = key_pos <= q_pos
    if sliding_window is not None:
        valid &= key_pos > q_pos - sliding_window
    out = attend(q.unsqueeze(2), k, v, valid[:, None, None, :], scale, softcap)
    return out.squeeze(2)


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, query_start_loc: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """Bidirectional attention within each sequence of a flat batch (encoders), no KV cache.

    q: [T, H, D]; k, v: [T, KVH, D]; query_start_loc: [B + 1] (host); -> [T, H, D]. Every token of sequence b
    attends to every token of b. The sequences are padded to the longest one and masked, one SDPA call in all.
    """
    starts = query_start_loc.tolist()
    lens = torch.tensor([b - a for a, b in zip(starts[:-1], starts[1:])], dtype=torch.int64)
    num_seqs, max_len = len(lens), int(lens.max()) if len(lens) else 0
    seq_of_token = torch.repeat_interleave(torch.arange(num_seqs), lens).to(q.device)  # [T]
    index_in_seq = (torch.arange(q.shape[0]) - torch.repeat_interleave(query_start_loc[:-1].long(), lens)).to(q.device)

    def padded(x: torch.Tensor) -> torch.Tensor:  # [T, h, D] -> [B, L, h, D], zeros past each sequence's end
        out = x.new_zeros(num_seqs, max_len, x.shape[1], x.shape[2])
        out[seq_of_token, index_in_seq] = x
        return out

    num_heads = q.shape[1]
    key_valid = (torch.arange(max_len)[None, :] < lens[:, None]).to(q.device)  # [B, L]
    out = F.scaled_dot_product_attention(
        padded(q).transpose(1, 2), _expand_kv(padded(k), num_heads), _expand_kv(padded(v), num_heads),
        attn_mask=key_valid[:, None, None, :], scale=scale,
    )  # [B, H, L, D]
    return out.transpose(1, 2)[seq_of_token, index_in_seq]


def topk_softmax(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Mixture-of-experts routing as transformers computes it: router_logits [T, E] -> (weights [T, K] float32,
    ids [T, K] int64): softmax over all experts in float32, torch.topk of the probabilities (its order, and its
    choice among tied ones), divided by their sum when `renormalize`."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def route(hidden: torch.Tensor, gate_weight: torch.Tensor, top_k: int, renormalize: bool):
    """Mixture-of-experts router and routing: logits [T, E] = hidden [T, H] @ gate_weight [E, H]^T in hidden's
    dtype (as transformers' gate), then `topk_softmax` -> (weights [T, K] float32, ids [T, K] int64)."""
    return topk_softmax(F.linear(hidden, gate_weight), top_k, renormalize)


def fused_moe(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, w13_scale: Optional[torch.Tensor] = None,
              w2_scale: Optional[torch.Tensor] = None, group_size: Optional[int] = None,
              w13_zeros: Optional[torch.Tensor] = None, w2_zeros: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Mixture of gated-MLP experts: each token through its top-k experts, outputs summed with routing weights.

    hidden: [T, H]; w13: [E, 2I, H] laid out as [gate | up] along dim 1; w2: [E, H, I];
    topk_weights: [T, K] (float32); topk_ids: [T, K] int, each in [0, E).
    out[t] = sum_k topk_weights[t, k] * w2[e] @ (silu(w13[e, :I] @ x_t) * (w13[e, I:] @ x_t)), e = topk_ids[t, k].
    Each expert's projections run in the input dtype (as a GEMM would); the weighted sum is taken in float32 and
    rounded once. Returns [T, H] in hidden's dtype. One loop iteration per expert that has tokens.
    FP8 experts (block-wise checkpoints): w13 / w2 in e4m3 with group scales w13_scale [E, ceil(H / g), 2I] and
    w2_scale [E, ceil(I / g), H], g = group_size (quant_reference.dequantize_fp8_groups), each used expert's weights
    dequantized to hidden's dtype first.
    Int4 experts (GPTQ / AWQ checkpoints): w13 [E, 2I, H / 8] and w2 [E, H, I / 8] int32, each row's inputs packed
    8 a word (quant_reference's packed layout along the rows: dequantize_packed_rows), with group scales and zero
    points w13_zeros / w2_zeros of the same shapes as FP8's scales (in hidden's dtype in the kernels), each used
    expert's weights dequantized in the scales' dtype, then cast to hidden's.
    """
    def expert_weights(e: int) -> tuple[torch.Tensor, torch.Tensor]:
        if w13_zeros is not None:
            return (dequantize_packed_rows(w13[e], w13_scale[e], w13_zeros[e], group_size).to(hidden.dtype),
                    dequantize_packed_rows(w2[e], w2_scale[e], w2_zeros[e], group_size).to(hidden.dtype))
        if w13_scale is None:
            return w13[e], w2[e]
        return (dequantize_fp8_groups(w13[e], w13_scale[e], group_size, hidden.dtype),
                dequantize_fp8_groups(w2[e], w2_scale[e], group_size, hidden.dtype))

    tokens, top_k = topk_ids.shape
    out = torch.zeros(tokens, hidden.shape[1], dtype=torch.float32, device=hidden.device)
    flat_ids = topk_ids.reshape(-1)
    for expert in flat_ids.unique().tolist():
        slots = (flat_ids == expert).nonzero().squeeze(1)  # positions in the flattened [T * K] assignments
        rows = slots // top_k
        x = hidden[rows]  # [n, H]
        gate_up, down_weight = expert_weights(expert)
        down = F.linear(silu_and_mul(F.linear(x, gate_up)), down_weight)  # [n, H]
        out.index_add_(0, rows, down.float() * topk_weights.reshape(-1)[slots, None].float())
    return out.to(hidden.dtype)

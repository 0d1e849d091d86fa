"""Fast CPU kernels: the same contracts as `kernels/reference.py`, written for speed on a CPU with plain torch ops.

The references gather and expand every sequence's K/V for every layer (`repeat_interleave` for grouped-query
attention, one gather per prefill sequence). Here the work that does not depend on the layer is done once per step
(`plan_attention`: index tensors and masks on the host), and each layer then does:
  - decode rows (one query each), all together: ONE `index_select` per cache of the blocks they read, into a
    buffer the plan owns and every layer reuses, then one SDPA call where grouped-query attention is a reshape of
    the queries (q [Bd, H, D] -> [Bd, KVH, G, D]: the G query heads of a kv head are G query rows of that head),
    never a copy of K/V per query head;
  - prefill rows, one sequence at a time: a prompt with no cached prefix attends to this step's own keys (no
    gather, `is_causal`); a chunk after a cached prefix gathers its blocks once; both use SDPA with the kv heads
    broadcast over their query heads by a stride-0 view.
Decode rows in a float32 cache go to `cpu_native.decode_attention` when the native kernels are built (a C loop that
reads each row's blocks in place: no gather, no copy; see cpu_native.py), and the rest of this paragraph describes
the torch path that runs otherwise (other dtypes, no C compiler, ASYNCENGINE_CPU_NATIVE=0).
Across steps, `DecodeKVMirror` keeps the decode rows' K/V contiguous: while the decode rows stay the same
sequences, each growing by one token a step, a layer appends each row's new key instead of gathering every block
again (session 9's profile of the default model, 64 x 64 greedy: the gathers were 22% of the model thread's time).
The engine allocates CPU caches with `allocate_kv_cache`: the [num_blocks, block_size, KVH, D] tensor every path
indexes, stored heads-major ([KVH, num_blocks, block_size, D] in memory, a permuted view). Gathering a decode
batch's blocks from that storage gives each (sequence, kv head) its keys as one contiguous [L, D] matrix, the
layout SDPA's CPU kernel reads fastest (measured: its decode call takes 0.55 ms instead of 0.80 ms at 64 sequences
of 112 keys, 2 kv heads). The kernels here also accept caches in the plain layout (tests, the references' own).
An FP8 cache (float8_e4m3fn) holds `reference.quantize_kv(x, scale)` and is read as `reference.dequantize_kv`; a
prompt with no cached prefix attends to its own keys rounded through e4m3 the same way, so every path sees the
values the cache holds (torch has no CPU index_copy_ for e4m3: the writes copy the bytes as uint8).
Element-wise work is fused where torch allows it (in-place residual add, rotary on strided views in place).
Nothing here imports the engine. Shapes as in `reference.py` (T tokens, B sequences, H heads, KVH kv heads, D).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import torch
import torch.nn.functional as F

from asyncengine.kernels import cpu_native, reference


@dataclass
class PrefillPlan:
    """One sequence with more than one query row: q rows start:end, seq_len keys after this step."""

    start: int
    end: int
    seq_len: int
    blocks: Optional[torch.Tensor]  # [nb] int64 cache blocks to read; None: no cached prefix, use the new K/V
    mask: Optional[torch.Tensor]  # [q_len, S] bool (True = visible); None with blocks None and no window (is_causal)
    key_start: int = 0  # position of the first key read (the first block any query of a sliding window sees)


@dataclass
class AttentionPlan:
    """Index tensors of one step's attention, built once on the host and shared by every layer.

    decode_rows: [Bd] int64 q rows of the decode sequences (None when every row decodes: rows 0..T-1 in order);
    decode_blocks: [Bd * nb] int64 the blocks each decode sequence reads, row-major, padded with block 0;
    decode_mask: [Bd, 1, 1, nb * block_size] bool, True for a key the row sees; None when none is padding.
    decode_tables: [Bd, W] int32 the decode rows' block tables; decode_lens: [Bd] int32 their lengths (the native
    kernel's inputs; None without decode rows).
    Layers with a sliding window use `for_window(W)`, the same step's plan under that window (built once).
    """

    num_decode: int
    decode_rows: Optional[torch.Tensor]
    decode_blocks: Optional[torch.Tensor]
    decode_mask: Optional[torch.Tensor]
    prefills: list[PrefillPlan]
    decode_tables: Optional[torch.Tensor] = None
    decode_lens: Optional[torch.Tensor] = None
    sliding_window: Optional[int] = None
    # the step's host layout (query_start_loc, seq_lens, block_tables, block_size), for the windowed variants
    layout: Optional[tuple] = None
    # the decode rows' place in the engine's DecodeKVMirror (None: gather every layer, e.g. under a window)
    mirror: Optional["MirrorStep"] = None
    # gather buffers for the decode rows, allocated on first use and reused by every layer of the step
    _buffers: dict = field(default_factory=dict)
    _windowed: dict = field(default_factory=dict)

    def decode_bias(self, dtype: torch.dtype) -> Optional[torch.Tensor]:
        """decode_mask as SDPA's additive mask [Bd, 1, 1, L] in `dtype` (0 visible, -inf hidden), made once per
        step and dtype: SDPA turns a bool mask into this on every call, that is in every layer."""
        if self.decode_mask is None:
            return None
        bias = self._buffers.get(("bias", dtype))
        if bias is None:
            bias = torch.zeros(self.decode_mask.shape, dtype=dtype).masked_fill_(~self.decode_mask, float("-inf"))
            self._buffers[("bias", dtype)] = bias
        return bias

    def gather_buffer(self, name: str, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
        """A buffer of `shape` in `like`'s dtype, one per name, made on first use."""
        buf = self._buffers.get(name)
        if buf is None:
            buf = torch.empty(shape, dtype=like.dtype, device=like.device)
            self._buffers[name] = buf
        return buf

    def for_window(self, sliding_window: Optional[int]) -> "AttentionPlan":
        """This step's plan for layers whose queries see only the last `sliding_window` keys (None: self)."""
        if sliding_window is None:
            return self
        plan = self._windowed.get(sliding_window)
        if plan is None:
            plan = self._windowed[sliding_window] = plan_attention(*self.layout, sliding_window=sliding_window)
        return plan


def _first_visible(q_pos, sliding_window: Optional[int]):
    """The earliest key position visible to queries at q_pos (int or array)."""
    return 0 * q_pos if sliding_window is None else np.maximum(0, q_pos - sliding_window + 1)


def _visible(q_pos: np.ndarray, key_pos: np.ndarray, sliding_window: Optional[int]) -> np.ndarray:
    """Causal (and windowed) visibility, broadcast over q_pos [..., 1] and key_pos [..., L]."""
    visible = key_pos <= q_pos
    if sliding_window is not None:
        visible &= key_pos > q_pos - sliding_window
    return visible


# -- the cache's layout ----------------------------------------------------------------------------------------------
def allocate_kv_cache(shape: tuple[int, int, int, int], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed cache of logical shape [num_blocks, block_size, KVH, D], stored heads-major ([KVH, num_blocks,
    block_size, D] contiguous). Every reader indexes it by its logical shape; the kernels here use the storage."""
    num_blocks, block_size, kv_heads, head_dim = shape
    return torch.zeros(kv_heads, num_blocks, block_size, head_dim, dtype=dtype).permute(1, 2, 0, 3)


def heads_major(cache: torch.Tensor) -> Optional[torch.Tensor]:
    """The [KVH, num_blocks, block_size, D] contiguous storage of a cache from `allocate_kv_cache`; None for a
    cache in the plain layout (contiguous [num_blocks, block_size, KVH, D])."""
    storage = cache.permute(2, 0, 1, 3)
    return storage if storage.is_contiguous() else None  # (with one kv head both layouts coincide)


def plan_attention(query_start_loc: np.ndarray, seq_lens: np.ndarray, block_tables: np.ndarray,
                   block_size: int, sliding_window: Optional[int] = None,
                   mirror: Optional["DecodeKVMirror"] = None) -> AttentionPlan:
    """The plan of a step from its host-side layout: query_start_loc [B + 1], seq_lens [B], block_tables
    [B, max_blocks] (numpy ints). With a sliding window, each sequence reads only from the first block that one
    of its queries sees (earlier blocks may have been freed). With `mirror` (the engine's, one per cache set;
    plans must be made in the order their forwards run), the layers without a window read the decode rows'
    K/V from it."""
    q_lens = np.diff(query_start_loc)
    decode = np.flatnonzero(q_lens == 1)
    num_decode = len(decode)
    rows = blocks = mask = tables = lens = None
    if num_decode:
        blocks, mask = _plan_decode(seq_lens[decode].astype(np.int64), block_tables[decode], block_size,
                                    sliding_window)
        if num_decode != len(q_lens):
            rows = torch.from_numpy(query_start_loc[decode].astype(np.int64))
        tables = torch.from_numpy(np.ascontiguousarray(block_tables[decode], dtype=np.int32))
        lens = torch.from_numpy(np.ascontiguousarray(seq_lens[decode], dtype=np.int32))
    prefills = []
    for b in np.flatnonzero(q_lens > 1).tolist():
        start, end, seq_len = int(query_start_loc[b]), int(query_start_loc[b + 1]), int(seq_lens[b])
        prefills.append(_plan_prefill(start, end, seq_len, block_tables[b], block_size, sliding_window))
    layout = (query_start_loc, seq_lens, block_tables, block_size)
    mirror_step = None
    if mirror is not None and num_decode and sliding_window is None:
        keys_len = blocks.shape[0] // num_decode * block_size
        mirror_step = mirror.begin_step(seq_lens[decode], block_tables[decode], block_size, keys_len)
    elif mirror is not None:
        mirror.begin_step_without_decode_rows()
    return AttentionPlan(num_decode, rows, blocks, mask, prefills, decode_tables=tables, decode_lens=lens,
                         sliding_window=sliding_window, layout=layout, mirror=mirror_step)


def _plan_decode(lens: np.ndarray, tables: np.ndarray, block_size: int, sliding_window: Optional[int]):
    """(blocks [Bd * nb] int64, mask [Bd, 1, 1, nb * block_size] bool or None) of the decode rows."""
    num_decode = len(lens)
    first = _first_visible(lens - 1, sliding_window) // block_size  # [Bd] first block each row reads
    nb = int((-(-lens // block_size) - first).max())
    cols = first[:, None] + np.arange(nb)[None, :]  # [Bd, nb]
    in_table = cols < tables.shape[1]
    picked = np.where(in_table, np.take_along_axis(tables, np.minimum(cols, tables.shape[1] - 1), axis=1), 0)
    blocks = torch.from_numpy(np.ascontiguousarray(picked, dtype=np.int64).reshape(-1))
    key_pos = (cols[:, :, None] * block_size + np.arange(block_size)).reshape(num_decode, -1)  # [Bd, L]
    visible = _visible((lens - 1)[:, None], key_pos, sliding_window)
    if visible.all():
        return blocks, None
    return blocks, torch.from_numpy(visible).view(num_decode, 1, 1, nb * block_size)


def _plan_prefill(start: int, end: int, seq_len: int, table: np.ndarray, block_size: int,
                  sliding_window: Optional[int]) -> PrefillPlan:
    q_len = end - start
    q_pos = np.arange(seq_len - q_len, seq_len)[:, None]
    if q_len == seq_len:  # the whole context is new: attend to this step's keys, causally
        mask = None if sliding_window is None else torch.from_numpy(_visible(q_pos, np.arange(seq_len)[None, :],
                                                                              sliding_window))
        return PrefillPlan(start, end, seq_len, None, mask)
    first = int(_first_visible(seq_len - q_len, sliding_window)) // block_size
    key_start = first * block_size
    blocks = torch.from_numpy(table[first: -(-seq_len // block_size)].astype(np.int64))
    mask = torch.from_numpy(_visible(q_pos, np.arange(key_start, seq_len)[None, :], sliding_window))
    return PrefillPlan(start, end, seq_len, blocks, mask, key_start)


def cache_and_attend(q: torch.Tensor, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                     v_cache: torch.Tensor, slot_mapping: torch.Tensor, plan: AttentionPlan,
                     scale: float, sliding_window: Optional[int] = None,
                     softcap: Optional[float] = None, k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
    """reference.reshape_and_cache then reference.paged_attention (with its sliding_window, softcap and an FP8
    cache's k_scale / v_scale), as one call.

    q: [T, H, D]; key, value: [T, KVH, D] (this step's, may be strided views); slot_mapping: [T] int64 (no
    padding slots on CPU). Returns [T, H, D] in q's dtype.
    """
    write_cache(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    plan = plan.for_window(sliding_window)
    scales = (k_scale, v_scale)
    if not plan.prefills:  # decode only: the output is the decode output, no scatter
        return decode_attention(q, k_cache, v_cache, plan, scale, softcap, *scales, new_kv=(key, value))
    out = torch.empty_like(q)
    if plan.num_decode:
        rows = plan.decode_rows
        new_kv = (key.index_select(0, rows), value.index_select(0, rows))
        out.index_copy_(0, rows, decode_attention(q.index_select(0, rows), k_cache, v_cache, plan, scale, softcap,
                                                  *scales, new_kv=new_kv))
    for p in plan.prefills:
        out[p.start:p.end] = prefill_attention(q[p.start:p.end], key[p.start:p.end], value[p.start:p.end],
                                               k_cache, v_cache, p, scale, softcap, *scales)
    return out


def write_cache(key, value, k_cache, v_cache, slot_mapping, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """key/value [T, KVH, D] into the caches at slot_mapping [T] (every slot valid): float32 into heads-major caches
    in one native pass (cpu_native.write_kv), else one index_copy_ each, along the slot axis of the cache's storage ([KVH, num_slots, D] heads-major, [num_slots, KVH, D] plain); an FP8
    cache stores `reference.quantize_kv(x, scale)`."""
    k_storage, v_storage = heads_major(k_cache), heads_major(v_cache)
    if (k_storage is not None and v_storage is not None and key.dtype == torch.float32
            and k_cache.dtype == torch.float32 and v_cache.dtype == torch.float32 and cpu_native.available()):
        shape = (k_storage.shape[0], -1, k_storage.shape[-1])  # [KVH, num_slots, D]
        cpu_native.write_kv(key, value, k_storage.view(shape), v_storage.view(shape), slot_mapping)
        return
    for new, cache, scale in ((key, k_cache, k_scale), (value, v_cache, v_scale)):
        stored = reference.quantize_kv(new, scale, cache.dtype)
        if reference.is_fp8(cache):  # no e4m3 index_copy_ on CPU: copy the bytes
            cache, stored = cache.view(torch.uint8), stored.view(torch.uint8)
        storage = heads_major(cache)
        if storage is not None:
            storage.view(storage.shape[0], -1, storage.shape[-1]).index_copy_(1, slot_mapping, stored.transpose(0, 1))
        else:
            cache.view(-1, *cache.shape[2:]).index_copy_(0, slot_mapping, stored)


def gather_blocks(cache: torch.Tensor, blocks: torch.Tensor, num_seqs: int,
                  out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The blocks [num_seqs * nb] (row-major per sequence) of a cache as [num_seqs, KVH, nb * block_size, D]: one
    index_select into `out` (a buffer from `gather_buffer_shape`, or None). Heads-major storage gives each
    (sequence, kv head) a contiguous [L, D] matrix; the plain layout a strided view."""
    storage = heads_major(cache)
    if storage is not None:  # [KVH, Bd * nb, bs, D] -> [KVH, Bd, L, D] -> [Bd, KVH, L, D]
        gathered = torch.index_select(storage, 1, blocks, out=out)
        return gathered.view(storage.shape[0], num_seqs, -1, storage.shape[-1]).transpose(0, 1)
    gathered = torch.index_select(cache, 0, blocks, out=out)  # [Bd * nb, bs, KVH, D] -> [Bd, KVH, L, D]
    return gathered.view(num_seqs, -1, *cache.shape[2:]).transpose(1, 2)


def gather_buffer_shape(cache: torch.Tensor, num_blocks: int) -> tuple[int, ...]:
    """The shape of `gather_blocks`' output buffer for num_blocks blocks of `cache`."""
    storage = heads_major(cache)
    if storage is not None:
        return (storage.shape[0], num_blocks, *storage.shape[2:])
    return (num_blocks, *cache.shape[1:])


def decode_attention(q, k_cache, v_cache, plan: AttentionPlan, scale: float,
                     softcap: Optional[float] = None, k_scale: float = 1.0, v_scale: float = 1.0,
                     new_kv: Optional[tuple[torch.Tensor, torch.Tensor]] = None) -> torch.Tensor:
    """q: [Bd, H, D], one query per sequence at its last position -> [Bd, H, D]. new_kv: the decode rows' keys
    and values of this step ([Bd, KVH, D] each, already in the cache), which let the plan's mirror append them."""
    if not reference.is_fp8(k_cache) and cpu_native.decode_attention_supported(q, heads_major(k_cache)):
        return cpu_native.decode_attention(q, heads_major(k_cache), heads_major(v_cache), plan.decode_tables,
                                           plan.decode_lens, scale, plan.sliding_window, softcap)
    num_seqs, num_heads, head_dim = q.shape
    kv_heads = k_cache.shape[2]

    def gather():
        shape = gather_buffer_shape(k_cache, plan.decode_blocks.shape[0])
        return (gather_blocks(k_cache, plan.decode_blocks, num_seqs, plan.gather_buffer("k", shape, k_cache)),
                gather_blocks(v_cache, plan.decode_blocks, num_seqs, plan.gather_buffer("v", shape, v_cache)))

    if plan.mirror is not None and new_kv is not None and not reference.is_fp8(k_cache):
        keys, values = plan.mirror.keys_values(k_cache, *new_kv, gather)
    else:
        keys, values = gather()
    if reference.is_fp8(k_cache):  # [Bd, KVH, L, D] e4m3 -> q's dtype
        keys = reference.dequantize_kv(keys, k_scale, q.dtype)
        values = reference.dequantize_kv(values, v_scale, q.dtype)
    grouped = q.view(num_seqs, kv_heads, num_heads // kv_heads, head_dim)  # [Bd, KVH, G, D]
    if softcap is None and plan.decode_mask is not None:  # the same SDPA call, its mask converted once a step
        out = F.scaled_dot_product_attention(grouped.to(keys.dtype), keys, values,
                                             attn_mask=plan.decode_bias(keys.dtype), scale=scale)
    else:
        out = reference.attend(grouped.to(keys.dtype), keys, values, plan.decode_mask, scale, softcap)
    return out.view(num_seqs, num_heads, head_dim).to(q.dtype)


def prefill_attention(q, key, value, k_cache, v_cache, p: PrefillPlan, scale: float,
                      softcap: Optional[float] = None, k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
    """One sequence: q [n, H, D]; key/value [n, KVH, D] its new rows -> [n, H, D]."""
    q_len, num_heads, head_dim = q.shape
    kv_heads = k_cache.shape[2]
    if p.blocks is None:  # [S, KVH, D] -> [KVH, S, D]
        keys, values = key.transpose(0, 1), value.transpose(0, 1)
        if reference.is_fp8(k_cache):  # what the cache holds: rounded through e4m3
            keys = reference.quantize_kv(keys, k_scale, k_cache.dtype)
            values = reference.quantize_kv(values, v_scale, v_cache.dtype)
    else:  # a chunk after a cached prefix: its whole context, from the cache, [KVH, S, D]
        keys = gather_blocks(k_cache, p.blocks, 1)[0, :, : p.seq_len - p.key_start]
        values = gather_blocks(v_cache, p.blocks, 1)[0, :, : p.seq_len - p.key_start]
    keys = reference.dequantize_kv(keys, k_scale, q.dtype)  # a no-op cast unless the cache is e4m3
    values = reference.dequantize_kv(values, v_scale, q.dtype)
    group = num_heads // kv_heads
    seq_len = keys.shape[1]
    # [KVH, S, D] -> [KVH, G, S, D] with the G axis of stride 0: each kv head seen by its G query heads
    keys = keys.unsqueeze(1).expand(kv_heads, group, seq_len, head_dim).to(q.dtype)
    values = values.unsqueeze(1).expand(kv_heads, group, seq_len, head_dim).to(q.dtype)
    grouped = q.view(q_len, kv_heads, group, head_dim).permute(1, 2, 0, 3)  # [KVH, G, n, D]
    if p.mask is None and softcap is None:
        out = F.scaled_dot_product_attention(grouped, keys, values, is_causal=True, scale=scale)
    else:
        mask = p.mask if p.mask is not None else torch.ones(q_len, seq_len, dtype=torch.bool).tril_()
        out = reference.attend(grouped, keys, values, mask, scale, softcap)
    return out.permute(2, 0, 1, 3).reshape(q_len, num_heads, head_dim)


# -- the decode rows' K/V across steps ------------------------------------------------------------------------------
MIRROR_MAX_BYTES = 512 << 20  # all layers' mirrors together; past it a layer gathers as before (host memory)


def make_decode_mirror(kv_cache_dtype: torch.dtype) -> Optional["DecodeKVMirror"]:
    """The engine's mirror for a CPU cache of this dtype, or None where the native decode attention reads the
    cache in place (float32 caches with the native kernels built): the mirror would only cost copies there."""
    if kv_cache_dtype == torch.float32 and cpu_native.available():
        return None
    return DecodeKVMirror()


@dataclass(frozen=True)
class MirrorStep:
    """One step's decode rows in a DecodeKVMirror (made on the host when the step is planned, read by its layers).

    appends_to: the step whose mirrors this one extends by one key per row (the same sequences in the same rows,
    each one token longer), or None: every layer fills its mirror by a gather this step.
    positions: [Bd] int64 where each row's new key goes (its length - 1); keys_len: the keys each row attends
    over (nb * block_size, as the gather path, so both paths run the same attention shapes and mask)."""

    owner: "DecodeKVMirror"
    step: int
    appends_to: Optional[int]
    positions: torch.Tensor
    keys_len: int

    _slots: dict = field(default_factory=dict, compare=False)

    def keys_values(self, k_cache, k_new, v_new, gather):
        return self.owner.keys_values(self, k_cache, k_new, v_new, gather)

    def append_slots(self, shape: tuple[int, ...]) -> torch.Tensor:
        """[Bd * KVH] int64: where each row's (and kv head's) new key goes in a mirror buffer of `shape` [R, KVH,
        C, D] seen as [R * KVH * C, D] rows; one index_copy_ then appends, which costs a fraction of indexing
        with (rows, :, positions). Made once per buffer shape and step (the layers' buffers mostly share one)."""
        slots = self._slots.get(shape)
        if slots is None:
            _, kv_heads, capacity, _ = shape
            rows = torch.arange(self.positions.shape[0]).unsqueeze(1) * kv_heads + torch.arange(kv_heads)  # [Bd, KVH]
            slots = self._slots[shape] = (rows * capacity + self.positions.unsqueeze(1)).reshape(-1)
        return slots


@dataclass
class _LayerMirror:
    keys: torch.Tensor  # [row capacity, KVH, key capacity, D]; a step uses [:Bd, :, :keys_len]
    values: torch.Tensor
    step: int  # the last step whose keys it holds


class DecodeKVMirror:
    """Each layer's decode-row K/V as [Bd, KVH, capacity, D] buffers (one per cache, keyed by the cache) that
    outlive the step. `begin_step` (host, every step's plan, in forward order) tells whether this step's decode
    rows are the previous step's sequences one token on; `keys_values` (the model's thread) then appends each row's new key and value, or fills
    the mirror with the gather path's result when the rows changed (or the layer skipped a step). Positions past a
    row's length hold finite stale values, which the plan's mask hides, as the gather path's padding."""

    def __init__(self, max_bytes: int = MIRROR_MAX_BYTES):
        self.max_bytes = max_bytes
        self._step = 0
        self._last: Optional[tuple] = None  # (step, lens [Bd], tables [Bd, W]) of the last step with decode rows
        self._layers: dict[int, _LayerMirror] = {}

    def begin_step(self, lens: np.ndarray, tables: np.ndarray, block_size: int, keys_len: int) -> MirrorStep:
        """lens [Bd], tables [Bd, W]: the decode rows' lengths after this step and block tables."""
        self._step += 1
        lens = lens.astype(np.int64)
        used = -(-(lens - 1) // block_size)  # blocks holding each row's earlier keys
        appends_to = self._last[0] if self._extends_last(lens, tables, used) else None
        self._last = (self._step, lens, tables.copy())
        return MirrorStep(self, self._step, appends_to, torch.from_numpy(lens - 1), keys_len)

    def begin_step_without_decode_rows(self) -> None:
        """A step with no decode rows (prefills only): the next step's decode rows cannot extend an earlier one's
        (in between, a finished sequence's blocks may have gone to a new prompt of the same length)."""
        self._step += 1
        self._last = None

    def _extends_last(self, lens, tables, used) -> bool:
        """The same sequences in the same rows, each one key longer: same count, lengths + 1, and the blocks of
        every earlier key unchanged (a row's last, partly filled block is its own: no other sequence shares it)."""
        if self._last is None:
            return False
        _, last_lens, last_tables = self._last
        if len(last_lens) != len(lens) or not np.array_equal(last_lens + 1, lens):
            return False
        width = int(used.max(initial=0))
        if width > last_tables.shape[1] or width > tables.shape[1]:
            return False
        earlier = np.arange(width)[None, :] < used[:, None]
        return bool(((last_tables[:, :width] == tables[:, :width]) | ~earlier).all())

    def keys_values(self, step: MirrorStep, k_cache, k_new, v_new, gather):
        """This layer's ([Bd, KVH, keys_len, D] keys, values) for `step`; k_new, v_new [Bd, KVH, D] this step's
        (in the cache already). gather() gives the same from the cache."""
        key = k_cache.data_ptr()
        layer = self._layers.get(key)
        rows = step.positions.shape[0]
        if (layer is not None and step.appends_to is not None and layer.step == step.appends_to
                and self._fits(layer, key, rows, step.keys_len, k_cache)):
            layer = self._layers[key]
            slots = step.append_slots(layer.keys.shape)
            for buffer, new in ((layer.keys, k_new), (layer.values, v_new)):  # [R, KVH, C, D] as [R*KVH*C, D]
                buffer.view(-1, buffer.shape[-1]).index_copy_(0, slots, new.reshape(-1, new.shape[-1]).to(buffer.dtype))
        else:
            keys, values = gather()
            if not self._fits(layer, key, rows, step.keys_len, k_cache, keep=False):
                self._layers.pop(key, None)
                return keys, values
            layer = self._layers[key]
            layer.keys[:rows, :, : step.keys_len].copy_(keys)
            layer.values[:rows, :, : step.keys_len].copy_(values)
        layer.step = step.step
        return layer.keys[:rows, :, : step.keys_len], layer.values[:rows, :, : step.keys_len]

    def _fits(self, layer: Optional[_LayerMirror], key: int, rows: int, keys_len: int, cache, keep: bool = True):
        """Make this layer's buffers hold at least `rows` rows of keys_len keys (keep: their contents too); a
        buffer grows to twice its capacity along the one that is short (fewer reallocations as sequences come,
        go and lengthen), and when it is refilled (not keep) at under a quarter of its size it shrinks to fit, so
        that what a burst of sequences took is given back once fewer decode; False (and nothing allocated) past
        max_bytes."""
        have_rows, have_keys = (0, 0) if layer is None else (layer.keys.shape[0], layer.keys.shape[2])
        oversized = not keep and have_rows * have_keys > 4 * rows * keys_len
        if rows <= have_rows and keys_len <= have_keys and not oversized:
            return True
        if oversized:
            shape = (rows, cache.shape[2], keys_len, cache.shape[3])
        else:
            shape = (have_rows if rows <= have_rows else max(rows, 2 * have_rows), cache.shape[2],
                     have_keys if keys_len <= have_keys else max(keys_len, 2 * have_keys), cache.shape[3])
        others = sum(m.keys.nbytes * 2 for k, m in self._layers.items() if k != key)
        if others + 2 * math.prod(shape) * cache.element_size() > self.max_bytes:
            return False
        grown = _LayerMirror(torch.zeros(shape, dtype=cache.dtype), torch.zeros(shape, dtype=cache.dtype),
                             layer.step if layer is not None else -1)
        if keep and layer is not None:  # (keep never shrinks)
            grown.keys[:have_rows, :, :have_keys].copy_(layer.keys)
            grown.values[:have_rows, :, :have_keys].copy_(layer.values)
        self._layers[key] = grown
        return True


# -- the LM head -------------------------------------------------------------------------------------------------
def head_logits(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """hidden [S, K] x weight [V, K] (row-major, e.g. the tied embedding) -> logits [S, V], as F.linear, but
    computed as (weight @ hidden^T)^T: MKL runs the product with the long side V as its rows about 1.5x faster than
    F.linear's hidden @ weight^T at decode sizes here (64 x 256 x 8192 on two AVX2 cores: 147 vs 100 GFLOP/s).
    The result is a transposed view [S, V] (stride (1, S)); the sampler's ops take any strides, and a contiguous
    copy would cost more than the product saves."""
    if weight.dim() != 2 or not weight.is_contiguous() or hidden.dim() != 2:
        return F.linear(hidden, weight)
    return torch.mm(weight, hidden.t()).t()


# -- element-wise --------------------------------------------------------------------------------------------------
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """reference.rms_norm for float32: one native pass over each row where cpu_native takes it (the sum of squares
    summed in another order: within 1e-6), else torch's rms_norm (the reference's arithmetic, bit-identical, fewer
    ops); the other dtypes take the reference."""
    if x.dtype != torch.float32:
        return reference.rms_norm(x, weight, eps)
    if cpu_native.takes_rows(x) and _native_weight(weight):
        return cpu_native.rms_norm(x, weight, eps)
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    """reference.fused_add_rms_norm, adding x into `residual` in place (as the Triton kernel does)."""
    if (x.dtype == torch.float32 and cpu_native.takes_rows(x) and residual.is_contiguous()
            and residual.dtype == torch.float32 and residual.shape == x.shape and _native_weight(weight)):
        return cpu_native.rms_norm(x, weight, eps, residual=residual), residual
    residual.add_(x)
    return rms_norm(residual, weight, eps), residual


def _native_weight(weight: torch.Tensor) -> bool:
    return weight.dtype == torch.float32 and weight.dim() == 1 and weight.is_contiguous()


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [T, 2I] = [gate | up] -> silu(gate) * up [T, I]: one native pass where cpu_native takes x (float32),
    else torch with the silu done in place on x's gate half."""
    if cpu_native.takes_rows(x) and x.shape[1] % 2 == 0:
        return cpu_native.silu_and_mul(x)
    gate, up = x.chunk(2, dim=-1)
    return torch.mul(F.silu(gate, inplace=True), up)


def rotary_embedding(positions, q, k, cos_sin_cache, head_dim: int):
    """reference.rotary_embedding (neox), in place on q and k (strided views allowed); returns (q, k).
    When k directly follows q in each row (both views of one qkv projection output) both rotate in one pass."""
    rows = _rows_of_q_and_k(q, k)
    if all(cpu_native.rotary_supported(x, cos_sin_cache, positions, head_dim) for x in rows):
        for x in rows:  # one native pass over each row (the same arithmetic as below, within float32 rounding)
            cpu_native.rotary_neox(x, positions, cos_sin_cache, head_dim)
        return q, k
    cos, sin = cos_sin_cache.index_select(0, positions).unsqueeze(1).chunk(2, dim=-1)  # [T, 1, D/2] each
    for x in rows:
        xs = x.view(x.shape[0], -1, head_dim) if x.is_contiguous() else x.unflatten(-1, (-1, head_dim))
        x1, x2 = xs.chunk(2, dim=-1)
        x2_sin = x2 * sin  # the old x2's share of the new x1, taken before x2 changes
        x2.mul_(cos).addcmul_(x1, sin)
        x1.mul_(cos).sub_(x2_sin)
    return q, k


def _rows_of_q_and_k(q: torch.Tensor, k: torch.Tensor) -> list[torch.Tensor]:
    """[q | k] as one [T, q_width + k_width] view when k's columns follow q's in every row of one tensor (the
    model's split of its qkv output), else [q, k]."""
    adjacent = (q.dim() == 2 and k.dim() == 2 and q.shape[0] == k.shape[0] and q.stride() == k.stride()
                and q.stride(-1) == 1 and q.dtype == k.dtype
                and k.data_ptr() == q.data_ptr() + q.shape[-1] * q.element_size())
    if adjacent:
        return [q.as_strided((q.shape[0], q.shape[-1] + k.shape[-1]), q.stride())]
    return [q, k]

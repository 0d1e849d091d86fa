"""Building blocks of the decoder models: parallel-ready linears, RMSNorm, rotary embedding, paged attention.

Linear layers are column- and row-parallel (Megatron style) over the tensor-parallel world of
`distributed.parallel_state`: each owns the slice of the full weight that its rank holds, and its `weight_loader`
cuts that slice out of a checkpoint tensor. Fused layers (QKV, gate/up) load several checkpoint tensors into one
weight, named by a shard id. How a weight is stored and multiplied (unquantized, or a quantized format) is the
layer's `LinearMethod` (asyncengine.quantization); the loaders work for any format through the `output_dim` /
`input_dim` attributes each parameter carries.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from asyncengine import ops
from asyncengine.distributed.parallel_state import all_gather, all_reduce, tp_rank, tp_size
from asyncengine.quantization import LinearMethod, UnquantizedLinearMethod, set_weight_attrs
from asyncengine.quantization.cpu_prepacked import onednn_linear, onednn_rows


@dataclass
class AttentionMetadata:
    """Per-step batch layout, shared by every attention layer (B sequences, T tokens).

    query_start_loc: [B + 1] int32 (device); seq_lens: [B] int32 (device), context length after this step;
    block_tables: [B, max_blocks] int32 (device); slot_mapping: [T] int64, cache slot of each new token (-1 = pad).
    The *_cpu copies and max_* ints let kernels size their grids without a device-to-host sync.
    cpu_plan: on CPU, the step's attention plan (`kernels.cpu.AttentionPlan`, index tensors shared by every layer),
    built by the model runner; None elsewhere (and for batches built without it, which take the references).
    """

    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    slot_mapping: torch.Tensor
    query_start_loc_cpu: torch.Tensor
    seq_lens_cpu: torch.Tensor
    max_query_len: int
    max_seq_len: int
    cpu_plan: Optional[object] = None


def _param(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


def _rank_part(param: nn.Parameter, dim: int, loaded: torch.Tensor, size: int,
               piece: Optional[int] = None) -> torch.Tensor:
    """This rank's `size` rows of `loaded` along `dim` (the `piece`-th run of them; default: the rank's own, but
    a replicated KV head is shared by several ranks). A checkpoint's single value (a per-tensor scale) for a
    parameter kept per output row (fused shards each bring their own) comes back as one row: `copy_` broadcasts it."""
    if loaded.numel() == 1 and param.shape[dim] > 1:
        return loaded.reshape((1,) * param.dim())
    return loaded.narrow(dim, (tp_rank() if piece is None else piece) * size, size)


def _load_shared(param: nn.Parameter, loaded: torch.Tensor, layer: str) -> None:
    """Load a parameter that every shard of a fused layer brings: they must agree (ValueError otherwise)."""
    if getattr(param, "loaded_by_a_shard", False) and not torch.equal(param.data, loaded.to(param.device)):
        raise ValueError(f"the shards of a {layer} disagree on a parameter they share (shape {list(param.shape)})")
    param.data.copy_(loaded)
    param.loaded_by_a_shard = True


def _shard_of(param: nn.Parameter, dim: int, logical_offset: int, logical_size: int, logical_total: int):
    """The (offset, size) along `dim` of `param` for a shard at [logical_offset, +logical_size) of a logical
    extent `logical_total`: packed formats store fewer (or more) elements per logical column, in proportion, and
    block-wise scales one per block. ValueError when the shard does not fall on whole elements of `param` (e.g. a
    q/k/v shard that is not a whole number of an FP8 checkpoint's scale blocks)."""
    extent = param.shape[dim]
    offset, size = logical_offset * extent, logical_size * extent
    if offset % logical_total or size % logical_total:
        raise ValueError(f"a fused shard at outputs [{logical_offset}, {logical_offset + logical_size}) of "
                         f"{logical_total} does not fall on whole rows of a parameter of shape {list(param.shape)} "
                         "(packed or block-wise scales need every shard to be a whole number of their blocks)")
    return offset // logical_total, size // logical_total


class LinearBase(nn.Module):
    """A linear layer whose weights its `linear_method` creates and applies (unquantized by default).

    in_per_rank / out_per_rank: this rank's logical slice of the [out_features, in_features] weight; input_ranks:
    the ranks the inputs are split over (row-parallel layers), which a linear method may read in create_weights.
    """

    def __init__(self, in_per_rank: int, out_per_rank: int, bias_size: Optional[int], dtype: torch.dtype,
                 linear_method: Optional[LinearMethod] = None, input_ranks: int = 1):
        super().__init__()
        self.in_per_rank, self.out_per_rank, self.input_ranks = in_per_rank, out_per_rank, input_ranks
        self.linear_method = linear_method or UnquantizedLinearMethod()
        self.linear_method.create_weights(self, in_per_rank, out_per_rank, dtype)
        self.bias = None if bias_size is None else set_weight_attrs(_param(bias_size, dtype=dtype), output_dim=0)

    def matmul(self, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        return self.linear_method.apply(self, x, bias)

    @property
    def matmul_takes_bias(self) -> bool:
        """Whether forward hands `matmul` this layer's bias (a CPU product's oneDNN primitive differs by it)."""
        return self.bias is not None

    def takes_fp8_input(self, m: int) -> bool:
        """May the kernel making this layer's M-row input hand it over with its per-token e4m3 copy (an
        Fp8Activation)? See LinearMethod.takes_fp8_input."""
        return self.linear_method.takes_fp8_input(self, m)


class ColumnParallelLinear(LinearBase):
    """y = x W^T (+ b) with W split along the output dimension across ranks."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype,
                 linear_method: Optional[LinearMethod] = None):
        out_per_rank = out_features // tp_size()
        super().__init__(in_features, out_per_rank, out_per_rank if bias else None, dtype, linear_method)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, self.bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        dim = getattr(param, "output_dim", None)
        if dim is None:
            param.data.copy_(loaded)
            return
        param.data.copy_(_rank_part(param, dim, loaded, param.shape[dim]))

    def _load_shard(self, param: nn.Parameter, loaded: torch.Tensor, offset: int, size: int,
                    piece: Optional[int] = None) -> None:
        """Copy this rank's part of one fused shard into logical rows [offset, offset + size) of this rank's
        slice: the checkpoint tensor's `piece`-th run of `size` rows (default: the rank's own)."""
        dim = getattr(param, "output_dim", None)
        if dim is None:  # a parameter shared by the shards (e.g. GPTQ's g_idx of their common input)
            _load_shared(param, loaded, type(self).__name__)
            return
        offset, size = _shard_of(param, dim, offset, size, self.out_per_rank)
        param.data.narrow(dim, offset, size).copy_(_rank_part(param, dim, loaded, size, piece))


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs stored as one weight, e.g. [gate | up] of the MLP (shard ids 0, 1)."""

    def __init__(self, in_features: int, out_sizes: list[int], bias: bool, dtype: torch.dtype,
                 linear_method: Optional[LinearMethod] = None):
        self.out_sizes = out_sizes
        super().__init__(in_features, sum(out_sizes), bias, dtype, linear_method)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        size = self.out_sizes[shard_id] // tp_size()
        offset = sum(self.out_sizes[:shard_id]) // tp_size()
        self._load_shard(param, loaded, offset, size)


def kv_heads_per_rank(num_kv_heads: int, world: int) -> int:
    """KV heads each rank holds: its 1/world share, or one replicated head when there are fewer heads than ranks
    (rank r then holds head r * num_kv_heads // world, shared with world / num_kv_heads - 1 other ranks)."""
    return max(1, num_kv_heads // world)


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections as one weight [q | k | v]; shard ids "q", "k", "v".

    Each rank holds num_heads / tp query heads and kv_heads_per_rank(num_kv_heads, tp) KV heads (replicated when
    the model has fewer KV heads than ranks).
    """

    def __init__(self, hidden: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool, dtype,
                 linear_method: Optional[LinearMethod] = None):
        world = tp_size()
        kv_per_rank = kv_heads_per_rank(num_kv_heads, world)
        # this rank's sizes, and which of the checkpoint's equal-sized pieces it takes
        self.sizes = {"q": num_heads // world * head_dim, "k": kv_per_rank * head_dim, "v": kv_per_rank * head_dim}
        kv_piece = tp_rank() * num_kv_heads // world if num_kv_heads < world else tp_rank()
        self.pieces = {"q": tp_rank(), "k": kv_piece, "v": kv_piece}
        out_per_rank = sum(self.sizes.values())
        LinearBase.__init__(self, hidden, out_per_rank, out_per_rank if bias else None, dtype, linear_method)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        offsets = {"q": 0, "k": self.sizes["q"], "v": self.sizes["q"] + self.sizes["k"]}
        self._load_shard(param, loaded, offsets[shard_id], self.sizes[shard_id], self.pieces[shard_id])


class RowParallelLinear(LinearBase):
    """y = x W^T with W split along the input dimension; with more than one rank an all-reduce follows."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype,
                 linear_method: Optional[LinearMethod] = None):
        super().__init__(in_features // tp_size(), out_features, out_features if bias else None, dtype, linear_method,
                         input_ranks=tp_size())

    @property
    def matmul_takes_bias(self) -> bool:
        return self.bias is not None and tp_size() == 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if tp_size() == 1:
            return self.matmul(x, self.bias)
        # The bias is added once, after the sum over ranks' partial products.
        out = all_reduce(self.matmul(x, None))
        return out if self.bias is None else out + self.bias

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        dim = getattr(param, "input_dim", None)
        if dim is None:  # bias and per-output-channel parameters: whole on every rank
            param.data.copy_(loaded)
            return
        size = param.shape[dim]
        param.data.copy_(loaded.narrow(dim, tp_rank() * size, size))


class VocabParallelEmbedding(nn.Module):
    """Token embedding [vocab, hidden] split by rows over the ranks: each holds vocab_per_rank consecutive tokens
    (the vocabulary padded up to a multiple of the ranks, pad rows zero). A rank embeds the tokens it holds and
    zeros for the rest; the all-reduce sums them into every token's row. Also the LM head (`ParallelLMHead`)."""

    def __init__(self, vocab_size: int, hidden: int, dtype: torch.dtype):
        super().__init__()
        self.vocab_size = vocab_size
        self.vocab_per_rank = -(-vocab_size // tp_size())
        self.vocab_start = tp_rank() * self.vocab_per_rank
        self.weight = set_weight_attrs(_param(self.vocab_per_rank, hidden, dtype=dtype), output_dim=0)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [T] -> [T, hidden]."""
        if tp_size() == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.vocab_per_rank)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        return all_reduce(out.masked_fill_(outside[:, None], 0))

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        rows = max(0, min(self.vocab_per_rank, self.vocab_size - self.vocab_start))
        param.data[rows:].zero_()
        param.data[:rows].copy_(loaded.narrow(0, self.vocab_start, rows))


VocabEmbedding = VocabParallelEmbedding  # the name the single-rank layers had


class ParallelLMHead(VocabParallelEmbedding):
    """The LM head [vocab, hidden], split by rows like the embedding; see `vocab_parallel_logits`."""


def vocab_parallel_logits(hidden: torch.Tensor, weight: torch.Tensor, vocab_size: int,
                          gemv_max_m: int = 0, onednn_weight: Optional[torch.Tensor] = None) -> torch.Tensor:
    """hidden [S, hidden] x this rank's head rows weight [vocab_per_rank, hidden] -> logits [S, vocab_size] in the
    weight's dtype: each rank computes its tokens' logits and the pieces are gathered (every rank gets them; rank 0
    samples). The pad rows of the last rank are cut off. S <= gemv_max_m (`head_gemv_max_m`): our decode GEMV.
    onednn_weight: the weight packed for oneDNN on CPU (quantization/cpu_prepacked.py), used for float32 hidden."""
    if (onednn_weight is not None and hidden.device.type == "cpu" and hidden.dtype == torch.float32
            and onednn_rows(hidden.shape[0])):
        local = onednn_linear(hidden, onednn_weight)
    elif hidden.shape[0] <= gemv_max_m:
        local = ops.dense_gemv(hidden, weight)  # [S, vocab_per_rank]
    else:
        local = ops.head_logits(hidden, weight)
    if tp_size() == 1:
        return local
    return all_gather(local, dim=-1)[:, :vocab_size]


def head_gemv_max_m(weight: torch.Tensor) -> int:
    """Up to which decode batch size the LM head's product [S, hidden] x weight^T runs our GEMV (measured once per
    shape at start-up against cuBLAS, as the linear layers are; 0 on CPU). The head is the largest single product of
    a decode step (Llama-3-8B: 1 GB, 0.34 ms on an H100)."""
    return ops.decode_gemv_max_m(("dense", *weight.shape, weight.dtype), lambda x, w: ops.dense_gemv(x, w[0]),
                                 lambda x, w: F.linear(x, w[0]), (weight,), weight.shape[1], weight.dtype,
                                 weight.device)


class RMSNorm(nn.Module):
    def __init__(self, hidden: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.weight = _param(hidden, dtype=dtype)
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None, fp8_copy: bool = False):
        """Without residual: rms_norm(x). With residual: (rms_norm(x + residual), x + residual), the first with its
        per-token e4m3 copy (an Fp8Activation) when fp8_copy (for an FP8 linear that `takes_fp8_input`)."""
        if residual is None:
            return ops.rms_norm(x, self.weight, self.eps)
        return ops.fused_add_rms_norm(x, residual, self.weight, self.eps, fp8_copy)


def rope_inv_freq(head_dim: int, rope: dict) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [head_dim / 2] (float32) and the attention scaling for a rope config.

    Supports rope_type default, linear and llama3 (Llama-3.1's frequency-dependent scaling: low frequencies are
    divided by `factor`, high ones kept, and a smooth ramp in between, by wavelength).
    """
    base = float(rope.get("rope_theta", 10000.0))
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type == "default":
        return inv_freq, 1.0
    if rope_type == "linear":
        return inv_freq / float(rope["factor"]), 1.0
    if rope_type == "llama3":
        factor = float(rope["factor"])
        low, high = float(rope["low_freq_factor"]), float(rope["high_freq_factor"])
        old_len = float(rope["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        low_freq_wavelen, high_freq_wavelen = old_len / low, old_len / high
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
        return torch.where(is_medium, blended, scaled), 1.0
    raise ValueError(f"rope_scaling type {rope_type!r} is not supported (supported: default, linear, llama3, "
                     "longrope)")


LONGROPE_TYPES = ("longrope", "su")


def longrope_cos_sin_cache(head_dim: int, max_positions: int, rope: dict) -> torch.Tensor:
    """[max_positions, head_dim] float32 = [cos | sin] for LongRoPE (Phi-3): inverse frequencies divided per
    dimension by `short_factor` below `original_max_position_embeddings` (L) and by `long_factor` from L on,
    cos/sin scaled by `attention_factor` (default sqrt(1 + ln(factor) / ln(L)), 1 when factor <= 1).

    transformers switches every position of a sequence to the long factors once the sequence grows past L
    (recomputing its cache); a paged cache cannot recompute the keys it holds, so here each position chooses by
    itself (as vLLM does). Sequences that stay within L match transformers exactly.
    """
    base = float(rope.get("rope_theta", 10000.0))
    original = int(rope["original_max_position_embeddings"])
    factor = float(rope["factor"])
    attention_factor = rope.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    positions = torch.arange(max_positions, dtype=torch.float32)[:, None]
    caches = []
    for name in ("short_factor", "long_factor"):
        ext = torch.tensor(rope[name], dtype=torch.float32)
        if ext.shape != (head_dim // 2,):
            raise ValueError(f"rope {name} has {ext.shape[0]} entries; head_dim / 2 = {head_dim // 2} expected")
        freqs = positions * (1.0 / (ext * base**exponents))[None, :]
        caches.append(torch.cat((freqs.cos(), freqs.sin()), dim=-1) * attention_factor)
    return torch.where(positions >= original, caches[1], caches[0])


class RotaryEmbedding(nn.Module):
    """Holds cos_sin_cache [max_positions, head_dim] float32 = [cos | sin] and applies it to q and k."""

    def __init__(self, head_dim: int, max_positions: int, rope: dict):
        super().__init__()
        if rope.get("rope_type", rope.get("type")) in LONGROPE_TYPES:
            cache = longrope_cos_sin_cache(head_dim, max_positions, rope)
        else:
            inv_freq, scaling = rope_inv_freq(head_dim, rope)
            freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
            cache = torch.cat((freqs.cos() * scaling, freqs.sin() * scaling), dim=-1)
        self.register_buffer("cos_sin_cache", cache, persistent=False)
        self.head_dim = head_dim

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        return ops.rotary_embedding(positions, q, k, self.cos_sin_cache, self.head_dim)


class PagedAttention(nn.Module):
    """Writes this step's K/V into the layer's paged cache, then attends over the cached context: all of it, or
    with a sliding_window only the last that many keys. scale defaults to head_dim**-0.5; softcap caps the scores
    (softcap * tanh(score / softcap), Gemma 2).

    k_scale / v_scale (float32 numbers, one per layer) are read only when the cache is FP8 (`--kv-cache-dtype
    fp8`): the cache stores k / k_scale and v / v_scale in e4m3 (saturating at +-448) and attention reads them back
    times the scale. They come from the checkpoint when it has them (`load_kv_scale`), else stay 1.0, as in vLLM:
    e4m3 then holds the activations as they are, which costs nothing when |K|, |V| stay well inside +-448 (they
    do in usual models) but spends precision on small values (e4m3 has 3 mantissa bits at every magnitude, and
    values under 2^-6 lose relative precision) and clips any outlier past 448. A calibrated checkpoint (AutoFP8,
    llm-compressor's kv_cache_scheme) sets the scale so that the layer's largest value maps near 448.
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: Optional[float] = None,
                 sliding_window: Optional[int] = None, softcap: Optional[float] = None):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = head_dim**-0.5 if scale is None else scale
        self.sliding_window, self.softcap = sliding_window, softcap
        # Python floats, fixed after loading: kernel arguments that a captured CUDA graph may bake in.
        self.k_scale, self.v_scale = 1.0, 1.0

    def forward(self, q, k, v, kv_cache: tuple[torch.Tensor, torch.Tensor], metadata: AttentionMetadata,
                rotary: Optional[tuple[torch.Tensor, "RotaryEmbedding"]] = None,
                qk_norm: Optional[ops.QKNorm] = None):
        """q: [T, H*D], k, v: [T, KVH*D] -> [T, H*D]. rotary: (positions [T], the layer's RotaryEmbedding) to
        rotate q and k first (in place; on CUDA in the same kernel as the cache write). qk_norm: per-head norms
        of q and k before the rotation (on CUDA in that kernel too)."""
        tokens = q.shape[0]
        q = q.view(tokens, self.num_heads, self.head_dim)
        k = k.view(tokens, self.num_kv_heads, self.head_dim)
        v = v.view(tokens, self.num_kv_heads, self.head_dim)
        k_cache, v_cache = kv_cache
        if rotary is not None:
            positions, embedding = rotary
            rotary = (positions, embedding.cos_sin_cache)
        out = ops.cache_and_attend(q, k, v, k_cache, v_cache, metadata, self.scale, self.sliding_window,
                                   self.softcap, self.k_scale, self.v_scale, rotary, qk_norm)
        return out.reshape(tokens, self.num_heads * self.head_dim)


# Checkpoint names of per-layer KV-cache scales (after the attention module's path) -> which scale they set:
# vLLM / llm-compressor's k_scale and v_scale; the older single kv_scale (AutoFP8), used for both; compressed-
# tensors' kv_cache_scheme as first saved (the k/v projections' output_scale); ModelOpt's names.
_KV_SCALE_SUFFIXES = {
    ".attn.k_scale": "k", ".attn.v_scale": "v",
    ".k_proj.output_scale": "k", ".v_proj.output_scale": "v",
    ".k_proj.k_scale": "k", ".v_proj.v_scale": "v",
    ".k_scale": "k", ".v_scale": "v", ".kv_scale": "kv",
}


def load_kv_scale(model: nn.Module, name: str, tensor) -> bool:
    """If `name` (our module path, "model." removed) is a checkpoint's KV-cache scale, set it on the layer's
    PagedAttention and return True; else False. A scale must be one positive finite number (per-tensor): per-head
    scales are a ValueError naming the tensor."""
    for suffix, which in _KV_SCALE_SUFFIXES.items():
        if name.endswith(suffix):
            break
    else:
        return False
    owner = model.get_submodule(name.removesuffix(suffix))
    attn = next((m for m in owner.modules() if isinstance(m, PagedAttention)), None)
    if attn is None:
        raise ValueError(f"checkpoint tensor {name!r} looks like a KV-cache scale but {type(owner).__name__} has no "
                         "attention")
    value = tensor.read() if hasattr(tensor, "read") else tensor  # a CheckpointSlice with several ranks
    scale = float(value.float().reshape(-1)[0]) if value.numel() == 1 else None
    if scale is None or not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"KV-cache scale {name!r} must be one positive finite number (per-tensor scales only), got "
                         f"{scale if scale is not None else f'shape {tuple(value.shape)}'}")
    if which in ("k", "kv"):
        attn.k_scale = scale
    if which in ("v", "kv"):
        attn.v_scale = scale
    return True


def load_checkpoint_tensor(model: nn.Module, params: dict, name: str, shard_id, tensor: torch.Tensor,
                           hf_name: str) -> None:
    """Copy one checkpoint tensor into the model parameter `name` (already renamed to ours), through its module's
    `weight_loader` when it has one (fused and sharded layers: `shard_id` says which part); a tensor with no
    place in the model is a ValueError naming it. `tensor` may be a `CheckpointSlice`: loaders narrow it to their
    rank's slice before it is read, and `copy_` casts to the parameter's dtype."""
    if name not in params:
        raise ValueError(f"checkpoint tensor {hf_name!r} has no place in {type(model).__name__}")
    param = params[name]
    loader = getattr(model.get_submodule(name.rsplit(".", 1)[0]), "weight_loader", None)
    if loader is not None:
        loader(param, tensor, shard_id)
    else:
        param.data.copy_(tensor)

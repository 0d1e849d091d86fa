"""The Llama family: Llama (incl. Llama-3.1 rope scaling), Mistral (its sliding window), Qwen2 (QKV bias; sliding
layers when the config asks), Qwen3 (per-head q/k RMSNorm).

The four differ only in flags read from the HF config, so one implementation serves them all. The model works on
a flat batch: T tokens from many sequences, each with its position and its cache slot; attention reads the paged
KV cache through `AttentionMetadata`.
"""

from __future__ import annotations

from typing import Iterable, Optional

import torch
from torch import nn

from asyncengine import ops
from asyncengine.distributed.parallel_state import tp_size
from asyncengine.quantization import LinearMethod, QuantizationConfig
from asyncengine.quantization.cpu_prepacked import cpu_onednn_weight
from asyncengine.models.layers import (
    LONGROPE_TYPES,
    AttentionMetadata,
    MergedColumnParallelLinear,
    PagedAttention,
    ParallelLMHead,
    QKVParallelLinear,
    RMSNorm,
    RotaryEmbedding,
    RowParallelLinear,
    VocabParallelEmbedding,
    head_gemv_max_m,
    kv_heads_per_rank,
    vocab_parallel_logits,
    load_checkpoint_tensor,
    load_kv_scale,
)

KVCache = tuple[torch.Tensor, torch.Tensor]  # (k_cache, v_cache), each [num_blocks, block_size, KVH, D]


def rope_config(hf_config) -> dict:
    """rope settings across transformers versions (v5 `rope_parameters`, v4 `rope_theta` + `rope_scaling`)."""
    params = getattr(hf_config, "rope_parameters", None)
    if params:
        rope = dict(params)
    else:
        rope = dict(getattr(hf_config, "rope_scaling", None) or {})
        rope.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    if rope.get("rope_type", rope.get("type")) in LONGROPE_TYPES:  # its lengths may sit on the config itself
        original = rope.get("original_max_position_embeddings") or hf_config.original_max_position_embeddings
        rope["original_max_position_embeddings"] = original
        rope.setdefault("factor", hf_config.max_position_embeddings / original)
    return rope


def layer_sliding_windows(cfg) -> list[Optional[int]]:
    """Each layer's sliding window (None: global attention), as transformers reads the config: `layer_types`
    ("sliding_attention" / "full_attention") when given, else `sliding_window` for every layer (Mistral, Phi-3)."""
    window = getattr(cfg, "sliding_window", None) or None
    layer_types = getattr(cfg, "layer_types", None)
    if layer_types is None:
        return [window] * cfg.num_hidden_layers
    unknown = set(layer_types) - {"sliding_attention", "full_attention"}
    if unknown:
        raise ValueError(f"layer_types {sorted(unknown)} are not supported (sliding_attention, full_attention)")
    return [window if t == "sliding_attention" else None for t in layer_types]


class Attention(nn.Module):
    def __init__(self, cfg, dtype: torch.dtype, qkv_bias: bool, qk_norm: bool, max_positions: int,
                 sliding_window: Optional[int] = None, linear_method: Optional[LinearMethod] = None):
        super().__init__()
        hidden, heads = cfg.hidden_size, cfg.num_attention_heads
        kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
        self.head_dim = getattr(cfg, "head_dim", None) or hidden // heads
        # this rank's heads (KV heads replicated when there are fewer than ranks)
        self.num_heads, self.num_kv_heads = heads // tp_size(), kv_heads_per_rank(kv_heads, tp_size())
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.qkv_proj = QKVParallelLinear(hidden, self.head_dim, heads, kv_heads, qkv_bias, dtype, linear_method)
        self.o_proj = RowParallelLinear(heads * self.head_dim, hidden, getattr(cfg, "attention_bias", False), dtype,
                                        linear_method)
        self.rotary_emb = RotaryEmbedding(self.head_dim, max_positions, rope_config(cfg))
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, self.head_dim, sliding_window=sliding_window)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, dtype) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, dtype) if qk_norm else None

    def forward(self, positions, hidden_states, kv_cache: KVCache, metadata: AttentionMetadata) -> torch.Tensor:
        qkv = self.qkv_proj(hidden_states)  # [T, q_size + 2 * kv_size]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        # q, k, v stay strided views of qkv (rows qkv_size apart): the kernels take row strides, so no copies.
        # Rotary, and Qwen3's RMSNorm over each q and k head before it, are applied inside the attention layer (on
        # CUDA fused with the KV-cache write).
        out = self.attn(q, k, v, kv_cache, metadata, rotary=(positions, self.rotary_emb), qk_norm=self.qk_norm())
        return self.o_proj(out)

    def qk_norm(self) -> Optional[ops.QKNorm]:
        """The per-head q/k norms (Qwen3; Gemma 3's too, whose weights hold 1 + w), or None."""
        if self.q_norm is None:
            return None
        return ops.QKNorm(self.q_norm.weight, self.k_norm.weight, self.q_norm.eps)


class MLP(nn.Module):
    """Gated MLP (SiLU) of cfg.intermediate_size, or of `intermediate_size` when given (e.g. a shared expert)."""

    def __init__(self, cfg, dtype: torch.dtype, intermediate_size: Optional[int] = None,
                 linear_method: Optional[LinearMethod] = None):
        super().__init__()
        inter = intermediate_size or cfg.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(cfg.hidden_size, [inter, inter], False, dtype, linear_method)
        self.down_proj = RowParallelLinear(inter, cfg.hidden_size, False, dtype, linear_method)
        if getattr(cfg, "hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {cfg.hidden_act!r} is not supported (only silu)")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, hidden] (or an Fp8Activation of it, see takes_fp8_input) -> [T, hidden]."""
        gate_up = self.gate_up_proj(x)  # [T, 2 * inter]
        return self.down_proj(ops.silu_and_mul(gate_up, self.down_proj.takes_fp8_input(gate_up.shape[0])))

    def takes_fp8_input(self, m: int) -> bool:
        return self.gate_up_proj.takes_fp8_input(m)


class DecoderLayer(nn.Module):
    def __init__(self, cfg, dtype, qkv_bias: bool, qk_norm: bool, max_positions: int,
                 sliding_window: Optional[int] = None, mlp: Optional[nn.Module] = None,
                 linear_method: Optional[LinearMethod] = None):
        super().__init__()
        self.self_attn = Attention(cfg, dtype, qkv_bias, qk_norm, max_positions, sliding_window, linear_method)
        # [T, hidden] -> [T, hidden]
        self.mlp = mlp if mlp is not None else MLP(cfg, dtype, linear_method=linear_method)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)

    def forward(self, positions, hidden, residual: Optional[torch.Tensor], kv_cache, metadata):
        """Pre-norm block; the residual stream travels beside the hidden states so norms can fuse the add."""
        # An FP8 linear after a norm gets the norm's per-token e4m3 copy of its input (one launch fewer).
        tokens = hidden.shape[0]
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual,
                                                    self.self_attn.qkv_proj.takes_fp8_input(tokens))
        hidden = self.self_attn(positions, hidden, kv_cache, metadata)
        mlp_takes_fp8 = getattr(self.mlp, "takes_fp8_input", None)  # MLP's; not a mixture of experts'
        hidden, residual = self.post_attention_layernorm(hidden, residual,
                                                         mlp_takes_fp8 is not None and mlp_takes_fp8(tokens))
        return self.mlp(hidden), residual


class LlamaForCausalLM(nn.Module):
    """Also MistralForCausalLM, Qwen2ForCausalLM and Qwen3ForCausalLM, chosen by the flags below.

    `sliding_windows` lists each layer's window (None: global), read by the engine to free KV blocks that no
    layer can see any more (only when every layer has a window)."""

    qkv_bias_default = False
    qk_norm = False

    def __init__(self, cfg, dtype: torch.dtype, max_positions: int,
                 quant_config: Optional[QuantizationConfig] = None):
        """quant_config: the decoder's linear layers' weight format (None: unquantized); the LM head stays in dtype."""
        super().__init__()
        linear_method = quant_config.linear_method() if quant_config is not None else None
        self.linear_method = linear_method  # make_mlp's too
        self.config = cfg
        qkv_bias = getattr(cfg, "attention_bias", self.qkv_bias_default) or self.qkv_bias_default
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, dtype)
        self.sliding_windows = layer_sliding_windows(cfg)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, dtype, qkv_bias, self.qk_norm, max_positions, window, self.make_mlp(cfg, dtype, i),
                         linear_method)
            for i, window in enumerate(self.sliding_windows)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.tie_word_embeddings = bool(getattr(cfg, "tie_word_embeddings", False))
        # tied: the embedding's weight (split by rows like the head's) serves as the head
        self.lm_head = None if self.tie_word_embeddings else ParallelLMHead(cfg.vocab_size, cfg.hidden_size, dtype)

    def make_mlp(self, cfg, dtype: torch.dtype, layer_index: int) -> nn.Module:
        """The feed-forward block of layer `layer_index` (families with sparse layers override this)."""
        return MLP(cfg, dtype, linear_method=self.linear_method)

    def forward(self, input_ids, positions, kv_caches: list[KVCache], metadata: AttentionMetadata) -> torch.Tensor:
        """input_ids, positions: [T] -> final hidden states [T, hidden]."""
        hidden, residual = self.embed_tokens(input_ids), None
        for layer, kv_cache in zip(self.layers, kv_caches):
            hidden, residual = layer(positions, hidden, residual, kv_cache, metadata)
        hidden, _ = self.norm(hidden, residual)
        return hidden

    head_gemv_max_m = 0  # decode batches up to this size take our GEMV for the head (process_weights_after_loading)

    def head_weight(self) -> torch.Tensor:
        """The LM head's rows on this rank [vocab_per_rank, hidden] (the embedding's when tied)."""
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    head_onednn = None  # on CPU, the head packed for oneDNN where that measured faster (process_weights_after_loading)

    def process_weights_after_loading(self) -> None:
        """After every weight is loaded (and the linear layers processed): measure the head's GEMV threshold (CUDA),
        or whether oneDNN's packed product beats MKL on the head (CPU, float32; a packed copy is kept if so)."""
        self.head_gemv_max_m = head_gemv_max_m(self.head_weight())
        self.head_onednn = cpu_onednn_weight(self.head_weight())

    def compute_logits(self, hidden: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """hidden: [S, hidden] -> logits [S, vocab] in float32, written into `out` ([S, vocab] float32) if given.
        With several ranks every rank computes its vocabulary slice and gets the gathered logits."""
        logits = vocab_parallel_logits(hidden, self.head_weight(), self.config.vocab_size, self.head_gemv_max_m,
                                       self.head_onednn)
        if out is None:
            return logits.float()
        return out.copy_(logits)

    # -- weight loading -------------------------------------------------------------------------------------
    # checkpoint name fragment -> (our fused parameter fragment, shard id)
    stacked = {
        ".q_proj.": (".qkv_proj.", "q"),
        ".k_proj.": (".qkv_proj.", "k"),
        ".v_proj.": (".qkv_proj.", "v"),
        ".gate_proj.": (".gate_up_proj.", 0),
        ".up_proj.": (".gate_up_proj.", 1),
    }

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]],
                     loaded: Optional[set[tuple[str, object]]] = None) -> set[tuple[str, object]]:
        """Load (HF name, tensor) pairs. Each (parameter name, shard id) pair written is added to `loaded` (a new set
        if None) as soon as it is written (the model loader passes a LayerwiseProcessing, which acts on them), and
        `loaded` is returned."""
        params = dict(self.named_parameters())
        loaded = set() if loaded is None else loaded
        for hf_name, tensor in weights:
            name = hf_name.removeprefix("model.")
            if "rotary_emb.inv_freq" in name or (self.tie_word_embeddings and name == "lm_head.weight"):
                continue
            if load_kv_scale(self, name, tensor):  # read by an FP8 KV cache; not a parameter
                continue
            shard_id = None
            for fragment, (fused, sid) in self.stacked.items():
                if fragment in name:
                    name, shard_id = name.replace(fragment, fused), sid
                    break
            load_checkpoint_tensor(self, params, name, shard_id, tensor, hf_name)
            loaded.add((name, shard_id))
        return loaded


class MistralForCausalLM(LlamaForCausalLM):
    pass


class Qwen2ForCausalLM(LlamaForCausalLM):
    qkv_bias_default = True


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True

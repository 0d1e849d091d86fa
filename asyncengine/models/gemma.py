"""Gemma 2 and Gemma 3 (text): the Llama block with Gemma's changes, built from llama.py's pieces.

What differs from Llama (transformers' Gemma2/Gemma3 modeling is the reference):
  - RMSNorm scales by (1 + weight): `GemmaRMSNorm` adds the 1 once, when the weight is loaded;
  - four norms per layer: input, post-attention, pre-feedforward and post-feedforward (the outputs of attention
    and of the MLP are normed before they join the residual stream);
  - GeGLU MLP: gelu(tanh approximation)(gate) * up;
  - attention scale query_pre_attn_scalar**-0.5, attention-score soft-capping (Gemma 2), per-head q/k norms
    (Gemma 3);
  - alternating local (sliding-window) and global layers, from `layer_types`; Gemma 3's local layers use their own
    rope base (`rope_local_base_freq`, or rope_parameters["sliding_attention"]);
  - embeddings scaled by sqrt(hidden) (in the weights' dtype), tied to the LM head (unscaled there), and the
    final logits soft-capped (Gemma 2).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from asyncengine import ops
from asyncengine.models.layers import (
    MergedColumnParallelLinear,
    PagedAttention,
    RMSNorm,
    RotaryEmbedding,
    RowParallelLinear,
    VocabEmbedding,
)
from asyncengine.models.llama import Attention, LlamaForCausalLM, layer_sliding_windows, rope_config


class GemmaRMSNorm(RMSNorm):
    """RMSNorm whose checkpoint weight w means a scale of (1 + w): the 1 is added at load time."""

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        param.data.copy_(loaded.float() + 1.0)


def gemma_rope(cfg, sliding: bool) -> dict:
    """The rope settings of a global or a local (sliding) layer, across transformers versions."""
    params = getattr(cfg, "rope_parameters", None) or {}
    layer_type = "sliding_attention" if sliding else "full_attention"
    if layer_type in params:  # transformers v5 (Gemma 3): one rope dict per layer type
        return dict(params[layer_type])
    rope = rope_config(cfg)
    local_base = getattr(cfg, "rope_local_base_freq", None)
    if sliding and local_base is not None:  # Gemma 3 under transformers v4: local layers, plain rope, own base
        return {"rope_type": "default", "rope_theta": local_base}
    return rope


def gemma_sliding_windows(cfg, global_every: int) -> list[Optional[int]]:
    """Each layer's window: from `layer_types`, or (transformers before it had them) every `global_every`-th
    layer global and the others local."""
    if getattr(cfg, "layer_types", None) is not None:
        return layer_sliding_windows(cfg)
    return [None if (i + 1) % global_every == 0 else cfg.sliding_window for i in range(cfg.num_hidden_layers)]


class GemmaAttention(Attention):
    """llama.Attention with Gemma's scale, soft-cap, sliding window, rope per layer type and q/k norms."""

    def __init__(self, cfg, dtype, max_positions: int, sliding_window: Optional[int], qk_norm: bool):
        super().__init__(cfg, dtype, qkv_bias=False, qk_norm=False, max_positions=max_positions)
        self.rotary_emb = RotaryEmbedding(self.head_dim, max_positions, gemma_rope(cfg, sliding_window is not None))
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, self.head_dim,
                                   scale=cfg.query_pre_attn_scalar**-0.5, sliding_window=sliding_window,
                                   softcap=getattr(cfg, "attn_logit_softcapping", None))
        if qk_norm:  # Gemma 3
            self.q_norm = GemmaRMSNorm(self.head_dim, cfg.rms_norm_eps, dtype)
            self.k_norm = GemmaRMSNorm(self.head_dim, cfg.rms_norm_eps, dtype)


class GegluMLP(nn.Module):
    def __init__(self, cfg, dtype: torch.dtype):
        super().__init__()
        act = getattr(cfg, "hidden_activation", None) or getattr(cfg, "hidden_act", None)
        if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
            raise ValueError(f"hidden_activation {act!r} is not supported for Gemma (only gelu_pytorch_tanh)")
        inter = cfg.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(cfg.hidden_size, [inter, inter], False, dtype)
        self.down_proj = RowParallelLinear(inter, cfg.hidden_size, False, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(ops.gelu_tanh_and_mul(self.gate_up_proj(x)))


class GemmaDecoderLayer(nn.Module):
    def __init__(self, cfg, dtype, max_positions: int, sliding_window: Optional[int], qk_norm: bool):
        super().__init__()
        hidden, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.self_attn = GemmaAttention(cfg, dtype, max_positions, sliding_window, qk_norm)
        self.mlp = GegluMLP(cfg, dtype)
        self.input_layernorm = GemmaRMSNorm(hidden, eps, dtype)
        self.post_attention_layernorm = GemmaRMSNorm(hidden, eps, dtype)
        self.pre_feedforward_layernorm = GemmaRMSNorm(hidden, eps, dtype)
        self.post_feedforward_layernorm = GemmaRMSNorm(hidden, eps, dtype)

    def forward(self, positions, hidden, residual: Optional[torch.Tensor], kv_cache, metadata):
        """The residual stream is hidden + residual, as in llama.DecoderLayer: each pre-norm fuses the add."""
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.post_attention_layernorm(self.self_attn(positions, hidden, kv_cache, metadata))
        hidden, residual = self.pre_feedforward_layernorm(hidden, residual)
        return self.post_feedforward_layernorm(self.mlp(hidden)), residual


class Gemma2ForCausalLM(LlamaForCausalLM):
    """Gemma 2; `Gemma3ForCausalLM` adds q/k norms and the local rope base. Weight loading is llama's."""

    qk_norm = False

    def global_every(self, cfg) -> int:
        return 2  # Gemma 2: odd layers global

    def __init__(self, cfg, dtype: torch.dtype, max_positions: int):
        nn.Module.__init__(self)
        self.config = cfg
        if getattr(cfg, "use_bidirectional_attention", False):
            raise ValueError("use_bidirectional_attention is not supported (causal decoders only)")
        self.embed_tokens = VocabEmbedding(cfg.vocab_size, cfg.hidden_size, dtype)
        # sqrt(hidden) rounded to the weights' dtype, as transformers multiplies it
        self.register_buffer("embed_scale", torch.tensor(cfg.hidden_size**0.5, dtype=dtype), persistent=False)
        self.sliding_windows = gemma_sliding_windows(cfg, self.global_every(cfg))
        self.layers = nn.ModuleList(
            GemmaDecoderLayer(cfg, dtype, max_positions, window, self.qk_norm) for window in self.sliding_windows
        )
        self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.tie_word_embeddings = bool(getattr(cfg, "tie_word_embeddings", True))
        if not self.tie_word_embeddings:
            raise ValueError("Gemma checkpoints tie the LM head to the embeddings (tie_word_embeddings=false given)")
        self.lm_head = None
        self.final_logit_softcap = getattr(cfg, "final_logit_softcapping", None)

    def forward(self, input_ids, positions, kv_caches, metadata) -> torch.Tensor:
        """input_ids, positions: [T] -> final hidden states [T, hidden]."""
        hidden, residual = self.embed_tokens(input_ids) * self.embed_scale, None
        for layer, kv_cache in zip(self.layers, kv_caches):
            hidden, residual = layer(positions, hidden, residual, kv_cache, metadata)
        hidden, _ = self.norm(hidden, residual)
        return hidden

    def compute_logits(self, hidden: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """llama's logits, then soft-capped (cap * tanh(logits / cap)) in float32 when the config asks."""
        if self.final_logit_softcap is None:
            return super().compute_logits(hidden, out)
        logits = super().compute_logits(hidden, out)
        cap = float(self.final_logit_softcap)
        return logits.div_(cap).tanh_().mul_(cap)


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    qk_norm = True

    def global_every(self, cfg) -> int:
        return getattr(cfg, "sliding_window_pattern", None) or 6

"""Phi-3: the Llama block with fused checkpoint weights, a sliding window and LongRoPE scaling.

- The checkpoint stores `qkv_proj` ([q | k | v] rows) and `gate_up_proj` ([gate | up] rows) fused; they are cut
  into the q/k/v and gate/up shards that llama's loader (and its tensor-parallel sharding) already takes.
- `sliding_window` applies to every layer (llama.layer_sliding_windows).
- LongRoPE ("longrope", formerly "su"): layers.longrope_cos_sin_cache, chosen by the rope type.
"""

from __future__ import annotations

from typing import Iterable, Optional

import torch

from asyncengine.models.llama import LlamaForCausalLM, rope_config


class Phi3ForCausalLM(LlamaForCausalLM):
    def __init__(self, cfg, dtype: torch.dtype, max_positions: int):
        partial = rope_config(cfg).get("partial_rotary_factor", getattr(cfg, "partial_rotary_factor", 1.0))
        if float(partial or 1.0) != 1.0:
            raise ValueError(f"partial_rotary_factor {partial} is not supported for Phi-3 (only 1.0)")
        super().__init__(cfg, dtype, max_positions)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]],
                     loaded: Optional[set[tuple[str, object]]] = None) -> set[tuple[str, object]]:
        return super().load_weights(self._split_fused(weights), loaded)

    def _split_fused(self, weights: Iterable[tuple[str, torch.Tensor]]):
        """Cut the fused qkv_proj / gate_up_proj tensors into the per-projection tensors llama's loader takes."""
        cfg = self.config
        head_dim = self.layers[0].self_attn.head_dim
        q_size = cfg.num_attention_heads * head_dim
        kv_size = (getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads) * head_dim
        for name, tensor in weights:
            if ".qkv_proj." in name:
                if tensor.shape[0] != q_size + 2 * kv_size:
                    raise ValueError(f"{name}: {tensor.shape[0]} rows, q + k + v = {q_size + 2 * kv_size} expected")
                for part, piece in zip(("q_proj", "k_proj", "v_proj"), tensor.split([q_size, kv_size, kv_size])):
                    yield name.replace("qkv_proj", part), piece
            elif ".gate_up_proj." in name:
                gate, up = tensor.chunk(2, dim=0)
                yield name.replace("gate_up_proj", "gate_proj"), gate
                yield name.replace("gate_up_proj", "up_proj"), up
            else:
                yield name, tensor

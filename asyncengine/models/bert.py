"""The BERT family of encoders (BERT, MiniLM, and sentence-transformers models built on them): absolute position
embeddings, token types, post-LayerNorm blocks, GELU, and bidirectional attention. `BertModel` gives hidden states
to pool into embeddings; `BertForSequenceClassification` (a cross-encoder, as sentence-transformers' CrossEncoder
saves it) adds BERT's pooler and a classifier that scores a text pair from its [CLS] state.

An encoder keeps no KV cache: every sequence is computed whole in one pass (it cannot be chunked, since each
token attends to the tokens after it). The model works on a flat batch like the decoders do: T tokens of B
sequences laid end to end, delimited by `EncoderMetadata.query_start_loc`. Attention goes through
`ops.encoder_attention` (the Triton prefill kernel without its causal mask on CUDA, torch SDPA on CPU).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from asyncengine import ops
from asyncengine.distributed.parallel_state import tp_size
from asyncengine.models.layers import (ColumnParallelLinear, QKVParallelLinear, RowParallelLinear,
                                       load_checkpoint_tensor)

_ACTIVATIONS = {
    "gelu": lambda x: F.gelu(x),  # erf form, as transformers' "gelu"
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}


@dataclass
class EncoderMetadata:
    """Layout of a flat batch of whole sequences (B sequences, T tokens).

    query_start_loc: [B + 1] int32 on the model's device, with a host copy; max_len: the longest sequence.
    """

    query_start_loc: torch.Tensor
    query_start_loc_cpu: torch.Tensor
    max_len: int


class LayerNorm(nn.Module):
    def __init__(self, hidden: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(hidden, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(hidden, dtype=dtype), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, self.eps)


class BertEmbeddings(nn.Module):
    def __init__(self, cfg, dtype: torch.dtype):
        super().__init__()
        self.word_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
        self.position_embeddings = nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size, dtype=dtype)
        self.token_type_embeddings = nn.Embedding(cfg.type_vocab_size, cfg.hidden_size, dtype=dtype)
        self.LayerNorm = LayerNorm(cfg.hidden_size, cfg.layer_norm_eps, dtype)
        for p in self.parameters():
            p.requires_grad_(False)

    def forward(self, input_ids, positions, token_type_ids: Optional[torch.Tensor]) -> torch.Tensor:
        """input_ids, positions, token_type_ids: [T] (token types default to 0) -> [T, hidden]."""
        x = self.word_embeddings(input_ids) + self.position_embeddings(positions)
        if token_type_ids is None:
            x = x + self.token_type_embeddings.weight[0]
        else:
            x = x + self.token_type_embeddings(token_type_ids)
        return self.LayerNorm(x)


class BertAttention(nn.Module):
    """Self-attention over whole sequences, then the output projection, residual and LayerNorm."""

    def __init__(self, cfg, dtype: torch.dtype):
        super().__init__()
        hidden, heads = cfg.hidden_size, cfg.num_attention_heads
        self.head_dim = hidden // heads
        self.num_heads = heads // tp_size()
        self.q_size = self.num_heads * self.head_dim
        self.scale = self.head_dim**-0.5
        self.qkv_proj = QKVParallelLinear(hidden, self.head_dim, heads, heads, True, dtype)
        self.dense = RowParallelLinear(hidden, hidden, True, dtype)
        self.LayerNorm = LayerNorm(hidden, cfg.layer_norm_eps, dtype)

    def forward(self, hidden: torch.Tensor, metadata: EncoderMetadata) -> torch.Tensor:
        tokens = hidden.shape[0]
        qkv = self.qkv_proj(hidden)  # [T, 3 * H * D]
        q, k, v = (t.view(tokens, self.num_heads, self.head_dim) for t in qkv.split(self.q_size, dim=-1))
        out = ops.encoder_attention(q, k, v, metadata, self.scale)  # [T, H, D]
        return self.LayerNorm(self.dense(out.reshape(tokens, self.q_size)) + hidden)


class BertLayer(nn.Module):
    def __init__(self, cfg, dtype: torch.dtype):
        super().__init__()
        act = getattr(cfg, "hidden_act", "gelu")
        if act not in _ACTIVATIONS:
            raise ValueError(f"hidden_act {act!r} is not supported (supported: {sorted(_ACTIVATIONS)})")
        self.act = _ACTIVATIONS[act]
        self.attention = BertAttention(cfg, dtype)
        self.intermediate = ColumnParallelLinear(cfg.hidden_size, cfg.intermediate_size, True, dtype)
        self.output = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, True, dtype)
        self.output_norm = LayerNorm(cfg.hidden_size, cfg.layer_norm_eps, dtype)

    def forward(self, hidden: torch.Tensor, metadata: EncoderMetadata) -> torch.Tensor:
        """Post-LayerNorm block: x = LN(x + attn(x)); x = LN(x + W2 act(W1 x))."""
        hidden = self.attention(hidden, metadata)
        return self.output_norm(self.output(self.act(self.intermediate(hidden))) + hidden)


class BertModel(nn.Module):
    """The encoder stack without BERT's pooler (sentence-transformers pools the last hidden states itself)."""

    is_encoder = True  # computes whole sequences without a KV cache (see the module docstring)

    def __init__(self, cfg, dtype: torch.dtype, max_positions: int):
        super().__init__()
        position_type = getattr(cfg, "position_embedding_type", "absolute")
        if position_type != "absolute":
            raise ValueError(f"position_embedding_type {position_type!r} is not supported (only absolute)")
        self.config = cfg
        self.embeddings = BertEmbeddings(cfg, dtype)
        self.layers = nn.ModuleList(BertLayer(cfg, dtype) for _ in range(cfg.num_hidden_layers))

    def forward(self, input_ids, positions, metadata: EncoderMetadata,
                token_type_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        """input_ids, positions (0 at each sequence's first token), token_type_ids: [T] -> hidden [T, hidden]."""
        hidden = self.embeddings(input_ids, positions, token_type_ids)
        for layer in self.layers:
            hidden = layer(hidden, metadata)
        return hidden

    # -- weight loading -------------------------------------------------------------------------------------
    # Checkpoint name fragment -> (our parameter fragment, shard id). Names may carry a "bert." prefix
    # (BertFor* checkpoints); the pooler (dense + tanh) is not used by sentence embeddings and is skipped.
    renames = {
        ".attention.self.query.": (".attention.qkv_proj.", "q"),
        ".attention.self.key.": (".attention.qkv_proj.", "k"),
        ".attention.self.value.": (".attention.qkv_proj.", "v"),
        ".attention.output.dense.": (".attention.dense.", None),
        ".attention.output.LayerNorm.": (".attention.LayerNorm.", None),
        ".intermediate.dense.": (".intermediate.", None),
        ".output.dense.": (".output.", None),
        ".output.LayerNorm.": (".output_norm.", None),
    }

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]],
                     loaded: Optional[set[tuple[str, object]]] = None) -> set[tuple[str, object]]:
        """As LlamaForCausalLM.load_weights: each written (parameter name, shard id) pair into `loaded`, returned."""
        params = dict(self.named_parameters())
        loaded = set() if loaded is None else loaded
        for hf_name, tensor in weights:
            name = _our_name(hf_name.removeprefix("bert."))
            if name is None:
                continue
            name, shard_id = self._rename(name)
            load_checkpoint_tensor(self, params, name, shard_id, tensor, hf_name)
            loaded.add((name, shard_id))
        return loaded

    def _rename(self, name: str) -> tuple[str, object]:
        for fragment, (ours, shard_id) in self.renames.items():
            if fragment in name:
                return name.replace(fragment, ours), shard_id
        return name, None


def _our_name(name: str) -> Optional[str]:
    """Map old-style LayerNorm names (gamma/beta) and the layer prefix; None for tensors we do not use."""
    if name.startswith(("pooler.", "cls.")) or name.endswith("position_ids"):
        return None
    name = name.replace("encoder.layer.", "layers.")
    if name.endswith(".gamma"):
        name = name[: -len("gamma")] + "weight"
    elif name.endswith(".beta"):
        name = name[: -len("beta")] + "bias"
    return name


class BertForSequenceClassification(nn.Module):
    """A cross-encoder: the encoder over "[CLS] text_1 [SEP] text_2 [SEP]" (token type 1 from text_2 on), then
    BERT's pooler (dense + tanh on the [CLS] state) and the classifier: one logit per label. Only one label (a
    relevance score) is served: ValueError otherwise."""

    is_encoder = True
    is_cross_encoder = True  # the pooling runner scores pairs with `classify` instead of embedding

    def __init__(self, cfg, dtype: torch.dtype, max_positions: int):
        super().__init__()
        num_labels = getattr(cfg, "num_labels", 2)
        if num_labels != 1:
            raise ValueError(f"num_labels {num_labels} is not supported for a cross-encoder (only 1: a score)")
        self.bert = BertModel(cfg, dtype, max_positions)
        self.pooler = ColumnParallelLinear(cfg.hidden_size, cfg.hidden_size, True, dtype)
        self.classifier = ColumnParallelLinear(cfg.hidden_size, num_labels, True, dtype)

    def forward(self, input_ids, positions, metadata: EncoderMetadata,
                token_type_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        """As BertModel.forward: hidden [T, hidden]."""
        return self.bert(input_ids, positions, metadata, token_type_ids)

    def classify(self, cls_hidden: torch.Tensor) -> torch.Tensor:
        """[B, hidden] [CLS] states -> [B, num_labels] logits (no activation: see pooler.score_activation)."""
        return self.classifier(torch.tanh(self.pooler(cls_hidden)))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]],
                     loaded: Optional[set[tuple[str, object]]] = None) -> set[tuple[str, object]]:
        """`bert.*` into the encoder, `bert.pooler.dense.*` and `classifier.*` into the head (the encoder's pairs
        reach `loaded` after the whole checkpoint)."""
        params = dict(self.named_parameters())
        encoder_weights = []
        loaded = set() if loaded is None else loaded
        for hf_name, tensor in weights:
            name = hf_name.removeprefix("bert.")
            if name.startswith("pooler.dense.") or name.startswith("classifier."):
                name = name.replace("pooler.dense.", "pooler.")
                load_checkpoint_tensor(self, params, name, None, tensor, hf_name)
                loaded.add((name, None))
            else:
                encoder_weights.append((hf_name, tensor))
        loaded.update((f"bert.{name}", shard) for name, shard in self.bert.load_weights(encoder_weights))
        return loaded

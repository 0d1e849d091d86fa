"""The pooling runner: one forward pass over whole sequences, then one pooled vector per sequence.

Batch layout of one pass (B sequences, T tokens laid end to end):
    input_ids, positions: [T]    query_start_loc: [B + 1]    -> hidden [T, hidden] -> embeddings [B, hidden] fp32
A cross-encoder also takes token_type_ids [T] (1 from each pair's second text on) and gives scores [B] fp32 (its
classifier over the [CLS] states, then the activation of pooler.apply_score_activation).
Encoders (BERT family) attend bidirectionally and keep no KV cache at all. Decoders used for embeddings run
their usual causal forward over a scratch paged cache just big enough for this pass (each sequence's blocks in a
row), allocated for the pass and dropped after it: pooling needs no KV once the pass is done.

`launch` queues the device work (on CUDA the copy of the embeddings into pinned host memory behind an event);
`collect` waits for it: the pass's one host sync.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from asyncengine.config import EngineConfig, ModelConfig
from asyncengine.models.bert import EncoderMetadata
from asyncengine.models.layers import AttentionMetadata
from asyncengine.models.loader import load_model
from asyncengine.pooler import PoolerConfig, apply_score_activation, pool
from asyncengine.sampler import to_device


@dataclass
class PoolingInputs:
    input_ids: torch.Tensor  # [T] on the device
    positions: torch.Tensor  # [T] on the device
    query_start_loc: torch.Tensor  # [B + 1] int32 on the device
    query_start_loc_cpu: torch.Tensor  # [B + 1] int32
    max_len: int
    token_type_ids: Optional[torch.Tensor] = None  # [T] on the device; None: all 0


@dataclass
class LaunchedPooling:
    embeddings: torch.Tensor  # [B, hidden] (scores: [B]) float32, on the host once `event` completes
    event: Optional[torch.cuda.Event] = None  # None on CPU, where launching computes everything


class PoolingRunner:
    def __init__(self, config: EngineConfig, model_config: ModelConfig, max_model_len: int, pooler: PoolerConfig):
        if config.fp8_kv_cache:  # runner "auto" resolved to pooling (an explicit one is refused by EngineConfig)
            raise ValueError(f"kv_cache_dtype (--kv-cache-dtype) {config.kv_cache_dtype!r} needs the generate "
                             "runner: this checkpoint runs as a pooling model, which keeps no KV cache between "
                             "steps (supported: auto)")
        self.device = config.torch_device()
        self.model_config = model_config
        self.block_size = config.block_size
        self.pooler = pooler
        self.model = load_model(model_config, self.device, max_positions=max_model_len)
        self.is_encoder = bool(getattr(self.model, "is_encoder", False))
        if self.device.type == "cuda":
            self._warm_up(min(max_model_len, config.max_num_batched_tokens))

    def _warm_up(self, longest: int) -> None:
        """Compile the attention kernel's tile variants (they follow the longest sequence, in power-of-two
        buckets) now, not while serving."""
        n = 1
        while n <= min(longest, 128):
            self.collect(self.launch(self.prepare([[0] * n])))
            n *= 2

    def prepare(self, token_lists: list[list[int]],
                second_text_starts: Optional[list[Optional[int]]] = None) -> PoolingInputs:
        """Flat batch tensors for whole sequences (numpy on the host, then one copy each). second_text_starts:
        per sequence, the position from which its tokens have token type 1 (None: all type 0)."""
        lens = np.fromiter((len(t) for t in token_lists), np.int64, len(token_lists))
        qsl = np.zeros(len(lens) + 1, dtype=np.int32)
        np.cumsum(lens, out=qsl[1:])
        # chain.from_iterable flattens in C: half the time of a nested generator (the host's cost per token)
        ids = np.fromiter(itertools.chain.from_iterable(token_lists), np.int64, int(qsl[-1]))
        positions = np.arange(int(qsl[-1]), dtype=np.int64) - np.repeat(qsl[:-1].astype(np.int64), lens)
        token_types = None
        if second_text_starts is not None and any(s is not None for s in second_text_starts):
            starts = np.array([n if s is None else s for s, n in zip(second_text_starts, lens)], dtype=np.int64)
            token_types = to_device((positions >= np.repeat(starts, lens)).astype(np.int64), self.device)
        return PoolingInputs(
            input_ids=to_device(ids, self.device),
            positions=to_device(positions, self.device),
            query_start_loc=to_device(qsl, self.device),
            query_start_loc_cpu=torch.from_numpy(qsl),
            max_len=int(lens.max()),
            token_type_ids=token_types,
        )

    @torch.inference_mode()
    def launch(self, inputs: PoolingInputs) -> LaunchedPooling:
        """Queue the forward pass and pooling; touches no request, so it may run in a worker thread."""
        if self.is_encoder:
            metadata = EncoderMetadata(inputs.query_start_loc, inputs.query_start_loc_cpu, inputs.max_len)
            hidden = self.model(inputs.input_ids, inputs.positions, metadata, inputs.token_type_ids)
        else:
            caches, metadata = self._scratch_cache(inputs)
            hidden = self.model(inputs.input_ids, inputs.positions, caches, metadata)
        if self.pooler.scores:  # a cross-encoder: its classifier over the [CLS] states
            logits = self.model.classify(hidden[inputs.query_start_loc[:-1].long()])  # [B, 1]
            embeddings = apply_score_activation(logits, self.pooler.score_activation)  # [B] float32
        else:
            embeddings = pool(hidden, inputs.query_start_loc, self.pooler)  # [B, hidden] float32
        if self.device.type == "cpu":
            return LaunchedPooling(embeddings)
        host = torch.empty(embeddings.shape, dtype=embeddings.dtype, pin_memory=True)
        host.copy_(embeddings, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return LaunchedPooling(host, event)

    def collect(self, launched: LaunchedPooling) -> torch.Tensor:
        """Wait for a launched pass; its embeddings [B, hidden] (scores [B]) float32 on the host."""
        if launched.event is not None:
            launched.event.synchronize()
        return launched.embeddings

    def _scratch_cache(self, inputs: PoolingInputs):
        """A paged KV cache for this pass only: sequence b owns blocks [first_b, first_b + ceil(len_b / BS))."""
        mc, dev, bs = self.model_config, self.device, self.block_size
        qsl = inputs.query_start_loc_cpu.long()
        lens = qsl[1:] - qsl[:-1]
        blocks = (lens + bs - 1) // bs  # [B]
        first_block = torch.cumsum(blocks, 0) - blocks
        num_blocks, width = int(blocks.sum()), int(blocks.max())
        shape = (num_blocks, bs, mc.num_kv_heads, mc.head_dim)
        caches = [(torch.empty(shape, dtype=mc.dtype, device=dev), torch.empty(shape, dtype=mc.dtype, device=dev))
                  for _ in range(mc.num_layers)]
        tables = (first_block[:, None] + torch.arange(width)[None, :]).clamp_(max=num_blocks - 1).to(torch.int32)
        seq_of_token = torch.repeat_interleave(torch.arange(len(lens)), lens)
        offset = torch.arange(int(qsl[-1])) - qsl[:-1][seq_of_token]
        slots = first_block[seq_of_token] * bs + offset  # [T]: contiguous within each sequence's blocks
        lens32 = lens.to(torch.int32)
        metadata = AttentionMetadata(  # to_device: a pageable .to(dev) would wait for the device's whole stream
            query_start_loc=inputs.query_start_loc,
            seq_lens=to_device(lens32.numpy(), dev),
            block_tables=to_device(tables.numpy(), dev),
            slot_mapping=to_device(slots.numpy(), dev),
            query_start_loc_cpu=inputs.query_start_loc_cpu,
            seq_lens_cpu=lens32,
            max_query_len=inputs.max_len,
            max_seq_len=inputs.max_len,
        )
        return caches, metadata

"""Logits processing and sampling for a batch of S rows (one per request that samples this step).

Order of operations (as in vLLM):
  1. logprobs, when asked, come from the raw logits: log_softmax(logits)
  2. logit_bias is added; min_tokens masks EOS and stop_token_ids to -inf
  3. penalties: repetition (over prompt and output: positive logits divided, negative multiplied),
     frequency (minus f * count in output) and presence (minus p * [count > 0])
  3b. structured outputs: tokens the row's grammar forbids become -inf (constrained rows only)
  4. greedy rows (temperature below 1e-5, SamplingParams.greedy) take the argmax here
  5. other rows: divide by temperature, keep the top_k, keep the smallest set with mass >= top_p,
     drop tokens with prob < min_p * max prob, then sample by the exponential race argmax(p / q), q ~ Exp(1),
     which needs no host sync. Rows with a seed draw q from their own generator, so a seeded request samples
     the same tokens whatever else is in the batch.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import torch

from asyncengine.kernels import cpu_native
from asyncengine.request import Request
from asyncengine.stops import banned_ids
from asyncengine.structured_output import GrammarBatch


def to_device(values, device: torch.device, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """A host list or numpy array as a tensor on `device`: the engine's one way to send step inputs. On CUDA it
    goes through pinned memory without blocking: torch.tensor(..., device="cuda") copies from pageable memory and
    waits for the whole stream, which would stall a step prepared while the previous one runs."""
    host = torch.from_numpy(values) if isinstance(values, np.ndarray) else torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def to_device_packed(arrays: list[np.ndarray], device: torch.device) -> list[torch.Tensor]:
    """Several host arrays on `device`, as `to_device` sends one, but on CUDA in ONE copy: packed into one pinned
    byte buffer (`pack_arrays`), sent once, and returned as views of the device buffer, in order, each with its
    array's dtype and shape. Each copy is a step of its own on the stream, between the previous forward pass and
    the next: a decode step's ten small inputs cost ten of them (run 127, RESULTS.md). Elsewhere the arrays
    themselves, as tensors (nothing to save on a CPU)."""
    if device.type != "cuda":
        return [torch.from_numpy(np.ascontiguousarray(a)) for a in arrays]
    host, offsets = pack_arrays(arrays, pin=True)
    return unpack_arrays(host.to(device, non_blocking=True), arrays, offsets)


def pack_arrays(arrays: list[np.ndarray], pin: bool = False) -> tuple[torch.Tensor, list[int]]:
    """(one byte buffer holding the arrays' bytes, each array's offset in it): every offset 16-byte aligned, the
    alignment Triton specialises its kernels on, as a tensor of its own has."""
    arrays = [np.ascontiguousarray(a) for a in arrays]
    offsets, size = [], 0
    for a in arrays:
        offsets.append(size)
        size += -(-a.nbytes // 16) * 16
    buffer = torch.empty(max(size, 16), dtype=torch.uint8, pin_memory=pin)
    buffer_bytes = buffer.numpy()
    for a, offset in zip(arrays, offsets):
        buffer_bytes[offset: offset + a.nbytes] = a.reshape(-1).view(np.uint8)
    return buffer, offsets


def unpack_arrays(buffer: torch.Tensor, arrays: list[np.ndarray], offsets: list[int]) -> list[torch.Tensor]:
    """Views of `buffer` (pack_arrays' buffer, or a copy of it) with each array's dtype and shape."""
    return [buffer[offset: offset + a.nbytes].view(torch.from_numpy(np.asarray(a)[:0]).dtype).view(np.shape(a))
            for a, offset in zip(arrays, offsets)]


@dataclass
class SamplingBatch:
    """Host-side description of the rows, built once per step; tensors live on the logits' device."""

    requests: list[Request]
    temperature: torch.Tensor  # [S] float32, 1.0 for greedy rows (unused there)
    greedy: torch.Tensor  # [S] bool
    top_k: Optional[torch.Tensor]  # [S] int64, vocab size where disabled; None if no row uses it
    top_p: Optional[torch.Tensor]  # [S] float32
    min_p: Optional[torch.Tensor]  # [S] float32
    all_greedy: bool
    max_logprobs: int  # the largest top-N asked by any row
    wants_logprobs: bool
    biases: list[tuple[int, torch.Tensor, torch.Tensor]] = field(default_factory=list)  # (row, ids, values)
    banned: list[tuple[int, torch.Tensor]] = field(default_factory=list)  # (row, ids) set to -inf
    penalties: Optional["PenaltyBatch"] = None
    # [S] each row's last input token on the device, set by the runner at launch when penalties need it
    last_input_ids: Optional[torch.Tensor] = None
    grammar: Optional[GrammarBatch] = None  # the constrained rows; None when no row is constrained
    grammar_bitmask: Optional[torch.Tensor] = None  # [C, ceil(V/32)] int32, set by the runner at launch

    @classmethod
    def build(cls, requests: list[Request], vocab_size: int, device: torch.device,
              inflight: Optional[list[bool]] = None) -> "SamplingBatch":
        """inflight[row]: the row's last input token is in flight (lookahead), not yet among its tokens."""
        params = [r.params for r in requests]
        greedy = [p.greedy for p in params]
        temps = [1.0 if g else p.temperature for p, g in zip(params, greedy)]

        def optional(values, neutral, dtype):
            if all(v == neutral for v in values):
                return None
            return to_device(values, device, dtype)

        batch = cls(
            requests=requests,
            temperature=to_device(temps, device, torch.float32),
            greedy=to_device(greedy, device, torch.bool),
            top_k=optional([min(p.top_k, vocab_size) if p.top_k > 0 else vocab_size for p in params], vocab_size,
                           torch.int64),  # any top_k beyond the vocabulary means "all tokens"
            top_p=optional([p.top_p for p in params], 1.0, torch.float32),
            min_p=optional([p.min_p for p in params], 0.0, torch.float32),
            all_greedy=all(greedy),
            max_logprobs=max((p.logprobs or 0 for p in params), default=0),
            wants_logprobs=any(p.logprobs is not None for p in params),
        )
        for row, (request, p) in enumerate(zip(requests, params)):
            if p.logit_bias:
                ids = to_device(list(p.logit_bias), device, torch.int64)
                vals = to_device(list(p.logit_bias.values()), device, torch.float32)
                batch.biases.append((row, ids, vals))
            banned = banned_ids(request)  # min_tokens not yet out: its stop ids cannot be sampled
            if banned:
                batch.banned.append((row, to_device(banned, device, torch.int64)))
        batch.penalties = PenaltyBatch.build(requests, inflight, vocab_size, device)
        batch.grammar = GrammarBatch.build(requests, vocab_size)
        return batch


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # [S] int64
    logprobs: Optional[torch.Tensor] = None  # [S, 1 + N] logprob of the sampled token, then the top N
    logprob_ids: Optional[torch.Tensor] = None  # [S, 1 + N] token ids matching `logprobs`
    ranks: Optional[torch.Tensor] = None  # [S] rank of the sampled token (1 = most likely)


def _flat_ids(lists: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    """(row index of each id, the ids) of several lists, concatenated: int64 arrays of the total length."""
    lengths = [len(ids) for ids in lists]
    ids = np.fromiter(itertools.chain.from_iterable(lists), dtype=np.int64, count=sum(lengths))
    return np.repeat(np.arange(len(lists), dtype=np.int64), lengths), ids


@dataclass
class PenaltyBatch:
    """The P penalised rows of a step, sent to the device when the step is prepared; `apply` then needs no host
    data and no sync. A row whose last input token is still in flight (lookahead: sampled by the previous step,
    not yet booked) has it counted on the device, from the step's input ids, so penalties see every output token
    in plain and lookahead mode alike."""

    rows: torch.Tensor  # [P] int64, sampling rows
    output_rows: torch.Tensor  # [N] int64 in [0, P): the penalised row of each booked output token
    output_ids: torch.Tensor  # [N] int64
    inflight_rows: Optional[torch.Tensor]  # [F] int64 in [0, P): rows with an output token in flight
    inflight_sampling_rows: Optional[torch.Tensor]  # [F] int64: the same rows' index among the sampling rows
    seen_rows: Optional[torch.Tensor]  # [M] int64 in [0, P): prompt tokens of the repetition-penalised rows
    seen_ids: Optional[torch.Tensor]  # [M] int64
    repetition: Optional[torch.Tensor]  # [P, 1]; None when no row has a repetition penalty
    frequency: torch.Tensor  # [P, 1]
    presence: torch.Tensor  # [P, 1]

    @classmethod
    def build(cls, requests: list[Request], inflight: Optional[list[bool]], vocab_size: int,
              device: torch.device) -> Optional["PenaltyBatch"]:
        """None when no row asks for penalties. inflight[row]: the row's last input token is in flight."""
        rows = [i for i, r in enumerate(requests) if r.params.needs_penalties]
        if not rows:
            return None
        pen = [requests[i] for i in rows]
        out_rows, out_ids = _flat_ids([r.output_token_ids for r in pen])  # the booked ones
        flying = [k for k, row in enumerate(rows) if inflight is not None and inflight[row]]
        rep_rows = [k for k, r in enumerate(pen) if r.params.repetition_penalty != 1.0]
        seen_rows, seen_ids = _flat_ids([[t for t in pen[k].prompt_token_ids if t < vocab_size] for k in rep_rows])
        params = [r.params for r in pen]
        column = lambda values: to_device(values, device, torch.float32).unsqueeze(1)  # noqa: E731
        return cls(
            rows=to_device(rows, device, torch.int64),
            output_rows=to_device(out_rows, device),
            output_ids=to_device(out_ids, device),
            inflight_rows=to_device(flying, device, torch.int64) if flying else None,
            inflight_sampling_rows=to_device([rows[k] for k in flying], device, torch.int64) if flying else None,
            seen_rows=to_device(np.asarray(rep_rows, dtype=np.int64)[seen_rows], device) if len(seen_ids) else None,
            seen_ids=to_device(seen_ids, device) if len(seen_ids) else None,
            repetition=column([p.repetition_penalty for p in params]) if rep_rows else None,
            frequency=column([p.frequency_penalty for p in params]),
            presence=column([p.presence_penalty for p in params]),
        )

    def apply(self, logits: torch.Tensor, last_input_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        """In place on logits [S, V] float32. last_input_ids: [S] each sampling row's last input token (on the
        device), needed when a row has a token in flight."""
        num_rows, vocab = self.rows.shape[0], logits.shape[1]
        one = torch.ones((), dtype=logits.dtype, device=logits.device)
        counts = torch.zeros(num_rows, vocab, dtype=logits.dtype, device=logits.device)  # [P, V]
        counts.index_put_((self.output_rows, self.output_ids), one, accumulate=True)
        if self.inflight_rows is not None:
            if last_input_ids is None:
                raise ValueError("rows with a token in flight need the step's last input ids")
            counts.index_put_((self.inflight_rows, last_input_ids[self.inflight_sampling_rows]), one, accumulate=True)
        sub = logits.index_select(0, self.rows)  # [P, V]
        if self.repetition is not None:
            seen = counts > 0
            if self.seen_ids is not None:
                seen[self.seen_rows, self.seen_ids] = True
            rep = self.repetition
            sub = torch.where(seen, torch.where(sub > 0, sub / rep, sub * rep), sub)  # rep 1 rows: unchanged
        sub = sub - self.frequency * counts - self.presence * (counts > 0).to(logits.dtype)
        logits.index_copy_(0, self.rows, sub)
        return logits


def apply_penalties(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    """In place on logits [S, V]: repetition, frequency and presence penalties over every booked token."""
    penalties = PenaltyBatch.build(requests, None, logits.shape[1], logits.device)
    return logits if penalties is None else penalties.apply(logits)


def apply_filters(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Temperature, top_k and top_p on logits [S, V] (returns new logits with -inf for dropped tokens)."""
    logits = logits / batch.temperature.unsqueeze(1)
    if batch.top_k is None and batch.top_p is None:
        return logits
    sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True)
    drop = torch.zeros_like(sorted_logits, dtype=torch.bool)
    if batch.top_k is not None:
        ranks = torch.arange(logits.shape[1], device=logits.device).unsqueeze(0)
        drop |= ranks >= batch.top_k.unsqueeze(1)
    if batch.top_p is not None:
        probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs  # probability of strictly better tokens
        drop |= mass_before >= batch.top_p.unsqueeze(1)
    drop[:, 0] = False  # always keep the most likely token
    return logits.scatter(1, sorted_idx, sorted_logits.masked_fill(drop, float("-inf")))


def exponential_race(probs: torch.Tensor, requests: list[Request], generator: Optional[torch.Generator]) -> torch.Tensor:
    """argmax(p / q) with q ~ Exp(1) is a draw from p; seeded rows use their own generator."""
    q = torch.empty_like(probs).exponential_(generator=generator)
    for row, request in enumerate(requests):
        if request.generator is not None:
            q[row].exponential_(generator=request.generator)
    return (probs / q).argmax(dim=-1)


ARGMAX_BLOCK = 64


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """logits.argmax(dim=-1) of [S, V] logits: the first index of each row's largest value (NaN counts as largest).

    On CPU the LM head leaves the logits as a transposed view of a contiguous [V, S] (model_runner: `weight @
    hidden^T` runs faster there), and argmax along a row then strides through memory (0.6-0.9 ms for 64 x 8192 on
    this 2-core machine). Here it is found in three passes over contiguous memory (~0.1 ms): each block of
    ARGMAX_BLOCK vocabulary entries' maximum per row, the first block holding the row's maximum, the first index of
    it within that block; the same first index as argmax, NaN included (max and argmax both take NaN as largest).
    Contiguous float32 rows (oneDNN's head) take the native kernel (kernels/cpu_native.argmax_rows, the same rule)."""
    rows, vocab = logits.shape
    if logits.device.type == "cpu" and cpu_native.takes_rows(logits) and vocab:  # contiguous rows (oneDNN's head)
        return cpu_native.argmax_rows(logits)
    if logits.device.type != "cpu" or logits.stride(0) != 1 or vocab % ARGMAX_BLOCK or rows < 2:
        return logits.argmax(dim=-1)
    blocks = logits.t().view(vocab // ARGMAX_BLOCK, ARGMAX_BLOCK, rows)  # [V / B, B, S], contiguous
    best_block = blocks.amax(dim=1).argmax(dim=0)  # [S]
    within = blocks[best_block, :, torch.arange(rows)].argmax(dim=1)  # [S, B] -> [S]
    return best_block * ARGMAX_BLOCK + within


class Sampler:
    def __init__(self, generator: Optional[torch.Generator] = None):
        self.generator = generator

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        """logits: [S, V] float32 (modified in place) -> sampled token ids and, when asked, logprobs."""
        raw_logprobs = logits.log_softmax(dim=-1) if batch.wants_logprobs else None
        for row, ids, values in batch.biases:
            logits[row].index_add_(0, ids, values)
        for row, ids in batch.banned:
            logits[row, ids] = float("-inf")
        if batch.penalties is not None:
            batch.penalties.apply(logits, batch.last_input_ids)
        if batch.grammar is not None:
            if batch.grammar_bitmask is None:
                raise ValueError("constrained rows need the step's grammar bitmask")
            batch.grammar.apply(logits, batch.grammar_bitmask)
        tokens = greedy_tokens(logits)
        if not batch.all_greedy:
            probs = apply_filters(logits, batch).softmax(dim=-1)
            if batch.min_p is not None:
                threshold = batch.min_p.unsqueeze(1) * probs.max(dim=-1, keepdim=True).values
                probs = probs.masked_fill(probs < threshold, 0.0)
            sampled = exponential_race(probs, batch.requests, self.generator)
            tokens = torch.where(batch.greedy, tokens, sampled)
        out = SamplerOutput(token_ids=tokens)
        if raw_logprobs is not None:
            chosen = raw_logprobs.gather(1, tokens.unsqueeze(1))  # [S, 1]
            out.ranks = (raw_logprobs > chosen).sum(dim=-1) + 1
            top_vals, top_ids = raw_logprobs.topk(batch.max_logprobs, dim=-1)
            out.logprobs = torch.cat([chosen, top_vals], dim=1)
            out.logprob_ids = torch.cat([tokens.unsqueeze(1), top_ids], dim=1)
        return out

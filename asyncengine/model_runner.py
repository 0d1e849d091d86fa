"""The model runner: owns the device, the weights and the KV cache, turns a SchedulerOutput into one forward pass
and samples the next tokens.

Batch layout of one step (T tokens over B scheduled requests, S of which sample):
    input_ids, positions, slot_mapping: [T]    query_start_loc: [B + 1]    seq_lens: [B]
    block_tables: [B, max_blocks]             logits_indices: [S] (last row of each sampling request)
    pooling_indices: [P] (last row of each pooling request, only when the step has one) -> pooled [P, hidden] fp32
Host-side inputs are built as CPU tensors (pinned on CUDA) and copied without blocking. A step is `launch`ed
(forward and sampling queued on the device, sampled tokens copied into pinned host memory behind a CUDA event)
and later `collect`ed (waits on that event: the step's one host sync). Between the two the host may prepare and
launch the next step: a decoding request whose last token is still in flight gets it from the previous step's
sampled tokens on the device (`StepInputs.feedback`), so the GPU never waits for the host to read a token back.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from asyncengine.config import EngineConfig, ModelConfig
from asyncengine.distributed.executor import StepChannel, WorkerGroup
from asyncengine.distributed.parallel_state import all_reduce_min
from asyncengine.kernels.cpu import allocate_kv_cache, make_decode_mirror, plan_attention
from asyncengine.models.layers import AttentionMetadata, PagedAttention
from asyncengine.models.loader import load_model
from asyncengine.outputs import Logprob
from asyncengine.request import Request
from asyncengine.sampler import Sampler, SamplerOutput, SamplingBatch, to_device_packed
from asyncengine.sampling_params import SamplingParams
from asyncengine.scheduler import SchedulerOutput

logger = logging.getLogger(__name__)


@dataclass
class StepInputs:
    """Everything one step's device work needs, built on the host beforehand (so the device work never reads
    request state that the event loop may change meanwhile)."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    metadata: AttentionMetadata
    logits_indices: torch.Tensor
    sampling_requests: list[Request]
    sampling: Optional[SamplingBatch] = None
    graph_size: Optional[int] = None  # the CUDA graph to replay, or None for an eager forward
    logprobs_asked: dict[str, int] = None  # request id -> top-N, for the rows that asked
    # input rows [F] whose token is in flight, and their rows [F] in the previous step's sampled tokens
    feedback: Optional[tuple[torch.Tensor, torch.Tensor]] = None
    step_index: int = 0  # the order of prepare() calls; a step with feedback must follow its source directly
    # pooling requests whose last prompt token this step computes, and those tokens' rows [P] (None: no such
    # request, the usual case: nothing of pooling touches the step then)
    pooling_requests: tuple[Request, ...] = ()
    pooling_indices: Optional[torch.Tensor] = None


@dataclass
class LaunchedStep:
    """A step queued on the device: its sampled tokens (and logprobs) land in `host` once `event` completes."""

    inputs: StepInputs
    host: Optional["SamplerOutput"] = None  # None when no request samples
    event: Optional[torch.cuda.Event] = None  # None on CPU, where launching computes everything
    pooled: Optional[torch.Tensor] = None  # [P, hidden] float32 final hidden states at the pooling rows (host)


@dataclass
class StepResult:
    """What one step produced, on the host: request id -> sampled token, and -> logprobs when asked."""

    tokens: dict[str, int]
    logprobs: dict[str, dict[int, Logprob]]
    pooled: Optional[torch.Tensor] = None  # [P, hidden] float32, in the order of StepInputs.pooling_requests


class ModelRunner:
    """One rank's model. Rank 0 (the engine's) prepares, launches and collects steps; with tensor parallelism it
    first starts ranks 1..N-1 (`WorkerGroup`), each a ModelRunner built with its `rank` and `device` that
    `follow`s rank 0's steps. With one rank there is no process group and no extra work per step."""

    def __init__(self, config: EngineConfig, model_config: ModelConfig, max_model_len: int, rank: int = 0,
                 device: Optional[torch.device] = None):
        self.config = config
        self.model_config = model_config
        self.rank = rank
        self.block_size = config.block_size
        self.max_model_len = max_model_len
        self.workers: Optional[WorkerGroup] = None
        self.channel: Optional[StepChannel] = None
        self.device = device or config.torch_device()
        # the cache's storage: the model's dtype, or e4m3 (--kv-cache-dtype fp8: 1 byte per element)
        self.kv_cache_dtype = config.kv_cache_torch_dtype(model_config.dtype)
        if config.tensor_parallel_size > 1:
            if rank == 0:  # the world exists once this returns; the layers below read its rank and size
                self.workers = WorkerGroup(config, model_config, max_model_len)
                self.device = self.workers.rank0_device
                if self.device.type == "cuda":
                    torch.cuda.set_device(self.device)
                self.workers.start()
            self.channel = StepChannel(self.device, self.block_size, self.kv_cache_dtype)
        try:
            self._build(config, model_config, max_model_len)
        except BaseException:
            self.close(graceful=False)
            raise

    def _build(self, config: EngineConfig, model_config: ModelConfig, max_model_len: int) -> None:
        self.model = load_model(model_config, self.device, max_positions=max_model_len,
                                load_format=config.load_format, seed=config.seed)
        if self.rank == 0:
            self._log_kv_scales()
        generator = torch.Generator(device=self.device)
        generator.manual_seed(config.seed)
        self.sampler = Sampler(generator)
        # The graphs' static buffers exist before the KV cache is sized, so the profile counts them.
        self.graphs: Optional[DecodeGraphs] = None
        if self.device.type == "cuda" and not config.enforce_eager:
            self.graphs = DecodeGraphs(self)
        self.num_blocks = all_reduce_min(self._choose_num_blocks())  # the rank with least room decides
        # this rank's heads only (kv_heads_per_rank)
        shape = (self.num_blocks, self.block_size, model_config.kv_heads_per_rank, model_config.head_dim)
        self.kv_caches = [(self._allocate_cache(shape), self._allocate_cache(shape))
                          for _ in range(model_config.num_layers)]
        # CPU without the native decode attention: the decode rows' K/V kept contiguous across steps
        # (kernels/cpu.py); plans are made in forward order
        self.cpu_mirror = make_decode_mirror(self.kv_cache_dtype) if self.device.type == "cpu" else None
        self._num_prepared = 0
        self._last_launched = -1  # step_index of the last launched step
        self._last_sampled: Optional[torch.Tensor] = None  # [S] its sampled tokens, on the device
        self.grammar_mask_seconds = 0.0  # host time spent building structured-output masks (device thread)
        self.grammar_masked_steps = 0  # steps that had constrained rows
        if self.device.type == "cuda":
            self._warm_up_kernels()
            if self.graphs is not None:
                self.graphs.capture()

    def _log_kv_scales(self) -> None:
        """Say once which KV-cache scales run: the checkpoint's (used only by an FP8 cache) or 1.0."""
        scales = [(m.k_scale, m.v_scale) for m in self.model.modules() if isinstance(m, PagedAttention)]
        from_checkpoint = any(s != (1.0, 1.0) for s in scales)
        if self.kv_cache_dtype == torch.float8_e4m3fn:
            logger.info("FP8 KV cache (e4m3): %s", "the checkpoint's per-layer k_scale / v_scale" if from_checkpoint
                        else "no scales in the checkpoint: k_scale = v_scale = 1.0")
        elif from_checkpoint:
            logger.info("the checkpoint's KV-cache scales are unused: the cache is %s (--kv-cache-dtype fp8 uses "
                        "them)", str(self.kv_cache_dtype).removeprefix("torch."))

    @property
    def kv_sliding_window(self) -> Optional[int]:
        """The widest sliding window when every layer of the model has one, else None: past it, KV blocks can be
        given back (models list their layers' windows in `sliding_windows`; those that do not see everything)."""
        windows = getattr(self.model, "sliding_windows", None)
        if not windows or any(w is None for w in windows):
            return None
        return max(windows)

    def tokens_one_sequence_holds(self) -> int:
        """KV slots one sequence may hold at once: max_model_len, or, when every layer has a sliding window (blocks
        before it are given back), its window plus two steps' tokens (one may still be in flight, its blocks not yet
        released) plus two partial blocks."""
        window = self.kv_sliding_window
        if window is None:
            return self.max_model_len
        step = self.config.max_num_batched_tokens
        return min(self.max_model_len, window + 2 * step + 2 * self.block_size)

    def _allocate_cache(self, shape: tuple[int, int, int, int]) -> torch.Tensor:
        """One zeroed cache [num_blocks, block_size, KVH, D]; on CPU stored heads-major for the CPU kernels
        (`kernels.cpu.allocate_kv_cache`: the same logical tensor, a faster layout for their attention)."""
        if self.device.type == "cpu":
            return allocate_kv_cache(shape, self.kv_cache_dtype)
        return torch.zeros(shape, dtype=self.kv_cache_dtype, device=self.device)

    # -- KV cache sizing --------------------------------------------------------------------------------------
    def bytes_per_block(self) -> int:
        """KV bytes of one block on this rank, all layers, K and V (1 byte per element with an FP8 cache)."""
        return self.block_size * self.model_config.kv_bytes_per_token(self.kv_cache_dtype)

    def _choose_num_blocks(self) -> int:
        if self.config.num_kv_blocks is not None:
            return self.config.num_kv_blocks
        # Never more than every sequence slot filled to what one sequence holds at once needs.
        enough = self.config.max_num_seqs * (-(-self.tokens_one_sequence_holds() // self.block_size) + 1)
        if self.device.type == "cuda":
            budget = self._profile_free_gpu_memory()
        else:
            budget = int(self.config.kv_cache_memory_gb * 2**30)
        return max(1, min(enough, budget // self.bytes_per_block()))

    def _profile_free_gpu_memory(self) -> int:
        """Run the largest step once (forward, logits and the costliest sampling for max_num_seqs rows) to learn
        peak activation memory; return what is left for the KV cache under gpu_memory_utilization. The decode
        graphs' private pool (one decode forward's intermediates) is not counted: it lives in the headroom."""
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        logits = self._dummy_forward(self.config.max_num_batched_tokens)
        self._dummy_sampling(logits)
        del logits
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        torch.cuda.empty_cache()
        total = torch.cuda.get_device_properties(self.device).total_memory
        free_budget = int(total * self.config.gpu_memory_utilization) - peak
        if free_budget <= 0:
            raise RuntimeError(f"no GPU memory left for the KV cache (peak {peak / 2**30:.1f} GiB of {total / 2**30:.1f})")
        return free_budget

    def _warm_up_kernels(self) -> None:
        """Compile every tile variant of the prefill kernel now (its tile size follows the longest query of a
        step, in power-of-two buckets), so no request meets a Triton compilation while serving."""
        for num_tokens in (1, 2, 4, 8, 16, 32, 64, 128):
            if num_tokens <= min(self.max_model_len, self.config.max_num_batched_tokens):
                self._dummy_forward(num_tokens)
        torch.cuda.synchronize(self.device)

    @torch.inference_mode()
    def _dummy_forward(self, num_tokens: int) -> torch.Tensor:
        """A prefill of num_tokens random tokens, as sequences of at most max_model_len tokens (a step may carry
        max_num_batched_tokens over many sequences), into a throw-away cache just big enough for it; returns the
        logits of its last max_num_seqs rows."""
        mc, dev, bs = self.model_config, self.device, self.block_size
        lens = [min(self.max_model_len, num_tokens - start) for start in range(0, num_tokens, self.max_model_len)]
        blocks_per_seq = -(-lens[0] // bs)
        num_blocks = blocks_per_seq * len(lens)
        shape = (num_blocks, bs, mc.kv_heads_per_rank, mc.head_dim)
        kv = self.kv_cache_dtype  # the real cache's dtype: the profile and the warm-up run its kernels
        caches = [(torch.empty(shape, dtype=kv, device=dev), torch.empty(shape, dtype=kv, device=dev))
                  for _ in range(mc.num_layers)]
        qsl = torch.tensor([0, *np.cumsum(lens)], dtype=torch.int32)
        seq_lens = torch.tensor(lens, dtype=torch.int32)
        block_tables = torch.arange(num_blocks, dtype=torch.int32).view(len(lens), blocks_per_seq)
        # slot of token t of sequence i: its own blocks, in order
        slots = torch.cat([block_tables[i, 0] * bs + torch.arange(n) for i, n in enumerate(lens)])
        positions = torch.cat([torch.arange(n) for n in lens])
        metadata = AttentionMetadata(
            query_start_loc=qsl.to(dev),
            seq_lens=seq_lens.to(dev),
            block_tables=block_tables.to(dev),
            slot_mapping=slots.to(dev, torch.int64),
            query_start_loc_cpu=qsl,
            seq_lens_cpu=seq_lens,
            max_query_len=lens[0],
            max_seq_len=lens[0],
        )
        ids = torch.randint(0, mc.vocab_size, (num_tokens,), device=dev)
        hidden = self.model(ids, positions.to(dev), caches, metadata)
        return self.model.compute_logits(hidden[-self.config.max_num_seqs :])

    @torch.inference_mode()
    def _dummy_sampling(self, logits: torch.Tensor) -> None:
        """Sample logits [R, vocab] with every option that costs memory (penalties, temperature, top-k/p and
        min-p filters, 20 logprobs), on max_num_seqs rows: a full decode batch samples that many, each needing
        [vocab]-wide temporaries (counts, sort indices, probabilities, noise), several GB at 1024 rows of a 128k
        vocabulary."""
        rows = self.config.max_num_seqs
        if logits.shape[0] < rows:  # a short profiled step: sampling needs its full row count anyway
            logits = logits.new_zeros(rows, logits.shape[1]).normal_()
        params = SamplingParams(temperature=0.7, top_k=50, top_p=0.9, min_p=0.05, logprobs=20,
                                repetition_penalty=1.1, frequency_penalty=0.1, presence_penalty=0.1)
        requests = [Request(f"profile-{i}", [0], params, max_tokens=1) for i in range(rows)]
        throwaway = Sampler(torch.Generator(device=self.device))  # leaves the engine's seeded stream untouched
        throwaway(logits[:rows], SamplingBatch.build(requests, logits.shape[1], self.device))

    # -- one step ---------------------------------------------------------------------------------------------
    def make_generator(self, seed: int) -> torch.Generator:
        generator = torch.Generator(device=self.device)
        generator.manual_seed(seed & 0xFFFF_FFFF_FFFF_FFFF)
        return generator

    def prepare(self, sched: SchedulerOutput) -> StepInputs:
        """Flat batch tensors for the scheduled requests (numpy on the host, then one copy each)."""
        items = sched.scheduled
        num_seqs, bs = len(items), self.block_size
        num_new = np.fromiter((s.num_new_tokens for s in items), np.int64, num_seqs)
        starts = np.fromiter((s.start for s in items), np.int64, num_seqs)
        qsl = np.zeros(num_seqs + 1, dtype=np.int32)
        np.cumsum(num_new, out=qsl[1:])
        seq_lens = (starts + num_new).astype(np.int32)
        num_tokens = int(qsl[-1])
        # positions: start_b + i for the i-th new token of sequence b
        positions = np.arange(num_tokens, dtype=np.int64) + np.repeat(starts - qsl[:-1], num_new)
        tables = np.zeros((num_seqs, max(len(s.request.block_table) for s in items)), dtype=np.int32)
        for row, item in enumerate(items):
            table = item.request.block_table
            tables[row, : len(table)] = table
        rows = np.repeat(np.arange(num_seqs), num_new)
        slots = tables[rows, positions // bs].astype(np.int64) * bs + positions % bs
        input_ids, feedback = self._input_ids(items, qsl)
        sampling = [s.request for s in items if s.samples]
        for row, request in enumerate(sampling):  # after _input_ids, which reads the previous step's rows
            request.inflight_row = row
        logits_idx = np.array([qsl[i + 1] - 1 for i, s in enumerate(items) if s.samples], dtype=np.int64)
        inflight = np.isin(logits_idx, feedback[0]).tolist()  # a sampling row whose last input is in flight
        pooling = tuple(s.request for s in items if s.pools)
        pooling_idx = [qsl[i + 1] - 1 for i, s in enumerate(items) if s.pools] if pooling else None
        qsl_cpu, lens_cpu = torch.from_numpy(qsl), torch.from_numpy(seq_lens)
        # the step's inputs in one host-to-device copy (to_device_packed)
        sent = to_device_packed([qsl, seq_lens, tables, slots, input_ids, positions, logits_idx,
                                 np.asarray(feedback[0], dtype=np.int64), np.asarray(feedback[1], dtype=np.int64),
                                 np.asarray(pooling_idx or [], dtype=np.int64)], self.device)
        d_qsl, d_seq_lens, d_tables, d_slots, d_input_ids, d_positions, d_logits_idx, *d_feedback, d_pooling = sent
        metadata = AttentionMetadata(
            query_start_loc=d_qsl,
            seq_lens=d_seq_lens,
            block_tables=d_tables,
            slot_mapping=d_slots,
            query_start_loc_cpu=qsl_cpu,
            seq_lens_cpu=lens_cpu,
            max_query_len=int(num_new.max()),
            max_seq_len=int(seq_lens.max()),
            # CPU: attention's index tensors, built here once for every layer of the step
            cpu_plan=(plan_attention(qsl, seq_lens, tables, bs, mirror=self.cpu_mirror)
                      if self.device.type == "cpu" else None),
        )
        self._num_prepared += 1
        return StepInputs(
            input_ids=d_input_ids,
            positions=d_positions,
            metadata=metadata,
            logits_indices=d_logits_idx,
            sampling_requests=sampling,
            # Built before the forward is launched: its small host-to-device copies never wait on the GPU.
            sampling=SamplingBatch.build(sampling, self.model_config.vocab_size, self.device, inflight),
            graph_size=self.graphs.batch_size_for(sched) if self.graphs is not None else None,
            logprobs_asked={r.request_id: r.params.logprobs for r in sampling if r.params.logprobs is not None},
            feedback=tuple(d_feedback) if feedback[0] else None,
            step_index=self._num_prepared,
            pooling_requests=pooling,
            pooling_indices=d_pooling if pooling else None,
        )

    @staticmethod
    def _input_ids(items, qsl: np.ndarray) -> tuple[np.ndarray, tuple[list[int], list[int]]]:
        """The step's input token ids [T]; a request's last input may be in flight (sampled by the previous step,
        not yet booked): it gets a 0 here and an entry in the feedback lists (input row, source row)."""
        ids: list[int] = []
        fb_rows: list[int] = []
        fb_sources: list[int] = []
        for i, item in enumerate(items):
            known = item.request.token_ids[item.start : item.start + item.num_new_tokens]
            ids.extend(known)
            missing = item.num_new_tokens - len(known)
            if missing:
                if missing != 1:
                    raise RuntimeError(f"{item.request!r}: {missing} input tokens in flight (at most 1 can be)")
                ids.append(0)
                fb_rows.append(int(qsl[i + 1]) - 1)
                fb_sources.append(item.request.inflight_row)
        return np.array(ids, dtype=np.int64), (fb_rows, fb_sources)

    def launch(self, inputs: StepInputs) -> LaunchedStep:
        """Queue the step's device work: in-flight input tokens, forward, logits, sampling, and the copy of the
        sampled tokens to the host. Touches no request, so it may run in a worker thread while the loop goes on.
        On CPU the work is done when this returns. With tensor parallelism the step is on the workers' clock
        (a step that does not finish in time means a hung rank) until `collect`."""
        if self.workers is None:
            return self._launch(inputs)
        self.workers.clock.started()
        try:
            return self._launch(inputs)
        except BaseException:
            self.workers.clock.finished()
            self._check_workers()  # the broken collective's error, told why (a worker exited or hung)
            raise

    @torch.inference_mode()
    def _launch(self, inputs: StepInputs) -> LaunchedStep:
        if inputs.feedback is not None:
            if inputs.step_index != self._last_launched + 1 or self._last_sampled is None:
                raise RuntimeError("a step whose inputs are in flight must be launched right after the step that samples them")
            rows, sources = inputs.feedback
            inputs.input_ids[rows] = self._last_sampled[sources]
        self._last_launched, self._last_sampled = inputs.step_index, None
        penalties = inputs.sampling.penalties if inputs.sampling is not None else None
        if penalties is not None and penalties.inflight_rows is not None:  # their in-flight tokens, now known
            inputs.sampling.last_input_ids = inputs.input_ids.index_select(0, inputs.logits_indices)
        if self.channel is not None:  # the other ranks run the same forward pass
            self._check_workers()
            self.channel.send(inputs.input_ids, inputs.positions, inputs.metadata, inputs.logits_indices,
                              inputs.graph_size)
        logits, hidden = self._forward(inputs)
        pooled = None
        if inputs.pooling_indices is not None:  # never in a graph replay (a pure decode step)
            pooled = hidden.index_select(0, inputs.pooling_indices).float()  # [P, hidden]
        if logits is None:
            return self._launched_without_sampling(inputs, pooled)
        grammar = inputs.sampling.grammar
        if grammar is not None:  # the forward is queued: build the mask while the device runs it
            inputs.sampling.grammar_bitmask = grammar.mask(self.device)
            self.grammar_mask_seconds += grammar.fill_seconds
            self.grammar_masked_steps += 1
        out = self.sampler(logits, inputs.sampling)
        self._last_sampled = out.token_ids
        if self.device.type == "cpu":
            if grammar is not None:
                grammar.record_sampled(out.token_ids, None)
            return LaunchedStep(inputs, out, pooled=pooled)
        host = SamplerOutput(*(None if t is None else self._copy_to_pinned(t)
                               for t in (out.token_ids, out.logprobs, out.logprob_ids, out.ranks)))
        pooled_host = self._copy_to_pinned(pooled) if pooled is not None else None
        event = torch.cuda.Event()
        event.record()
        if grammar is not None:
            grammar.record_sampled(host.token_ids, event)
        return LaunchedStep(inputs, host, event, pooled_host)

    def _launched_without_sampling(self, inputs: StepInputs, pooled: Optional[torch.Tensor]) -> LaunchedStep:
        """A step of prefill chunks only: nothing to read back but the pooled states, if any."""
        if pooled is None or self.device.type == "cpu":
            return LaunchedStep(inputs, pooled=pooled)
        pooled_host = self._copy_to_pinned(pooled)
        event = torch.cuda.Event()
        event.record()
        return LaunchedStep(inputs, event=event, pooled=pooled_host)

    def _forward(self, inputs) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        """The step's forward pass (a graph replay or eager): its logits [S, vocab] float32 (None if no row
        samples) and final hidden states [T, hidden] (None for a graph replay). `inputs`: StepInputs, or a
        worker's FollowerStep (the same fields but sampling and pooling)."""
        if inputs.graph_size is not None:
            return self.graphs.run(inputs.graph_size, inputs), None
        hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.metadata)
        if inputs.logits_indices.shape[0] == 0:
            return None, hidden
        return self.model.compute_logits(hidden[inputs.logits_indices]), hidden

    @torch.inference_mode()
    def follow(self) -> None:
        """Ranks 1..N-1: run rank 0's steps (their forward passes; the logits are gathered, not sampled) until
        rank 0 says stop."""
        while (step := self.channel.receive()) is not None:
            self._forward(step)

    def _check_workers(self) -> None:
        if self.workers is not None and self.workers.failure is not None:
            raise RuntimeError(f"tensor parallelism is broken: {self.workers.failure}")

    def failure(self) -> Optional[BaseException]:
        """Why this runner cannot step any more (a tensor-parallel worker died), or None."""
        return self.workers.failure if self.workers is not None else None

    def close(self, graceful: bool = True) -> None:
        """Rank 0: stop the other ranks (idempotent; nothing to do with one rank)."""
        if self.workers is not None:
            self.workers.stop(graceful, self.channel)

    @staticmethod
    def _copy_to_pinned(tensor: torch.Tensor) -> torch.Tensor:
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        return host.copy_(tensor, non_blocking=True)

    def collect(self, launched: LaunchedStep) -> StepResult:
        """Wait for a launched step (the step's one host sync) and read its sampled tokens, logprobs and pooled
        states."""
        if self.workers is None:
            return self._collect(launched)
        try:
            return self._collect(launched)
        except BaseException:
            self._check_workers()
            raise
        finally:
            self.workers.clock.finished()

    def _collect(self, launched: LaunchedStep) -> StepResult:
        if launched.host is None and launched.pooled is None:
            return StepResult({}, {})
        if launched.event is not None:
            launched.event.synchronize()
        result = self._to_host(launched.inputs, launched.host) if launched.host is not None else StepResult({}, {})
        result.pooled = launched.pooled
        return result

    def _to_host(self, inputs: StepInputs, out: SamplerOutput) -> StepResult:
        """Host-side result of the sampled tokens `out` (host tensors, or CPU-device ones)."""
        token_list = out.token_ids.tolist()
        ids_in_order = [r.request_id for r in inputs.sampling_requests]
        tokens = dict(zip(ids_in_order, token_list))
        logprobs: dict[str, dict[int, Logprob]] = {}
        if out.logprobs is not None:
            values, ids, ranks = out.logprobs.tolist(), out.logprob_ids.tolist(), out.ranks.tolist()
            for row, request_id in enumerate(ids_in_order):
                n = inputs.logprobs_asked.get(request_id)
                if n is None:
                    continue
                entry = {ids[row][0]: Logprob(values[row][0], ranks[row])}
                for j in range(1, n + 1):
                    entry.setdefault(ids[row][j], Logprob(values[row][j], j))
                logprobs[request_id] = entry
        return StepResult(tokens, logprobs)


class DecodeGraphs:
    """CUDA graphs of the decode step (one token per sequence) for padded batch sizes up to max_num_seqs.

    Each graph reads static device buffers (ids, positions, slots, seq_lens, block tables) and writes logits
    [G, vocab]; a step of B <= G decodes copies its inputs into the first B rows, pads the rest (slot -1, so the
    pad rows write no KV; seq_len 1 over block 0, so they read finite values) and replays. Attention's split count
    is sized from max_model_len, so the captured grid fits every context length. Graphs share one memory pool and
    are captured largest first.
    """

    def __init__(self, runner: "ModelRunner"):
        self.runner = runner
        cfg = runner.config
        self.sizes = sorted({1, 2, 4, 8} | set(range(16, cfg.max_num_seqs + 1, 16)) | {cfg.max_num_seqs})
        self.sizes = [g for g in self.sizes if g <= cfg.max_num_seqs]
        max_g, dev = self.sizes[-1], runner.device
        max_blocks = -(-runner.max_model_len // runner.block_size)
        self.input_ids = torch.zeros(max_g, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(max_g, dtype=torch.int64, device=dev)
        self.slot_mapping = torch.full((max_g,), -1, dtype=torch.int64, device=dev)
        self.seq_lens = torch.ones(max_g, dtype=torch.int32, device=dev)
        self.block_tables = torch.zeros(max_g, max_blocks, dtype=torch.int32, device=dev)
        self.query_start_loc = torch.arange(max_g + 1, dtype=torch.int32, device=dev)
        # Every graph writes its logits into rows [:G] of this one buffer: a graph's own output tensor would stay
        # alive with it, and one per captured size adds up to ~17 GB at max_num_seqs=1024 with a 128k vocabulary.
        self.logits = torch.empty(max_g, runner.model_config.vocab_size, dtype=torch.float32, device=dev)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.pool = None

    def _metadata(self, g: int) -> AttentionMetadata:
        return AttentionMetadata(
            query_start_loc=self.query_start_loc[: g + 1],
            seq_lens=self.seq_lens[:g],
            block_tables=self.block_tables[:g],
            slot_mapping=self.slot_mapping[:g],
            query_start_loc_cpu=torch.arange(g + 1, dtype=torch.int32),
            seq_lens_cpu=torch.ones(g, dtype=torch.int32),
            max_query_len=1,
            max_seq_len=self.runner.max_model_len,
        )

    def _forward(self, g: int) -> torch.Tensor:
        model = self.runner.model
        hidden = model(self.input_ids[:g], self.positions[:g], self.runner.kv_caches, self._metadata(g))
        return model.compute_logits(hidden, out=self.logits[:g])

    @torch.inference_mode()
    def capture(self) -> None:
        for g in reversed(self.sizes):
            self._forward(g)  # warm-up: Triton compilation and cuBLAS handles outside the capture
            torch.cuda.synchronize(self.runner.device)
            graph = torch.cuda.CUDAGraph()
            # With several ranks NCCL's watchdog thread queries events while we capture: "thread_local" keeps its
            # calls legal (only this thread's capture is checked).
            mode = "thread_local" if self.runner.config.tensor_parallel_size > 1 else "global"
            with torch.cuda.graph(graph, pool=self.pool, capture_error_mode=mode):
                self._forward(g)
            if self.pool is None:
                self.pool = graph.pool()
            self.graphs[g] = graph
        torch.cuda.synchronize(self.runner.device)

    def batch_size_for(self, sched: SchedulerOutput) -> Optional[int]:
        """The graph to replay for this step, or None when it is not a pure decode step that fits one."""
        b = len(sched.scheduled)
        if b > self.sizes[-1] or any(s.num_new_tokens != 1 or not s.samples for s in sched.scheduled):
            return None
        return next(g for g in self.sizes if g >= b)

    def run(self, g: int, inputs: StepInputs) -> torch.Tensor:
        """Copy the step's inputs into the static buffers, replay graph g, return logits of the real rows: a view
        of the buffer every graph shares, valid until the next replay (the sampler reads it first, in stream order)."""
        b = inputs.input_ids.shape[0]
        meta = inputs.metadata
        self.input_ids[:b].copy_(inputs.input_ids)
        self.positions[:b].copy_(inputs.positions)
        self.slot_mapping[:b].copy_(meta.slot_mapping)
        self.slot_mapping[b:g].fill_(-1)
        self.seq_lens[:b].copy_(meta.seq_lens)
        self.seq_lens[b:g].fill_(1)
        width = meta.block_tables.shape[1]
        self.block_tables[:b, :width].copy_(meta.block_tables)
        self.graphs[g].replay()
        return self.logits[:b]

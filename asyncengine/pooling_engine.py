"""PoolingEngine: the sans-IO core of a model served for embeddings or scores (the pooling runner).

A pooling request is prefill-only: one forward pass over its whole input, then one pooled vector (an embedding),
or, on a cross-encoder, one score of the text pair it holds. Its life:

    add_request    validate (length, vocabulary, PoolingParams against the model), queue it
    prepare_step   take queued requests in arrival order while the step's token budget and sequence slots last
    launch/collect the pass on the device (pooling_runner), thread-safe like LLMEngine's
    book           attach each embedding (after dimensions / normalisation) or score to its request
    emit           EmbeddingRequestOutput / ScoringRequestOutput for every request booked, then forget it

The engine answers to the names the step driver (engine.StepPipeline) and engine_client.InProcessClient use for an
LLMEngine (enqueue, prepare_step, run, launch, collect, book, emit, abort_request, has_unfinished_requests,
stats, stats_listeners), so both drive it unchanged.

Budget: a step takes up to max_num_seqs requests and max(max_num_batched_tokens, max_model_len) tokens, so that
any admissible input fits one step. Requests are never chunked: an encoder's bidirectional attention needs the
whole sequence in one pass (and a decoder's last-token pooling gains nothing from chunks here).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import json
import logging
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Optional, Union

import torch

from asyncengine.config import EngineConfig, load_model_config, resolve_max_model_len
from asyncengine.engine import EngineStats, LLMEngine, PromptType, StepStats
from asyncengine.models import model_class_for
from asyncengine.pooler import PoolerConfig, choose_runner, load_cross_encoder_pooler, load_pooler_config
from asyncengine.pooling_params import (EmbeddingOutput, EmbeddingRequestOutput, PoolingLimits, PoolingParams,  # noqa: F401
                                        PoolingRequestOutput, ScoringOutput, ScoringRequestOutput, finish_embedding,
                                        pooling_token_ids)
from asyncengine.pooling_runner import LaunchedPooling, PoolingInputs, PoolingRunner
from asyncengine.tokenizer import load_tokenizer

logger = logging.getLogger(__name__)


@dataclass
class PoolingRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: PoolingParams
    prompt: Optional[str]
    arrival_time: float
    result: Union[list[float], float, None] = None  # set by book(): the embedding, or the pair's score
    aborted: bool = False


@dataclass
class PoolingStep:
    requests: list[PoolingRequest]
    inputs: PoolingInputs
    launched: Optional[LaunchedPooling] = None


TextPair = tuple[str, str]


def pair_texts(first: Union[str, list[str]], second: Union[str, list[str]],
               names: tuple[str, str] = ("text_1", "text_2")) -> list[TextPair]:
    """The pairs a score request means (vLLM's rules): one text against each text of `second` (1:N), or the i-th
    of `first` against the i-th of `second` (N:N). ValueError naming the field (`names`) for empty input, an empty
    text or lengths that do not pair."""
    firsts = [first] if isinstance(first, str) else list(first)
    seconds = [second] if isinstance(second, str) else list(second)
    for name, texts in zip(names, (firsts, seconds)):
        if not texts:
            raise ValueError(f"{name} must not be empty")
        if any(not isinstance(t, str) or not t for t in texts):
            raise ValueError(f"{name} must hold non-empty strings")
    if len(firsts) == 1:
        firsts = firsts * len(seconds)
    if len(firsts) != len(seconds):
        raise ValueError(f"{names[1]} has {len(seconds)} texts for {len(firsts)} in {names[0]}: give one "
                         f"{names[0]} (1:N) or as many as {names[1]} (N:N)")
    return list(zip(firsts, seconds))


def pair_token_ids(tokenizer, pairs: list[TextPair], params: PoolingParams, max_model_len: int
                   ) -> list[tuple[list[int], Optional[int]]]:
    """A cross-encoder's inputs: each pair tokenized as a text pair ("[CLS] a [SEP] b [SEP]" for BERT), with where
    its second text starts (the first token of type 1; None when the tokenizer gives no token types). Cut as
    params.truncate_prompt_tokens says, by the tokenizer's own pair truncation (longest text first)."""
    if not pairs:
        return []
    limit = params.truncation_length(max_model_len)
    cut = {} if limit is None else {"truncation": True, "max_length": limit}
    encoded = tokenizer([a for a, _ in pairs], [b for _, b in pairs], **cut)
    types = encoded.get("token_type_ids") or [None] * len(pairs)
    return [(ids, _first_of_type_1(t)) for ids, t in zip(encoded.input_ids, types)]


def _first_of_type_1(token_type_ids: Optional[list[int]]) -> Optional[int]:
    if not token_type_ids or 1 not in token_type_ids:
        return None
    return token_type_ids.index(1)


def pooling_runner_for(config: EngineConfig) -> bool:
    """True when `config` asks for (or its checkpoint implies) the pooling runner; see pooler.choose_runner."""
    from asyncengine.models import supported_architectures
    from asyncengine.plugins import load_plugins

    load_plugins()
    folder = Path(config.model)
    raw = json.loads((folder / "config.json").read_text()) if (folder / "config.json").exists() else {}
    archs = [a for a in raw.get("architectures") or [] if a in supported_architectures()]
    is_encoder = bool(archs) and bool(getattr(model_class_for(archs[0]), "is_encoder", False))
    return choose_runner(config.runner, folder, is_encoder) == "pooling"


def build_engine_on_its_thread(config: EngineConfig, thread_name: str):
    """(build_engine(config), the one-thread executor it was built on): the caller submits every step there too,
    so that all of the engine's torch work runs on one thread.

    Why one thread: on CPU torch runs its operators' parallel regions on OpenMP (libgomp), which keeps a pool of
    worker threads for each thread that has ever started a parallel region. Once a process holds more OpenMP threads
    than cores, libgomp lets a waiting worker spin only ~100 times before it sleeps, so every parallel region (each
    matrix product, the attention, most element-wise ops) pays a futex wake-up: ~50 us on a 2-core VM, where a
    decode step of the default model has about a hundred of them. Measured there (64 x 64 greedy, offline): 3,250
    tok/s with the engine built on the caller's thread and stepped on its own, 4,400 when built where it steps.
    The process's other threads (an event loop, the caller of LLM.generate) should run no parallel torch work."""
    device = ThreadPoolExecutor(1, thread_name_prefix=thread_name)
    try:
        return device.submit(build_engine, config).result(), device
    except BaseException:
        device.shutdown(wait=False)
        raise


def build_engine(config: EngineConfig):
    """An LLMEngine, or a PoolingEngine when the pooling runner applies (`config.runner`, else the checkpoint)."""
    if not pooling_runner_for(config):
        return LLMEngine(config)
    if config.tensor_parallel_size > 1:
        raise ValueError("--tensor-parallel-size (tensor_parallel_size) > 1 is not supported with the pooling runner "
                         "(embedding models run on one device)")
    return PoolingEngine(config)


class PoolingEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        device = config.torch_device()
        self.model_config = load_model_config(config, device)
        model_class = model_class_for(self.model_config.architecture)
        self.is_encoder = bool(getattr(model_class, "is_encoder", False))
        if getattr(model_class, "is_cross_encoder", False):
            self.pooler: PoolerConfig = load_cross_encoder_pooler(Path(config.model), self.model_config.hf_config)
        else:
            self.pooler = load_pooler_config(Path(config.model), self.is_encoder, self.model_config.hf_config)
        self.max_model_len = self._max_model_len()
        self.vocab_size = self.model_config.vocab_size
        self.tokenizer = load_tokenizer(config.tokenizer or config.model)
        self.runner = PoolingRunner(config, self.model_config, self.max_model_len, self.pooler)
        self.max_step_tokens = max(config.max_num_batched_tokens, self.max_model_len)
        self.waiting: deque[PoolingRequest] = deque()
        self.requests: dict[str, PoolingRequest] = {}  # every live request, waiting or in a pass
        self.num_in_pass = 0
        self.stats_listeners: list[Callable[[StepStats], None]] = []
        self._stats = StepStats()
        logger.info("pooling engine ready: %s (%s pooling%s%s) on %s", self.model_config.architecture,
                    self.pooler.mode, ", normalised" if self.pooler.normalize else "",
                    f", scores with {self.pooler.score_activation}" if self.pooler.scores else "", device)

    @classmethod
    def from_config(cls, config: EngineConfig) -> "PoolingEngine":
        return cls(config)

    def _max_model_len(self) -> int:
        """The model's limit, lowered to sentence-transformers' max_seq_length unless max_model_len is given."""
        max_len = resolve_max_model_len(self.config, self.model_config)
        if self.config.max_model_len is None and self.pooler.max_seq_length:
            max_len = min(max_len, self.pooler.max_seq_length)
        return max_len

    # -- requests ---------------------------------------------------------------------------------------------
    def tokenize(self, prompts: list[PromptType], params: PoolingParams) -> list[list[int]]:
        """See pooling_token_ids."""
        return pooling_token_ids(self.tokenizer, prompts, params, self.max_model_len)

    def tokenize_pairs(self, pairs: list[TextPair], params: PoolingParams) -> list[tuple[list[int], Optional[int]]]:
        """See pair_token_ids."""
        return pair_token_ids(self.tokenizer, pairs, params, self.max_model_len)

    @property
    def limits(self) -> "PoolingLimits":
        return PoolingLimits(self.pooler, self.model_config.hidden_size, self.vocab_size, self.max_model_len)

    def check_prompt(self, prompt_ids: list[int], params: PoolingParams) -> None:
        """See PoolingLimits.check."""
        self.limits.check(prompt_ids, params)

    def add_request(self, request_id: str, prompt: PromptType, params: Optional[PoolingParams] = None,
                    arrival_time: Optional[float] = None, prompt_token_ids: Optional[list[int]] = None) -> None:
        """Queue a request. prompt: text, or token ids (already cut when prompt_token_ids is given). Raises
        ValueError on bad input or a duplicate live id."""
        params = params if params is not None else PoolingParams()
        if prompt_token_ids is None:
            prompt_token_ids = self.tokenize([prompt], params)[0] if isinstance(params, PoolingParams) else []
        self.check_prompt(prompt_token_ids, params)
        self.enqueue(request_id, prompt if isinstance(prompt, str) else None, prompt_token_ids, params, arrival_time)

    def enqueue(self, request_id: str, prompt: Optional[str], prompt_token_ids: list[int], params: PoolingParams,
                arrival_time: Optional[float] = None) -> None:
        """Queue a request that has passed check_prompt. ValueError for a request id that is in use."""
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        request = PoolingRequest(request_id, list(prompt_token_ids), params, prompt,
                                 arrival_time if arrival_time is not None else time.monotonic())
        self.requests[request_id] = request
        self.waiting.append(request)

    def abort_request(self, request_ids: Union[str, Iterable[str]]) -> list[PoolingRequestOutput]:
        """End the given requests now (their pass, if running, is discarded); unknown ids are ignored. Returns
        their final outputs (finish_reason "abort")."""
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        outputs = []
        for request_id in request_ids:
            request = self.requests.pop(request_id, None)
            if request is None:
                continue
            request.aborted = True
            if request in self.waiting:
                self.waiting.remove(request)
            outputs.append(self._output_class(request_id, None, request.prompt_token_ids, True, request.prompt,
                                              "abort"))
        return outputs

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # -- the step ---------------------------------------------------------------------------------------------
    @property
    def _output_class(self) -> type:
        return ScoringRequestOutput if self.pooler.scores else EmbeddingRequestOutput

    def step(self) -> list[PoolingRequestOutput]:
        """One whole step, serially: take a batch, run the pass, book the embeddings, emit outputs."""
        step = self.prepare_step()
        if step is None:
            return self.emit([])
        return self.emit(self.book(step, self.run(step)))

    # The step loop that drives an LLMEngine drives this engine too (it only calls the step methods below).
    run_pipelined = LLMEngine.run_pipelined

    def prepare_step(self) -> Optional[PoolingStep]:
        """Take waiting requests in arrival order under the budget (see the module docstring); None if none."""
        batch: list[PoolingRequest] = []
        tokens = 0
        while self.waiting and len(batch) < self.config.max_num_seqs:
            n = len(self.waiting[0].prompt_token_ids)
            if batch and tokens + n > self.max_step_tokens:
                break
            batch.append(self.waiting.popleft())
            tokens += n
        if not batch:
            return None
        self.num_in_pass += len(batch)
        return PoolingStep(batch, self.runner.prepare([r.prompt_token_ids for r in batch],
                                                      [r.params.second_text_start for r in batch]))

    def run(self, step: PoolingStep) -> torch.Tensor:
        """The device work of a step, launched and collected; reads no engine state (thread-safe)."""
        return self.collect(self.launch(step))

    def launch(self, step: PoolingStep) -> PoolingStep:
        step.launched = self.runner.launch(step.inputs)
        return step

    def collect(self, step: PoolingStep) -> torch.Tensor:
        """The step's embeddings [B, hidden] (or a cross-encoder's scores [B]) float32 on the host, in the order
        of step.requests."""
        return self.runner.collect(step.launched)

    def book(self, step: PoolingStep, pooled: torch.Tensor) -> list[PoolingRequest]:
        """Attach each embedding or score (see collect) to its request (aborted ones are skipped); returns the
        requests booked."""
        self.num_in_pass -= len(step.requests)
        booked = []
        for request, vector in zip(step.requests, pooled):
            if request.aborted:
                continue
            if self.pooler.scores:
                request.result = float(vector)
            else:
                request.result = finish_embedding(vector, self.pooler, request.params)
            booked.append(request)
        self._stats.prompt_tokens += sum(len(r.prompt_token_ids) for r in booked)
        return booked

    def emit(self, booked: list[PoolingRequest]) -> list[PoolingRequestOutput]:
        """Final outputs of the booked requests, which are then forgotten."""
        now = time.monotonic()
        stats, self._stats = self._stats, StepStats()
        outputs = []
        for request in booked:
            if self.requests.pop(request.request_id, None) is None:
                continue  # aborted after booking
            result = ScoringOutput(request.result) if self.pooler.scores else EmbeddingOutput(request.result)
            outputs.append(self._output_class(request.request_id, result, request.prompt_token_ids, True,
                                              request.prompt))
            stats.e2e_latency.append(now - request.arrival_time)
            stats.time_to_first_token.append(now - request.arrival_time)
            stats.finished_reasons.append("stop")
        for listener in self.stats_listeners:
            listener(stats)
        return outputs

    # -- introspection ---------------------------------------------------------------------------------------
    def stats(self) -> EngineStats:
        """Queue lengths after the latest step (no KV cache, preemption or prefix cache: those stay 0)."""
        return EngineStats(num_running=self.num_in_pass, num_waiting=len(self.waiting))

    def failure(self) -> Optional[BaseException]:
        """As LLMEngine.failure: always None (a pooling model runs on one device, with no workers)."""
        return None

    def close(self, graceful: bool = True) -> None:
        """As LLMEngine.close: nothing was started."""

    def reset_prefix_cache(self) -> None:
        """Nothing to reset: pooling keeps no prefix cache."""

"""Constrained decoding (structured outputs) with xgrammar: grammar compilation, matcher state per request, and
the token bitmask of each step.

Who does what, and on which thread:

    add_request (caller's thread)   StructuredOutputManager.submit(constraint) -> a Future of the compiled grammar,
                                    compiled in a small thread pool (never on the event loop, never in a step), cached
                                    by the constraint's key. The request waits outside the scheduler until it is
                                    compiled (LLMEngine holds it), so it never holds up the batch.
    prepare (host, loop thread)     GrammarBatch.build(requests): which sampling rows are constrained. Touches no
                                    matcher.
    launch (device thread)          after the forward is queued: GrammarBatch.mask() brings each constrained row's
                                    matcher up to date with the row's previous token, fills one bitmask
                                    [C, ceil(V/32)] for the C constrained rows only and sends it to the device; the
                                    sampler applies it (xgrammar's kernel) before any sampling. After sampling,
                                    GrammarBatch.record_sampled() remembers where each row's new token will land.

The token still in flight (lookahead): step N+1 is prepared before step N's tokens are read back, so a constrained
row's next mask needs a token the host has not seen. Every matcher is touched only in the device thread, which
launches steps in order; when it builds step N+1's mask, step N has been launched, and the forward of N+1 is
already queued behind it on the device. So it waits for step N's sampled tokens (the event of their copy to the
host, which step N's collect() would wait for anyway), feeds them to the matchers and builds the mask while the
device runs N+1's forward. Unconstrained steps never wait; constrained steps keep looking ahead too, and the
device idles only if filling the mask takes longer than a forward. Nothing is ever rolled back: this engine keeps
a request's sampled tokens through preemption (recompute rebuilds only the KV), so a matcher's state (every
output token accepted, in order) stays valid; a token sampled for a request that has finished meanwhile (EOS or a
stop string, discarded by the scheduler) reaches no later mask.

Thinking (StructuredOutputsParams.after_thinking): a reasoning model's thinking is free and the grammar
constrains only the answer after it. The thinking's rows stay in the batch (whether the token in flight closes
the thinking is known only once it is read back, like any constrained row's token) with a mask that allows
everything; the matcher first sees the token after the `end` token (RequestGrammar.phase).

Stopping: the matchers' stop tokens are the model's EOS ids. When the grammar is complete, the mask allows only
EOS, and the scheduler stops the request on it as on any EOS (ignore_eos and min_tokens, which would forbid it,
are refused in SamplingParams).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Optional

import torch

from asyncengine.sampling_params import StructuredOutputsParams, ThinkingTokens

logger = logging.getLogger(__name__)

# The one cache of compiled grammars (by constraint key; xgrammar's own, unbounded by default, is off): the least
# recently used go first once it holds more than CACHE_ENTRIES grammars or more than CACHE_BYTES of them (xgrammar's
# memory_size_bytes: the grammar and its token masks, which grow with the vocabulary). A grammar larger than
# CACHE_BYTES on its own stays until the next one arrives.
CACHE_ENTRIES = 512
CACHE_BYTES = 256 * 2**20
COMPILE_THREADS = 2


def _xgrammar():
    try:
        import xgrammar
    except ImportError as exc:  # pragma: no cover - a dependency of the package
        raise ValueError("structured_outputs needs the xgrammar package (pip install xgrammar)") from exc
    return xgrammar


def choice_grammar(choices: list[str]) -> str:
    """An EBNF grammar (xgrammar's dialect) matching exactly one of `choices`: each is a quoted literal, escaped
    as a JSON string (whose escapes xgrammar's literals accept)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def _to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Through pinned memory without blocking on CUDA (a pageable copy would wait for the forward just queued)."""
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)


class StructuredOutputManager:
    """Compiles constraints for one tokenizer and vocabulary, in a thread pool, with a cache by constraint key.
    Thread-safe: submit() may be called from any thread."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int]):
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._stop_token_ids = list(stop_token_ids)
        self._compiler = None  # built on first use: TokenizerInfo walks the whole vocabulary
        self._compiler_lock = threading.Lock()
        self._executor: Optional[ThreadPoolExecutor] = None
        self._cache: OrderedDict[tuple, Future] = OrderedDict()
        self._cache_sizes: dict[tuple, int] = {}  # bytes of each cached grammar compiled successfully
        self._cache_lock = threading.Lock()

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    def _get_compiler(self):
        with self._compiler_lock:
            if self._compiler is None:
                xgr = _xgrammar()
                info = xgr.TokenizerInfo.from_huggingface(self._tokenizer, vocab_size=self._vocab_size,
                                                          stop_token_ids=self._stop_token_ids or None)
                self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
            return self._compiler

    def submit(self, constraint: StructuredOutputsParams) -> Future:
        """A Future of the compiled grammar (xgrammar.CompiledGrammar); it raises ValueError (naming
        structured_outputs and the kind) when the constraint does not compile. Cached by constraint key."""
        key = constraint.key()
        with self._cache_lock:
            future = self._cache.get(key)
            if future is not None:
                self._cache.move_to_end(key)
                return future
            if self._executor is None:
                self._executor = ThreadPoolExecutor(COMPILE_THREADS, thread_name_prefix="asyncengine-grammar")
            future = self._executor.submit(self._compile_and_count, key, constraint)
            self._cache[key] = future
            self._evict()
            return future

    @property
    def cached_bytes(self) -> int:
        """Memory of the compiled grammars in the cache (those compiled so far)."""
        with self._cache_lock:
            return sum(self._cache_sizes.values())

    @property
    def cached_entries(self) -> int:
        with self._cache_lock:
            return len(self._cache)

    def _compile_and_count(self, key: tuple, constraint: StructuredOutputsParams):
        """Compile (in the pool); the grammar's bytes count against CACHE_BYTES before its Future is done (a
        failure, which holds only its error, is not counted)."""
        compiled = self._compile(constraint)
        with self._cache_lock:
            if key in self._cache:  # not evicted meanwhile
                self._cache_sizes[key] = compiled.memory_size_bytes
                self._evict()
        return compiled

    def _evict(self) -> None:
        """Drop the least recently used grammars beyond the bounds (call with the lock held)."""
        while len(self._cache) > CACHE_ENTRIES or (
                len(self._cache) > 1 and sum(self._cache_sizes.values()) > CACHE_BYTES):
            key, _ = self._cache.popitem(last=False)
            self._cache_sizes.pop(key, None)

    def compile(self, constraint: StructuredOutputsParams):
        """Compile now (or wait for a compilation under way); ValueError when it does not compile."""
        return self.submit(constraint).result()

    def _compile(self, constraint: StructuredOutputsParams):
        compiler = self._get_compiler()
        kind, value = constraint.kind, constraint.value
        try:
            if kind == "json":
                schema = value if isinstance(value, str) else json.dumps(value)
                return compiler.compile_json_schema(schema, any_whitespace=constraint.any_whitespace,
                                                    strict_mode=True)
            if kind == "json_object":  # any JSON object (xgrammar's builtin JSON grammar allows any value)
                return compiler.compile_json_schema('{"type": "object"}',
                                                    any_whitespace=constraint.any_whitespace)
            if kind == "regex":
                return compiler.compile_regex(value)
            if kind == "choice":
                return compiler.compile_grammar(choice_grammar(value))
            return compiler.compile_grammar(value)  # grammar: EBNF (GBNF)
        except Exception as exc:  # noqa: BLE001 - xgrammar raises RuntimeError/ValueError for bad input
            message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise ValueError(f"structured_outputs.{kind} does not compile: {message[:300]}") from exc

    def shutdown(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)


class RequestGrammar:
    """One request's constraint: its compiled grammar (a Future until compiled), its matcher, and where its
    output stands against a reasoning model's thinking. The matcher, `phase` and `_pending` are touched only by
    the device thread (GrammarBatch); the engine reads `ready` and `failure`.

    phase (after_thinking, ThinkingTokens): "answer" (constrained: every token goes to the matcher) is where a
    request without after_thinking starts. With it, "think" (free: the mask allows everything, and the matcher
    sees nothing until the `end` token has been sampled) or, when the thinking may be off, "first" (the first
    token may be `start`, which opens the thinking, or any token the grammar allows, which begins the answer)."""

    def __init__(self, compiled: Future, after_thinking: Optional[ThinkingTokens] = None):
        self.compiled = compiled
        self.thinking = after_thinking
        if after_thinking is None:
            self.phase = "answer"
        else:
            self.phase = "think" if after_thinking.start is None else "first"
        self._matcher = None
        # where this request's last sampled token lands: (host tensor [S] of that step's tokens, row, event or None)
        self._pending: Optional[tuple[torch.Tensor, int, Optional[torch.cuda.Event]]] = None
        self.rejected: Optional[int] = None  # a token the matcher refused (set by the device thread)

    @property
    def ready(self) -> bool:
        return self.compiled.done()

    def failure(self) -> Optional[BaseException]:
        """The compilation's error once done (None while compiling or when it succeeded)."""
        return self.compiled.exception() if self.compiled.done() else None

    def _catch_up(self) -> None:
        """Feed the last sampled token (waiting for its step's copy to the host if need be) to the thinking
        phases, then to the matcher once the answer has begun."""
        if self._pending is None:
            return
        tokens, row, event = self._pending
        self._pending = None
        if event is not None:
            event.synchronize()
        token = int(tokens[row])
        if self.phase == "think":
            if token == self.thinking.end:
                self.phase = "answer"  # the constraint starts with the next token
            return
        if self.phase == "first":
            self.phase = "think" if token == self.thinking.start else "answer"
            if self.phase == "think":
                return
        if self._matcher.is_terminated():
            return  # the request ended on this grammar's EOS; its extra lookahead token is discarded
        if not self._matcher.accept_token(token):
            self.rejected = token
            logger.error("constrained request sampled token %d, which its grammar refuses", token)

    def fill(self, bitmask: torch.Tensor, index: int) -> None:
        """Bring the matcher up to date and write the tokens allowed next into bitmask[index]."""
        if self._matcher is None:
            self._matcher = _xgrammar().GrammarMatcher(self.compiled.result())
        self._catch_up()
        if self.phase == "think" or self._matcher.is_terminated() or self.rejected is not None:
            bitmask[index].fill_(-1)  # thinking (free), finished (its token will be discarded) or broken
            return
        self._matcher.fill_next_token_bitmask(bitmask, index)
        if self.phase == "first":
            _allow(bitmask, index, self.thinking.start)

    def record_sampled(self, tokens: torch.Tensor, row: int, event: Optional[torch.cuda.Event]) -> None:
        self._pending = (tokens, row, event)

    @property
    def terminated(self) -> bool:
        return self._matcher is not None and self._matcher.is_terminated()


def _allow(bitmask: torch.Tensor, index: int, token: int) -> None:
    """Set token's bit in bitmask[index] (int32 words, 32 tokens each, bit j of word w: token 32 * w + j)."""
    word, bit = divmod(token, 32)
    value = (int(bitmask[index, word]) & 0xFFFFFFFF) | (1 << bit)
    bitmask[index, word] = value - (1 << 32) if value >= 1 << 31 else value  # back to a signed int32


@dataclass
class GrammarBatch:
    """The constrained rows of one step: rows [C] among its sampling rows and their RequestGrammars. Built on the
    host at prepare; mask() and record_sampled() run in the device thread at launch."""

    rows: list[int]
    grammars: list[RequestGrammar]
    vocab_size: int
    fill_seconds: float = 0.0  # time spent in mask() (catching up, filling, copying): the per-step mask cost
    _rows_on_device: Optional[torch.Tensor] = None  # [C] int64, sent by mask()

    @classmethod
    def build(cls, requests, vocab_size: int) -> Optional["GrammarBatch"]:
        rows = [i for i, r in enumerate(requests) if r.grammar is not None]
        if not rows:
            return None
        return cls(rows, [requests[i].grammar for i in rows], vocab_size)

    def mask(self, device: torch.device) -> torch.Tensor:
        """The bitmask [C, ceil(V/32)] int32 of the constrained rows, built on the host and sent to `device`
        (bit j of row c set: token j allowed). Waits for the rows' previous tokens if they are in flight."""
        start = time.perf_counter()
        xgr = _xgrammar()
        bitmask = xgr.allocate_token_bitmask(len(self.rows), self.vocab_size)
        for index, grammar in enumerate(self.grammars):
            grammar.fill(bitmask, index)
        self._rows_on_device = _to_device(torch.tensor(self.rows, dtype=torch.int64), device)
        bitmask = _to_device(bitmask, device)
        self.fill_seconds = time.perf_counter() - start
        return bitmask

    def apply(self, logits: torch.Tensor, bitmask: torch.Tensor) -> None:
        """In place on logits [S, V]: tokens the grammar forbids become -inf in the constrained rows. xgrammar's
        kernel takes a bitmask row per logits row, so the C constrained rows are gathered [C, V], masked and put
        back (on the device, no sync). The kernel reads rows as contiguous memory: logits of other strides (the CPU's
        LM head gives a transposed view, kernels/cpu.head_logits) are masked in a contiguous copy and copied back."""
        apply = _xgrammar().apply_token_bitmask_inplace
        if len(self.rows) == logits.shape[0]:
            if logits.is_contiguous():
                apply(logits, bitmask, vocab_size=self.vocab_size)
            else:
                masked = logits.contiguous()
                apply(masked, bitmask, vocab_size=self.vocab_size)
                logits.copy_(masked)
            return
        rows = self._rows_on_device  # [C]
        constrained = logits.index_select(0, rows).contiguous()  # [C, V]
        apply(constrained, bitmask, vocab_size=self.vocab_size)
        logits.index_copy_(0, rows, constrained)

    def record_sampled(self, tokens: torch.Tensor, event: Optional[torch.cuda.Event]) -> None:
        """tokens: [S] the step's sampled tokens on the host (valid once `event` completes)."""
        for row, grammar in zip(self.rows, self.grammars):
            grammar.record_sampled(tokens, row, event)

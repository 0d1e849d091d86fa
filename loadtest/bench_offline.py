"""Offline throughput and latency of the engine on one GPU, against transformers in the same run (issue 5).

    python -m loadtest.bench_offline --out results/ [--quick]

One process: measures the GPU's copy bandwidth and matmul rate, builds a Llama-3-8B-shape checkpoint with random
bf16 weights, runs the transformers peers on W2 first (then frees them), then the engine on:
  W1 ShareGPT-like: 1000 requests, seeded lognormal lengths (mean ~200 in, ~180 out), ignore_eos, all at once
  W2 fixed: 1000 requests of 512 in, 128 out
  W3 batch-1 decode at 1,000 tokens of context: ms per output token (and the roofline for it)
  W4 prefill: 64 prompts of 2,048 tokens, max_tokens=1: tokens/s and model FLOP utilisation
  W1-structured (--only): W1 with every 4th request under a JSON schema against plain W1, and the per-step mask
  cost (--tiny: a CPU smoke run of it on the embedded default model)
  --quant: W3 per weight format (bf16, FP8, FP8 block-wise, AWQ int4) with each one's roofline, and W1 FP8 against
  bf16
  (loadtest/bench_quant.py; --quant --tiny: a CPU smoke run of it)
  --kv-cache-dtype fp8: W2 with the bf16 cache and with the FP8 cache in one run, each one's KV blocks and
  output tok/s (loadtest/bench_kv_cache.py; with --tiny: a CPU smoke run of it)
Prints one table and writes JSON. Each section is timed after a warm-up with the same shapes.

    python -m loadtest.bench_offline --family qwen3-30b-a3b --out results/ [--quick] [--tiny]

The mixture-of-experts mode (issue 18): a Qwen3-30B-A3B-shape checkpoint (48 layers, hidden 2048, 128 experts of
intermediate 768, top-8, 32/4 heads) with random bf16 weights, written layer by layer (about 61 GB: put
--checkpoint on a disk with room), then W3 (batch-1 decode at 1,000 tokens of context, against its roofline: the
parameters one token activates plus its KV, at the measured copy bandwidth) and W1 (requests/s), each against
transformers on the same checkpoint in the same run (generate at batch 1 for W3, its continuous batching with each
request's own max_new_tokens for W1). --tiny: the same mode at a tiny shape on the CPU (a smoke run).

    python -m loadtest.bench_offline --tensor-parallel-size N [--tp-model 8b|70b] [--quick] [--tiny]

Tensor parallelism (loadtest/bench_tp.py says more): --tp-model 70b, a Llama-3-70B-shape model (80 layers, hidden
8192, 64 heads / 8 KV heads, intermediate 28672, vocab 128256) over N GPUs, its random bf16 weights drawn by each
rank on its own GPU (load_format "dummy"); --tp-model 8b, the Llama-3-8B checkpoint at TP=1 and TP=N in one run,
and their float32 greedy tokens compared. W1 and W3 as above, W3 against each rank's roofline, and one
all-reduce's latency in a CUDA graph. --tiny: a CPU smoke run of the mode (tiny shapes over N CPU processes).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch

LLAMA3_8B = dict(
    hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
    vocab_size=128256, max_position_embeddings=8192, rms_norm_eps=1e-5, bos_token_id=0, eos_token_id=1,
    rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 8192},
    rope_theta=500000.0, tie_word_embeddings=False, architectures=["LlamaForCausalLM"],
)
LLAMA3_70B = dict(LLAMA3_8B, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                  num_attention_heads=64, num_key_value_heads=8)
# the same proportions, small enough for a CPU smoke run of the tensor-parallel mode
TINY_70B_LIKE = dict(LLAMA3_70B, hidden_size=256, intermediate_size=896, num_hidden_layers=2, num_attention_heads=8,
                     num_key_value_heads=2, vocab_size=4096)


# -- the hardware's limits -------------------------------------------------------------------------------------
def measure_copy_bandwidth(gib: float = 4.0) -> float:
    """Device-to-device copy, bytes read plus written per second (median of 20)."""
    n = int(gib * 2**30) // 2
    src, dst = torch.randn(n // 2, device="cuda").to(torch.bfloat16).repeat(2), torch.empty(n, dtype=torch.bfloat16, device="cuda")
    times = []
    for _ in range(25):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return 2 * n * 2 / float(np.median(times[5:]))


def measure_matmul_flops(n: int = 8192) -> float:
    a, b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16), torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    times = []
    for _ in range(13):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        a @ b
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return 2 * n**3 / float(np.median(times[3:]))


# -- the checkpoint --------------------------------------------------------------------------------------------
def build_tokenizer(folder: Path, vocab_size: int) -> None:
    """A word-level tokenizer covering every id of the model, so each generated token detokenizes to text (words
    "w<id>", and single characters at the end of a large vocabulary)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(vocab_size)}
    if vocab_size >= 1024:  # the last 95 ids are the printable ASCII characters, so grammars (JSON) can be written
        for i, char in enumerate(chr(c) for c in range(32, 127)):
            vocab.pop(f"w{vocab_size - 95 + i}")
            vocab[char] = vocab_size - 95 + i
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="w2"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="w0", eos_token="w1", unk_token="w2")
    fast.save_pretrained(str(folder))


def build_checkpoint(folder: Path, layers: int | None = None) -> Path:
    """Random bf16 weights of the Llama-3-8B shape, drawn on the GPU, saved as safetensors."""
    from transformers import LlamaConfig, LlamaForCausalLM

    if (folder / "config.json").exists():
        return folder
    cfg = dict(LLAMA3_8B)
    if layers:
        cfg["num_hidden_layers"] = layers
    config = LlamaConfig(**cfg)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model = model.to_empty(device="cuda").to(torch.bfloat16)
    gen = torch.Generator(device="cuda").manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            elif name == "lm_head.weight":  # peaked logits, like a trained model's: top-1 is well defined
                p.normal_(0.0, 0.25, generator=gen)
            else:
                p.normal_(0.0, 0.02, generator=gen)
    model.save_pretrained(str(folder))
    build_tokenizer(folder, config.vocab_size)
    del model
    gc.collect()
    torch.cuda.empty_cache()
    return folder


def build_shape_only_checkpoint(folder: Path, shape: dict) -> Path:
    """config.json (bf16) and a tokenizer: enough for load_format="dummy", where each rank draws its own weights."""
    from transformers import LlamaConfig

    if not (folder / "config.json").exists():
        folder.mkdir(parents=True, exist_ok=True)
        LlamaConfig(**shape, torch_dtype="bfloat16").save_pretrained(str(folder))
        build_tokenizer(folder, shape["vocab_size"])
    return folder


# -- workloads -------------------------------------------------------------------------------------------------
def sharegpt_like(n: int, mean_in: int, mean_out: int, seed: int, vocab: int):
    """Seeded lognormal lengths with the given means (sigma 0.8), clipped to [4, 1024] / [4, 1024]."""
    rng = np.random.default_rng(seed)
    sigma = 0.8

    def lengths(mean):
        mu = math.log(mean) - sigma**2 / 2
        return np.clip(rng.lognormal(mu, sigma, n).round().astype(int), 4, 1024)

    ins, outs = lengths(mean_in), lengths(mean_out)
    prompts = [rng.integers(3, vocab, size=int(k)).tolist() for k in ins]
    return prompts, [int(o) for o in outs]


def fixed(n: int, n_in: int, n_out: int, seed: int, vocab: int):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, vocab, size=n_in).tolist() for _ in range(n)], [n_out] * n


def w1_workload(n: int, vocab: int):
    """W1: n ShareGPT-like requests (seeded lengths, mean ~200 in, ~180 out)."""
    return sharegpt_like(n, 200, 180, seed=1, vocab=vocab)


def w2_workload(n: int, vocab: int):
    """W2: n requests of 512 tokens in, 128 out."""
    return fixed(n, 512, 128, seed=2, vocab=vocab)


class PhaseTimer:
    """Wraps the engine's step phases to attribute wall time (host) and GPU time of graph replays (events)."""

    def __init__(self, llm):
        self.engine, self.runner = llm.engine, llm.engine.runner
        self.host = {"prepare_step": 0.0, "launch (device thread)": 0.0, "collect (device thread)": 0.0, "book": 0.0,
                     "emit": 0.0}
        self.steps = {"graph": 0, "eager": 0}
        self.events: list = []
        self._originals = {}

    def _wrap(self, obj, name, key):
        original = getattr(obj, name)
        self._originals[(obj, name)] = original

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.host[key] += time.perf_counter() - start

        setattr(obj, name, timed)

    def __enter__(self):
        for name in ("prepare_step", "book", "emit"):
            self._wrap(self.engine, name, name)
        self._wrap(self.engine, "launch", "launch (device thread)")
        self._wrap(self.engine, "collect", "collect (device thread)")
        graphs = self.runner.graphs
        if graphs is not None:
            original_run = graphs.run
            self._originals[(graphs, "run")] = original_run

            def graph_run(g, inputs):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                out = original_run(g, inputs)
                end.record()
                self.events.append((start, end))
                return out

            graphs.run = graph_run
        return self

    def __exit__(self, *exc):
        for (obj, name), original in self._originals.items():
            setattr(obj, name, original)
        if torch.cuda.is_available():  # (a CPU smoke run has no graphs to time)
            torch.cuda.synchronize()
        self.graph_gpu_s = sum(s.elapsed_time(e) for s, e in self.events) / 1e3
        self.steps["graph"] = len(self.events)

    def summary(self, total_steps: int) -> dict:
        n = max(total_steps, 1)
        out = {f"{k}_ms_per_step": v / n * 1e3 for k, v in self.host.items()}
        out["graph_steps"] = self.steps["graph"]
        out["steps"] = total_steps
        out["graph_replay_gpu_ms_mean"] = self.graph_gpu_s / max(self.steps["graph"], 1) * 1e3
        return out


def run_engine(llm, prompts, outs, temperature=1.0, profile: bool = False, constrain_every: int = 0,
               **sampling) -> dict:
    """Generate max_tokens=outs[i] for each prompt (ignore_eos); `sampling`: more SamplingParams fields.
    constrain_every k > 0: every k-th request is under STRUCTURED_SCHEMA instead (no ignore_eos: the grammar ends
    it; the schema's unbounded last string makes most run to max_tokens anyway)."""
    from asyncengine import SamplingParams

    params = [SamplingParams(temperature=temperature, max_tokens=o, ignore_eos=True, seed=None, **sampling) for o in outs]
    constrained = set(range(0, len(outs), constrain_every)) if constrain_every else set()
    for i in constrained:
        params[i] = structured_params(temperature, outs[i], **sampling)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    counter = {"steps": 0}
    original_prepare = llm.engine.prepare_step

    def counting_prepare():
        counter["steps"] += 1
        return original_prepare()

    llm.engine.prepare_step = counting_prepare
    # Every timed run starts cold: W1's ablations repeat W1's prompts and W4 its warm-up's, which the prefix
    # cache would otherwise serve (before session 4 it did, flattering those rows).
    llm.reset_prefix_cache()
    hits_before = llm.engine.stats().prefix_cache_hits
    timer = PhaseTimer(llm) if profile else None
    start = time.perf_counter()
    if timer is not None:
        with timer:
            results = llm.generate(prompts, params, use_tqdm=False)
    else:
        results = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    llm.engine.prepare_step = original_prepare
    out_tokens = sum(len(r.outputs[0].token_ids) for r in results)
    in_tokens = sum(len(p) for p in prompts)
    assert all(len(r.outputs[0].token_ids) == o for i, (r, o) in enumerate(zip(results, outs)) if i not in constrained), \
        "every unconstrained request must produce exactly max_tokens (ignore_eos)"
    res = dict(seconds=elapsed, requests=len(prompts), req_per_s=len(prompts) / elapsed,
               output_tok_per_s=out_tokens / elapsed, total_tok_per_s=(in_tokens + out_tokens) / elapsed,
               preemptions=llm.engine.scheduler.num_preemptions, steps=counter["steps"],
               prefix_cache_hit_tokens=llm.engine.stats().prefix_cache_hits - hits_before)
    if timer is not None:
        res["profile"] = timer.summary(counter["steps"])
    if constrained:
        finished = [results[i].outputs[0].finish_reason for i in sorted(constrained)]
        res["constrained_requests"] = len(constrained)
        res["constrained_finished_by_grammar"] = finished.count("stop")
    return res


# A JSON schema for W1's constrained quarter: bounded fields, an array of enums, then an unbounded string, so
# that a request goes through several grammar states and usually runs to max_tokens like its peers.
STRUCTURED_SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 99999},
        "title": {"type": "string", "maxLength": 12},
        "tags": {"type": "array", "items": {"enum": ["drama", "comedy", "history"]}, "maxItems": 4},
        "body": {"type": "string"},
    },
    "required": ["id", "title", "tags", "body"],
    "additionalProperties": False,
}


def structured_params(temperature: float, max_tokens: int, **sampling):
    from asyncengine import SamplingParams, StructuredOutputsParams

    so = StructuredOutputsParams(json=STRUCTURED_SCHEMA)
    return SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=None, structured_outputs=so, **sampling)


def run_w1_structured(llm, prompts, outs) -> dict:
    """W1 with a quarter of its requests under STRUCTURED_SCHEMA against plain W1, same prompts, same process,
    and the host time per step spent building the grammar bitmask (device thread, overlapped with the forward)."""
    runner = llm.engine.runner
    run_engine(llm, prompts[:16], [min(o, 16) for o in outs[:16]], constrain_every=4)  # warm: compile, matchers
    plain, mixed = None, None
    for _ in range(2):  # alternated, best of two each: a drifting machine favours neither
        run = run_engine(llm, prompts, outs)
        plain = run if plain is None or run["req_per_s"] > plain["req_per_s"] else plain
        seconds_before, steps_before = runner.grammar_mask_seconds, runner.grammar_masked_steps
        run = run_engine(llm, prompts, outs, constrain_every=4)
        masked_steps = runner.grammar_masked_steps - steps_before
        run["mask_ms_per_masked_step"] = (runner.grammar_mask_seconds - seconds_before) / max(masked_steps, 1) * 1e3
        run["masked_steps"] = masked_steps
        mixed = run if mixed is None or run["req_per_s"] > mixed["req_per_s"] else mixed
    return {"W1_plain": plain, "W1_quarter_json": mixed,
            "W1_quarter_json_req_per_s_ratio": mixed["req_per_s"] / plain["req_per_s"],
            "W1_quarter_json_output_tok_per_s_ratio": mixed["output_tok_per_s"] / plain["output_tok_per_s"]}


def print_structured(r: dict) -> None:
    plain, mixed = r["W1_plain"], r["W1_quarter_json"]
    print(f"W1 plain            {plain['req_per_s']:8.2f} req/s {plain['output_tok_per_s']:10.0f} out tok/s "
          f"{plain['steps']:6d} steps")
    print(f"W1 1/4 JSON schema  {mixed['req_per_s']:8.2f} req/s {mixed['output_tok_per_s']:10.0f} out tok/s "
          f"{mixed['steps']:6d} steps  ({r['W1_quarter_json_req_per_s_ratio']:.2f}x req/s, "
          f"{r['W1_quarter_json_output_tok_per_s_ratio']:.2f}x tok/s)")
    print(f"mask: {mixed['mask_ms_per_masked_step']:.3f} ms host time per masked step over {mixed['masked_steps']} "
          f"steps; {mixed['constrained_finished_by_grammar']}/{mixed['constrained_requests']} constrained requests "
          f"ended by their grammar before max_tokens")


def ensure_json_characters(folder: Path, vocab_size: int) -> None:
    """The structured workload needs tokens for JSON's characters; a checkpoint built before they were part of
    build_tokenizer gets its tokenizer rewritten (weights untouched)."""
    from transformers import AutoTokenizer

    if "{" not in AutoTokenizer.from_pretrained(str(folder)).get_vocab():
        build_tokenizer(folder, vocab_size)


def w1_ablations(llm, w1) -> dict:
    """W1 again with each of the step loop's throughput features turned off, in the same process: what each buys."""
    engine, out = llm.engine, {}
    variants = {"admit_every_step": dict(min_prefill_batch=1), "no_lookahead": dict(async_scheduling=False),
                "neither": dict(min_prefill_batch=1, async_scheduling=False)}
    for name, change in variants.items():
        saved = (engine.scheduler.min_prefill_batch, engine.config.async_scheduling)
        engine.scheduler.min_prefill_batch = change.get("min_prefill_batch", saved[0])
        engine.config.async_scheduling = change.get("async_scheduling", saved[1])
        try:
            out[name] = run_engine(llm, *w1)
        finally:
            engine.scheduler.min_prefill_batch, engine.config.async_scheduling = saved
    return out


def batch1_decode_ms(llm, vocab: int, context: int = 1000, new_tokens: int = 200) -> dict:
    """Median milliseconds per output token of one sequence at ~context tokens, through the pipelined step
    loop that LLM.generate uses; also the GPU time of one decode graph replay (CUDA events)."""
    from asyncengine import SamplingParams

    engine = llm.engine
    prompt = np.random.default_rng(3).integers(3, vocab, size=context).tolist()
    engine.add_request("w3", prompt, SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True))
    stamps = []
    with PhaseTimer(llm) as timer:
        for _ in engine.run_pipelined(llm._device_thread):
            stamps.append(time.perf_counter())
    gaps = np.diff(stamps[2:])  # skip the prefill step
    return {"ms_per_token": float(np.median(gaps) * 1e3), "graph_replay_gpu_ms": timer.graph_gpu_s / max(len(timer.events), 1) * 1e3}


def run_w3(llm, vocab: int) -> dict:
    """W3, plus its floor under the issue's rule that matrix products stay with cuBLAS: the model's own batch-1
    matrix products alone, in one graph."""
    from .bench_matmul import matmul_floor_ms

    w3 = batch1_decode_ms(llm, vocab)
    return {"W3_ms_per_token": w3["ms_per_token"], "W3_graph_replay_gpu_ms": w3["graph_replay_gpu_ms"],
            "W3_cublas_matmul_floor_ms": matmul_floor_ms(llm.engine.runner.model)}


def linear_params(llm) -> int:
    """Parameters of every matrix the layers and lm_head multiply by (the embedding table is only indexed)."""
    return sum(p.numel() for name, p in llm.engine.runner.model.named_parameters() if "embed" not in name)


def run_w4(llm, num_prompts: int, vocab: int, matmul_tflops: float) -> dict:
    """W4: num_prompts prompts of 2,048 tokens, max_tokens=1, after a warm-up on 8 of them (the cache is reset
    before the timed run); adds prefill tokens/s and model FLOP utilisation against the measured matmul rate."""
    prompts, outs = fixed(num_prompts, 2048, 1, seed=4, vocab=vocab)
    run_engine(llm, prompts[:8], outs[:8])
    w4 = run_engine(llm, prompts, outs)
    mc = llm.engine.model_config
    flops = num_prompts * prefill_flops(linear_params(llm), mc.num_layers, mc.num_heads, mc.head_dim, 2048)
    w4["prefill_tok_per_s"] = num_prompts * 2048 / w4["seconds"]
    w4["mfu_vs_measured_matmul"] = flops / w4["seconds"] / (matmul_tflops * 1e12)
    return w4


def run_selected(llm, only: list[str], n: int, vocab: int, results: dict, save) -> int:
    """The workloads named in --only, each with the same inputs as in the full run; prints one line each."""
    if "W1" in only:
        results["W1"] = run_engine(llm, *w1_workload(n, vocab), profile=True)
        print(f"W1 on {results['gpu']}: {results['W1']['req_per_s']:.1f} req/s")
    if "W1-structured" in only:
        results.update(run_w1_structured(llm, *w1_workload(n, vocab)))
        print_structured(results)
    if "W1-penalties" in only:
        w1, penalties = w1_workload(n, vocab), dict(frequency_penalty=0.5, presence_penalty=0.5)
        saved = llm.engine.config.async_scheduling
        for name, lookahead in (("W1_penalties", saved), ("W1_penalties_no_lookahead", False)):
            llm.engine.config.async_scheduling = lookahead
            results[name] = run_engine(llm, *w1, **penalties)
            print(f"{name} on {results['gpu']}: {results[name]['req_per_s']:.1f} req/s")
        llm.engine.config.async_scheduling = saved
    if "W2" in only:
        results["W2"] = run_engine(llm, *w2_workload(n, vocab), profile=True)
        print(f"W2 on {results['gpu']}: {results['W2']['output_tok_per_s']:.0f} output tok/s")
    if "W3" in only:
        results.update(run_w3(llm, vocab))
        print(f"W3 on {results['gpu']}: {results['W3_ms_per_token']:.2f} ms/token, graph replay "
              f"{results['W3_graph_replay_gpu_ms']:.2f} ms, cuBLAS matmuls alone {results['W3_cublas_matmul_floor_ms']:.2f} ms")
    if "W4" in only:
        results["W4"] = run_w4(llm, 64, vocab, results["matmul_TFLOPs"])
        print(f"W4 on {results['gpu']}: {results['W4']['prefill_tok_per_s']:.0f} prefill tok/s, "
              f"MFU {results['W4']['mfu_vs_measured_matmul']:.0%}")
    save()
    return 0


def prefill_flops(n_params_linear: float, layers: int, heads: int, head_dim: int, seq: int) -> float:
    """Model FLOPs of a prefill of one sequence: 2 * params per token plus causal attention (QK and PV)."""
    linear = 2 * n_params_linear * seq
    attention = 2 * 2 * layers * heads * head_dim * seq * seq / 2
    return linear + attention


def w2_ceiling(mc, n_linear: float, lm_head_params: float, n_req: int, n_in: int, n_out: int,
               matmul_flops: float, copy_bytes_per_s: float) -> dict:
    """The fastest W2 could possibly run on this GPU, whatever the engine: its unavoidable model FLOPs at the
    measured matmul rate plus its unavoidable KV reads (each decode token reads its whole context once) at the
    measured copy bandwidth. Weight reads, sampling, host work and every inefficiency are left out, so no engine
    beats it; its ratio to the peer is the best W2 ratio this hardware allows."""
    body = n_linear - lm_head_params
    fed = n_in + n_out - 1  # tokens through the layers: the prompt, then every sampled token but the last
    attn_per_ctx = 2 * 2 * mc.num_layers * mc.num_heads * mc.head_dim  # QK^T + PV FLOPs per (query, key) pair
    prefill_pairs = n_in * (n_in + 1) / 2
    decode_ctx = sum(n_in + i for i in range(1, n_out))  # context each decode token attends over
    flops = n_req * (2 * body * fed + 2 * lm_head_params * n_out + attn_per_ctx * (prefill_pairs + decode_ctx))
    kv_bytes = n_req * decode_ctx * mc.kv_bytes_per_token(torch.bfloat16)
    seconds = flops / matmul_flops + kv_bytes / copy_bytes_per_s
    return {"seconds": seconds, "output_tok_per_s": n_req * n_out / seconds, "flops": flops, "kv_read_bytes": kv_bytes}


def run_peers(folder: Path, prompts, n_out: int, batch: int, cb_requests: int) -> dict:
    """transformers generate (static batch) and generate_batch (continuous batching) on W2-shaped requests."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.bfloat16, device_map="cuda")
    model.eval()
    res = {}
    ids = torch.tensor(prompts[:batch], device="cuda")
    mask = torch.ones_like(ids)
    kwargs = dict(max_new_tokens=n_out, min_new_tokens=n_out, do_sample=False, pad_token_id=0)
    with torch.inference_mode():
        model.generate(ids[:, :64], attention_mask=mask[:, :64], max_new_tokens=8, do_sample=False, pad_token_id=0)
        model.generate(ids, attention_mask=mask, **kwargs)  # warm-up with the timed shapes
        torch.cuda.synchronize()
        start = time.perf_counter()
        out = model.generate(ids, attention_mask=mask, **kwargs)
        torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
    made = (out.shape[1] - ids.shape[1]) * batch
    res["hf_generate_static"] = dict(batch=batch, seconds=elapsed, output_tok_per_s=made / elapsed)
    try:
        gen_cfg = GenerationConfig(max_new_tokens=n_out, do_sample=False, eos_token_id=-1, pad_token_id=0)
        reqs = [p for p in prompts[:cb_requests]]
        model.generate_batch(inputs=reqs[: min(32, len(reqs))], generation_config=gen_cfg)  # warm-up
        torch.cuda.synchronize()
        start = time.perf_counter()
        outs = model.generate_batch(inputs=reqs, generation_config=gen_cfg)
        torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
        made = sum(len(o.generated_tokens) for o in outs.values())
        res["hf_generate_batch"] = dict(requests=len(reqs), seconds=elapsed, output_tok_per_s=made / elapsed)
    except Exception as exc:  # record why, keep the rest of the benchmark
        res["hf_generate_batch"] = dict(error=repr(exc)[:500])
    del model
    gc.collect()
    torch.cuda.empty_cache()
    return res


# -- the mixture-of-experts mode (--family qwen3-30b-a3b) ---------------------------------------------------------
QWEN3_30B_A3B = dict(
    hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=48, num_attention_heads=32,
    num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
    decoder_sparse_step=1, mlp_only_layers=[], vocab_size=151936, max_position_embeddings=40960, rms_norm_eps=1e-6,
    rope_theta=1000000.0, tie_word_embeddings=False, bos_token_id=0, eos_token_id=1, use_sliding_window=False,
    sliding_window=None, architectures=["Qwen3MoeForCausalLM"],
)
QWEN3_MOE_TINY = dict(QWEN3_30B_A3B, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=16,
                      num_experts_per_tok=4, vocab_size=1024, max_position_embeddings=4096)


def moe_layer_tensors(cfg: dict, layer: int, gen: torch.Generator, device: str) -> dict:
    """One decoder layer's tensors under their hub names (experts one by one), random bf16, norms at one."""
    h, inter, d = cfg["hidden_size"], cfg["moe_intermediate_size"], cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
    prefix = f"model.layers.{layer}."
    shapes = {"self_attn.q_proj.weight": (q, h), "self_attn.k_proj.weight": (kv, h), "self_attn.v_proj.weight": (kv, h),
              "self_attn.o_proj.weight": (h, q), "mlp.gate.weight": (cfg["num_experts"], h)}
    for e in range(cfg["num_experts"]):
        shapes.update({f"mlp.experts.{e}.gate_proj.weight": (inter, h), f"mlp.experts.{e}.up_proj.weight": (inter, h),
                       f"mlp.experts.{e}.down_proj.weight": (h, inter)})
    out = {prefix + n: torch.empty(shape, dtype=torch.bfloat16, device=device).normal_(0.0, 0.02, generator=gen).cpu()
           for n, shape in shapes.items()}
    for norm, size in (("input_layernorm", h), ("post_attention_layernorm", h), ("self_attn.q_norm", d),
                       ("self_attn.k_norm", d)):
        out[f"{prefix}{norm}.weight"] = torch.ones(size, dtype=torch.bfloat16)
    return out


def build_moe_checkpoint(folder: Path, cfg: dict, device: str) -> Path:
    """A Qwen3-MoE checkpoint of shape `cfg` with random bf16 weights, one safetensors shard per layer (bounded
    memory) and an index, as the hub lays it out; refuses to start without the disk space it needs."""
    import shutil

    from safetensors.torch import save_file
    from transformers import Qwen3MoeConfig

    if (folder / "config.json").exists():
        return folder
    config = Qwen3MoeConfig(**cfg)
    h, v = cfg["hidden_size"], cfg["vocab_size"]
    experts = cfg["num_experts"] * 3 * h * cfg["moe_intermediate_size"]
    attn = h * (2 * cfg["num_attention_heads"] + 2 * cfg["num_key_value_heads"]) * cfg["head_dim"]
    need = 2 * (cfg["num_hidden_layers"] * (experts + attn + cfg["num_experts"] * h) + 2 * v * h)
    folder.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(folder).free
    if free < need * 1.02:
        raise SystemExit(f"{folder} has {free / 1e9:.1f} GB free; the checkpoint needs {need / 1e9:.1f} GB "
                         f"(pass --checkpoint on a larger disk)")
    gen = torch.Generator(device=device).manual_seed(0)
    weight_map = {}

    def save(tensors: dict, name: str) -> None:
        save_file(tensors, str(folder / name), metadata={"format": "pt"})
        weight_map.update({k: name for k in tensors})

    top = {"model.embed_tokens.weight": torch.empty(v, h, dtype=torch.bfloat16, device=device).normal_(0, 0.02, generator=gen).cpu(),
           "lm_head.weight": torch.empty(v, h, dtype=torch.bfloat16, device=device).normal_(0, 0.25, generator=gen).cpu(),
           "model.norm.weight": torch.ones(h, dtype=torch.bfloat16)}  # lm_head std 0.25: peaked logits
    save(top, "model-top.safetensors")
    for layer in range(cfg["num_hidden_layers"]):
        save(moe_layer_tensors(cfg, layer, gen, device), f"model-layer{layer:03d}.safetensors")
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": need},
                                                                       "weight_map": weight_map}))
    config.save_pretrained(str(folder))
    build_tokenizer(folder, v)
    return folder


def active_params(llm, in_bytes: bool = False) -> int:
    """Parameters one batch-1 decode token reads: every matrix but the embedding table, experts counted at
    top_k / num_experts (the experts it is routed to); in_bytes: their bytes as stored (FP8 and int4 experts with
    their scales and zero points included); else int4 words count their 8 weights each."""
    cfg = llm.engine.model_config.hf_config
    share = cfg.num_experts_per_tok / cfg.num_experts

    def size(p):
        return p.numel() * (p.element_size() if in_bytes else 8 if p.dtype == torch.int32 else 1)

    return int(sum(size(p) * (share if ".experts." in name else 1.0)
                   for name, p in llm.engine.runner.model.named_parameters() if "embed" not in name))


def hf_batch1_decode_ms(model, vocab: int, device: str, context: int = 1000, new_tokens: int = 200) -> float:
    """transformers generate at batch 1: ms per output token, (time for new_tokens + 1) - (time for one), same
    prompt (so the prefill cancels out), each the best of two runs."""
    prompt = torch.tensor([np.random.default_rng(3).integers(3, vocab, size=context).tolist()], device=device)
    kwargs = dict(do_sample=False, pad_token_id=0, attention_mask=torch.ones_like(prompt))

    def timed(n: int) -> float:
        sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
        sync()
        start = time.perf_counter()
        model.generate(prompt, max_new_tokens=n, min_new_tokens=n, **kwargs)
        sync()
        return time.perf_counter() - start

    with torch.inference_mode():
        timed(4)  # warm-up
        longer, one = min(timed(new_tokens + 1) for _ in range(2)), min(timed(1) for _ in range(2))  # best of two
        return (longer - one) / new_tokens * 1e3


def hf_continuous_batching(model, prompts, outs, budget_s: float = float("inf")) -> dict:
    """transformers' continuous batching manager on W1: every request with its own max_new_tokens, EOS ignored.
    Stops waiting after budget_s: the rates then count the requests (and their tokens) finished by then, and
    `finished` < `requests` says so."""
    from transformers import GenerationConfig

    gen_cfg = GenerationConfig(do_sample=False, eos_token_id=-1, pad_token_id=0, max_new_tokens=max(outs))
    made, finished = 0, 0
    with model.continuous_batching_context_manager(generation_config=gen_cfg, block=True, timeout=5) as manager:
        start = time.perf_counter()
        for i, (prompt, n_out) in enumerate(zip(prompts, outs)):
            manager.add_request(prompt, request_id=f"w1-{i}", max_new_tokens=n_out)
        while finished < len(prompts) and time.perf_counter() - start < budget_s:
            result = manager.get_result(timeout=1)
            if result is not None and result.is_finished():
                finished += 1
                made += len(result.generated_tokens)
            elif result is None and not manager.is_running():
                raise RuntimeError("transformers' continuous batching stopped before every request finished")
        elapsed = time.perf_counter() - start
    return dict(requests=len(prompts), finished=finished, seconds=elapsed, req_per_s=finished / elapsed,
                output_tok_per_s=made / elapsed, output_tokens=made, output_tokens_asked=sum(outs),
                budget_s=budget_s, stopped_at_budget=finished < len(prompts))


def run_moe_peers(folder: Path, w1, vocab: int, device: str, w3_shape: tuple[int, int], budget_s: float) -> dict:
    """transformers on the same checkpoint, within budget_s after loading: batch-1 decode (W3, over
    w3_shape[1] new tokens), then continuous batching on the W1 requests given (whatever time is left). Rates
    only (ms/token, req/s, tok/s), so that they compare with the engine's over other token and request counts."""
    from transformers import AutoModelForCausalLM

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype,
                                                 device_map=device if device == "cuda" else None).eval()
    res = {"hf_load_s": time.perf_counter() - t0, "hf_budget_s": budget_s,
           "hf_experts_implementation": getattr(model.config, "_experts_implementation", None),
           "hf_W3_context_and_tokens": list(w3_shape)}
    start = time.perf_counter()
    res["hf_W3_ms_per_token"] = hf_batch1_decode_ms(model, vocab, device, *w3_shape)
    try:
        res["hf_W1"] = hf_continuous_batching(model, *w1, budget_s=max(10.0, budget_s - (time.perf_counter() - start)))
    except Exception as exc:  # record why, keep the engine's half of the benchmark
        res["hf_W1"] = dict(error=repr(exc)[:500])
    del model
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    return res


def measure_cpu_copy_bandwidth(mib: int = 256) -> float:
    src = torch.randn(mib * 2**18)
    dst = torch.empty_like(src)
    times = []
    for _ in range(7):
        start = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - start)
    return 2 * src.numel() * 4 / float(np.median(times[2:]))


def moe_config(args) -> dict:
    """The checkpoint's shape: Qwen3-30B-A3B (or the tiny one), with --num-layers decoder layers if given."""
    cfg = dict(QWEN3_MOE_TINY if args.tiny else QWEN3_30B_A3B)
    if args.num_layers is not None:
        if not 0 < args.num_layers <= QWEN3_30B_A3B["num_hidden_layers"]:
            raise SystemExit(f"--num-layers must be in [1, {QWEN3_30B_A3B['num_hidden_layers']}], got {args.num_layers}")
        cfg["num_hidden_layers"] = args.num_layers
    return cfg


def moe_folder(args, cfg: dict) -> Path:
    """--checkpoint, or /tmp/<family>[-tiny]-random[-<N>l]; an existing folder must hold the asked layer count."""
    layers = cfg["num_hidden_layers"]
    if args.checkpoint != DEFAULT_CHECKPOINT:
        folder = Path(args.checkpoint)
    else:
        suffix = "" if args.num_layers is None else f"-{layers}l"
        folder = Path(f"/tmp/{args.family}{'-tiny' if args.tiny else ''}-random{suffix}")
    config = folder / "config.json"
    if config.exists() and json.loads(config.read_text())["num_hidden_layers"] != layers:
        raise SystemExit(f"{folder} holds a checkpoint of {json.loads(config.read_text())['num_hidden_layers']} "
                         f"layers, not {layers}: pass another --checkpoint (or --num-layers to match)")
    return folder


def w3_per_layer(results: dict, lm_head_params: int, layers: int, full_layers: int) -> dict:
    """W3 extrapolated from a checkpoint of `layers` layers to `full_layers` (an ESTIMATE, not a measurement):
    the LM head and final norm are taken to run at the copy bandwidth, the rest of the step is split evenly
    over the layers, and the roofline scales the same way."""
    copy = results["copy_bandwidth_GBps"] * 1e9
    head_bytes = 2 * lm_head_params
    head_ms = head_bytes / copy * 1e3
    per_layer_ms = (results["W3_ms_per_token"] - head_ms) / layers
    per_layer_bytes = (results["W3_bytes_per_step"] - head_bytes) / layers
    roofline_ms = (head_bytes + full_layers * per_layer_bytes) / copy * 1e3
    extrapolated = head_ms + full_layers * per_layer_ms
    return {"layers_measured": layers, "layers_extrapolated_to": full_layers, "per_layer_ms": per_layer_ms,
            "per_layer_roofline_ms": per_layer_bytes / copy * 1e3, "W3_ms_per_token": extrapolated,
            "W3_roofline_ms": roofline_ms, "of_roofline": roofline_ms / extrapolated}


def record_moe_w3(results: dict, llm, w3: dict, w3_shape: tuple, layers: int, full_layers: int) -> None:
    """W3 and its roofline (active parameters plus the KV read at mid-decode) into results; with fewer layers
    than the model's, also the extrapolation to all of them (`w3_per_layer`)."""
    results["W3_ms_per_token"], results["W3_graph_replay_gpu_ms"] = w3["ms_per_token"], w3["graph_replay_gpu_ms"]
    results["W3_context_and_tokens"] = list(w3_shape)
    n_active = active_params(llm)
    kv_bytes = (w3_shape[0] + w3_shape[1] // 2) * llm.engine.model_config.kv_bytes_per_token(torch.bfloat16)
    results["W3_active_params"] = n_active
    results["W3_bytes_per_step"] = active_params(llm, in_bytes=True) + kv_bytes
    results["W3_roofline_ms"] = results["W3_bytes_per_step"] / (results["copy_bandwidth_GBps"] * 1e9) * 1e3
    if layers != full_layers:
        lm_head = llm.engine.runner.model.lm_head
        results["W3_extrapolated_estimate"] = w3_per_layer(results, lm_head.weight.numel(), layers, full_layers)


def run_moe(args) -> int:
    """The MoE mode: W3 and W1 on a Qwen3-30B-A3B-shape checkpoint, each against transformers in the same run."""
    from asyncengine import LLM

    device = "cpu" if args.tiny else "cuda"
    cfg = moe_config(args)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    results: dict = {"family": args.family, "tiny": args.tiny, "date": time.strftime("%Y-%m-%d"), "args": vars(args),
                     "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
                     "num_layers": cfg["num_hidden_layers"]}
    part = args.moe_part
    stem = f"bench_offline_{args.family}{'_tiny' if args.tiny else ''}"
    if args.num_layers is not None:
        stem += f"_{cfg['num_hidden_layers']}l"
    if (args.moe_fp8_block or args.moe_awq) and not args.skip_peers:
        raise SystemExit("--moe-fp8-block and --moe-awq measure the engine alone: add --skip-peers (transformers' "
                         "peer run is the bf16 checkpoint's)")
    if args.moe_fp8_block and args.moe_awq:
        raise SystemExit("--moe-fp8-block and --moe-awq: one format a run")

    def save():
        (out_dir / f"{stem}{'' if part == 'all' else '_' + part}.json").write_text(json.dumps(results, indent=2))

    results["copy_bandwidth_GBps"] = (measure_copy_bandwidth() if device == "cuda" else measure_cpu_copy_bandwidth()) / 1e9
    t0 = time.perf_counter()
    folder = build_moe_checkpoint(moe_folder(args, cfg), cfg, device)
    if args.moe_fp8_block:  # the same weights in block-wise FP8, as Qwen3-30B-A3B-FP8 ships
        from .bench_quant import build_fp8_block_checkpoint

        block = (16, 32) if args.tiny else (128, 128)  # the tiny experts' 32 rows take no 128-row block
        folder = build_fp8_block_checkpoint(folder, Path(f"{folder}-fp8-block{block[0]}x{block[1]}"), block, device)
        stem += "_fp8_block"
    if args.moe_awq:  # the same weights in AWQ int4, groups of 128 (32 for the tiny experts' 32 inputs)
        from .bench_quant import build_awq_checkpoint

        group = 32 if args.tiny else 128
        folder = build_awq_checkpoint(folder, Path(f"{folder}-awq-g{group}"), group, device)
        stem += "_awq"
    results["build_checkpoint_s"] = time.perf_counter() - t0
    print(f"checkpoint ({cfg['num_hidden_layers']} layers) ready in {results['build_checkpoint_s']:.0f} s", flush=True)
    if part == "build":
        save()
        return 0
    vocab = cfg["vocab_size"]
    n = 16 if args.tiny else (100 if args.quick else args.moe_w1_requests)
    w1 = w1_workload(n, vocab)
    w3_shape = (100, 20) if args.tiny else (1000, 200)  # (context, new tokens)
    if args.tiny:
        w1 = (w1[0], [min(o, 24) for o in w1[1]])
    hf_n = min(n, args.hf_w1_requests)
    hf_w1 = (w1[0][:hf_n], w1[1][:hf_n])  # the first requests of the engine's W1: the engine runs them too
    if not args.skip_peers and part in ("all", "peers"):
        results["peers"] = run_moe_peers(folder, hf_w1, vocab, device, (w3_shape[0], min(w3_shape[1], args.hf_w3_tokens)),
                                         args.hf_budget_s)  # fmt: skip
        save()
        print(f"transformers done at {time.perf_counter() - t0:.0f} s: {json.dumps(results['peers'])[:400]}", flush=True)
        if part == "peers":
            print(json.dumps(results["peers"], indent=2))
            return 0
    peers_file = out_dir / f"{stem}_peers.json"
    if part == "engine" and peers_file.exists():  # transformers measured by an earlier --moe-part peers call
        results["peers"] = json.loads(peers_file.read_text())["peers"]
    t0 = time.perf_counter()
    llm = LLM(str(folder), dtype="bfloat16" if device == "cuda" else "float32", max_model_len=4096,
              max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
              **({"gpu_memory_utilization": 0.90} if device == "cuda" else {}))
    results["engine_init_s"] = time.perf_counter() - t0
    print(f"engine ready in {results['engine_init_s']:.0f} s", flush=True)
    run_engine(llm, *sharegpt_like(min(n, 64), 200, 32, seed=8, vocab=vocab))  # warm-up: compile every shape
    record_moe_w3(results, llm, batch1_decode_ms(llm, vocab, *w3_shape), w3_shape, cfg["num_hidden_layers"],
                  (QWEN3_MOE_TINY if args.tiny else QWEN3_30B_A3B)["num_hidden_layers"])  # fmt: skip
    save()  # W3 first: the number a call cut short must not lose
    print(f"W3 {results['W3_ms_per_token']:.2f} ms/token, roofline {results['W3_roofline_ms']:.2f} ms", flush=True)
    results["W1"] = run_engine(llm, *w1)
    results["W1_peer_requests"] = run_engine(llm, *hf_w1)  # the same requests transformers ran
    save()
    print_moe_table(results)
    return 0


def print_moe_table(r: dict) -> None:
    peers = r.get("peers", {})
    hf_w1, hf_w3 = peers.get("hf_W1", {}), peers.get("hf_W3_ms_per_token")
    w1, w3 = r["W1"]["req_per_s"], r["W3_ms_per_token"]
    sub = r["W1_peer_requests"]
    print(f"\n{r['device']}  {r['date']}  {r['family']}, {r['num_layers']} layers  copy {r['copy_bandwidth_GBps']:.0f} GB/s"
          f"  (transformers: experts {peers.get('hf_experts_implementation', 'n/a')})")
    print(f"W1 ({r['W1']['requests']} requests) req/s        engine {w1:8.2f}")
    line = f"W1 (first {sub['requests']} requests) req/s  engine {sub['req_per_s']:8.2f}   transformers "
    if "req_per_s" in hf_w1:
        line += (f"{hf_w1['req_per_s']:8.2f}   {sub['req_per_s'] / hf_w1['req_per_s']:.1f}x   (transformers finished "
                 f"{hf_w1['finished']} of {hf_w1['requests']} in {hf_w1['seconds']:.0f} s"
                 + (", stopped at its budget: its rate counts the finished ones" if hf_w1["stopped_at_budget"] else "")
                 + f"; output tok/s {sub['output_tok_per_s']:.0f} vs {hf_w1['output_tok_per_s']:.0f})")
    else:
        line += f"n/a {hf_w1}"
    print(line)
    hf_tokens = peers.get("hf_W3_context_and_tokens", [None, None])[1]
    print(f"W3 ms/token (bs1, 1k ctx)       engine {w3:8.2f}   transformers "
          + (f"{hf_w3:8.2f}   {hf_w3 / w3:.1f}x (transformers over {hf_tokens} tokens, the engine over "
             f"{r['W3_context_and_tokens'][1]})" if hf_w3
             else "n/a")
          + f"   roofline {r['W3_roofline_ms']:.2f} ms ({r['W3_active_params'] / 1e9:.2f} B active params + KV): "
          f"{r['W3_roofline_ms'] / w3:.0%} of roofline")
    est = r.get("W3_extrapolated_estimate")
    if est:
        print(f"W3 EXTRAPOLATED to {est['layers_extrapolated_to']} layers (an estimate from {est['layers_measured']}: "
              f"LM head at copy bandwidth, the rest split per layer): {est['W3_ms_per_token']:.2f} ms/token, "
              f"roofline {est['W3_roofline_ms']:.2f} ms, {est['of_roofline']:.0%}; per layer {est['per_layer_ms'] * 1e3:.0f} us "
              f"(roofline {est['per_layer_roofline_ms'] * 1e3:.0f} us)")


DEFAULT_CHECKPOINT = "/tmp/llama3-8b-random"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench_out")
    parser.add_argument("--checkpoint", default=DEFAULT_CHECKPOINT,
                        help="checkpoint folder (built there if missing); the MoE family defaults to "
                             "/tmp/<family>-random")
    parser.add_argument("--family", choices=["llama3-8b", "qwen3-30b-a3b"], default="llama3-8b",
                        help="qwen3-30b-a3b: the mixture-of-experts mode (W3 and W1 against transformers)")
    parser.add_argument("--moe-w1-requests", type=int, default=1000, help="W1 requests in the MoE mode")
    parser.add_argument("--num-layers", type=int, default=None,
                        help="MoE mode: a checkpoint of this many decoder layers (default: the model's 48); W3 is "
                             "then also extrapolated to 48 layers, labelled as an estimate")
    parser.add_argument("--hf-w1-requests", type=int, default=32,
                        help="MoE mode: W1 requests given to transformers (the first of the engine's; the engine "
                             "runs the same ones too, for the ratio)")
    parser.add_argument("--hf-w3-tokens", type=int, default=32,
                        help="MoE mode: new tokens of transformers' batch-1 decode (ms/token over them)")
    parser.add_argument("--hf-budget-s", type=float, default=240.0,
                        help="MoE mode: seconds transformers gets after loading (W3, then W1 until the budget; its "
                             "rates then count what finished)")
    parser.add_argument("--moe-part", choices=["all", "build", "peers", "engine"], default="all",
                        help="MoE mode in parts, for machines that limit one command's time: build the checkpoint "
                             "only, or run only transformers or only the engine on it (each writes its own JSON; "
                             "the engine part reports against the peers part's JSON when --out holds it)")
    parser.add_argument("--quick", action="store_true", help="fewer requests (a smoke run)")
    parser.add_argument("--skip-peers", action="store_true")
    parser.add_argument("--w1-only", action="store_true", help="stop after W1 (the served benchmark's reference)")
    parser.add_argument("--only", nargs="+", choices=["W1", "W2", "W3", "W4", "W1-penalties", "W1-structured"],
                        default=None,
                        help="run just these workloads (no W1 ablations, no table); W1-penalties: W1 with frequency "
                             "and presence penalties on every request, with and without lookahead")
    parser.add_argument("--max-num-seqs", type=int, default=1024,
                        help="1024 since run 23; 256 before (run 22, H200: W1 1.10x, W2 1.03x at 1024)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--quant", action="store_true",
                        help="the quantized formats instead: W3 per format with its roofline, W1 fp8 vs bf16")
    parser.add_argument("--moe-fp8-block", action="store_true",
                        help="MoE mode: the checkpoint's weights in block-wise FP8 (128 x 128, Qwen3-30B-A3B-FP8's "
                             "layout), the engine alone (--skip-peers); W3's roofline counts the bytes as stored")
    parser.add_argument("--moe-awq", action="store_true",
                        help="MoE mode: the checkpoint's weights in AWQ int4, groups of 128 (round to nearest), the "
                             "engine alone (--skip-peers); W3's roofline counts the bytes as stored")
    parser.add_argument("--quant-formats", nargs="+", choices=["bf16", "fp8", "fp8-block", "awq"], default=None,
                        help="--quant on the GPU: only these formats (default: all; W1 fp8 / bf16 needs both)")
    parser.add_argument("--kv-cache-dtype", choices=["fp8"], default=None,
                        help="W2 with the bf16 KV cache against the FP8 one: KV blocks and output tok/s of each")
    parser.add_argument("--tiny", action="store_true",
                        help="a CPU smoke run: W1-structured on the embedded default model (32 short requests), "
                             "or with --family qwen3-30b-a3b the MoE mode at a tiny shape, or with "
                             "--tensor-parallel-size the tensor-parallel mode at a tiny shape")
    parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=None,
                        help="the tensor-parallel mode (--tp-model): W1, W3 over N GPUs")
    parser.add_argument("--distributed-executor-backend", default="mp", choices=["mp", "ray"])
    parser.add_argument("--tp-model", nargs="+", choices=["8b", "8b-greedy", "70b"], default=["70b"],
                        help="the tensor-parallel mode's model: 8b (TP=1 against TP=N, same weights, greedy check) "
                             "or 70b (TP=N alone)")
    args = parser.parse_args(argv)
    args.checkpoint_given = "--checkpoint" in (argv if argv is not None else sys.argv)
    if args.tensor_parallel_size is not None:
        from .bench_tp import main as run_tensor_parallel

        return run_tensor_parallel(args)
    if args.quant and args.family != "llama3-8b":
        parser.error("--quant runs on the llama3-8b family (AWQ and FP8 of its dense layers)")
    if args.quant and args.tiny:
        from .bench_quant import main_tiny

        return main_tiny(Path(args.out))
    if args.kv_cache_dtype and args.tiny:
        from .bench_kv_cache import main_tiny as kv_cache_tiny

        return kv_cache_tiny(Path(args.out))
    if args.family != "llama3-8b":
        return run_moe(args)
    if args.tiny:
        return run_tiny_structured(Path(args.out))
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    results: dict = {"gpu": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"), "args": vars(args)}

    def save():
        (out_dir / "bench_offline.json").write_text(json.dumps(results, indent=2))

    if args.quant:
        from .bench_quant import main_gpu

        return main_gpu(args, results, save)
    if args.kv_cache_dtype:
        from .bench_kv_cache import main_gpu as kv_cache_gpu

        return kv_cache_gpu(args, results, save)
    results["copy_bandwidth_GBps"] = measure_copy_bandwidth() / 1e9
    results["matmul_TFLOPs"] = measure_matmul_flops() / 1e12
    save()
    t0 = time.perf_counter()
    folder = build_checkpoint(Path(args.checkpoint))
    if "W1-structured" in (args.only or []):
        ensure_json_characters(folder, LLAMA3_8B["vocab_size"])
    results["build_checkpoint_s"] = time.perf_counter() - t0
    vocab = LLAMA3_8B["vocab_size"]
    n = 200 if args.quick else 1000
    w2_prompts, w2_outs = w2_workload(n, vocab)
    if not args.skip_peers:
        results["peers"] = run_peers(folder, w2_prompts, 128, batch=64, cb_requests=64 if args.quick else 256)
        save()

    from asyncengine import LLM

    t0 = time.perf_counter()
    llm = LLM(str(folder), dtype="bfloat16", max_model_len=4096, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens, gpu_memory_utilization=0.90)
    results["engine_init_s"] = time.perf_counter() - t0
    results["kv_blocks"] = llm.engine.runner.num_blocks
    # Warm-up with the timed shapes (Triton compiles per shape family), then the workloads.
    run_engine(llm, *fixed(64, 512, 16, seed=9, vocab=vocab))
    run_engine(llm, *sharegpt_like(64, 200, 32, seed=8, vocab=vocab))
    if args.w1_only:
        args.only = ["W1"]
    if args.only:
        return run_selected(llm, args.only, n, vocab, results, save)
    w1 = w1_workload(n, vocab)
    results["W1"] = run_engine(llm, *w1, profile=True)
    save()
    results["W1_ablations"] = w1_ablations(llm, w1)
    save()
    results["W2"] = run_engine(llm, w2_prompts, w2_outs, profile=True)
    save()
    results.update(run_w3(llm, vocab))
    save()
    results["W4"] = run_w4(llm, 16 if args.quick else 64, vocab, results["matmul_TFLOPs"])
    mc, n_linear = llm.engine.model_config, linear_params(llm)
    # Roofline for W3: every weight except the embedding table read once, plus the KV of 1,000 tokens.
    weight_bytes = n_linear * 2
    kv_bytes = 1100 * mc.kv_bytes_per_token(torch.bfloat16)
    results["W3_bytes_per_step"] = weight_bytes + kv_bytes
    results["W3_roofline_ms"] = (weight_bytes + kv_bytes) / (results["copy_bandwidth_GBps"] * 1e9) * 1e3
    lm_head = llm.engine.runner.model.lm_head
    results["W2_ceiling"] = w2_ceiling(mc, n_linear, lm_head.weight.numel() if lm_head is not None else 0, len(w2_prompts),
                                       512, 128, results["matmul_TFLOPs"] * 1e12, results["copy_bandwidth_GBps"] * 1e9)
    save()
    print_table(results)
    return 0


def run_tiny_structured(out_dir: Path) -> int:
    """W1-structured at a tiny size on whatever device the engine picks (CPU here): a smoke run of the mode."""
    from asyncengine import LLM

    out_dir.mkdir(parents=True, exist_ok=True)
    llm = LLM(max_model_len=512, max_num_seqs=16)
    prompts, outs = sharegpt_like(32, 20, 40, seed=1, vocab=llm.engine.vocab_size)
    results = {"device": str(llm.engine.runner.device), **run_w1_structured(llm, prompts, outs)}
    (out_dir / "bench_offline_structured_tiny.json").write_text(json.dumps(results, indent=2))
    print_structured(results)
    return 0


def print_table(r: dict) -> None:
    peers = r.get("peers", {})
    cb = peers.get("hf_generate_batch", {}).get("output_tok_per_s")
    static = peers.get("hf_generate_static", {}).get("output_tok_per_s")
    w2 = r["W2"]["output_tok_per_s"]
    rows = [
        ("W1 sharegpt-like req/s", f"{r['W1']['req_per_s']:.1f}", "-", "-", ""),
        ("W1 output tok/s", f"{r['W1']['output_tok_per_s']:.0f}", "-", "-", ""),
        ("W2 output tok/s", f"{w2:.0f}", f"HF generate_batch {cb:.0f}" if cb else "HF generate_batch n/a",
         f"{w2 / cb:.1f}x" if cb else "-", ""),
        ("W2 output tok/s", f"{w2:.0f}", f"HF generate(64) {static:.0f}" if static else "-",
         f"{w2 / static:.1f}x" if static else "-", ""),
        ("W2 ceiling at measured rates", f"{r['W2_ceiling']['output_tok_per_s']:.0f}",
         f"HF generate_batch {cb:.0f}" if cb else "-", f"{r['W2_ceiling']['output_tok_per_s'] / cb:.1f}x" if cb else "-",
         f"engine at {w2 / r['W2_ceiling']['output_tok_per_s']:.0%}"),
        ("W3 ms/token (bs1, 1k ctx)", f"{r['W3_ms_per_token']:.2f}", f"roofline {r['W3_roofline_ms']:.2f}",
         "-", f"{r['W3_roofline_ms'] / r['W3_ms_per_token']:.0%} of roofline"),
        ("W3 cuBLAS matmuls alone, ms", f"{r['W3_cublas_matmul_floor_ms']:.2f}", f"roofline {r['W3_roofline_ms']:.2f}",
         "-", f"{r['W3_roofline_ms'] / r['W3_cublas_matmul_floor_ms']:.0%} of roofline"),
        ("W4 prefill tok/s", f"{r['W4']['prefill_tok_per_s']:.0f}", f"matmul {r['matmul_TFLOPs']:.0f} TFLOP/s", "-",
         f"MFU {r['W4']['mfu_vs_measured_matmul']:.0%}"),
    ]
    print(f"\n{r['gpu']}  {r['date']}  copy {r['copy_bandwidth_GBps']:.0f} GB/s  matmul {r['matmul_TFLOPs']:.0f} TFLOP/s")
    print(f"{'workload':28} {'engine':>10} {'peer':>30} {'ratio':>7} {'limit':>20}")
    for row in rows:
        print(f"{row[0]:28} {row[1]:>10} {row[2]:>30} {row[3]:>7} {row[4]:>20}")
    for name, res in r.get("W1_ablations", {}).items():
        print(f"{'W1 req/s, ' + name:28} {res['req_per_s']:>10.1f} {'default':>30} "
              f"{res['req_per_s'] / r['W1']['req_per_s']:>6.2f}x {res['steps']:>14} steps")


if __name__ == "__main__":
    raise SystemExit(main())

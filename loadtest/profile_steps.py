"""Where a step's time goes on the GPU: kernel tables for batch-1 decode (W3) and for the W1 load (issue 5).

    python -m loadtest.profile_steps --out results/ [--w1-requests 300] [--w3-only] [--quantization fp8|awq]

On the Llama-3-8B-shape random checkpoint of bench_offline:
  1. W3 decode eagerly under torch.profiler: GPU time per kernel family per decoded token, and the sum, against
     the graph replay's time (CUDA events) and the host's wall time per token;
  1b. one W4-like prefill step (4 x 2,048 tokens): its wall time and kernel table;
  2. a W1 subset with CUDA graphs on: for graph steps and eager (mixed) steps separately, the count, the mean host
     time of `run`, the mean GPU time (CUDA events) and the mean tokens per step; then the kernel table of the
     eager steps under torch.profiler.
Prints the tables and writes profile_steps.json.
"""

from __future__ import annotations

import argparse
import json
import re
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch

from .bench_offline import LLAMA3_8B, build_checkpoint, fixed, sharegpt_like, w1_workload


def kernel_family(name: str) -> str:
    """Group a CUDA kernel's name into a family (cuBLAS GEMMs together, Triton kernels by their function)."""
    lowered = name.lower()
    library = not name.startswith("_")  # our Triton kernels' names start with "_" (e.g. _gemv_kernel)
    if library and any(k in lowered for k in ("gemm", "gemv", "cutlass", "sm90_xmma", "nvjet", "cublas")):
        return "matmul (cuBLAS)"
    match = re.match(r"^_?([a-z0-9_]+?)(_kernel)?(_\d+)?$", name)
    if match and not name.startswith("void"):
        return f"triton {match.group(1)}"
    for key in ("elementwise", "reduce", "index", "copy", "fill", "argmax", "softmax", "cat", "sort", "scatter", "gather"):
        if key in lowered:
            return f"torch {key}"
    return name[:60]


def profile_kernels(fn, steps: int) -> dict[str, float]:
    """GPU milliseconds per step for each kernel family while fn() runs."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    totals: dict[str, float] = defaultdict(float)
    counts: dict[str, int] = defaultdict(int)
    for evt in prof.events():
        if evt.device_type == torch.autograd.DeviceType.CUDA:
            fam = kernel_family(evt.name)
            totals[fam] += evt.device_time / 1e3  # microseconds -> ms
            counts[fam] += 1
    return {k: {"ms_per_step": v / steps, "kernels_per_step": counts[k] / steps} for k, v in
            sorted(totals.items(), key=lambda kv: -kv[1])}


def print_kernels(title: str, table: dict) -> None:
    total = sum(v["ms_per_step"] for v in table.values())
    launches = sum(v["kernels_per_step"] for v in table.values())
    print(f"\n{title}: {total:.3f} GPU ms per step in {launches:.0f} kernels")
    for fam, v in list(table.items())[:14]:
        print(f"  {fam:44} {v['ms_per_step']:8.3f} ms  {v['kernels_per_step']:6.1f} kernels")


class StepTimer:
    """Host wall time of each runner.launch call (the enqueue; on CPU the work) and the GPU time from its start
    to the end of its work (events; idle gaps while the host enqueues count), split into graph and eager steps."""

    def __init__(self, runner):
        self.runner, self.rows = runner, []

    def __enter__(self):
        self.original = self.runner.launch

        def timed(inputs):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t0 = time.perf_counter()
            start.record()
            out = self.original(inputs)
            end.record()
            self.rows.append((inputs.graph_size is not None, inputs.input_ids.shape[0], time.perf_counter() - t0,
                              start, end))
            return out

        self.runner.launch = timed
        return self

    def __exit__(self, *exc):
        self.runner.launch = self.original
        torch.cuda.synchronize()

    def summary(self) -> dict:
        out = {}
        for kind, is_graph in (("graph", True), ("eager", False)):
            rows = [r for r in self.rows if r[0] == is_graph]
            if not rows:
                continue
            gpu = [s.elapsed_time(e) for _, _, _, s, e in rows]
            out[kind] = dict(steps=len(rows), tokens_mean=float(np.mean([r[1] for r in rows])),
                             launch_host_ms_mean=float(np.mean([r[2] for r in rows]) * 1e3),
                             gpu_ms_mean=float(np.mean(gpu)), gpu_ms_total=float(np.sum(gpu)))
        return out


def host_us_per_call(fn, calls: int = 300) -> float:
    """Host microseconds per call of fn (no sync inside the loop): the launch cost when it exceeds the GPU's."""
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / calls * 1e6


@torch.inference_mode()
def launch_costs(runner, tokens: int = 64, context: int = 256) -> dict[str, float]:
    """Host cost per call of each piece of one decoder layer, on a decode batch of `tokens` sequences."""
    from asyncengine import ops
    from asyncengine.models.layers import AttentionMetadata

    model, dev, bs = runner.model, runner.device, runner.block_size
    layer, mc = model.layers[0], runner.model_config
    attn = layer.self_attn
    blocks = -(-context // bs)
    meta = AttentionMetadata(
        query_start_loc=torch.arange(tokens + 1, dtype=torch.int32, device=dev),
        seq_lens=torch.full((tokens,), context, dtype=torch.int32, device=dev),
        block_tables=torch.arange(tokens * blocks, dtype=torch.int32, device=dev).view(tokens, blocks),
        slot_mapping=torch.arange(tokens, dtype=torch.int64, device=dev) * context,
        query_start_loc_cpu=torch.arange(tokens + 1, dtype=torch.int32),
        seq_lens_cpu=torch.full((tokens,), context, dtype=torch.int32),
        max_query_len=1, max_seq_len=context)
    x = torch.randn(tokens, mc.hidden_size, dtype=mc.dtype, device=dev)
    residual = torch.randn_like(x)
    positions = torch.full((tokens,), context - 1, dtype=torch.int64, device=dev)
    qkv = attn.qkv_proj(x)
    q, k, v = qkv.split([attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
    gate_up = layer.mlp.gate_up_proj(x)
    kv = runner.kv_caches[0]
    heads = (tokens, attn.num_heads, attn.head_dim)
    kv_heads = (tokens, attn.num_kv_heads, attn.head_dim)
    pieces = {
        "torch add_ (baseline)": lambda: residual.add_(0),
        "qkv matmul (cuBLAS)": lambda: attn.qkv_proj(x),
        "rms_norm": lambda: layer.input_layernorm(x),
        "fused_add_rms_norm": lambda: layer.input_layernorm(x, residual),
        "rotary": lambda: attn.rotary_emb(positions, q, k),
        "reshape_and_cache": lambda: ops.reshape_and_cache(k.view(kv_heads), v.view(kv_heads), kv[0], kv[1],
                                                           meta.slot_mapping),
        "paged_attention (decode)": lambda: ops.paged_attention(q.reshape(heads), kv[0], kv[1], meta, attn.attn.scale),
        "silu_and_mul": lambda: ops.silu_and_mul(gate_up),
        "whole decoder layer": lambda: layer(positions, x, residual, kv, meta),
    }
    return {name: host_us_per_call(fn) for name, fn in pieces.items()}


def generate(llm, prompts, outs, temperature=1.0):
    from asyncengine import SamplingParams

    params = [SamplingParams(temperature=temperature, max_tokens=o, ignore_eos=True) for o in outs]
    llm.reset_prefix_cache()  # repeated prompts are profiled cold
    return llm.generate(prompts, params, use_tqdm=False)


def prefill_step_profile(llm, prompts_and_outs) -> tuple[float, dict]:
    """(wall ms of one generate over these prompts, timed cold, then its kernel table, profiled cold too)."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    generate(llm, *prompts_and_outs)
    torch.cuda.synchronize()
    wall_ms = (time.perf_counter() - t0) * 1e3
    return wall_ms, profile_kernels(lambda: generate(llm, *prompts_and_outs), 1)


def print_w3(results: dict) -> None:
    print(f"\n{results['gpu']}  {results['date']}")
    g = results["W3_graph"].get("graph", {})
    print(f"W3 graphs on: wall {results['W3_wall_ms_per_token']:.2f} ms/token; launch() host {g.get('launch_host_ms_mean', 0):.2f} ms, "
          f"GPU {g.get('gpu_ms_mean', 0):.2f} ms per step")
    print_kernels("W3 eager decode kernels (per token)", results["W3_eager_kernels"])
    print(f"\nW4 step (4 x 2048 tokens) wall {results['W4_step_wall_ms']:.1f} ms")
    print_kernels("W4 prefill step kernels", results["W4_step_kernels"])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench_out")
    parser.add_argument("--checkpoint", default="/tmp/llama3-8b-random")
    parser.add_argument("--w1-requests", type=int, default=300)
    parser.add_argument("--w3-only", action="store_true", help="only the batch-1 decode (W3) part")
    parser.add_argument("--quantization", choices=["fp8", "awq"], default=None,
                        help="profile the checkpoint quantized: FP8 at load time, or AWQ int4 group 128 (built on the "
                             "GPU as bench_quant does)")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    from asyncengine import LLM

    folder = build_checkpoint(Path(args.checkpoint))
    quant = {}
    if args.quantization == "awq":
        from .bench_quant import build_awq_checkpoint

        folder = build_awq_checkpoint(folder, Path(str(args.checkpoint) + "-awq-g128"), 128, "cuda")
    elif args.quantization == "fp8":
        quant = {"quantization": "fp8"}
    llm = LLM(str(folder), dtype="bfloat16", max_model_len=4096, max_num_seqs=256, max_num_batched_tokens=8192,
              gpu_memory_utilization=0.90, **quant)
    vocab = LLAMA3_8B["vocab_size"]
    generate(llm, *sharegpt_like(64, 200, 32, seed=8, vocab=vocab))  # warm-up
    results: dict = {"gpu": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d")}

    # 1. W3: batch-1 decode at 1,000 tokens of context, graphs on (timed) and off (kernel table).
    w3_prompt = fixed(1, 1000, 64, seed=3, vocab=vocab)
    with StepTimer(llm.engine.runner) as timer:
        t0 = time.perf_counter()
        generate(llm, *w3_prompt, temperature=0)
        wall = time.perf_counter() - t0
    results["W3_graph"] = timer.summary()
    results["W3_wall_ms_per_token"] = wall / 64 * 1e3
    graphs, llm.engine.runner.graphs = llm.engine.runner.graphs, None
    generate(llm, *w3_prompt, temperature=0)
    results["W3_eager_kernels"] = profile_kernels(lambda: generate(llm, *w3_prompt, temperature=0), 64)
    llm.engine.runner.graphs = graphs

    # 1b. A W4 step: 4 prompts of 2,048 tokens in one 8,192-token prefill (what W2's and W4's time is made of).
    w4 = fixed(4, 2048, 1, seed=4, vocab=vocab)
    generate(llm, *w4)
    w4_ms, w4_table = prefill_step_profile(llm, w4)
    results["W4_step_wall_ms"], results["W4_step_kernels"] = w4_ms, w4_table
    if args.w3_only:
        (out / "profile_steps.json").write_text(json.dumps(results, indent=2))
        print_w3(results)
        return 0

    # 2. Host cost of launching each piece of a layer (eager steps pay it 32 times).
    results["launch_us"] = launch_costs(llm.engine.runner)

    # 3. Full W1: graph vs eager steps; then a subset all eager, for the eager steps' kernels.
    with StepTimer(llm.engine.runner) as timer:
        t0 = time.perf_counter()
        generate(llm, *w1_workload(1000, vocab))
        results["W1_wall_s"] = time.perf_counter() - t0
    results["W1_steps"] = timer.summary()
    w1 = w1_workload(args.w1_requests, vocab)
    graphs, llm.engine.runner.graphs = llm.engine.runner.graphs, None  # every step eager: one kernel table
    with StepTimer(llm.engine.runner) as timer:
        kernels = profile_kernels(lambda: generate(llm, *w1), 1)
    llm.engine.runner.graphs = graphs
    steps = timer.summary()["eager"]["steps"]
    results["W1_all_eager_kernels"] = {k: {kk: vv / steps for kk, vv in v.items()} for k, v in kernels.items()}
    results["W1_all_eager_steps"] = timer.summary()
    (out / "profile_steps.json").write_text(json.dumps(results, indent=2))

    print_w3(results)
    print("\nhost microseconds per call (64 decode sequences, 256 context):")
    for name, us in results["launch_us"].items():
        print(f"  {name:32} {us:8.1f}")
    for kind, v in results["W1_steps"].items():
        print(f"W1 (1000 req, {results['W1_wall_s']:.1f} s) {kind:5}: {v['steps']} steps, "
              f"{v['tokens_mean']:.0f} tokens, launch() host {v['launch_host_ms_mean']:.2f} ms, GPU {v['gpu_ms_mean']:.2f} ms, "
              f"GPU total {v['gpu_ms_total'] / 1e3:.2f} s")
    e = results["W1_all_eager_steps"]["eager"]
    print(f"W1 subset all eager: {e['steps']} steps, launch() host {e['launch_host_ms_mean']:.2f} ms, GPU {e['gpu_ms_mean']:.2f} ms")
    print_kernels("W1 subset all-eager kernels (per step)", results["W1_all_eager_kernels"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

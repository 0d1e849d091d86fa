"""W2 with the FP8 KV cache against the bf16 cache, in one run (issue 14): KV blocks and throughput.

    python -m loadtest.bench_offline --kv-cache-dtype fp8 --out results/ [--quick] [--tiny]

The engine is built twice on the same checkpoint (Llama-3-8B shape, random bf16 weights; --tiny: the embedded
default model in bf16 on the CPU, a smoke run), once with the cache in the model's dtype (`auto`) and once in
e4m3 (`fp8`), each under the same memory budget; each reports its KV blocks (the fp8 cache should hold twice as
many) and runs W2 (1000 requests of 512 tokens in, 128 out, all at once; --quick 200) after a warm-up of the same
shapes. Prints one table with the fp8/bf16 ratios and writes bench_kv_cache.json.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

CACHE_DTYPES = ("auto", "fp8")


def cache_shape(runner) -> dict:
    """The KV cache's dtype, blocks, bytes per block and tokens held (a function, so that no local name keeps the
    runner, and with it the engine's GPU memory, alive past `del llm`: run 1 of session 8 ran OOM so)."""
    return dict(kv_cache_dtype=str(runner.kv_cache_dtype).removeprefix("torch."), kv_blocks=runner.num_blocks,
                bytes_per_block=runner.bytes_per_block(), kv_tokens=runner.num_blocks * runner.block_size)


def measure(folder, w2, warm_up, **engine_args) -> dict:
    """{cache dtype: blocks, bytes per block, tokens the cache holds, W2 result} for the bf16 and the fp8 cache."""
    from asyncengine import LLM

    from .bench_offline import run_engine
    from .bench_quant import _free_gpu_memory

    results = {}
    for kv in CACHE_DTYPES:
        t0 = time.perf_counter()
        llm = LLM(str(folder), dtype="bfloat16", kv_cache_dtype=kv, **engine_args)
        res = dict(init_s=time.perf_counter() - t0, **cache_shape(llm.engine.runner))
        run_engine(llm, *warm_up)
        res["W2"] = run_engine(llm, *w2)
        results[kv] = res
        llm.close()
        del llm  # the last reference: the next engine needs its memory
        _free_gpu_memory()
    return results


def print_kv_table(r: dict) -> None:
    bf16, fp8 = r["auto"], r["fp8"]
    print(f"\n{r['device']}  {r['date']}  W2: {r['requests']} requests, {r['prompt_tokens']} in, "
          f"{r['output_tokens']} out")
    print(f"{'KV cache':16} {'blocks':>10} {'bytes/block':>12} {'tokens held':>12} {'W2 out tok/s':>13} "
          f"{'req/s':>8} {'preempt':>8}")
    for name, res in (("bf16 (auto)", bf16), ("fp8 e4m3", fp8)):
        w2 = res["W2"]
        print(f"{name:16} {res['kv_blocks']:>10} {res['bytes_per_block']:>12} {res['kv_tokens']:>12} "
              f"{w2['output_tok_per_s']:>13.0f} {w2['req_per_s']:>8.1f} {w2['preemptions']:>8}")
    print(f"{'fp8 / bf16':16} {fp8['kv_blocks'] / bf16['kv_blocks']:>9.2f}x {'':>12} {'':>12} "
          f"{fp8['W2']['output_tok_per_s'] / bf16['W2']['output_tok_per_s']:>12.2f}x")


def main_gpu(args, results: dict, save) -> int:
    """The GPU mode: the Llama-3-8B-shape checkpoint of bench_offline, W2 with the bf16 and the fp8 cache."""
    from .bench_offline import LLAMA3_8B, build_checkpoint, fixed, w2_workload

    vocab = LLAMA3_8B["vocab_size"]
    n = 200 if args.quick else 1000
    folder = build_checkpoint(Path(args.checkpoint))
    results.update(device=torch.cuda.get_device_name(), requests=n, prompt_tokens=512, output_tokens=128)
    results.update(measure(folder, w2_workload(n, vocab), fixed(64, 512, 16, seed=9, vocab=vocab),
                           max_model_len=4096, max_num_seqs=args.max_num_seqs,
                           max_num_batched_tokens=args.max_num_batched_tokens, gpu_memory_utilization=0.90))
    save()
    print_kv_table(results)
    return 0


def main_tiny(out_dir: Path) -> int:
    """A CPU smoke run: the embedded default model in bf16, a 2 MiB cache budget (the bf16 cache holds 512
    tokens, fewer than W2's 896: it preempts; the fp8 cache holds 1024), 16 requests of 48 in, 8 out."""
    from asyncengine.config import default_model_path

    from .bench_offline import fixed

    out_dir.mkdir(parents=True, exist_ok=True)
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(default_model_path()).vocab_size
    results = dict(device="cpu", date=time.strftime("%Y-%m-%d"), requests=16, prompt_tokens=48, output_tokens=8)
    results.update(measure(default_model_path(), fixed(16, 48, 8, seed=2, vocab=vocab),
                           fixed(2, 48, 2, seed=9, vocab=vocab), max_model_len=256, max_num_seqs=16,
                           kv_cache_memory_gb=2 / 1024))
    (out_dir / "bench_kv_cache_tiny.json").write_text(json.dumps(results, indent=2))
    print_kv_table(results)
    return 0

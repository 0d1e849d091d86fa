"""Batch-1 (and small-batch) split-KV decode attention under other split counts, in
CUDA graphs over 16 layers' caches (as a decode step reads them), at the engine's shapes: Llama-3-8B (32 q / 8 kv
heads) and Qwen3-30B-A3B (32 q / 4 kv heads), head_dim 128, bf16, block size 16. One GPU call:

    python scripts/decode_split_sweep.py

Run 65 (one H200) also varied a minimum segment length (a kernel parameter added for it and removed after: at batch
1 no combination beat the engine's split count by more than 8%).
"""

from __future__ import annotations

import itertools
import statistics

import torch

from asyncengine.kernels import attention

LAYERS, BLOCK_SIZE, HEAD_DIM = 16, 16, 128


def case(batch: int, context: int, heads: int, kv_heads: int):
    blocks = -(-context // BLOCK_SIZE)
    tables = torch.stack([torch.randperm(blocks * batch, device="cuda")[:blocks] for _ in range(batch)]).int()
    caches = [(torch.randn(blocks * batch, BLOCK_SIZE, kv_heads, HEAD_DIM, device="cuda", dtype=torch.bfloat16),
               torch.randn(blocks * batch, BLOCK_SIZE, kv_heads, HEAD_DIM, device="cuda", dtype=torch.bfloat16))
              for _ in range(LAYERS)]
    q = torch.randn(batch, heads, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    qsl = torch.arange(batch + 1, device="cuda", dtype=torch.int32)
    lens = torch.full((batch,), context, device="cuda", dtype=torch.int32)
    return q, caches, qsl, lens, tables


def time_us(q, caches, qsl, lens, tables, splits) -> tuple[float, torch.Tensor]:
    out = torch.empty_like(q)

    def step():
        for kc, vc in caches:
            attention.paged_attention_decode(q, kc, vc, qsl, lens, tables, HEAD_DIM**-0.5, splits, out=out)

    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    graph.replay()
    times = []
    for _ in range(20):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / LAYERS)
    return statistics.median(times), out.clone()


def main() -> None:
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"{torch.cuda.get_device_name()}  {sms} SMs; us per layer call (median of 20 graph replays of {LAYERS})")
    for (heads, kv_heads), batch, context in itertools.product(((32, 8), (32, 4)), (1, 4), (1000, 4000)):
        data = case(batch, context, heads, kv_heads)
        engine_splits = attention.decode_num_splits(batch, kv_heads, 4096, sms)  # graphs: bound = max_model_len
        base, ref = time_us(*data, engine_splits)
        rows = []
        for splits in (2, 4, 8, 9, 16, 17, 32):
            us, out = time_us(*data, splits)
            rows.append((us, splits, (out.float() - ref.float()).abs().max().item()))
        timings = ", ".join(f"{s}: {us:.1f}" for us, s, _ in sorted(rows, key=lambda r: r[1]))
        print(f"q/kv {heads}/{kv_heads} B={batch} ctx={context}: engine ({engine_splits} splits) {base:.1f} us; "
              f"by splits {timings}; max |diff| {max(r[2] for r in rows):.3g}")


if __name__ == "__main__":
    main()

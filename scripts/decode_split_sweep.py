"""Batch-1 (and small-batch) split-KV decode attention under other split counts, in
CUDA graphs over 16 layers' caches (as a decode step reads them), at the engine's shapes: Llama-3-8B (32 q / 8 kv
heads) and Qwen3-30B-A3B (32 q / 4 kv heads), head_dim 128, bf16, block size 16. One GPU call:

    python scripts/decode_split_sweep.py

Session 11 adds the partial kernel's tiles and the merge's heads a pass (DECODE_MERGE_FLOATS) to the sweep.
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


TILES = ((64, 4, 3), (32, 4, 3), (64, 8, 3))  # (BLOCK_N, num_warps, num_stages) of the partial kernel
MERGES = {"1 head a pass": 1, "8K": 8192, "32K": 32768}  # DECODE_MERGE_FLOATS values


def configured(splits: int, tiles: tuple, merge_floats: int, data) -> tuple[float, torch.Tensor]:
    """time_us with the partial kernel's tiles and the merge's budget replaced for this call."""
    saved = attention.decode_tiles, attention.DECODE_MERGE_FLOATS
    attention.decode_tiles = lambda fp32, merge_partials: tiles
    attention.DECODE_MERGE_FLOATS = merge_floats
    try:
        return time_us(*data, splits)
    finally:
        attention.decode_tiles, attention.DECODE_MERGE_FLOATS = saved


def main() -> None:
    import os

    with open(os.path.join(os.environ.get("OUT", "."), "decode_sweep_table.txt"), "w") as table:
        sweep(table)


def sweep(table) -> None:
    """Print one line a case (the engine's choice, the best four) and every cell to `table`."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"{torch.cuda.get_device_name()}  {sms} SMs; us per layer call (median of 20 graph replays of {LAYERS}); "
          "tiles (BLOCK_N, warps, stages); merge: 1 head a pass (session 10's order) or up to 8K / 32K partials "
          "a pass")
    for (heads, kv_heads), batch, context in itertools.product(((32, 8), (32, 4)), (1, 4), (1000, 4000)):
        data = case(batch, context, heads, kv_heads)
        engine_splits = attention.decode_num_splits(batch, kv_heads, 4096, sms)  # graphs: bound = max_model_len
        base, ref = time_us(*data, engine_splits)
        rows = []
        for splits, tiles, (merge, floats) in itertools.product(sorted({8, 16, 32, engine_splits}), TILES,
                                                                MERGES.items()):
            us, out = configured(splits, tiles, floats, data)
            diff = (out.float() - ref.float()).abs().max().item()
            rows.append((us, f"{splits}/{tiles[0]}x{tiles[1]}/{merge}", diff))
        for us, name, diff in sorted(rows):
            print(f"{heads}/{kv_heads} B={batch} ctx={context} {name}: {us:.2f} us (max |diff| {diff:.3g})", file=table)
        best = ", ".join(f"{name}: {us:.1f}" for us, name, _ in sorted(rows)[:4])
        per_head = {name: us for us, name, _ in rows}
        engine_tiles = attention.decode_config(heads // kv_heads, engine_splits, HEAD_DIM, False)[1:]
        key = f"{engine_splits}/{engine_tiles[0]}x{engine_tiles[1]}/"
        print(f"q/kv {heads}/{kv_heads} B={batch} ctx={context}: engine ({key}) {base:.1f} us "
              f"(1 head a pass {per_head[key + '1 head a pass']:.1f}); best {best}; "
              f"max |diff| {max(r[2] for r in rows):.3g}")


if __name__ == "__main__":
    main()

"""Benchmark of the Triton kernels at Llama-3-8B sizes (bf16) against the torch reference and dense SDPA.

    python loadtest/bench_kernels.py [--sweep | --moe | --gemv-sweep [--tiny] | --moe-decode | --moe-sweep [--tiny]
                                      | --int4-gemm | --fp8-gemm | --fp8-gemm-sweep]

Cases: paged_attention decode (batch 1 and 64 at 1k context; eager and replayed from a CUDA graph, and in a graph
with the separate reduction kernel instead of the fused merge), prefill
(4 x 2048), and the row-wise kernels. Times are do_bench medians (CUDA events). Decode is memory bound, so it
reports GB/s of K/V read; prefill is compute bound, so it reports TFLOP/s of the causal half of QK^T and PV.
The last column is the reference's time over this row's time.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
from triton.testing import do_bench

from asyncengine.kernels import activation, attention, norm, reference

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
DTYPE = torch.bfloat16
SCALE = HEAD_DIM**-0.5


def median_ms(fn) -> float:
    return do_bench(fn, warmup=50, rep=300, return_mode="median")


def graph_ms(fn) -> float:
    """Median time of fn replayed from a CUDA graph (launch overhead removed)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return median_ms(graph.replay)


def paged_batch(q_lens: list[int], seq_lens: list[int]):
    """Random bf16 q and paged K/V with a shuffled block table: (q, k_cache, v_cache, qsl, seq_lens, tables)."""
    blocks = [triton.cdiv(s, BLOCK_SIZE) for s in seq_lens]
    order = torch.randperm(sum(blocks), device="cuda").int()
    tables = torch.zeros(len(seq_lens), max(blocks), dtype=torch.int32, device="cuda")
    used = 0
    for b, n in enumerate(blocks):
        tables[b, :n] = order[used : used + n]
        used += n
    shape = (sum(blocks), BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    k_cache = torch.randn(shape, dtype=DTYPE, device="cuda")
    v_cache = torch.randn(shape, dtype=DTYPE, device="cuda")
    starts = torch.tensor([0] + q_lens, device="cuda").cumsum(0).int()
    q = torch.randn(sum(q_lens), HEADS, HEAD_DIM, dtype=DTYPE, device="cuda")
    return q, k_cache, v_cache, starts, torch.tensor(seq_lens, dtype=torch.int32, device="cuda"), tables


def decode_rows(batch: int, context: int) -> list[tuple]:
    q, kc, vc, qsl, lens, tables = paged_batch([1] * batch, [context] * batch)
    kv_bytes = 2 * batch * context * KV_HEADS * HEAD_DIM * kc.element_size()
    out = torch.empty_like(q)

    def triton_fn():
        attention.paged_attention(q, kc, vc, qsl, lens, tables, SCALE, max_query_len=1, max_seq_len=context, out=out)

    ref_ms = median_ms(lambda: reference.paged_attention(q, kc, vc, qsl, lens, tables, SCALE))
    # Dense SDPA on contiguous K/V (no paging): what a fused library kernel does with the same bytes.
    k = kc[tables.long()].reshape(batch, -1, KV_HEADS, HEAD_DIM)[:, :context].transpose(1, 2).contiguous()
    v = vc[tables.long()].reshape(batch, -1, KV_HEADS, HEAD_DIM)[:, :context].transpose(1, 2).contiguous()
    qd = q.view(batch, 1, HEADS, HEAD_DIM).transpose(1, 2)
    sdpa_ms = median_ms(lambda: F.scaled_dot_product_attention(qd, k, v, scale=SCALE, enable_gqa=True))
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    splits = attention.decode_num_splits(batch, KV_HEADS, context, sms)
    name = f"decode B={batch} ctx={context} ({splits} splits)"

    def two_kernels_fn():  # the partial kernel, then the reduction kernel (the fused merge's predecessor)
        attention.paged_attention_decode(q, kc, vc, qsl, lens, tables, SCALE, splits, out=out, fused_reduce=False)

    rows = []
    for impl, ms in (("reference", ref_ms), ("sdpa dense", sdpa_ms), ("triton", median_ms(triton_fn)),
                     ("triton graph", graph_ms(triton_fn)),
                     ("triton graph, reduce kernel", graph_ms(two_kernels_fn))):  # fmt: skip
        rows.append((name, impl, ms, f"{kv_bytes / ms / 1e6:8.0f} GB/s", ref_ms / ms))
    return rows


def prefill_rows(batch: int, length: int) -> list[tuple]:
    q, kc, vc, qsl, lens, tables = paged_batch([length] * batch, [length] * batch)
    flops = 4 * batch * HEADS * length * length * HEAD_DIM / 2  # causal half of two matmuls

    def triton_fn():
        attention.paged_attention(q, kc, vc, qsl, lens, tables, SCALE, max_query_len=length, max_seq_len=length)

    ref_ms = median_ms(lambda: reference.paged_attention(q, kc, vc, qsl, lens, tables, SCALE))
    qd = q.view(batch, length, HEADS, HEAD_DIM).transpose(1, 2)
    k = kc[tables.long()].reshape(batch, length, KV_HEADS, HEAD_DIM).transpose(1, 2).contiguous()
    v = vc[tables.long()].reshape(batch, length, KV_HEADS, HEAD_DIM).transpose(1, 2).contiguous()
    sdpa_ms = median_ms(
        lambda: F.scaled_dot_product_attention(qd, k, v, is_causal=True, scale=SCALE, enable_gqa=True)
    )
    name = f"prefill {batch}x{length}"
    timed = (("reference", ref_ms), ("sdpa dense", sdpa_ms), ("triton", median_ms(triton_fn)))
    return [(name, impl, ms, f"{flops / ms / 1e9:8.1f} TFLOP/s", ref_ms / ms) for impl, ms in timed]


def rowwise_rows(tokens: int = 4096) -> list[tuple]:
    x = torch.randn(tokens, 4096, dtype=DTYPE, device="cuda")
    w = torch.randn(4096, dtype=DTYPE, device="cuda")
    gate_up = torch.randn(tokens, 2 * 14336, dtype=DTYPE, device="cuda")
    cases = [
        ("rms_norm 4096x4096", 2 * x.numel() * 2,
         lambda: reference.rms_norm(x, w, 1e-5), lambda: norm.rms_norm(x, w, 1e-5)),
        ("silu_and_mul 4096x14336", 3 * gate_up.numel() // 2 * 2,
         lambda: reference.silu_and_mul(gate_up), lambda: activation.silu_and_mul(gate_up)),
    ]  # fmt: skip
    rows = []
    for name, nbytes, ref_fn, fn in cases:
        ref_ms, ms = median_ms(ref_fn), median_ms(fn)
        rows += [(name, "reference", ref_ms, f"{nbytes / ref_ms / 1e6:8.0f} GB/s", 1.0),
                 (name, "triton", ms, f"{nbytes / ms / 1e6:8.0f} GB/s", ref_ms / ms)]  # fmt: skip
    return rows


def _patched(name: str, value):
    """Context manager that replaces attention.<name> by a function returning `value` (tile sweeps)."""
    import contextlib

    @contextlib.contextmanager
    def patch():
        real = getattr(attention, name)
        setattr(attention, name, lambda *args, **kwargs: value)
        try:
            yield
        finally:
            setattr(attention, name, real)

    return patch()


def _fp32_reference(batch) -> torch.Tensor:
    q, kc, vc, qsl, lens, tables = batch
    return reference.paged_attention(q.float(), kc.float(), vc.float(), qsl, lens, tables, SCALE)


def _rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref).norm() / ref.norm()).item()


def sweep_prefill(batch: int = 4, length: int = 2048) -> list[tuple]:
    """Time the 2D kernel under other (rows, block_n, num_warps, num_stages) tiles; error vs float32 reference."""
    data = paged_batch([length] * batch, [length] * batch)
    ref = _fp32_reference(data)
    flops = 4 * batch * HEADS * length * length * HEAD_DIM / 2
    rows = []
    for tiles in [(128, 64, 8, 2), (128, 64, 8, 3), (128, 128, 8, 2), (128, 32, 8, 3), (64, 64, 4, 3), (64, 128, 4, 2),
                  (64, 64, 4, 2)]:  # fmt: skip
        with _patched("prefill_tiles", tiles):
            fn = lambda: attention.paged_attention(*data, SCALE, max_query_len=length, max_seq_len=length)  # noqa: E731
            name = f"prefill {batch}x{length} tiles={tiles}"
            try:
                err, ms = _rel_error(fn(), ref), median_ms(fn)
            except Exception as exc:  # a tile that does not fit: report and go on
                rows.append((name, type(exc).__name__, float("nan"), "", 0.0))
                continue
        rows.append((name, f"err {err:.1e}", ms, f"{flops / ms / 1e9:8.1f} TFLOP/s", 0.0))
    return rows


def sweep_decode() -> list[tuple]:
    """Time the split-KV path (CUDA-graph replays) under other tiles and split counts; error vs float32 reference."""
    rows = []
    for batch, context, split_options in ((1, 1024, (4, 8, 16)), (64, 1024, (1, 2, 4)), (8, 4096, (4, 8, 16))):
        data = paged_batch([1] * batch, [context] * batch)
        ref = _fp32_reference(data)
        kv_bytes = 2 * batch * context * KV_HEADS * HEAD_DIM * 2
        out = torch.empty_like(data[0])
        for tiles in [(64, 4, 3), (32, 4, 3), (128, 4, 3), (64, 8, 3), (128, 8, 3), (64, 4, 4)]:
            for splits in split_options:
                with _patched("decode_tiles", tiles):
                    fn = lambda: attention.paged_attention_decode(*data, SCALE, splits, out=out)  # noqa: E731
                    err, ms = _rel_error(fn(), ref), graph_ms(fn)
                name = f"decode B={batch} ctx={context} tiles={tiles} splits={splits}"
                rows.append((name, f"err {err:.1e}", ms, f"{kv_bytes / ms / 1e6:8.0f} GB/s", 0.0))
    return rows


# (experts, top_k, hidden, intermediate) of the mixtures of experts in issue 18
MOE_SHAPES = {"qwen3-30b-a3b": (128, 8, 2048, 768), "mixtral-8x7b": (8, 2, 4096, 14336)}


def moe_rows(shape: str, tokens: int) -> list[tuple]:
    """fused_moe (routing included) against the reference; rate: bytes of the experts the batch hits, read once,
    per second (decode is bound by them: compare with the device's copy bandwidth)."""
    from asyncengine.kernels import moe

    experts, top_k, hidden, inter = MOE_SHAPES[shape]
    x = torch.randn(tokens, hidden, dtype=DTYPE, device="cuda")
    w13 = torch.randn(experts, 2 * inter, hidden, dtype=DTYPE, device="cuda") * hidden**-0.5
    w2 = torch.randn(experts, hidden, inter, dtype=DTYPE, device="cuda") * inter**-0.5
    logits = torch.randn(tokens, experts, dtype=DTYPE, device="cuda")
    weights, ids = moe.topk_softmax(logits, top_k, True)
    hit_bytes = ids.unique().numel() * 3 * hidden * inter * w13.element_size()

    def triton_fn():
        moe.fused_moe(x, w13, w2, *moe.topk_softmax(logits, top_k, True))

    ref_ms = median_ms(lambda: reference.fused_moe(x, w13, w2, *reference.topk_softmax(logits, top_k, True)))
    name = f"moe {shape} T={tokens}"
    path = "decode" if tokens <= moe.DECODE_MAX_TOKENS else "grouped"
    return [(name, impl, ms, f"{hit_bytes / ms / 1e6:8.0f} GB/s", ref_ms / ms)
            for impl, ms in (("reference", ref_ms), (f"{path}", median_ms(triton_fn)),
                             (f"{path} graph", graph_ms(triton_fn)))]


INT4_SHAPES = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096)}  # (K, N)


def int4_gemm_rows(ms=(32, 64, 128, 256, 512, 1024, 2048, 8192)) -> list[tuple]:
    """The engine's int4 product (`int_weight_matmul`: the GEMV up to GEMV_MAX_M rows, dequantize + cuBLAS above) at
    the 8B shapes (group 128), and the dequantize alone, against cuBLAS on the bf16 weight, per M; TFLOP/s of
    2 M N K; ratio bf16 time / int4 time."""
    from asyncengine.kernels import quant_int4, quant_reference

    rows = []
    for name, (k, n) in INT4_SHAPES.items():
        w = torch.randn(k, n, device="cuda") * 0.02
        qweight, scales, zeros = quant_reference.quantize_int_weight(w, 128)
        scales, zeros = scales.to(DTYPE), zeros.to(DTYPE)
        w16 = quant_reference.dequantize_packed(qweight, scales, zeros, 128)  # [K, N] bf16
        rows.append((f"int4 dequantize {name} {k}->{n}", "dequantize",
                     median_ms(lambda: quant_int4.dequantize(qweight, scales, zeros, 128, DTYPE)),
                     f"{(qweight.numel() * 4 + w16.numel() * 2) / 1e9:.2f} GB moved", 1.0))
        for m in ms:
            x = torch.randn(m, k, device="cuda", dtype=DTYPE)
            bf16 = median_ms(lambda: x @ w16)
            int4 = median_ms(lambda: quant_int4.int_weight_matmul(x, qweight, scales, zeros, 128))
            for impl, ms_ in (("bf16 cuBLAS", bf16), ("int4", int4)):
                tflops = f"{2 * m * n * k / ms_ / 1e9:.1f} TFLOP/s"
                rows.append((f"int4 {name} M={m}", impl, ms_, tflops, bf16 / ms_))
    return rows


def print_table(rows: list[tuple]) -> None:
    width = max(len(r[0]) for r in rows) + 1
    print(f"{'case':{width}} {'impl':13} {'median us':>10} {'rate':>16} {'vs ref':>7}")
    for name, impl, ms, rate, ratio in rows:
        print(f"{name:{width}} {impl:13} {ms * 1e3:10.1f} {rate:>16} {ratio:6.1f}x")


def main(argv: list[str] | None = None) -> None:
    """Default: the comparison table. --sweep: tile and split variants of the attention kernels. --moe: the fused
    mixture-of-experts kernels at Qwen3-30B-A3B and Mixtral-8x7B expert shapes. --gemv-sweep [--tiny]: launch
    configurations of the decode GEMV per 8B linear shape and format (loadtest/bench_gemv.py). --moe-decode /
    --moe-sweep [--tiny]: the MoE layer's decode kernels at the Qwen3-30B-A3B shape, and their tile sweep
    (loadtest/bench_moe.py). --int4-gemm: the engine's int4 product against bf16 cuBLAS (`int4_gemm_rows`).
    --fp8-gemm / --fp8-gemm-sweep: the W8A8 FP8 paths per batch size, and our FP8 GEMM's tile sweep
    (loadtest/bench_fp8_gemm.py)."""
    import sys

    args = sys.argv[1:] if argv is None else argv
    if "--gemv-sweep" in args:  # runs on CPU too (--tiny): before anything below asks for CUDA
        from .bench_gemv import run_sweep

        raise SystemExit(run_sweep(args))
    if "--fp8-gemm" in args or "--fp8-gemm-sweep" in args:
        from .bench_fp8_gemm import main as run_fp8_gemm

        raise SystemExit(run_fp8_gemm(args))
    if "--moe-decode" in args or "--moe-sweep" in args:  # --tiny runs on CPU as well
        from .bench_moe import main as run_moe_decode

        raise SystemExit(run_moe_decode(args))
    torch.manual_seed(0)
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}")
    if "--moe" in args:
        print_table([row for shape in MOE_SHAPES for tokens in (1, 8, 16, 17, 64, 512, 4096)
                     for row in moe_rows(shape, tokens)])
        return
    if "--sweep" in args:
        print_table(sweep_prefill() + sweep_decode())
        return
    if "--int4-gemm" in args:
        print_table(int4_gemm_rows())
        return

    print_table(decode_rows(1, 1024) + decode_rows(64, 1024) + prefill_rows(4, 2048) + rowwise_rows())


if __name__ == "__main__":
    main()

"""Is a persistent decode kernel worth building? The 8B decode step's four bf16 GEMVs at one row, chained (each
product's output is the next one's input), timed three ways in CUDA graphs on one GPU:

  engine      the engine's decode GEMV (kernels/quant_gemv.dense_gemv, tuned tiles, PDL as the engine launches
              it): four launches;
  cublas      F.linear: four launches;
  persistent  one launch of `_chain_kernel`: a grid of P programs (a few per SM, all resident at once) that
              runs the four products as phases; between phases a grid-wide barrier (one arrival counter per
              phase, spun on in L2), and each program issues its first weight loads of the next phase *before*
              it waits there, so the weight stream does not stop at product boundaries (the ramp and tail that
              Nsight Compute measured in runs 131-132: SMs idle 9-41% of each GEMV's time).

Also timed: the barrier alone (four phases of one tiny tile each). Products: qkv 4096 -> 6144, o 4096 -> 4096
(input: the first 4096 of qkv's output), gate_up 4096 -> 28672, down 14336 -> 4096 (input: the first 14336 of
gate_up's output, no activation, so all three paths do the same arithmetic). Checks the persistent chain's
output against the engine's (bf16 intermediates in both; relative error printed). A deadlock cannot happen while
every program is resident: the grid is sized from the compiled kernel's registers, and the run is bounded by the
caller's timeout. This is a measurement, not an engine path.

    python scripts/persistent_chain.py [--repeats 20]
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

SHAPES = ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336))  # (N, K) of qkv, o, gate_up, down


@triton.jit
def _phase(x_ptr, w_ptr, y_ptr, N, K, arrive_ptr, wait_ptr, pid, P, WAIT: tl.constexpr,
           BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPIN_LOAD: tl.constexpr):
    """y[tile rows] = W[tile rows] @ x for the tiles pid, pid + P, ... of N / BLOCK_N (full K each), streamed as
    one sequence of [BLOCK_N, BLOCK_K] chunks, each loaded one step ahead; the first chunk before the wait for
    the previous phase (weights depend on nothing). Then arrive on arrive_ptr (release)."""
    k_steps = tl.cdiv(K, BLOCK_K)
    num_tiles = tl.cdiv(N, BLOCK_N)
    my_tiles = tl.cdiv(tl.maximum(num_tiles - pid, 0), P)
    total = my_tiles * k_steps
    ks = tl.arange(0, BLOCK_K)
    rn = tl.arange(0, BLOCK_N)
    rows = pid * BLOCK_N + rn
    w = tl.load(w_ptr + rows.to(tl.int64)[:, None] * K + ks[None, :],
                mask=(rows < N)[:, None] & (ks < K)[None, :] & (total > 0), other=0.0)
    if WAIT:
        if SPIN_LOAD:  # spin on plain (volatile) reads, which L2 serves side by side, then one acquire
            while tl.load(wait_ptr, volatile=True) < P:
                pass
            tl.atomic_add(wait_ptr, 0, sem="acquire")
        else:  # spin on atomic reads (read-modify-write: serialized at the counter's L2 slice)
            while tl.atomic_add(wait_ptr, 0, sem="acquire") < P:
                pass
        tl.debug_barrier()
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for step in range(0, total):
        tile = pid + (step // k_steps) * P
        k0 = (step % k_steps) * BLOCK_K
        x = tl.load(x_ptr + k0 + ks, mask=k0 + ks < K, other=0.0, cache_modifier=".cg").to(tl.float32)
        nxt = step + 1
        n_tile = pid + (nxt // k_steps) * P
        n_k0 = (nxt % k_steps) * BLOCK_K
        n_rows = n_tile * BLOCK_N + rn
        w_next = tl.load(w_ptr + n_rows.to(tl.int64)[:, None] * K + (n_k0 + ks)[None, :],
                         mask=(n_rows < N)[:, None] & (n_k0 + ks < K)[None, :] & (nxt < total), other=0.0)
        acc += w.to(tl.float32) * x[None, :]
        w = w_next
        if k0 + BLOCK_K >= K:  # the tile's last chunk: finish it
            rows = tile * BLOCK_N + rn
            tl.store(y_ptr + rows, tl.sum(acc, axis=1).to(y_ptr.dtype.element_ty), mask=rows < N)
            acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    tl.debug_barrier()  # every thread's stores issued before the release below
    tl.atomic_add(arrive_ptr, 1, sem="release")


@triton.jit(do_not_specialize=["P"])
def _chain_kernel(x_ptr, w1, y1, w2, y2, w3, y3, w4, y4, counters_ptr, N1, K1, N2, K2, N3, K3, N4, K4, P,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPIN_LOAD: tl.constexpr):
    pid = tl.program_id(0)
    _phase(x_ptr, w1, y1, N1, K1, counters_ptr + 0, counters_ptr, pid, P, False, BLOCK_N, BLOCK_K, SPIN_LOAD)
    _phase(y1, w2, y2, N2, K2, counters_ptr + 1, counters_ptr + 0, pid, P, True, BLOCK_N, BLOCK_K, SPIN_LOAD)
    _phase(y2, w3, y3, N3, K3, counters_ptr + 2, counters_ptr + 1, pid, P, True, BLOCK_N, BLOCK_K, SPIN_LOAD)
    _phase(y3, w4, y4, N4, K4, counters_ptr + 3, counters_ptr + 2, pid, P, True, BLOCK_N, BLOCK_K, SPIN_LOAD)
    # The last program to finish phase 4 knows every program passed every barrier: it resets the counters for
    # the next launch (graph replay).
    if tl.atomic_add(counters_ptr + 4, 1, sem="acq_rel") == P - 1:
        for i in tl.static_range(5):
            tl.atomic_xchg(counters_ptr + i, 0)


def persistent_chain(x, weights, outs, counters, programs, block_n, block_k, num_warps, spin_load=True):
    (w1, w2, w3, w4), (y1, y2, y3, y4) = weights, outs
    shapes = [d for w in weights for d in w.shape]
    kernel = _chain_kernel[(programs,)](x, w1, y1, w2, y2, w3, y3, w4, y4, counters, *shapes, programs,
                                        BLOCK_N=block_n, BLOCK_K=block_k, SPIN_LOAD=spin_load,
                                        num_warps=num_warps)
    return y4, kernel


def resident_programs(kernel, num_warps, device) -> int:
    """Programs of a compiled _chain_kernel that fit on the GPU at once (its registers and shared memory)."""
    props = torch.cuda.get_device_properties(device)
    threads = 32 * num_warps
    by_regs = props.regs_per_multiprocessor // max(1, kernel.n_regs * threads)
    by_threads = props.max_threads_per_multi_processor // threads
    shared = kernel.metadata.shared
    by_smem = props.shared_memory_per_multiprocessor // shared if shared else by_threads
    return props.multi_processor_count * min(by_regs, by_threads, by_smem)


def graph_time_us(fn, repeats, per_graph=10):
    """Median over `repeats` replays of a graph of `per_graph` calls of fn: microseconds per call (ten calls a
    graph, so that the replay's own launch is spread over them; bench_kernels.graph_ms times one call a graph)."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        for _ in range(per_graph):
            fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1000 / per_graph)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    from asyncengine.kernels.quant_gemv import dense_gemv
    from asyncengine.loadtest.bench_offline import measure_copy_bandwidth

    torch.manual_seed(0)
    dev = torch.device("cuda")
    weights = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * k**-0.5 for n, k in SHAPES]
    x = torch.randn(1, SHAPES[0][1], device=dev, dtype=torch.bfloat16)
    outs = [torch.empty(n, device=dev, dtype=torch.bfloat16) for n, _ in SHAPES]
    counters = torch.zeros(8, dtype=torch.int32, device=dev)

    def engine():
        h = x
        for w in weights:
            h = dense_gemv(h[:, : w.shape[1]], w)
        return h

    def cublas():
        h = x
        for w in weights:
            h = F.linear(h[:, : w.shape[1]], w)
        return h

    bw = measure_copy_bandwidth()
    nbytes = sum(w.numel() * 2 for w in weights)
    print(f"{torch.cuda.get_device_name()}: copy {bw / 1e9:,.0f} GB/s; the four products' weights "
          f"{nbytes / 1e6:.0f} MB: floor {nbytes / bw * 1e6:.1f} us")
    reference = engine().float().flatten()
    rows = [("engine GEMV x4 (PDL)", graph_time_us(engine, args.repeats)),
            ("cuBLAS x4", graph_time_us(cublas, args.repeats))]
    # The same chain with FP8 e4m3 weights (per-channel scales, the engine's weight-only decode GEMV): its floor
    # is half the bytes.
    fp8 = [(w.float() / (w.float().abs().amax(1, keepdim=True) / 448)).to(torch.float8_e4m3fn) for w in weights]
    fp8_scales = [w.float().abs().amax(1) / 448 for w in weights]

    def engine_fp8():
        h = x
        for w, scale in zip(fp8, fp8_scales):
            h = dense_gemv(h[:, : w.shape[1]], w, w_scale=scale)
        return h

    fp8_us = graph_time_us(engine_fp8, args.repeats)
    rows.append((f"engine GEMV x4, FP8 weights (floor {nbytes / 2 / bw * 1e6:.1f} us: {nbytes / 2 / bw * 1e6 / fp8_us:.0%})",
                 fp8_us))
    for block_n, block_k, num_warps, per_sm, spin_load in ((16, 512, 8, 2, False), (16, 512, 8, 2, True),
                                                          (16, 512, 8, 3, True), (16, 1024, 8, 2, True),
                                                          (32, 512, 8, 2, True), (8, 512, 4, 4, True)):
        # one program alone first: it compiles the kernel and cannot deadlock (it waits only for itself)
        _, kernel = persistent_chain(x, weights, outs, counters, 1, block_n, block_k, num_warps, spin_load)
        torch.cuda.synchronize()
        fit = resident_programs(kernel, num_warps, dev)
        programs = torch.cuda.get_device_properties(dev).multi_processor_count * per_sm
        name = (f"persistent {block_n}x{block_k} w{num_warps} {per_sm}/SM {'load' if spin_load else 'atomic'} spin "
                f"({kernel.n_regs} regs)")
        if programs > fit:
            rows.append((name + f": {programs} programs > {fit} resident, skipped", float("nan")))
            continue
        run = lambda: persistent_chain(x, weights, outs, counters, programs, block_n, block_k, num_warps,  # noqa
                                       spin_load)[0]
        got = run().float()
        torch.cuda.synchronize()
        err = ((got - reference).norm() / reference.norm()).item()
        rows.append((name + f" rel.err {err:.1e}", graph_time_us(run, args.repeats)))
        print(rows[-1], flush=True)
    tiny = [torch.randn(16 * 132, 64, device=dev, dtype=torch.bfloat16) for _ in SHAPES]
    tiny_outs = [torch.empty(16 * 132, device=dev, dtype=torch.bfloat16) for _ in SHAPES]
    xt = torch.randn(1, 64, device=dev, dtype=torch.bfloat16)
    for spin_load in (False, True):
        rows.append((f"barriers alone (4 phases, 1 tile of 16x64 a program, 132 programs, "
                     f"{'load' if spin_load else 'atomic'} spin)",
                     graph_time_us(lambda: persistent_chain(xt, tiny, tiny_outs, counters, 132, 16, 64, 4,
                                                            spin_load)[0], args.repeats)))
    rows.append(("one empty-ish GEMV launch alone (engine, 2112x64)",
                 graph_time_us(lambda: dense_gemv(xt, tiny[0]), args.repeats)))
    print(f"{'chain of the 8B products at M = 1':<78} {'us':>8} {'of floor':>9}")
    for name, us in rows:
        print(f"{name:<78} {us:8.1f} {nbytes / bw * 1e6 / us:8.0%}")


if __name__ == "__main__":
    main()

"""The W8A8 FP8 GEMM (kernels/fp8_gemm.py) at the Llama-3-8B linear shapes, per batch size, in CUDA graphs:

    python -m loadtest.bench_kernels --fp8-gemm                      # the table below
    python -m loadtest.bench_kernels --fp8-gemm-sweep [--budget-s 300] [--ms 16,32,...] [--write-table PATH]
    python -m loadtest.bench_kernels --fp8-gemm --host               # host time to enqueue each path

--fp8-gemm: for qkv 4096->6144, o 4096->4096, gate_up 4096->28672 and down 14336->4096 at M = 16 ... 8192: bf16
cuBLAS; the engine's two W8A8 paths (`fp8_linear`: per-token quantization + torch._scaled_mm row-wise; and
`fp8_gemm_linear`: the same quantization + our GEMM); and their parts alone (the quantization, `_scaled_mm`
row-wise and per tensor, our GEMM). Each case is timed as the engine's start-up choice times it
(kernels/quant_linear.graph_time_us): a CUDA graph cycling through enough weight copies to defeat L2, so GB/s of
the weight compares with the copy bandwidth.
--fp8-gemm-sweep: every candidate tile (block_n, block_k, split_k, num_warps, num_stages) of our GEMM per shape and
M bucket against `_scaled_mm` row-wise; prints the best per cell, then the winners (each checked against the torch
reference) as lines of kernels/fp8_gemm_configs.py's table, written there (or to PATH) with --write-table.
"""

from __future__ import annotations

import itertools
import time
from typing import Optional

import torch

SHAPES = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096)}  # (K, N)
TABLE_MS = (16, 32, 64, 128, 256, 512, 1024, 8192)
SWEEP_MS = (16, 32, 64, 128, 256, 512)


def _weights(k: int, n: int):
    from asyncengine.kernels import quant_reference

    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    w8, w_scale = quant_reference.quantize_fp8(w, dim=-1)  # [N, K] e4m3, [N, 1] float32
    return w, w8, w_scale


def _time(call, weights: tuple) -> float:
    """us per call(w), in a CUDA graph over copies of `weights` (the engine's start-up timing)."""
    from asyncengine.kernels import quant_linear

    return quant_linear.graph_time_us(call, quant_linear._copies(weights))


def table_rows(ms=TABLE_MS) -> list[tuple]:
    """(case, impl, us, rate, bf16 us / us) rows of the --fp8-gemm table."""
    from asyncengine.kernels import fp8_gemm, quant_fp8

    rows = []
    for name, (k, n) in SHAPES.items():
        w, w8, w_scale = _weights(k, n)
        w_row = w_scale.reshape(1, -1).contiguous()
        one = torch.ones((), device="cuda")
        for m in ms:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            x8, x_scale = quant_fp8.quantize_per_token(x)
            cases = {
                "bf16 cuBLAS": (lambda ws: x @ ws[0].t(), (w,)),
                "fp8_linear": (lambda ws: quant_fp8.fp8_linear(x, ws[0], ws[1], None), (w8, w_scale)),
                "quantize": (lambda ws: quant_fp8.quantize_per_token(x), (w8,)),
                "rowwise mm": (lambda ws: torch._scaled_mm(x8, ws[0].t(), scale_a=x_scale, scale_b=ws[1],
                                                           out_dtype=torch.bfloat16), (w8, w_row)),
                "tensor mm": (lambda ws: torch._scaled_mm(x8, ws[0].t(), scale_a=one, scale_b=one,
                                                          out_dtype=torch.bfloat16), (w8,)),
            }
            if m <= fp8_gemm.MAX_M:
                cases["fp8_gemm_linear"] = (lambda ws: quant_fp8.fp8_gemm_linear(x, ws[0], ws[1], None),
                                            (w8, w_scale))
                cases["our gemm"] = (lambda ws: fp8_gemm.fp8_gemm(x8, x_scale, ws[0], ws[1], torch.bfloat16),
                                     (w8, w_scale))
            times = {impl: _time(call, weights) for impl, (call, weights) in cases.items()}
            for impl, us in times.items():
                weight_bytes = w.numel() * 2 if impl == "bf16 cuBLAS" else w8.numel()
                rate = f"{weight_bytes / us / 1e3:.0f} GB/s"
                rows.append((f"fp8 {name} M={m}", impl, us, rate, times["bf16 cuBLAS"] / us))
    return rows


def print_rows(rows: list[tuple]) -> None:
    width = max(len(r[0]) for r in rows) + 1
    print(f"{'case':{width}} {'impl':16} {'us':>8} {'weight rate':>12} {'bf16/this':>9}")
    for case, impl, us, rate, ratio in rows:
        print(f"{case:{width}} {impl:16} {us:8.1f} {rate:>12} {ratio:8.2f}x")


def host_rows(m: int = 4096, calls: int = 200) -> list[str]:
    """Host microseconds to enqueue one call of each W8A8 path (and bf16 cuBLAS) at the qkv shape with M tokens:
    `calls` calls timed back to back without synchronizing, after a warm-up (an eager prefill step enqueues 128 of
    these). Run 96 found W1's eager (prefill) steps host-bound with FP8 and not with bf16."""
    from asyncengine.kernels import fp8_gemm, quant_fp8

    k, n = SHAPES["qkv"]
    w, w8, w_scale = _weights(k, n)
    w_row = w_scale.reshape(1, -1).contiguous()
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    x8, x_scale = quant_fp8.quantize_per_token(x)
    small = min(m, fp8_gemm.MAX_M)
    cases = {
        "bf16 cuBLAS": lambda: x @ w.t(),
        "quantize_per_token": lambda: quant_fp8.quantize_per_token(x),
        "_scaled_mm row-wise": lambda: torch._scaled_mm(x8, w8.t(), scale_a=x_scale, scale_b=w_row,
                                                        out_dtype=torch.bfloat16),
        "fp8_linear": lambda: quant_fp8.fp8_linear(x, w8, w_scale, None),
        f"fp8_gemm (M={small})": lambda: fp8_gemm.fp8_gemm(x8[:small], x_scale[:small], w8, w_scale, torch.bfloat16),
    }
    lines = []
    for name, call in cases.items():
        for _ in range(10):
            call()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            call()
        host_us = (time.perf_counter() - start) / calls * 1e6
        torch.cuda.synchronize()
        lines.append(f"{name:24} {host_us:8.1f} us host per call (M={m})")
    return lines


# -- the sweep -----------------------------------------------------------------------------------------------

def candidates(m: int, n: int, k: int, num_sms: int):
    """Tiles worth timing for one cell: 64 or 128 channels, 128 or 256 inputs, 3 or 5 stages, 4 warps (8 with 128
    channels or 256 tokens), tokens per program the bucket's or half of it (above 64), and the K splits that give
    between a third of and three programs per SM."""
    from asyncengine.kernels import fp8_gemm

    default_m = fp8_gemm.block_m_for(m)
    block_ms = (default_m, default_m // 2) if default_m > 64 else (default_m,)
    for block_m, block_n, block_k, stages, warps in itertools.product(block_ms, (64, 128), (128, 256), (3, 5),
                                                                       (4, 8)):
        if warps == 8 and block_n == 64 and block_m < 256:
            continue
        tiles = -(-n // block_n) * -(-m // block_m)
        for split in (1, 2, 3, 4, 6, 8, 12):
            if k // split < block_k or (split > 1 and tiles * split > 3 * num_sms) or tiles * split < num_sms // 3:
                continue
            yield fp8_gemm.Fp8GemmConfig(block_n, block_k, split, warps, stages,
                                         block_m=0 if block_m == default_m else block_m)


def sweep(budget_s: float, write_path: Optional[str], ms: tuple = SWEEP_MS) -> int:
    from asyncengine.kernels import fp8_gemm, quant_fp8, quant_reference, sm_count

    num_sms = sm_count(0)
    started, winners, skipped = time.monotonic(), [], []
    for (name, (k, n)), m in itertools.product(SHAPES.items(), ms):
        if time.monotonic() - started > budget_s:
            skipped.append(f"{name} M={m}")
            continue
        _, w8, w_scale = _weights(k, n)
        w_row = w_scale.reshape(1, -1).contiguous()
        x8, x_scale = quant_fp8.quantize_per_token(torch.randn(m, k, device="cuda", dtype=torch.bfloat16))
        library = _time(lambda ws: torch._scaled_mm(x8, ws[0].t(), scale_a=x_scale, scale_b=ws[1],
                                                    out_dtype=torch.bfloat16), (w8, w_row))
        results = []
        for config in candidates(m, n, k, num_sms):
            try:
                us = _time(lambda ws: fp8_gemm.fp8_gemm(x8, x_scale, ws[0], ws[1], torch.bfloat16, config=config),
                           (w8, w_scale))
            except Exception as exc:  # noqa: BLE001 - a tile that does not compile (shared memory) is skipped
                print(f"  {name} M={m} {config}: failed ({type(exc).__name__})")
                continue
            results.append((us, config))
        results.sort(key=lambda r: r[0])
        best_us, best = results[0]
        out = fp8_gemm.fp8_gemm(x8, x_scale, w8, w_scale, torch.bfloat16, config=best)
        ref = quant_reference.fp8_scaled_mm(x8, x_scale, w8, w_scale, torch.bfloat16)
        error = ((out.double() - ref.double()).norm() / ref.double().norm()).item()
        gbps = w8.numel() / best_us / 1e3
        print(f"{name} M={m}: library {library:.1f} us; best {best_us:.1f} us ({gbps:.0f} GB/s, rel. error "
              f"{error:.1e}); next: " + ", ".join(f"{us:.1f}" for us, _ in results[1:4]), flush=True)
        if error > 1e-2:
            print(f"  winner rejected: relative error {error:.2e} against the reference")
            continue
        args = f"{best.block_n}, {best.block_k}, {best.split_k}, {best.num_warps}, {best.num_stages}"
        args += f", block_m={best.block_m}" if best.block_m else ""
        winners.append(f"    ({n}, {k}, {fp8_gemm.m_bucket(m)}): Fp8GemmConfig({args}),  # {name}: {best_us:.1f} us, "
                       f"{gbps:.0f} GB/s; row-wise {library:.1f} us")
    if skipped:
        print("skipped (budget): " + ", ".join(skipped))
    print("winners:")
    print("\n".join(winners))
    if write_path:
        _write_table(winners, write_path)
    return 0


def _write_table(lines: list[str], path: str) -> None:
    """Write kernels/fp8_gemm_configs.py with `lines` as its table to `path`; the current table's lines for keys not
    measured this time stay, after them, under a comment of their own."""
    from asyncengine.kernels import fp8_gemm_configs

    source = open(fp8_gemm_configs.__file__).read()
    head = source[: source.index("# Measured on" if "# Measured on" in source else "FP8_GEMM_TUNED")]

    def key(line: str) -> str:
        return line.split(":")[0].strip()

    measured = {key(line) for line in lines}
    kept = [line for line in source.splitlines() if line.startswith("    (") and key(line) not in measured]
    if kept:
        lines = lines + ["    # from the previous sweep:"] + kept
    device = torch.cuda.get_device_name()
    body = (f"# Measured on: one {device}, {time.strftime('%Y-%m-%d')}, `--fp8-gemm-sweep`. Comments: our time, the\n"
            "# weight's GB/s, and torch._scaled_mm row-wise on the same pre-quantized x. Arguments: block_n, block_k,\n"
            "# split_k, num_warps, num_stages.\n"
            "FP8_GEMM_TUNED: dict[tuple[int, int, int], Fp8GemmConfig] = {\n" + "\n".join(lines) + "\n}\n")
    with open(path, "w") as f:
        f.write(head + body)
    print(f"wrote {path}")


def main(argv: list[str]) -> int:
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}")
    if "--fp8-gemm-sweep" in argv:
        budget = float(argv[argv.index("--budget-s") + 1]) if "--budget-s" in argv else 300.0
        path = argv[argv.index("--write-table") + 1] if "--write-table" in argv else None
        ms = tuple(int(m) for m in argv[argv.index("--ms") + 1].split(",")) if "--ms" in argv else SWEEP_MS
        return sweep(budget, path, ms)
    if "--host" in argv:
        print("\n".join(host_rows()))
        return 0
    print_rows(table_rows())
    return 0

"""The int4 GEMM (kernels/int4_gemm.py) at the Llama-3-8B linear shapes (group 128), per batch size, in CUDA graphs
over weight copies that defeat L2 (the engine's start-up timing, kernels/quant_linear.graph_time_us):

    python -m loadtest.bench_kernels --int4-gemm-sweep [--budget-s 300] [--ms 64,128,...] [--write-table PATH]

For every shape and M: the engine's path above the GEMV before this kernel (dequantize + cuBLAS), cuBLAS on the
bf16 weight, and every candidate tile of the int4 GEMM; prints the best per cell (checked against the torch
reference) and the winners as lines of kernels/int4_gemm_configs.py's table, written there (or to PATH) with
--write-table.
"""

from __future__ import annotations

import itertools
import time
from typing import Optional

import torch

SHAPES = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096)}  # (K, N)
SWEEP_MS = (64, 128, 256, 512)
GROUP = 128


def _time(call, weights: tuple) -> float:
    from asyncengine.kernels import quant_linear

    return quant_linear.graph_time_us(call, quant_linear._copies(weights))


def candidates(m: int, n: int, k: int, num_sms: int):
    """block_n 64 / 128 / 256, block_k 64 / 128, block_m 64 / 128 (at most the batch's bucket), 2-4 stages, 4 or 8
    warps, and the K splits that give between a third of and three programs per SM."""
    from asyncengine.kernels import int4_gemm

    bucket = int4_gemm.m_bucket(m)
    for block_m, block_n, block_k, stages, warps in itertools.product((64, 128), (64, 128, 256), (64, 128), (2, 3, 4),
                                                                       (4, 8)):
        if block_m > max(64, bucket) or (warps == 8 and block_n * block_m < 128 * 128):
            continue
        tiles = -(-n // block_n) * -(-m // block_m)
        for split in (1, 2, 3, 4, 6, 8):
            if k // split < block_k or (split > 1 and tiles * split > 3 * num_sms) or tiles * split < num_sms // 3:
                continue
            yield int4_gemm.Int4GemmConfig(block_n, block_k, block_m, split, warps, stages)


def sweep(budget_s: float, write_path: Optional[str], ms: tuple = SWEEP_MS) -> int:
    from asyncengine.kernels import int4_gemm, quant_int4, quant_reference, sm_count

    num_sms = sm_count(0)
    print(f"device: {torch.cuda.get_device_name()}")
    started, winners, skipped = time.monotonic(), [], []
    for name, (k, n) in SHAPES.items():
        qweight, scales, zeros = quant_reference.quantize_int_weight(torch.randn(k, n, device="cuda") * 0.02, GROUP)
        scales, zeros = scales.to(torch.bfloat16), zeros.to(torch.bfloat16)
        packed = (qweight, scales, zeros)
        w16 = quant_reference.dequantize_packed(qweight, scales, zeros, GROUP).to(torch.bfloat16)  # [K, N]
        for m in ms:
            if time.monotonic() - started > budget_s:
                skipped.append(f"{name} M={m}")
                continue
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            dequant = _time(lambda ws: x @ quant_int4.dequantize(ws[0], ws[1], ws[2], GROUP, torch.bfloat16), packed)
            bf16 = _time(lambda ws: x @ ws[0], (w16,))
            results = []
            for config in candidates(m, n, k, num_sms):
                try:
                    us = _time(lambda ws: int4_gemm.int4_gemm(x, ws[0], ws[1], ws[2], GROUP, config=config), packed)
                except Exception as exc:  # noqa: BLE001 - a tile that does not compile (shared memory) is skipped
                    print(f"  {name} M={m} {config}: failed ({type(exc).__name__}: {str(exc)[:80]})")
                    continue
                results.append((us, config))
            results.sort(key=lambda r: r[0])
            best_us, best = results[0]
            out = int4_gemm.int4_gemm(x, qweight, scales, zeros, GROUP, config=best)
            ref = quant_reference.int_weight_matmul(x, qweight, scales, zeros, GROUP, 4)
            error = ((out.double() - ref.double()).norm() / ref.double().norm()).item()
            tflops = 2 * m * n * k / best_us / 1e6
            print(f"{name} M={m}: dequantize + cuBLAS {dequant:.1f} us, bf16 cuBLAS {bf16:.1f} us; int4 GEMM best "
                  f"{best_us:.1f} us ({tflops:.0f} TFLOP/s, {dequant / best_us:.2f}x, rel. error {error:.1e}) "
                  f"{best}; next: " + ", ".join(f"{us:.1f}" for us, _ in results[1:4]), flush=True)
            if error > 1e-2:
                print(f"  winner rejected: relative error {error:.2e} against the reference")
                continue
            args = (f"{best.block_n}, {best.block_k}, {best.block_m}, {best.split_k}, {best.num_warps}, "
                    f"{best.num_stages}")
            winners.append(f"    ({n}, {k}, {int4_gemm.m_bucket(m)}): Int4GemmConfig({args}),  # {name}: "
                           f"{best_us:.1f} us; dequantize + cuBLAS {dequant:.1f}, bf16 cuBLAS {bf16:.1f}")
    if skipped:
        print("skipped (budget): " + ", ".join(skipped))
    print("winners:")
    print("\n".join(winners))
    if write_path:
        _write_table(winners, write_path)
    return 0


def _write_table(lines: list[str], path: str) -> None:
    device = torch.cuda.get_device_name()
    source = (
        '"""Tuned tiles of the int4 GEMM (kernels/int4_gemm.py), keyed (N, K, M bucket); written by\n'
        '`python -m loadtest.bench_kernels --int4-gemm-sweep --write-table kernels/int4_gemm_configs.py`."""\n\n'
        "from .int4_gemm import Int4GemmConfig\n\n"
        f"# Measured on: one {device}, {time.strftime('%Y-%m-%d')}. Arguments: block_n, block_k, block_m, split_k,\n"
        "# num_warps, num_stages.\n"
        "INT4_GEMM_TUNED: dict[tuple[int, int, int], Int4GemmConfig] = {\n" + "\n".join(lines) + "\n}\n")
    with open(path, "w") as f:
        f.write(source)
    print(f"wrote {path}")


def main(argv: list[str]) -> int:
    budget = float(argv[argv.index("--budget-s") + 1]) if "--budget-s" in argv else 300.0
    ms = tuple(int(v) for v in argv[argv.index("--ms") + 1].split(",")) if "--ms" in argv else SWEEP_MS
    path = argv[argv.index("--write-table") + 1] if "--write-table" in argv else None
    return sweep(budget, path, ms)

"""Batch-1 matrix products at Llama-3-8B sizes: how close cuBLAS comes to the memory bandwidth (a benchmark).

    python -m loadtest.bench_matmul

W3 (batch-1 decode) reads 15 GB of weights per token through 129 matrix-vector products; they take most of its
time, so their bandwidth sets W3's floor. For each shape this times, replayed from a CUDA graph over enough weight
copies that L2 cannot serve repeats (as successive layers do in the model):
- `linear`: `F.linear(x, W)`, W stored [N, K] (the model's layout), torch's default BLAS;
- `linear-lt`: the same with `torch.backends.cuda.preferred_blas_library("cublaslt")`;
- `x@W^T[K,N]`: the weight stored transposed, [K, N] contiguous;
- `triton-gemv`: a plain Triton matrix-vector kernel, for scale only (the model keeps matrix products in torch).
Then the whole decode chain (32 x qkv, o, gate_up, down, then lm_head) per variant, in one graph. Rates are weight
bytes read per second, next to the measured device-to-device copy bandwidth (the roofline's denominator).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .bench_kernels import graph_ms
from .bench_offline import measure_copy_bandwidth

DTYPE = torch.bfloat16
# (name, N = output features, K = input features) of Llama-3-8B's linear layers
SHAPES = [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336), ("lm_head", 128256, 4096)]
LAYERS = 32
L2_DEFEAT_BYTES = 512 * 2**20  # weight copies per shape add up to at least this (H100/H200 L2: 50 MB)


@triton.jit
def _gemv_kernel(w_ptr, x_ptr, out_ptr, N, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """out[n] = sum_k W[n, k] * x[k]; one program per BLOCK_N rows, fp32 accumulation. W: [N, K] contiguous."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        w = tl.load(w_ptr + rows[:, None] * K + cols[None, :], mask=(rows[:, None] < N) & (cols[None, :] < K), other=0.0)
        x = tl.load(x_ptr + cols, mask=cols < K, other=0.0)
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
    tl.store(out_ptr + rows, tl.sum(acc, axis=1).to(out_ptr.dtype.element_ty), mask=rows < N)


def triton_gemv(x: torch.Tensor, w: torch.Tensor, block_n: int = 8, block_k: int = 512) -> torch.Tensor:
    """x: [1, K], w: [N, K] -> [1, N]."""
    n, k = w.shape
    out = torch.empty(1, n, dtype=x.dtype, device=x.device)
    _gemv_kernel[(triton.cdiv(n, block_n),)](w, x, out, n, k, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4)
    return out


def variants() -> dict:
    """name -> (prepare weight [N, K] -> stored form, product(x [1, K], stored) -> [1, N], blas library)."""
    same = lambda w: w  # noqa: E731
    return {
        "linear": (same, F.linear, "cublas"),
        "linear-lt": (same, F.linear, "cublaslt"),
        "x@W^T[K,N]": (lambda w: w.t().contiguous(), torch.matmul, "cublas"),
        "triton-gemv": (same, triton_gemv, "cublas"),
    }


def copies_beyond_l2(nbytes: int) -> int:
    """How many copies of an nbytes weight to cycle through so that no product is served from L2."""
    return max(2, -(-L2_DEFEAT_BYTES // nbytes))


def per_shape_rows() -> list[dict]:
    rows = []
    for name, n, k in SHAPES:
        nbytes = n * k * 2
        copies = copies_beyond_l2(nbytes)
        base = [torch.randn(n, k, device="cuda", dtype=DTYPE) * 0.02 for _ in range(copies)]
        x = torch.randn(1, k, device="cuda", dtype=DTYPE)
        reference = F.linear(x.float(), base[0].float())
        for variant, (prepare, product, blas) in variants().items():
            torch.backends.cuda.preferred_blas_library(blas)
            stored = [prepare(w) for w in base]
            error = (product(x, stored[0]).float() - reference).abs().max().item()
            ms = graph_ms(lambda: [product(x, w) for w in stored]) / copies
            rows.append({"shape": name, "N": n, "K": k, "variant": variant, "us": ms * 1e3,
                         "GB/s": nbytes / (ms / 1e3) / 1e9, "max_abs_err": error})
            del stored
        del base
        torch.backends.cuda.preferred_blas_library("cublas")
        torch.cuda.empty_cache()
    return rows


def decode_chain_rows() -> list[dict]:
    """All 129 products of one Llama-3-8B decode token, in order, in one graph, per variant."""
    weights = [torch.randn(n, k, device="cuda", dtype=DTYPE) * 0.02 for _ in range(LAYERS) for _, n, k in SHAPES[:4]]
    weights.append(torch.randn(SHAPES[4][1], SHAPES[4][2], device="cuda", dtype=DTYPE) * 0.02)
    total_bytes = sum(w.numel() * 2 for w in weights)
    rows = []
    for variant, (prepare, product, blas) in variants().items():
        torch.backends.cuda.preferred_blas_library(blas)
        # (x [1, K], stored weight) per product; prepare either returns w itself or a transposed copy
        calls = [(torch.randn(1, w.shape[1], device="cuda", dtype=DTYPE), prepare(w)) for w in weights]
        ms = graph_ms(lambda: [product(x, w) for x, w in calls])
        rows.append({"shape": "decode chain", "variant": variant, "us": ms * 1e3, "GB/s": total_bytes / (ms / 1e3) / 1e9})
        del calls
        torch.cuda.empty_cache()
    torch.backends.cuda.preferred_blas_library("cublas")
    return rows


def linear_weights_in_order(model: torch.nn.Module) -> list[torch.Tensor]:
    """The 2-D weights that one decode token multiplies by, in forward order (each layer's linears, then lm_head)."""
    weights = [m.weight for name, m in model.named_modules()
               if hasattr(m, "weight") and isinstance(m.weight, torch.Tensor) and m.weight.dim() == 2
               and "embed" not in name]
    if getattr(model, "lm_head", None) is None:  # tied: logits read the embedding table
        weights.append(model.embed_tokens.weight)
    return weights


def matmul_floor_ms(model: torch.nn.Module) -> float:
    """GPU ms of a batch-1 token's matrix products alone, exactly as the model calls them (F.linear on its own
    weights, in order, one CUDA graph): what W3 would take if every other kernel cost nothing."""
    weights = linear_weights_in_order(model)
    inputs = {w.shape[1]: torch.randn(1, w.shape[1], device=w.device, dtype=w.dtype) for w in weights}
    return graph_ms(lambda: [F.linear(inputs[w.shape[1]], w) for w in weights])


def batch_sweep_rows(batches=(1, 8, 64, 256, 2048, 8192)) -> list[dict]:
    """Both weight layouts at M tokens: a layout that helps batch 1 must not cost prefill (M in the thousands)."""
    rows = []
    for name, n, k in SHAPES[:4]:
        w = torch.randn(n, k, device="cuda", dtype=DTYPE) * 0.02
        copies = copies_beyond_l2(n * k * 2)
        layouts = {"W[N,K]": (F.linear, [w.clone() for _ in range(copies)]),
                   "W^T[K,N]": (torch.matmul, [w.t().contiguous() for _ in range(copies)])}
        for m in batches:
            x = torch.randn(m, k, device="cuda", dtype=DTYPE)
            for layout, (product, stored) in layouts.items():
                ms = graph_ms(lambda: [product(x, s) for s in stored]) / copies
                rows.append({"shape": name, "M": m, "layout": layout, "us": ms * 1e3,
                             "TFLOP/s": 2 * m * n * k / (ms / 1e3) / 1e12})
        del layouts, w
        torch.cuda.empty_cache()
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="write bench_matmul.json here")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    copy = measure_copy_bandwidth()
    rows = per_shape_rows() + decode_chain_rows()
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}  copy bandwidth {copy / 1e9:.0f} GB/s")
    print(f"{'shape':13} {'variant':12} {'us':>9} {'GB/s':>7} {'of copy':>8}")
    for r in rows:
        print(f"{r['shape']:13} {r['variant']:12} {r['us']:9.1f} {r['GB/s']:7.0f} {r['GB/s'] * 1e9 / copy:8.0%}")
    sweep = batch_sweep_rows()
    print(f"{'shape':8} {'M':>5} {'W[N,K] us':>10} {'W^T[K,N] us':>12} {'ratio':>6}")
    for a, b in zip(sweep[::2], sweep[1::2]):
        print(f"{a['shape']:8} {a['M']:5} {a['us']:10.1f} {b['us']:12.1f} {a['us'] / b['us']:6.2f}")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "bench_matmul.json").write_text(json.dumps({"gpu": torch.cuda.get_device_name(),
                                                                 "copy_GBps": copy / 1e9, "rows": rows,
                                                                 "batch_sweep": sweep}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

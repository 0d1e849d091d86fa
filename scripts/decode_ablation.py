"""What each kind of kernel costs inside the batch-1 decode step (W3), by leaving it out (issues 14 and 18).

Kernel timings taken alone, or under torch's profiler in eager steps, do not say what a kernel costs inside the
step's CUDA graph, where programmatic dependent launch overlaps each kernel's start with its predecessor's tail.
This script measures the marginal cost instead: W3 (one sequence at ~1,000 tokens of context, greedy, graphs on)
with every launch of one kind of kernel replaced by no kernel at all, each variant in a fresh process, against the
unchanged engine measured first and last in the same call. The outputs of an ablated step are garbage; only its
time is read. Variants (each a monkeypatch of the one place the model calls that kernel):

    base          the engine as it is
    attention     decode attention (ops.paged_attention) returns q
    rotary_cache  rotary (+ Qwen3's q/k norm) + KV-cache write returns q, k untouched
    norms         every RMSNorm (fused add + norm included) returns its input
    route         the MoE router + top-k returns fixed experts 0..k-1 (weights 1/k)
    experts       the MoE experts (ops.fused_moe) return their input
    silu          silu_and_mul returns the gate half (a strided view, no kernel)
    gemv_all      (not an ablation) every dense linear takes our decode GEMV up to 64 rows, whatever start-up
                  measured against cuBLAS for it alone
    cublas_all    (not an ablation) every dense linear takes the library's product (cuBLAS) at every size
    split_div_D   (not an ablation) every GEMV config's split_k divided by D (at least 1): fewer programs, so
                  the next kernel's programs can become resident beside them and prefetch; split_mul_M: times M
    maxnreg_N     (not an ablation) the decode GEMV compiled with at most N registers a thread (more programs,
                  of it or of the next kernel, fit an SM; spills if too few)
    prefetch_KB   (not an ablation) each GEMV program asks L2 for KB KiB of its weights before its PDL wait
                  (quant_gemv.PREFETCH_BYTES; whole slices at most); prefetch_o_KB: only square weights (the 8B
                  shape's o projection, after the decode attention), the others as they are
    attn_splits_S (not an ablation) the split-KV decode attention's split count capped at S (fewer programs,
                  longer segments, a smaller merge); attn_bn_B_S: its key tiles and shortest segment B keys, at
                  most S splits
    carveout_P    (not an ablation) every Triton kernel prefers P% of the unified L1 / shared memory as shared
                  memory (`set_triton_carveout`), so that neighbouring kernels share one carveout
    nowait_gemv   (not an ablation, a bound) every decode GEMV launch skips its PDL wait (`griddepcontrol.wait`) and
                  only lets its dependents launch: each GEMV overlaps its predecessor as if it did not depend on it.
                  What per-tile dependencies (a GEMV starting on the inputs that are ready) could save at most at
                  the GEMVs' inputs; nowait_all: every PDL kernel of ours skips its wait, so the step is the same
                  kernels streamed back to back with no dependency at all, bounded only by what fits on the SMs
                  (the upper bound of any overlap of these kernels, a persistent dataflow kernel's included).
                  Outputs are garbage and the split-K arrival counters may be left inconsistent (a reduction
                  skipped: the bound is slightly optimistic). A mixture of experts routed on garbage reads
                  outside its weights: measure it as route+nowait_all against route
    mma_BN_BK_W   (not an ablation) every int4 decode GEMV of at most 8 rows on the tensor-core path
                  (GemvConfig.mma) with block_n BN, block_k BK, W warps and `split_k_for`'s slices, whatever the
                  tile table says: the MMA path measured in the step before any sweep writes its rows
    A+B           both variants at once (each applied in turn)
    first_tile_after_wait (not an ablation) the decode GEMV's FMA paths load their first weight tile after the PDL
                  wait instead of before it (quant_gemv.FIRST_TILE_BEFORE_WAIT off: the engine before session 28)
    l2_o          (not an ablation) a kernel that asks L2 for the whole o projection's weight (one
                  `prefetch.global.L2` per 128-byte line) between the qkv GEMV and the rotary + cache write, so
                  that the weight streams in while the latency-bound rotary and decode attention run; l2_o_first:
                  before the qkv GEMV (bf16 weights)

    python scripts/decode_ablation.py --family qwen3-30b-a3b --num-layers 8 --checkpoint /dev/shm/q3-8l \
        --variants base attention rotary_cache norms route experts base

prints, per variant, the GPU time of one decode graph replay (CUDA events; median of --repeats W3 runs), its
difference from the median of the base runs, and that difference per layer in microseconds (with few layers the
host, not the GPU, paces the step loop, so its ms per token is printed beside but not compared); JSON to --out.
With ABLATION_SITE=DIR in the environment the engine is the one installed in DIR (`pip install --target DIR` of
another revision), for before / after comparisons in one call.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

SITE = os.environ.get("ABLATION_SITE")
sys.path.insert(0, SITE or str(Path(__file__).resolve().parents[1]))


def bench_offline():
    """loadtest.bench_offline of the engine measured (installed as asyncengine.loadtest in ABLATION_SITE)."""
    return importlib.import_module("asyncengine.loadtest.bench_offline" if SITE else "loadtest.bench_offline")


def model_folder(args) -> Path:
    """The folder the engine loads: the bf16 checkpoint, or its AWQ copy (group 128) for --quantization awq."""
    return Path(args.checkpoint + "-awq-g128" if args.quantization == "awq" else args.checkpoint)


CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT = 9  # cuda.h's CUfunction_attribute
VARIANTS = ("base", "attention", "rotary_cache", "norms", "route", "experts", "silu", "gemv_all", "cublas_all")


def set_triton_carveout(percent: int) -> None:
    """Every Triton kernel loaded from now on prefers `percent` of the SM's unified L1 / shared memory as shared
    memory (cuFuncSetAttribute's PREFERRED_SHARED_MEMORY_CARVEOUT). Triton sets PREFER_SHARED only for kernels of
    more than 48 KB; an SM runs kernels of different carveouts side by side only after draining, which would cost
    programmatic dependent launch its overlap wherever a kernel of the one kind follows one of the other."""
    import ctypes

    from triton.compiler import compiler

    libcuda = ctypes.CDLL("libcuda.so.1")
    load = compiler.CompiledKernel._init_handles

    def load_with_carveout(self):
        fresh = self.module is None
        load(self)
        if fresh:
            rc = libcuda.cuFuncSetAttribute(ctypes.c_void_p(self.function),
                                            CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT, ctypes.c_int(percent))
            if rc:
                raise RuntimeError(f"cuFuncSetAttribute(PREFERRED_SHARED_MEMORY_CARVEOUT, {percent}) failed: {rc}")

    compiler.CompiledKernel._init_handles = load_with_carveout


def ablate(variant: str) -> None:
    """Replace one kind of kernel by no kernel (see the module docstring). Patched before the engine is built,
    so that the CUDA graphs are captured without it."""
    import torch

    from asyncengine import ops
    from asyncengine.kernels import rotary_cache

    if variant == "attention":
        ops.paged_attention = lambda q, *args, **kwargs: q
    elif variant == "rotary_cache":
        rotary_cache.rotary_and_cache = lambda positions, q, k, *args, **kwargs: (q, k)
    elif variant == "norms":
        ops.rms_norm = lambda x, weight, eps: x
        ops.fused_add_rms_norm = lambda x, residual, weight, eps, fp8_copy=False: (x, residual)
    elif variant == "route":
        fixed: dict = {}

        def route(hidden, gate_weight, top_k, renormalize):
            key = (hidden.shape[0], top_k, hidden.device)
            if key not in fixed:  # made on the first call of a size (a warm-up, before capture)
                ids = torch.arange(top_k, device=hidden.device, dtype=torch.int32).expand(hidden.shape[0], top_k)
                weights = torch.full((hidden.shape[0], top_k), 1.0 / top_k, device=hidden.device)
                fixed[key] = (weights, ids.contiguous())
            return fixed[key]

        ops.route = route
    elif variant == "experts":
        ops.fused_moe = lambda hidden, *args, **kwargs: hidden
    elif variant == "silu":
        ops.silu_and_mul = lambda x, fp8_copy=False: x[:, : x.shape[1] // 2]
    elif variant in ("gemv_all", "cublas_all"):
        rows = 64 if variant == "gemv_all" else 0
        ops.decode_gemv_max_m = lambda *args, **kwargs: rows
    elif variant.startswith("carveout_"):
        set_triton_carveout(int(variant.rsplit("_", 1)[1]))
    elif variant.startswith(("split_div_", "split_mul_")):
        import dataclasses

        from asyncengine.kernels import quant_gemv

        factor, chosen = int(variant.rsplit("_", 1)[1]), quant_gemv.config_for
        scale = (lambda n: max(1, n // factor)) if variant.startswith("split_div_") else (lambda n: n * factor)

        def other_slices(*args, **kwargs):
            config = chosen(*args, **kwargs)
            return dataclasses.replace(config, split_k=scale(config.split_k))

        quant_gemv.config_for = other_slices
    elif variant.startswith("mma_"):  # mma_BN_BK_W: every int4 GEMV of at most 8 rows on the MMA path
        from asyncengine.kernels import quant_gemv

        block_n, block_k, warps = (int(v) for v in variant.split("_")[1:4])
        table = quant_gemv.config_for

        def on_the_mma(fmt, m, n, k, num_sms, gpu=""):
            if fmt != "int4" or m > quant_gemv.MMA_MAX_M:
                return table(fmt, m, n, k, num_sms, gpu)
            split = quant_gemv.split_k_for(n, k, block_n, block_k, num_sms)
            return quant_gemv.GemvConfig(block_n, block_k, split, warps, mma=True)

        quant_gemv.config_for = on_the_mma
    elif variant.startswith("attn_splits_"):  # the split-KV decode's split count capped at S
        from asyncengine.kernels import attention

        cap, chosen = int(variant.rsplit("_", 1)[1]), attention.decode_num_splits
        attention.decode_num_splits = lambda *args: min(cap, chosen(*args))
    elif variant.startswith("attn_bn_"):  # attn_bn_B_S: key tiles (and shortest segment) of B, at most S splits
        from asyncengine.kernels import attention

        block_n, max_splits = (int(v) for v in variant.split("_")[2:4])
        attention.DECODE_BLOCK_N = attention.DECODE_MIN_SEGMENT = block_n
        attention.DECODE_MAX_SPLITS = max_splits
        attention.DECODE_PROGRAMS_PER_SM = 8  # so that S, not the SM count, bounds the splits
    elif variant == "first_tile_after_wait":
        from asyncengine.kernels import quant_gemv

        quant_gemv.FIRST_TILE_BEFORE_WAIT = False
    elif variant in ("nowait_gemv", "nowait_all"):
        _skip_pdl_waits(everywhere=variant == "nowait_all")
    elif variant in ("l2_o", "l2_o_first"):
        _prefetch_o_weights(before_qkv=variant == "l2_o_first")
    elif variant.startswith("maxnreg_"):
        from asyncengine.kernels import quant_gemv

        quant_gemv._gemv_kernel = _WithMaxRegisters(quant_gemv._gemv_kernel, int(variant.rsplit("_", 1)[1]))
    elif variant.startswith("prefetch_"):
        from asyncengine.kernels import quant_gemv

        square_only = variant.startswith("prefetch_o_")
        budget = int(variant.rsplit("_", 1)[1]) * 1024
        prefetch_shape = quant_gemv._prefetch_shape

        def shaped(weight, int4, block_n, k_per_split):
            kept = quant_gemv.PREFETCH_BYTES
            if not square_only or weight.shape[0] == weight.shape[1]:
                quant_gemv.PREFETCH_BYTES = budget
            try:
                return prefetch_shape(weight, int4, block_n, k_per_split)
            finally:
                quant_gemv.PREFETCH_BYTES = kept

        quant_gemv._prefetch_shape = shaped
    elif variant != "base":
        raise SystemExit(f"unknown variant {variant!r}; known: {', '.join(VARIANTS)}, prefetch_KB, prefetch_o_KB, "
                         "maxnreg_N, split_div_D, split_mul_M, attn_splits_S, attn_bn_B_S, mma_BN_BK_W, l2_o, "
                         "l2_o_first, nowait_gemv, nowait_all, first_tile_after_wait")


def _skip_pdl_waits(everywhere: bool) -> None:
    """Rebind the PDL wait helpers (kernels/pdl.py) that our kernels call to ones that only let their dependents
    launch: in the decode GEMV's module, or in every kernel module (everywhere). Done before any kernel compiles
    (Triton resolves a jit function's callees from its module's globals when it first compiles it)."""
    import importlib

    import triton
    import triton.language as tl

    @triton.jit
    def launch_only(USE_PDL: tl.constexpr):
        if USE_PDL:
            tl.extra.cuda.gdc_launch_dependents()

    @triton.jit
    def launch_only_early(USE_PDL: tl.constexpr, EARLY: tl.constexpr):
        if USE_PDL:
            tl.extra.cuda.gdc_launch_dependents()

    names = ["quant_gemv"]
    if everywhere:
        names += ["activation", "attention", "cache", "fp8_gemm", "moe", "norm", "quant_fp8", "rotary", "rotary_cache"]
    for name in names:
        module = importlib.import_module(f"asyncengine.kernels.{name}")
        if hasattr(module, "wait_for_prior_grids"):
            module.wait_for_prior_grids = launch_only
        if hasattr(module, "wait_for_prior_grids_early"):
            module.wait_for_prior_grids_early = launch_only_early


def _prefetch_o_weights(before_qkv: bool) -> None:
    """Patch the model's attention block to launch `_l2_prefetch_kernel` over its o projection's weight."""
    import torch
    import triton
    import triton.language as tl

    from asyncengine.kernels import pdl
    from asyncengine.models import llama

    @triton.jit
    def _l2_prefetch_kernel(ptr, n_lines, LINES: tl.constexpr, USE_PDL: tl.constexpr):
        # rule 3 (kernels/pdl.py): the next kernel may launch now (this one writes nothing); the wait at the end
        # keeps the chain (this kernel cannot complete before its predecessor has)
        if USE_PDL:
            tl.extra.cuda.gdc_launch_dependents()
        lines = tl.program_id(0) * LINES + tl.arange(0, LINES)
        base = ptr.to(tl.pointer_type(tl.int8), bitcast=True)
        addresses = (base + tl.where(lines < n_lines, lines, 0).to(tl.int64) * 128).to(tl.int64, bitcast=True)
        tl.inline_asm_elementwise("prefetch.global.L2 [$1]; // $0 unused", "=r,l", [addresses], dtype=tl.int32,
                                  is_pure=False, pack=1)
        if USE_PDL:
            tl.extra.cuda.gdc_wait()

    def prefetch(weight: torch.Tensor) -> None:
        n_lines = triton.cdiv(weight.numel() * weight.element_size(), 128)
        use_pdl = pdl.enabled(weight.device)
        _l2_prefetch_kernel[(triton.cdiv(n_lines, 2048),)](weight, n_lines, LINES=2048, USE_PDL=use_pdl,
                                                           num_warps=4, launch_pdl=use_pdl)

    def forward(self, positions, hidden_states, kv_cache, metadata):
        if before_qkv:
            prefetch(self.o_proj.weight)
        qkv = self.qkv_proj(hidden_states)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if not before_qkv:
            prefetch(self.o_proj.weight)
        out = self.attn(q, k, v, kv_cache, metadata, rotary=(positions, self.rotary_emb), qk_norm=self.qk_norm())
        return self.o_proj(out)

    llama.Attention.forward = forward


class _WithMaxRegisters:
    """A Triton kernel whose launches pass maxnreg (ptxas's register cap per thread): `kernel[grid](...)` as usual."""

    def __init__(self, kernel, registers: int):
        self.kernel, self.registers = kernel, registers

    def __getitem__(self, grid):
        launch = self.kernel[grid]
        return lambda *args, **kwargs: launch(*args, maxnreg=self.registers, **kwargs)


def child(args) -> dict:
    """One variant in this process: build the engine, warm up, then --repeats W3 measurements."""
    import torch

    from asyncengine import LLM

    bo = bench_offline()
    for part in args.child.split("+"):  # "route+nowait_all": both
        ablate(part)
    config = json.loads((model_folder(args) / "config.json").read_text())
    vocab = config["vocab_size"]
    quant = {"quantization": args.quantization} if args.quantization == "fp8" else {}  # AWQ: from its config
    llm = LLM(str(model_folder(args)), dtype="bfloat16", max_model_len=4096, max_num_seqs=8, gpu_memory_utilization=0.9,
              **quant)
    bo.run_engine(llm, *bo.sharegpt_like(8, 200, 16, seed=8, vocab=vocab))  # warm-up: compile the shapes
    runs = [bo.batch1_decode_ms(llm, vocab, 1000, args.new_tokens) for _ in range(args.repeats)]
    gemv_rows = {name.split(".")[-1]: getattr(module, "gemv_max_m", None)
                 for name, module in llm.engine.runner.model.named_modules() if ".layers.0." in f".{name}" and
                 name.endswith("_proj")}
    return {"variant": args.child, "ms_per_token": [r["ms_per_token"] for r in runs],
            "graph_replay_gpu_ms": [r["graph_replay_gpu_ms"] for r in runs],
            "layers": config["num_hidden_layers"], "device": torch.cuda.get_device_name(), "site": SITE,
            "quantization": args.quantization, "gemv_max_m_layer0": gemv_rows}


def build(args) -> None:
    bo = bench_offline()
    folder = Path(args.checkpoint)
    if args.family == "llama3-8b":
        bo.build_checkpoint(folder, args.num_layers)
    else:
        cfg = dict(bo.QWEN3_30B_A3B, num_hidden_layers=args.num_layers)
        bo.build_moe_checkpoint(folder, cfg, "cuda")
    if args.quantization == "awq":  # the linears quantized on the GPU (RTN, group 128), as bench_offline --quant does
        quant = importlib.import_module("asyncengine.loadtest.bench_quant" if SITE else "loadtest.bench_quant")
        quant.build_awq_checkpoint(folder, model_folder(args), 128, "cuda")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--family", choices=["llama3-8b", "qwen3-30b-a3b"], default="qwen3-30b-a3b")
    parser.add_argument("--num-layers", type=int, default=8)
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--variants", nargs="+", default=["base", "attention", "rotary_cache", "norms", "base"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=200)
    parser.add_argument("--quantization", choices=["fp8", "awq"], default=None,
                        help="fp8: --quantization fp8 on the bf16 checkpoint; awq: its AWQ int4 copy (built once)")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print("RESULT " + json.dumps(child(args)), flush=True)
        return 0
    t0 = time.perf_counter()
    build(args)
    print(f"checkpoint ready in {time.perf_counter() - t0:.0f} s", flush=True)
    rows = []
    for variant in args.variants:
        cmd = [sys.executable, __file__, "--family", args.family, "--num-layers", str(args.num_layers),
               "--checkpoint", args.checkpoint, "--repeats", str(args.repeats), "--new-tokens", str(args.new_tokens),
               "--child", variant, *(["--quantization", args.quantization] if args.quantization else [])]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
        if proc.returncode or not lines:
            print(f"{variant}: failed (rc {proc.returncode})\n{proc.stderr[-3000:]}", flush=True)
            continue
        rows.append(json.loads(lines[-1][len("RESULT "):]))
        print(f"{variant}: {rows[-1]['ms_per_token']} ms/token, our GEMV up to M = "
              f"{rows[-1]['gemv_max_m_layer0']}", flush=True)
    base = [statistics.median(r["graph_replay_gpu_ms"]) for r in rows if r["variant"] == "base"]
    base_ms = statistics.median(base) if base else float("nan")
    tag = ("_" + Path(SITE).name if SITE else "") + (f"_{args.quantization}" if args.quantization else "")
    out = Path(args.out) / f"decode_ablation_{args.family}_{args.num_layers}l{tag}.json"
    out.write_text(json.dumps({"family": args.family, "site": SITE, "rows": rows, "base_ms": base_ms}, indent=2))
    device = rows[0]["device"] if rows else "?"
    print(f"\n{device}, {args.family} shape{', ' + args.quantization if args.quantization else ''}, "
          f"{args.num_layers} layers, W3 (1,000 context), engine "
          f"{SITE or 'this tree'}; graph replay GPU ms, median of {args.repeats}")
    print(f"{'variant':14} {'replay ms':>9} {'saved ms':>9} {'us/layer':>9} {'ms/token':>9}")
    for r in rows:
        ms = statistics.median(r["graph_replay_gpu_ms"])
        saved = base_ms - ms
        print(f"{r['variant']:14} {ms:9.4f} {saved:9.4f} {1e3 * saved / r['layers']:9.2f} "
              f"{statistics.median(r['ms_per_token']):9.3f}")
    print(f"base runs: {', '.join(f'{b:.4f}' for b in base)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

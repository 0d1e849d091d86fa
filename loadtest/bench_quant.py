"""Quantized formats in the offline benchmark (issue 14): `python -m loadtest.bench_offline --quant [--quick]`.

On the Llama-3-8B-shape checkpoint of bench_offline (random bf16 weights), in one run and on one GPU:
  W3 per format: batch-1 decode ms/token at 1,000 tokens of context for bf16, FP8 (`quantization="fp8"`: the
     bf16 weights quantized per channel on the GPU at load time), FP8 block-wise (the same weights quantized per
     128 x 128 block on the GPU, written as Qwen3-*-FP8 checkpoints are) and AWQ int4 group 128 (quantized on the
     GPU by round-to-nearest and written in AutoAWQ's gemm layout), each with its roofline: the bytes one
     decode step reads (every weight the layers and LM head multiply by, in its stored format with scales and zero
     points, plus 1,100 tokens of bf16 KV) at the measured copy bandwidth.
  W1 FP8 against bf16: requests/s of the ShareGPT-like workload, same prompts.
`--tiny` runs the same on the embedded default model on CPU (a smoke run: the numbers mean nothing there).
"""

from __future__ import annotations

import gc
import json
import shutil
import time
from pathlib import Path

import torch

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
AWQ_ORDER = [0, 4, 1, 5, 2, 6, 3, 7]  # as asyncengine.quantization.awq: the slot of logical column i of a word


def _quantized_copy(src: Path, dst: Path, device: str, quantize_linear, quantization_config: dict) -> Path:
    """dst: src with each decoder linear's weight replaced by quantize_linear(weight on `device`) -> {suffix: tensor}
    (tensors named prefix + suffix), and `quantization_config` in config.json. Kept if dst already holds one."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    if (dst / "config.json").exists():
        return dst
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and not f.name.endswith((".safetensors", ".safetensors.index.json")):
            shutil.copy(f, dst / f.name)
    tensors = {}
    for path in sorted(src.glob("*.safetensors")):
        with safe_open(str(path), framework="pt", device=device) as f:
            for name in f.keys():
                w = f.get_tensor(name)
                if not (name.endswith(".weight") and any(f".{p}." in name for p in LINEARS)):
                    tensors[name] = w.cpu()
                    continue
                prefix = name.removesuffix("weight")
                tensors.update({prefix + suffix: t.cpu() for suffix, t in quantize_linear(w).items()})
    save_file(tensors, str(dst / "model.safetensors"))
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = quantization_config
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return dst


def build_awq_checkpoint(src: Path, dst: Path, group_size: int, device: str) -> Path:
    """src's linear weights quantized (RTN, asymmetric, `group_size`) on `device`, saved in AutoAWQ's gemm layout."""
    from asyncengine.kernels.quant_reference import pack_int32, quantize_int_weight, unpack_int32

    def quantize(w):
        qweight, scales, zeros = quantize_int_weight(w.t(), group_size, 4)  # packed along K: [K/8, N]
        q = unpack_int32(qweight, 4, dim=0)  # [K, N]
        return {"qweight": pack_int32(q, 4, dim=1, order=AWQ_ORDER),
                "qzeros": pack_int32(zeros.to(torch.int32), 4, dim=1, order=AWQ_ORDER), "scales": scales.half()}

    return _quantized_copy(src, dst, device, quantize, {"quant_method": "awq", "bits": 4, "group_size": group_size,
                                                        "zero_point": True, "version": "gemm"})


def build_fp8_block_checkpoint(src: Path, dst: Path, block: tuple[int, int], device: str) -> Path:
    """src's linear weights quantized to e4m3 per [bn, bk] block (amax / 448) on `device`, saved as block-wise
    checkpoints are published (quant_method fp8, weight_block_size, weight_scale_inv; Qwen3-*-FP8's layout)."""
    from asyncengine.kernels.quant_reference import FP8_DTYPE, FP8_MAX

    bn, bk = block

    def quantize(w):
        n, k = w.shape
        padded = torch.zeros(-(-n // bn) * bn, -(-k // bk) * bk, device=w.device, dtype=torch.float32)
        padded[:n, :k] = w.float()
        blocks = padded.view(padded.shape[0] // bn, bn, padded.shape[1] // bk, bk)
        scales = (blocks.abs().amax(dim=(1, 3)) / FP8_MAX).clamp(min=1e-12)  # [N / bn, K / bk]
        w8 = (blocks / scales[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).view_as(padded)[:n, :k].to(FP8_DTYPE)
        return {"weight": w8.contiguous(), "weight_scale_inv": scales}

    return _quantized_copy(src, dst, device, quantize, {"quant_method": "fp8", "activation_scheme": "dynamic",
                                                        "weight_block_size": [bn, bk]})


def step_bytes(llm, context: int = 1100) -> int:
    """Bytes one batch-1 decode step reads: every parameter but the embedding table (quantized layers in their
    stored form) plus `context` tokens of KV."""
    model = llm.engine.runner.model
    weights = sum(p.numel() * p.element_size() for name, p in model.named_parameters() if "embed" not in name)
    if model.lm_head is None:  # tied: the LM head reads the embedding table
        weights += model.embed_tokens.weight.numel() * model.embed_tokens.weight.element_size()
    mc = llm.engine.model_config
    return weights + context * mc.kv_bytes_per_token(mc.dtype)


def cpu_decode_ms(llm, vocab: int, context: int = 200, new_tokens: int = 32) -> dict:
    """batch1_decode_ms without CUDA events (the tiny CPU run): median ms between decode steps."""
    import numpy as np

    from asyncengine import SamplingParams

    prompt = np.random.default_rng(3).integers(3, vocab, size=context).tolist()
    llm.engine.add_request("w3", prompt, SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True))
    stamps = [time.perf_counter() for _ in llm.engine.run_pipelined(llm._device_thread)]
    return {"ms_per_token": float(np.median(np.diff(stamps[2:])) * 1e3), "graph_replay_gpu_ms": float("nan")}


def _free_gpu_memory() -> None:
    """After the caller dropped its last reference to an engine: collect it and give its memory back."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def run_quant(folders: dict[str, tuple[Path, dict]], engine_kwargs: dict, w1, vocab: int, bandwidth: float | None,
              results: dict, save) -> None:
    """For each format: W3 ms/token and its roofline, and W1 req/s. folders: name -> (checkpoint,
    extra LLM arguments)."""
    from asyncengine import LLM

    from .bench_offline import batch1_decode_ms, run_engine

    for fmt, (folder, extra) in folders.items():
        t0 = time.perf_counter()
        llm = LLM(str(folder), **engine_kwargs, **extra)
        res = {"engine_init_s": time.perf_counter() - t0, "kv_blocks": llm.engine.runner.num_blocks}
        run_engine(llm, *(p[:8] for p in w1))  # warm-up of the timed shapes
        w3 = batch1_decode_ms(llm, vocab) if torch.cuda.is_available() else cpu_decode_ms(llm, vocab)
        res.update(W3_ms_per_token=w3["ms_per_token"], W3_graph_replay_gpu_ms=w3["graph_replay_gpu_ms"],
                   W3_bytes_per_step=step_bytes(llm))
        if bandwidth:
            res["W3_roofline_ms"] = res["W3_bytes_per_step"] / bandwidth * 1e3
        res["decode_kernels"] = decode_kernel_choices(llm)
        res["W1"] = run_engine(llm, *w1)
        results.setdefault("quant", {})[fmt] = res
        save()
        llm.close()
        del llm  # the caller's reference: a helper's `del` of its argument freed nothing (the FP8 engine ran OOM)
        _free_gpu_memory()
    print_quant(results)


def decode_kernel_choices(llm) -> dict[str, str]:
    """Per distinct linear shape (out x in) of the decoder, which product a decode batch runs: our GEMV up to the
    batch size measured at start-up (gemv_max_m; 0: the library's product at every size), for FP8 then our W8A8
    GEMM up to gemm_max_m, or the int4 GEMV."""
    from asyncengine.models.layers import LinearBase

    choices = {}
    for module in llm.engine.runner.model.modules():
        if isinstance(module, LinearBase):
            shape = f"{module.out_per_rank}x{module.in_per_rank}"
            if next(module.parameters()).device.type == "cpu":
                choices[shape] = "CPU: torch (references for the quantized formats)"
            elif hasattr(module, "qweight"):
                choices[shape] = "int4 GEMV for M <= 64"
            elif getattr(module, "group_size", None):  # FP8 with block-wise (group) scales
                choices[shape] = f"our GEMV up to M={module.gemv_max_m}, dequantize + library above"
            elif hasattr(module, "gemm_max_m"):
                choices[shape] = (f"our GEMV up to M={module.gemv_max_m}, our W8A8 GEMM up to M={module.gemm_max_m}, "
                                  "library above")
            else:
                choices[shape] = f"our GEMV up to M={getattr(module, 'gemv_max_m', 0)}, library above"
    return choices


def print_quant(results: dict) -> None:
    q = results["quant"]
    print(f"\n{results.get('gpu', 'cpu')}  {results.get('date', '')}  copy "
          f"{results.get('copy_bandwidth_GBps', float('nan')):.0f} GB/s")
    print(f"{'format':8} {'W3 ms/token':>12} {'graph ms':>9} {'MB/step':>9} {'roofline ms':>12} {'of roofline':>12} "
          f"{'W1 req/s':>9} {'KV blocks':>10}")
    for fmt, r in q.items():
        roof = r.get("W3_roofline_ms")
        w1 = r.get("W1", {}).get("req_per_s")
        print(f"{fmt:8} {r['W3_ms_per_token']:>12.2f} {r['W3_graph_replay_gpu_ms']:>9.2f} "
              f"{r['W3_bytes_per_step'] / 1e6:>9.1f} {roof if roof else float('nan'):>12.2f} "
              f"{(roof / r['W3_ms_per_token']) if roof else float('nan'):>11.0%} "
              f"{w1 if w1 else float('nan'):>9.1f} {r['kv_blocks']:>10}")
    for fmt, r in q.items():
        print(f"{fmt} decode kernels: " + "; ".join(f"{shape}: {c}" for shape, c in r.get("decode_kernels", {}).items()))
    if "W1" in q.get("bf16", {}) and "W1" in q.get("fp8", {}):
        ratio = q["fp8"]["W1"]["req_per_s"] / q["bf16"]["W1"]["req_per_s"]
        results["W1_fp8_vs_bf16"] = ratio
        print(f"W1 fp8 / bf16 requests/s: {ratio:.2f}x (target >= 1.3x)")


def main_gpu(args, results: dict, save) -> int:
    from .bench_offline import LLAMA3_8B, build_checkpoint, measure_copy_bandwidth, w1_workload

    results["copy_bandwidth_GBps"] = measure_copy_bandwidth() / 1e9
    folder = build_checkpoint(Path(args.checkpoint))
    wanted = args.quant_formats or ["bf16", "fp8", "fp8-block", "awq"]
    folders = {"bf16": (folder, {}), "fp8": (folder, {"quantization": "fp8"})}
    if "fp8-block" in wanted:
        t0 = time.perf_counter()
        folders["fp8-block"] = (build_fp8_block_checkpoint(folder, Path(str(args.checkpoint) + "-fp8-block128"),
                                                           (128, 128), "cuda"), {})
        results["build_fp8_block_checkpoint_s"] = time.perf_counter() - t0
    if "awq" in wanted:
        t0 = time.perf_counter()
        folders["awq"] = (build_awq_checkpoint(folder, Path(str(args.checkpoint) + "-awq-g128"), 128, "cuda"), {})
        results["build_awq_checkpoint_s"] = time.perf_counter() - t0
    folders = {name: f for name, f in folders.items() if name in wanted}
    vocab = LLAMA3_8B["vocab_size"]
    engine_kwargs = dict(dtype="bfloat16", max_model_len=4096, max_num_seqs=args.max_num_seqs,
                         max_num_batched_tokens=args.max_num_batched_tokens, gpu_memory_utilization=0.90)
    run_quant(folders, engine_kwargs, w1_workload(200 if args.quick else 1000, vocab), vocab,
              results["copy_bandwidth_GBps"] * 1e9, results, save)
    return 0


def main_tiny(out_dir: Path) -> int:
    """The same on the embedded default model on CPU (AWQ group 64: its intermediate size 704 is not a multiple
    of 128)."""
    from asyncengine.config import default_model_path

    from .bench_offline import sharegpt_like

    out_dir.mkdir(parents=True, exist_ok=True)
    results: dict = {"gpu": "cpu (tiny smoke run)", "date": time.strftime("%Y-%m-%d")}

    def save():
        (out_dir / "bench_quant_tiny.json").write_text(json.dumps(results, indent=2))

    src = Path(default_model_path())
    awq = build_awq_checkpoint(src, out_dir / "default-awq-g64", 64, "cpu")
    fp8_block = build_fp8_block_checkpoint(src, out_dir / "default-fp8-block64", (64, 64), "cpu")
    folders = {"bf16": (src, {}), "fp8": (src, {"quantization": "fp8"}), "fp8-block": (fp8_block, {}), "awq": (awq, {})}
    w1 = sharegpt_like(16, 20, 16, seed=1, vocab=8192)
    run_quant(folders, dict(max_model_len=2048, max_num_seqs=16), w1, 8192, None, results, save)
    return 0

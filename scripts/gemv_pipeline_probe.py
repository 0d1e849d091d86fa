"""Does Triton's own software pipelining help the decode GEMV's FMA path at M = 1 (issue 14)?

For each 8B shape and format (int4 group 128, FP8 e4m3 per-channel, bf16), the tuned config of the table
(`quant_gemv.config_for`) is timed as it is and with `loop_stages` S = 2, 3, 4 (the K loop as
`tl.range(..., num_stages=S)`), and each of those with the split count halved and doubled; the same CUDA-graph
timing over weight copies that defeat L2 as the sweep (`loadtest.bench_gemv`). Every variant is checked against
the torch reference (relative error of y). Each compiled kernel's PTX is read for `cp.async` (the pipeliner's
copies into shared memory), its registers and its shared memory, so a variant that compiled to the plain loop
shows as such.

    python scripts/gemv_pipeline_probe.py [--formats int4,fp8,bf16] [--out DIR]

Prints a table per format; JSON to --out.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def compiled_facts(kernel) -> dict:
    """cp.async count, registers and shared bytes of the most recently compiled specialisation of a Triton
    kernel (the one the last call used, since every variant here compiles anew)."""
    facts = {}
    for cache in getattr(kernel, "device_caches", {}).values():
        compiled = list(cache[0].values())
        if compiled:
            last = compiled[-1]
            ptx = last.asm.get("ptx", "")
            facts = {"cp_async": ptx.count("cp.async.ca") + ptx.count("cp.async.cg"),
                     "regs": getattr(last, "n_regs", None), "spills": getattr(last, "n_spills", None),
                     "shared": last.metadata.shared}
    return facts


def variants(base):
    """The tuned config, then loop_stages 2-4 at its split, and 3 at half and twice it."""
    out = [base]
    for stages in (2, 3, 4):
        splits = {base.split_k, max(1, base.split_k // 2), base.split_k * 2} if stages == 3 else {base.split_k}
        for split in sorted(splits):
            if base.load_ahead:
                config = dataclasses.replace(base, load_ahead=False, split_k=split, loop_stages=stages)
            else:
                config = dataclasses.replace(base, split_k=split, loop_stages=stages)
            out.append(config)
    return out


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--formats", default="int4,fp8,bf16")
    parser.add_argument("--out", default="")
    parser.add_argument("--jobs", type=int, default=12)
    args = parser.parse_args()
    from asyncengine.kernels import device_name, quant_gemv
    from loadtest.bench_gemv import SHAPES, Case, Group, copies_for, precompile, time_per_call_us

    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    gpu = device_name(0)
    print(f"device: {torch.cuda.get_device_name()}  {num_sms} SMs")
    rows = []
    work = []
    for fmt in args.formats.split(","):
        for name, (k, n) in SHAPES.items():
            if name != "lm_head":
                work.append((Group(fmt, name, k, n, 1), variants(quant_gemv.config_for(fmt, 1, n, k, num_sms, gpu))))
    failed = precompile(work, args.jobs)  # into Triton's on-disk cache, in parallel processes
    print(f"{len(failed)} kernels failed to compile or run", flush=True)
    for fmt in args.formats.split(","):
        for name, (k, n) in SHAPES.items():
            if name == "lm_head":
                continue
            group = Group(fmt, name, k, n, 1)
            case = Case(group, "cuda", copies_for(group))
            ref = case.reference().float()
            base = quant_gemv.config_for(fmt, 1, n, k, num_sms, gpu)
            for config in variants(base):
                try:
                    call = case.ours(config)
                    out = call(case.weights[0]).float()
                    torch.cuda.synchronize()
                    facts = compiled_facts(quant_gemv._gemv_kernel)
                    error = ((out - ref).norm() / ref.norm()).item()
                    us = time_per_call_us(call, case.weights, "cuda")
                except Exception as exc:  # a variant that does not fit (shared memory): reported
                    print(f"{fmt:5} {name:8} {config}: {type(exc).__name__}: {str(exc)[:120]}")
                    continue
                row = {"fmt": fmt, "shape": name, "us": us, "gbps": case.bytes / us / 1e3, "error": error,
                       "config": str(config), "loop_stages": config.loop_stages, "split_k": config.split_k,
                       **facts}
                rows.append(row)
                print(f"{fmt:5} {name:8} stages {config.loop_stages} split {config.split_k:3}: {us:7.2f} us "
                      f"{row['gbps']:6.0f} GB/s  err {error:.1e}  cp.async {facts.get('cp_async')} regs "
                      f"{facts.get('regs')} spills {facts.get('spills')} smem {facts.get('shared')}", flush=True)
    print("\nbest per (format, shape): tuned row -> best pipelined")
    for fmt in args.formats.split(","):
        for name in SHAPES:
            cell = [r for r in rows if r["fmt"] == fmt and r["shape"] == name]
            if not cell:
                continue
            tuned = cell[0]
            best = min((r for r in cell if r["loop_stages"] and r["error"] < 1e-2), key=lambda r: r["us"],
                       default=None)
            if best:
                print(f"{fmt:5} {name:8} {tuned['us']:7.2f} -> {best['us']:7.2f} us ({tuned['us'] / best['us']:.2f}x)"
                      f"  stages {best['loop_stages']} split {best['split_k']}")
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "gemv_pipeline_probe.json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

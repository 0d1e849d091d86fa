"""Instructions per weight in the decode GEMV's K loop, read from its sm_90 machine code, without a GPU (issue 14).

The batch-1 decode GEMVs of int4 and FP8 spend about as long issuing instructions as streaming bytes (RESULTS.md
runs 82 and 131), so what one loop step costs in instructions is a number worth knowing before a GPU run. This
script compiles `quant_gemv._gemv_kernel` ahead of time for sm_90 (Triton's own ptxas and nvdisasm; the same
constexprs `quant_gemv._launch` passes for M = 1 and PDL, pointers and sizes specialised as multiples of 16 as
at the 8B shapes) for each M = 1 row of the tile table at the Llama-3-8B shapes, finds the K loop (the largest
block that branches back), and prints its SASS instructions per weight (one loop step covers BLOCK_K x BLOCK_N
weights over 32 x num_warps threads), by kind. Issue rate, not time: a GPU run still decides.

    python scripts/gemv_sass.py [--formats int4,fp8,bf16] [--keep DIR] [--int4-load-ahead] [--int4-mma N,K,WARPS]

--int4-mma compiles the int4 rows as GemvConfig.mma (`quant_gemv._int4_mma_kernel`, M = 1) with block_n N,
block_k K and WARPS warps instead (N = 32 or 64 x WARPS), the tensor-core path the table may not take yet.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SHAPES_8B = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
KINDS = {  # SASS opcode -> what it does here
    "LDG": "global loads", "LDS": "shared loads", "LDC": "constants",
    "HFMA2": "half math", "HADD2": "half math", "HMUL2": "half math",
    "FFMA": "float math", "FADD": "float math", "FMUL": "float math",
    "LOP3": "integer / bits", "SHF": "integer / bits", "PRMT": "integer / bits", "IMAD": "integer / bits",
    "IADD3": "integer / bits", "LEA": "integer / bits", "VIADD": "integer / bits", "ISETP": "integer / bits",
    "MOV": "integer / bits", "CS2R": "integer / bits", "SEL": "integer / bits",
    "F2F": "conversions", "I2F": "conversions", "F2I": "conversions", "I2FP": "conversions", "F2FP": "conversions",
}


def constexprs(fmt: str, config, k: int, n: int) -> dict:
    """What quant_gemv._launch passes at M = 1 under PDL for this format and tuned config (bf16 x, aligned).
    Written out again here, since _launch computes them from tensors: a new constexpr of the kernel must be added
    to both (Triton's compile fails on a missing one, so a drift shows as an error, not a wrong count)."""
    from asyncengine.kernels import quant_gemv

    int4 = fmt == "int4"
    fit = quant_gemv._fit(config, k, 128 if int4 else None)
    weight_bytes = {"int4": 4, "fp8": 1, "bf16": 2}[fmt]
    fake = type("W", (), {"element_size": lambda self: weight_bytes})()
    rows, lines, step = quant_gemv._prefetch_shape(fake, int4, config.block_n, fit.k_per_split)
    vec = 8 if int4 else (4 if config.fp8_words else min(16 // weight_bytes, fit.block_k))
    return dict(INT4=int4, HAS_SCALE=fmt != "bf16", HAS_BIAS=False, PARTIAL=fit.split_k > 1, USE_DOT=False,
                DOT_FP32=False, X_HALF=True, X_FP16=False, ASM=True, X_BF16_PAIRS=True, SLOT_DOT=False,
                HALF_FMA=int4 and config.half_fma, REDUCE_CHUNK=quant_gemv._reduce_chunk(1, config),
                FP8_WORDS=config.fp8_words, LOAD_AHEAD=config.load_ahead, E4M3_PTX=config.fp8_words, BLOCK_M=1,
                BLOCK_N=config.block_n, BLOCK_K=fit.block_k, VEC=vec, USE_PDL=True, INT4_FMA=int4,
                EARLY_TILE=quant_gemv.FIRST_TILE_BEFORE_WAIT, PF_ROWS=rows, PF_LINES=lines, PF_STEP=step,
                GROUP_SCALE=False, group_size=128 if int4 else 1)


def mma_constexprs(config, k: int) -> dict:
    """What quant_gemv._launch_mma passes at M = 1 under PDL (bf16 x, group 128)."""
    from asyncengine.kernels import quant_gemv

    fake = type("W", (), {"element_size": lambda self: 4})()
    return quant_gemv.mma_constexprs(fake, quant_gemv._fit(config, k, 128), 1, 128, False, True)


def sass_of(fmt: str, constants: dict, num_warps: int, keep: Path | None, name: str) -> str:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from asyncengine.kernels import quant_gemv

    fn = quant_gemv._int4_mma_kernel if "COLS" in constants else quant_gemv._gemv_kernel
    weight = {"int4": "*i32", "fp8": "*fp8e4nv", "bf16": "*bf16"}[fmt]
    types = dict(partial_ptr="*fp32", counter_ptr="*i32", w_ptr=weight, scale_ptr="*bf16" if fmt == "int4" else
                 "*fp32", zero_ptr="*bf16")
    signature = {a: "constexpr" if a in constants else types.get(a, "*bf16" if a.endswith("_ptr") else "i32")
                 for a in fn.arg_names}
    divisible = ("out_ptr", "partial_ptr", "counter_ptr", "x_ptr", "w_ptr", "scale_ptr", "zero_ptr", "bias_ptr", "N",
                 "K", "stride_xm", "stride_wn", "k_per_split")
    attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in divisible if a in fn.arg_names}
    kernel = triton.compile(ASTSource(fn, signature, constants, attrs), target=GPUTarget("cuda", 90, 32),
                            options=dict(num_warps=num_warps))
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(kernel.asm["cubin"])
        cubin.flush()
        nvdisasm = Path(triton.__file__).parent / "backends/nvidia/bin/nvdisasm"
        sass = subprocess.run([str(nvdisasm), "-c", cubin.name], capture_output=True, text=True, check=True).stdout
    if keep:
        (keep / f"{name}.sass").write_text(sass)
    return sass


def k_loop(sass: str) -> list[str]:
    """The instructions of the largest block of code that branches back to its start (the K loop's steady state)."""
    address_of, instructions, pending = {}, [], []
    for line in sass.splitlines():
        label = re.match(r"^\s*\.(L_x_\d+):", line)
        if label:
            pending.append(label.group(1))
            continue
        found = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", line)
        if found:
            address = int(found.group(1), 16)
            for name in pending:
                address_of[name] = address
            pending = []
            instructions.append((address, found.group(2)))
    loops = []
    for address, text in instructions:
        target = re.search(r"BRA\s+`?\(?\.?(L_x_\d+)", text)
        if target and address_of.get(target.group(1), address) < address:
            start = address_of[target.group(1)]
            loops.append([t for a, t in instructions if start <= a <= address])
    return max(loops, key=len) if loops else []


def opcode(text: str) -> str:
    words = text.split()
    word = words[1] if words[0].startswith("@") else words[0]
    return word.split(".")[0]


def per_weight_by_kind(body: list[str], weights: int, kinds: list[str]) -> str:
    """A loop's instructions per weight for each kind (KINDS' values, then "other"), as table columns."""
    counts = collections.Counter(KINDS.get(opcode(t), "other") for t in body)
    return "  ".join(f"{counts[kind] / weights:{len(kind)}.2f}" for kind in kinds)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--formats", default="int4,fp8,bf16")
    parser.add_argument("--keep", type=Path, help="write each kernel's SASS into this folder")
    parser.add_argument("--int4-mma", metavar="N,K,WARPS",
                        help="compile the int4 rows as GemvConfig.mma with these tiles (module docstring)")
    parser.add_argument("--int4-load-ahead", action="store_true",
                        help="compile the int4 rows with GemvConfig.load_ahead (the next tile and its x loaded a "
                             "step ahead) whatever the table says")
    args = parser.parse_args()
    from asyncengine.kernels import quant_gemv

    if args.keep:
        args.keep.mkdir(parents=True, exist_ok=True)
    kinds = sorted(set(KINDS.values())) + ["other"]
    print(f"{'format':6} {'shape':8} {'tile (n x k, warps)':22} {'loop':>5} {'weights':>7} {'per weight':>10}  "
          + "  ".join(f"{kind}" for kind in kinds))
    for fmt in args.formats.split(","):
        for shape, (n, k) in SHAPES_8B.items():
            config = quant_gemv.config_for(fmt, 1, n, k, 132)
            if fmt == "int4" and args.int4_load_ahead:
                config = dataclasses.replace(config, load_ahead=True)
            if fmt == "int4" and args.int4_mma:
                block_n, block_k, warps = (int(v) for v in args.int4_mma.split(","))
                config = quant_gemv.GemvConfig(block_n, block_k, quant_gemv.split_k_for(n, k, block_n, block_k, 132),
                                               warps, mma=True)
                constants = mma_constexprs(config, k)
            else:
                constants = constexprs(fmt, config, k, n)
            body = k_loop(sass_of(fmt, constants, config.num_warps, args.keep, f"{fmt}_{shape}"))
            weights = constants["BLOCK_K"] * config.block_n // (32 * config.num_warps)
            tile = f"{config.block_n} x {constants['BLOCK_K']}, {config.num_warps}"
            print(f"{fmt:6} {shape:8} {tile:22} {len(body):5} {weights:7} {len(body) / weights:10.2f}  "
                  + per_weight_by_kind(body, weights, kinds))
    return 0


if __name__ == "__main__":
    sys.exit(main())

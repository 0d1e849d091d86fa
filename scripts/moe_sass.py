"""Instructions per weight in the MoE decode kernels' K loop on int4 experts, from their sm_90 machine code,
without a GPU (issues 14 and 18), for this tree or another checkout (`git worktree add /tmp/old REV`):

    python scripts/moe_sass.py [ROOT ...]

Compiles `moe._gate_up_act_kernel` and `moe._down_reduce_kernel` ahead of time for sm_90 (Triton's ptxas and
nvdisasm) as `_fused_moe_decode` launches them on int4 experts (bf16 x, groups of 128) at the Qwen3-30B-A3B expert
shape, batch 1, with the tiles `moe.decode_config` picks (TUNED_INT4's row; an older tree: the bf16 row's, its K tile
doubled at launch), each kernel summing in float32 and in bf16x2; finds each K loop (gemv_sass.k_loop) and prints
its SASS instructions per weight by kind, and ptxas's spill count. Issue rate, not time: a GPU run decides.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

HIDDEN, INTER, TOP_K, GROUP = 2048, 768, 8, 128


def load_moe(root: str):
    """kernels/moe.py of the checkout at root, imported by path under a name of its own."""
    import asyncengine.kernels  # noqa: F401  (the package its relative imports resolve in)

    spec = importlib.util.spec_from_file_location(f"asyncengine.kernels.moe_sass_{abs(hash(root))}",
                                                  f"{root}/kernels/moe.py")  # fmt: skip
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def compile_sass(fn, constants: dict, num_warps: int) -> tuple[str, str]:
    """(SASS, ptxas -v's report) of one kernel for sm_90."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    types = dict(ids_ptr="*i64", weights_ptr="*fp32", partial_ptr="*fp32", counter_ptr="*i32", w13_ptr="*i32",
                 w2_ptr="*i32")
    signature = {a: "constexpr" if a in constants else types.get(a, "*bf16" if a.endswith("_ptr") else "i32")
                 for a in fn.arg_names}
    # pointers and sizes known to be multiples of 16 (as the launch specialises them at this shape): vector loads
    divisible = [i for i, a in enumerate(fn.arg_names) if a not in constants and not a.startswith(("ids", "weights"))]
    attrs = {(i,): [["tt.divisibility", 16]] for i in divisible}
    source = ASTSource(fn, signature, {k: v for k, v in constants.items() if k in fn.arg_names}, attrs)
    kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=num_warps))
    bin_dir = Path(triton.__file__).parent / "backends/nvidia/bin"
    with tempfile.TemporaryDirectory() as tmp:
        cubin, ptx = Path(tmp, "k.cubin"), Path(tmp, "k.ptx")
        cubin.write_bytes(kernel.asm["cubin"])
        ptx.write_text(kernel.asm["ptx"])
        sass = subprocess.run([str(bin_dir / "nvdisasm"), "-c", str(cubin)], capture_output=True, text=True,
                              check=True).stdout
        report = subprocess.run([str(bin_dir / "ptxas"), "-arch=sm_90a", "-v", str(ptx), "-o", f"{tmp}/o.cubin"],
                                capture_output=True, text=True).stderr
    return sass, report


def main() -> int:
    from gemv_sass import KINDS, k_loop, per_weight_by_kind

    roots = sys.argv[1:] or [str(Path(__file__).resolve().parents[1])]
    kinds = sorted(set(KINDS.values())) + ["other"]
    print(f"{'tree':24} {'kernel':12} {'tile':16} {'loop':>5} {'per weight':>10} {'spills':>6}  " + "  ".join(kinds))
    for root in roots:
        moe = load_moe(root)
        tokens = 1
        try:
            config = moe.decode_config(HIDDEN, INTER, TOP_K, tokens, True)
            variants = [(config, False), (config, True)]
        except TypeError:  # an older tree: no int4 argument, the K tile doubled at launch
            config = moe.decode_config(HIDDEN, INTER, TOP_K, tokens)
            variants = [(config, False)]
        for config, half in variants:
            for name, tiles, k_dim in (("gate_up_act", config.gate_up, HIDDEN), ("down_reduce", config.down, INTER)):
                block_k = (moe._int4_block_k(tiles, k_dim) if not hasattr(moe, "_int4_sub_k")
                           else min(tiles.block_k, 1 << (k_dim - 1).bit_length()))
                sub = min(block_k, GROUP)  # constexprs an older tree lacks are dropped by compile_sass
                constants = dict(TOP_K=TOP_K, BLOCK_N=tiles.block_n, BLOCK_K=block_k, LOAD_AHEAD=tiles.load_ahead,
                                 USE_PDL=True, GROUP_SCALE=False, INT4=True, SUB_K=sub, GROUP_SUBS=GROUP // sub,
                                 WHOLE_SUBS=k_dim % sub == 0, ASM=True, X_BF16_PAIRS=True, HALF_FMA=half)
                sass, report = compile_sass(getattr(moe, f"_{name}_kernel"), constants, tiles.num_warps)
                body = k_loop(sass)
                weights = block_k * tiles.block_n * (2 if name == "gate_up_act" else 1) // (32 * tiles.num_warps)
                spills = sum(int(n) for n in re.findall(r"(\d+) bytes spill stores", report))
                tile = f"{tiles.block_n}x{block_k}/{tiles.num_warps}{' bf16x2' * half}"
                print(f"{root[-24:]:24} {name:12} {tile:16} {len(body):5} {len(body) / weights:10.2f} {spills:6}  "
                      + per_weight_by_kind(body, weights, kinds))
    return 0


if __name__ == "__main__":
    sys.exit(main())

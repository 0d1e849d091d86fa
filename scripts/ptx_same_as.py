"""Do this tree's decode kernels compile to the same sm_90 PTX as another revision's? (No GPU needed.)

    git worktree add /tmp/old_tree REV
    python scripts/ptx_same_as.py /tmp/old_tree      # prints, per kernel variant, the two opcode totals and
                                                     # every opcode whose count differs

Compiles the MoE kernels (decode gate_up_act / down_reduce, the grouped GEMM on bf16 and int4 experts) and the
decode GEMV's FP8-words, FP8 tl.dot, int4 float32 tl.dot and int4 FMA paths, each as the engine launches them on unquantized / per-channel weights, from both trees'
source files (imported by path under other names; constexprs the older tree lacks are dropped), and compares the
PTX opcode counts. Session 29 used it to show that adding group scales (GROUP_SCALE=False) left the existing paths'
code unchanged while no GPU could be had.
"""
import collections, re, sys
import importlib.util
import triton
import asyncengine.kernels

def load(path, name):
    spec = importlib.util.spec_from_file_location(f"asyncengine.kernels.{name}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
root = sys.argv[1]
moe = load(f"{root}/kernels/moe.py", "cmp_moe_" + str(abs(hash(sys.argv[1]))))
qg = load(f"{root}/kernels/quant_gemv.py", "cmp_quant_gemv_" + str(abs(hash(sys.argv[1]))))
target = GPUTarget("cuda", 90, 32)
bf16, i32, i64, f32, fp8 = "*bf16", "*i32", "*i64", "*fp32", "*fp8e4nv"
def ops(fn, types, constants):
    sig = {a: "constexpr" if a in constants else types.get(a, "*bf16" if a.endswith("_ptr") else "i32") for a in fn.arg_names}
    consts = {k: v for k, v in constants.items() if k in fn.arg_names}
    ptx = triton.compile(ASTSource(fn, sig, consts), target=target).asm["ptx"]
    body = [l.strip().split()[0] for l in ptx.splitlines() if l.strip() and not l.strip().startswith((".", "//", "$", "{", "}", ")", "("))]
    return collections.Counter(body)
cases = {
 "gate_up_act": (moe._gate_up_act_kernel, dict(ids_ptr=i64, scale_ptr=f32), dict(TOP_K=8, BLOCK_N=16, BLOCK_K=256, LOAD_AHEAD=True, GROUP_SCALE=False, INT4=False, USE_PDL=True, SUB_K=1, WHOLE_SUBS=True, GROUP_SUBS=1, ASM=True, X_BF16_PAIRS=False, HALF_FMA=False)),
 "down_reduce": (moe._down_reduce_kernel, dict(ids_ptr=i64, weights_ptr=f32, partial_ptr=f32, counter_ptr=i32, scale_ptr=f32), dict(TOP_K=8, BLOCK_N=32, BLOCK_K=256, LOAD_AHEAD=False, GROUP_SCALE=False, INT4=False, USE_PDL=True, SUB_K=1, WHOLE_SUBS=True, GROUP_SUBS=1, ASM=True, X_BF16_PAIRS=False, HALF_FMA=False)),
 "grouped": (moe._grouped_gemm_kernel, dict(weights_ptr=f32, scale_ptr=f32, sorted_ids_ptr=i32, block_expert_ptr=i32), dict(A_ROW_DIV=8, MUL_WEIGHT=True, DOT_F32=False, PRECISION="tf32", BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, GROUP_SCALE=False, INT4=False)),
 "grouped_int4": (moe._grouped_gemm_kernel, dict(b_ptr=i32, weights_ptr=f32, scale_ptr=bf16, sorted_ids_ptr=i32, block_expert_ptr=i32), dict(A_ROW_DIV=8, MUL_WEIGHT=True, DOT_F32=False, PRECISION="tf32", BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, GROUP_SCALE=False, INT4=True)),
 "gemv_fp8_words": (qg._gemv_kernel, dict(partial_ptr=f32, counter_ptr=i32, w_ptr=fp8, scale_ptr=f32, zero_ptr=f32),
     dict(INT4=False, HAS_SCALE=True, HAS_BIAS=False, PARTIAL=True, USE_DOT=False, DOT_FP32=False, X_HALF=True,
          X_FP16=False, ASM=True, X_BF16_PAIRS=True, SLOT_DOT=False, HALF_FMA=False, REDUCE_CHUNK=8, FP8_WORDS=True,
          LOAD_AHEAD=True, E4M3_PTX=True, BLOCK_M=1, BLOCK_N=16, BLOCK_K=512, VEC=4, PF_ROWS=16, PF_LINES=16,
          PF_STEP=128, INT4_FMA=False, EARLY_TILE=True, GROUP_SCALE=False, USE_PDL=True, group_size=1)),
 "gemv_fp8_dot": (qg._gemv_kernel, dict(partial_ptr=f32, counter_ptr=i32, w_ptr=fp8, scale_ptr=f32, zero_ptr=f32),
     dict(INT4=False, HAS_SCALE=True, HAS_BIAS=False, PARTIAL=True, USE_DOT=True, DOT_FP32=False, X_HALF=True,
          X_FP16=False, ASM=True, X_BF16_PAIRS=True, SLOT_DOT=False, HALF_FMA=False, REDUCE_CHUNK=1, FP8_WORDS=False,
          LOAD_AHEAD=False, E4M3_PTX=False, BLOCK_M=16, BLOCK_N=32, BLOCK_K=256, VEC=16, PF_ROWS=32, PF_LINES=4,
          PF_STEP=128, INT4_FMA=False, EARLY_TILE=True, GROUP_SCALE=False, USE_PDL=True, group_size=1)),
 "gemv_int4_dot_f32": (qg._gemv_kernel, dict(partial_ptr=f32, counter_ptr=i32, x_ptr=f32, w_ptr=i32, scale_ptr=f32, zero_ptr=f32, out_ptr=f32),
     dict(INT4=True, HAS_SCALE=True, HAS_BIAS=False, PARTIAL=True, USE_DOT=True, DOT_FP32=True, X_HALF=False,
          X_FP16=False, ASM=True, X_BF16_PAIRS=False, SLOT_DOT=False, HALF_FMA=False, REDUCE_CHUNK=1, FP8_WORDS=False,
          LOAD_AHEAD=False, E4M3_PTX=False, BLOCK_M=16, BLOCK_N=64, BLOCK_K=64, VEC=8, PF_ROWS=16, PF_LINES=2,
          PF_STEP=32, INT4_FMA=False, EARLY_TILE=True, GROUP_SCALE=False, USE_PDL=True, group_size=128)),
 "gemv_int4": (qg._gemv_kernel, dict(partial_ptr=f32, counter_ptr=i32, w_ptr=i32, scale_ptr=bf16, zero_ptr=bf16),
     dict(INT4=True, HAS_SCALE=True, HAS_BIAS=False, PARTIAL=True, USE_DOT=False, DOT_FP32=False, X_HALF=True,
          X_FP16=False, ASM=True, X_BF16_PAIRS=True, SLOT_DOT=False, HALF_FMA=True, REDUCE_CHUNK=8, FP8_WORDS=False,
          LOAD_AHEAD=False, E4M3_PTX=False, BLOCK_M=1, BLOCK_N=64, BLOCK_K=128, VEC=8, PF_ROWS=16, PF_LINES=2,
          PF_STEP=32, INT4_FMA=True, EARLY_TILE=True, GROUP_SCALE=False, USE_PDL=True, group_size=128)),
}
import json
import subprocess

if len(sys.argv) > 2 and sys.argv[2] == "--child":  # one tree's counts, in a process of its own
    print(json.dumps({name: dict(ops(*c)) for name, c in cases.items()}))
    raise SystemExit(0)
counts = [json.loads(subprocess.run([sys.executable, __file__, tree, "--child"], capture_output=True, text=True,
                                    check=True).stdout) for tree in (sys.argv[1], str(__import__("pathlib").Path(__file__).resolve().parents[1]))]
for name in counts[1]:
    old, new = counts[0].get(name, {}), counts[1][name]
    diff = {k: (old.get(k, 0), new.get(k, 0)) for k in sorted(set(old) | set(new)) if old.get(k, 0) != new.get(k, 0)}
    print(f"{name:16} opcodes {sum(old.values()):5} -> {sum(new.values()):5}", "same" if not diff else f"differ: {diff}")

"""Sweep of the decode GEMV's launch configurations (kernels/quant_gemv.py) at the Llama-3-8B linear shapes:

    python -m loadtest.bench_kernels --gemv-sweep [--jobs 12] [--budget-s 330] [--formats int4,fp8,bf16]
    TRITON_INTERPRET=1 python -m loadtest.bench_kernels --gemv-sweep --tiny

For each format (bf16; FP8 e4m3 weights with per-channel scales, x unquantized; int4 group 128 in the engine's
packed layout), each shape (qkv 4096->6144, o 4096->4096, gate_up 4096->28672, down 14336->4096, and the bf16 LM
head 4096->128256) and M = 1, 16 and 64, every candidate (block_n, block_k, split_k, num_warps, num_stages, dot)
is timed in CUDA graphs against the library's product (cuBLAS for bf16; torch._scaled_mm per-tensor and row-wise,
and the full W8A8 fp8_linear with its per-token quantization, for FP8; for int4, the dequantize + GEMM the engine
runs above the GEMV's batch sizes). Each timed graph cycles through enough copies of the weight to defeat the L2
cache, so GB/s (weight, scales and zeros, x and y per call) compares with the copy bandwidth.

Candidates are compiled first in `--jobs` worker processes (Triton's on-disk cache then serves the timing process),
so the whole sweep fits one GPU call; past `--budget-s` seconds the remaining groups are skipped (and named).
Each group prints its best candidates and the library's time as it finishes; the end prints the winners as lines
of kernels/quant_gemv_configs.py's TUNED table, each winner checked against the torch reference first.
`--tiny` runs the same on CPU in Triton's interpreter at toy sizes (a smoke run: its times mean nothing).

A winner here is fastest alone, not necessarily inside the decode step: run 155 (loadtest/RESULTS.md, session 26)
measured int4 rows 0.5-3.2 us faster alone and 3.5-23 us a layer slower in the step, where they had a quarter to
a half of the old rows' programs. Confirm a changed row in the step (`scripts/decode_ablation.py`,
`scripts/decode_before_after.sh`) before committing it.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import time
from typing import Callable, Optional

import torch

SHAPES = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096),
          "lm_head": (4096, 128256)}  # name: (K, N)
TINY_SHAPES = {"qkv": (256, 96), "down": (512, 64)}
# --shapes: other models' per-rank shapes (name: (K, N)); TP=2 halves qkv/gate_up/LM head rows and o/down columns
SHAPE_SETS = {
    "8b": SHAPES,
    "8b-tp2": {"qkv": (4096, 3072), "o": (2048, 4096), "gate_up": (4096, 14336), "down": (7168, 4096),
               "lm_head": (4096, 64128)},
    "70b-tp2": {"qkv": (8192, 5120), "o": (4096, 8192), "gate_up": (8192, 28672), "down": (14336, 8192),
                "lm_head": (8192, 64128)},
    "qwen3-30b-a3b": {"qkv": (2048, 5120), "o": (4096, 2048), "lm_head": (2048, 151936)},  # the dense linears
}
GROUP_SIZE = 128
L2_DEFEAT_BYTES = 256 << 20  # weights cycled per graph: several times any current L2


@dataclasses.dataclass(frozen=True)
class Group:
    """One (format, shape, M) cell of the sweep."""

    fmt: str  # bf16, fp8, int4
    name: str
    k: int
    n: int
    m: int


# -- candidates -------------------------------------------------------------------------------------------

def _splits(n: int, k: int, block_n: int, block_k: int, num_sms: int) -> list[int]:
    """No split, and the splits giving about 1, 2 and 4 programs per SM (whole K tiles each)."""
    from triton import cdiv

    tiles = cdiv(n, block_n)
    most = cdiv(k, block_k)
    options = {1} | {min(most, max(1, cdiv(waves * num_sms, tiles))) for waves in (1, 2, 4)}
    return sorted(options)


def _tile_shapes(fmt: str, dot: bool, tiny: bool) -> list[tuple[int, int, int, int]]:
    """(block_n, block_k, num_warps, num_stages) tried for a format and path (on the FMA path, tiles a thread can
    hold in registers)."""
    if tiny:
        return [(16, 32, 4, 2)] if dot else [(16, 32, 4, 2), (32, 64, 4, 3)]
    if dot:
        ns, ks = ((32, 64, 128), (64, 128)) if fmt == "int4" else ((16, 32, 64), (64, 128, 256))
        wide = [(256, 128, 8, 3)] if fmt == "int4" else []  # slot_dot's widest tile without spills (sm_90)
        return [(bn, bk, 4, st) for bn in ns for bk in ks for st in (3, 4)] + wide
    # the FMA path's loads are not software-pipelined (num_stages changes nothing there): occupancy hides latency
    if fmt == "int4":  # 64 to 256 weights a thread (8 to 32 words): wide N tiles give a thread more columns per x
        return [(bn, bk, w, 3) for bn in (64, 128, 256, 512, 1024) for bk in (32, 64, 128) for w in (2, 4, 8)
                if 64 * 32 * w <= bn * bk <= 256 * 32 * w]
    ns, ks = (16, 32, 64, 128), (128, 256, 512)
    if fmt == "fp8":  # 8-row tiles: twice the programs for the latency-bound small shapes (qkv, o) without split-K
        ns = (8,) + ns
    per_thread = 256 if fmt == "fp8" else 128  # weight elements a thread holds per step (about 64 registers)
    return [(bn, bk, w, 3) for bn in ns for bk in ks for w in (4, 8) if bn * bk <= per_thread * 32 * w]


def candidates(group: Group, num_sms: int, tiny: bool = False):
    """Every GemvConfig tried for one group."""
    from asyncengine.kernels.quant_gemv import MMA_MAX_M, GemvConfig

    paths = [False, True] if group.m == 1 else [True]
    out = []
    for dot in paths:
        shapes = _tile_shapes(group.fmt, dot, tiny)
        if dot and group.m == 1 and not tiny:  # the 16-row MMA at M = 1: a few of the M = 16 tiles
            shapes = [s for s in shapes if s[3] == 3][:6]
        if group.m > 16 and not tiny:  # the dense formats' larger decode batches: fewer pipeline depths
            shapes = [s for s in shapes if s[3] == 3]
        for bn, bk, warps, stages in shapes:
            if group.fmt == "int4" and GROUP_SIZE % bk:
                continue
            # alternatives: int4 one tl.dot per nibble slot (block_k 128) or bf16x2 sums per word and the load-ahead
            # of the next tile and its x (the FMA path);
            # at M = 1 FP8's word path with and without the load-ahead of the next tile (its load-ahead on the byte
            # tile repacks every byte in registers: 1.5-2x the SASS and registers on sm_90), bf16's load-ahead
            # (slot_dot, half_fma, fp8_words, load_ahead)
            variants = [(False, False, False, False)]
            if group.fmt == "int4" and dot and bk >= 128:
                variants.append((True, False, False, False))
            if group.fmt == "int4" and not dot:  # bf16x2 sums, each with and without the load-ahead
                variants += [(False, True, False, False), (False, False, False, True), (False, True, False, True)]
            if group.fmt == "fp8" and not dot:
                variants += [(False, False, True, False), (False, False, True, True)]
            if group.fmt == "bf16" and not dot:
                variants.append((False, False, False, True))
            for split in _splits(group.n, group.k, bn, bk, num_sms):
                out += [GemvConfig(bn, bk, split, warps, stages, dot, slot_dot, half_fma, fp8_words, load_ahead)
                        for slot_dot, half_fma, fp8_words, load_ahead in variants]
    if group.fmt == "int4" and group.m <= MMA_MAX_M:
        out += _mma_candidates(group, num_sms, tiny)
    return out


def _mma_candidates(group: Group, num_sms: int, tiny: bool):
    """The int4 tensor-core path's configs at M <= 8 (GemvConfig.mma: a warp owns 32 or 64 columns, so block_n is
    32 or 64 * num_warps): 2 to 8 warps, 64 or 128 inputs a step, and splits for up to 8 programs per SM (its
    programs are smaller than the FMA path's)."""
    from triton import cdiv

    from asyncengine.kernels.quant_gemv import GemvConfig

    # block_k 32 is left out: a step's fixed work (scales, zero points, the correction) over one chunk issues 3.8
    # instructions a weight at 4 columns (sm_90 SASS), against 2.2 at block_k 128
    shapes = [(1, 32, 4), (2, 64, 8)] if tiny else [(w, bk, cols) for w in (2, 4, 8) for bk in (64, 128)
                                                   for cols in (4, 8)]
    out = []
    for warps, bk, cols in shapes:
        bn = 8 * cols * warps
        splits = set(_splits(group.n, group.k, bn, bk, num_sms))
        splits.add(min(cdiv(group.k, bk), max(1, cdiv(8 * num_sms, cdiv(group.n, bn)))))
        out += [GemvConfig(bn, bk, split, warps, 3, mma=True) for split in sorted(splits)]
    return out


# -- one group's data and calls ---------------------------------------------------------------------------

class Case:
    """A group's weights, in `copies` copies (to cycle through, defeating L2), x, and the calls to time."""

    def __init__(self, group: Group, device: str, copies: int):
        from asyncengine.kernels import quant_reference as qr

        self.group, self.device = group, device
        g = torch.Generator(device=device).manual_seed(0)
        base = torch.randn(group.n, group.k, generator=g, device=device) * 0.02  # [N, K] float32
        self.x = torch.randn(group.m, group.k, generator=g, device=device).bfloat16()
        if group.fmt == "int4":
            q, s, z = qr.quantize_int_weight(base.t(), GROUP_SIZE, 4)
            one = (q, s.bfloat16(), z.bfloat16())
            self.bytes = q.numel() * 4 + 2 * s.numel() * 2
        elif group.fmt == "fp8":
            w8, scale = qr.quantize_fp8(base, dim=-1)  # [N, K] e4m3, [N, 1] float32
            one = (w8, scale)
            self.bytes = w8.numel() + scale.numel() * 4
        else:
            one = (base.bfloat16(),)
            self.bytes = base.numel() * 2
        del base
        self.bytes += (group.m * group.k + group.m * group.n) * 2  # x read, y written
        self.weights = [one] + [tuple(t.clone() for t in one) for _ in range(copies - 1)]

    def ours(self, config) -> Callable[[], None]:
        from asyncengine.kernels import quant_gemv

        if self.group.fmt == "int4":
            return lambda w: quant_gemv.int4_gemv(self.x, *w, GROUP_SIZE, config=config)
        if self.group.fmt == "fp8":
            return lambda w: quant_gemv.dense_gemv(self.x, w[0], None, w[1], config=config)
        return lambda w: quant_gemv.dense_gemv(self.x, w[0], config=config)

    def reference(self) -> torch.Tensor:
        from asyncengine.kernels import quant_reference as qr

        w = self.weights[0]
        if self.group.fmt == "int4":
            return qr.int_weight_matmul(self.x, *w, GROUP_SIZE, 4)
        return qr.dense_gemv(self.x, w[0], None, w[1] if self.group.fmt == "fp8" else None)

    def library(self, num_sms: int) -> dict[str, Callable]:
        """The products ours competes with, by name (each a function of one weight copy)."""
        import torch.nn.functional as F

        x = self.x
        if self.group.fmt == "bf16":
            return {"cuBLAS F.linear": lambda w: F.linear(x, w[0])}
        if self.group.fmt == "int4":
            from asyncengine.kernels.quant_int4 import dequantize

            # what the engine runs above the GEMV's batch sizes
            return {"dequantize + GEMM": lambda w: x @ dequantize(*w, GROUP_SIZE, x.dtype)}
        if self.device != "cuda":
            return {}
        from asyncengine.kernels import quant_fp8, quant_reference as qr

        x8, x_scale = qr.quantize_fp8(x, dim=-1)
        one = torch.ones((), device="cuda")
        return {
            "_scaled_mm per-tensor": lambda w: torch._scaled_mm(x8, w[0].t(), scale_a=one, scale_b=one,
                                                                out_dtype=torch.bfloat16),
            "_scaled_mm rowwise": lambda w: torch._scaled_mm(x8, w[0].t(), scale_a=x_scale,
                                                             scale_b=w[1].reshape(1, -1), out_dtype=torch.bfloat16),
            "fp8_linear (quant+rowwise)": lambda w: quant_fp8.fp8_linear(x, w[0], w[1], None),
        }


def copies_for(group: Group) -> int:
    per_byte = {"bf16": 2, "fp8": 1, "int4": 0.5}[group.fmt]
    return max(1, min(64, int(L2_DEFEAT_BYTES // (group.n * group.k * per_byte)) + 1))


# -- timing -------------------------------------------------------------------------------------------------

def time_per_call_us(call: Callable, weights: list, device: str) -> float:
    """Median time of one call, from a CUDA graph cycling over every weight copy (at least 8 calls; the engine's
    start-up choice times the same way, quant_linear.graph_time_us), or on CPU the median wall time of a few eager
    calls."""
    if device != "cuda":
        times = []
        for w in weights[:1] * 3:
            t0 = time.perf_counter()
            call(w)
            times.append(time.perf_counter() - t0)
        return sorted(times)[1] * 1e6
    from asyncengine.kernels.quant_linear import graph_time_us

    return graph_time_us(call, weights)


# -- compiling ahead in worker processes ----------------------------------------------------------------------

def compile_key(group: Group, config) -> tuple:
    """What makes Triton compile a config anew for a group's call: dtypes, the constexprs, and which integer
    arguments equal 1 or divide by 16 (every 8B dimension divides by 16)."""
    from asyncengine.kernels.quant_gemv import _fit, m_bucket

    fit = _fit(config, group.k, GROUP_SIZE if group.fmt == "int4" else None)
    return (group.fmt, m_bucket(group.m, group.fmt), config.block_n, fit.block_k, config.num_warps,
            config.num_stages, config.dot, config.slot_dot and fit.block_k >= 128, config.half_fma,
            config.fp8_words, config.load_ahead, config.mma, fit.split_k > 1, fit.split_k % 16 == 0)


def _compile_tasks(tasks: list[tuple[Group, object]]) -> list[tuple]:
    """Worker: run each (group, config) once, compiling it into Triton's on-disk cache; the failures as
    (group, config, message). Tasks come sorted by group: one group's weights are held at a time."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    case, failed = None, []
    for group, config in tasks:
        if case is None or case.group != group:
            case = None
            case = Case(group, device, copies=1)
        try:
            case.ours(config)(case.weights[0])
        except Exception as exc:  # a tile that does not fit (shared memory, registers): skipped in the timing
            failed.append((group, config, f"{type(exc).__name__}: {str(exc)[:160]}"))
    if device == "cuda":
        torch.cuda.synchronize()
    return failed


def precompile(work: list[tuple[Group, list]], jobs: int) -> dict[tuple, str]:
    """Compile one representative call per compile key, spread over `jobs` processes; the keys that failed, with
    their message."""
    tasks, seen = [], set()
    for group, configs in work:
        for config in configs:
            key = compile_key(group, config)
            if key not in seen:
                seen.add(key)
                tasks.append((group, config))
    print(f"{len(tasks)} distinct kernels to compile")
    if jobs <= 1:
        failures = _compile_tasks(tasks)
    else:
        import concurrent.futures
        import multiprocessing

        size = -(-len(tasks) // jobs)
        with concurrent.futures.ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
            chunks = pool.map(_compile_tasks, [tasks[i:i + size] for i in range(0, len(tasks), size)])
            failures = [f for chunk in chunks for f in chunk]
    return {compile_key(group, config): message for group, config, message in failures}


# -- the sweep ------------------------------------------------------------------------------------------------

@dataclasses.dataclass
class Result:
    group: Group
    best: list  # [(us, config)] fastest first
    library: dict  # name -> us
    bytes: int
    error: Optional[float] = None  # the winner's relative error against the reference


def sweep_group(group: Group, configs: list, failed: dict, device: str, num_sms: int, copy_gbps: float) -> Result:
    case = Case(group, device, copies_for(group) if device == "cuda" else 1)
    timed = []
    for config in configs:
        if compile_key(group, config) in failed:
            continue
        try:
            timed.append((time_per_call_us(case.ours(config), case.weights, device), config))
        except Exception as exc:  # reported, not fatal: the other configs still count
            print(f"  failed: {config}: {type(exc).__name__}: {str(exc)[:120]}")
    timed.sort(key=lambda t: t[0])
    library = {}
    for name, call in case.library(num_sms).items():
        try:
            library[name] = time_per_call_us(call, case.weights, device)
        except Exception as exc:  # e.g. a _scaled_mm form this torch build lacks: reported, not fatal
            library[name] = float("nan")
            print(f"  {name}: {type(exc).__name__}: {str(exc)[:100]}")
    result = Result(group, timed, library, case.bytes)
    ref = case.reference().float()
    while result.best:  # the winner must be right: a fast wrong config is dropped
        out = case.ours(result.best[0][1])(case.weights[0]).float()
        result.error = ((out - ref).norm() / ref.norm()).item()
        if result.error < 1e-2:
            break
        print(f"  DROPPED (rel error {result.error:.1e}): {result.best[0][1]}")
        result.best.pop(0)
    print_group(result, copy_gbps)
    return result


def _rate(nbytes: int, us: float, copy_gbps: float) -> str:
    gbps = nbytes / us / 1e3
    return f"{gbps:7.0f} GB/s" + (f" {gbps / copy_gbps:4.0%}" if copy_gbps else "")


def print_group(r: Result, copy_gbps: float) -> None:
    g = r.group
    print(f"\n{g.fmt} {g.name} {g.k}->{g.n} M={g.m}: {len(r.best)} configs, {r.bytes / 1e6:.1f} MB per call")
    for us, config in r.best[:5]:
        print(f"  {us:8.2f} us {_rate(r.bytes, us, copy_gbps)}  {config}")
    paths = _best_per_path(r.best)
    if len(paths) > 1:  # the alternatives side by side, measured in the same run
        print("  best per path: " + ", ".join(f"{name} {us:.2f} us" for name, us in paths.items()))
    for name, us in r.library.items():
        print(f"  {us:8.2f} us {_rate(r.bytes, us, copy_gbps)}  [{name}]")
    if r.best and r.library:
        fastest = min(r.library.values())
        print(f"  best ours / best library: {r.best[0][0] / fastest:.2f}x (rel error {r.error:.1e})")
    flush()


def flush() -> None:
    import sys

    sys.stdout.flush()


def winner_line(r: Result, copy_gbps: float, gpu: str = "") -> str:
    """A row of quant_gemv_configs.TUNED for the winner: keyed by `gpu` (a GPU's name) when given, for any GPU
    when not."""
    us, c = r.best[0]
    g = r.group
    lib = ", ".join(f"{name} {t:.1f} us" for name, t in r.library.items())
    gpu_key = f", {gpu!r}".replace("'", '"') if gpu else ""
    return (f'    ("{g.fmt}", {g.n}, {g.k}, {g.m}{gpu_key}): GemvConfig({c.block_n}, {c.block_k}, {c.split_k}, '
            f'{c.num_warps}, {c.num_stages}, {c.dot}{_path_flags(c)}),  '
            f'# {g.name}: {us:.1f} us,{_rate(r.bytes, us, copy_gbps)}'
            f"{'; ' + lib if lib else ''}")


def write_table(lines: list[str], path: str) -> int:
    """Put winner lines into the TUNED table at `path` (kernels/quant_gemv_configs.py): a line whose key is already
    there replaces it, a new key goes before the table's closing brace. Returns the lines written."""
    text = open(path).read()
    head, close, tail = text.rpartition("\n}")
    rows = head.split("\n")
    for line in lines:
        key = line.strip().split("):", 1)[0] + ")"  # '("bf16", 6144, 4096, 1)' or '(..., 1, "NVIDIA H200")'
        at = [i for i, row in enumerate(rows) if row.strip().startswith(key + ":")]
        if at:
            rows[at[0]] = line
        else:
            rows.append(line)
    open(path, "w").write("\n".join(rows) + close + tail)
    return len(lines)


def _best_per_path(best: list) -> dict[str, float]:
    """The fastest time of each path among the timed (us, config), sorted fastest first: FMA or tl.dot, and each
    alternative (int4 slot_dot / half_fma, FP8 word path, load_ahead)."""
    paths: dict[str, float] = {}
    for us, c in best:
        flags = _path_flags(c)  # ", half_fma=True, ..."
        name = ("dot" if c.dot else "fma") + flags.replace(", ", " ").replace("=True", "")
        paths.setdefault(name, us)
    return paths


PATH_FLAGS = ("slot_dot", "half_fma", "fp8_words", "load_ahead", "mma")  # GemvConfig's booleans after dot


def _path_flags(config) -> str:
    """A config's alternative paths (int4 slot_dot / half_fma, the FP8 word path, any format's load_ahead) as
    GemvConfig's keyword arguments, ", half_fma=True, ..." (none: the default path)."""
    return "".join(f", {flag}=True" for flag in PATH_FLAGS if getattr(config, flag))


def _only_path(group: Group, configs: list, flag: str, num_sms: int, device: str) -> list:
    """The candidates taking path `flag`, and the group's current table row (its baseline in the same run)."""
    from asyncengine.kernels import device_name
    from asyncengine.kernels.quant_gemv import config_for

    gpu = device_name(0) if device == "cuda" else ""
    row = config_for(group.fmt, group.m, group.n, group.k, num_sms, gpu)
    return [c for c in configs if getattr(c, flag)] + ([row] if not getattr(row, flag) else [])


def groups_for(formats: list[str], tiny: bool, shape_sets: tuple[str, ...] = ("8b",),
               ms: Optional[tuple[int, ...]] = None) -> list[Group]:
    """The sweep's cells: each format x shape (of each named set; the toy shapes with `tiny`) x M (`ms`, or the
    format's own: 1, 8, 16 and 64 for int4, 1, 16 and 64 for the dense formats)."""
    from asyncengine.kernels.quant_gemv import MMA_MAX_M

    shapes = [(f"{name}" if set_name == "8b" else f"{set_name} {name}", kn)
              for set_name in (("tiny",) if tiny else shape_sets)
              for name, kn in (TINY_SHAPES if tiny else SHAPE_SETS[set_name]).items()]
    out = []
    for fmt in formats:
        for name, (k, n) in shapes:
            if name.endswith("lm_head") and fmt != "bf16":  # the engine keeps the LM head in the model's dtype
                continue
            # int4 takes the GEMV up to M = 64 (quant_int4.GEMV_MAX_M), with a key of its own for 2..8 (the MMA
            # path's); dense formats up to 64 where it wins
            own = (1, MMA_MAX_M, 16, 64) if fmt == "int4" else (1, 16, 64)
            out += [Group(fmt, name, k, n, m) for m in (ms or own)]
    return out


def run_sweep(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="bench_kernels --gemv-sweep")
    parser.add_argument("--gemv-sweep", action="store_true")
    parser.add_argument("--tiny", action="store_true", help="CPU, Triton's interpreter, toy sizes (smoke run)")
    parser.add_argument("--jobs", type=int, default=min(12, os.cpu_count() or 1))
    parser.add_argument("--budget-s", type=float, default=330.0, help="skip the groups not started by then")
    parser.add_argument("--formats", default="int4,fp8,bf16", help="in this order (the budget cuts the last)")
    parser.add_argument("--shapes", default="8b", help=f"comma-separated shape sets, of {sorted(SHAPE_SETS)}")
    parser.add_argument("--ms", default="", help="comma-separated M values (default: each format's own)")
    parser.add_argument("--write-table", action="store_true",
                        help="also write the winners into kernels/quant_gemv_configs.py (replacing their keys' rows)")
    parser.add_argument("--only", choices=PATH_FLAGS,
                        help="time only the candidates of this path (a GemvConfig flag, e.g. mma), beside each "
                             "shape's current table row")
    parser.add_argument("--any-gpu", action="store_true",
                        help="winners as rows for any GPU (default: rows keyed by the name of the GPU measured)")
    args = parser.parse_args(argv)
    if args.tiny and os.environ.get("TRITON_INTERPRET") != "1":  # Triton reads it once, when first imported
        raise SystemExit("--tiny runs in Triton's interpreter: TRITON_INTERPRET=1 python -m loadtest.bench_kernels "
                         "--gemv-sweep --tiny")
    start = time.perf_counter()
    device = "cuda" if torch.cuda.is_available() and not args.tiny else "cpu"
    formats = args.formats.split(",")
    torch.manual_seed(0)
    copy_gbps, num_sms = 0.0, 4
    if device == "cuda":
        from .bench_offline import measure_copy_bandwidth

        copy_gbps = measure_copy_bandwidth(2.0) / 1e9
        torch.cuda.empty_cache()  # its 4 GiB back for the compile workers
        num_sms = torch.cuda.get_device_properties(0).multi_processor_count
        print(f"device: {torch.cuda.get_device_name()}  {num_sms} SMs  copy {copy_gbps:.0f} GB/s")
    unknown = set(args.shapes.split(",")) - set(SHAPE_SETS)
    if unknown:
        parser.error(f"--shapes: unknown set(s) {sorted(unknown)}; known: {sorted(SHAPE_SETS)}")
    try:
        ms = tuple(int(m) for m in args.ms.split(",")) if args.ms else None
    except ValueError:
        parser.error(f"--ms: comma-separated integers, not {args.ms!r}")
    groups = groups_for(formats, args.tiny, tuple(args.shapes.split(",")), ms)
    work = [(g, candidates(g, num_sms, args.tiny)) for g in groups]
    if args.only:
        work = [(g, _only_path(g, configs, args.only, num_sms, device)) for g, configs in work]
    print(f"{len(work)} groups, {sum(len(c) for _, c in work)} candidates; compiling in {args.jobs} processes")
    flush()
    failed = precompile(work, args.jobs)  # on CPU too: a smoke run of the pool (the interpreter compiles nothing)
    print(f"compiled in {time.perf_counter() - start:.0f} s; {len(failed)} kernels failed to run")
    for key, message in list(failed.items())[:5]:
        print(f"  {key}: {message}")
    results, skipped = [], []
    for group, configs in work:
        if time.perf_counter() - start > args.budget_s:
            skipped.append(group)
            continue
        results.append(sweep_group(group, configs, failed, device, num_sms, copy_gbps))
    print(f"\nwinners ({time.perf_counter() - start:.0f} s; paste into kernels/quant_gemv_configs.py TUNED):")
    from asyncengine.kernels import device_name

    gpu = device_name(0) if device == "cuda" and not args.any_gpu else ""  # the key config_for looks up
    lines = [winner_line(r, copy_gbps, gpu) for r in results if r.best]
    print("\n".join(lines))
    if args.write_table and lines and not args.tiny:
        from asyncengine.kernels import quant_gemv_configs

        print(f"wrote {write_table(lines, quant_gemv_configs.__file__)} rows into {quant_gemv_configs.__file__}")
    for group in skipped:
        print(f"    # skipped (over --budget-s): {group}")
    return 0

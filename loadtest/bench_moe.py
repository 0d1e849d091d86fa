"""The fused MoE's decode kernels (kernels/moe.py) at the Qwen3-30B-A3B expert shape (or --shape mixtral-8x7b), one
MoE layer at a time:

    python -m loadtest.bench_kernels --moe-decode [--layers 8]       the layer's kernels per batch size T
    python -m loadtest.bench_kernels --moe-sweep [--budget-s 420]    candidate tiles; winners for moe_configs.py
    ... --int4                       the experts in packed int4 (groups of 128, asymmetric: GPTQ / AWQ after
                                     loading) in both modes; the sweep's winners go to TUNED_INT4
    TRITON_INTERPRET=1 python -m loadtest.bench_kernels --moe-sweep --tiny    (CPU smoke run: times mean nothing)

A layer here is what the decode step runs for the sparse MLP: the router product (x [T, H] @ gate [E, H]^T),
routing (topk_softmax) and the experts (gate_up_act + down_reduce), for T = 1, 2, 4, 8, 16 tokens; the whole layer also with PDL off. Each timing
is a CUDA graph over `--layers` layers, each with its own weights (8 layers of 128 experts: 9.7 GB, far past any
L2; the 48 of the model would not fit next to nothing else), so every layer reads its experts from memory as in
the model. Reported per layer: microseconds, and GB/s of the bytes the layer must read (the experts its tokens
hit, once each, and the router's weight) against the device's copy bandwidth measured in the same run. The peer
measured in the same run is the grouped-GEMM path (what T > DECODE_MAX_TOKENS takes) on the same routing.

The sweep times gate_up_act's candidate tiles (with down_reduce at its default), then down_reduce's (with the
best gate_up_act), per T, and prints the winners as lines of kernels/moe_configs.py's TUNED table, each checked
against the torch reference first.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import time
from typing import Callable

import torch
import torch.nn.functional as F

# (experts, top_k, hidden, intermediate)
SHAPES = {"qwen3-30b-a3b": (128, 8, 2048, 768), "mixtral-8x7b": (8, 2, 4096, 14336)}
TINY = (16, 4, 64, 32)
TOKENS = (1, 2, 4, 8, 16)


INT4_GROUP = 128


@dataclasses.dataclass
class Layer:
    """One MoE layer's weights: bf16, or packed int4 with group scales and zero points (`quant`)."""

    gate: torch.Tensor  # [E, H]
    w13: torch.Tensor  # [E, 2I, H] (int4: int32 [E, 2I, H / 8])
    w2: torch.Tensor  # [E, H, I] (int4: int32 [E, H, I / 8])
    quant: tuple = ()  # int4: (w13_scale, w2_scale, group, w13_zeros, w2_zeros), scales and zeros [E, G, N] bf16


def _int4_expert(shape: tuple, group: int, g: torch.Generator, device: str) -> tuple:
    """Random packed int4 experts [E, N, K] (any words are valid codes): (int32 [E, N, K / 8], scales [E, G, N]
    bf16 sized so that outputs stay near unit scale, integer zero points [E, G, N] bf16)."""
    experts, n, k = shape
    words = torch.randint(-(2**31), 2**31 - 1, (experts, n, k // 8), generator=g, device=device, dtype=torch.int32)
    groups = k // group
    scales = (torch.rand(experts, groups, n, generator=g, device=device) * 0.5 + 0.5) * 0.25 * k**-0.5
    zeros = torch.randint(6, 10, (experts, groups, n), generator=g, device=device).float()
    return words, scales.to(torch.bfloat16), zeros.to(torch.bfloat16)


class Case:
    """`layers` MoE layers at one shape, and x [T, H] for each T asked."""

    def __init__(self, shape: tuple, layers: int, device: str, int4: bool = False):
        from asyncengine.kernels import moe

        self.shape, self.device, self.int4 = shape, device, int4
        self.group = INT4_GROUP if min(shape[2:]) % INT4_GROUP == 0 else 16  # --tiny: groups of 16
        experts, self.top_k, hidden, inter = shape
        g = torch.Generator(device=device).manual_seed(0)
        dtype = torch.bfloat16

        def randn(*size, scale):
            return (torch.randn(*size, generator=g, device=device) * scale).to(dtype)

        self.layers = []
        for _ in range(layers):
            gate = randn(experts, hidden, scale=hidden**-0.5)
            if int4:
                (w13, s13, z13), (w2, s2, z2) = (_int4_expert((experts, 2 * inter, hidden), self.group, g, device),
                                                 _int4_expert((experts, hidden, inter), self.group, g, device))
                self.layers.append(Layer(gate, w13, w2, (s13, s2, self.group, z13, z2)))
                continue
            self.layers.append(Layer(gate, randn(experts, 2 * inter, hidden, scale=hidden**-0.5),
                                     randn(experts, hidden, inter, scale=inter**-0.5)))  # fmt: skip
        self.xs = {t: torch.randn(t, hidden, generator=g, device=device).to(dtype) for t in TOKENS}
        self.routed = {}  # T -> [(weights [T, K], ids [T, K])] per layer, computed once (the byte count needs it)
        for t, x in self.xs.items():
            self.routed[t] = [moe.topk_softmax(F.linear(x, layer.gate), self.top_k, True) for layer in self.layers]

    def expert_bytes(self, t: int) -> float:
        """Mean bytes per layer that T tokens must read: each expert hit once, plus the router's weight."""
        experts, _, hidden, inter = self.shape
        hit = sum(ids.unique().numel() for _, ids in self.routed[t]) / len(self.layers)
        return hit * self.bytes_per_expert() + experts * hidden * 2

    def bytes_per_expert(self) -> float:
        """One expert's three projections as stored: bf16, or int4 words plus bf16 scales and zero points."""
        _, _, hidden, inter = self.shape
        weights = 3 * hidden * inter
        return weights / 2 + 2 * 2 * weights / self.group if self.int4 else 2 * weights

    # -- the calls timed, each a function of (layer index) ---------------------------------------------------
    def experts_call(self, t: int, config=None, grouped: bool = False) -> Callable[[int], torch.Tensor]:
        from asyncengine.kernels import moe

        x = self.xs[t]

        def call(i: int) -> torch.Tensor:
            layer, (weights, ids) = self.layers[i], self.routed[t][i]
            if grouped:
                return moe.fused_moe_grouped(x, layer.w13, layer.w2, weights, ids, *layer.quant)
            return moe._fused_moe_decode(x, layer.w13, layer.w2, weights.reshape(-1), ids.reshape(-1),
                                         self.top_k, config, *layer.quant)  # fmt: skip

        return call

    def routing_call(self, t: int, how: str) -> Callable[[int], object]:
        from asyncengine.kernels import moe, quant_gemv

        x = self.xs[t]
        if how == "fused":
            return lambda i: moe.route(x, self.layers[i].gate, self.top_k, True)
        product = {"cuBLAS": lambda w: F.linear(x, w), "our GEMV": lambda w: quant_gemv.dense_gemv(x, w)}[how]
        return lambda i: moe.topk_softmax(product(self.layers[i].gate), self.top_k, True)

    def reference(self, t: int, i: int = 0) -> torch.Tensor:
        from asyncengine.kernels import reference

        layer, (weights, ids) = self.layers[i], self.routed[t][i]
        if self.int4:  # each used expert dequantized (in the scales' bf16, as the reference does), in float32
            return reference.fused_moe(self.xs[t].float(), layer.w13, layer.w2, weights, ids, *layer.quant)
        return reference.fused_moe(self.xs[t].float(), layer.w13.float(), layer.w2.float(), weights, ids)


def time_per_layer_us(call: Callable[[int], object], layers: int, device: str) -> float:
    """Median time of one layer's call: a CUDA graph over every layer (each its own weights), replayed; on CPU the
    median wall time of a few eager calls of layer 0."""
    if device != "cuda":
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            call(0)
            times.append(time.perf_counter() - t0)
        return sorted(times)[1] * 1e6
    from triton.testing import do_bench

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for i in range(layers):  # compile, and make the split counters, outside the capture
            call(i)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(layers):
            call(i)
    ms = do_bench(graph.replay, warmup=5, rep=40, return_mode="median")
    del graph
    return ms * 1e3 / layers


def _rate(nbytes: float, us: float, copy_gbps: float) -> str:
    gbps = nbytes / us / 1e3
    return f"{gbps:7.0f} GB/s" + (f" {gbps / copy_gbps:4.0%}" if copy_gbps else "")


def _setup(args) -> tuple[str, tuple, float]:
    device = "cuda" if torch.cuda.is_available() and not args.tiny else "cpu"
    copy_gbps = 0.0
    if device == "cuda":
        from .bench_offline import measure_copy_bandwidth

        copy_gbps = measure_copy_bandwidth(2.0) / 1e9
        torch.cuda.empty_cache()
        props = torch.cuda.get_device_properties(0)
        print(f"device: {props.name}  {props.multi_processor_count} SMs  copy {copy_gbps:.0f} GB/s")
    shape = TINY if args.tiny else SHAPES[args.shape]
    print(f"shape (experts, top_k, hidden, intermediate) = {shape}, {args.layers} layers cycled per graph")
    return device, shape, copy_gbps


def run_decode(args) -> int:
    """Per T: routing (two ways), the experts (decode kernels, tuned or default config, and the grouped peer) and
    the whole layer, per layer."""
    from asyncengine.kernels import moe

    device, shape, copy_gbps = _setup(args)
    case = Case(shape, args.layers, device, args.int4)
    hidden, inter, top_k = shape[2], shape[3], shape[1]
    print(f"{'T':>3} {'part':44} {'us/layer':>9} {'rate (bytes the layer must read)':>32}")
    for t in args.tokens:
        nbytes = case.expert_bytes(t)
        config = moe.decode_config(hidden, inter, top_k, t, args.int4)
        rows = [
            ("routing: cuBLAS router + topk_softmax", case.routing_call(t, "cuBLAS")),
            ("routing: our GEMV router + topk_softmax", case.routing_call(t, "our GEMV")),
            ("routing: one fused kernel (moe.route)", case.routing_call(t, "fused")),
            (f"experts: decode kernels {_tiles(config)}", case.experts_call(t, config)),
            ("experts: decode kernels, default tiles", case.experts_call(t, _untuned(case, t))),
            ("experts: grouped GEMMs (peer)", case.experts_call(t, grouped=True)),
            ("layer: moe.route + fused_moe (as the model)", _model_call(case, t)),
            ("layer: the same, ASYNCENGINE_PDL=0", _model_call(case, t)),
        ]  # fmt: skip
        times = {}
        for name, call in rows:
            with _pdl_switch("0" if "PDL=0" in name else None):
                times[name] = time_per_layer_us(call, args.layers, device)
            print(f"{t:>3} {name:44} {times[name]:9.1f} {_rate(nbytes, times[name], copy_gbps):>32}")
        decode, peer = times[rows[3][0]], times[rows[5][0]]
        print(f"{t:>3} {'(grouped peer time / decode kernels time)':44} {peer / decode:8.2f}x "
              f"   experts hit per layer {(nbytes - shape[0] * hidden * 2) / case.bytes_per_expert():.1f}")
    return 0


@contextlib.contextmanager
def _pdl_switch(value):
    """Set kernels/pdl.py's environment switch for the launches inside (None: leave it)."""
    from asyncengine.kernels.pdl import ENV_SWITCH

    saved = os.environ.get(ENV_SWITCH)
    if value is not None:
        os.environ[ENV_SWITCH] = value
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(ENV_SWITCH, None)
        else:
            os.environ[ENV_SWITCH] = saved


def _model_call(case: Case, t: int) -> Callable[[int], torch.Tensor]:
    """Routing and experts as asyncengine.models.moe.SparseMoeBlock runs them on CUDA."""
    from asyncengine.kernels import moe

    x = case.xs[t]

    def call(i: int) -> torch.Tensor:
        layer = case.layers[i]
        weights, ids = moe.route(x, layer.gate, case.top_k, True)
        return moe.fused_moe(x, layer.w13, layer.w2, weights, ids, *layer.quant)

    return call


def _untuned(case: Case, t: int):
    """What the engine runs without a tuned row: bf16 experts the default tiles; int4 experts the bf16 table's
    row (or the default) with moe._int4_block_k, unless TUNED_INT4 has the row."""
    from asyncengine.kernels import moe

    _, top_k, hidden, inter = case.shape
    if case.int4:
        return moe.decode_config(hidden, inter, top_k, t, True)
    return moe.default_decode_config(hidden, inter, top_k, t)


def _tiles(config) -> str:
    def one(tiles) -> str:
        return (f"{tiles.block_n}x{tiles.block_k}/{tiles.num_warps}{'+ahead' * tiles.load_ahead}"
                f"{'+bf16x2' * tiles.half_fma}")

    return f"({one(config.gate_up)}, {one(config.down)})"


# -- the sweep ------------------------------------------------------------------------------------------------

def gate_up_candidates(tiny: bool) -> list:
    """(block_n, block_k, num_warps, load_ahead) for gate_up_act: two float32 accumulator tiles a thread can hold
    in registers (about 64 each, half that when a second pair of weight tiles is loaded ahead)."""
    from asyncengine.kernels.moe import GemvTiles

    if tiny:
        return [GemvTiles(8, 32, 2), GemvTiles(16, 64, 4)]
    return [GemvTiles(n, k, w, ahead) for n in (4, 8, 16, 32) for k in (128, 256, 512, 1024) for w in (2, 4, 8)
            for ahead in (False, True) if n * k * (1 + ahead) <= 64 * 32 * w]


def down_candidates(tiny: bool) -> list:
    """(block_n, block_k, num_warps, load_ahead) for down_reduce: one accumulator tile (up to about 128 registers a
    thread, half that when the next weight tile is loaded ahead)."""
    from asyncengine.kernels.moe import GemvTiles

    if tiny:
        return [GemvTiles(8, 32, 2), GemvTiles(32, 16, 4)]
    return [GemvTiles(n, k, w, ahead) for n in (8, 16, 32, 64, 128) for k in (64, 128, 256, 512) for w in (2, 4, 8)
            for ahead in (False, True) if n * k * (1 + ahead) <= 128 * 32 * w and n * k >= 16 * 32 * w]


def int4_gate_up_candidates(tiny: bool) -> list:
    """(block_n, block_k, num_warps, load_ahead) for gate_up_act on int4 experts: its tile of 2 block_n rows (gate
    and up interleaved) covers at least the rows of one layout tile (8 a warp at 16 words a group of 128), with 8
    to 64 words a thread in flight (twice a step's with load_ahead; ptxas spilled at 64 in some). Run 163: at T = 1
    every winner was short of bytes in flight (~12 KB an SM), so loading ahead is tried on every tile."""
    from asyncengine.kernels.moe import GemvTiles

    if tiny:
        return [GemvTiles(8, 32, 2), GemvTiles(4, 16, 1)]
    return [GemvTiles(n, k, w, ahead) for n in (4, 8, 16, 32, 64) for k in (128, 256, 512, 1024) for w in (1, 2, 4)
            for ahead in (False, True) if 2 * n >= 8 * w and 8 <= 2 * n * k // 8 // (32 * w) * (1 + ahead) <= 64]


def int4_down_candidates(tiny: bool) -> list:
    """(block_n, block_k, num_warps, load_ahead) for down_reduce on int4 experts: as gate_up_act's, block_n rows."""
    from asyncengine.kernels.moe import GemvTiles

    if tiny:
        return [GemvTiles(8, 32, 1), GemvTiles(16, 16, 2)]
    return [GemvTiles(n, k, w, ahead) for n in (8, 16, 32, 64, 128) for k in (128, 256, 512) for w in (1, 2, 4)
            for ahead in (False, True) if n >= 8 * w and 8 <= n * k // 8 // (32 * w) * (1 + ahead) <= 64]


def _int4_variants(ranked: list, which: str) -> list:
    """The four fastest int4 configs again with `which` (gate_up or down) summing in bf16x2 (GemvTiles.half_fma)."""
    return [dataclasses.replace(config, **{which: dataclasses.replace(getattr(config, which), half_fma=True)})
            for _, config in ranked[:4]]


def _timed(case: Case, t: int, configs: list, device: str, layers: int, deadline: float) -> list:
    """[(us per layer, config)] fastest first; a config that fails to run is named and skipped."""
    out = []
    for config in configs:
        if time.perf_counter() > deadline:
            print(f"  T={t}: over --budget-s, {len(configs) - len(out)} candidates left untimed")
            break
        try:
            out.append((time_per_layer_us(case.experts_call(t, config), layers, device), config))
        except Exception as exc:  # e.g. out of registers: reported, the others still count
            print(f"  failed: {_tiles(config)}: {type(exc).__name__}: {str(exc)[:120]}")
    return sorted(out, key=lambda r: r[0])


def _checked(case: Case, t: int, ranked: list) -> list:
    """Drop leading configs whose output is wrong: relative error against the float32 reference of 1e-2 or more
    (3e-2 in the interpreter, which truncates each rounding to bf16)."""
    from asyncengine.kernels import interpreting

    ref = case.reference(t)
    while ranked:
        out = case.experts_call(t, ranked[0][1])(0).float()
        error = ((out - ref).norm() / ref.norm()).item()
        if error < (3e-2 if interpreting() else 1e-2):
            break
        print(f"  DROPPED (rel error {error:.1e}): {_tiles(ranked[0][1])}")
        ranked.pop(0)
    return ranked


def run_sweep(args) -> int:
    from asyncengine.kernels import moe

    start = time.perf_counter()
    device, shape, copy_gbps = _setup(args)
    case = Case(shape, args.layers, device, args.int4)
    experts, top_k, hidden, inter = shape
    deadline = start + args.budget_s
    winners = []
    for t in args.tokens if not args.tiny else [t for t in args.tokens if t in (1, 4)]:  # --tiny: T = 1, 4 at most
        nbytes = case.expert_bytes(t)
        default = _untuned(case, t)
        default_us = time_per_layer_us(case.experts_call(t, default), args.layers, device)
        up_tiles, down_tiles = ((int4_gate_up_candidates, int4_down_candidates) if args.int4 else
                                (gate_up_candidates, down_candidates))
        ups = _timed(case, t, [moe.DecodeConfig(c, default.down) for c in up_tiles(args.tiny)], device, args.layers,
                     deadline)  # fmt: skip
        if args.int4:  # the leaders again, summing each word's products in bf16x2
            ups = sorted(ups + _timed(case, t, _int4_variants(ups, "gate_up"), device, args.layers, deadline),
                         key=lambda r: r[0])  # fmt: skip
        ups = _checked(case, t, ups)
        best_up = ups[0][1].gate_up if ups else default.gate_up
        downs = _timed(case, t, [moe.DecodeConfig(best_up, c) for c in down_tiles(args.tiny)], device, args.layers,
                       deadline)  # fmt: skip
        if args.int4:
            downs = sorted(downs + _timed(case, t, _int4_variants(downs, "down"), device, args.layers, deadline),
                           key=lambda r: r[0])  # fmt: skip
        downs = _checked(case, t, downs)
        print(f"\nT={t}: default {_tiles(default)} {default_us:.1f} us {_rate(nbytes, default_us, copy_gbps)}")
        for label, ranked in (("gate_up_act", ups), ("down_reduce", downs)):
            for us, config in ranked[:4]:
                print(f"  {label} {_tiles(config)} {us:8.1f} us {_rate(nbytes, us, copy_gbps)}")
        if downs:
            us, best = downs[0]
            winners.append(f"    ({hidden}, {inter}, {top_k}, {t}): DecodeConfig(GemvTiles{dataclasses.astuple(best.gate_up)}, "
                           f"GemvTiles{dataclasses.astuple(best.down)}),  # {us:.1f} us,{_rate(nbytes, us, copy_gbps)}; "
                           f"default {default_us:.1f} us")  # fmt: skip
        import sys

        sys.stdout.flush()
    table = "TUNED_INT4" if args.int4 else "TUNED"
    print(f"\nwinners ({time.perf_counter() - start:.0f} s; paste into kernels/moe_configs.py {table}):")
    print("\n".join(winners))
    return 0


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="bench_kernels --moe-decode | --moe-sweep")
    parser.add_argument("--moe-decode", action="store_true")
    parser.add_argument("--moe-sweep", action="store_true")
    parser.add_argument("--shape", choices=list(SHAPES), default="qwen3-30b-a3b",
                        help="expert shape (mixtral-8x7b: 2.8 GB per layer; pass fewer --layers if memory is short)")
    parser.add_argument("--layers", type=int, default=8, help="MoE layers cycled in each timed graph")
    parser.add_argument("--tokens", type=int, nargs="+", default=list(TOKENS), choices=TOKENS,
                        help="the batch sizes timed (or swept)")
    parser.add_argument("--budget-s", type=float, default=420.0, help="stop timing candidates after this")
    parser.add_argument("--tiny", action="store_true", help="CPU, Triton's interpreter, toy sizes (smoke run)")
    parser.add_argument("--int4", action="store_true", help="int4 experts (groups of 128; --tiny: of 16)")
    args = parser.parse_args(argv)
    if args.tiny and os.environ.get("TRITON_INTERPRET") != "1":  # Triton reads it once, when first imported
        raise SystemExit("--tiny runs in Triton's interpreter: TRITON_INTERPRET=1 python -m loadtest.bench_kernels "
                         "--moe-sweep --tiny")
    torch.manual_seed(0)
    return run_sweep(args) if args.moe_sweep else run_decode(args)

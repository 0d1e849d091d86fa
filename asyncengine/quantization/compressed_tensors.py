"""compressed-tensors checkpoints (`quant_method: compressed-tensors`, as llm-compressor writes them):

- FP8 float-quantized (W8A8 with per-tensor or per-channel weight scales, static per-tensor or dynamic per-token
  activation scales): the tensors of fp8.py (weight, weight_scale, input_scale). With block-wise weight scales
  (strategy block, the FP8_BLOCK preset): weight, weight_scale [ceil(N / bn), ceil(K / bk)], run weight-only.
- Integer weight-only pack-quantized (W4A16 / W8A16, group or channel scales, symmetric or asymmetric):
    weight_packed [N, K / pack] int32: values + 2**(bits-1) (stored unsigned) packed along the input dimension,
        value j of a word at bit offset bits * j;  weight_scale [N, G];  weight_zero_point [N / pack, G] int32
        (asymmetric only; packed along the output dimension, offset alike);  weight_shape [2] (not needed: dropped).
    W[n, k] = (q[n, k] - z[n, k / g]) * s[n, k / g], converted at load time to the engine's packed layout.
"""

from __future__ import annotations

import torch

from asyncengine.kernels.quant_reference import pack_int32, unpack_int32
from asyncengine.quantization.base import QuantizationConfig, decoder_layers_left_unquantized
from asyncengine.quantization.fp8 import Fp8Config, parse_block
from asyncengine.quantization.packed_int import PackedIntLinearMethod

_SUPPORTED = ("FP8 W8A8 (format float-quantized, one config group targeting Linear, weights float 8-bit "
              "symmetric static per tensor or channel, input activations float 8-bit static per tensor or "
              "dynamic per token; or weights per block, input activations dynamic or none) and W4A16 / W8A16 "
              "(format pack-quantized, weights int 4 or 8-bit, group or channel strategy, no activation "
              "quantization, no actorder)")


def _unsupported(what: str) -> ValueError:
    return ValueError(f"compressed-tensors checkpoint: {what} is not supported (supported: {_SUPPORTED})")


def _check_ignore(ignore: list) -> None:
    """Layers left unquantized: only the LM head and the MoE routers (which the engine never quantizes; llm-compressor
    lists them as e.g. `re:.*mlp.gate$`) are allowed."""
    others = decoder_layers_left_unquantized(ignore)
    if others:
        raise _unsupported(f"ignore list {others} (unquantized decoder layers)")


def _scheme(cfg: dict) -> dict:
    groups = list((cfg.get("config_groups") or {}).values())
    if len(groups) != 1:
        raise _unsupported(f"{len(groups)} config groups")
    group = groups[0]
    if [t for t in group.get("targets", []) if t != "Linear"]:
        raise _unsupported(f"targets {group.get('targets')}")
    return group


def _check_kv_cache_scheme(scheme) -> None:
    """kv_cache_scheme: static per-tensor FP8 scales of K and V, which the model loader reads (the k_scale /
    v_scale tensors, `models.layers.load_kv_scale`) and an FP8 KV cache (--kv-cache-dtype fp8) uses."""
    if not scheme:
        return
    _float8(scheme, "kv_cache_scheme")
    if scheme.get("strategy", "tensor") != "tensor" or scheme.get("dynamic"):
        raise ValueError(f"compressed-tensors checkpoint: kv_cache_scheme strategy {scheme.get('strategy')!r} "
                         f"(dynamic: {scheme.get('dynamic')}) is not supported (supported: float 8-bit symmetric "
                         "static per-tensor scales)")


def _float8(args: dict, what: str) -> None:
    if args.get("type") != "float" or args.get("num_bits") != 8:
        raise _unsupported(f"{what} of type {args.get('type')!r} with {args.get('num_bits')} bits")
    if args.get("symmetric") is False:
        raise _unsupported(f"asymmetric {what}")


class WNA16LinearMethod(PackedIntLinearMethod):
    """pack-quantized integer weights (module docstring) -> the engine's packed layout."""

    def __init__(self, bits: int, group_size: int, symmetric: bool):
        super().__init__(bits, group_size)
        self.symmetric = symmetric

    def checkpoint_tensors(self, in_features, out_features, dtype):
        if in_features % self.pack or out_features % self.pack:
            raise ValueError(f"compressed-tensors {self.bits}-bit layer of {in_features} inputs and {out_features} "
                             f"outputs: both must be multiples of {self.pack} (values per int32)")
        groups = -(-in_features // self.layer_group_size(in_features))
        tensors = {"weight_packed": ((out_features, in_features // self.pack), torch.int32, 1, 0),
                   "weight_scale": ((out_features, groups), dtype, 1, 0)}
        if not self.symmetric:
            tensors["weight_zero_point"] = ((out_features // self.pack, groups), torch.int32, 1, 0)
        return tensors

    def convert(self, tensors, in_features):
        q = unpack_int32(tensors["weight_packed"], self.bits, dim=1)  # [N, K], unsigned
        scales = tensors["weight_scale"].t()  # [G, N]
        if self.symmetric:
            zeros = torch.full_like(scales, float(2 ** (self.bits - 1)))
        else:
            zeros = unpack_int32(tensors["weight_zero_point"], self.bits, dim=0).t()  # [G, N]
        return pack_int32(q.t(), self.bits, dim=0), scales, zeros, None


class WNA16Config(QuantizationConfig):
    name = "compressed-tensors"

    def __init__(self, bits: int, group_size: int, symmetric: bool):
        self.bits, self.group_size, self.symmetric = bits, group_size, symmetric

    def linear_method(self):
        return WNA16LinearMethod(self.bits, self.group_size, self.symmetric)

    def skipped_checkpoint_tensors(self) -> tuple[str, ...]:
        return ("weight_shape",)

    def check_device(self, device):
        if device.type == "cuda" and self.bits != 4:
            raise ValueError(f"compressed-tensors W{self.bits}A16 has no CUDA kernel here (supported on CUDA: "
                             "W4A16; W8A16 runs on CPU)")

    def describe(self):
        return (f"compressed-tensors W{self.bits}A16 group {self.group_size}, "
                f"{'sym' if self.symmetric else 'asym'}")


def _pack_quantized(group: dict) -> WNA16Config:
    weights = group.get("weights") or {}
    if weights.get("type") != "int" or weights.get("num_bits") not in (4, 8):
        raise _unsupported(f"pack-quantized weights of type {weights.get('type')!r} with {weights.get('num_bits')} "
                           "bits")
    if group.get("input_activations"):
        raise _unsupported("pack-quantized weights with quantized input activations")
    if weights.get("actorder") or weights.get("dynamic"):
        raise _unsupported(f"pack-quantized actorder {weights.get('actorder')!r} / dynamic weights")
    strategy = weights.get("strategy")
    if strategy not in ("group", "channel"):
        raise _unsupported(f"pack-quantized weight strategy {strategy!r}")
    group_size = int(weights["group_size"]) if strategy == "group" else -1
    return WNA16Config(int(weights["num_bits"]), group_size, bool(weights.get("symmetric", True)))


def _fp8_block(weights: dict, inputs) -> Fp8Config:
    """FP8 weights with block-wise scales (the FP8_BLOCK preset: `weight_scale` [ceil(N / bn), ceil(K / bk)]), run
    weight-only as fp8.py's block-wise checkpoints: the inputs' scheme may be absent or dynamic (per token or per
    group), whose quantization the engine leaves out; static input scales are refused."""
    block = parse_block(weights.get("block_structure"), "block_structure")
    if inputs:
        _float8(inputs, "input activations")
        if not inputs.get("dynamic"):
            raise _unsupported("block-wise FP8 weights with static input activation scales")
    return Fp8Config("compressed-tensors", serialized=True, per_channel=False, static_input=False, block=block,
                     block_scale_name="weight_scale")


def compressed_tensors_config(cfg: dict) -> QuantizationConfig:
    """The format of a compressed-tensors quantization_config (ValueError saying what is supported)."""
    fmt = cfg.get("format")
    if fmt not in ("float-quantized", "naive-quantized", "pack-quantized"):
        raise _unsupported(f"format {fmt!r}")
    _check_kv_cache_scheme(cfg.get("kv_cache_scheme"))
    _check_ignore(cfg.get("ignore"))
    group = _scheme(cfg)
    if fmt == "pack-quantized":
        return _pack_quantized(group)
    weights, inputs = group.get("weights") or {}, group.get("input_activations")
    _float8(weights, "weights")
    if weights.get("strategy") not in ("tensor", "channel", "block") or weights.get("dynamic"):
        raise _unsupported(f"weight strategy {weights.get('strategy')!r} (dynamic: {weights.get('dynamic')})")
    if weights["strategy"] == "block":
        return _fp8_block(weights, inputs)
    if inputs is None:
        raise _unsupported("weight-only FP8 (no input_activations)")
    _float8(inputs, "input activations")
    dynamic = bool(inputs.get("dynamic"))
    if (inputs.get("strategy"), dynamic) not in (("tensor", False), ("token", True), ("tensor", True)):
        raise _unsupported(f"input activation strategy {inputs.get('strategy')!r} with dynamic {dynamic}")
    return Fp8Config("compressed-tensors", serialized=True, per_channel=weights["strategy"] == "channel",
                     static_input=not dynamic)

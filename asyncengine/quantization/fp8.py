"""FP8 e4m3 weights (W8A8): checkpoints serialized in FP8 (`quant_method: fp8`, or compressed-tensors'
float-quantized layout) and `--quantization fp8` of a bf16/fp32 checkpoint (quantized per channel at load time).

Checkpoint tensors of a linear layer with K inputs and N outputs:
    weight [N, K] float8_e4m3fn;  weight_scale: [] or [1] (per tensor) or [N, 1] (per output channel);
    input_scale: [] or [1], present for static activation scales (dynamic: per-token scales computed at run time).
Block-wise checkpoints (`weight_block_size: [bn, bk]`, as Qwen3-*-FP8 and DeepSeek publish them; compressed-tensors'
block strategy) hold one scale per [bn, bk] block of W instead: weight_scale_inv (or compressed-tensors'
weight_scale) [ceil(N / bn), ceil(K / bk)]. After loading they become group scales [ceil(K / bk), N]
(quant_reference.fp8_group_scales) and run weight-only at every batch size (x is not quantized: closer to the
dequantized weights than the checkpoint's per-group W8A8, and no FP8 tensor cores in prefill): our decode GEMV up to
`gemv_max_m`, above it each weight dequantized to x's dtype for the call, then the library's GEMM. Fused shards and
tensor-parallel slices must fall on whole blocks (a ValueError at load otherwise).
Fused layers (q/k/v, gate/up) load one per-tensor scale per shard, so weight scales are kept per output row
([N, 1], exact: no requantization), and become one scale [] after loading when all rows agree (a layer that is
not fused, or shards with equal scales); kernels take either. Static input scales of fused shards reduce to
their largest (the shards share the input).
On CUDA activations are quantized (static per tensor, or dynamic per token) and multiplied in FP8, except for
decode-sized batches where our weight-only FP8 GEMV (x unquantized, measured faster at start-up) runs. Each layer
shape takes, by batch size M, each measured at start-up against the next: the GEMV up to `gemv_max_m`, our W8A8
GEMM (kernels/fp8_gemm.py) up to `gemm_max_m`, torch._scaled_mm above. The W8A8 products take the input's
per-token e4m3 copy from the norm or activation kernel that made the input, where it made one (`takes_fp8_input`:
one launch fewer per product). On CPU the torch reference dequantizes the
weight and multiplies in the activations' dtype (activations stay unquantized).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from asyncengine import ops
from asyncengine.distributed.parallel_state import tp_size
from asyncengine.kernels.quant_reference import (FP8_DTYPE, Fp8Activation, dequantize_fp8, fp8_group_scales,
                                                 quantize_fp8)
from asyncengine.quantization.base import (LinearMethod, QuantizationConfig, decoder_layers_left_unquantized,
                                           quantized_after_loading, set_weight_attrs, to_target_device)


def _param(*shape: int, dtype: torch.dtype, **dims) -> nn.Parameter:
    return set_weight_attrs(nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False), **dims)


class Fp8LinearMethod(LinearMethod):
    """serialized: the checkpoint holds FP8 weights and scales; else the model-dtype weight is quantized per
    output channel after loading. per_channel: the checkpoint's weight scales are per output channel.
    static_input: the checkpoint holds per-tensor activation scales (else per-token scales at run time).
    block: (bn, bk) of block-wise weight scales, stored in the checkpoint as `block_scale_name` (module docstring)."""

    def __init__(self, serialized: bool, per_channel: bool, static_input: bool,
                 block: Optional[tuple[int, int]] = None, block_scale_name: str = "weight_scale_inv"):
        self.serialized, self.per_channel, self.static_input = serialized, per_channel, static_input
        self.block, self.block_scale_name = block, block_scale_name

    def create_weights(self, layer, in_per_rank, out_per_rank, dtype):
        layer.activation_dtype = dtype
        if self.block is not None:
            self._create_block_weights(layer, in_per_rank, out_per_rank)
            return
        if not self.serialized:  # waits in host memory until its layer is loaded and quantized
            layer.register_parameter("weight", quantized_after_loading(out_per_rank, in_per_rank, dtype=dtype,
                                                                       output_dim=0, input_dim=1))
            return
        layer.register_parameter("weight", _param(out_per_rank, in_per_rank, dtype=FP8_DTYPE, output_dim=0,
                                                  input_dim=1))
        # One scale per output row while loading, whether the checkpoint's are per tensor or per channel.
        layer.register_parameter("weight_scale", _param(out_per_rank, 1, dtype=torch.float32, output_dim=0))
        if self.static_input:
            layer.register_parameter("input_scale", _param(out_per_rank, 1, dtype=torch.float32, output_dim=0))

    def _create_block_weights(self, layer, in_per_rank, out_per_rank):
        block_n, block_k = self.block
        if tp_size() > 1 and (out_per_rank % block_n or in_per_rank % block_k):
            raise ValueError(f"FP8 block-wise scales of blocks [{block_n}, {block_k}]: a tensor-parallel slice of "
                             f"[{out_per_rank}, {in_per_rank}] does not fall on whole blocks (choose a "
                             "tensor_parallel_size that splits each layer into multiples of the block)")
        layer.register_parameter("weight", _param(out_per_rank, in_per_rank, dtype=FP8_DTYPE, output_dim=0,
                                                  input_dim=1))
        layer.register_parameter(self.block_scale_name, _param(-(-out_per_rank // block_n), -(-in_per_rank // block_k),
                                                               dtype=torch.float32, output_dim=0, input_dim=1))

    def _process_block_weights(self, layer):
        """Block scales -> group scales [G, N] (`weight_scale`, group size bk), then the decode GEMV's batch sizes
        measured against dequantize + the library's GEMM (the path above them)."""
        block_n, block_k = self.block
        weight = layer.weight
        group_scales = fp8_group_scales(getattr(layer, self.block_scale_name).data, block_n, weight.shape[0])
        if self.block_scale_name != "weight_scale":
            delattr(layer, self.block_scale_name)
        layer.weight_scale = nn.Parameter(group_scales, requires_grad=False)
        layer.input_scale, layer.group_size = None, block_k
        key = ("fp8-groups", *weight.shape, block_k)
        layer.gemv_max_m = ops.decode_gemv_max_m(
            key, lambda x, ws: ops.dense_gemv(x, ws[0], None, ws[1], group_size=block_k),
            lambda x, ws: ops.fp8_group_linear(x, ws[0], ws[1], block_k), (weight, layer.weight_scale),
            weight.shape[1], layer.activation_dtype, weight.device)

    def process_weights_after_loading(self, layer):
        if self.block is not None:
            self._process_block_weights(layer)
            return
        if not self.serialized:
            weight, scale = quantize_fp8(to_target_device(layer.weight), dim=-1)  # [N, K] fp8, [N, 1]
        else:  # per-tensor scales stay per row: fused shards keep their own (exact, no requantization)
            weight, scale = layer.weight.data, layer.weight_scale.data
            if torch.all(scale == scale[0]):  # one value after all: kernels may take the per-tensor form
                scale = scale[0].reshape(())
        layer.weight = nn.Parameter(weight, requires_grad=False)
        layer.weight_scale = nn.Parameter(scale, requires_grad=False)
        if self.static_input:  # fused shards each saw the same input: the largest of their scales covers all
            layer.input_scale = nn.Parameter(layer.input_scale.data.max().reshape(()), requires_grad=False)
        else:
            layer.input_scale = None
        # Each path measured against the next at start-up: our W8A8 GEMM against torch._scaled_mm (run 91:
        # cuBLASLt streams the weight at 40-60% of the bandwidth at M = 64-256 on an H100), then our weight-only FP8
        # GEMV (x unquantized) against whichever of the two serves that batch size.
        w, s, input_scale = layer.weight, layer.weight_scale, layer.input_scale
        key, k, dtype = ("fp8", *w.shape, s.numel() == 1, input_scale is None), w.shape[1], layer.activation_dtype
        gemm_max_m = ops.fp8_gemm_max_m(key, lambda x, ws: ops.fp8_gemm_linear(x, ws[0], ws[1], input_scale),
                                        lambda x, ws: ops.fp8_linear(x, ws[0], ws[1], input_scale), (w, s), k, dtype,
                                        w.device)

        def w8a8(x, ws):
            if x.shape[0] <= gemm_max_m:
                return ops.fp8_gemm_linear(x, ws[0], ws[1], input_scale)
            return ops.fp8_linear(x, ws[0], ws[1], input_scale)

        layer.gemv_max_m = ops.decode_gemv_max_m(key, lambda x, ws: ops.dense_gemv(x, ws[0], None, ws[1]), w8a8,
                                                 (w, s), k, dtype, w.device)
        layer.gemm_max_m = max(gemm_max_m, layer.gemv_max_m)

    def takes_fp8_input(self, layer, m):
        """On CUDA, with per-token activation scales, for the batch sizes that the W8A8 products serve (above the
        weight-only GEMV's)."""
        return (self.block is None and layer.weight.is_cuda and layer.input_scale is None
                and m > layer.gemv_max_m)

    def apply(self, layer, x, bias):
        """x: [T, K], or an Fp8Activation (x with its per-token e4m3 copy; see takes_fp8_input) -> [T, N]."""
        quantized = None
        if isinstance(x, Fp8Activation):
            x, quantized = x.value, x
        if self.block is not None:  # weight-only at every size (the module docstring says why)
            if x.shape[0] <= layer.gemv_max_m:
                return ops.dense_gemv(x, layer.weight, bias, layer.weight_scale, group_size=layer.group_size)
            return ops.fp8_group_linear(x, layer.weight, layer.weight_scale, layer.group_size, bias)
        if x.device.type == "cpu":  # the reference: dequantize, then matmul (logged once at load)
            return F.linear(x, dequantize_fp8(layer.weight, layer.weight_scale, x.dtype), bias)
        if x.shape[0] <= layer.gemv_max_m:
            return ops.dense_gemv(x, layer.weight, bias, layer.weight_scale)
        if x.shape[0] <= layer.gemm_max_m:
            return ops.fp8_gemm_linear(x, layer.weight, layer.weight_scale, layer.input_scale, bias, quantized)
        return ops.fp8_linear(x, layer.weight, layer.weight_scale, layer.input_scale, bias, quantized)


class Fp8Config(QuantizationConfig):
    """name is "fp8" or "compressed-tensors", after the checkpoint's quant_method; block: (bn, bk) of block-wise
    weight scales, stored as block_scale_name."""

    def __init__(self, name: str, serialized: bool, per_channel: bool, static_input: bool,
                 block: Optional[tuple[int, int]] = None, block_scale_name: str = "weight_scale_inv"):
        self.name, self.serialized = name, serialized
        self.per_channel, self.static_input = per_channel, static_input
        self.block, self.block_scale_name = block, block_scale_name

    @classmethod
    def online(cls) -> "Fp8Config":
        """`--quantization fp8` on an unquantized checkpoint: per-channel weights, per-token activations."""
        return cls("fp8", serialized=False, per_channel=True, static_input=False)

    @classmethod
    def from_config(cls, cfg: dict) -> "Fp8Config":
        """quant_method "fp8" (as written by llm-compressor's predecessors and transformers' FP8 configs)."""
        kept = decoder_layers_left_unquantized(cfg.get("modules_to_not_convert") or cfg.get("ignored_layers"))
        if kept:
            raise ValueError(f"FP8 checkpoint with unquantized decoder layers {kept[:5]} (modules_to_not_convert) is "
                             "not supported (supported: every decoder linear in FP8; the LM head and MoE routers "
                             "stay unquantized)")
        scheme = cfg.get("activation_scheme", "dynamic")
        if scheme not in ("static", "dynamic"):
            raise ValueError(f"FP8 activation_scheme {scheme!r} is not supported (supported: static, dynamic)")
        if cfg.get("weight_block_size") is not None:
            block = parse_block(cfg["weight_block_size"], "weight_block_size")
            if scheme != "dynamic":
                raise ValueError(f"FP8 with block-wise weight scales needs dynamic activation scales "
                                 f"(activation_scheme 'dynamic'), got {scheme!r}")
            return cls("fp8", serialized=True, per_channel=False, static_input=False, block=block)
        return cls("fp8", serialized=True, per_channel=False, static_input=scheme == "static")

    def linear_method(self):
        return Fp8LinearMethod(self.serialized, self.per_channel, self.static_input, self.block,
                               self.block_scale_name)

    def check_device(self, device):
        if device.type == "cuda" and self.block is not None and self.block[1] % 16:
            raise ValueError(f"FP8 block-wise scales with blocks of {self.block[1]} inputs have no CUDA kernel here "
                             "(supported on CUDA: input blocks that are multiples of 16, such as 128)")
        if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
            raise ValueError(f"FP8 needs a GPU of compute capability 8.9 or newer (Ada, Hopper); "
                             f"{torch.cuda.get_device_name(device)} is not. Supported there: awq, gptq, or no "
                             "quantization")

    def describe(self):
        if self.block is not None:
            return (f"{self.name} fp8 e4m3 (checkpoint; block-wise weight scales {self.block[0]}x{self.block[1]}, "
                    "weight-only: activations stay unquantized; above the decode GEMV's batch sizes each weight is "
                    "dequantized to the model's dtype for its product)")
        weights = "per-channel" if self.per_channel else "per-tensor"
        if not self.serialized:
            weights += " (mixture-of-experts experts: per row and group of 128 inputs)"
        acts = "static per-tensor" if self.static_input else "dynamic per-token"
        origin = "checkpoint" if self.serialized else "quantized at load time, layer by layer"
        return f"{self.name} fp8 e4m3 ({origin}; {weights} weight scales, {acts} activation scales)"


def parse_block(value, field: str) -> tuple[int, int]:
    """[bn, bk] of a block-wise FP8 checkpoint (ValueError naming `field` unless two positive integers)."""
    if (not isinstance(value, (list, tuple)) or len(value) != 2
            or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value)):
        raise ValueError(f"FP8 {field} must be [block_n, block_k], two positive integers, got {value!r}")
    return int(value[0]), int(value[1])

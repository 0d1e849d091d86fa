"""FP8 e4m3 weights (W8A8): checkpoints serialized in FP8 (`quant_method: fp8`, or compressed-tensors'
float-quantized layout) and `--quantization fp8` of a bf16/fp32 checkpoint (quantized per channel at load time).

Checkpoint tensors of a linear layer with K inputs and N outputs:
    weight [N, K] float8_e4m3fn;  weight_scale: [] or [1] (per tensor) or [N, 1] (per output channel);
    input_scale: [] or [1], present for static activation scales (dynamic: per-token scales computed at run time).
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

import torch
import torch.nn.functional as F
from torch import nn

from asyncengine import ops
from asyncengine.kernels.quant_reference import FP8_DTYPE, Fp8Activation, dequantize_fp8, quantize_fp8
from asyncengine.quantization.base import LinearMethod, QuantizationConfig, set_weight_attrs


def _param(*shape: int, dtype: torch.dtype, **dims) -> nn.Parameter:
    return set_weight_attrs(nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False), **dims)


class Fp8LinearMethod(LinearMethod):
    """serialized: the checkpoint holds FP8 weights and scales; else the model-dtype weight is quantized per
    output channel after loading. per_channel: the checkpoint's weight scales are per output channel.
    static_input: the checkpoint holds per-tensor activation scales (else per-token scales at run time)."""

    def __init__(self, serialized: bool, per_channel: bool, static_input: bool):
        self.serialized, self.per_channel, self.static_input = serialized, per_channel, static_input

    def create_weights(self, layer, in_per_rank, out_per_rank, dtype):
        layer.activation_dtype = dtype
        if not self.serialized:
            layer.register_parameter("weight", _param(out_per_rank, in_per_rank, dtype=dtype, output_dim=0,
                                                      input_dim=1))
            return
        layer.register_parameter("weight", _param(out_per_rank, in_per_rank, dtype=FP8_DTYPE, output_dim=0,
                                                  input_dim=1))
        # One scale per output row while loading, whether the checkpoint's are per tensor or per channel.
        layer.register_parameter("weight_scale", _param(out_per_rank, 1, dtype=torch.float32, output_dim=0))
        if self.static_input:
            layer.register_parameter("input_scale", _param(out_per_rank, 1, dtype=torch.float32, output_dim=0))

    def process_weights_after_loading(self, layer):
        if not self.serialized:
            weight, scale = quantize_fp8(layer.weight.data, dim=-1)  # [N, K] fp8, [N, 1]
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
        return layer.weight.is_cuda and layer.input_scale is None and m > layer.gemv_max_m

    def apply(self, layer, x, bias):
        """x: [T, K], or an Fp8Activation (x with its per-token e4m3 copy; see takes_fp8_input) -> [T, N]."""
        quantized = None
        if isinstance(x, Fp8Activation):
            x, quantized = x.value, x
        if x.device.type == "cpu":  # the reference: dequantize, then matmul (logged once at load)
            return F.linear(x, dequantize_fp8(layer.weight, layer.weight_scale, x.dtype), bias)
        if x.shape[0] <= layer.gemv_max_m:
            return ops.dense_gemv(x, layer.weight, bias, layer.weight_scale)
        if x.shape[0] <= layer.gemm_max_m:
            return ops.fp8_gemm_linear(x, layer.weight, layer.weight_scale, layer.input_scale, bias, quantized)
        return ops.fp8_linear(x, layer.weight, layer.weight_scale, layer.input_scale, bias, quantized)


class Fp8Config(QuantizationConfig):
    """name is "fp8" or "compressed-tensors", after the checkpoint's quant_method."""

    def __init__(self, name: str, serialized: bool, per_channel: bool, static_input: bool):
        self.name, self.serialized = name, serialized
        self.per_channel, self.static_input = per_channel, static_input

    @classmethod
    def online(cls) -> "Fp8Config":
        """`--quantization fp8` on an unquantized checkpoint: per-channel weights, per-token activations."""
        return cls("fp8", serialized=False, per_channel=True, static_input=False)

    @classmethod
    def from_config(cls, cfg: dict) -> "Fp8Config":
        """quant_method "fp8" (as written by llm-compressor's predecessors and transformers' FP8 configs)."""
        if cfg.get("weight_block_size"):
            raise ValueError(f"FP8 with block-wise weight scales (weight_block_size {cfg['weight_block_size']}) is "
                             "not supported (supported: per-tensor and per-channel scales)")
        scheme = cfg.get("activation_scheme", "dynamic")
        if scheme not in ("static", "dynamic"):
            raise ValueError(f"FP8 activation_scheme {scheme!r} is not supported (supported: static, dynamic)")
        return cls("fp8", serialized=True, per_channel=False, static_input=scheme == "static")

    def linear_method(self):
        return Fp8LinearMethod(self.serialized, self.per_channel, self.static_input)

    def check_device(self, device):
        if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
            raise ValueError(f"FP8 needs a GPU of compute capability 8.9 or newer (Ada, Hopper); "
                             f"{torch.cuda.get_device_name(device)} is not. Supported there: awq, gptq, or no "
                             "quantization")

    def describe(self):
        weights = "per-channel" if self.per_channel else "per-tensor"
        acts = "static per-tensor" if self.static_input else "dynamic per-token"
        origin = "checkpoint" if self.serialized else "quantized at load time"
        return f"{self.name} fp8 e4m3 ({origin}; {weights} weight scales, {acts} activation scales)"

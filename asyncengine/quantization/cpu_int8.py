"""int8 W8A8 on CPU, quantized at load time (`quantization="int8"`, issue 17): opt-in, trades exact greedy
equality with float32 for speed.

Weights: one scale per output channel, quantized at load time from the float checkpoint to 7 bits ([-63, 63]).
Activations: one scale per token (row), chosen at run time from the row's largest magnitude. The product is
fbgemm's dynamic int8 linear (`torch.ops.quantized.linear_dynamic`, the int8 GEMM torch ships for x86 CPUs),
which quantizes its input with ONE scale for the whole tensor: each row is first divided by its own largest
magnitude, so that every row spans [-1, 1] and the tensor's single scale is in effect each row's, and the output
row is multiplied back. Why 7-bit weights: on AVX2 without VNNI the int8 GEMM multiplies uint8 activations by
int8 weights in pairs summed into int16 (vpmaddubsw), which saturates above 32767; 255 * 63 * 2 fits, 255 * 127
* 2 does not (measured: 8-bit weights with full-range activations were 8-17% off the exact product, 7-bit weights
within 1%).

Measured on the default model (64 prompts x 64 greedy tokens, interleaved with float32 in one process,
loadtest/RESULTS.md, issue 17): float32 took 1.13x its wall time on 2 threads (1.20x on 1 thread);
33 of the 64 greedy outputs are identical to float32's, the other 31 diverge somewhere in their 64 tokens (the
model is tiny and its top logits are close). fbgemm derives its one scale and zero point from the scaled
tensor's min and max, which are -1 and 1 when some row's largest magnitude is negative and some positive (the
usual case); otherwise the step is finer, so a row's rounding can depend, within a step, on its batch. The LM
head and embeddings stay float32, as with every other format. CPU only; float32 or bfloat16 activations (computed in
float32). fbgemm's quantized-tensor API is deprecated in torch 2.13 (the project pins 2.13.0); its warning is
silenced once, at load.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

from asyncengine.quantization.base import LinearMethod, QuantizationConfig, UnquantizedLinearMethod

WEIGHT_MAX = 63  # 7-bit weights: no int16 saturation in AVX2's u8 x s8 pair products (see the module docstring)


def quantize_weight_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] float -> (int8 [N, K] in [-WEIGHT_MAX, WEIGHT_MAX], scales [N] float32): weight ~ int8 *
    scale[:, None]. An all-zero row gets scale 1 (its int8 row is zero)."""
    w = weight.detach().float()
    scale = w.abs().amax(dim=1) / WEIGHT_MAX
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    return torch.round(w / scale[:, None]).clamp_(-WEIGHT_MAX, WEIGHT_MAX).to(torch.int8), scale


def prepack(weight_int8: torch.Tensor, scale: torch.Tensor):
    """fbgemm's packed form of a per-channel int8 weight [N, K] with scales [N]."""
    zero_points = torch.zeros(weight_int8.shape[0], dtype=torch.long)
    with warnings.catch_warnings():  # the quantized tensor is only the packing routine's input (deprecated API)
        warnings.filterwarnings("ignore", message=".*quantized tensor creation functions.*")
        quantized = torch._make_per_channel_quantized_tensor(weight_int8.contiguous(), scale.double(),
                                                             zero_points, 0)
    return torch.ops.quantized.linear_prepack(quantized, None)


def int8_linear(x: torch.Tensor, packed, bias=None) -> torch.Tensor:
    """x [T, K] -> [T, N] = x W^T (+ bias), x quantized to int8 with one scale per row (in float32)."""
    x32 = x.float()
    row_max = x32.abs().amax(dim=1, keepdim=True).clamp_min_(torch.finfo(torch.float32).tiny)  # [T, 1]
    out = torch.ops.quantized.linear_dynamic(x32 / row_max, packed, False).mul_(row_max)
    if bias is not None:
        out.add_(bias)
    return out.to(x.dtype)


class Int8LinearMethod(LinearMethod):
    """Loads the float weight as the unquantized method does, then replaces it by its int8 form:
    layer.weight int8 [N, K], layer.weight_scale [N] float32, layer.int8_packed (fbgemm's)."""

    def create_weights(self, layer, in_per_rank, out_per_rank, dtype):
        UnquantizedLinearMethod().create_weights(layer, in_per_rank, out_per_rank, dtype)

    def process_weights_after_loading(self, layer):
        weight, scale = quantize_weight_per_channel(layer.weight)
        layer.weight = nn.Parameter(weight, requires_grad=False)
        layer.weight_scale = nn.Parameter(scale, requires_grad=False)
        layer.int8_packed = prepack(weight, scale)

    def apply(self, layer, x, bias):
        return int8_linear(x, layer.int8_packed, bias)


class Int8Config(QuantizationConfig):
    """`quantization="int8"` on an unquantized checkpoint, on CPU."""

    name = "int8"

    def linear_method(self):
        return Int8LinearMethod()

    def check_device(self, device):
        if device.type != "cpu":
            raise ValueError(f"quantization 'int8' runs on CPU only (device {device}); on a GPU use fp8, awq or "
                             "gptq")

    def describe(self):
        return "int8 (quantized at load time; per-channel 7-bit weight scales, dynamic per-token activation scales)"

"""The contract between linear layers and weight formats.

A linear layer owns no weight of its own: its `LinearMethod` creates the parameters (one rank's slice) and applies
them. Each parameter says which of its dimensions is the layer's output and input dimension (`output_dim`,
`input_dim` attributes; None for a dimension it does not span), so the layers' weight loaders can cut a rank's
slice and place a fused layer's shards (q/k/v, gate/up) for any format, packed ones included: a shard's offset
and size along a dimension scale with the parameter's extent there (a weight packing 8 values per int32 along the
output dimension has 1/8 of the logical width there).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from asyncengine.quantization.cpu_prepacked import (cpu_onednn_weight, onednn_linear, onednn_rows,
                                                   use_cpu_gemm_layout)


def set_weight_attrs(param: nn.Parameter, **attrs) -> nn.Parameter:
    for key, value in attrs.items():
        setattr(param, key, value)
    return param


NEVER_QUANTIZED = ("lm_head", "gate", "shared_expert_gate")  # the LM head and the MoE routers, by their last name


def decoder_layers_left_unquantized(entries) -> list:
    """The entries of a checkpoint's list of unquantized modules (modules_to_not_convert, ignored_layers,
    compressed-tensors' ignore: names, suffixes or `re:` patterns) that name anything but the LM head and the MoE
    routers (Mixtral's `block_sparse_moe.gate`, which AutoAWQ lists as `gate`; Qwen's `mlp.gate` and
    `shared_expert_gate`), which the engine never quantizes: layers a format would misread if they were left in the
    model dtype."""
    def last_name(entry) -> str:
        return str(entry).removeprefix("re:").strip(".*$").replace("\\.", ".").rsplit(".", 1)[-1]

    return [entry for entry in entries or [] if last_name(entry) not in NEVER_QUANTIZED]


def quantized_after_loading(*shape: int, dtype: torch.dtype, **dims) -> nn.Parameter:
    """A model-dtype weight that is quantized once loaded (`--quantization fp8`). It waits in host memory, whatever
    device the model is built on (the default device when called, kept as the parameter's `target_device`), so that
    the unquantized model never has to fit on the accelerator: the loader processes each layer as soon as its
    shards are in (models/loader.py LayerwiseProcessing), and processing moves the weight to `target_device` and
    quantizes it there. Its pages stay uncommitted until loading writes them, so the host holds little more than
    the layers being loaded."""
    param = nn.Parameter(torch.empty(*shape, dtype=dtype, device="cpu"), requires_grad=False)
    return set_weight_attrs(param, target_device=torch.get_default_device(), **dims)


def to_target_device(weight: nn.Parameter) -> torch.Tensor:
    """The data of a `quantized_after_loading` weight on the device it is quantized for."""
    return weight.data.to(weight.target_device)


class LinearMethod(ABC):
    """Creates and applies one linear layer's weights in some format."""

    @abstractmethod
    def create_weights(self, layer: nn.Module, in_per_rank: int, out_per_rank: int, dtype: torch.dtype) -> None:
        """Register this rank's parameters on `layer` (logical shape [out_per_rank, in_per_rank]), each with its
        `output_dim` and `input_dim` attributes."""

    @abstractmethod
    def apply(self, layer: nn.Module, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        """x: [T, in_per_rank] -> [T, out_per_rank]."""

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Repack what was loaded into the layout `apply` wants (nothing by default)."""

    def takes_fp8_input(self, layer: nn.Module, m: int) -> bool:
        """Would `apply` on an M-row input use its per-token e4m3 copy? Then the kernel that makes the input may
        pass `apply` a quant_reference.Fp8Activation (the input with that copy) instead of a tensor. No by default."""
        return False


class UnquantizedLinearMethod(LinearMethod):
    """weight [out_per_rank, in_per_rank] in the model's dtype; y = x W^T (+ b).

    On CUDA, decode-sized batches (M up to `layer.gemv_max_m`, measured per shape at start-up) take our GEMV
    where it beat cuBLAS; everything else is F.linear."""

    def create_weights(self, layer, in_per_rank, out_per_rank, dtype):
        weight = nn.Parameter(torch.empty(out_per_rank, in_per_rank, dtype=dtype), requires_grad=False)
        layer.register_parameter("weight", set_weight_attrs(weight, output_dim=0, input_dim=1))

    def process_weights_after_loading(self, layer):
        """On CPU the weight is first re-stored column-major, the layout MKL's GEMM reads fastest (cpu_prepacked;
        same values and shape), and a float32 weight also gets a oneDNN-packed copy (`layer.onednn_weight`) where
        that measured faster on this machine. Then, on CUDA, the GEMV threshold is measured."""
        from asyncengine import ops

        use_cpu_gemm_layout(layer.weight)
        weight = layer.weight
        layer.onednn_weight = cpu_onednn_weight(weight, layer.matmul_takes_bias)
        layer.gemv_max_m = ops.decode_gemv_max_m(
            ("dense", *weight.shape, weight.dtype), lambda x, w: ops.dense_gemv(x, w[0]),
            lambda x, w: F.linear(x, w[0]), (weight,), weight.shape[1], weight.dtype, weight.device)

    def apply(self, layer, x, bias):
        packed = getattr(layer, "onednn_weight", None)
        if packed is not None and x.device.type == "cpu" and x.dtype == torch.float32 and onednn_rows(x.shape[0]):
            return onednn_linear(x, packed, bias)
        if x.shape[0] <= getattr(layer, "gemv_max_m", 0):
            from asyncengine import ops

            return ops.dense_gemv(x, layer.weight, bias)
        return F.linear(x, layer.weight, bias)


class QuantizationConfig(ABC):
    """One checkpoint's weight format, parsed from config.json's `quantization_config` (or `--quantization`).

    Contract: `linear_method()` gives the method every quantized linear layer of the model uses (the LM head and
    embeddings stay unquantized); `check_device(device)` raises ValueError at start-up, saying what is supported,
    when this format cannot run on `device`.
    """

    name: str  # vLLM's spelling: awq, gptq, fp8, compressed-tensors

    @abstractmethod
    def linear_method(self) -> LinearMethod:
        """The LinearMethod of this format."""

    def check_device(self, device: torch.device) -> None:
        """ValueError when this format cannot run on `device` (all formats run on CPU through the references)."""

    def describe(self) -> str:
        """One line for the start-up log."""
        return self.name

    def skipped_checkpoint_tensors(self) -> tuple[str, ...]:
        """Name suffixes of checkpoint tensors this format does not need (the loader drops them)."""
        return ()

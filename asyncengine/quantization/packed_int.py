"""Integer weight-only formats (AWQ, GPTQ): after loading, all of them hold the engine's packed layout.

A format's `create_weights` registers its checkpoint's tensors as they are stored; its `convert` turns them into
the layout of `kernels/quant_reference.py` (qweight [K / pack, N] int32 packed along the input dimension, scales
and zeros [G, N]), so one kernel family and one reference serve every format. A GPTQ checkpoint with act-order
(desc_act) gets its input rows sorted by group at load time, and `apply` gathers x's columns in the same order.
"""

from __future__ import annotations

from abc import abstractmethod
from typing import Optional

import torch
from torch import nn

from asyncengine import ops
from asyncengine.quantization.base import LinearMethod, set_weight_attrs


def int_param(*shape: int, dtype: torch.dtype = torch.int32, **dims) -> nn.Parameter:
    """An empty parameter for a checkpoint tensor, with its output_dim / input_dim attributes."""
    param = nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)
    return set_weight_attrs(param, **dims)


class PackedIntLinearMethod(LinearMethod):
    """Shared by AWQ and GPTQ: `apply` on the engine's layout; subclasses create and convert their tensors."""

    def __init__(self, bits: int, group_size: int):
        self.bits = bits
        self.pack = 32 // bits
        self.group_size = group_size  # -1: one group spanning the whole input dimension

    def layer_group_size(self, in_per_rank: int) -> int:
        return in_per_rank if self.group_size == -1 else self.group_size

    @abstractmethod
    def checkpoint_tensors(self, in_features: int, out_features: int, dtype: torch.dtype) -> dict[str, tuple]:
        """The checkpoint's tensors of one [out_features, in_features] layer, as stored: name -> (shape, dtype,
        input_dim, output_dim), a dimension None where the tensor does not span it. ValueError for a layer the
        format cannot hold."""

    @abstractmethod
    def convert(self, tensors: dict[str, torch.Tensor], in_features: int
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
        """One layer's loaded checkpoint tensors (by name) -> (qweight [K' / pack, N] int32, scales [G, N], zeros
        [G, N], input_perm [K'] or None). K' = K, unless the format regrouped the inputs into uniform groups of
        K' / G with zero-weight padding rows (GPTQ act-order split over ranks), x gathered by input_perm."""

    def checkpoint_names(self) -> tuple[str, ...]:
        """The names of the checkpoint's tensors of a layer (parameters until converted)."""
        size = self.pack * max(self.group_size, 1)  # a layer every format can hold: whole words, whole groups
        return tuple(self.checkpoint_tensors(size, size, torch.float16))

    def create_weights(self, layer, in_per_rank, out_per_rank, dtype):
        for name, (shape, tensor_dtype, input_dim, output_dim) in self.checkpoint_tensors(
                in_per_rank, out_per_rank, dtype).items():
            layer.register_parameter(name, int_param(*shape, dtype=tensor_dtype, input_dim=input_dim,
                                                     output_dim=output_dim))

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        tensors = {name: getattr(layer, name).data for name in self.checkpoint_names()}
        qweight, scales, zeros, perm = self.convert(tensors, layer.in_per_rank)
        for name in self.checkpoint_names():
            delattr(layer, name)
        layer.qweight = nn.Parameter(qweight.contiguous(), requires_grad=False)
        layer.scales = nn.Parameter(scales.contiguous(), requires_grad=False)
        layer.zeros = nn.Parameter(zeros.to(scales.dtype).contiguous(), requires_grad=False)
        layer.input_perm = None if perm is None else nn.Parameter(perm, requires_grad=False)
        inputs = qweight.shape[0] * self.pack
        # a format that regrouped the inputs (GPTQ act-order split over ranks) left uniform groups of K' / G
        layer.group_size = (self.layer_group_size(layer.in_per_rank) if inputs == layer.in_per_rank
                            else inputs // scales.shape[0])

    def apply(self, layer, x, bias):
        """x: [T, K] -> [T, N]."""
        if layer.input_perm is not None:  # act-order: rows were sorted by group at load time
            x = x.index_select(-1, layer.input_perm)
        return ops.int_weight_linear(x, layer.qweight, layer.scales, layer.zeros, layer.group_size, self.bits, bias)

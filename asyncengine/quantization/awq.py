"""AWQ int4 checkpoints in AutoAWQ's "gemm" layout (`quant_method: awq`, `version: gemm`).

Checkpoint tensors of a linear layer with K inputs, N outputs and group size g:
    qweight [K, N / 8] int32, qzeros [K / g, N / 8] int32: 8 four-bit values per word along the output dimension,
        logical column i of a word at nibble slot AWQ_ORDER[i] (AutoAWQ packs columns 0, 2, 4, 6, 1, 3, 5, 7 into
        slots 0..7);
    scales [K / g, N] (fp16);  W[k, n] = (q[k, n] - z[k / g, n]) * s[k / g, n],  y = x @ W.
"""

from __future__ import annotations

import torch

from asyncengine.kernels.quant_reference import pack_int32, unpack_int32
from asyncengine.quantization.base import QuantizationConfig, decoder_layers_left_unquantized
from asyncengine.quantization.packed_int import PackedIntLinearMethod

AWQ_ORDER = [0, 4, 1, 5, 2, 6, 3, 7]  # AWQ_ORDER[i]: the nibble slot holding logical column i of a word


class AWQLinearMethod(PackedIntLinearMethod):
    def checkpoint_tensors(self, in_features, out_features, dtype):
        g = self.layer_group_size(in_features)
        if in_features % g or out_features % self.pack:
            raise ValueError(f"AWQ layer of {in_features} inputs and {out_features} outputs does not fit group size "
                             f"{g} (inputs must be a multiple) and 8 outputs per int32")
        return {"qweight": ((in_features, out_features // 8), torch.int32, 0, 1),
                "qzeros": ((in_features // g, out_features // 8), torch.int32, 0, 1),
                "scales": ((in_features // g, out_features), dtype, 0, 1)}

    def convert(self, tensors, in_features):
        q = unpack_int32(tensors["qweight"], 4, dim=1, order=AWQ_ORDER)  # [K, N]
        zeros = unpack_int32(tensors["qzeros"], 4, dim=1, order=AWQ_ORDER)  # [G, N]
        return pack_int32(q, 4, dim=0), tensors["scales"], zeros, None


class AWQConfig(QuantizationConfig):
    name = "awq"

    def __init__(self, bits: int, group_size: int, zero_point: bool, version: str):
        if bits != 4:
            raise ValueError(f"AWQ with {bits} bits is not supported (supported: 4)")
        if version.lower() != "gemm":
            raise ValueError(f"AWQ version {version!r} is not supported (supported: gemm, AutoAWQ's default)")
        if not zero_point:
            raise ValueError("AWQ without zero points (zero_point: false) is not supported "
                             "(supported: zero_point true)")
        if group_size < 1:
            raise ValueError(f"AWQ group_size must be positive, got {group_size}")
        self.bits, self.group_size = bits, group_size

    @classmethod
    def from_config(cls, cfg: dict) -> "AWQConfig":
        bits = cfg.get("bits", cfg.get("w_bit"))
        group_size = cfg.get("group_size", cfg.get("q_group_size"))
        if bits is None or group_size is None:
            raise ValueError("quantization_config of an AWQ checkpoint needs bits (w_bit) and group_size "
                             "(q_group_size)")
        kept = decoder_layers_left_unquantized(cfg.get("modules_to_not_convert"))
        if kept:  # Mixtral's AWQ checkpoints list its routers ("gate"), which the engine never quantizes
            raise ValueError(f"AWQ modules_to_not_convert {kept} is not supported (supported: every linear layer of "
                             "the decoder quantized; the LM head and MoE routers may be listed)")
        return cls(int(bits), int(group_size), bool(cfg.get("zero_point", True)), str(cfg.get("version", "gemm")))

    def linear_method(self):
        return AWQLinearMethod(self.bits, self.group_size)

    def describe(self):
        return f"awq int{self.bits} group {self.group_size}"

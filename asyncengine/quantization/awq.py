"""AWQ int4 checkpoints in AutoAWQ's "gemm" layout (`quant_method: awq`, `version: gemm`).

Checkpoint tensors of a linear layer with K inputs, N outputs and group size g:
    qweight [K, N / 8] int32, qzeros [K / g, N / 8] int32: 8 four-bit values per word along the output dimension,
        logical column i of a word at nibble slot AWQ_ORDER[i] (AutoAWQ packs columns 0, 2, 4, 6, 1, 3, 5, 7 into
        slots 0..7);
    scales [K / g, N] (fp16);  W[k, n] = (q[k, n] - z[k / g, n]) * s[k / g, n],  y = x @ W.
"""

from __future__ import annotations

from asyncengine.kernels.quant_reference import pack_int32, unpack_int32
from asyncengine.quantization.base import QuantizationConfig
from asyncengine.quantization.packed_int import PackedIntLinearMethod, int_param

AWQ_ORDER = [0, 4, 1, 5, 2, 6, 3, 7]  # AWQ_ORDER[i]: the nibble slot holding logical column i of a word


class AWQLinearMethod(PackedIntLinearMethod):
    def create_weights(self, layer, in_per_rank, out_per_rank, dtype):
        g = self.layer_group_size(in_per_rank)
        if in_per_rank % g or out_per_rank % self.pack:
            raise ValueError(f"AWQ layer of {in_per_rank} inputs and {out_per_rank} outputs does not fit group size "
                             f"{g} (inputs must be a multiple) and 8 outputs per int32")
        layer.register_parameter("qweight", int_param(in_per_rank, out_per_rank // 8, input_dim=0, output_dim=1))
        layer.register_parameter("qzeros", int_param(in_per_rank // g, out_per_rank // 8, input_dim=0, output_dim=1))
        layer.register_parameter("scales", int_param(in_per_rank // g, out_per_rank, dtype=dtype, input_dim=0,
                                                     output_dim=1))

    def checkpoint_names(self):
        return ("qweight", "qzeros", "scales")

    def convert(self, layer):
        q = unpack_int32(layer.qweight.data, 4, dim=1, order=AWQ_ORDER)  # [K, N]
        zeros = unpack_int32(layer.qzeros.data, 4, dim=1, order=AWQ_ORDER)  # [G, N]
        return pack_int32(q, 4, dim=0), layer.scales.data, zeros, None


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
        if cfg.get("modules_to_not_convert"):
            raise ValueError(f"AWQ modules_to_not_convert {cfg['modules_to_not_convert']} is not supported "
                             "(supported: every linear layer of the decoder quantized)")
        return cls(int(bits), int(group_size), bool(cfg.get("zero_point", True)), str(cfg.get("version", "gemm")))

    def linear_method(self):
        return AWQLinearMethod(self.bits, self.group_size)

    def describe(self):
        return f"awq int{self.bits} group {self.group_size}"

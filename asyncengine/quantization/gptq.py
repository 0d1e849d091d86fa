"""GPTQ checkpoints (`quant_method: gptq`), 4 or 8 bits, symmetric or asymmetric, with or without act-order.

Checkpoint tensors of a linear layer with K inputs, N outputs, group size g, pack = 32 / bits:
    qweight [K / pack, N] int32: values packed along the input dimension (value j of row r is input pack*r + j);
    qzeros [G, N / pack] int32: zero points packed along the output dimension, stored minus one
        (checkpoint_format "gptq", the original format; "gptq_v2" stores them as they are);
    scales [G, N] (fp16); g_idx [K] int32: the group of each input (k / g without act-order; with desc_act the
        groups follow the order in which GPTQ quantized the columns).
    W[k, n] = (q[k, n] - z[g_idx[k], n]) * s[g_idx[k], n],  y = x @ W.
"""

from __future__ import annotations

import torch

from asyncengine.kernels.quant_reference import pack_int32, unpack_int32
from asyncengine.quantization.base import QuantizationConfig
from asyncengine.quantization.packed_int import PackedIntLinearMethod


class GPTQLinearMethod(PackedIntLinearMethod):
    def __init__(self, bits: int, group_size: int, zeros_minus_one: bool):
        super().__init__(bits, group_size)
        self.zeros_minus_one = zeros_minus_one

    def checkpoint_tensors(self, in_features, out_features, dtype):
        if in_features % self.pack or out_features % self.pack:
            raise ValueError(f"GPTQ {self.bits}-bit layer of {in_features} inputs and {out_features} outputs: both "
                             f"must be multiples of {self.pack} (values per int32)")
        groups = -(-in_features // self.layer_group_size(in_features))
        return {"qweight": ((in_features // self.pack, out_features), torch.int32, 0, 1),
                "qzeros": ((groups, out_features // self.pack), torch.int32, 0, 1),
                "scales": ((groups, out_features), dtype, 0, 1),
                "g_idx": ((in_features,), torch.int32, 0, None)}

    def convert(self, tensors, in_features):
        q = tensors["qweight"]
        zeros = unpack_int32(tensors["qzeros"], self.bits, dim=1)  # [G, N]
        if self.zeros_minus_one:
            zeros = zeros + 1
        g_idx = tensors["g_idx"].long()
        if g_idx.numel() and bool((g_idx.diff() >= 0).all()):  # in group order: a rank's slice of the inputs
            g_idx = g_idx - g_idx[0]  # counts groups from its first (tensor parallelism: its scales' first row)
        group_size = self.layer_group_size(in_features)
        contiguous = torch.arange(g_idx.numel(), device=g_idx.device) // group_size
        if torch.equal(g_idx, contiguous):
            return q, tensors["scales"], zeros, None
        if int(g_idx.max()) >= -(-in_features // group_size):  # groups beyond this slice's own scales
            raise ValueError("GPTQ act-order (desc_act) on a layer split over tensor-parallel ranks along its inputs "
                             "(o_proj, down_proj) is not supported: each rank's inputs draw on every group's scales "
                             "(supported: desc_act false, or tensor_parallel_size 1)")
        # act-order: sort the inputs by group so each group's rows are contiguous again; x is gathered alike.
        perm = torch.argsort(g_idx, stable=True)
        if not torch.equal(g_idx[perm], contiguous):
            raise ValueError(f"GPTQ g_idx with groups of unequal size is not supported (group size {group_size})")
        q = pack_int32(unpack_int32(q, self.bits, dim=0)[perm], self.bits, dim=0)
        return q, tensors["scales"], zeros, perm


class GPTQConfig(QuantizationConfig):
    name = "gptq"

    def __init__(self, bits: int, group_size: int, desc_act: bool, sym: bool, checkpoint_format: str):
        if bits not in (4, 8):
            raise ValueError(f"GPTQ with {bits} bits is not supported (supported: 4, 8)")
        if group_size != -1 and group_size < 1:
            raise ValueError(f"GPTQ group_size must be positive or -1, got {group_size}")
        if checkpoint_format not in ("gptq", "gptq_v2"):
            raise ValueError(f"GPTQ checkpoint_format {checkpoint_format!r} is not supported (supported: gptq, "
                             "gptq_v2)")
        self.bits, self.group_size, self.desc_act, self.sym = bits, group_size, desc_act, sym
        self.checkpoint_format = checkpoint_format

    @classmethod
    def from_config(cls, cfg: dict) -> "GPTQConfig":
        if "bits" not in cfg or "group_size" not in cfg:
            raise ValueError("quantization_config of a GPTQ checkpoint needs bits and group_size")
        if cfg.get("lm_head"):
            raise ValueError("GPTQ with a quantized lm_head is not supported (supported: lm_head unquantized)")
        fmt = cfg.get("checkpoint_format") or cfg.get("format") or "gptq"
        return cls(int(cfg["bits"]), int(cfg["group_size"]), bool(cfg.get("desc_act", False)),
                   bool(cfg.get("sym", True)), str(fmt))

    def linear_method(self):
        return GPTQLinearMethod(self.bits, self.group_size, zeros_minus_one=self.checkpoint_format == "gptq")

    def check_device(self, device):
        if device.type == "cuda" and self.bits != 4:
            raise ValueError(f"GPTQ {self.bits}-bit has no CUDA kernel here (supported on CUDA: 4-bit GPTQ and "
                             "AWQ; 8-bit GPTQ runs on CPU)")

    def describe(self):
        act = ", act-order" if self.desc_act else ""
        return f"gptq int{self.bits} group {self.group_size}, {'sym' if self.sym else 'asym'}{act}"

"""GPTQ checkpoints (`quant_method: gptq`), 4 or 8 bits, symmetric or asymmetric, with or without act-order.

Checkpoint tensors of a linear layer with K inputs, N outputs, group size g, pack = 32 / bits:
    qweight [K / pack, N] int32: values packed along the input dimension (value j of row r is input pack*r + j);
    qzeros [G, N / pack] int32: zero points packed along the output dimension, stored minus one
        (checkpoint_format "gptq", the original format; "gptq_v2" stores them as they are);
    scales [G, N] (fp16); g_idx [K] int32: the group of each input (k / g without act-order; with desc_act the
        groups follow the order in which GPTQ quantized the columns).
    W[k, n] = (q[k, n] - z[g_idx[k], n]) * s[g_idx[k], n],  y = x @ W.

Act-order split over tensor-parallel ranks along the inputs (o_proj, down_proj): each rank's inputs belong to any
of the layer's groups, so such a layer keeps every group's scales and zero points on every rank, and its slice is
regrouped at load (`_regroup_act_order_slice`): the inputs sorted by group, each group's run padded with zero-weight
rows to a multiple of ACT_ORDER_SUB_GROUP, which becomes the layer's uniform group size (the kernels' layout). The
padding costs about half a sub-group of rows per group (logged once, with the share).
"""

from __future__ import annotations

import logging

import torch

from asyncengine.kernels.quant_reference import pack_int32, unpack_int32
from asyncengine.quantization.base import QuantizationConfig
from asyncengine.quantization.packed_int import PackedIntLinearMethod, int_param

logger = logging.getLogger(__name__)

ACT_ORDER_SUB_GROUP = 32  # the group size of an act-order slice after regrouping (16 where the group is not a multiple)
_regrouping_logged = False


class GPTQLinearMethod(PackedIntLinearMethod):
    def __init__(self, bits: int, group_size: int, zeros_minus_one: bool, desc_act: bool = False):
        super().__init__(bits, group_size)
        self.zeros_minus_one = zeros_minus_one
        self.desc_act = desc_act

    def create_weights(self, layer, in_per_rank, out_per_rank, dtype):
        super().create_weights(layer, in_per_rank, out_per_rank, dtype)
        ranks = getattr(layer, "input_ranks", 1)
        if self.desc_act and ranks > 1 and self.group_size != -1:  # every group's scales and zeros on every rank
            groups = -(-in_per_rank * ranks // self.group_size)
            layer.scales = int_param(groups, out_per_rank, dtype=dtype, input_dim=None, output_dim=1)
            layer.qzeros = int_param(groups, out_per_rank // self.pack, input_dim=None, output_dim=1)

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
        q, scales = tensors["qweight"], tensors["scales"]
        zeros = unpack_int32(tensors["qzeros"], self.bits, dim=1)  # [G, N]
        if self.zeros_minus_one:
            zeros = zeros + 1
        g_idx = tensors["g_idx"].long()
        group_size = self.layer_group_size(in_features)
        own_groups = -(-in_features // group_size)
        if g_idx.numel() and bool((g_idx.diff() >= 0).all()):  # in group order: a rank's slice of the inputs
            first = int(g_idx[0])
            g_idx = g_idx - first  # counts groups from its first (tensor parallelism: its scales' first row)
            if scales.shape[0] > own_groups:  # every group's scales on this rank (create_weights): its own rows
                scales, zeros = scales[first:first + own_groups], zeros[first:first + own_groups]
        contiguous = torch.arange(g_idx.numel(), device=g_idx.device) // group_size
        if torch.equal(g_idx, contiguous):
            return q, scales, zeros, None
        if scales.shape[0] > own_groups:  # act-order, this rank's slice of the inputs
            return self._regroup_act_order_slice(q, scales, zeros, g_idx)
        if int(g_idx.max()) >= own_groups:
            raise ValueError("GPTQ g_idx is not in group order (act-order) but quantization_config says desc_act "
                             "false: the checkpoint contradicts itself")
        # act-order: sort the inputs by group so each group's rows are contiguous again; x is gathered alike.
        perm = torch.argsort(g_idx, stable=True)
        if not torch.equal(g_idx[perm], contiguous):
            raise ValueError(f"GPTQ g_idx with groups of unequal size is not supported (group size {group_size})")
        q = pack_int32(unpack_int32(q, self.bits, dim=0)[perm], self.bits, dim=0)
        return q, scales, zeros, perm

    def _regroup_act_order_slice(self, q, scales, zeros, g_idx):
        """One rank's act-order slice of K inputs, each in any of the layer's G groups (scales, zeros [G, N]) ->
        (qweight [K' / pack, N], scales and zeros [K' / s, N], input_perm [K']) in groups of s =
        ACT_ORDER_SUB_GROUP: the inputs sorted by group, each group's run padded to a multiple of s with rows whose
        code equals the zero point (weight exactly 0; their input is gathered from input 0)."""
        sub = ACT_ORDER_SUB_GROUP if self.group_size % ACT_ORDER_SUB_GROUP == 0 else 16
        if int(zeros.max()) >= 1 << self.bits:  # a gptq-format asymmetric zero point of 0 reads as 2**bits
            raise ValueError(f"GPTQ act-order split over tensor-parallel ranks needs zero points below {1 << self.bits}"
                             f" for its padding rows, and this layer has one of {int(zeros.max())}; supported: "
                             "tensor_parallel_size 1")
        num_groups, k = scales.shape[0], g_idx.numel()
        order = torch.argsort(g_idx, stable=True)  # this slice's inputs by group
        counts = torch.bincount(g_idx, minlength=num_groups)  # [G] inputs of each group here
        padded = (counts + sub - 1) // sub * sub
        starts = torch.cumsum(padded, 0) - padded  # [G] each group's first row after regrouping
        sorted_groups = g_idx[order]
        within = torch.arange(k, device=g_idx.device) - (torch.cumsum(counts, 0) - counts)[sorted_groups]
        rows = starts[sorted_groups] + within  # [K] the new row of each sorted input
        group_of_row = torch.repeat_interleave(torch.arange(num_groups, device=g_idx.device), padded)  # [K']
        values = zeros[group_of_row].to(torch.int32)  # padding rows: q = z
        values[rows] = unpack_int32(q, self.bits, dim=0)[order].to(torch.int32)
        perm = torch.zeros(group_of_row.numel(), dtype=torch.long, device=g_idx.device)
        perm[rows] = order
        sub_groups = group_of_row[::sub]  # [K' / s] the original group of each new one
        _log_regrouping_once(sub, 100 * (group_of_row.numel() / k - 1))
        return pack_int32(values, self.bits, dim=0), scales[sub_groups], zeros[sub_groups], perm


def _log_regrouping_once(sub_group: int, padding_percent: float) -> None:
    """Logs the first regrouped layer of the process; later ones stay quiet."""
    global _regrouping_logged
    if not _regrouping_logged:
        _regrouping_logged = True
        logger.warning("GPTQ act-order split over tensor-parallel ranks: each rank's inputs regrouped into groups of "
                       "%d, padded with zero weights (%.0f%% more rows on the first such layer)", sub_group,
                       padding_percent)


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
        return GPTQLinearMethod(self.bits, self.group_size, zeros_minus_one=self.checkpoint_format == "gptq",
                                desc_act=self.desc_act)

    def check_device(self, device):
        if device.type == "cuda" and self.bits != 4:
            raise ValueError(f"GPTQ {self.bits}-bit has no CUDA kernel here (supported on CUDA: 4-bit GPTQ and "
                             "AWQ; 8-bit GPTQ runs on CPU)")

    def describe(self):
        act = ", act-order" if self.desc_act else ""
        return f"gptq int{self.bits} group {self.group_size}, {'sym' if self.sym else 'asym'}{act}"

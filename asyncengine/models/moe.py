"""Mixture-of-experts families: Mixtral, Qwen2-MoE and Qwen3-MoE.

They are the Llama family (llama.py: attention, norms, decoder layer, loading) with the MLP of some layers
replaced by a sparse block: a router picks each token's top-k experts, the experts (gated MLPs) run through one
fused call (`ops.fused_moe`), and their outputs are summed with the routing weights. Qwen2-MoE adds a shared
expert whose output, scaled by a sigmoid gate, is added for every token.

Routing, as transformers computes it: softmax over all experts in float32, the top-k probabilities, divided by
their sum when the family renormalises (Mixtral always; Qwen2/3-MoE when `norm_topk_prob`).

Tensor parallelism: every rank holds every expert and its slice of the intermediate dimension (as vLLM shards
them), read from tp_size() when the layer is built; the experts' partial outputs are summed over ranks.

Quantized checkpoints (`expert_format` says which the experts take; the routers stay in the model dtype):
- block-wise FP8 (Qwen3-30B-A3B-FP8's layout, quantization/fp8.py): the experts keep their e4m3 weights, their block
  scales become group scales per expert after loading (`FusedMoE.process_expert_weights`), and the fused kernels
  apply them per weight tile (kernels/moe.py); `--quantization fp8` quantizes the experts so at load;
- GPTQ, AWQ and compressed-tensors W4A16 int4 (Qwen3-30B-A3B-GPTQ-Int4's, Mixtral AWQ's and llm-compressor's
  layouts: every expert's projections packed as a linear layer is): each expert's tensors load as stored, go
  through the format's own conversion (the dense layers') and are stacked as rows of packed inputs ([E, N, K / 8]
  int32) with scales and zero points [E, G, N]; the fused kernels dequantize each weight tile. GPTQ act-order
  (`_convert_int4`): down's inputs sorted by group as the dense layers sort theirs, and gate / up's output rows in
  that same order, so the activation comes out sorted; gate / up's inputs sorted by group, each expert's order its
  own, so x is gathered per assignment (`FusedMoE.forward`). 8-bit GPTQ, act-order split over tensor-parallel
  ranks and groups that are not a multiple of 16 are refused at start-up.
"""

from __future__ import annotations

import re
from typing import Iterable, Iterator, Optional

import torch
import torch.nn.functional as F
from torch import nn

from asyncengine import ops
from asyncengine.distributed.parallel_state import all_reduce, tp_rank, tp_size
from asyncengine.models.layers import load_checkpoint_tensor
from asyncengine.kernels.quant_reference import FP8_DTYPE, fp8_group_scales, quantize_fp8_groups
from asyncengine.models.llama import MLP, LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM
from asyncengine.quantization import LinearMethod, set_weight_attrs
from asyncengine.quantization.base import quantized_after_loading
from asyncengine.quantization.packed_int import PackedIntLinearMethod, int_param


class Router(nn.Module):
    """The gate: logits [T, E] = x W^T with W [E, hidden], whole on every rank (it is small). The sparse block
    hands its router's weight to ops.route (product and routing in one launch at decode sizes); forward serves the
    shared expert's gate."""

    def __init__(self, hidden: int, num_outputs: int, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_outputs, hidden, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class FusedMoE(nn.Module):
    """num_experts gated MLPs (hidden -> intermediate -> hidden) stored stacked for the fused kernel.

    w13_weight: [E, 2 * I_rank, hidden] laid out [gate | up] per expert; w2_weight: [E, hidden, I_rank], with
    I_rank = intermediate / tp_size(). Checkpoint tensors arrive per expert (shard id (expert, "gate" | "up" |
    "down")) or stacked for all experts, the layout transformers 5 holds in memory (("all", "gate_up" | "down")).
    block: (bn, bk) of a block-wise FP8 checkpoint: the weights in e4m3 and, per expert as the checkpoint stores
    them, block scales w13_<scale_name> [E, 2 * I_rank / bn, ceil(hidden / bk)] and w2_<scale_name>
    [E, ceil(hidden / bn), ceil(I_rank / bk)], turned into group scales after loading (process_expert_weights).
    online_group: `--quantization fp8` of a model-dtype checkpoint: the experts quantized after loading, each output
    row's groups of online_group inputs with their own scale (finer than a checkpoint's 128 x 128 blocks).
    int4: the packed-int method of an int4 checkpoint (GPTQ, AWQ, compressed-tensors W4A16): its tensors per
    expert, stacked (`_create_int4_tensors`), then converted (`_convert_int4`) to w13_weight [E, 2 I_rank, hidden / 8]
    and w2_weight [E, hidden, I_rank / 8] int32 with scales and zero points (w13_scale, w13_zeros, ...) [E, G, N];
    GPTQ act-order adds w13_input_perm [E, hidden].
    """

    PER_EXPERT = ("gate", "up", "down")

    def __init__(self, num_experts: int, hidden: int, intermediate: int, dtype: torch.dtype,
                 block: Optional[tuple[int, int]] = None, scale_name: str = "weight_scale_inv", online_group: int = 0,
                 int4: Optional[PackedIntLinearMethod] = None):
        super().__init__()
        if intermediate % tp_size():
            raise ValueError(f"moe intermediate size {intermediate} is not divisible by tensor_parallel_size "
                             f"{tp_size()}")  # fmt: skip
        self.num_experts, self.hidden, self.inter, self.block = num_experts, hidden, intermediate // tp_size(), block
        self.online_group, self.int4 = online_group, int4
        # the group scales (FP8, int4) and zero points (int4), once processed; GPTQ act-order: each expert's order
        # of gate / up's inputs [E, hidden] (`_convert_int4`)
        self.w13_scale = self.w2_scale = self.w13_zeros = self.w2_zeros = self.group_size = None
        self.w13_input_perm = None
        self._g_idx_loaded: set = set()  # the experts whose w13 g_idx slot gate or up has filled
        if int4 is not None:
            self._create_int4_tensors(dtype)
            return
        self.w13_weight = self._expert_weights(num_experts, 2 * self.inter, hidden, dtype)
        self.w2_weight = self._expert_weights(num_experts, hidden, self.inter, dtype)
        if block:
            self._create_block_scales(hidden, scale_name)

    def _expert_weights(self, num_experts: int, rows: int, cols: int, dtype: torch.dtype) -> nn.Parameter:
        """[E, rows, cols]: e4m3 from a block-wise checkpoint; in the model dtype otherwise, in host memory until
        processed when quantized online (quantization.base.quantized_after_loading)."""
        if self.online_group:
            return quantized_after_loading(num_experts, rows, cols, dtype=dtype, output_dim=1, input_dim=2)
        weight = torch.empty(num_experts, rows, cols, dtype=FP8_DTYPE if self.block else dtype)
        return set_weight_attrs(nn.Parameter(weight, requires_grad=False), output_dim=1, input_dim=2)

    def _create_block_scales(self, hidden: int, scale_name: str) -> None:
        (bn, bk), inter = self.block, self.inter
        if inter % bn or (tp_size() > 1 and inter % bk):
            raise ValueError(f"FP8 block-wise experts of intermediate size {inter} per rank: blocks [{bn}, {bk}] do "
                             "not fall on whole rows of gate / up (and, split over ranks, on whole inputs of down)")
        self.scale_names = (f"w13_{scale_name}", f"w2_{scale_name}")
        shapes = ((2 * inter // bn, -(-hidden // bk)), (-(-hidden // bn), -(-inter // bk)))
        for name, shape in zip(self.scale_names, shapes):
            self.register_parameter(name, nn.Parameter(torch.empty(self.num_experts, *shape, dtype=torch.float32),
                                                       requires_grad=False))

    def _create_int4_tensors(self, dtype: torch.dtype) -> None:
        """The int4 checkpoint's tensors stacked per expert, as the format stores one layer's (w13: gate's then
        up's outputs of this rank; w2: this rank's inputs): w13_<name> [E, *tensor of a [2 I_rank, hidden] layer],
        w2_<name> [E, *tensor of a [hidden, I_rank] layer]; each keeps its input_dim / output_dim (shifted by the
        expert dimension)."""
        group = self.int4.group_size
        if self.inter % 8 or self.inter % group:
            raise ValueError(f"int4 experts of intermediate size {self.inter} per rank: groups of {group} inputs and "
                             "8 outputs a word must not straddle ranks (or gate and up)")
        for prefix, (k, n) in (("w13", (self.hidden, 2 * self.inter)), ("w2", (self.inter, self.hidden))):
            for name, (shape, tensor_dtype, input_dim, output_dim) in self.int4.checkpoint_tensors(k, n, dtype).items():
                param = int_param(self.num_experts, *shape, dtype=tensor_dtype,
                                  input_dim=None if input_dim is None else input_dim + 1,
                                  output_dim=None if output_dim is None else output_dim + 1)
                self.register_parameter(f"{prefix}_{name}", param)

    def process_expert_weights(self) -> None:
        """The quantized experts' group scales, what the fused kernels read: w13_scale [E, ceil(hidden / g), 2 I_rank],
        w2_scale [E, ceil(I_rank / g), hidden], one per output row per group of g inputs (FP8: g = bk, from a
        block-wise checkpoint's block scales, or online_group, quantizing the loaded experts; int4: the checkpoint's
        groups, with zero points alike, `_convert_int4`). Nothing when unquantized."""
        if self.online_group:
            self._quantize_online()
            return
        if self.int4 is not None:
            self._convert_int4()
            return
        if not self.block:
            return
        bn, bk = self.block
        group_scales = []
        for name, weight in zip(self.scale_names, (self.w13_weight, self.w2_weight)):
            group_scales.append(fp8_group_scales(getattr(self, name).data, bn, weight.shape[1]))
            delattr(self, name)
        self.w13_scale = nn.Parameter(group_scales[0], requires_grad=False)
        self.w2_scale = nn.Parameter(group_scales[1], requires_grad=False)
        self.group_size = bk

    def _convert_int4(self) -> None:
        """The checkpoint's int4 tensors -> what the fused kernels read: w13_weight [E, 2 I_rank, hidden / 8] and
        w2_weight [E, hidden, I_rank / 8] int32 (each row's inputs 8 a word), scales and zero points [E, G, N] in
        the scales' dtype, one expert at a time through the format's own conversion (the dense layers').

        GPTQ act-order: the conversion sorts a layer's inputs by group (input_perm). For down, the inputs are the
        activation's columns, which gate_up_act computes one per gate / up row: those rows are put in down's order
        here, so the activation comes out sorted and nothing is gathered at run time. For gate / up (one order per
        expert, shared by both: they read the same x) the order is kept, w13_input_perm [E, hidden], and forward
        gathers each assignment's x in its expert's order."""
        if getattr(self.int4, "desc_act", False) and tp_size() > 1:
            raise ValueError("GPTQ act-order (desc_act) experts split over tensor-parallel ranks are not supported "
                             "(supported: desc_act false, or tensor_parallel_size 1)")
        converted = {}
        for prefix, k in (("w13", self.hidden), ("w2", self.inter)):
            names = [f"{prefix}_{name}" for name in self.int4.checkpoint_names()]
            experts = []
            for e in range(self.num_experts):
                tensors = {name.split("_", 1)[1]: getattr(self, name).data[e] for name in names}
                qweight, scale, zero, perm = self.int4.convert(tensors, k)
                experts.append((qweight, scale, zero.to(scale.dtype), perm))
            for name in names:
                delattr(self, name)
            converted[prefix] = experts
        perms = []
        for e, (qweight, scale, zero, perm) in enumerate(converted["w13"]):
            down_order = converted["w2"][e][3]
            if down_order is not None:  # gate and up rows (outputs, along N) in down's input order
                outputs = torch.cat([down_order, down_order + self.inter])
                qweight, scale, zero = qweight[:, outputs], scale[:, outputs], zero[:, outputs]
            converted["w13"][e] = (qweight, scale, zero, perm)
            perms.append(perm)
        if any(perm is not None for perm in perms):
            identity = torch.arange(self.hidden, device=converted["w13"][0][0].device)
            self.w13_input_perm = nn.Parameter(torch.stack([identity if p is None else p for p in perms]),
                                               requires_grad=False)
        for prefix, experts in converted.items():
            rows = [qweight.t().contiguous() for qweight, _, _, _ in experts]  # [K / 8, N] along K -> [N, K / 8]
            setattr(self, f"{prefix}_weight", nn.Parameter(torch.stack(rows), requires_grad=False))
            setattr(self, f"{prefix}_scale", nn.Parameter(torch.stack([e[1] for e in experts]).contiguous(),
                                                          requires_grad=False))
            setattr(self, f"{prefix}_zeros", nn.Parameter(torch.stack([e[2] for e in experts]).contiguous(),
                                                          requires_grad=False))
        self.group_size = self.int4.group_size

    def _quantize_online(self) -> None:
        """The loaded model-dtype experts (in host memory) -> e4m3 with group scales on the target device
        (quant_reference.quantize_fp8_groups), one expert at a time so that the copies and float32 temporaries on
        the device stay one expert's size."""
        for name in ("w13", "w2"):
            weight = getattr(self, f"{name}_weight")
            experts, n, k = weight.shape
            device = weight.target_device
            w8 = torch.empty((experts, n, k), dtype=FP8_DTYPE, device=device)
            scales = torch.empty((experts, -(-k // self.online_group), n), dtype=torch.float32, device=device)
            for e in range(experts):
                w8[e], scales[e] = quantize_fp8_groups(weight.data[e].to(device), self.online_group)
            setattr(self, f"{name}_weight", nn.Parameter(w8, requires_grad=False))
            setattr(self, f"{name}_scale", nn.Parameter(scales, requires_grad=False))
        self.group_size = self.online_group

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """x [T, hidden], topk_* [T, K] -> [T, hidden], summed over ranks."""
        if self.w13_input_perm is not None:
            return self._forward_input_orders(x, topk_weights, topk_ids)
        return all_reduce(ops.fused_moe(x, self.w13_weight, self.w2_weight, topk_weights, topk_ids, self.w13_scale,
                                        self.w2_scale, self.group_size, self.w13_zeros, self.w2_zeros))

    def _forward_input_orders(self, x: torch.Tensor, topk_weights: torch.Tensor,
                              topk_ids: torch.Tensor) -> torch.Tensor:
        """GPTQ act-order experts: each of the N = T * K assignments becomes a row of its own, x in its expert's
        input order ([N, hidden], one gather), through the fused call with one expert per row; the rows' weighted
        outputs [N, hidden] are summed per token in float32 (one rounding more than the fused reduction)."""
        tokens, top_k = topk_ids.shape
        ids = topk_ids.reshape(-1, 1)  # [N, 1]
        rows = x.repeat_interleave(top_k, dim=0).gather(1, self.w13_input_perm[ids[:, 0]])  # [N, hidden]
        out = ops.fused_moe(rows, self.w13_weight, self.w2_weight, topk_weights.reshape(-1, 1), ids,
                            self.w13_scale, self.w2_scale, self.group_size, self.w13_zeros, self.w2_zeros)
        return all_reduce(out.view(tokens, top_k, -1).float().sum(1).to(x.dtype))

    def shard_ids(self, param_name: str) -> set:
        """The shard ids that fill `param_name` completely when loaded per expert (what the loader expects)."""
        kinds = ("gate", "up") if param_name.startswith("w13_") else ("down",)
        return {(e, kind) for e in range(self.num_experts) for kind in kinds}

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id) -> None:
        """Copy this rank's slice of the intermediate dimension; see the class docstring for shard ids."""
        if self.block and any(param is getattr(self, name, None) for name in self.scale_names):
            self._load_block_scales(param, loaded, shard_id)
            return
        if self.int4 is not None:
            self._load_int4_tensor(param, loaded, shard_id)
            return
        expert, kind = shard_id
        inter, rank = self.inter, tp_rank()
        if expert == "all":  # stacked: gate_up [E, 2I, hidden] or down [E, hidden, I]
            if kind == "gate_up":
                full = loaded.shape[1] // 2
                gate, up = loaded[:, :full], loaded[:, full:]
                param.data[:, :inter].copy_(gate[:, rank * inter : (rank + 1) * inter])
                param.data[:, inter:].copy_(up[:, rank * inter : (rank + 1) * inter])
            else:
                param.data.copy_(loaded[:, :, rank * inter : (rank + 1) * inter])
            return
        if kind == "down":  # [hidden, I]
            param.data[expert].copy_(loaded[:, rank * inter : (rank + 1) * inter])
        else:  # gate or up: [I, hidden]
            offset = 0 if kind == "gate" else inter
            param.data[expert, offset : offset + inter].copy_(loaded[rank * inter : (rank + 1) * inter])

    def _load_int4_tensor(self, param: nn.Parameter, loaded: torch.Tensor, shard_id) -> None:
        """One expert's int4 tensor as the format stores a layer's: gate / up cut to this rank's outputs and placed
        at their half of w13's (along the tensor's output dimension, in its own units: packed words, groups), down
        cut to this rank's inputs (GPTQ's g_idx then counts groups from the rank's first: its conversion rebases
        them)."""
        expert, kind = shard_id
        if expert == "all":
            raise ValueError("int4 expert tensors stacked for all experts are not supported (supported: one tensor "
                             "per expert, as int4 checkpoints store them)")
        dim = param.output_dim if kind != "down" else param.input_dim
        if dim is None:  # gate's and up's g_idx [hidden] (no output dimension): one slot, which both must fill alike
            slot = param.data[expert]
            if expert in self._g_idx_loaded and not torch.equal(slot, loaded.to(slot.device, slot.dtype)):
                raise ValueError(f"expert {expert}'s gate and up projections order their inputs differently "
                                 "(GPTQ g_idx): not supported (GPTQ gives both one order: they read one input)")
            slot.copy_(loaded)
            self._g_idx_loaded.add(expert)
            return
        dim -= 1  # the checkpoint tensor has no expert dimension
        part = loaded.shape[dim] // tp_size()
        if part * tp_size() != loaded.shape[dim]:
            raise ValueError(f"int4 expert tensor of shape {tuple(loaded.shape)} does not split over {tp_size()} "
                             f"ranks along dimension {dim}")
        loaded = loaded.narrow(dim, tp_rank() * part, part)
        param.data[expert].narrow(dim, part if kind == "up" else 0, part).copy_(loaded)

    def _load_block_scales(self, param: nn.Parameter, loaded: torch.Tensor, shard_id) -> None:
        """One expert's block scales: gate / up [I / bn, ceil(hidden / bk)] into its half of w13's rows, down
        [ceil(hidden / bn), I / bk] (this rank's blocks of the intermediate dimension)."""
        expert, kind = shard_id
        if expert == "all":
            raise ValueError("FP8 block scales stacked for all experts are not supported (supported: one tensor per "
                             "expert, as FP8 checkpoints on the hub store them)")
        (bn, bk), rank = self.block, tp_rank()
        if kind == "down":
            cols = param.shape[2]
            param.data[expert].copy_(loaded[:, rank * cols : (rank + 1) * cols])
            return
        rows = self.inter // bn
        offset = 0 if kind == "gate" else rows
        param.data[expert, offset : offset + rows].copy_(loaded[rank * rows : (rank + 1) * rows])


class SparseMoeBlock(nn.Module):
    """Router + experts (+ the gated shared expert where the config has one): [T, hidden] -> [T, hidden]."""

    def __init__(self, cfg, dtype: torch.dtype, intermediate: int, renormalize: bool,
                 shared_intermediate: int = 0, linear_method: Optional[LinearMethod] = None):  # fmt: skip
        super().__init__()
        self.top_k, self.renormalize = cfg.num_experts_per_tok, renormalize
        num_experts = _num_experts(cfg)
        if not 0 < self.top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok {self.top_k} must be in [1, {num_experts}] (the number of experts)")
        self.gate = Router(cfg.hidden_size, num_experts, dtype)
        self.experts = FusedMoE(num_experts, cfg.hidden_size, intermediate, dtype, **expert_format(linear_method))
        self.shared_expert = (MLP(cfg, dtype, shared_intermediate, linear_method=linear_method)
                              if shared_intermediate else None)
        self.shared_expert_gate = Router(cfg.hidden_size, 1, dtype) if shared_intermediate else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # the router product and the routing: one launch on CUDA at decode sizes (kernels/moe.py route)
        topk_weights, topk_ids = ops.route(x, self.gate.weight, self.top_k, self.renormalize)  # [T, K] each
        out = self.experts(x, topk_weights, topk_ids)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out


ONLINE_FP8_GROUP = 128  # `--quantization fp8`: the experts' inputs per scale (the fused kernels' K tiles divide it)


def expert_format(linear_method: Optional[LinearMethod]) -> dict:
    """FusedMoE's keyword arguments for the weight format: none unquantized; the block and the scale's checkpoint
    name for block-wise FP8; online_group for `--quantization fp8` of a model-dtype checkpoint; ValueError for any
    other format (the fused kernels have no path for it)."""
    if linear_method is None:
        return {}
    block = getattr(linear_method, "block", None)
    if block is not None:
        return {"block": block, "scale_name": linear_method.block_scale_name}
    if getattr(linear_method, "serialized", True) is False:  # Fp8LinearMethod of Fp8Config.online()
        return {"online_group": ONLINE_FP8_GROUP}
    if isinstance(linear_method, PackedIntLinearMethod):  # GPTQ, AWQ, compressed-tensors WNA16
        if linear_method.bits != 4 or linear_method.group_size < 16 or linear_method.group_size % 16:
            raise ValueError(f"int{linear_method.bits} mixture-of-experts weights of group size "
                             f"{linear_method.group_size} are not supported (supported for the experts: 4 bits, "
                             "groups of a multiple of 16 inputs)")
        return {"int4": linear_method}
    raise ValueError(f"quantized mixture-of-experts weights ({type(linear_method).__name__}) are not supported "
                     "(supported for the experts: block-wise FP8 checkpoints, weight_block_size, as "
                     "Qwen3-30B-A3B-FP8; --quantization fp8; GPTQ, AWQ and compressed-tensors int4)")


def _num_experts(cfg) -> int:
    return getattr(cfg, "num_local_experts", None) or cfg.num_experts  # Mixtral's name, then Qwen's


# checkpoint names of expert weights: "<prefix>.experts.<e>.<proj>.weight" (per expert, as on the hub) or
# "<prefix>.experts.gate_up_proj" / ".down_proj" (stacked, the layout transformers 5 holds in memory)
_PER_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(w1|w2|w3|gate_proj|up_proj|down_proj)\."
                         r"(weight|weight_scale_inv|weight_scale|qweight|qzeros|scales|g_idx|weight_packed|"
                         r"weight_zero_point)$")
_STACKED = re.compile(r"^(.*\.experts)\.(gate_up_proj|down_proj)$")
_KIND = {"w1": "gate", "gate_proj": "gate", "w3": "up", "up_proj": "up", "w2": "down", "down_proj": "down"}


def expert_target(name: str) -> Optional[tuple[str, object]]:
    """(our parameter name, shard id) of an expert weight's checkpoint name (prefix stripped), else None."""
    match = _PER_EXPERT.match(name)
    if match:
        kind = _KIND[match[3]]
        return f"{match[1]}.{'w2' if kind == 'down' else 'w13'}_{match[4]}", (int(match[2]), kind)
    match = _STACKED.match(name)
    if match:
        kind = "gate_up" if match[2] == "gate_up_proj" else "down"
        return f"{match[1]}.{'w2' if kind == 'down' else 'w13'}_weight", ("all", kind)
    return None


class MoeLoadingMixin:
    """Loads expert weights itself and hands every other tensor to the Llama family's loader."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]],
                     loaded: Optional[set[tuple[str, object]]] = None) -> set[tuple[str, object]]:
        """As LlamaForCausalLM.load_weights (`loaded` receives each written pair as it is written)."""
        params = dict(self.named_parameters())
        loaded = set() if loaded is None else loaded

        def dense_weights() -> Iterator[tuple[str, torch.Tensor]]:
            for hf_name, tensor in weights:
                name = hf_name.replace(".block_sparse_moe.", ".mlp.")  # Mixtral's name for the sparse block
                target = expert_target(name.removeprefix("model."))
                if target is None:
                    yield name, tensor
                    continue
                load_checkpoint_tensor(self, params, target[0], target[1], tensor, hf_name)
                if target[1][0] == "all":  # a stacked tensor fills every expert's shards at once
                    module = self.get_submodule(target[0].rsplit(".", 1)[0])
                    loaded.update((target[0], s) for s in module.shard_ids(target[0].rsplit(".", 1)[1]))
                else:
                    loaded.add(target)

        return super().load_weights(dense_weights(), loaded)


class MixtralForCausalLM(MoeLoadingMixin, LlamaForCausalLM):
    """Mixtral: every layer sparse (num_local_experts experts, top num_experts_per_tok, renormalised)."""

    def make_mlp(self, cfg, dtype: torch.dtype, layer_index: int) -> nn.Module:
        return SparseMoeBlock(cfg, dtype, cfg.intermediate_size, renormalize=True, linear_method=self.linear_method)


class QwenMoeMixin(MoeLoadingMixin):
    """Qwen2-MoE / Qwen3-MoE: sparse layers every decoder_sparse_step-th layer outside mlp_only_layers (the others
    a dense MLP of intermediate_size); experts of moe_intermediate_size; renormalised when norm_topk_prob."""

    def make_mlp(self, cfg, dtype: torch.dtype, layer_index: int) -> nn.Module:
        step = getattr(cfg, "decoder_sparse_step", 1) or 1
        sparse = (layer_index not in (getattr(cfg, "mlp_only_layers", None) or [])
                  and _num_experts(cfg) > 0 and (layer_index + 1) % step == 0)  # fmt: skip
        if not sparse:
            return MLP(cfg, dtype, linear_method=self.linear_method)
        return SparseMoeBlock(cfg, dtype, cfg.moe_intermediate_size, bool(getattr(cfg, "norm_topk_prob", False)),
                              getattr(cfg, "shared_expert_intermediate_size", 0) or 0,
                              self.linear_method)  # fmt: skip


class Qwen2MoeForCausalLM(QwenMoeMixin, Qwen2ForCausalLM):
    """Qwen2-MoE: Qwen2 attention (q/k/v bias) and a shared expert beside the routed ones."""


class Qwen3MoeForCausalLM(QwenMoeMixin, Qwen3ForCausalLM):
    """Qwen3-MoE: Qwen3 attention (per-head q/k RMSNorm), no shared expert."""

"""Quantized checkpoints for tests, each written beside the float32 checkpoint its packed weights dequantize to.

Packers: AWQ by AutoAWQ (`WQLinear_GEMM.from_linear`, its gemm layout), FP8 by compressed-tensors (its
`ModelCompressor`, float-quantized format), and, where no independent packer installs here (gptqmodel does not),
GPTQ and the `quant_method: fp8` layouts packed in this file from the formats' published specifications (GPTQ:
AutoGPTQ's / the GPTQ paper's checkpoint layout as transformers documents it; FP8: vLLM's Fp8Config layout, and
for block-wise scales vLLM's / DeepSeek-V3's `weight_scale_inv` layout, as Qwen3-*-FP8 publish it). The
unpacking below is also written from those specifications, independently of asyncengine/quantization: the
dequantized checkpoint is what transformers runs as the reference.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from types import SimpleNamespace

import torch
from safetensors.torch import load_file, save_file

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
AWQ_PACK_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # AutoAWQ: slot i of a word holds column AWQ_PACK_ORDER[i]


def _is_linear(name: str) -> bool:
    """A decoder linear's weight: attention and MLP projections, experts' included (Mixtral names its experts'
    w1 / w2 / w3); not the MoE routers (mlp.gate) nor the LM head."""
    return name.endswith(".weight") and (any(f".{p}." in name for p in LINEARS)
                                         or re.search(r"\.experts\.\d+\.w[123]\.weight$", name) is not None)


def _copy_folder(src: Path, dst: Path) -> None:
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors":
            shutil.copy(f, dst / f.name)


def _write(dst: Path, tensors: dict, quantization_config: dict | None) -> Path:
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(dst / "model.safetensors"))
    config = json.loads((dst / "config.json").read_text())
    if quantization_config is None:
        config.pop("quantization_config", None)
    else:
        config["quantization_config"] = quantization_config
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return dst


def _quantized_pair(src: Path, out: Path, name: str, quantize_one, quantization_config: dict) -> tuple[Path, Path]:
    """Write out/name (quantized) and out/name-dequant (float32): quantize_one(hf_name, W [N, K] float32) ->
    (tensors to save under the layer's prefix, W dequantized [N, K] float32)."""
    qdir, ddir = out / name, out / f"{name}-dequant"
    _copy_folder(src, qdir)
    _copy_folder(src, ddir)
    quantized, dequantized = {}, {}
    for hf_name, tensor in load_file(str(src / "model.safetensors")).items():
        if not _is_linear(hf_name):
            quantized[hf_name] = dequantized[hf_name] = tensor
            continue
        prefix = hf_name.removesuffix("weight")
        tensors, w_deq = quantize_one(hf_name, tensor.float())
        quantized.update({prefix + k: v for k, v in tensors.items()})
        dequantized[hf_name] = w_deq.to(tensor.dtype)
    return _write(qdir, quantized, quantization_config), _write(ddir, dequantized, None)


# -- shared: round-to-nearest grouped quantization of W^T [K, N] ----------------------------------------------

def _groups_rtn(wt: torch.Tensor, g_idx: torch.Tensor, groups: int, bits: int, sym: bool):
    """wt [K, N]; g_idx [K] -> (q [K, N] int, scales [G, N] fp16, zeros [G, N] int)."""
    qmax = 2**bits - 1
    scales = torch.empty(groups, wt.shape[1])
    zeros = torch.empty(groups, wt.shape[1], dtype=torch.int64)
    for g in range(groups):
        rows = wt[g_idx == g]
        if sym:
            scales[g] = (rows.abs().amax(0) / (2 ** (bits - 1) - 0.5)).clamp(min=1e-6)
            zeros[g] = 2 ** (bits - 1)
        else:
            lo, hi = rows.amin(0).clamp(max=0), rows.amax(0).clamp(min=0)
            scales[g] = ((hi - lo) / qmax).clamp(min=1e-6)
            zeros[g] = (-lo / scales[g].half().float()).round().clamp(0, qmax).long()
    scales = scales.half()
    q = (wt / scales[g_idx].float() + zeros[g_idx]).round().clamp(0, qmax).long()
    return q, scales, zeros


def _pack_words(values: torch.Tensor, bits: int, slot_of=None) -> torch.Tensor:
    """values [..., W * pack] (unsigned) -> [..., W] int32; value i of a word at bit offset bits * slot_of[i]."""
    pack = 32 // bits
    slot_of = slot_of or list(range(pack))
    v = values.reshape(*values.shape[:-1], -1, pack).long()
    word = torch.zeros(v.shape[:-1], dtype=torch.int64)
    for i in range(pack):
        word |= v[..., i] << (bits * slot_of[i])
    return (word - (word >= 2**31).long() * 2**32).to(torch.int32)


def _unpack_words(words: torch.Tensor, bits: int, slot_of=None) -> torch.Tensor:
    pack = 32 // bits
    slot_of = slot_of or list(range(pack))
    w = words.long() & 0xFFFFFFFF
    parts = [(w >> (bits * slot_of[i])) & (2**bits - 1) for i in range(pack)]
    return torch.stack(parts, dim=-1).reshape(*words.shape[:-1], -1)


# -- GPTQ (packed here, from the specification) -----------------------------------------------------------

def gptq_checkpoint(src: Path, out: Path, *, bits: int = 4, group_size: int = 32, sym: bool = True,
                    desc_act: bool = False, seed: int = 0, swap_nibbles: bool = False) -> tuple[Path, Path]:
    """GPTQ v1 layout: qweight [K / pack, N] packed along K; qzeros [G, N / pack] packed along N, stored minus one;
    scales [G, N] fp16; g_idx [K] int32. desc_act: inputs assigned to groups in a random order (as act-order
    does). swap_nibbles: a deliberately broken packer (adjacent values swapped in each word)."""
    gen = torch.Generator().manual_seed(seed)
    orders: dict[str, torch.Tensor] = {}  # layers reading the same input share one order, as GPTQ's Hessian does

    def input_order(name: str, k: int) -> torch.Tensor:
        key = (name.replace("k_proj", "q_proj").replace("v_proj", "q_proj").replace("up_proj", "gate_proj")
               .replace(".w3", ".w1"))  # Mixtral's experts: w1 (gate) and w3 (up) read one input
        if key not in orders:
            orders[key] = torch.randperm(k, generator=gen) if desc_act else torch.arange(k)
        return orders[key]

    def quantize_one(name, w):
        wt = w.t().contiguous()  # [K, N]
        k = wt.shape[0]
        g = k if group_size == -1 else group_size
        groups = -(-k // g)
        order = input_order(name, k)
        g_idx = torch.empty(k, dtype=torch.int64)
        g_idx[order] = torch.arange(k) // g
        q, scales, zeros = _groups_rtn(wt, g_idx, groups, bits, sym)
        slots = list(range(32 // bits))
        if swap_nibbles:
            slots[0], slots[1] = slots[1], slots[0]
        qweight = _pack_words(q.t(), bits, slots).t()  # pack along K: [N, K] -> [N, K / pack] -> [K / pack, N]
        qzeros = _pack_words(zeros - 1, bits)  # [G, N / pack]
        w_deq = ((q - zeros[g_idx]).float() * scales[g_idx].float()).t()
        return {"qweight": qweight, "qzeros": qzeros, "scales": scales, "g_idx": g_idx.int()}, w_deq

    cfg = {"quant_method": "gptq", "bits": bits, "group_size": group_size, "desc_act": desc_act, "sym": sym,
           "checkpoint_format": "gptq"}
    name = f"gptq{bits}-g{group_size}-{'sym' if sym else 'asym'}{'-act' if desc_act else ''}"
    return _quantized_pair(src, out, name + ("-broken" if swap_nibbles else ""), quantize_one, cfg)


# -- AWQ (packed by AutoAWQ) --------------------------------------------------------------------------------

def awq_checkpoint(src: Path, out: Path, *, group_size: int = 32,
                   modules_to_not_convert: list | None = None) -> tuple[Path, Path]:
    """AutoAWQ's WQLinear_GEMM.from_linear packs (qweight [K, N/8], qzeros [K/g, N/8], scales [K/g, N] fp16) from
    weights we round to its grid first (from_linear rounds without clamping, as AutoAWQ's search hands it
    weights already on the grid). The reference dequantizes the packed tensors with AutoAWQ's order.
    modules_to_not_convert: written into the config as given (AutoAWQ's Mixtral checkpoints list ["gate"])."""
    from awq.modules.linear.gemm import WQLinear_GEMM

    def quantize_one(name, w):
        n, k = w.shape
        g_idx = torch.arange(k) // group_size
        q, scales, zeros = _groups_rtn(w.t(), g_idx, k // group_size, 4, sym=False)
        on_grid = ((q - zeros[g_idx]).float() * scales[g_idx].float()).t()  # [N, K]
        linear = torch.nn.Linear(k, n, bias=False)
        linear.weight.data.copy_(on_grid)
        packed = WQLinear_GEMM.from_linear(linear, 4, group_size, scales=scales.float(), zeros=zeros.float())
        q_back = _unpack_words(packed.qweight, 4, AWQ_PACK_ORDER_SLOTS)  # [K, N]
        z_back = _unpack_words(packed.qzeros, 4, AWQ_PACK_ORDER_SLOTS)  # [G, N]
        w_deq = ((q_back - z_back[g_idx]).float() * packed.scales.float()[g_idx]).t()
        return {"qweight": packed.qweight, "qzeros": packed.qzeros, "scales": packed.scales}, w_deq

    cfg = {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True, "version": "gemm"}
    if modules_to_not_convert is not None:
        cfg["modules_to_not_convert"] = modules_to_not_convert
    return _quantized_pair(src, out, f"awq-g{group_size}", quantize_one, cfg)


# slot of logical column i under AutoAWQ's packing (the inverse of AWQ_PACK_ORDER)
AWQ_PACK_ORDER_SLOTS = [AWQ_PACK_ORDER.index(i) for i in range(8)]


# -- FP8 ----------------------------------------------------------------------------------------------------

FP8 = torch.float8_e4m3fn


def fp8_checkpoint(src: Path, out: Path, *, static: bool = True, input_scale: float = 0.05) -> tuple[Path, Path]:
    """quant_method "fp8" (vLLM's Fp8Config layout), packed here: weight [N, K] e4m3, weight_scale [] per tensor,
    input_scale [] when static (a fixed scale: the CPU path does not quantize activations)."""

    def quantize_one(name, w):
        scale = w.abs().amax() / 448.0
        w8 = (w / scale).clamp(-448, 448).to(FP8)
        tensors = {"weight": w8, "weight_scale": scale.reshape(())}
        if static:
            tensors["input_scale"] = torch.tensor(input_scale)
        return tensors, w8.float() * scale

    cfg = {"quant_method": "fp8", "activation_scheme": "static" if static else "dynamic"}
    return _quantized_pair(src, out, f"fp8-{'static' if static else 'dynamic'}", quantize_one, cfg)


def _block_amax(w: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """w [N, K] -> amax |w| of each [bn, bk] block, [ceil(N / bn), ceil(K / bk)]; a partial last block (along N or
    K) takes the amax of the entries it has (zero padding leaves the amax as it is)."""
    bn, bk = block
    n, k = w.shape
    rows, cols = -(-n // bn), -(-k // bk)
    padded = torch.nn.functional.pad(w.abs(), (0, cols * bk - k, 0, rows * bn - n))
    return padded.reshape(rows, bn, cols, bk).amax(dim=(1, 3))


def _expand_blocks(scale: torch.Tensor, shape: tuple[int, int], block: tuple[int, int]) -> torch.Tensor:
    """scale [ceil(N / bn), ceil(K / bk)] -> [N, K]: entry [n, k] is scale[n // bn, k // bk]."""
    n, k = shape
    rows = torch.arange(n) // block[0]
    cols = torch.arange(k) // block[1]
    return scale[rows[:, None], cols[None, :]]


def fp8_block_checkpoint(src: Path, out: Path, *, block: tuple[int, int] = (16, 32)) -> tuple[Path, Path]:
    """quant_method "fp8" with block-wise weight scales, packed here from the published specification (vLLM's /
    DeepSeek-V3's `weight_scale_inv` layout, as Qwen3-*-FP8 publish it): "weight_block_size": [bn, bk],
    "activation_scheme": "dynamic"; per Linear weight [N, K] e4m3 and weight_scale_inv [ceil(N / bn), ceil(K / bk)]
    float32, amax / 448 of each block; W[n, k] = weight[n, k] * weight_scale_inv[n // bn, k // bk]. N or K not a
    multiple of the block leaves a partial last block, scaled by the entries it has. No input_scale (activations
    are quantized dynamically, per token group, by the kernels that use them)."""
    bn, bk = block

    def quantize_one(name, w):
        scale = (_block_amax(w, block) / 448.0).clamp(min=1e-12)  # [ceil(N / bn), ceil(K / bk)]
        full = _expand_blocks(scale, w.shape, block)  # [N, K]
        w8 = (w / full).clamp(-448, 448).to(FP8)
        return {"weight": w8, "weight_scale_inv": scale.float()}, w8.float() * full

    cfg = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [bn, bk]}
    return _quantized_pair(src, out, f"fp8-block-{bn}x{bk}", quantize_one, cfg)


def _kv_amax(model) -> dict[str, float]:
    """{attention module name: (amax of its k_proj output, amax of its v_proj output)} over a calibration prompt."""
    amax, hooks = {}, []
    for name, module in model.named_modules():
        if name.endswith(("k_proj", "v_proj")):
            def hook(mod, args, output, name=name):
                amax[name] = output.abs().max().item()
            hooks.append(module.register_forward_hook(hook))
    with torch.no_grad():
        model(torch.arange(2, 60)[None])
    for h in hooks:
        h.remove()
    return amax


def _has_experts(src: Path) -> bool:
    return any(".experts." in name for name in load_file(str(src / "model.safetensors")))


def _linears_as_stored(src: Path) -> torch.nn.Module:
    """A module tree with the checkpoint's names: an nn.Linear (float32) for every decoder linear's weight
    (`_is_linear`: the experts' per-expert projections included, not the routers), the other tensors as plain
    parameters, so that compressed-tensors quantizes exactly the layers a checkpoint of it would hold."""
    root = torch.nn.Module()

    def owner(path: list, last=None) -> torch.nn.Module:  # the module at path, made on the way (`last` at its end)
        module = root
        for i, part in enumerate(path):
            if not hasattr(module, part):
                module.add_module(part, last if i == len(path) - 1 and last is not None else torch.nn.Module())
            module = getattr(module, part)
        return module

    tensors = load_file(str(src / "model.safetensors"))
    linears = {name: t for name, t in tensors.items() if _is_linear(name)}
    for name, tensor in linears.items():  # first, so that a bias before its weight finds the Linear
        linear = owner(name.split(".")[:-1], torch.nn.Linear(tensor.shape[1], tensor.shape[0], bias=False))
        linear.weight.data.copy_(tensor.float())
    for name, tensor in tensors.items():
        if name not in linears:
            *path, leaf = name.split(".")
            owner(path).register_parameter(leaf, torch.nn.Parameter(tensor.float(), requires_grad=False))
    return root


def _compressed_tensors_checkpoint(src: Path, out: Path, name: str, scheme, fmt: str, set_qparams,
                                   kv_cache_scheme: bool = False) -> tuple[Path, Path]:
    """compressed-tensors end to end: its `scheme` applied to every Linear but lm_head, set_qparams(module) filling
    the scales / zero points as an observer would, its ModelCompressor compressing to `fmt` and writing the
    quantization_config; the reference weights come from its own decompressor applied to each compressed layer.
    kv_cache_scheme: also its static per-tensor FP8 KV-cache scheme, each attention's k_scale / v_scale set to
    amax / 448 of its k_proj / v_proj outputs on a calibration prompt."""
    from compressed_tensors.compressors import BaseCompressor, ModelCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, apply_quantization_config
    from transformers import AutoModelForCausalLM

    config = json.loads((src / "config.json").read_text())
    if _has_experts(src):  # transformers 5 stacks the experts (no nn.Linear for compressed-tensors to quantize)
        if kv_cache_scheme:
            raise ValueError("the KV-cache scheme needs the transformers model (no mixtures of experts)")
        model = _linears_as_stored(src)
        model.config = SimpleNamespace(tie_word_embeddings=config.get("tie_word_embeddings", False))
    else:
        model = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32)
    kv_args, kv_amax = None, {}
    if kv_cache_scheme:
        kv_args = QuantizationArgs(num_bits=8, type="float", strategy="tensor", dynamic=False, symmetric=True)
        kv_amax = _kv_amax(model)
    apply_quantization_config(model, QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head"],
                                                        kv_cache_scheme=kv_args))
    for module_name, module in model.named_modules():  # (not `name`: that names the output folder)
        if hasattr(module, "weight_scale"):
            set_qparams(module)
        if kv_cache_scheme and hasattr(module, "k_scale"):
            module.k_scale.data.fill_(kv_amax[f"{module_name}.k_proj"] / 448.0)
            module.v_scale.data.fill_(kv_amax[f"{module_name}.v_proj"] / 448.0)
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format=fmt)
    # compress_model (compressed-tensors 0.20) would hand the attention modules, which carry only the kv-cache
    # scheme and no weight, to the weight compressor: hide their scheme meanwhile (their k_scale / v_scale stay)
    kv_schemes = {m: m.quantization_scheme for m in model.modules() if hasattr(m, "k_scale")}
    for module in kv_schemes:
        del module.quantization_scheme
    compressor.compress_model(model)
    for module, kv_scheme in kv_schemes.items():
        module.quantization_scheme = kv_scheme
    state = dict(model.state_dict())
    if getattr(model.config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    decompressor = BaseCompressor.load_from_registry(fmt)
    dequantized = {}
    for key, tensor in state.items():
        prefix, _, local = key.rpartition(".")
        if local in ("weight_packed", "weight") and key.rpartition(".")[0] + ".weight_scale" in state:
            layer = {k.rpartition(".")[2]: v for k, v in state.items() if k.rpartition(".")[0] == prefix}
            dequantized[prefix + ".weight"] = decompressor.decompress(layer, scheme)["weight"].float()
        elif not local.startswith(("weight_", "input_")) and key not in dequantized:
            dequantized[key] = tensor
    state = {k: v for k, v in state.items() if not k.endswith("input_zero_point")
             and not (k.endswith("weight_zero_point") and scheme.weights.symmetric)}
    qdir, ddir = out / name, out / f"{name}-dequant"
    _copy_folder(src, qdir)
    _copy_folder(src, ddir)
    qcfg = compressor.quantization_config.model_dump(exclude_none=True)
    _write(qdir, state, json.loads(json.dumps(qcfg, default=str)))
    _write(ddir, dequantized, None)
    return qdir, ddir


def compressed_tensors_fp8_checkpoint(src: Path, out: Path, *, scheme: str = "FP8_DYNAMIC",
                                      strategy: str = "channel", block_structure: tuple[int, int] | None = None,
                                      kv_cache_scheme: bool = False) -> tuple[Path, Path]:
    """Its preset FP8 (static activations), FP8_DYNAMIC (per-token) or FP8_BLOCK scheme, float-quantized; weight
    scales amax / 448 per tensor or per channel, a fixed static input scale (the CPU path leaves activations as
    they are). FP8_BLOCK: strategy "block" whatever `strategy` says, weight_scale [ceil(N / bn), ceil(K / bk)]
    amax / 448 of each [bn, bk] block of block_structure (the preset's [128, 128] when None), the preset's dynamic
    per-group-of-128 input activations kept as they are; its compressor pads a partial last block with zeros."""
    from compressed_tensors.quantization.quant_scheme import preset_name_to_scheme

    quant_scheme = preset_name_to_scheme(scheme, ["Linear"])
    if scheme == "FP8_BLOCK":
        strategy = "block"
        if block_structure is not None:
            quant_scheme.weights.block_structure = list(block_structure)
        block_structure = tuple(quant_scheme.weights.block_structure)
    else:
        quant_scheme.weights.strategy = strategy

    def set_qparams(module):
        w = module.weight.data
        if strategy == "block":
            amax = _block_amax(w, block_structure)
        elif strategy == "channel":
            amax = w.abs().amax(dim=1, keepdim=True)
        else:
            amax = w.abs().amax().reshape(1)
        module.weight_scale.data.copy_((amax / 448.0).reshape(module.weight_scale.shape))
        if hasattr(module, "input_scale"):
            module.input_scale.data.fill_(0.05)

    layout = f"{block_structure[0]}x{block_structure[1]}" if strategy == "block" else strategy
    name = f"ct-{scheme.lower()}-{layout}" + ("-kv" if kv_cache_scheme else "")
    return _compressed_tensors_checkpoint(src, out, name, quant_scheme, "float-quantized", set_qparams,
                                          kv_cache_scheme)


def compressed_tensors_int_checkpoint(src: Path, out: Path, *, bits: int = 4, group_size: int | None = 32,
                                      symmetric: bool = True) -> tuple[Path, Path]:
    """Its W4A16 preset (group_size None: per-channel; asymmetric: with zero points), pack-quantized; scales
    and zero points from each group's min / max as its min-max observer computes them."""
    from compressed_tensors.quantization.quant_scheme import preset_name_to_scheme

    quant_scheme = preset_name_to_scheme("W4A16" if bits == 4 else "W8A16", ["Linear"])
    quant_scheme.weights.symmetric = symmetric
    quant_scheme.weights.strategy = "group" if group_size else "channel"
    quant_scheme.weights.group_size = group_size

    def set_qparams(module):
        w = module.weight.data  # [N, K]
        groups = w.view(w.shape[0], -1, group_size or w.shape[1])  # [N, G, g]
        qmin, qmax = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
        if symmetric:
            scale = groups.abs().amax(-1) / ((qmax - qmin) / 2)
            zero = torch.zeros_like(scale)
        else:
            lo, hi = groups.amin(-1).clamp(max=0), groups.amax(-1).clamp(min=0)
            scale = (hi - lo) / (qmax - qmin)
            zero = (qmin - lo / scale).round().clamp(qmin, qmax)
        module.weight_scale.data.copy_(scale.reshape(module.weight_scale.shape))
        if hasattr(module, "weight_zero_point"):
            module.weight_zero_point.data.copy_(zero.reshape(module.weight_zero_point.shape))

    name = f"ct-w{bits}a16-{'g' + str(group_size) if group_size else 'channel'}-{'sym' if symmetric else 'asym'}"
    return _compressed_tensors_checkpoint(src, out, name, quant_scheme, "pack-quantized", set_qparams)

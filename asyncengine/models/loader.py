"""Build a model for a checkpoint and load its safetensors weights (single file or sharded with an index)."""

from __future__ import annotations

import inspect
import json
import logging
from pathlib import Path
from typing import Iterator

import torch
from safetensors import safe_open

from asyncengine.config import ModelConfig
from asyncengine.distributed.parallel_state import tp_rank, tp_size
from asyncengine.models import model_class_for
from asyncengine.models.checkpoint_slice import CheckpointSlice
from asyncengine.models.layers import LinearBase, MergedColumnParallelLinear, QKVParallelLinear
from asyncengine.models.llama import LlamaForCausalLM
from asyncengine.models.moe import expert_format

logger = logging.getLogger(__name__)


def safetensors_files(folder: Path) -> list[Path]:
    """The weight files: those named by model.safetensors.index.json when present, else every *.safetensors."""
    index = folder / "model.safetensors.index.json"
    if index.exists():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [n for n in names if not (folder / n).exists()]
        if missing:
            raise ValueError(f"{index} names shards that are missing: {missing}")
        return [folder / n for n in names]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ValueError(f"model folder {folder} has no *.safetensors weights")
    return files


def iterate_weights(folder: Path) -> Iterator[tuple[str, torch.Tensor | CheckpointSlice]]:
    """(name, tensor) for every checkpoint tensor. With several ranks the tensors are `CheckpointSlice`s, read
    only where a weight loader takes its rank's slice, so no rank reads (or holds) the whole model."""
    sharded = tp_size() > 1
    for path in safetensors_files(folder):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                yield name, CheckpointSlice.whole(f.get_slice(name)) if sharded else f.get_tensor(name)


def _expected_shards(model: torch.nn.Module) -> set[tuple[str, object]]:
    expected = set()
    for module_name, module in model.named_modules():
        for pname, _ in module.named_parameters(recurse=False):
            full = f"{module_name}.{pname}" if module_name else pname
            if isinstance(module, QKVParallelLinear):
                expected |= {(full, s) for s in ("q", "k", "v")}
            elif isinstance(module, MergedColumnParallelLinear):
                expected |= {(full, s) for s in range(len(module.out_sizes))}
            elif hasattr(module, "shard_ids"):  # a module filled piecewise by its own shard ids (e.g. experts)
                expected |= {(full, s) for s in module.shard_ids(pname)}
            else:
                expected.add((full, None))
    return expected


def _quantization_kwargs(model_config: ModelConfig, cls: type, device: torch.device) -> dict:
    """{"quant_config": ...} for a quantized checkpoint (checked against the family and the device), else {}."""
    quant_config = model_config.quant_config
    if quant_config is None:
        return {}
    # Families that build their linears themselves take no quantized weights; those with their own feed-forward
    # blocks (MoE experts) take the formats models/moe.py expert_format names (FP8 block-wise or online, int4).
    takes_quant_config = "quant_config" in inspect.signature(cls.__init__).parameters
    own_mlp = issubclass(cls, LlamaForCausalLM) and cls.make_mlp is not LlamaForCausalLM.make_mlp
    if not takes_quant_config:
        raise ValueError(f"quantization ({quant_config.name}) is not supported for {model_config.architecture} "
                         "(supported: the dense Llama family: Llama, Mistral, Qwen2, Qwen3; and for the "
                         "mixture-of-experts families block-wise FP8 checkpoints, weight_block_size; "
                         "--quantization fp8; GPTQ, AWQ and compressed-tensors int4)")
    if own_mlp:
        try:
            expert_format(quant_config.linear_method())
        except ValueError as error:
            raise ValueError(f"quantization ({quant_config.name}) of {model_config.architecture}: {error}") from None
    quant_config.check_device(device)
    if device.type == "cpu":
        logger.info("quantized weights (%s) run on CPU through the torch references: each layer dequantizes its "
                    "weight, then multiplies in %s (FP8 activations are not quantized on CPU)",
                    quant_config.describe(), model_config.dtype)
    else:
        logger.info("quantized weights: %s", quant_config.describe())
    return {"quant_config": quant_config}


def load_model(model_config: ModelConfig, device: torch.device, max_positions: int,
               load_format: str = "auto", seed: int = 0) -> torch.nn.Module:
    """Instantiate the architecture on `device` in model_config.dtype and fill every parameter from disk (each
    rank reads only its slices), or with random values drawn on `device` (load_format "dummy")."""
    cls = model_class_for(model_config.architecture)
    quant = _quantization_kwargs(model_config, cls, device)
    with torch.device(device):
        model = cls(model_config.hf_config, model_config.dtype, max_positions, **quant)
    if load_format == "dummy":
        fill_random(model, seed, device)
    else:
        weights = iterate_weights(Path(model_config.path))
        if quant:  # tensors the format does not need (e.g. compressed-tensors' weight_shape)
            skipped = quant["quant_config"].skipped_checkpoint_tensors()
            weights = ((name, t) for name, t in weights if not (skipped and name.endswith(skipped)))
        processing = LayerwiseProcessing(model)  # each layer processed as soon as it is complete
        if "loaded" in inspect.signature(model.load_weights).parameters:
            model.load_weights(weights, loaded=processing)
        else:  # a plugin's family with load_weights(weights) alone: its layers are processed after the checkpoint
            processing.update(model.load_weights(weights))
        missing = processing.missing()
        if missing:
            raise ValueError(f"checkpoint {model_config.path} lacks weights for: {', '.join(missing[:10])}")
    for module in model.modules():
        process_module(module)
    if hasattr(model, "process_weights_after_loading"):  # the whole model's own step (e.g. the LM head's GEMV)
        model.process_weights_after_loading()
    return model.eval()


def process_module(module: torch.nn.Module) -> None:
    """Once a module's weights are all loaded, what its format does with them (repacking, FP8 scales, quantizing
    online); a second call does nothing."""
    if getattr(module, "weights_processed", False):
        return
    if isinstance(module, LinearBase):
        module.linear_method.process_weights_after_loading(module)
    elif hasattr(module, "process_expert_weights"):  # models/moe.py FusedMoE: FP8 / int4 experts for the kernels
        module.process_expert_weights()
    module.weights_processed = True


class LayerwiseProcessing(set):
    """The set of (parameter name, shard id) pairs loaded so far, handed to the model's load_weights, which adds each
    pair (`add` or `update`) as soon as it is written. Each module is processed (process_module) once every shard of
    its parameters is in, instead of after the whole checkpoint. With `--quantization fp8` the model-dtype weights
    wait in host memory (quantization.base.quantized_after_loading) only until their layer is complete, so neither
    the accelerator nor the host holds the unquantized model whole: a bf16 model larger than the GPU loads as FP8."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model
        self.expected = _expected_shards(model)
        self.waiting: dict[str, set] = {}  # module name -> its parameters' shards not loaded yet
        for param_name, shard in self.expected:
            self.waiting.setdefault(_owner(param_name), set()).add((param_name, shard))

    def add(self, pair: tuple[str, object]) -> None:
        super().add(pair)
        owner = _owner(pair[0])
        waiting = self.waiting.get(owner)
        if waiting is not None:
            waiting.discard(pair)
            if not waiting:
                del self.waiting[owner]
                process_module(self.model.get_submodule(owner))

    def update(self, *pairs_iterables) -> None:
        for pairs in pairs_iterables:
            for pair in pairs:
                self.add(pair)

    def missing(self) -> list[str]:
        """The shards no tensor filled, named for the error message."""
        return sorted(n + (f"[{s}]" if s is not None else "") for n, s in self.expected - self)


def _owner(param_name: str) -> str:
    return param_name.rsplit(".", 1)[0] if "." in param_name else ""


@torch.no_grad()
def fill_random(model: torch.nn.Module, seed: int, device: torch.device) -> None:
    """Random weights drawn on `device` (each rank its own slices): matrices N(0, 0.02), the LM head N(0, 0.25) so
    logits are peaked like a trained model's, vectors (norms) 1, integer (packed) tensors left as allocated. Each
    module is processed (process_module) once filled, so weights waiting in host memory to be quantized
    (quantization.base.quantized_after_loading) are drawn on `device` and quantized one layer at a time."""
    generator = torch.Generator(device=device).manual_seed(seed * 1000 + tp_rank())
    for module_name, module in model.named_modules():
        for param_name, param in module.named_parameters(recurse=False):
            if not param.dtype.is_floating_point:
                continue
            if hasattr(param, "target_device"):  # waits in host memory: drawn where it will be quantized
                param.data = torch.empty_like(param, device=param.target_device)
            if param.dim() == 1:
                param.fill_(1.0)
            else:
                name = f"{module_name}.{param_name}" if module_name else param_name
                param.normal_(0.0, 0.25 if name.startswith("lm_head") else 0.02, generator=generator)
        process_module(module)

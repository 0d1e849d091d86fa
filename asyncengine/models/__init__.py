"""Model families, looked up by the `architectures` entry of a checkpoint's config.json.

Third parties add families through `asyncengine.plugins` (`register_model`), which writes into the same registry.
"""

from __future__ import annotations

from asyncengine.models.bert import BertModel
from asyncengine.models.llama import LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM
from asyncengine.models.moe import MixtralForCausalLM, Qwen2MoeForCausalLM, Qwen3MoeForCausalLM

_REGISTRY: dict[str, type] = {
    "BertModel": BertModel,
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Qwen2MoeForCausalLM": Qwen2MoeForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
}


def register_model(architecture: str, model_class: type) -> None:
    """Make `architecture` (as spelled in config.json) load with `model_class`."""
    _REGISTRY[architecture] = model_class


def supported_architectures() -> set[str]:
    return set(_REGISTRY)


def model_class_for(architecture: str) -> type:
    try:
        return _REGISTRY[architecture]
    except KeyError:
        raise ValueError(f"architecture {architecture!r} is not supported; supported: {sorted(_REGISTRY)}") from None

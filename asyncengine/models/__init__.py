"""Model families, looked up by the `architectures` entry of a checkpoint's config.json.

Third parties add families through `asyncengine.plugins` (`register_model`), which writes into the same registry.
"""

from __future__ import annotations

from asyncengine.models.bert import BertForSequenceClassification, BertModel
from asyncengine.models.gemma import Gemma2ForCausalLM, Gemma3ForCausalLM
from asyncengine.models.llama import LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM
from asyncengine.models.phi3 import Phi3ForCausalLM
from asyncengine.models.moe import MixtralForCausalLM, Qwen2MoeForCausalLM, Qwen3MoeForCausalLM

_REGISTRY: dict[str, type] = {
    "BertModel": BertModel,
    "BertForSequenceClassification": BertForSequenceClassification,
    "Gemma2ForCausalLM": Gemma2ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    "Qwen2MoeForCausalLM": Qwen2MoeForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
}

HOW_TO_REGISTER = (
    "to add a family, register it from a plugin: an entry point in the group 'asyncengine.plugins' whose "
    "register(registry) calls registry.register_model(architecture, model_class) (see asyncengine.plugins)"
)


def unsupported_architecture_message(architectures) -> str:
    """The error for a checkpoint none of whose architectures is registered: what is supported, and how to add one."""
    return (f"architectures {list(architectures)} not supported; supported: {sorted(_REGISTRY)}; "
            f"{HOW_TO_REGISTER}")


def register_model(architecture: str, model_class: type) -> None:
    """Make `architecture` (as spelled in config.json) load with `model_class`."""
    _REGISTRY[architecture] = model_class


def supported_architectures() -> set[str]:
    return set(_REGISTRY)


def model_class_for(architecture: str) -> type:
    try:
        return _REGISTRY[architecture]
    except KeyError:
        raise ValueError(unsupported_architecture_message([architecture])) from None

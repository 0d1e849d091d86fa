"""Tiny random Hugging Face checkpoints, built offline, for tests.

Each is saved exactly as a downloaded model would be (config.json, model.safetensors, tokenizer.json,
tokenizer_config.json with a chat template, generation_config.json), so the engine loads it through the same
code path as a real Llama.
"""

from __future__ import annotations

from pathlib import Path

import torch

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello world! How are you today? I am fine, thank you.",
    "Paged attention stores keys and values in fixed-size blocks.",
    "Continuous batching keeps the accelerator busy while requests come and go.",
    "Ünïcödé têxt, emoji 🙂🚀 and 漢字 must round-trip through byte-level BPE.",
    "def main():\n    print('hello')\n",
    "0123456789 + - * / = ( ) [ ] { } < > , . ; : ! ?",
]


def build_tokenizer(folder: Path, vocab_size: int = 384, added_tokens: tuple[str, ...] = ()):
    """A byte-level BPE tokenizer trained on a few sentences, wrapped as a transformers fast tokenizer.
    added_tokens: appended as non-special added tokens (as Qwen3 adds `<think>` and `</think>`)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<s>", "</s>", "<pad>", "<|user|>", "<|assistant|>", "<|system|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(_CORPUS * 20, trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    fast.chat_template = CHAT_TEMPLATE
    fast.add_tokens(list(added_tokens))
    fast.save_pretrained(str(folder))
    return fast


SLIDING_WINDOW = 12  # tokens; shorter than most test prompts, and than every prompt plus its output


def _config(arch: str, vocab_size: int, **overrides):
    from transformers import (Gemma2Config, Gemma3TextConfig, LlamaConfig, MistralConfig, MixtralConfig, Phi3Config,
                              Qwen2Config, Qwen2MoeConfig, Qwen3Config, Qwen3MoeConfig)

    common = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=2,
        rms_norm_eps=1e-6,
        architectures=[arch],
    )
    if arch == "LlamaForCausalLM":  # Llama-3.1-style rope scaling that matters at these short positions
        common["rope_scaling"] = {
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        }
        common["rope_theta"] = 500000.0
        cls = LlamaConfig
    elif arch == "MistralForCausalLM":  # a window shorter than most test prompts (and than their outputs)
        cls = MistralConfig
        common["sliding_window"] = SLIDING_WINDOW
    elif arch == "Qwen2ForCausalLM":
        cls = Qwen2Config
        common["tie_word_embeddings"] = True
    elif arch == "Qwen3ForCausalLM":
        cls = Qwen3Config
        common["head_dim"] = 32  # Qwen3 decouples head_dim from hidden / heads
    elif arch in ("Gemma2ForCausalLM", "Gemma3ForCausalLM"):
        # local then global layer; a small soft-cap that the random scores reach; query_pre_attn_scalar != head_dim
        common.update(head_dim=16, query_pre_attn_scalar=24, sliding_window=SLIDING_WINDOW,
                      layer_types=["sliding_attention", "full_attention"], hidden_activation="gelu_pytorch_tanh")
        if arch == "Gemma2ForCausalLM":
            cls = Gemma2Config
            common.update(attn_logit_softcapping=2.0, final_logit_softcapping=8.0)
        else:  # Gemma 3: q/k norms, and local layers on their own rope base
            cls = Gemma3TextConfig
            common["rope_parameters"] = {
                "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
            }
    elif arch == "Phi3ForCausalLM":
        # LongRoPE with a pretraining length beyond the tests' sequences (short factors; the long ones are checked
        # on their own), every layer windowed
        cls = Phi3Config
        head_dim = 64 // 4
        common.update(sliding_window=SLIDING_WINDOW, original_max_position_embeddings=128, rope_parameters={
            "rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 128,
            "short_factor": [1.0 + 0.25 * i for i in range(head_dim // 2)],
            "long_factor": [2.0 + i for i in range(head_dim // 2)],
        })
    elif arch == "MixtralForCausalLM":  # 8 experts, top-2, as Mixtral-8x7B
        cls = MixtralConfig
        common.update(num_local_experts=8, num_experts_per_tok=2, intermediate_size=64, sliding_window=None)
    elif arch == "Qwen2MoeForCausalLM":  # top-4 of 8 without renormalising, a shared expert, one dense layer
        cls = Qwen2MoeConfig
        common.update(num_hidden_layers=3, num_experts=8, num_experts_per_tok=4, moe_intermediate_size=32,
                      shared_expert_intermediate_size=96, norm_topk_prob=False, decoder_sparse_step=1,
                      mlp_only_layers=[1], use_sliding_window=False, tie_word_embeddings=True)
    elif arch == "Qwen3MoeForCausalLM":  # many small experts, top-4 of 16, renormalised, per-head q/k norms
        cls = Qwen3MoeConfig
        common.update(num_experts=16, num_experts_per_tok=4, moe_intermediate_size=32, norm_topk_prob=True,
                      head_dim=32, sliding_window=None, use_sliding_window=False)
    else:
        raise ValueError(arch)
    common.update(overrides)
    return cls(**common)


def build_checkpoint(
    folder: Path, arch: str = "LlamaForCausalLM", seed: int = 0, dtype=torch.float32, lm_head_std: float = 0.08,
    added_tokens: tuple[str, ...] = (), **overrides,
) -> Path:
    """Save a random model of `arch` and its tokenizer to folder; returns folder. A larger lm_head_std makes the
    logits peaked like a trained model's (so top-1 comparisons are not decided by rounding noise). added_tokens:
    see build_tokenizer (the model's vocabulary includes them)."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(folder, added_tokens=added_tokens)
    config = _config(arch, overrides.pop("vocab_size", len(tokenizer)), **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    with torch.no_grad():  # larger weights than the default init: peaked logits, so greedy ties are unlikely
        for name, p in model.named_parameters():
            if name == "lm_head.weight":
                p.normal_(0.0, lm_head_std)
            elif p.dim() >= 2:  # matrices, and experts stacked as [E, out, in] by transformers 5
                p.normal_(0.0, 0.08)
            elif "bias" in name:
                p.normal_(0.0, 0.02)
            elif arch.startswith("Gemma") and "post_" in name:  # Gemma's (1 + w) norms on the layer outputs:
                p.normal_(3.0, 0.5)  # outputs that outweigh the tied embedding, so greedy does not echo its input
    model.save_pretrained(str(folder))
    GenerationConfig(bos_token_id=0, eos_token_id=1, pad_token_id=2).save_pretrained(str(folder))
    return folder


ARCHITECTURES = ["LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                 "Gemma2ForCausalLM", "Gemma3ForCausalLM", "Phi3ForCausalLM", "MixtralForCausalLM",
                 "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"]

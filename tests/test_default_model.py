"""The embedded default model: a standard HF checkpoint that loads offline and writes real words."""

from __future__ import annotations

import json
import string
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

MODEL_DIR = Path(__file__).parents[1] / "asyncengine" / "default_model"
PROMPT = "ROMEO:"
MAX_FILE_BYTES = 16 * 2**20


def normalize_word(token: str) -> str:
    """Lowercase and strip punctuation from both ends (as scripts/build_corpus.py does)."""
    return token.strip(string.punctuation).lower()


@pytest.fixture(scope="module")
def tokenizer():
    return transformers.AutoTokenizer.from_pretrained(MODEL_DIR, local_files_only=True)


@pytest.fixture(scope="module")
def model():
    m = transformers.AutoModelForCausalLM.from_pretrained(
        MODEL_DIR, local_files_only=True, dtype=torch.float32
    )
    return m.eval()


@pytest.fixture(scope="module")
def vocabulary() -> set[str]:
    return set((MODEL_DIR / "words.txt").read_text(encoding="utf-8").split())


def test_files_are_a_small_standard_checkpoint():
    for name in ("config.json", "generation_config.json", "model.safetensors",
                 "tokenizer.json", "tokenizer_config.json", "words.txt", "SOURCE.md"):
        assert (MODEL_DIR / name).is_file(), name
    assert all(f.stat().st_size <= MAX_FILE_BYTES for f in MODEL_DIR.iterdir())
    config = json.loads((MODEL_DIR / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["head_dim"] == 64 and config["tie_word_embeddings"] is True
    assert config["num_key_value_heads"] < config["num_attention_heads"]
    assert config.get("dtype", config.get("torch_dtype")) == "bfloat16"


def test_loads_offline(model, tokenizer):
    assert isinstance(model, transformers.LlamaForCausalLM)
    assert model.config.vocab_size == len(tokenizer)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert tokenizer.bos_token == "<|begin_of_text|>" and tokenizer.eos_token == "<|end_of_text|>"
    assert tokenizer.pad_token == "<|pad|>"
    assert model.config.bos_token_id == tokenizer.bos_token_id
    assert tokenizer.eos_token_id in model.generation_config.eos_token_id


def test_tokenizer_round_trips_text(tokenizer):
    text = "But soft! what light through yonder window breaks?\n\tÜnïcødé — 日本  x"
    ids = tokenizer(text).input_ids
    assert ids[0] == tokenizer.bos_token_id
    assert tokenizer.decode(ids, skip_special_tokens=True) == text


def test_greedy_continuation_is_mostly_real_words(model, tokenizer, vocabulary):
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=64, do_sample=False)
    text = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    words = [w for w in map(normalize_word, text.split()) if w]
    assert len(words) >= 10, text
    known = sum(w in vocabulary for w in words) / len(words)
    assert known >= 0.7, f"{known:.0%} known words in {text!r}"


def test_chat_template_applies(tokenizer):
    messages = [
        {"role": "system", "content": "You are Romeo."},
        {"role": "user", "content": "Who art thou?"},
    ]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nYou are Romeo.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nWho art thou?<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    plain = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    assert plain.endswith("Who art thou?<|eot_id|>")
    ids = tokenizer(text, add_special_tokens=False).input_ids
    assert ids[0] == tokenizer.bos_token_id and ids.count(tokenizer.bos_token_id) == 1
    eot = tokenizer.convert_tokens_to_ids("<|eot_id|>")
    assert ids.count(eot) == 2
    with pytest.raises(Exception):
        tokenizer.apply_chat_template([{"role": "robot", "content": "hi"}], tokenize=False)


@pytest.fixture(scope="module")
def engine_llm():
    from asyncengine import LLM

    return LLM(max_model_len=512)  # no model named: the embedded default


def test_engine_finds_default_model_and_matches_transformers_greedy(engine_llm, model, tokenizer):
    from asyncengine import SamplingParams

    assert Path(engine_llm.engine.config.model).resolve() == MODEL_DIR.resolve()
    ours = engine_llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=48, ignore_eos=True), use_tqdm=False)
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    ref = model.generate(ids, max_new_tokens=48, min_new_tokens=48, do_sample=False)[0, ids.shape[1]:].tolist()
    assert ours[0].outputs[0].token_ids == ref


def test_engine_text_is_mostly_real_words(engine_llm, vocabulary):
    from asyncengine import SamplingParams

    params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=64, seed=7)
    text = engine_llm.generate(["In the beginning"], params, use_tqdm=False)[0].outputs[0].text
    words = [normalize_word(w) for w in text.split()]
    words = [w for w in words if w]
    assert len(words) >= 20
    known = sum(w in vocabulary for w in words) / len(words)
    assert known >= 0.7, (known, text)


def test_a_named_model_wins_over_the_default(llama_dir):
    from asyncengine import LLM

    assert LLM(str(llama_dir), max_model_len=64).engine.config.model == str(llama_dir)

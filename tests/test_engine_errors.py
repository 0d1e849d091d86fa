"""Bad checkpoints and bad configuration fail early with a ValueError that names what is wrong; LLM.chat renders
the checkpoint's chat template."""

from __future__ import annotations

import json
import shutil

import pytest

from asyncengine import LLM, EngineConfig, LLMEngine, SamplingParams


@pytest.fixture
def broken(tmp_path, llama_dir):
    """A private copy of the tiny Llama checkpoint to break."""
    folder = tmp_path / "model"
    shutil.copytree(llama_dir, folder)
    return folder


def load(folder, **kwargs):
    return LLMEngine(EngineConfig(model=str(folder), max_model_len=64, **kwargs))


# -- checkpoints -----------------------------------------------------------------------------------------------
def test_missing_folder(tmp_path):
    with pytest.raises(ValueError, match="not a local folder"):
        load(tmp_path / "nowhere")


def test_folder_without_config_json(broken):
    (broken / "config.json").unlink()
    with pytest.raises(ValueError, match="no config.json"):
        load(broken)


def test_unsupported_architecture_is_named_with_the_supported_ones(broken):
    config = json.loads((broken / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (broken / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"GPT2LMHeadModel.*not supported.*LlamaForCausalLM"):
        load(broken)


def test_folder_without_safetensors(broken):
    (broken / "model.safetensors").unlink()
    with pytest.raises(ValueError, match=r"no \*\.safetensors"):
        load(broken)


@pytest.mark.parametrize(
    "tensor, named",
    [
        ("model.layers.1.mlp.down_proj.weight", "layers.1.mlp.down_proj.weight"),
        ("model.layers.0.self_attn.k_proj.weight", "layers.0.self_attn.qkv_proj.weight[k]"),
        ("model.layers.0.mlp.up_proj.weight", "layers.0.mlp.gate_up_proj.weight[1]"),
        ("model.norm.weight", "norm.weight"),
    ],
)
def test_missing_weight_tensor_is_named(broken, tensor, named):
    from safetensors.torch import load_file, save_file

    path = broken / "model.safetensors"
    weights = load_file(str(path))
    del weights[tensor]
    save_file(weights, str(path), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="lacks weights for") as info:
        load(broken)
    assert named in str(info.value)


def test_missing_shard_named_by_the_index(broken):
    (broken / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": {"lm_head.weight": "model-00002-of-00002.safetensors"}})
    )
    with pytest.raises(ValueError, match="model-00002-of-00002.safetensors"):
        load(broken)


def test_unexpected_tensor_is_named(broken):
    from safetensors.torch import load_file, save_file

    path = broken / "model.safetensors"
    weights = load_file(str(path))
    weights["model.layers.0.mystery.weight"] = weights["model.norm.weight"].clone()
    save_file(weights, str(path), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="mystery"):
        load(broken)


# -- configuration ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(block_size=0), "block_size"),
        (dict(block_size=3), "block_size"),
        (dict(block_size=512), "block_size"),
        (dict(block_size=16.0), "block_size"),
        (dict(max_num_seqs=0), "max_num_seqs"),
        (dict(max_num_batched_tokens=-1), "max_num_batched_tokens"),
        (dict(max_model_len=0), "max_model_len"),
        (dict(num_kv_blocks=0), "num_kv_blocks"),
        (dict(gpu_memory_utilization=1.5), "gpu_memory_utilization"),
        (dict(gpu_memory_utilization=0), "gpu_memory_utilization"),
        (dict(kv_cache_memory_gb=0), "kv_cache_memory_gb"),
        (dict(max_queue_len=-1), "max_queue_len"),
        (dict(dtype="int8"), "dtype"),
        (dict(tensor_parallel_size=0), "tensor_parallel_size"),
        (dict(distributed_executor_backend="slurm"), "distributed_executor_backend"),
        (dict(distributed_timeout_s=0), "distributed_timeout_s"),
        (dict(load_format="pt"), "load_format"),
    ],
)
def test_engine_config_rejects_bad_values_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=rf"^{field}\b|\b{field} \("):
        EngineConfig(**kwargs)


@pytest.mark.parametrize("device, seqs, tokens", [("cpu", 64, 2048), ("cuda", 256, 8192), ("cuda:0", 256, 8192)])
def test_batch_limits_default_by_device_and_stay_when_given(device, seqs, tokens):
    config = EngineConfig(device=device)  # no GPU needed: only the device's type is read here
    assert (config.max_num_seqs, config.max_num_batched_tokens, config.min_prefill_batch) == (seqs, tokens, seqs // 16)
    given = EngineConfig(device=device, max_num_seqs=8, max_num_batched_tokens=512)
    assert (given.max_num_seqs, given.max_num_batched_tokens) == (8, 512)


def test_max_model_len_beyond_the_model_is_rejected(llama_dir):
    with pytest.raises(ValueError, match=r"max_model_len \(1024\).*max_position_embeddings \(512\)"):
        LLMEngine(EngineConfig(model=str(llama_dir), max_model_len=1024))


def test_kv_cache_smaller_than_one_sequence_is_rejected(llama_dir):
    with pytest.raises(ValueError, match=r"2 blocks x 16 tokens = 32 tokens.*max_model_len \(64\)"):
        LLMEngine(EngineConfig(model=str(llama_dir), max_model_len=64, num_kv_blocks=2))


def test_no_chunked_prefill_with_a_budget_below_the_model_length_is_rejected(llama_dir):
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        engine = LLMEngine(EngineConfig(model=str(llama_dir), enable_chunked_prefill=False, max_num_batched_tokens=8))
        engine.add_request("long", [5] * 20, SamplingParams(max_tokens=2))
        for _ in range(10):  # without the check, the request waits forever: fail instead of hanging
            engine.step()
        assert not engine.has_unfinished_requests()


# -- chat ------------------------------------------------------------------------------------------------------
def test_chat_applies_the_chat_template(llama_dir):
    llm = LLM(str(llama_dir), max_model_len=128)
    tok = llm.get_tokenizer()
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello world"}]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    chat = llm.chat(messages, params, use_tqdm=False)[0]
    rendered = "<s><|system|>Be brief.</s><|user|>Hello world</s><|assistant|>"  # by hand, from CHAT_TEMPLATE
    expected_ids = tok(rendered, add_special_tokens=False).input_ids
    assert expected_ids.count(0) == 1 and expected_ids[0] == 0  # one BOS: the template's, not a second one
    assert chat.prompt_token_ids == expected_ids
    direct = llm.generate([expected_ids], params, use_tqdm=False)[0]
    assert chat.outputs[0].token_ids == direct.outputs[0].token_ids
    two = llm.chat([messages, messages[1:]], params, use_tqdm=False)
    assert two[0].outputs[0].token_ids == chat.outputs[0].token_ids
    assert two[1].prompt_token_ids == tok("<s><|user|>Hello world</s><|assistant|>", add_special_tokens=False).input_ids
    no_prompt = llm.chat(messages, params, use_tqdm=False, add_generation_prompt=False)[0]
    assert no_prompt.prompt_token_ids == expected_ids[: -len(tok("<|assistant|>", add_special_tokens=False).input_ids)]


def test_chat_rejects_malformed_messages(llama_dir):
    llm = LLM(str(llama_dir), max_model_len=64)
    with pytest.raises(ValueError, match=r"messages\[1\].*'role'"):
        llm.chat([{"role": "user", "content": "hi"}, {"content": "no role"}], use_tqdm=False)

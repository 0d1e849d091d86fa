"""Plugins register model families that checkpoints then load by their `architectures` name."""

from __future__ import annotations

import json

import pytest

from asyncengine import LLM, SamplingParams
from asyncengine.models import supported_architectures
from asyncengine.models.llama import LlamaForCausalLM
from asyncengine.plugins import load_plugins


class MyLlama(LlamaForCausalLM):
    """An out-of-tree family: here simply the Llama code under another architecture name."""


class MyOlderLlama(LlamaForCausalLM):
    """A family written to the older contract: load_weights(weights) alone, returning the pairs it wrote."""

    def load_weights(self, weights):
        return super().load_weights(weights)


@pytest.mark.parametrize("family", [MyLlama, MyOlderLlama], ids=["loaded-argument", "weights-alone"])
def test_plugin_registers_a_model_family_that_loads(tmp_path, llama_dir, family):
    def register(registry):
        registry.register_model("MyLlamaForCausalLM", family)

    assert load_plugins({"mine": register}) == ["mine"]
    assert "MyLlamaForCausalLM" in supported_architectures()
    folder = tmp_path / "mine"
    folder.mkdir()
    for f in llama_dir.iterdir():
        (folder / f.name).write_bytes(f.read_bytes())
    config = json.loads((folder / "config.json").read_text())
    config["architectures"] = ["MyLlamaForCausalLM"]
    (folder / "config.json").write_text(json.dumps(config))
    llm = LLM(str(folder), max_model_len=64)
    assert type(llm.engine.runner.model) is family
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    ours = llm.generate(["Hello"], params, use_tqdm=False)[0].outputs[0].token_ids
    assert ours == LLM(str(llama_dir), max_model_len=64).generate(["Hello"], params, use_tqdm=False)[0].outputs[0].token_ids


def test_a_broken_plugin_is_skipped_not_fatal():
    def broken(registry):
        raise RuntimeError("boom")

    assert load_plugins({"broken": broken}) == []

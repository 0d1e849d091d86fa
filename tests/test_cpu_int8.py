"""Opt-in int8 on CPU (asyncengine.quantization.cpu_int8, `quantization="int8"`, issue 17): the product against
the exact integer arithmetic it stands for, the default model end to end, and the errors."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from asyncengine import LLM, SamplingParams
from asyncengine.config import EngineConfig
from asyncengine.quantization import quantization_config_for
from asyncengine.quantization.cpu_int8 import (WEIGHT_MAX, Int8Config, int8_linear, prepack,
                                               quantize_weight_per_channel)


def test_weights_are_7_bit_per_channel_and_round_trip_within_half_a_step():
    torch.manual_seed(0)
    weight = torch.randn(48, 64) * torch.logspace(-3, 0, 48)[:, None]  # rows of very different magnitudes
    weight[5] = 0  # an all-zero row
    q, scale = quantize_weight_per_channel(weight)
    assert q.dtype == torch.int8 and q.shape == weight.shape and scale.shape == (48,)
    assert int(q.abs().max()) == WEIGHT_MAX and torch.all(q[5] == 0)
    err = (q.float() * scale[:, None] - weight).abs()
    assert torch.all(err <= scale[:, None] / 2 + 1e-7)


@pytest.mark.parametrize("rows", [1, 64, 300])
def test_int8_linear_is_as_close_to_float_as_per_token_quantization(rows):
    """Every output row within 5% of its largest float32 value (measured: 1.6% median, 3% worst, as the exact
    per-token integer arithmetic). With one activation scale for the whole tensor, the rows 1000x smaller than
    the largest would be off by 20-110%."""
    torch.manual_seed(rows)
    x = torch.randn(rows, 256) * torch.logspace(-2, 1, rows)[:, None]  # tokens of very different magnitudes
    weight = torch.randn(512, 256) * 0.05
    bias = torch.randn(512)
    got = int8_linear(x, prepack(*quantize_weight_per_channel(weight)), bias)
    expected = F.linear(x, weight)
    row_err = ((got - bias - expected).abs() / expected.abs().amax(dim=1, keepdim=True)).amax(dim=1)
    assert float(row_err.max()) < 0.05


def test_zero_rows_give_the_bias_and_bfloat16_input_keeps_its_dtype():
    weight = torch.randn(16, 32)
    packed = prepack(*quantize_weight_per_channel(weight))
    bias = torch.randn(16)
    out = int8_linear(torch.zeros(3, 32), packed, bias)
    assert torch.equal(out, bias.expand(3, 16))
    assert int8_linear(torch.randn(2, 32, dtype=torch.bfloat16), packed).dtype == torch.bfloat16


def test_int8_on_the_default_model_keeps_most_greedy_outputs_of_float32():
    prompts = [f"The {w} of the day was" for w in ("story", "end", "start", "name", "color", "sound", "light",
                                                  "rain")]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    float_llm = LLM(max_model_len=128)
    expected = [o.outputs[0].token_ids for o in float_llm.generate(prompts, params, use_tqdm=False)]
    del float_llm
    llm = LLM(max_model_len=128, quantization="int8")
    linears = [m for m in llm.engine.runner.model.modules() if hasattr(m, "int8_packed")]
    assert len(linears) == 4 * llm.engine.model_config.num_layers  # qkv, o, gate_up, down of every layer
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    same = sum(a == b for a, b in zip(got, expected))
    assert same >= len(prompts) // 2 + 1, f"only {same} of {len(prompts)} greedy outputs equal float32's"


def test_int8_is_cpu_only_and_needs_an_unquantized_checkpoint():
    with pytest.raises(ValueError, match="'int8' runs on CPU only"):
        Int8Config().check_device(torch.device("cuda"))
    with pytest.raises(ValueError, match="does not match the checkpoint's quantization_config"):
        quantization_config_for({"quant_method": "fp8"}, "int8")
    assert EngineConfig(quantization="int8").quantization == "int8"

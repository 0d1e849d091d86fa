"""CPU weight layout (asyncengine.quantization.cpu_prepacked): the same values and shape, column-major storage,
bit-identical matrix products; the engine's linear layers get it after loading, on CPU."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from asyncengine.quantization.cpu_prepacked import is_cpu_gemm_layout, use_cpu_gemm_layout


def test_column_major_weight_keeps_values_and_shape_and_gives_identical_products():
    torch.manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(48, 40), requires_grad=False)
    before = weight.detach().clone()
    x = torch.randn(64, 40)
    expected = F.linear(x, weight)
    use_cpu_gemm_layout(weight)
    assert weight.shape == (48, 40) and is_cpu_gemm_layout(weight) and not weight.is_contiguous()
    assert torch.equal(weight, before)
    assert torch.equal(F.linear(x, weight), expected)  # bit-identical, not merely close


def test_non_float_and_non_matrix_tensors_are_left_alone():
    ints = torch.randint(0, 100, (8, 4), dtype=torch.int32)
    bias = torch.randn(8)
    use_cpu_gemm_layout(ints)
    use_cpu_gemm_layout(bias)
    assert ints.is_contiguous() and bias.is_contiguous()


def test_loaded_default_model_linears_are_column_major_on_cpu():
    from asyncengine.config import EngineConfig, load_model_config
    from asyncengine.models.layers import LinearBase
    from asyncengine.models.loader import load_model

    cpu = torch.device("cpu")
    model = load_model(load_model_config(EngineConfig(), cpu), cpu, max_positions=64)
    linears = [m for m in model.modules() if isinstance(m, LinearBase)]
    assert linears and all(is_cpu_gemm_layout(m.weight) for m in linears)

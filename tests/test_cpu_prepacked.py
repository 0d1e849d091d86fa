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


def test_onednn_packed_product_matches_f_linear_and_does_not_depend_on_the_batch():
    """oneDNN's packed product (used where it measured faster at start-up): within float32 rounding of F.linear, and
    a row's result is the same bits alone as among 200 rows (the engine's batch invariance rests on that)."""
    import pytest

    from asyncengine.quantization.cpu_prepacked import onednn_available, onednn_linear, onednn_pack

    if not onednn_available():
        pytest.skip("torch was built without oneDNN")
    weight = torch.randn(1408, 256).t().contiguous().t()  # column-major, as the engine stores it
    packed = onednn_pack(weight)
    x = torch.randn(200, 256)
    bias = torch.randn(1408)
    full = onednn_linear(x, packed, bias)
    # outputs of size ~16 (256 products of unit normals): float32's rounding in another order, a few 1e-5 apart
    torch.testing.assert_close(full, F.linear(x, weight, bias), rtol=1e-5, atol=1e-4)
    for rows in (1, 7, 64):
        assert torch.equal(onednn_linear(x[:rows], packed, bias), full[:rows])


def test_only_float32_cpu_matrices_are_timed_and_packed_where_onednn_won(monkeypatch):
    from asyncengine.quantization import cpu_prepacked

    timed = []
    monkeypatch.setattr(cpu_prepacked, "onednn_is_faster", lambda n, k, threads: timed.append((n, k)) or True)
    monkeypatch.setattr(cpu_prepacked, "onednn_available", lambda: True)
    assert cpu_prepacked.cpu_onednn_weight(torch.randn(8, 4, dtype=torch.bfloat16)) is None
    assert cpu_prepacked.cpu_onednn_weight(torch.randn(8)) is None
    assert timed == []
    packed = cpu_prepacked.cpu_onednn_weight(torch.randn(48, 32))
    assert timed == [(48, 32)] and packed is not None
    monkeypatch.setattr(cpu_prepacked, "onednn_is_faster", lambda n, k, threads: False)
    assert cpu_prepacked.cpu_onednn_weight(torch.randn(48, 32)) is None


def test_engine_linears_and_head_use_onednn_only_where_it_measured_faster():
    """The default model on CPU: each linear layer and the head carry a packed copy exactly when the start-up
    measurement of its shape chose oneDNN; the greedy tokens equal those of the plain MKL path (measured below)."""
    from asyncengine import LLM, SamplingParams
    from asyncengine.models.layers import LinearBase
    from asyncengine.quantization import cpu_prepacked

    llm = LLM()
    model = llm.engine.runner.model
    threads = torch.get_num_threads()
    for module in model.modules():
        if isinstance(module, LinearBase):
            chosen = cpu_prepacked.onednn_is_faster(*module.weight.shape, threads)
            assert (module.onednn_weight is not None) == chosen
    assert (model.head_onednn is not None) == cpu_prepacked.onednn_is_faster(*model.head_weight().shape, threads)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = ["The history of the city", "Once upon a time", "In the morning we"]
    fast = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    for module in model.modules():
        if isinstance(module, LinearBase):
            module.onednn_weight = None
    model.head_onednn = None
    plain = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert fast == plain
    llm.close()


def test_onednn_batches_are_rounded_to_a_few_row_counts_and_large_ones_take_mkl():
    """oneDNN keeps a primitive (~0.5 MB) per input shape it sees: batches are padded to multiples of ROW_STEP up to
    MAX_ROWS, so that a server's ever-changing batch sizes make at most MAX_ROWS / ROW_STEP of them per weight."""
    import pytest

    from asyncengine.quantization import cpu_prepacked
    from asyncengine.quantization.base import UnquantizedLinearMethod

    assert [cpu_prepacked.onednn_rows(m) for m in (1, 16, 17, 255, 256, 257)] == [16, 16, 32, 256, 256, 0]
    if not cpu_prepacked.onednn_available():
        pytest.skip("torch was built without oneDNN")
    layer = torch.nn.Module()
    layer.weight = torch.nn.Parameter(torch.randn(1408, 256), requires_grad=False)
    layer.onednn_weight = cpu_prepacked.onednn_pack(layer.weight)
    method = UnquantizedLinearMethod()
    for m in (5, 300):  # padded for oneDNN; too large: MKL, exactly F.linear
        x = torch.randn(m, 256)
        out = method.apply(layer, x, None)
        assert out.shape == (m, 1408)
        if m > cpu_prepacked.MAX_ROWS:
            assert torch.equal(out, F.linear(x, layer.weight))
        else:
            torch.testing.assert_close(out, F.linear(x, layer.weight), rtol=1e-5, atol=1e-4)


# Run in a fresh process with malloc's thresholds pinned (as the soak pins them), so that RSS follows what is held.
_PRIMITIVE_GROWTH = r"""
import json, sys, torch
from asyncengine.quantization import cpu_prepacked as cp

def anon_mib():
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("RssAnon")) / 1024

def serve_every_batch_size(packs):
    before = anon_mib()
    for packed, (n, k), bias in packs:
        for m in range(1, cp.MAX_ROWS + 1):
            cp.onednn_linear(torch.randn(m, k), packed, bias)
    return anon_mib() - before

torch.set_num_threads(2)
cp.onednn_is_faster = lambda n, k, threads: True  # oneDNN chosen on any machine
shapes = [((512, 256), False), ((1408, 256), True), ((256, 704), False)]
weights = [(torch.randn(n, k), (n, k), torch.randn(n) if bias else None) for (n, k), bias in shapes]
lazy = [(cp.onednn_pack(w), shape, bias) for w, shape, bias in weights]
lazy_growth = serve_every_batch_size(lazy)  # primitives built on first use: the old behaviour
wide = [(torch.randn(n, 2 * k), (n, 2 * k), bias) for _, (n, k), bias in weights]  # shapes not yet seen
built = [(cp.cpu_onednn_weight(w, bias is not None), shape, bias) for w, shape, bias in wide]
print(json.dumps({"lazy": lazy_growth, "built": serve_every_batch_size(built)}))
"""


def test_onednn_primitives_for_every_batch_size_are_built_at_load_so_serving_does_not_grow_memory():
    """oneDNN keeps a primitive (~0.55 MiB) for each input shape the first time it sees it; a layer packed for it
    builds those of its every row count at load (cpu_prepacked.build_primitives), with its bias or without. Serving
    batches of 1-256 rows afterwards adds (almost) nothing, where the same batches on weights packed without the
    build grow the process by about 9 MiB a shape (measured: 8-10)."""
    import json
    import os
    import subprocess
    import sys

    import pytest

    from asyncengine.quantization import cpu_prepacked
    from loadtest.soak import PINNED_MALLOC

    if not cpu_prepacked.onednn_available():
        pytest.skip("torch was built without oneDNN")
    env = {**os.environ, **PINNED_MALLOC}
    done = subprocess.run([sys.executable, "-c", _PRIMITIVE_GROWTH], capture_output=True, text=True, env=env,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    growth = json.loads(done.stdout.strip().splitlines()[-1])
    # Three shapes built lazily: the test sees the growth it guards against (26.9 MiB here; a primitive's size depends
    # on the CPU's instruction set, so the bounds are loose and the built run is also held to a quarter of the lazy).
    assert growth["lazy"] > 6, growth
    assert growth["built"] < min(3, growth["lazy"] / 4), growth

"""scripts/persistent_chain.py's kernel (a measurement of issue 14's persistent-kernel route) against torch: one
program (the only grid the interpreter can run: its programs run one after another, so a grid barrier with two
would wait forever), both ways of spinning at the barriers, each product's output and the counters reset."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "scripts"))
import persistent_chain  # noqa: E402

SHAPES = ((48, 32), (32, 32), (80, 32), (32, 64))  # (N, K): inputs are the first K of the previous output


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter's one-program grid; the GPU runs the script")
@pytest.mark.parametrize("spin_load", [False, True])
def test_chain_of_products_matches_torch_stage_by_stage(spin_load):
    torch.manual_seed(1234)
    weights = [torch.randn(n, k, dtype=torch.bfloat16) * k**-0.5 for n, k in SHAPES]
    x = torch.randn(1, SHAPES[0][1], dtype=torch.bfloat16)
    outs = [torch.full((n,), float("nan"), dtype=torch.bfloat16) for n, _ in SHAPES]
    counters = torch.zeros(8, dtype=torch.int32)
    persistent_chain.persistent_chain(x, weights, outs, counters, 1, 16, 16, 4, spin_load)
    for i, w in enumerate(weights):
        given = x.float() if i == 0 else outs[i - 1].float()[None, : w.shape[1]]
        expected = (given @ w.float().T).flatten()
        # bf16 outputs, float32 sums in another order than torch's: at most one unit in the last place (2**-7
        # relative) of the largest value
        assert (outs[i].float() - expected).abs().max() <= 2**-7 * expected.abs().max(), f"product {i}"
    assert counters.tolist() == [0] * 8

"""The int4 GEMM for mid-sized batches (kernels/int4_gemm.py) against quant_reference.int_weight_matmul, in Triton's
interpreter at small sizes without CUDA (natively with it). Outputs and workspaces are NaN-poisoned (torch.empty
patched, as in test_kernels.py), inputs drawn fresh each run. Real sizes: tests/test_gpu_quant.py."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

pytest.importorskip("triton")

from test_kernels import fresh_seed, nan_poisoned_empty, rel_error  # noqa: E402,F401
from test_quant_kernels import int4_case  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("m", [1, 20, 70])  # one M tile with rows masked off, several M tiles
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("split_k, group_size", [(1, 64), (3, 32), (2, 128)])  # direct store / partial sums
@pytest.mark.parametrize("symmetric", [False, True])
def test_int4_gemm_matches_reference(m, dtype, split_k, group_size, symmetric):
    from asyncengine.kernels import int4_gemm, quant_reference

    k, n = 256, 80  # N not a multiple of the 32-channel tile: the last tile is masked
    x, qweight, scales, zeros = int4_case(m, k, n, group_size, dtype, symmetric)
    bias = torch.randn(n, dtype=dtype, device=DEVICE)
    config = int4_gemm.Int4GemmConfig(block_n=32, block_k=32, block_m=32, split_k=split_k)
    out = int4_gemm.int4_gemm(x, qweight, scales, zeros, group_size, bias, config=config)
    ref = quant_reference.int_weight_matmul(x, qweight, scales, zeros, group_size, 4, bias)
    assert out.shape == (m, n) and out.dtype == dtype and not out.isnan().any()
    assert rel_error(out, ref) < 1e-2  # the output's half-precision rounding; a wrong nibble or group is ~1


def test_int4_gemm_refuses_what_it_cannot_take():
    from asyncengine.kernels import int4_gemm

    x, qweight, scales, zeros = int4_case(4, 96, 32, 32, torch.bfloat16)
    with pytest.raises(ValueError, match="does not fit"):  # K = 96 is not a multiple of 64
        int4_gemm.int4_gemm(x, qweight, scales, zeros, 32, config=int4_gemm.Int4GemmConfig(block_k=64))
    with pytest.raises(ValueError, match="does not fit"):
        int4_gemm.int4_gemm(x.float(), qweight, scales.float(), zeros.float(), 32,
                            config=int4_gemm.Int4GemmConfig(block_k=32))
    empty = int4_gemm.int4_gemm(x[:0], qweight, scales, zeros, 32, config=int4_gemm.Int4GemmConfig(block_k=32))
    assert empty.shape == (0, 32)

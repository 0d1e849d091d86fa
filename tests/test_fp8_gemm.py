"""The W8A8 FP8 GEMM (kernels/fp8_gemm.py) against quant_reference.fp8_scaled_mm, in Triton's interpreter at small
sizes without CUDA, natively with it. Outputs and workspaces are NaN-poisoned (torch.empty patched, as in
test_kernels.py), inputs drawn fresh each run. Real sizes and the engine's choice of it: tests/test_gpu_quant.py.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

pytest.importorskip("triton")

from test_kernels import fresh_seed, nan_poisoned_empty, rel_error  # noqa: E402,F401

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# The interpreter sums the exact e4m3 products in float32 like the reference; only the order differs. On a GPU the
# tensor cores' FP8 accumulation is coarser than float32, and y is rounded to bf16 there: 1e-2 of the output's norm.
REL_ERROR = {"cpu": 1e-5, "cuda": 1e-2}


def fp8_case(m: int, k: int, n: int, per_token: bool, per_channel: bool, out_dtype=torch.float32):
    from asyncengine.kernels import quant_reference

    x8, x_scale = quant_reference.quantize_fp8(torch.randn(m, k, device=DEVICE) * 3, dim=-1 if per_token else None)
    w8, w_scale = quant_reference.quantize_fp8(torch.randn(n, k, device=DEVICE) * 0.1,
                                               dim=-1 if per_channel else None)
    return x8, x_scale, w8, w_scale


def check(m, k, n, per_token=True, per_channel=True, bias=False, out_dtype=torch.float32, **kw):
    from asyncengine.kernels import fp8_gemm, quant_reference

    x8, x_scale, w8, w_scale = fp8_case(m, k, n, per_token, per_channel)
    b = torch.randn(n, device=DEVICE).to(out_dtype) if bias else None
    out = fp8_gemm.fp8_gemm(x8, x_scale, w8, w_scale, out_dtype, b, **kw)
    ref = quant_reference.fp8_scaled_mm(x8, x_scale, w8, w_scale, out_dtype, b)
    assert out.dtype == out_dtype and out.shape == (m, n)
    assert not out.isnan().any(), "kernel left NaN (unwritten elements?)"
    tolerance = REL_ERROR[DEVICE] if out_dtype == torch.float32 else max(REL_ERROR[DEVICE], 1e-2)
    assert rel_error(out, ref) < tolerance, rel_error(out, ref)
    return out


@pytest.mark.parametrize("m", [1, 5, 16, 17, 40])  # one tile of 16, 32 and 64 tokens, rows masked off
@pytest.mark.parametrize("num_sms, split", [(1, False), (64, True)])  # direct store / split-K partial sums
def test_fp8_gemm_matches_reference(m, num_sms, split):
    from asyncengine.kernels import fp8_gemm

    k, n = 256, 48  # N: one partial tile of 128 channels (rows masked off)
    config = fp8_gemm.config_for(m, n, k, num_sms)
    assert (config.split_k > 1) == split
    check(m, k, n, num_sms=num_sms)


@pytest.mark.parametrize("per_token, per_channel", [(False, False), (False, True), (True, False)])
def test_fp8_gemm_takes_one_scale_for_a_whole_tensor(per_token, per_channel):
    """A static per-tensor input scale and a per-tensor weight scale (hub checkpoints), read with stride 0."""
    check(9, 128, 64, per_token=per_token, per_channel=per_channel, num_sms=4)


def test_fp8_gemm_with_bias_in_bf16_and_a_k_tail():
    """K = 200: no config's K tile divides it, so the last tile of the last slice is masked."""
    from asyncengine.kernels import fp8_gemm

    check(20, 200, 96, bias=True, out_dtype=torch.bfloat16,
          config=fp8_gemm.Fp8GemmConfig(32, 64, split_k=2, block_m=16))


def test_fp8_gemm_several_token_tiles_and_slices_sum_in_a_fixed_order():
    """Two M tiles of 16 by three N tiles by three K slices: each (M, N) tile's counter is its own; the same call
    twice gives the same bits (and finds its counters zeroed again)."""
    from asyncengine.kernels import fp8_gemm

    x8, x_scale, w8, w_scale = fp8_case(30, 192, 96, True, True)
    config = fp8_gemm.Fp8GemmConfig(32, 64, split_k=3, block_m=16)
    first = fp8_gemm.fp8_gemm(x8, x_scale, w8, w_scale, torch.float32, config=config)
    again = fp8_gemm.fp8_gemm(x8, x_scale, w8, w_scale, torch.float32, config=config)
    assert torch.equal(first, again)
    counters = fp8_gemm.arrival_counters("the FP8 GEMM", x8.device, fp8_gemm._COUNTER_SLOTS)
    assert int(counters.abs().sum()) == 0


def test_fp8_gemm_of_no_rows_is_empty():
    from asyncengine.kernels import fp8_gemm

    x8, x_scale, w8, w_scale = fp8_case(0, 64, 32, True, True)
    assert fp8_gemm.fp8_gemm(x8, x_scale, w8, w_scale, torch.float32).shape == (0, 32)


def test_fp8_gemm_rejects_bad_input():
    from asyncengine.kernels import fp8_gemm

    x8, x_scale, w8, w_scale = fp8_case(4, 64, 32, True, True)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        fp8_gemm.fp8_gemm(x8.float(), x_scale, w8, w_scale, torch.float32)
    with pytest.raises(ValueError, match="inputs"):
        fp8_gemm.fp8_gemm(x8[:, :32], x_scale, w8, w_scale, torch.float32)
    with pytest.raises(ValueError, match="x_scale has 3 values for 4 rows"):
        fp8_gemm.fp8_gemm(x8, x_scale[:3], w8, w_scale, torch.float32)
    with pytest.raises(ValueError, match="w_scale must be float32"):
        fp8_gemm.fp8_gemm(x8, x_scale, w8, w_scale.half(), torch.float32)
    with pytest.raises(ValueError, match="at most"):
        big = torch.zeros(fp8_gemm.MAX_M + 1, 64, device=DEVICE).to(torch.float8_e4m3fn)
        fp8_gemm.fp8_gemm(big, torch.ones(()), w8, w_scale, torch.float32)
    with pytest.raises(ValueError, match="block_k"):
        fp8_gemm.Fp8GemmConfig(64, 48)

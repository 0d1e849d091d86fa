"""Quantized Triton kernels (kernels/quant_int4.py, quant_fp8.py) against their torch references
(kernels/quant_reference.py), in Triton's interpreter at small sizes without CUDA, natively with it. Outputs and
workspaces are NaN-poisoned (torch.empty patched, as in test_kernels.py), inputs drawn fresh each run.
Real sizes: tests/test_gpu_quant.py.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

pytest.importorskip("triton")

from test_kernels import assert_matches, fresh_seed, nan_poisoned_empty, rel_error  # noqa: E402,F401

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# The kernel rounds the dequantized weight to x's dtype and sums in float32; the reference stays in float32. float32:
# elementwise (atol, rtol); half types: relative error of the whole output (bf16's 2^-8 rounding of each weight).
INT4_TOLERANCE = {torch.float32: (1e-4, 1e-4)}
INT4_REL_ERROR = {torch.float16: 2e-3, torch.bfloat16: 1e-2}


def int4_case(m: int, k: int, n: int, group_size: int, dtype, symmetric=False, device=DEVICE):
    from asyncengine.kernels.quant_reference import quantize_int_weight

    qweight, scales, zeros = quantize_int_weight(torch.randn(k, n), group_size, 4, symmetric)
    x = torch.randn(m, k, dtype=dtype)
    return [t.to(device) for t in (x, qweight, scales.to(dtype), zeros.to(dtype))]


def check_int4(m, k, n, group_size, dtype, bias=False, num_sms=None, **kw):
    from asyncengine.kernels import quant_int4, quant_reference

    x, qweight, scales, zeros = int4_case(m, k, n, group_size, dtype, **kw)
    b = torch.randn(n, dtype=dtype, device=x.device) if bias else None
    out = quant_int4.int_weight_matmul(x, qweight, scales, zeros, group_size, 4, b, num_sms=num_sms)
    ref = quant_reference.int_weight_matmul(x, qweight, scales, zeros, group_size, 4, b)
    if x.dtype == torch.float32:
        assert_matches(out, ref, INT4_TOLERANCE)
    else:
        assert out.dtype == ref.dtype and not out.isnan().any(), "kernel left NaN (unwritten elements?)"
        assert rel_error(out, ref) < INT4_REL_ERROR[x.dtype], rel_error(out, ref)


@pytest.mark.parametrize("m", [1, 3, 16])
@pytest.mark.parametrize("group_size", [32, 64])
def test_int4_split_k_gemv_matches_reference(m, group_size):
    from asyncengine.kernels.quant_int4 import plan

    assert plan(m, 96, 128, group_size, num_sms=8)["split_k"] > 1, "too few N tiles: the split-K path"
    assert plan(m, 96, 128, group_size, num_sms=4)["split_k"] == 1, "enough N tiles: direct stores"
    for num_sms in (8, 4):
        check_int4(m, 128, 96, group_size, torch.float32, bias=m == 3, num_sms=num_sms)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int4_dequantizing_gemm_matches_reference_with_ragged_tiles(dtype):
    from asyncengine.kernels.quant_int4 import plan

    assert plan(37, 80, 192, 64)["split_k"] == 1
    check_int4(37, 192, 80, 64, dtype, symmetric=True)


def test_int4_kernel_refuses_other_widths():
    from asyncengine.kernels import quant_int4

    x, qweight, scales, zeros = int4_case(1, 64, 32, 32, torch.float32)
    with pytest.raises(ValueError, match="only 4-bit"):
        quant_int4.int_weight_matmul(x, qweight, scales, zeros, 32, 8)


def test_fp8_per_token_scales_match_reference():
    """Scales exactly; the e4m3 values themselves on GPU only (tests/test_gpu_quant.py): Triton's interpreter
    does not round float32 -> e4m3 to nearest (it gives 16 for 31.3)."""
    from asyncengine.kernels import quant_fp8, quant_reference

    x = torch.randn(7, 96, device=DEVICE) * 5
    x[3] = 0  # a zero row keeps a finite scale and zero values
    q, scale = quant_fp8.quantize_per_token(x)
    ref_q, ref_scale = quant_reference.quantize_fp8(x, dim=-1)
    torch.testing.assert_close(scale, ref_scale, atol=0, rtol=0)
    assert q.dtype == torch.float8_e4m3fn and not q.float().isnan().any()
    assert (q[3].float() == 0).all()
    if DEVICE == "cuda":
        torch.testing.assert_close(q.float(), ref_q.float(), atol=0, rtol=0)


@pytest.mark.parametrize("m", [1, 4, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n, num_sms", [(48, 8), (80, 2)])  # split-K with partial sums / direct store
def test_dense_gemv_matches_reference(m, dtype, n, num_sms):
    from asyncengine.kernels import quant_gemv, quant_reference

    k = 160  # not a multiple of the K tile: the last tile is masked
    x = torch.randn(m, k, dtype=dtype, device=DEVICE)
    w = torch.randn(n, k, dtype=dtype, device=DEVICE)
    bias = torch.randn(n, dtype=dtype, device=DEVICE)
    split = quant_gemv.split_k_for(n, k, num_sms, 32)
    assert (split > 1) == (n == 48)
    out = quant_gemv.dense_gemv(x, w, bias, num_sms=num_sms)
    ref = quant_reference.dense_gemv(x, w, bias)
    assert_matches(out, ref, {torch.float32: (1e-4, 1e-4), torch.bfloat16: (2e-2, 2e-2)})


@pytest.mark.parametrize("per_channel", [False, True])
def test_fp8_weight_gemv_matches_reference(per_channel):
    """FP8 weights with per-channel (or one) scale, x unquantized: the decode path of FP8 layers."""
    from asyncengine.kernels import quant_gemv, quant_reference

    w8, scale = quant_reference.quantize_fp8(torch.randn(48, 96, device=DEVICE), dim=-1 if per_channel else None)
    x = torch.randn(3, 96, device=DEVICE)
    out = quant_gemv.dense_gemv(x, w8, None, scale, num_sms=8)
    ref = quant_reference.dense_gemv(x, w8, None, scale)
    assert_matches(out, ref, {torch.float32: (1e-4, 1e-4)})

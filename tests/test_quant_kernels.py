"""Quantized Triton kernels (kernels/quant_gemv.py, quant_int4.py, quant_fp8.py) against their torch references
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


@pytest.mark.parametrize("m", [1, 3, 16, 40])
@pytest.mark.parametrize("group_size", [32, 64])
def test_int4_decode_batches_take_the_split_k_gemv_by_default(m, group_size):
    """int_weight_matmul at M <= GEMV_MAX_M runs quant_gemv.int4_gemv with its default config: split over K when the
    N tiles cannot fill the (pretended) SMs, direct stores otherwise (M = 40: a 64-row tl.dot tile)."""
    from asyncengine.kernels import quant_gemv

    assert quant_gemv.config_for("int4", m, 96, 512, num_sms=8).split_k > 1, "too few N tiles: the split-K path"
    assert quant_gemv.config_for("int4", m, 96, 512, num_sms=1).split_k == 1, "enough N tiles: direct stores"
    for num_sms in (8, 1):
        check_int4(m, 512, 96, group_size, torch.float32, bias=m == 3, num_sms=num_sms)


def test_int4_takes_64_row_tiles_above_16_rows_and_dense_formats_the_next_power_of_two():
    from asyncengine.kernels import quant_gemv

    assert [quant_gemv.m_bucket(m, "int4") for m in (1, 2, 8, 9, 16, 17, 33, 64)] == [1, 8, 8, 16, 16, 64, 64, 64]
    assert [quant_gemv.m_bucket(m, "bf16") for m in (1, 2, 16, 17, 33, 64)] == [1, 16, 16, 32, 64, 64]
    # int4 at M of 2..8 has a key of its own (GemvConfig.mma's); without a row there, the M = 16 key's row
    assert quant_gemv.config_for("int4", 3, 6144, 4096, 132) == quant_gemv.config_for("int4", 16, 6144, 4096, 132)


# (block_n, block_k, split_k, dot): ragged N tiles, K tiles cut to the group (block_k 128 > group 32), one slice
# per K tile, and the 16-row tl.dot tile at M = 1
GEMV_CONFIGS = [(16, 32, 1, False), (32, 128, 3, False), (16, 16, 8, False), (16, 32, 2, True)]


@pytest.mark.parametrize("m", [1, 5])
@pytest.mark.parametrize("tiles", GEMV_CONFIGS)
def test_int4_gemv_matches_reference_under_every_tile_shape(m, tiles):
    from asyncengine.kernels import quant_gemv, quant_reference

    block_n, block_k, split_k, dot = tiles
    config = quant_gemv.GemvConfig(block_n, block_k, split_k, dot=dot)
    x, qweight, scales, zeros = int4_case(m, 128, 40, 32, torch.float32)
    bias = torch.randn(40, device=x.device)
    out = quant_gemv.int4_gemv(x, qweight, scales, zeros, 32, bias, config=config)
    assert_matches(out, quant_reference.int_weight_matmul(x, qweight, scales, zeros, 32, 4, bias), INT4_TOLERANCE)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [1, 5])
def test_int4_gemv_tl_dot_path_in_half_precision_matches_reference(dtype, m):
    """Half-precision x takes the tl.dot path without dequantizing: x @ (BIAS + q) with the nibbles ORed under a
    half-precision exponent, then the zero points and scales applied per tile."""
    from asyncengine.kernels import quant_gemv, quant_reference

    x, qweight, scales, zeros = int4_case(m, 256, 48, 64, dtype)
    bias = torch.randn(48, dtype=dtype, device=x.device)
    out = quant_gemv.int4_gemv(x, qweight, scales, zeros, 64, bias, config=quant_gemv.GemvConfig(16, 64, 2, dot=True))
    ref = quant_reference.int_weight_matmul(x, qweight, scales, zeros, 64, 4, bias)
    assert out.dtype == dtype and not out.isnan().any()
    assert rel_error(out, ref) < INT4_REL_ERROR[dtype], rel_error(out, ref)


def test_int4_gemv_in_bf16_and_with_one_group_over_all_inputs():
    """bf16 activations (the tl.dot and FMA paths both round the weight like the GEMM), and group size -1 as
    GPTQ writes it (the loader turns it into group_size = K)."""
    check_int4(1, 192, 64, 64, torch.bfloat16)
    check_int4(4, 192, 64, 64, torch.bfloat16)
    check_int4(1, 96, 32, 96, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k, n, group_size", [(296, 37, 128), (256, 160, 32), (64, 8, 64)])
def test_int4_dequantize_gives_the_reference_bits(dtype, k, n, group_size):
    """quant_int4.dequantize against quant_reference.dequantize_packed in the same dtype, bit for bit: N tails, a K
    ending in a partial group (296 = 2 x 128 + 40), several word rows per group and one group over all of K.
    (Triton's interpreter rounds float32 -> bf16 toward zero, the GPU to nearest: there, bf16 within one unit in the
    last place.)"""
    from asyncengine.kernels import interpreting, quant_int4, quant_reference

    _, qweight, scales, zeros = int4_case(1, k, n, group_size, dtype)
    out = quant_int4.dequantize(qweight, scales, zeros, group_size, dtype)
    ref = quant_reference.dequantize_packed(qweight, scales, zeros, group_size)
    assert out.shape == (k, n) and out.dtype == dtype
    one_ulp = 2.0**-7 if dtype == torch.bfloat16 and interpreting() else 0.0
    torch.testing.assert_close(out, ref, atol=0, rtol=one_ulp)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows_above_the_gemv", [1, 236])
def test_int4_batches_above_the_gemv_dequantize_then_take_the_library_gemm(dtype, rows_above_the_gemv, monkeypatch):
    """Above GEMV_MAX_M rows int_weight_matmul dequantizes W (once a call) and multiplies with torch's GEMM; at
    GEMV_MAX_M it takes the GEMV and dequantizes nothing. Both against the reference, bias included, K ending in a
    partial group."""
    from asyncengine.kernels import quant_int4

    calls = []
    real = quant_int4.dequantize
    monkeypatch.setattr(quant_int4, "dequantize", lambda *a: calls.append(a[0].shape) or real(*a))
    check_int4(quant_int4.GEMV_MAX_M + rows_above_the_gemv, 296, 37, 128, dtype, bias=True)
    assert calls == [(37, 37)], "one dequantize of the [K / 8, N] packed weight"
    check_int4(quant_int4.GEMV_MAX_M, 296, 37, 128, dtype, bias=True)
    assert len(calls) == 1


@pytest.mark.parametrize("m", [1, 3, 16])
@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int4_gemv_with_odd_n_and_a_k_tail_matches_reference(m, group_size, dtype):
    """Fresh inputs, N odd and K ending in a partial group (K = 2 groups + 40 inputs), default tiles: at M = 1 the
    FMA path (each nibble made a float by OR-ing it under an exponent, the zero point subtracted exactly, the scale
    applied per word; bf16 x read in pairs), above it the tl.dot path."""
    check_int4(m, 2 * group_size + 40, 37, group_size, dtype, bias=m == 3, num_sms=4)


@pytest.mark.parametrize("load_ahead", [False, True])
@pytest.mark.parametrize("half_fma", [False, True])
@pytest.mark.parametrize("block_n, block_k, split_k", [(64, 16, 3), (128, 32, 1), (32, 128, 2)])
def test_int4_fma_gemv_reads_bf16_x_in_pairs_or_one_by_one_alike(block_n, block_k, split_k, half_fma, load_ahead):
    """bf16 x at a 4-byte aligned address is read as 16-byte vectors of int32 pairs; at an odd offset (a view) one
    input at a time: both equal the reference, under tiles that split K, cut it below a group and cover N with one
    ragged tile. half_fma (bf16x2 word sums, inline PTX) applies on CUDA to the aligned x only; elsewhere the
    float32 path. load_ahead (each step loads the next tile and its x before its math) gives the same bits."""
    from asyncengine.kernels import quant_gemv, quant_reference

    _, qweight, scales, zeros = int4_case(1, 256, 72, 64, torch.bfloat16)
    buffer = torch.randn(1, 257, dtype=torch.bfloat16, device=qweight.device)
    assert not quant_gemv.half_fma_ok(buffer[:, 1:]), "an odd address must take the float32 path"
    config = quant_gemv.GemvConfig(block_n, block_k, split_k, half_fma=half_fma, load_ahead=load_ahead)
    plain = quant_gemv.GemvConfig(block_n, block_k, split_k, half_fma=half_fma)
    for x in (buffer[:, :256], buffer[:, 1:]):  # data_ptr % 4 == 0, then == 2
        out = quant_gemv.int4_gemv(x, qweight, scales, zeros, 64, config=config)
        ref = quant_reference.int_weight_matmul(x, qweight, scales, zeros, 64, 4)
        assert not out.isnan().any() and rel_error(out, ref) < INT4_REL_ERROR[torch.bfloat16], rel_error(out, ref)
        if load_ahead:
            assert torch.equal(out, quant_gemv.int4_gemv(x, qweight, scales, zeros, 64, config=plain))


def assert_mma_sums_are_float32(out, x, qweight, scales, zeros, group_size, bias=None):
    """GemvConfig.mma's y against the float32 reference (x, scales and zeros widened), element by element: within
    one bf16 ulp (y is rounded to bf16: half an ulp, up to 2^-8 relative) and 1e-4 of the largest output (float32
    sums of (128 + q) x less (128 + z) sum(x): ~1e-6 relative to the largest)."""
    from asyncengine.kernels import quant_reference

    ref = quant_reference.int_weight_matmul(x.float(), qweight, scales.float(), zeros.float(), group_size, 4,
                                            None if bias is None else bias.float())
    assert out.dtype == torch.bfloat16 and not out.isnan().any(), "kernel left NaN (unwritten elements?)"
    torch.testing.assert_close(out.float(), ref, rtol=2 ** -7, atol=1e-4 * ref.abs().max().item())


# (block_n, block_k, split_k, num_warps) of GemvConfig.mma: a warp per 32 columns (4 a thread) or 64 (8 a thread);
# steps of 1 to 4 chunks of 32 inputs; K split in slices that end inside a group; N ragged (37)
MMA_TILES = [(32, 32, 1, 1), (64, 64, 3, 2), (128, 128, 2, 4), (32, 128, 4, 1), (64, 64, 2, 1), (128, 32, 1, 2)]


@pytest.mark.parametrize("block_n, block_k, split_k, warps", MMA_TILES)
@pytest.mark.parametrize("m, group_size", [(1, 64), (1, 128), (3, 64), (8, 128)])
def test_int4_mma_gemv_matches_the_float32_reference(block_n, block_k, split_k, warps, m, group_size):
    """The int4 tensor-core path at M <= 8 (GemvConfig.mma; in the interpreter its stand-in for mma.sync, the same
    D from each warp's lanes): K ending in a partial group (2 groups + 40 inputs), N odd, a bias, fresh weights
    with zero points, x's rows as B's columns. Its sums (128 + q) . x less (128 + z) sum(x) are float32: y is the
    float32 reference's rounded."""
    from asyncengine.kernels import quant_gemv

    x, qweight, scales, zeros = int4_case(m, 2 * group_size + 40, 37, group_size, torch.bfloat16)
    bias = torch.randn(37, dtype=torch.bfloat16, device=x.device)
    config = quant_gemv.GemvConfig(block_n, block_k, split_k, warps, mma=True)
    assert quant_gemv.mma_ok(x)
    out = quant_gemv.int4_gemv(x, qweight, scales, zeros, group_size, bias, config=config)
    assert_mma_sums_are_float32(out, x, qweight, scales, zeros, group_size, bias)
    # the split-K counters were left zeroed: the same bits again
    assert torch.equal(quant_gemv.int4_gemv(x, qweight, scales, zeros, group_size, bias, config=config), out)


def test_int4_mma_gemv_with_x_it_cannot_take_runs_the_float32_fma_path():
    """x the MMA cannot take (float32, or bf16 at an address that is not 4-byte aligned) runs the float32 FMA path
    with the same tiles, to the reference's precision; the MMA applies at M <= 8 to int4 weights only."""
    from asyncengine.kernels import quant_gemv, quant_reference

    _, qweight, scales, zeros = int4_case(1, 256, 64, 64, torch.bfloat16)
    config = quant_gemv.GemvConfig(64, 64, 2, 2, mma=True)
    buffer = torch.randn(1, 257, dtype=torch.bfloat16, device=qweight.device)
    for x in (buffer[:, 1:], buffer[:, :256].float()):
        assert not quant_gemv.mma_ok(x)
        out = quant_gemv.int4_gemv(x, qweight, scales, zeros, 64, config=config)
        ref = quant_reference.int_weight_matmul(x, qweight, scales, zeros, 64, 4)
        assert not out.isnan().any() and rel_error(out, ref) < INT4_REL_ERROR[torch.bfloat16], rel_error(out, ref)
    with pytest.raises(ValueError, match="GemvConfig.mma applies to int4 weights at M <= 8 only, got M=9"):
        quant_gemv.int4_gemv(buffer[:, :256].expand(9, 256), qweight, scales, zeros, 64, config=config)
    with pytest.raises(ValueError, match="a dense weight"):
        quant_gemv.dense_gemv(buffer[:, :256], torch.randn(64, 256, dtype=torch.bfloat16, device=qweight.device),
                              config=config)


MMA_LANE_LAYOUT = "sizePerThread = [1], threadsPerWarp = [32], warpsPerCTA = [{warps}], order = [0]"
# Compiles the MMA kernel for sm_90 outside the interpreter (this module runs under it without CUDA) and prints
# its TTGIR: argv = num_warps, block_k, cols, block_m
MMA_TTGIR = """
import sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from asyncengine.kernels import quant_gemv
warps, block_k, cols, block_m = (int(v) for v in sys.argv[1:])
fn = quant_gemv._int4_mma_kernel
constants = dict(group_size=128, HAS_BIAS=False, PARTIAL=True, ASM=True, REDUCE_CHUNK=1, BLOCK_M=block_m,
                 THREADS=32 * warps, COLS=cols, BLOCK_K=block_k, USE_PDL=True, PF_ROWS=8, PF_LINES=1, PF_STEP=32)
types = dict(partial_ptr="*fp32", counter_ptr="*i32", w_ptr="*i32", scale_ptr="*bf16", zero_ptr="*bf16")
signature = {a: "constexpr" if a in constants else types.get(a, "*bf16" if a.endswith("_ptr") else "i32")
             for a in fn.arg_names}
print(triton.compile(ASTSource(fn, signature, constants), target=GPUTarget("cuda", 90, 32),
                     options=dict(num_warps=warps)).asm["ttgir"])
"""


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU tests run the MMA path natively")
@pytest.mark.parametrize("warps, block_k, cols, block_m", [(4, 128, 8, 1), (2, 64, 4, 8), (8, 128, 8, 8)])
def test_int4_mma_operands_hold_one_value_per_lane_in_lane_order(warps, block_k, cols, block_m, tmp_path):
    """What the MMA path's inline assembly relies on, read from Triton's own layouts (compiled for sm_90, no GPU):
    every tensor fed to an mma.sync (or to the PRMT of x's pairs) is 1-D over 32 * num_warps values, one per
    thread, value i on lane i % 32 of warp i // 32, so that lane (g, c) holds its own fragment. A Triton that laid
    them out otherwise (a vectorized or replicated layout) would feed the MMAs other lanes' words: this fails first."""
    import re
    import subprocess
    import sys

    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_CACHE_DIR": str(tmp_path)}
    run = subprocess.run([sys.executable, "-c", MMA_TTGIR, str(warps), str(block_k), str(cols), str(block_m)],
                         env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    layouts = dict(re.findall(r"^(#\w+) = #ttg\.blocked<\{(.*)\}>", run.stdout, re.MULTILINE))
    asm_ops = [line for line in run.stdout.splitlines() if "elementwise_inline_asm" in line and
               ("mma.sync" in line or "prmt.b32" in line)]
    assert len(asm_ops) >= block_k // 32 * (cols // 2 + 2), "an MMA or x-pair op per chunk and row tile expected"
    for line in asm_ops:
        operands = re.findall(r"tensor<(\d+)x\w+, (#\w+)>", line)
        assert operands, line[-300:]
        for size, layout in operands:
            assert int(size) == 32 * warps and layouts[layout] == MMA_LANE_LAYOUT.format(warps=warps), (
                size, layout, layouts[layout])


@pytest.mark.parametrize("kwargs, message", [
    (dict(block_n=64, num_warps=4), "block_n = 32 or 64 \\* num_warps"),
    (dict(block_n=128, block_k=16), "block_k >= 32"),
    (dict(block_n=128, half_fma=True), "half_fma cannot be set with it"),
    (dict(block_n=128, load_ahead=True, dot=True), "dot, load_ahead cannot be set with it")])
def test_int4_mma_config_refuses_tiles_it_cannot_run(kwargs, message):
    from asyncengine.kernels.quant_gemv import GemvConfig

    with pytest.raises(ValueError, match=message):
        GemvConfig(**{"block_k": 64, **kwargs}, mma=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_n, block_k, split_k", [(16, 32, 1), (32, 64, 3), (64, 128, 2)])
def test_int4_gemv_load_ahead_with_a_k_tail_matches_reference(block_n, block_k, split_k, dtype):
    """GemvConfig.load_ahead on int4 at M == 1: K ending in a partial group (2 groups + 40 inputs, so the last
    tile is ragged), N odd, K split in slices whose last load-ahead falls past their end (masked: no read past
    the weight, the scales of the slice's last group read again)."""
    from asyncengine.kernels import quant_gemv, quant_reference

    x, qweight, scales, zeros = int4_case(1, 2 * 128 + 40, 37, 128, dtype)
    bias = torch.randn(37, dtype=dtype, device=x.device)
    config = quant_gemv.GemvConfig(block_n, block_k, split_k, load_ahead=True)
    out = quant_gemv.int4_gemv(x, qweight, scales, zeros, 128, bias, config=config)
    ref = quant_reference.int_weight_matmul(x, qweight, scales, zeros, 128, 4, bias)
    if dtype == torch.float32:
        assert_matches(out, ref, INT4_TOLERANCE)
    else:
        assert out.dtype == dtype and not out.isnan().any()
        assert rel_error(out, ref) < INT4_REL_ERROR[dtype], rel_error(out, ref)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [1, 3, 16])
def test_int4_gemv_one_dot_per_nibble_slot_matches_reference(dtype, m):
    """slot_dot: 8 tl.dot per 128-input tile, slot j taking inputs 8 w + j against nibble j of each word made
    q - z; N odd, K ending in a partial group, K split in slices."""
    from asyncengine.kernels import quant_gemv, quant_reference

    x, qweight, scales, zeros = int4_case(m, 296, 37, 128, dtype)
    bias = torch.randn(37, dtype=dtype, device=x.device)
    config = quant_gemv.GemvConfig(16, 128, 2, dot=True, slot_dot=True)
    out = quant_gemv.int4_gemv(x, qweight, scales, zeros, 128, bias, config=config)
    ref = quant_reference.int_weight_matmul(x, qweight, scales, zeros, 128, 4, bias)
    assert out.dtype == dtype and not out.isnan().any()
    assert rel_error(out, ref) < INT4_REL_ERROR[dtype], rel_error(out, ref)


@pytest.mark.parametrize("dtype, half_fma", [(torch.float32, False), (torch.bfloat16, True)])
def test_int4_fma_gemv_is_exact_for_every_nibble_value_in_every_position(dtype, half_fma):
    """Each of the 16 values in each of the 8 nibble slots of a word, against zero points 0 ... 15: with x one-hot
    per input and unit scales, y is exactly q - z (also in bf16, also with bf16x2 word sums), so a wrong mask,
    exponent, shift or pairing shows as a wrong integer."""
    from asyncengine.kernels import quant_gemv, quant_reference

    k, n = 128, 16  # inputs: 16 words x 8 slots; output n: zero point n, value (k + n) % 16 at input k
    q = (torch.arange(k)[:, None] + torch.arange(n)[None, :]) % 16
    qweight = quant_reference.pack_int32(q.to(torch.int32), 4, dim=0).to(DEVICE)
    scales = torch.ones(1, n, dtype=dtype, device=DEVICE)
    zeros = torch.arange(n, dtype=dtype, device=DEVICE)[None, :]
    config = quant_gemv.GemvConfig(16, 128, half_fma=half_fma)
    for i in range(k):
        x = torch.zeros(1, k, dtype=dtype, device=DEVICE)
        x[0, i] = 1.0
        out = quant_gemv.int4_gemv(x, qweight, scales, zeros, k, config=config)
        assert torch.equal(out[0].float().cpu(), (q[i] - torch.arange(n)).float()), i


@pytest.mark.parametrize("m", [1, 5])
def test_gemv_split_k_sums_more_slices_than_one_chunk(m):
    """11 K slices (the last program of an N tile sums them 8 at a time at M = 1: one full chunk, one ragged; one
    at a time at M = 5), for a dense and an int4 weight, against the references."""
    from asyncengine.kernels import quant_gemv, quant_reference

    config = quant_gemv.GemvConfig(16, 16, 13, dot=m > 1)
    assert quant_gemv._fit(config, 512, None).split_k == 11
    x = torch.randn(m, 512, device=DEVICE)
    w = torch.randn(24, 512, device=DEVICE)
    assert_matches(quant_gemv.dense_gemv(x, w, config=config), quant_reference.dense_gemv(x, w), INT4_TOLERANCE)
    _, qweight, scales, zeros = int4_case(m, 512, 24, 64, torch.float32)
    out = quant_gemv.int4_gemv(x, qweight, scales, zeros, 64, config=config)
    assert_matches(out, quant_reference.int_weight_matmul(x, qweight, scales, zeros, 64, 4), INT4_TOLERANCE)


def test_split_k_counters_are_left_zero_for_the_next_call_and_graph_replays():
    """The last K slice of each N tile resets its arrival counter: the same call twice gives the same y."""
    from asyncengine.kernels import quant_gemv, quant_reference

    config = quant_gemv.GemvConfig(16, 32, 4)
    x, w = torch.randn(1, 128, device=DEVICE), torch.randn(48, 128, device=DEVICE)
    first = quant_gemv.dense_gemv(x, w, config=config)
    assert int(quant_gemv._counter_buffer(x.device).abs().sum()) == 0
    second = quant_gemv.dense_gemv(x, w, config=config)
    assert torch.equal(first, second)
    assert_matches(second, quant_reference.dense_gemv(x, w), {torch.float32: (1e-4, 1e-4)})


def test_gemv_rejects_bad_configs_and_batches():
    from asyncengine.kernels import quant_gemv

    with pytest.raises(ValueError, match="block_n must be a power of two"):
        quant_gemv.GemvConfig(24, 64)
    with pytest.raises(ValueError, match="split_k"):
        quant_gemv.GemvConfig(16, 64, 0)
    with pytest.raises(ValueError, match="at most 64 rows"):
        quant_gemv.dense_gemv(torch.randn(65, 32, device=DEVICE), torch.randn(16, 32, device=DEVICE))
    x, qweight, scales, zeros = int4_case(1, 64, 32, 32, torch.float32)
    with pytest.raises(ValueError, match="multiple of 16"):
        quant_gemv.int4_gemv(x, qweight, scales, zeros, 8)
    with pytest.raises(ValueError, match="8 inputs"):
        quant_gemv.int4_gemv(x[:, :32], qweight, scales, zeros, 32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int4_above_the_gemv_matches_reference_with_symmetric_weights(dtype):
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


def _same_fp8_copy(activation, value):
    """activation (an Fp8Activation) carries exactly quantize_per_token(value): the same e4m3 bits and scales."""
    from asyncengine.kernels import quant_fp8, quant_reference

    q, scale = quant_fp8.quantize_per_token(value)
    assert activation.fp8.dtype == torch.float8_e4m3fn and activation.fp8.is_contiguous()
    assert torch.equal(activation.fp8.view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(activation.scale, scale) and activation.scale.shape == (value.shape[0], 1)
    torch.testing.assert_close(scale, quant_reference.quantize_fp8(value, dim=-1)[1], atol=0, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [0, 1, 5])
def test_fused_add_rms_norm_fp8_copy_is_the_per_token_quantization_of_its_output(dtype, tokens):
    """The norm that feeds an FP8 linear writes its output's e4m3 copy in the same kernel (quant_fp8.store_fp8_row):
    the output and residual exactly as without the copy (here, interpreted; compiled, the output may move by an ulp:
    tests/test_gpu_quant.py), the copy exactly what `quantize_per_token` makes of it."""
    from asyncengine.kernels import norm

    x, residual = (torch.randn(tokens, 96, dtype=dtype, device=DEVICE) * 4 for _ in range(2))
    weight = torch.randn(96, dtype=dtype, device=DEVICE)
    if tokens > 1:
        x[1], residual[1] = 0, 0  # a zero row: the floor scale, zero codes
    plain, plain_residual = norm.fused_add_rms_norm(x, residual.clone(), weight, 1e-5)
    copy, new_residual = norm.fused_add_rms_norm(x, residual, weight, 1e-5, fp8_copy=True)
    assert torch.equal(copy.value, plain) and torch.equal(new_residual, plain_residual)
    _same_fp8_copy(copy, plain)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul_fp8_copy_takes_whole_rows_and_is_the_per_token_quantization_of_its_output(dtype):
    from asyncengine.kernels import activation

    x = torch.randn(3, 2 * 1500, dtype=dtype, device=DEVICE) * 3  # I over one column block (1024) of the plain path
    plain = activation.silu_and_mul(x)
    copy = activation.silu_and_mul(x, fp8_copy=True)
    assert torch.equal(copy.value, plain)
    _same_fp8_copy(copy, plain)


def test_ops_fp8_copy_off_triton_is_the_reference_quantization_and_linears_take_it():
    """Off Triton (the CPU fast path and the references) ops make the same pair by quantizing afterwards; the FP8
    product's reference takes a given copy in place of quantizing x, and refuses one beside a static input scale."""
    from asyncengine import ops
    from asyncengine.kernels import quant_reference

    x, residual, weight = torch.randn(4, 64), torch.randn(4, 64), torch.randn(64)
    copy, _ = ops.fused_add_rms_norm(x, residual.clone(), weight, 1e-6, fp8_copy=True)
    plain, _ = ops.fused_add_rms_norm(x, residual.clone(), weight, 1e-6)
    q, scale = quant_reference.quantize_fp8(plain, dim=-1)
    assert torch.equal(copy.value, plain) and torch.equal(copy.fp8.float(), q.float()) and torch.equal(copy.scale,
                                                                                                       scale)
    gate_up = torch.randn(4, 128)
    assert torch.equal(ops.silu_and_mul(gate_up.clone(), fp8_copy=True).value, ops.silu_and_mul(gate_up.clone()))
    w8, w_scale = quant_reference.quantize_fp8(torch.randn(32, 64), dim=-1)
    given = quant_reference.Fp8Activation(copy.value, copy.fp8, copy.scale)
    assert torch.equal(quant_reference.fp8_linear(copy.value, w8, w_scale, None, quantized=given),
                       quant_reference.fp8_linear(copy.value, w8, w_scale, None))
    with pytest.raises(ValueError, match="static input scale"):
        quant_reference.fp8_linear(copy.value, w8, w_scale, torch.tensor(0.1), quantized=given)


@pytest.mark.parametrize("m", [1, 4, 16, 40])  # the FMA path; tl.dot tiles of 16 and 64 rows
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n, num_sms", [(48, 8), (80, 1)])  # split-K with partial sums / direct store
def test_dense_gemv_matches_reference(m, dtype, n, num_sms):
    from asyncengine.kernels import quant_gemv, quant_reference

    k = 1100  # not a multiple of any K tile (256, 512): the last tile is masked; 3+ tiles to split
    x = torch.randn(m, k, dtype=dtype, device=DEVICE)
    w = torch.randn(n, k, dtype=dtype, device=DEVICE)
    bias = torch.randn(n, dtype=dtype, device=DEVICE)
    config = quant_gemv.config_for(quant_gemv.weight_format(w), m, n, k, num_sms)
    assert (config.split_k > 1) == (n == 48)
    out = quant_gemv.dense_gemv(x, w, bias, num_sms=num_sms)
    ref = quant_reference.dense_gemv(x, w, bias)
    assert_matches(out, ref, {torch.float32: (1e-4, 1e-4), torch.bfloat16: (2e-2, 2e-2)})


@pytest.mark.parametrize("m", [1, 3])
@pytest.mark.parametrize("per_channel", [False, True])
def test_fp8_weight_gemv_matches_reference(m, per_channel):
    """FP8 weights with per-channel (or one) scale, x unquantized: the decode path of FP8 layers."""
    from asyncengine.kernels import quant_gemv, quant_reference

    w8, scale = quant_reference.quantize_fp8(torch.randn(48, 96, device=DEVICE), dim=-1 if per_channel else None)
    x = torch.randn(m, 96, device=DEVICE)
    out = quant_gemv.dense_gemv(x, w8, None, scale, num_sms=8)
    ref = quant_reference.dense_gemv(x, w8, None, scale)
    assert_matches(out, ref, {torch.float32: (1e-4, 1e-4)})


def e4m3_codes_one_hot_case(lane: int):
    """Every e4m3 code but the NaNs (0x7f, 0xff) down column `lane` of an [254, 8] FP8 weight, fresh random codes
    elsewhere, and x = the one-hot float32 row of `lane`: y[n] is then code n's value, exactly (0 * w = 0)."""
    codes = torch.tensor([c for c in range(256) if c not in (0x7F, 0xFF)], dtype=torch.uint8)
    bits = torch.randint(0, 0x7F, (codes.numel(), 8), dtype=torch.uint8)
    bits[:, lane] = codes
    w8 = bits.view(torch.float8_e4m3fn)
    x = torch.zeros(1, 8)
    x[0, lane] = 1.0
    return x, w8, w8[:, lane].float()


@pytest.mark.parametrize("lane", range(8))  # each byte of a 32-bit word, in two words
def test_fp8_words_converts_every_e4m3_code_exactly(lane):
    from asyncengine.kernels import quant_gemv

    x, w8, expected = e4m3_codes_one_hot_case(lane)
    config = quant_gemv.GemvConfig(16, 16, 1, fp8_words=True)
    out = quant_gemv.dense_gemv(x.to(DEVICE), w8.to(DEVICE), None, torch.ones(1, device=DEVICE), config=config)
    torch.testing.assert_close(out[0].cpu(), expected, atol=0, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n, k, config", [
    (50, 100, (16, 32, 1)),  # N and K tails (50 = 3 * 16 + 2, 100 = 3 * 32 + 4), y stored directly
    (48, 200, (32, 64, 3)),  # split-K: the last slice of each N tile sums the partials
    (37, 52, (64, 256, 1)),  # one masked tile wider than W
])
@pytest.mark.parametrize("per_channel", [False, True])
@pytest.mark.parametrize("load_ahead", [False, True])
def test_fp8_words_gemv_matches_reference(dtype, n, k, config, per_channel, load_ahead):
    """The word path (GemvConfig.fp8_words, with and without the load-ahead of the next tile) against the float32
    reference on fresh random inputs, bias included."""
    from asyncengine.kernels import quant_gemv, quant_reference

    w8, scale = quant_reference.quantize_fp8(torch.randn(n, k, device=DEVICE), dim=-1 if per_channel else None)
    x = torch.randn(1, k, dtype=dtype, device=DEVICE)
    bias = torch.randn(n, dtype=dtype, device=DEVICE)
    block_n, block_k, split_k = config
    config = quant_gemv.GemvConfig(block_n, block_k, split_k, fp8_words=True, load_ahead=load_ahead)
    out = quant_gemv.dense_gemv(x, w8, bias, scale, config=config)
    ref = quant_reference.dense_gemv(x, w8, bias, scale)
    assert_matches(out, ref, {torch.float32: (1e-4, 1e-4), torch.bfloat16: (2e-2, 2e-2)})


# Relative error (norm of the difference over the norm of the reference): the block scales span 2**12, so
# elementwise tolerances would be set by the cancellations of the largest blocks. float32: summation order only;
# bf16: x and y rounded to bf16 (and, above the GEMV, the dequantized weight).
FP8_GROUP_REL_ERROR = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def fp8_block_case(n: int, k: int, block: tuple[int, int], device=DEVICE):
    """A random FP8 weight [n, k] quantized per [bn, bk] block as block-wise checkpoints are (amax / 448 per block,
    partial blocks at the edges), its block scales [ceil(n / bn), ceil(k / bk)] spread far apart (2**-6 ... 2**6,
    so a scale applied to the wrong block shows), and the group scales [ceil(k / bk), n] the kernels read."""
    from asyncengine.kernels.quant_reference import FP8_DTYPE, fp8_group_scales

    bn, bk = block
    w = torch.randn(n, k)
    rows, cols = -(-n // bn), -(-k // bk)
    block_scales = 2.0 ** torch.randint(-6, 7, (rows, cols)).float() / 448.0
    per_weight = block_scales.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    w8 = (w / per_weight * 448.0 / w.abs().amax()).clamp(-448, 448).to(FP8_DTYPE)
    return w8.to(device), fp8_group_scales(block_scales, bn, n).to(device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 3, 16, 40])  # the FP8 word path; tl.dot tiles of 16 and 64 rows
@pytest.mark.parametrize("n, k, block, config", [
    (50, 160, (16, 32), None),  # the default tiles, their K tile cut to the 32-input group
    (48, 200, (16, 48), (32, 64, 3)),  # split-K, a partial last group (200 = 4 * 48 + 8), tile cut to 16
    (40, 128, (128, 128), (16, 128, 1)),  # one block along N wider than W (a checkpoint's 128 x 128)
    (24, 98, (16, 32), None),  # K not a multiple of 4: no FP8 words at M == 1, tl.dot instead
])
def test_fp8_group_scale_gemv_matches_reference(dtype, m, n, k, block, config):
    """FP8 weights with group scales (block-wise checkpoints) on the word path at M == 1 (whatever the config row
    says) and on tl.dot above, against the float32 reference, bias included."""
    from asyncengine.kernels import quant_gemv, quant_reference

    w8, scales = fp8_block_case(n, k, block)
    x = torch.randn(m, k, dtype=dtype, device=DEVICE)
    bias = torch.randn(n, dtype=dtype, device=DEVICE)
    if config is not None:
        config = quant_gemv.GemvConfig(*config, dot=m > 1)
    out = quant_gemv.dense_gemv(x, w8, bias, scales, config=config, group_size=block[1], num_sms=8)
    ref = quant_reference.dense_gemv(x, w8, bias, scales, group_size=block[1])
    assert out.dtype == dtype and not out.isnan().any(), "kernel left NaN (unwritten elements?)"
    assert rel_error(out, ref) < FP8_GROUP_REL_ERROR[dtype], rel_error(out, ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_group_dequantize_and_the_path_above_the_gemv_match_reference(dtype):
    """quant_fp8.dequantize_groups: the reference's bits (float32 product rounded once; the interpreter rounds to
    bf16 toward zero, the GPU to nearest, hence one bf16 unit there); fp8_group_linear (dequantize, then the
    library's GEMM) at a prefill-sized batch within the GEMM's rounding."""
    from asyncengine.kernels import interpreting, quant_fp8, quant_reference

    w8, scales = fp8_block_case(70, 200, (16, 48))
    out = quant_fp8.dequantize_groups(w8, scales, 48, dtype)
    ref = quant_reference.dequantize_fp8_groups(w8, scales, 48, dtype)
    one_ulp = 2.0**-7 if dtype == torch.bfloat16 and interpreting() else 0.0
    torch.testing.assert_close(out.float(), ref.float(), atol=0, rtol=one_ulp)
    x = torch.randn(100, 200, dtype=dtype, device=DEVICE)
    bias = torch.randn(70, dtype=dtype, device=DEVICE)
    y = quant_fp8.fp8_group_linear(x, w8, scales, 48, bias)
    assert rel_error(y, quant_reference.fp8_group_linear(x, w8, scales, 48, bias)) < FP8_GROUP_REL_ERROR[dtype]


def test_fp8_group_scales_are_checked_by_name():
    from asyncengine.kernels import quant_fp8, quant_gemv

    w8, scales = fp8_block_case(32, 64, (16, 32))
    x = torch.randn(1, 64, device=DEVICE)
    with pytest.raises(ValueError, match=r"group scales must be \[2, 32\]"):
        quant_gemv.dense_gemv(x, w8, None, scales.t(), group_size=32)
    with pytest.raises(ValueError, match="group size 24 is not a multiple of 16"):
        quant_gemv.dense_gemv(x, w8, None, torch.ones(3, 32, device=DEVICE), group_size=24)
    with pytest.raises(ValueError, match="group scales apply to FP8"):
        quant_gemv.dense_gemv(x, w8.float(), None, scales, group_size=32)
    with pytest.raises(ValueError, match=r"group scales must be \[2, 32\]"):
        quant_fp8.dequantize_groups(w8, scales[:1], 32, torch.float32)


def test_fp8_words_rejects_what_it_cannot_read():
    from asyncengine.kernels import quant_gemv, quant_reference

    config = quant_gemv.GemvConfig(16, 32, 1, fp8_words=True)
    w8, scale = quant_reference.quantize_fp8(torch.randn(16, 66, device=DEVICE), dim=-1)
    with pytest.raises(ValueError, match="fp8_words.*K=66"):
        quant_gemv.dense_gemv(torch.randn(1, 66, device=DEVICE), w8, None, scale, config=config)
    w8, scale = quant_reference.quantize_fp8(torch.randn(16, 64, device=DEVICE), dim=-1)
    with pytest.raises(ValueError, match="fp8_words.*FMA path"):
        quant_gemv.dense_gemv(torch.randn(2, 64, device=DEVICE), w8, None, scale, config=config)
    with pytest.raises(ValueError, match="fp8_words needs FP8"):
        quant_gemv.dense_gemv(torch.randn(1, 64, device=DEVICE), torch.randn(16, 64, device=DEVICE), config=config)
    load_ahead = quant_gemv.GemvConfig(16, 32, 1, load_ahead=True)
    with pytest.raises(ValueError, match="load_ahead applies at M == 1 on the FMA path"):
        quant_gemv.dense_gemv(torch.randn(2, 64, device=DEVICE), w8, None, scale, config=load_ahead)
    x, qweight, scales, zeros = int4_case(2, 128, 16, 32, torch.float32)
    with pytest.raises(ValueError, match="load_ahead applies at M == 1 on the FMA path"):
        quant_gemv.int4_gemv(x, qweight, scales, zeros, 32, config=load_ahead)
    with pytest.raises(ValueError, match="load_ahead applies at M == 1 on the FMA path"):
        quant_gemv.int4_gemv(x[:1], qweight, scales, zeros, 32,
                             config=quant_gemv.GemvConfig(16, 32, 1, dot=True, load_ahead=True))


@pytest.mark.parametrize("fmt", ["fp32", "bf16", "fp8"])
@pytest.mark.parametrize("n, k, config", [(50, 100, (16, 32, 1)), (48, 200, (32, 64, 3)), (37, 52, (64, 256, 1))])
def test_dense_gemv_load_ahead_matches_reference(fmt, n, k, config):
    """GemvConfig.load_ahead on the default dense FMA path (the next tile loaded one step ahead): tails, split-K (each
    slice's last load-ahead falls past its end: masked off), one tile wider than W."""
    from asyncengine.kernels import quant_gemv, quant_reference

    dtype = torch.float32 if fmt == "fp32" else torch.bfloat16
    w, scale = torch.randn(n, k, device=DEVICE, dtype=dtype), None
    if fmt == "fp8":
        w, scale = quant_reference.quantize_fp8(w.float(), dim=-1)
    x = torch.randn(1, k, dtype=dtype, device=DEVICE)
    out = quant_gemv.dense_gemv(x, w, None, scale, config=quant_gemv.GemvConfig(*config, load_ahead=True))
    ref = quant_reference.dense_gemv(x, w, None, scale)
    assert_matches(out, ref, {torch.float32: (1e-4, 1e-4), torch.bfloat16: (2e-2, 2e-2)})


@pytest.mark.parametrize("fmt, config", [
    ("int4", dict(block_n=64, block_k=32, split_k=3)), ("int4", dict(block_n=32, block_k=128)),
    ("int4", dict(block_n=16, block_k=64, split_k=2, half_fma=True)),
    ("int4", dict(block_n=32, block_k=32, split_k=3, load_ahead=True)),
    ("bf16", dict(block_n=16, block_k=64, split_k=2, load_ahead=True)),
    ("fp8", dict(block_n=32, block_k=64, split_k=3, fp8_words=True, load_ahead=True)),
    ("fp8", dict(block_n=32, block_k=64, fp8_words=True)), ("fp32", dict(block_n=16, block_k=32))])
def test_gemv_first_tile_before_or_after_the_wait_gives_the_same_bits(fmt, config, monkeypatch):
    """quant_gemv.FIRST_TILE_BEFORE_WAIT moves the FMA paths' first weight tile (int4 at M == 1: peeled out of the
    loop; dense load_ahead / fp8_words: the tile loaded ahead) ahead of the PDL wait: the same sums in the same
    order either way, so the same bits, and the reference's values (K split in slices, a ragged N tile). In the
    interpreter there is no wait to move: the test holds the peeled first step to the reference and to the bits of
    the other placement; the sm_90 compile test (test_fused_kernels.py) checks where the loads land."""
    from asyncengine.kernels import quant_gemv, quant_reference

    k, n = 256, 40
    config = quant_gemv.GemvConfig(**config)
    if fmt == "int4":
        x, qweight, scales, zeros = int4_case(1, k, n, 64, torch.bfloat16)
        run = lambda: quant_gemv.int4_gemv(x, qweight, scales, zeros, 64, config=config)  # noqa: E731
        ref = quant_reference.int_weight_matmul(x, qweight, scales, zeros, 64, 4)
    else:
        dtype = torch.float32 if fmt == "fp32" else torch.bfloat16
        w, scale = torch.randn(n, k, device=DEVICE, dtype=dtype), None
        if fmt == "fp8":
            w, scale = quant_reference.quantize_fp8(w.float(), dim=-1)
        x = torch.randn(1, k, dtype=dtype, device=DEVICE)
        run = lambda: quant_gemv.dense_gemv(x, w, None, scale, config=config)  # noqa: E731
        ref = quant_reference.dense_gemv(x, w, None, scale)
    early = run()
    monkeypatch.setattr(quant_gemv, "FIRST_TILE_BEFORE_WAIT", False)
    late = run()
    assert torch.equal(early, late)
    assert not early.isnan().any() and rel_error(early, ref) < 1e-2, rel_error(early, ref)


def test_gemv_sweep_write_table_replaces_known_keys_and_adds_new_ones_to_an_importable_table(tmp_path):
    """bench_gemv.write_table (what `--gemv-sweep --write-table` runs) on a copy of the real TUNED table."""
    import importlib.util

    from asyncengine.kernels import quant_gemv_configs
    from loadtest.bench_gemv import write_table

    path = tmp_path / "quant_gemv_configs.py"
    path.write_text(open(quant_gemv_configs.__file__).read())
    replaced = '    ("bf16", 4096, 4096, 1): GemvConfig(64, 128, 3, 4, 3, False),  # o: replaced'
    added = '    ("bf16", 1234, 5678, 1): GemvConfig(32, 256, 1, 4, 3, False),  # a new shape'
    assert write_table([replaced, added], str(path)) == 2
    text = path.read_text()
    assert text.count('("bf16", 4096, 4096, 1):') == 1 and replaced in text and added in text
    spec = importlib.util.spec_from_file_location("asyncengine.kernels.rewritten_configs", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.TUNED[("bf16", 4096, 4096, 1)].split_k == 3
    assert module.TUNED[("bf16", 1234, 5678, 1)].block_k == 256
    assert len(module.TUNED) == len(quant_gemv_configs.TUNED) + 1
    # a row of one GPU model sits beside the row for any GPU of that key, and is replaced by its own key only
    gpu_row = '    ("bf16", 4096, 4096, 1, "NVIDIA H100 80GB HBM3"): GemvConfig(16, 512, 2, 4, 3, False),  # o: H100'
    assert write_table([gpu_row], str(path)) == 1
    assert write_table([gpu_row.replace("(16, 512, 2,", "(16, 512, 7,")], str(path)) == 1
    spec.loader.exec_module(module)
    assert module.TUNED[("bf16", 4096, 4096, 1)].split_k == 3
    assert module.TUNED[("bf16", 4096, 4096, 1, "NVIDIA H100 80GB HBM3")].split_k == 7
    assert len(module.TUNED) == len(quant_gemv_configs.TUNED) + 2


def test_gemv_config_for_takes_the_row_of_its_gpu_then_the_row_for_any_gpu_then_the_default(monkeypatch):
    from asyncengine.kernels import quant_gemv, quant_gemv_configs

    any_gpu, h100 = quant_gemv.GemvConfig(32, 256, 3), quant_gemv.GemvConfig(16, 512, 5)
    monkeypatch.setattr(quant_gemv_configs, "TUNED", {("fp8", 6144, 4096, 1): any_gpu,
                                                      ("fp8", 6144, 4096, 1, "NVIDIA H100 80GB HBM3"): h100})
    assert quant_gemv.config_for("fp8", 1, 6144, 4096, 132, "NVIDIA H100 80GB HBM3") == h100
    assert quant_gemv.config_for("fp8", 1, 6144, 4096, 132, "NVIDIA H200") == any_gpu
    assert quant_gemv.config_for("fp8", 1, 6144, 4096, 132) == any_gpu
    assert quant_gemv.config_for("fp8", 16, 6144, 4096, 132, "NVIDIA H100 80GB HBM3") == \
        quant_gemv.default_config("fp8", 16, 6144, 4096, 132)


def test_gemv_sweep_winner_line_keys_the_row_by_the_gpu_measured():
    from asyncengine.kernels import quant_gemv
    from loadtest import bench_gemv

    group = bench_gemv.Group("fp8", "qkv", 4096, 6144, 1)
    result = bench_gemv.Result(group=group, best=[(10.0, quant_gemv.GemvConfig(32, 512, 2, 8, 3, fp8_words=True))],
                               library={}, bytes=6144 * 4096, error=0.0)
    line = bench_gemv.winner_line(result, 3000.0, "NVIDIA H100 80GB HBM3")
    assert line.startswith('    ("fp8", 6144, 4096, 1, "NVIDIA H100 80GB HBM3"): GemvConfig(32, 512, 2, 8, 3, False, '
                           'fp8_words=True),'), line
    assert bench_gemv.winner_line(result, 3000.0).startswith('    ("fp8", 6144, 4096, 1): GemvConfig(')


def test_fp8_group_quantization_round_trips_within_e4m3_precision():
    """quantize_fp8_groups (`--quantization fp8` of MoE experts): each output row's group of inputs at its own
    scale, its largest magnitude on 448; dequantized within e4m3's half unit in the last place (2**-4 relative)
    of each group's amax, a partial last group included, and an all-zero group stays zero."""
    from asyncengine.kernels.quant_reference import dequantize_fp8_groups, quantize_fp8_groups

    w = torch.randn(24, 200) * torch.logspace(-3, 3, 24)[:, None]  # rows of very different scales
    w[5, 128:] = 0.0  # row 5's partial last group: all zero
    w8, scales = quantize_fp8_groups(w, 128)
    assert w8.dtype == torch.float8_e4m3fn and scales.shape == (2, 24)
    assert w8.float().abs().view(24, -1)[:, :128].amax(dim=1).eq(448).all()
    back = dequantize_fp8_groups(w8, scales, 128)
    for g in range(2):
        cols = slice(128 * g, min(128 * (g + 1), 200))
        amax = w[:, cols].abs().amax(dim=1, keepdim=True)
        assert ((back[:, cols] - w[:, cols]).abs() <= amax * 2.0**-4).all()
    assert back[5, 128:].eq(0).all()

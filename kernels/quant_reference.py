"""Pure-torch references for the quantized linear kernels (quant_int4.py, quant_fp8.py, quant_gemv.py).

These define what each quantized Triton kernel computes; the engine runs them directly on CPU. Nothing here
imports the engine.

The engine's one packed-integer layout (AWQ and GPTQ checkpoints are converted to it at load time):
    qweight: [K // pack, N] int32, pack = 32 // bits values per int32 along the input dimension K; value j of a
             word sits at bit offset bits * j (so row r of qweight holds inputs pack*r ... pack*r + pack - 1).
    scales:  [G, N] in the activation dtype, G = ceil(K / group_size); input k uses group k // group_size.
    zeros:   [G, N] in the scales' dtype (unpacked integer zero points).
    W[k, n] = (q[k, n] - zeros[k // group_size, n]) * scales[k // group_size, n]; y = x @ W.
FP8 is e4m3 (torch.float8_e4m3fn, largest finite value 448); a scale maps fp8 values back: w = w_fp8 * scale.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max  # 448.0
# The smallest scale used for a row of zeros or a zero activation, so 0 / scale stays 0 and nothing is NaN.
_MIN_SCALE = 1.0 / (FP8_MAX * 512.0)


# -- packing ------------------------------------------------------------------------------------------------

def unpack_int32(packed: torch.Tensor, bits: int, dim: int, order: Optional[list[int]] = None) -> torch.Tensor:
    """Unpack an int32 tensor holding 32 // bits unsigned values per word along `dim` into int32 values.

    order: where each of a word's logical values sits (order[i] = the nibble slot of logical value i); None is
    sequential. AWQ's gemm layout uses its own interleaved order (see awq.py).
    """
    pack = 32 // bits
    slots = torch.arange(pack, device=packed.device) if order is None else torch.tensor(order, device=packed.device)
    shifts = (slots * bits).to(torch.int32)
    moved = packed.movedim(dim, -1).unsqueeze(-1)  # [..., W, 1]
    values = (moved >> shifts) & ((1 << bits) - 1)  # [..., W, pack]; >> on int32 is arithmetic, the mask fixes it
    values = values.flatten(-2)  # [..., W * pack]
    return values.movedim(-1, dim).contiguous()


def pack_int32(values: torch.Tensor, bits: int, dim: int, order: Optional[list[int]] = None) -> torch.Tensor:
    """The inverse of `unpack_int32`: values (0 <= v < 2**bits) along `dim` (a multiple of 32 // bits) -> int32."""
    pack = 32 // bits
    if values.shape[dim] % pack:
        raise ValueError(f"cannot pack {values.shape[dim]} values {pack} per int32")
    slots = torch.arange(pack, device=values.device) if order is None else torch.tensor(order, device=values.device)
    shifts = (slots * bits).to(torch.int64)
    moved = values.movedim(dim, -1).to(torch.int64)
    words = moved.unflatten(-1, (-1, pack)) << shifts  # [..., W, pack]
    packed = words.sum(-1)  # disjoint bit fields: the sum is their OR
    packed = torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)
    return packed.movedim(-1, dim).contiguous()


# -- integer weight-only -------------------------------------------------------------------------------------

def dequantize_packed(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
                      bits: int = 4) -> torch.Tensor:
    """The engine's packed layout (module docstring) -> W [K, N] in the scales' dtype."""
    q = unpack_int32(qweight, bits, dim=0)  # [K, N]
    group = torch.arange(q.shape[0], device=q.device) // group_size  # [K]
    return ((q.to(scales.dtype) - zeros[group]) * scales[group]).to(scales.dtype)


def dequantize_packed_rows(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
                           bits: int = 4) -> torch.Tensor:
    """W as rows [N, K] in the scales' dtype from qweight [N, K // pack] (each row's inputs packed along it: the
    module docstring's layout transposed, as the fused MoE kernels read each expert) and scales / zeros [G, N]."""
    return dequantize_packed(qweight.t(), scales, zeros, group_size, bits).t()


def int_weight_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                      group_size: int, bits: int = 4, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x: [M, K] -> x @ W (+ bias): [M, N] in x's dtype (products summed in float32)."""
    weight = dequantize_packed(qweight, scales.float(), zeros.float(), group_size, bits)  # [K, N]
    out = x.float() @ weight
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)


def quantize_int_weight(weight: torch.Tensor, group_size: int, bits: int = 4, symmetric: bool = False):
    """Round-to-nearest grouped quantization of W [K, N] (input-major) into the engine's layout.

    Returns (qweight [K // pack, N] int32, scales [G, N] float32, zeros [G, N] float32). Symmetric: zero point
    2**(bits-1); asymmetric: min/max per group. Used by benchmarks and tests (checkpoints are quantized offline).
    """
    k, n = weight.shape
    groups = -(-k // group_size)
    padded = F.pad(weight.float(), (0, 0, 0, groups * group_size - k))
    w = padded.view(groups, group_size, n)
    qmax = 2**bits - 1
    if symmetric:
        scales = (w.abs().amax(1) / (2 ** (bits - 1) - 0.5)).clamp(min=1e-8)  # [G, N]
        zeros = torch.full_like(scales, float(2 ** (bits - 1)))
    else:
        lo, hi = w.amin(1).clamp(max=0), w.amax(1).clamp(min=0)
        scales = ((hi - lo) / qmax).clamp(min=1e-8)
        zeros = (-lo / scales).round().clamp(0, qmax)
    q = (w / scales[:, None] + zeros[:, None]).round().clamp(0, qmax).view(-1, n)[:k]
    return pack_int32(q.to(torch.int32), bits, dim=0), scales, zeros


# -- FP8 ---------------------------------------------------------------------------------------------------

class Fp8Activation(NamedTuple):
    """A linear layer's input [M, K] with its per-token e4m3 copy, made by the kernel that produced the input
    (norm.fused_add_rms_norm and activation.silu_and_mul with fp8_copy): exactly quantize_fp8(value, dim=-1)."""

    value: torch.Tensor  # [M, K] in the model's dtype (the weight-only GEMV's input)
    fp8: torch.Tensor  # [M, K] float8_e4m3fn, contiguous
    scale: torch.Tensor  # [M, 1] float32: value ~= fp8 * scale


def taken_fp8_copy(quantized: Fp8Activation,
                   input_scale: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 values, per-token scales) of a copy made beforehand; a layer with a static input scale cannot take one
    (ValueError): its product expects x quantized by that scale."""
    if input_scale is not None:
        raise ValueError("a per-token FP8 copy was passed to a layer with a static input scale")
    return quantized.fp8, quantized.scale


def quantize_fp8(x: torch.Tensor, dim: Optional[int] = None, scale: Optional[torch.Tensor] = None):
    """x -> (x_fp8, scale float32) with x ~= x_fp8 * scale.

    dim None: one scale for the whole tensor (shape []); dim d: one scale per slice along the other dims, amax
    taken over d and kept (e.g. dim=-1 on activations [T, K]: per-token scales [T, 1]; on weights [N, K]:
    per-output-channel scales [N, 1]). A given `scale` (static) is used as is; values beyond 448 are clamped.
    """
    x32 = x.float()
    if scale is None:
        amax = x32.abs().amax() if dim is None else x32.abs().amax(dim=dim, keepdim=True)
        scale = (amax / FP8_MAX).clamp(min=_MIN_SCALE)
    q = (x32 / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale.float()


def dequantize_fp8(w_fp8: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """w_fp8 [N, K] with a scale [] / [1] (per tensor) or [N, 1] (per output channel) -> [N, K] in dtype."""
    return (w_fp8.float() * scale.float()).to(dtype)


def fp8_group_scales(block_scales: torch.Tensor, block_n: int, n: int) -> torch.Tensor:
    """Block-wise FP8 scales [..., ceil(N / bn), ceil(K / bk)] (one per [bn, bk] block of W, as checkpoints store
    them: `weight_scale_inv`, compressed-tensors' block strategy; leading dimensions, e.g. experts, kept) -> the
    group scales [..., ceil(K / bk), N] float32 that `dequantize_fp8_groups` and the kernels read: each output
    column's scale per group of bk inputs (a row per group, contiguous along N as the kernels load it)."""
    rows = torch.arange(n, device=block_scales.device) // block_n  # [N]: each output's block row
    return block_scales.float()[..., rows, :].transpose(-1, -2).contiguous()


def check_fp8_group_scales(w_fp8: torch.Tensor, group_scales: Optional[torch.Tensor], group_size: int,
                           what: str) -> None:
    """ValueError (naming `what`) unless w_fp8 [N, K] is e4m3 and group_scales is [ceil(K / group_size), N]."""
    if w_fp8.dtype != FP8_DTYPE:
        raise ValueError(f"{what}: group scales apply to FP8 e4m3 weights, got {w_fp8.dtype}")
    n, k = w_fp8.shape
    groups = -(-k // group_size)
    if group_scales is None or tuple(group_scales.shape) != (groups, n):
        raise ValueError(f"{what}: group scales must be [{groups}, {n}] for a [{n}, {k}] weight in groups of "
                         f"{group_size}, got {None if group_scales is None else list(group_scales.shape)}")


def dequantize_fp8_groups(w_fp8: torch.Tensor, group_scales: torch.Tensor, group_size: int,
                          dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """w_fp8 [N, K] with group scales [G, N] (inputs g * group_size ... share scale row g; the last group may be
    partial) -> [N, K] in dtype, computed in float32 and rounded once."""
    check_fp8_group_scales(w_fp8, group_scales, group_size, "FP8 dequantize")
    k = w_fp8.shape[1]
    per_input = group_scales.float().t().repeat_interleave(group_size, dim=1)[:, :k]  # [N, K]
    return (w_fp8.float() * per_input).to(dtype)


def quantize_fp8_groups(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (e4m3 [N, K], group scales [ceil(K / group_size), N] float32): each output row's groups of
    group_size inputs scaled by their own amax / 448 (the last group may be partial; an all-zero group gets the
    floor scale), the inverse of `dequantize_fp8_groups`."""
    n, k = w.shape
    groups = -(-k // group_size)
    padded = torch.zeros(n, groups * group_size, dtype=torch.float32, device=w.device)
    padded[:, :k] = w.float()
    amax = padded.view(n, groups, group_size).abs().amax(dim=2)  # [N, G]
    scales = torch.clamp(amax / FP8_MAX, min=_MIN_SCALE)
    w8 = (padded.view(n, groups, group_size) / scales[:, :, None]).clamp(-FP8_MAX, FP8_MAX).view(n, -1)[:, :k]
    return w8.to(FP8_DTYPE), scales.t().contiguous()


def fp8_group_linear(x: torch.Tensor, w_fp8: torch.Tensor, group_scales: torch.Tensor, group_size: int,
                     bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Weight-only FP8 with group scales (block-wise checkpoints): x [M, K] @ dequantize_fp8_groups(...)^T (+ bias)
    with float32 sums, in x's dtype; x is not quantized."""
    return dense_gemv(x, w_fp8, bias, group_scales, group_size)


def fp8_scaled_mm(x_fp8: torch.Tensor, x_scale: torch.Tensor, w_fp8: torch.Tensor, w_scale: torch.Tensor,
                  out_dtype: torch.dtype, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """(x_fp8 * x_scale) @ (w_fp8 * w_scale)^T (+ bias) in float32, returned in out_dtype.

    x_fp8: [M, K] with x_scale [] (per tensor) or [M, 1] (per token); w_fp8: [N, K] with w_scale [] or [N, 1].
    """
    out = (x_fp8.float() @ w_fp8.float().t()) * x_scale.float() * w_scale.float().reshape(1, -1)
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype)


def fp8_linear(x: torch.Tensor, w_fp8: torch.Tensor, w_scale: torch.Tensor, input_scale: Optional[torch.Tensor],
               bias: Optional[torch.Tensor] = None, quantized: Optional[Fp8Activation] = None) -> torch.Tensor:
    """W8A8: x [M, K] quantized per token (input_scale None, dynamic) or with the static per-tensor input_scale,
    then `fp8_scaled_mm` with the weight. The definition the CUDA path (kernels/quant_fp8.py) computes.
    quantized: x's per-token copy made beforehand (dynamic scales only), taken instead of quantizing x here."""
    if quantized is not None:
        x_fp8, x_scale = taken_fp8_copy(quantized, input_scale)
    else:
        x_fp8, x_scale = quantize_fp8(x, dim=-1, scale=input_scale)
    return fp8_scaled_mm(x_fp8, x_scale, w_fp8, w_scale, x.dtype, bias)


def fp8_gemm_linear(x: torch.Tensor, w_fp8: torch.Tensor, w_scale: torch.Tensor,
                    input_scale: Optional[torch.Tensor], bias: Optional[torch.Tensor] = None,
                    quantized: Optional[Fp8Activation] = None) -> torch.Tensor:
    """fp8_linear (the CUDA side computes it with our own W8A8 GEMM, kernels/fp8_gemm.py)."""
    return fp8_linear(x, w_fp8, w_scale, input_scale, bias, quantized)


# -- dense decode GEMV -------------------------------------------------------------------------------------

def dense_gemv(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
               w_scale: Optional[torch.Tensor] = None, group_size: Optional[int] = None) -> torch.Tensor:
    """x [M, K] @ (weight [N, K] * w_scale)^T (+ bias) with float32 sums, in x's dtype: the decode GEMV of a dense
    weight (bf16 / fp16 / fp32, or FP8 with w_scale [N, 1] or [] and x left unquantized). group_size: FP8 with
    group scales w_scale [G, N] instead (`dequantize_fp8_groups`)."""
    if group_size is not None:
        w = dequantize_fp8_groups(weight, w_scale, group_size)
    else:
        w = weight.float() if w_scale is None else dequantize_fp8(weight, w_scale)
    out = x.float() @ w.t()
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)

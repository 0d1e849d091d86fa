"""The adapter between the engine and `asyncengine.kernels`: Triton kernels on CUDA, the fast CPU kernels
(`kernels/cpu.py`) on CPU, the torch references elsewhere (and on CPU when `CPU_FAST_PATH` is off).

The choice is made per call from the tensor's device, so the same model code runs on both. Every function here
has the signature of its counterpart in `kernels/reference.py`; the Triton and CPU versions update some tensors in
place, so callers always use the returned values.
"""

from __future__ import annotations

import functools
import logging
from typing import NamedTuple

import torch

from asyncengine.kernels import cpu, quant_reference, reference

# The fast CPU kernels; tests turn this off (monkeypatch) to run the whole model on the references.
CPU_FAST_PATH = True

logger = logging.getLogger(__name__)


@functools.cache
def _triton_kernels():
    """The Triton kernel modules, or None when Triton cannot run here. Asked only for CUDA tensors, once: a
    failure is logged as an error, since the torch references are far slower on a GPU."""
    try:
        from asyncengine.kernels import activation, attention, cache, moe, norm, rotary, rotary_cache
    except Exception:  # Triton missing or broken: fall back to the references, loudly
        logger.exception("the Triton kernels failed to import on a CUDA device; every kernel falls back to its "
                         "torch reference (correct, but much slower). Install a Triton that matches torch.")
        return None
    return {"activation": activation, "attention": attention, "cache": cache, "moe": moe, "norm": norm,
            "rotary": rotary, "rotary_cache": rotary_cache}


def _impl(x: torch.Tensor, family: str):
    if x.is_cuda:
        kernels = _triton_kernels()
        if kernels is not None:
            return kernels[family]
        return reference
    if CPU_FAST_PATH and x.device.type == "cpu" and family in _CPU_FAMILIES:
        return cpu
    return reference


_CPU_FAMILIES = ("norm", "activation", "rotary")  # attention and cache: cache_and_attend, with the step's plan


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _impl(x, "norm").rms_norm(x, weight, eps)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                       fp8_copy: bool = False):
    """(rms_norm(x + residual), x + residual); with fp8_copy the first is a quant_reference.Fp8Activation (the
    Triton kernel quantizes the row it makes; elsewhere the reference quantizes afterwards)."""
    impl = _impl(x, "norm")
    if impl not in (reference, cpu):  # Triton
        return impl.fused_add_rms_norm(x, residual, weight, eps, fp8_copy)
    out, residual = impl.fused_add_rms_norm(x, residual, weight, eps)
    return (_with_fp8_copy(out) if fp8_copy else out), residual


def silu_and_mul(x: torch.Tensor, fp8_copy: bool = False):
    """silu(gate) * up of x [T, 2I]; with fp8_copy a quant_reference.Fp8Activation of it (as fused_add_rms_norm)."""
    impl = _impl(x, "activation")
    if impl not in (reference, cpu):  # Triton
        return impl.silu_and_mul(x, fp8_copy)
    out = impl.silu_and_mul(x)
    return _with_fp8_copy(out) if fp8_copy else out


def _with_fp8_copy(out: torch.Tensor) -> quant_reference.Fp8Activation:
    return quant_reference.Fp8Activation(out, *quant_reference.quantize_fp8(out, dim=-1))


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """GeGLU: [T, 2I] = [gate | up] -> gelu_tanh(gate) * up [T, I]. The reference on every device (torch's fused
    element-wise ops; no Triton kernel of its own yet)."""
    return reference.gelu_tanh_and_mul(x)


def rotary_embedding(positions, q, k, cos_sin_cache, head_dim: int):
    return _impl(q, "rotary").rotary_embedding(positions, q, k, cos_sin_cache, head_dim)


def fused_moe(hidden, w13, w2, topk_weights, topk_ids, w13_scale=None, w2_scale=None,
              group_size=None, w13_zeros=None, w2_zeros=None) -> torch.Tensor:
    """Top-k mixture of gated-MLP experts (see reference.fused_moe): hidden [T, H] -> [T, H]; FP8 experts with
    group scales when w13_scale / w2_scale are given, int4 experts (int32 words) with scales and zero points. CPU
    takes the reference, which already groups the tokens by expert."""
    return _impl(hidden, "moe").fused_moe(hidden, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale, group_size,
                                          w13_zeros, w2_zeros)


def route(hidden: torch.Tensor, gate_weight: torch.Tensor, top_k: int, renormalize: bool):
    """Mixture-of-experts router and routing (see reference.route): hidden [T, H], gate_weight [E, H] ->
    (weights [T, K] float32, ids [T, K])."""
    return _impl(hidden, "moe").route(hidden, gate_weight, top_k, renormalize)


def topk_softmax(router_logits: torch.Tensor, top_k: int, renormalize: bool):
    """Mixture-of-experts routing (see reference.topk_softmax): [T, E] -> (weights [T, K] float32, ids [T, K])."""
    return _impl(router_logits, "moe").topk_softmax(router_logits, top_k, renormalize)


def reshape_and_cache(key, value, k_cache, v_cache, slot_mapping, k_scale: float = 1.0,
                      v_scale: float = 1.0) -> None:
    """An FP8 (e4m3) cache stores key / k_scale and value / v_scale, saturated (reference.quantize_kv)."""
    _impl(key, "cache").reshape_and_cache(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)


class QKNorm(NamedTuple):
    """Per-head RMSNorms of q and k, applied before rotary (Qwen3): weights [D] and their epsilon."""

    q_weight: torch.Tensor
    k_weight: torch.Tensor
    eps: float


def cache_and_attend(q, k, v, k_cache, v_cache, metadata, scale: float, sliding_window=None,
                     softcap=None, k_scale: float = 1.0, v_scale: float = 1.0, rotary=None,
                     qk_norm: QKNorm | None = None) -> torch.Tensor:
    """reshape_and_cache(k, v, ...) then paged_attention(q, ...): q [T, H, D], k, v [T, KVH, D] -> [T, H, D].
    On CPU with the step's plan (metadata.cpu_plan) one fused call, which can skip reading back what it wrote.
    k_scale / v_scale: the layer's FP8 KV scales (read only when the caches are e4m3).
    rotary: None, or (positions [T], cos_sin_cache [max_pos, D]) to rotate q and k first (rotary_embedding); on
    CUDA the rotation and the cache write are one kernel (kernels/rotary_cache.py). q and k may be rotated in
    place. qk_norm: q and k are first rms_norm'ed over each head; on CUDA with rotary inside the same kernel
    (in place too), elsewhere by `rms_norm`, with the same bits."""
    if rotary is not None and q.is_cuda:
        positions, cos_sin_cache = rotary
        norm = {} if qk_norm is None else dict(q_norm_weight=qk_norm.q_weight, k_norm_weight=qk_norm.k_weight,
                                               eps=qk_norm.eps)
        q, k = _impl(q, "rotary_cache").rotary_and_cache(positions, q, k, v, cos_sin_cache, k_cache, v_cache,
                                                         metadata.slot_mapping, k_scale, v_scale, **norm)
        return paged_attention(q, k_cache, v_cache, metadata, scale, sliding_window, softcap, k_scale, v_scale)
    if qk_norm is not None:
        q, k = rms_norm(q, qk_norm.q_weight, qk_norm.eps), rms_norm(k, qk_norm.k_weight, qk_norm.eps)
    if rotary is not None:
        positions, cos_sin_cache = rotary
        q_rot, k_rot = rotary_embedding(positions, q.flatten(1), k.flatten(1), cos_sin_cache, q.shape[-1])
        q, k = q_rot.view(q.shape), k_rot.view(k.shape)
    if CPU_FAST_PATH and metadata.cpu_plan is not None and q.device.type == "cpu":
        return cpu.cache_and_attend(q, k, v, k_cache, v_cache, metadata.slot_mapping, metadata.cpu_plan, scale,
                                    sliding_window, softcap, k_scale, v_scale)
    reshape_and_cache(k, v, k_cache, v_cache, metadata.slot_mapping, k_scale, v_scale)
    return paged_attention(q, k_cache, v_cache, metadata, scale, sliding_window, softcap, k_scale, v_scale)


def paged_attention(q, k_cache, v_cache, metadata, scale: float, sliding_window=None, softcap=None,
                    k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
    """metadata: an AttentionMetadata (query_start_loc, seq_lens, block_tables, max lengths as host ints).
    sliding_window: queries see only the last this many keys (None: all); softcap: Gemma-2 score capping;
    k_scale / v_scale: an e4m3 cache's values are read times these."""
    impl = _impl(q, "attention")
    if impl is reference:
        return reference.paged_attention(
            q, k_cache, v_cache, metadata.query_start_loc_cpu, metadata.seq_lens_cpu, metadata.block_tables, scale,
            sliding_window, softcap, k_scale, v_scale,
        )
    return impl.paged_attention(
        q,
        k_cache,
        v_cache,
        metadata.query_start_loc,
        metadata.seq_lens,
        metadata.block_tables,
        scale,
        max_query_len=metadata.max_query_len,
        max_seq_len=metadata.max_seq_len,
        sliding_window=sliding_window,
        softcap=softcap,
        k_scale=k_scale,
        v_scale=v_scale,
    )


def encoder_attention(q, k, v, metadata, scale: float) -> torch.Tensor:
    """Bidirectional attention within each whole sequence, no KV cache (encoders). q: [T, H, D], k, v: [T, KVH, D];
    metadata: a models.bert.EncoderMetadata (query_start_loc on the device and on the host, max_len)."""
    impl = _impl(q, "attention")
    if impl is reference:
        return reference.varlen_attention(q, k, v, metadata.query_start_loc_cpu, scale)
    return impl.varlen_attention(q, k, v, metadata.query_start_loc, scale, max_len=metadata.max_len)


# -- quantized linear layers ------------------------------------------------------------------------------------
# On CUDA the Triton kernels of kernels/quant_*.py (which pick a kernel per shape); elsewhere the torch references
# of kernels/quant_reference.py (dequantize, then matmul), which the model loader announces once in the log.


@functools.cache
def _quant_kernels():
    """kernels.quant_linear (the per-shape dispatch over the quantized Triton kernels), or None when Triton cannot
    run here (logged once as an error, as for the other families)."""
    try:
        from asyncengine.kernels import quant_linear
    except Exception:
        logger.exception("the quantized Triton kernels failed to import on a CUDA device; quantized layers fall "
                         "back to the torch references (dequantize, then matmul: much slower)")
        return None
    return quant_linear


def _quant_impl(x: torch.Tensor):
    if x.is_cuda:
        return _quant_kernels() or quant_reference
    return quant_reference


def int_weight_linear(x, qweight, scales, zeros, group_size: int, bits: int, bias=None) -> torch.Tensor:
    """x [T, K] @ W (+ bias) with W in the engine's packed integer layout (kernels/quant_reference.py)."""
    return _quant_impl(x).int_weight_matmul(x, qweight, scales, zeros, group_size, bits, bias)


def fp8_linear(x, w_fp8, w_scale, input_scale, bias=None, quantized=None) -> torch.Tensor:
    """W8A8: x [T, K] quantized per token (input_scale None) or with a static scale, times w_fp8 [N, K].
    quantized: x's per-token copy (quant_reference.Fp8Activation) when the kernel that made x made it too."""
    return _quant_impl(x).fp8_linear(x, w_fp8, w_scale, input_scale, bias, quantized)


def fp8_gemm_linear(x, w_fp8, w_scale, input_scale, bias=None, quantized=None) -> torch.Tensor:
    """fp8_linear by our own W8A8 GEMM on CUDA (decode-sized batches, M <= 512); the same reference elsewhere."""
    return _quant_impl(x).fp8_gemm_linear(x, w_fp8, w_scale, input_scale, bias, quantized)


def head_logits(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """hidden [S, K] x weight [V, K]^T -> logits [S, V] (maybe a strided view): the LM head's product."""
    if CPU_FAST_PATH and hidden.device.type == "cpu":
        return cpu.head_logits(hidden, weight)
    return torch.nn.functional.linear(hidden, weight)


def dense_gemv(x, weight, bias=None, w_scale=None, group_size=None) -> torch.Tensor:
    """Decode GEMV (M <= 64): x [M, K] @ (weight [N, K] * w_scale)^T (+ bias), weight dense or FP8 (weight-only);
    group_size: FP8 with group scales w_scale [G, N] (block-wise checkpoints)."""
    return _quant_impl(x).dense_gemv(x, weight, bias, w_scale, group_size=group_size)


def fp8_group_linear(x, w_fp8, group_scales, group_size: int, bias=None) -> torch.Tensor:
    """Weight-only FP8 with group scales [G, N] at any batch size: x [T, K] @ W^T (+ bias), x not quantized."""
    return _quant_impl(x).fp8_group_linear(x, w_fp8, group_scales, group_size, bias)


def fp8_gemm_max_m(key: tuple, ours, library, weights: tuple, k: int, dtype: torch.dtype,
                   device: torch.device) -> int:
    """Up to which batch size `ours(x, w)` (fp8_gemm_linear) beats `library(x, w)` (fp8_linear): measured once per
    key on CUDA at start-up (kernels.quant_linear.fp8_gemm_max_m) and kept on disk (`_kept`); 0 elsewhere."""
    kernels = _quant_kernels() if device.type == "cuda" else None
    if kernels is None:
        return 0
    return _kept("FP8 GEMM", key, dtype, device,
                 lambda: kernels.fp8_gemm_max_m(key, ours, library, weights, k, dtype, device))


def decode_gemv_max_m(key: tuple, ours, library, weights: tuple, k: int, dtype: torch.dtype,
                      device: torch.device) -> int:
    """Up to which decode batch size `ours(x, w)` (our GEMV) beats `library(x, w)` on this shape, w being `weights`
    or a copy of them: measured once per key on CUDA at start-up (kernels.quant_linear.gemv_max_m) and kept on disk
    (`_kept`); 0 elsewhere (CPU runs the references)."""
    kernels = _quant_kernels() if device.type == "cuda" else None
    if kernels is None:
        return 0
    return _kept("decode GEMV", key, dtype, device,
                 lambda: kernels.gemv_max_m(key, ours, library, weights, k, dtype, device))


_kept_choices: dict[str, int] = {}


def _kept(what: str, key: tuple, dtype: torch.dtype, device: torch.device, measure) -> int:
    """measure()'s choice for this shape key and activation dtype, recorded per machine (measured_choices.py) under
    the GPU's name and a fingerprint of the kernels it times: a restart (another rank, the next server) reuses it
    instead of timing again, and every process on the machine multiplies alike. A kernel or tile table that
    changes (the fingerprint) is measured afresh."""
    from asyncengine.measured_choices import MeasuredChoices

    name = f"{what} {key} x {dtype} on {torch.cuda.get_device_name(device)} | {_kernels_fingerprint()}"
    if name not in _kept_choices:  # the layers of one shape share it: the file is read once per process
        _kept_choices[name] = int(MeasuredChoices("cuda_linear").get_or_measure(name, measure))
    return _kept_choices[name]


@functools.cache
def _kernels_fingerprint() -> str:
    """Triton's version and a hash of the sources of the kernels the start-up choices time, and of their tables."""
    import hashlib

    import triton

    from asyncengine.kernels import fp8_gemm, fp8_gemm_configs, pdl, quant_fp8, quant_gemv, quant_gemv_configs
    from asyncengine.kernels import quant_linear

    digest = hashlib.sha256()
    for module in (fp8_gemm, fp8_gemm_configs, pdl, quant_fp8, quant_gemv, quant_gemv_configs, quant_linear):
        with open(module.__file__, "rb") as source:
            digest.update(source.read())
    return f"triton {triton.__version__}, kernels {digest.hexdigest()[:16]}"

"""compressed-tensors checkpoints (`quant_method: compressed-tensors`, as llm-compressor writes them): the FP8
float-quantized schemes (W8A8 with per-tensor or per-channel weight scales, static per-tensor or dynamic
per-token activation scales). The tensors are those of fp8.py: weight, weight_scale, input_scale."""

from __future__ import annotations

from asyncengine.quantization.fp8 import Fp8Config

_SUPPORTED = ("FP8 W8A8 (format float-quantized, one config group targeting Linear, weights float 8-bit "
              "symmetric static per tensor or channel, input activations float 8-bit static per tensor or "
              "dynamic per token)")


def _unsupported(what: str) -> ValueError:
    return ValueError(f"compressed-tensors checkpoint: {what} is not supported (supported: {_SUPPORTED})")


def _check_ignore(ignore: list) -> None:
    """Layers left unquantized: only the LM head (which the engine never quantizes) is allowed."""
    others = [name for name in ignore or [] if not str(name).removeprefix("re:").strip(".*").endswith("lm_head")]
    if others:
        raise _unsupported(f"ignore list {others} (unquantized decoder layers)")


def _scheme(cfg: dict) -> dict:
    groups = list((cfg.get("config_groups") or {}).values())
    if len(groups) != 1:
        raise _unsupported(f"{len(groups)} config groups")
    group = groups[0]
    if [t for t in group.get("targets", []) if t != "Linear"]:
        raise _unsupported(f"targets {group.get('targets')}")
    return group


def _float8(args: dict, what: str) -> None:
    if args.get("type") != "float" or args.get("num_bits") != 8:
        raise _unsupported(f"{what} of type {args.get('type')!r} with {args.get('num_bits')} bits")
    if args.get("symmetric") is False:
        raise _unsupported(f"asymmetric {what}")


def compressed_tensors_config(cfg: dict) -> Fp8Config:
    """The format of a compressed-tensors quantization_config (ValueError saying what is supported)."""
    fmt = cfg.get("format")
    if fmt not in ("float-quantized", "naive-quantized"):
        raise _unsupported(f"format {fmt!r}")
    if cfg.get("kv_cache_scheme"):
        raise _unsupported("kv_cache_scheme (use --kv-cache-dtype)")
    _check_ignore(cfg.get("ignore"))
    group = _scheme(cfg)
    weights, inputs = group.get("weights") or {}, group.get("input_activations")
    _float8(weights, "weights")
    if weights.get("strategy") not in ("tensor", "channel") or weights.get("dynamic"):
        raise _unsupported(f"weight strategy {weights.get('strategy')!r} (dynamic: {weights.get('dynamic')})")
    if inputs is None:
        raise _unsupported("weight-only FP8 (no input_activations)")
    _float8(inputs, "input activations")
    dynamic = bool(inputs.get("dynamic"))
    if (inputs.get("strategy"), dynamic) not in (("tensor", False), ("token", True), ("tensor", True)):
        raise _unsupported(f"input activation strategy {inputs.get('strategy')!r} with dynamic {dynamic}")
    return Fp8Config("compressed-tensors", serialized=True, per_channel=weights["strategy"] == "channel",
                     static_input=not dynamic)

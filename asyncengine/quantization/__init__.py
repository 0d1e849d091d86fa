"""How a linear layer stores and applies its weight: unquantized, or a quantized format chosen from the
checkpoint's `quantization_config` (config.json) or `EngineConfig.quantization` (`--quantization`).

    base.py               LinearMethod (create / load / apply one layer's weights), QuantizationConfig
    packed_int.py         the shared int4/int8 weight-only method (AWQ and GPTQ convert to its layout)
    awq.py, gptq.py       AutoAWQ gemm and GPTQ checkpoints
    fp8.py                FP8 e4m3 checkpoints and online FP8 quantization
    compressed_tensors.py compressed-tensors' FP8 schemes
    cpu_int8.py           int8 W8A8 on CPU, quantized at load time (opt-in)
    cpu_prepacked.py      the CPU's column-major layout of unquantized weights
"""

from __future__ import annotations

import logging
from typing import Optional

from asyncengine.quantization.base import (
    LinearMethod,
    QuantizationConfig,
    UnquantizedLinearMethod,
    set_weight_attrs,
)

# vLLM's spelling of --quantization
QUANTIZATION_METHODS = ("awq", "gptq", "fp8", "compressed-tensors", "int8")
# vLLM's names for the same AWQ and GPTQ checkpoints run by its Marlin kernels (what vLLM picks for them on a GPU,
# and what its users often pass): here they load as the format itself and run on this engine's int4 kernels.
QUANTIZATION_ALIASES = {"awq_marlin": "awq", "gptq_marlin": "gptq"}
QUANTIZATION_CHOICES = QUANTIZATION_METHODS + tuple(QUANTIZATION_ALIASES)

__all__ = ["LinearMethod", "QuantizationConfig", "UnquantizedLinearMethod", "set_weight_attrs",
           "QUANTIZATION_METHODS", "QUANTIZATION_ALIASES", "QUANTIZATION_CHOICES", "check_quantization_name",
           "quantization_config_for"]

logger = logging.getLogger(__name__)


def check_quantization_name(requested: Optional[str]) -> Optional[str]:
    """The method `requested` (--quantization) names: itself, or the format a vLLM alias stands for (logged: the
    kernels are this engine's, not Marlin). ValueError listing the accepted names for any other."""
    if requested is None or requested in QUANTIZATION_METHODS:
        return requested
    if requested in QUANTIZATION_ALIASES:
        method = QUANTIZATION_ALIASES[requested]
        logger.info("quantization %r: vLLM's name for %s checkpoints run by Marlin kernels; loaded as %r and run "
                    "on asyncengine's own int4 kernels", requested, method.upper(), method)
        return method
    raise ValueError(f"quantization {requested!r} is not supported (supported: {', '.join(QUANTIZATION_CHOICES)})")


def _from_checkpoint(cfg: dict) -> QuantizationConfig:
    from asyncengine.quantization.awq import AWQConfig
    from asyncengine.quantization.compressed_tensors import compressed_tensors_config
    from asyncengine.quantization.fp8 import Fp8Config
    from asyncengine.quantization.gptq import GPTQConfig

    method = str(cfg.get("quant_method", "")).lower()
    parsers = {"awq": AWQConfig.from_config, "gptq": GPTQConfig.from_config, "fp8": Fp8Config.from_config,
               "compressed-tensors": compressed_tensors_config}
    if method not in parsers:
        raise ValueError(f"quantization_config.quant_method {method!r} is not supported (supported: "
                         f"{', '.join(parsers)})")
    return parsers[method](cfg)


def quantization_config_for(checkpoint_cfg: Optional[dict], requested: Optional[str]) -> Optional[QuantizationConfig]:
    """The format to run: the checkpoint's `quantization_config` (None when unquantized), checked against
    `requested` (--quantization, vLLM's spelling; its awq_marlin / gptq_marlin name AWQ / GPTQ) when both are
    given. `--quantization fp8` on an unquantized checkpoint quantizes it at load time, and so does `int8` (CPU
    only); other methods need a checkpoint already in that format. ValueError names the field (and the spelling
    given) and what is supported."""
    from asyncengine.quantization.cpu_int8 import Int8Config
    from asyncengine.quantization.fp8 import Fp8Config

    given, requested = requested, check_quantization_name(requested)
    if checkpoint_cfg is None:
        if requested is None:
            return None
        if requested == "fp8":
            return Fp8Config.online()
        if requested == "int8":
            return Int8Config()
        raise ValueError(f"quantization {given!r} needs a checkpoint quantized in that format (its config.json "
                         "has no quantization_config); an unquantized checkpoint can be quantized at load time with "
                         "quantization 'fp8' (or 'int8' on CPU)")
    config = _from_checkpoint(checkpoint_cfg)
    if requested is not None and requested != config.name:
        raise ValueError(f"quantization {given!r} does not match the checkpoint's quantization_config "
                         f"(quant_method {config.name!r}); leave it unset or give {config.name!r}")
    return config

"""How a linear layer stores and applies its weight: unquantized today; quantized formats plug in here."""

from asyncengine.quantization.base import LinearMethod, UnquantizedLinearMethod, set_weight_attrs

__all__ = ["LinearMethod", "UnquantizedLinearMethod", "set_weight_attrs"]

"""Weight quantization of the linear layers (FP8 on Hopper/Ada, weight-only int8 on CPU).

config.py resolves one QuantConfig per model; base.py is the hook the linear layers call; methods.py the
quantized methods; fp8_linear.py their FP8 GEMMs; fp8_math.py the math in plain PyTorch (reference and CPU);
fp8_ops.py the Triton kernels.
"""

from model_executor.layers.quantization.base import (
    UNQUANTIZED,
    LinearMethod,
    current_quant_config,
    finish_loading,
    quantization_context,
    restore_kept_dtypes,
)
from model_executor.layers.quantization.config import (
    KV_CACHE_DTYPES,
    QUANTIZATION_CHOICES,
    QuantConfig,
    QuantizationError,
    checkpoint_quant_config,
    resolve_quant_config,
)


def current_linear_method() -> LinearMethod:
    """The method of a linear layer built now: that of the QuantConfig being built (quantization_context),
    unquantized without one. The quantized methods (methods.py, and with FP8 its kernels and Triton) are
    imported with the first quantized model."""
    quant = current_quant_config()
    if quant is None:
        return UNQUANTIZED
    from model_executor.layers.quantization.methods import method_for

    return method_for(quant)


__all__ = [
    "KV_CACHE_DTYPES",
    "QUANTIZATION_CHOICES",
    "LinearMethod",
    "QuantConfig",
    "QuantizationError",
    "checkpoint_quant_config",
    "current_linear_method",
    "finish_loading",
    "quantization_context",
    "resolve_quant_config",
    "restore_kept_dtypes",
]

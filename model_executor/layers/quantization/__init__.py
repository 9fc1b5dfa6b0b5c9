"""Weight quantization of the linear layers (FP8 on Hopper/Ada, weight-only int8 on CPU).

config.py resolves one QuantConfig per model; base.py is the hook the linear layers call; methods.py the
quantized methods; fp8_math.py the math in plain PyTorch (reference and CPU); fp8_ops.py the Triton kernels.
"""

from model_executor.layers.quantization.base import (
    LinearMethod,
    current_linear_method,
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

"""The quantized LinearMethods: online FP8, pre-quantized FP8 (block-wise, per-channel/per-tensor), int8.

The FP8 GEMMs (fp8_linear.py) run on CUDA (sm89+): torch._scaled_mm with row-wise scales, or the Triton
block-scaled GEMM, their activations quantized inside the RMSNorm or SiLU-and-mul kernel before them where one
makes the input; decode-sized batches instead run the weight-only small-M kernel (triton_ops/small_m_gemm.py:
x stays in the model dtype, the FP8 weight is dequantized in the kernel), which reads the weight once and
skips the activation quantization. On the CPU they compute `fp8_linear_reference` (the same quantized math in
float32): the CPU tests load and run FP8 models through it, while the server refuses FP8 on a CPU
(config.check_device).
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from model_executor.layers.norm import PrenormedRow
from model_executor.layers.quantization import fp8_math
from model_executor.layers.quantization.base import (
    LinearMethod,
    copy_into,
    rows,
    set_kept_dtype,
)
from model_executor.layers.quantization.config import QuantConfig, QuantizationError
from model_executor.layers.quantization.fp8_linear import (
    fp8_linear,
    fp8_rmsnorm_linear,
    fp8_silu_and_mul_linear,
)

FP8 = fp8_math.FP8_DTYPE


def _fp8_weight(layer: nn.Module, input_size: int, output_size: int, load_dtype: torch.dtype) -> None:
    layer.weight = nn.Parameter(torch.empty(output_size, input_size, dtype=FP8), requires_grad=False)
    layer.weight.weight_loader = layer.weight_loader
    layer.weight.load_dtype = load_dtype
    set_kept_dtype(layer, "weight", FP8)


class _Fp8InputFusion:
    """FP8 methods with dynamic activation scales: at the W8A8 path's row counts the activations are quantized
    inside the RMSNorm or SiLU-and-mul kernel that makes the GEMM's input (fp8_linear.fp8_rmsnorm_linear,
    fp8_silu_and_mul_linear), one launch fewer each. Decode-sized rows keep the small-M GEMVs' fusions."""

    dynamic_activations = True

    def apply_rmsnorm(self, layer, x, norm_weight, eps, residual, rope=None):
        fused = super().apply_rmsnorm(layer, x, norm_weight, eps, residual, rope)
        if fused is not None or rope is not None:
            return fused
        return self.apply_rmsnorm_quant(layer, x, norm_weight, eps, residual)

    def apply_rmsnorm_quant(self, layer, x, norm_weight, eps, residual):
        if not self.dynamic_activations or isinstance(x, PrenormedRow):
            return None
        weight, scale, block = self.small_m_operands(layer)
        return fp8_rmsnorm_linear(x, residual, norm_weight, eps, weight, scale, layer.bias, block)

    def apply_gated(self, layer, gate_up):
        if not self.dynamic_activations:
            return None
        weight, scale, block = self.small_m_operands(layer)
        return fp8_silu_and_mul_linear(gate_up, weight, scale, layer.bias, block)


class _QuantizeOnLoad(LinearMethod):
    """Weights quantized per output channel as each checkpoint shard arrives (`quantize` gives the quantized
    rows and their scales); the scales are a buffer. Random weights for benchmarks take the same path."""

    quantize = None  # staticmethod: float rows -> (quantized rows, per-row scales)

    def load(self, layer, param, loaded, offset, size):
        if param is not layer.weight:
            return super().load(layer, param, loaded, offset, size)
        dst = rows(param, offset, size)
        if dst.shape != loaded.shape:
            raise ValueError(f"shape mismatch: parameter {tuple(dst.shape)} vs checkpoint {tuple(loaded.shape)}")
        q, scale = self.quantize(loaded.to(param.device))
        dst.copy_(q)
        rows(layer.weight_scale, offset, size).copy_(scale)

    def init_random(self, layer, generator, std):
        w = layer.weight
        full = torch.empty(w.shape, dtype=w.load_dtype, device=w.device).normal_(0.0, std, generator=generator)
        self.load(layer, w, full, 0, w.shape[0])
        return {"weight"}


class Fp8OnlineMethod(_Fp8InputFusion, _QuantizeOnLoad):
    """A bf16 checkpoint quantized as it loads: each shard's rows get per-output-channel scales, on the
    device, as the shard arrives (peak memory: the FP8 weights plus one shard and its float32 copy)."""

    quantize = staticmethod(fp8_math.quantize_fp8_per_channel)

    def create_weights(self, layer, input_size, output_size, bias):
        _fp8_weight(layer, input_size, output_size, load_dtype=torch.bfloat16)
        layer.register_buffer("weight_scale", torch.empty(output_size, dtype=torch.float32))
        set_kept_dtype(layer, "weight_scale", torch.float32)
        self._create_bias(layer, output_size, bias)

    def apply(self, layer, x):
        return fp8_linear(x, layer.weight, layer.weight_scale, layer.bias)

    def small_m_operands(self, layer):
        return layer.weight, layer.weight_scale, None


class Fp8ChannelMethod(_Fp8InputFusion, LinearMethod):
    """A pre-quantized checkpoint with `weight_scale` per output channel ([N, 1]) or per tensor ([] / [1]),
    kept per channel here ([N]: fused q/k/v or gate/up shards keep their own scales), and an optional
    static per-tensor `input_scale` (fused shards share the largest)."""

    def __init__(self, quant: QuantConfig):
        self.static_input_scale = quant.static_input_scale

    @property
    def dynamic_activations(self) -> bool:
        return not self.static_input_scale

    def create_weights(self, layer, input_size, output_size, bias):
        _fp8_weight(layer, input_size, output_size, load_dtype=FP8)
        layer.weight_scale = nn.Parameter(torch.empty(output_size, dtype=torch.float32), requires_grad=False)
        layer.weight_scale.weight_loader = layer.weight_loader
        layer.weight_scale.load_dtype = torch.float32
        set_kept_dtype(layer, "weight_scale", torch.float32)
        if self.static_input_scale:
            layer.input_scale = nn.Parameter(torch.empty(1, dtype=torch.float32), requires_grad=False)
            layer.input_scale.weight_loader = layer.weight_loader
            layer.input_scale.load_dtype = torch.float32
            set_kept_dtype(layer, "input_scale", torch.float32)
        self._create_bias(layer, output_size, bias)

    def load(self, layer, param, loaded, offset, size):
        if param is getattr(layer, "input_scale", None):
            if loaded.numel() != 1:
                raise ValueError(f"input_scale must hold one value, the checkpoint has {tuple(loaded.shape)}")
            loaded = loaded.reshape(1).to(param.device)
            if layer.__dict__.get("input_scale_loaded"):  # fused shards: the largest scale covers them all
                loaded = torch.maximum(param.data, loaded)
            param.data.copy_(loaded)
            layer.input_scale_loaded = True
            return
        if param is layer.weight_scale:
            flat = loaded.reshape(-1)
            if flat.numel() == 1:  # per tensor: every row of this shard gets it
                flat = flat.expand(size)
            elif flat.numel() != size or (loaded.dim() == 2 and loaded.shape[1] != 1):
                raise ValueError(f"shape mismatch: weight_scale rows {size} vs checkpoint {tuple(loaded.shape)}")
            return copy_into(rows(param, offset, size), flat)
        return super().load(layer, param, loaded, offset, size)

    def apply(self, layer, x):
        return fp8_linear(x, layer.weight, layer.weight_scale, layer.bias, getattr(layer, "input_scale", None))

    def small_m_operands(self, layer):  # (weight-only at one row, as fp8_linear: no input_scale)
        return layer.weight, layer.weight_scale, None

    def init_random(self, layer, generator, std):
        w = _random_like(layer.weight, generator, std)
        q, scale = fp8_math.quantize_fp8_per_channel(w)
        layer.weight.data.copy_(q)
        layer.weight_scale.data.copy_(scale)
        if self.static_input_scale:  # activations of a random model: about unit scale per element
            layer.input_scale.data.fill_(8.0 / fp8_math.FP8_MAX)
        return {"weight", "weight_scale", "input_scale"}


def _random_like(w: torch.Tensor, generator: torch.Generator, std: float) -> torch.Tensor:
    return torch.empty(w.shape, dtype=torch.bfloat16, device=w.device).normal_(0.0, std, generator=generator)


class Fp8BlockMethod(_Fp8InputFusion, LinearMethod):
    """A pre-quantized checkpoint with block-wise scales: `weight_scale_inv` [ceil(N / bn), ceil(K / bk)]
    multiplies each bn x bk tile; activations are quantized per token and group of bk columns."""

    def __init__(self, quant: QuantConfig):
        self.block = quant.block

    def create_weights(self, layer, input_size, output_size, bias):
        bn, bk = self.block
        if input_size % bk:
            raise QuantizationError(f"block-wise FP8: a linear layer's input size {input_size} is not a multiple "
                                    f"of the block {bk}")
        _fp8_weight(layer, input_size, output_size, load_dtype=FP8)
        layer.weight_scale_inv = nn.Parameter(torch.empty(-(-output_size // bn), input_size // bk,
                                                          dtype=torch.float32), requires_grad=False)
        layer.weight_scale_inv.weight_loader = layer.weight_loader
        layer.weight_scale_inv.load_dtype = torch.float32
        set_kept_dtype(layer, "weight_scale_inv", torch.float32)
        self._create_bias(layer, output_size, bias)

    def load(self, layer, param, loaded, offset, size):
        if param is layer.weight_scale_inv:
            bn = self.block[0]
            if offset % bn:  # a tile would straddle two checkpoint tensors
                raise ValueError(f"block-wise FP8: fused shard at row {offset} is not aligned to the block {bn}")
            return copy_into(rows(param, offset // bn, -(-size // bn)), loaded)
        return super().load(layer, param, loaded, offset, size)

    def apply(self, layer, x):
        return fp8_linear(x, layer.weight, layer.weight_scale_inv, layer.bias, block=self.block)

    def small_m_operands(self, layer):
        return layer.weight, layer.weight_scale_inv, self.block

    def init_random(self, layer, generator, std):
        q, scale = fp8_math.quantize_fp8_block(_random_like(layer.weight, generator, std), self.block)
        layer.weight.data.copy_(q)
        layer.weight_scale_inv.data.copy_(scale)
        return {"weight", "weight_scale_inv"}


class Int8WeightOnlyMethod(_QuantizeOnLoad):
    """CPU weight-only int8: int8 weights with per-output-channel scales, quantized as they load; the GEMM
    is ATen's `_weight_int8pack_mm` on bfloat16 activations (fp8_math.int8_weight_only_mm: the kernel is
    vectorized for those only), its output cast back to the model dtype."""

    quantize = staticmethod(functools.partial(fp8_math.quantize_int8_per_channel,
                                              scale_dtype=fp8_math.INT8_COMPUTE_DTYPE))

    def create_weights(self, layer, input_size, output_size, bias):
        layer.weight = nn.Parameter(torch.empty(output_size, input_size, dtype=torch.int8), requires_grad=False)
        layer.weight.weight_loader = layer.weight_loader
        layer.weight.load_dtype = torch.float32  # quantized from float32 whatever the checkpoint dtype
        set_kept_dtype(layer, "weight", torch.int8)
        layer.register_buffer("weight_scale", torch.empty(output_size))
        set_kept_dtype(layer, "weight_scale", fp8_math.INT8_COMPUTE_DTYPE)  # the kernel's rule: x's dtype
        self._create_bias(layer, output_size, bias)

    def apply(self, layer, x):
        x2 = x.reshape(-1, x.shape[-1])
        out = fp8_math.int8_weight_only_mm(x2, layer.weight, layer.weight_scale)
        if layer.bias is not None:
            out = out + layer.bias
        return out.reshape(*x.shape[:-1], out.shape[-1])

    def small_m_operands(self, layer):
        return None  # (its own weight-only GEMM: no fused one-row paths)


class Int4WeightOnlyMethod(LinearMethod):
    """CPU weight-only int4: asymmetric codes with a bfloat16 scale and zero per group of INT4_GROUP input
    columns (fp8_math.quantize_int4_groups), quantized as each shard loads; the GEMM is ATen's
    `_weight_int4pack_mm_for_cpu` on bfloat16 activations. Its packed layout interleaves blocks of output
    rows, so the codes load unpacked (a byte each) and are packed once all shards are in (finish_loading)."""

    def create_weights(self, layer, input_size, output_size, bias):
        group = fp8_math.INT4_GROUP
        if input_size % group or output_size % 16:
            raise QuantizationError(f"--quantization int4: a linear layer of {input_size} inputs and {output_size} "
                                    f"outputs does not fit the kernel (inputs a multiple of {group}, outputs "
                                    "of 16); use int8")
        layer.weight = nn.Parameter(torch.empty(output_size, input_size, dtype=torch.uint8), requires_grad=False)
        layer.weight.weight_loader = layer.weight_loader
        layer.weight.load_dtype = torch.float32
        set_kept_dtype(layer, "weight", torch.uint8)
        layer.register_buffer("weight_scale_zero", torch.empty(input_size // group, output_size, 2))
        set_kept_dtype(layer, "weight_scale_zero", fp8_math.INT8_COMPUTE_DTYPE)
        self._create_bias(layer, output_size, bias)

    def load(self, layer, param, loaded, offset, size):
        if param is not layer.weight:
            return super().load(layer, param, loaded, offset, size)
        if layer.__dict__.get("int4_packed"):
            raise ValueError("int4 weights are packed: they load once")
        dst = rows(param, offset, size)
        if dst.shape != loaded.shape:
            raise ValueError(f"shape mismatch: parameter {tuple(dst.shape)} vs checkpoint {tuple(loaded.shape)}")
        codes, scales_and_zeros = fp8_math.quantize_int4_groups(loaded.to(param.device))
        dst.copy_(codes)
        layer.weight_scale_zero.narrow(1, offset, size).copy_(scales_and_zeros)

    def finish_loading(self, layer):
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(layer.weight.to(torch.int32), 1)
        layer.weight = nn.Parameter(packed, requires_grad=False)
        layer.int4_packed = True

    def init_random(self, layer, generator, std):
        w = layer.weight
        full = torch.empty(w.shape, dtype=torch.float32, device=w.device).normal_(0.0, std, generator=generator)
        self.load(layer, w, full, 0, w.shape[0])
        return {"weight"}

    def apply(self, layer, x):
        x2 = x.reshape(-1, x.shape[-1])
        out = fp8_math.int4_weight_only_mm(x2, layer.weight, layer.weight_scale_zero)
        if layer.bias is not None:
            out = out + layer.bias
        return out.reshape(*x.shape[:-1], out.shape[-1])

    def small_m_operands(self, layer):
        return None  # (its own weight-only GEMM: no fused one-row paths)


@functools.cache
def method_for(quant: QuantConfig) -> LinearMethod:
    if quant.method == "fp8":
        return Fp8OnlineMethod()
    if quant.method == "fp8_channel":
        return Fp8ChannelMethod(quant)
    if quant.method == "fp8_block":
        return Fp8BlockMethod(quant)
    if quant.method == "int8":
        return Int8WeightOnlyMethod()
    if quant.method == "int4":
        return Int4WeightOnlyMethod()
    raise ValueError(f"unknown quantization method {quant.method!r}")

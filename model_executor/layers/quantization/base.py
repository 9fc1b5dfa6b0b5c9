"""The per-linear quantization hook: a LinearMethod creates a layer's tensors, loads checkpoint shards
into them, and runs its GEMM. The linear classes (layers/linear.py) call it and know nothing else.

Parameters are what the checkpoint holds (each with the layer's `weight_loader`); what is derived at load
time (online quantization's scales) is a buffer, so the checkpoint-completeness check never asks for it.
`load_dtype` on a parameter is the dtype its checkpoint tensor is converted to before the loader sees it
(online quantization gets the model dtype and quantizes itself).

Decode-sized GEMMs run the small-M kernel (triton_ops/small_m_gemm.py) where small_m_gemm_dispatch.py says
they do; the small_m_* functions below launch it for the methods and the layers. The quantized methods and the
method a layer being built gets (current_linear_method) are in methods.py.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from model_executor.layers.norm import PrenormedRow
from model_executor.layers.triton_ops import small_m_gemm_dispatch as dispatch

if TYPE_CHECKING:
    from model_executor.layers.rotary_store_kv import RopeStore


def copy_into(param: torch.Tensor, loaded: torch.Tensor) -> None:
    if param.shape != loaded.shape:
        raise ValueError(f"shape mismatch: parameter {tuple(param.shape)} vs checkpoint {tuple(loaded.shape)}")
    param.data.copy_(loaded)


def rows(t: torch.Tensor, offset: int, size: int) -> torch.Tensor:
    """Output rows offset .. offset + size of a weight-like tensor (the whole tensor when that is all)."""
    if offset == 0 and size == t.shape[0]:
        return t.data
    return t.data.narrow(0, offset, size)


class LinearMethod:
    """Unquantized: a [out, in] weight in the model dtype and F.linear."""

    def create_weights(self, layer: nn.Module, input_size: int, output_size: int, bias: bool) -> None:
        layer.weight = nn.Parameter(torch.empty(output_size, input_size), requires_grad=False)
        layer.weight.weight_loader = layer.weight_loader
        self._create_bias(layer, output_size, bias)

    @staticmethod
    def _create_bias(layer: nn.Module, output_size: int, bias: bool) -> None:
        if bias:
            layer.bias = nn.Parameter(torch.empty(output_size), requires_grad=False)
            layer.bias.weight_loader = layer.weight_loader
        else:
            layer.register_parameter("bias", None)

    def load(self, layer: nn.Module, param: nn.Parameter, loaded: torch.Tensor, offset: int, size: int) -> None:
        """Copy checkpoint tensor `loaded` (already sharded for this rank) into output rows offset .. offset +
        size of `param` (ValueError on a shape mismatch)."""
        copy_into(rows(param, offset, size), loaded)

    def init_random(self, layer: nn.Module, generator: torch.Generator, std: float) -> set[str]:
        """Random weights for benchmarks: the names of the parameters it filled (the generic init fills the
        rest)."""
        return set()

    def finish_loading(self, layer: nn.Module) -> None:
        """After every shard is in: the last step of a layout that cannot be built shard by shard."""

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        kernel = small_m_kernel(x, layer.weight)
        if kernel is not None:
            out = kernel.small_m_linear(x.reshape(-1, x.shape[-1]), layer.weight, bias=layer.bias)
            return out.reshape(*x.shape[:-1], out.shape[-1])
        return F.linear(x, layer.weight, layer.bias)

    def small_m_operands(self, layer: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None,
                                                          tuple[int, int] | None] | None:
        """The layer's weight, scale and scale block as the small-M kernel takes them, or None for a method
        with a GEMM of its own (no fused one-row paths then)."""
        return layer.weight, None, None

    def apply_silu_and_mul(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor | None:
        """silu(gate) * up of a [gate; up] layer in one kernel where the small-M kernel can (up to 16 decode rows,
        a table config that fuses), else None: the caller runs apply and SiluAndMul."""
        operands = self.small_m_operands(layer)
        return None if operands is None else small_m_silu_and_mul(x, *operands, layer.bias)

    def apply_gated(self, layer: nn.Module, gate_up: torch.Tensor) -> torch.Tensor | None:
        """apply(layer, silu(gate) * up) for gate_up = [gate; up] where the method makes the GEMM's input in the
        activation's kernel (FP8's activation quantization), else None: the caller runs SiluAndMul, then apply."""
        return None

    def rope_config(self, layer: nn.Module, x: torch.Tensor):
        """The small-M kernel's config for apply_rope at these rows (a plain tensor) of a qkv layer, or None."""
        operands = self.small_m_operands(layer)
        return None if operands is None else small_m_paired_config(x, operands[0], operands[2])

    def apply_rope(self, layer: nn.Module, x: torch.Tensor, rope: RopeStore, config) -> torch.Tensor:
        """apply(layer, x) for normed rows x of a qkv layer with the rotary and KV store in the same kernel
        (small_m_gemm.small_m_rope_linear), at rope_config(layer, x): the rows' norm ran as its own kernel."""
        weight, scale, block = self.small_m_operands(layer)
        k = x.shape[-1]
        y = _small_m().small_m_rope_linear(x.reshape(-1, k), weight, rope, scale, layer.bias, block, config)
        return y.reshape(*x.shape[:-1], y.shape[-1])

    def apply_rmsnorm_quant(self, layer: nn.Module, x: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                            residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor] | None:
        """apply_rmsnorm's (y, h) where the method makes the GEMM's input in the norm's kernel (FP8's activation
        quantization, at rows above the small-M kernel's), else None."""
        return None

    def apply_rmsnorm(self, layer: nn.Module, x: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                      residual: torch.Tensor | None,
                      rope: RopeStore | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(apply(norm_weight * rmsnorm(h)), h) for h = x + residual (x without one) in one kernel where the
        small-M kernel can (up to 4 decode rows, a table config that fuses; a PrenormedRow x up to 16), else
        None: the caller runs RMSNorm, then the layer. rope (a qkv layer): the same kernel also runs the rotary
        and KV store. x may be a PrenormedRow (residual: its h): the kernel before did the norm's sums."""
        operands = self.small_m_operands(layer)
        if operands is None:
            return None
        return small_m_rmsnorm_linear(x, norm_weight, eps, residual, *operands, layer.bias, rope)


_small_m_module = None


def _small_m():
    """The small-M kernel's module, imported (with Triton) at the first GEMM that runs it, never on a CPU path."""
    global _small_m_module
    if _small_m_module is None:
        from model_executor.layers.triton_ops import small_m_gemm

        _small_m_module = small_m_gemm
    return _small_m_module


def small_m_act_quant(xq: torch.Tensor, weight: torch.Tensor, block: tuple[int, int] | None = None):
    """(small_m_gemm, its X_FP8 config) where the W8A8 GEMM of FP8 rows xq [M, K] with an FP8 weight
    (per-channel, or `block` scales) runs the small-M kernel on FP8 tensor cores
    (small_m_gemm_dispatch.act_quant_kernel_config), else None."""
    cfg = dispatch.act_quant_kernel_config(xq, weight, block)
    return None if cfg is None else (_small_m(), cfg)


def small_m_kernel(x: torch.Tensor, weight: torch.Tensor, block: tuple[int, int] | None = None):
    """The small_m_gemm module where this GEMM (x [..., K] rows times `weight`) runs it
    (small_m_gemm_dispatch.takes_kernel), else None."""
    return _small_m() if dispatch.takes_kernel(x, weight, block) else None


def _rows_kernel(x: torch.Tensor, weight: torch.Tensor, block: tuple[int, int] | None):
    """small_m_kernel for the fused paths' rows (small_m_gemm_dispatch.takes_fused_rows), else None."""
    return _small_m() if dispatch.takes_fused_rows(x, weight, block) else None


def small_m_paired_config(x: torch.Tensor, weight: torch.Tensor, block: tuple[int, int] | None):
    """The small-M kernel's config for these rows x [..., K] of this weight where it fuses and pairs its rows
    (the rotary epilogue's; small_m_gemm_dispatch.paired_config), else None."""
    if not dispatch.takes_fused_rows(x, weight, block):
        return None
    return dispatch.paired_config(x.reshape(-1, x.shape[-1]), weight, block)


def small_m_silu_and_mul(x: torch.Tensor | PrenormedRow, weight: torch.Tensor, scale: torch.Tensor | None,
                         block: tuple[int, int] | None, bias: torch.Tensor | None) -> torch.Tensor | None:
    """The fused gate/up GEMM + SiLU-and-mul (small_m_gemm.small_m_silu_and_mul) for up to dispatch.MAX_FUSED_ROWS
    rows x [..., K] (or a PrenormedRow) where the small-M kernel runs this weight; None otherwise (and with a
    bias, which it does not add)."""
    prenormed = isinstance(x, PrenormedRow)
    kernel = _rows_kernel(x.weighted if prenormed else x, weight, block) if bias is None else None
    if kernel is None:
        return None
    if prenormed:  # (its rows are already [M, K], and so are the output's)
        return kernel.small_m_silu_and_mul(x, weight, scale, block)
    out = kernel.small_m_silu_and_mul(x.reshape(-1, x.shape[-1]), weight, scale, block)
    return None if out is None else out.reshape(*x.shape[:-1], out.shape[-1])


def small_m_rmsnorm_linear(x: torch.Tensor, norm_weight: torch.Tensor, eps: float, residual: torch.Tensor | None,
                           weight: torch.Tensor, scale: torch.Tensor | None, block: tuple[int, int] | None,
                           bias: torch.Tensor | None,
                           rope: RopeStore | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """RMSNorm (and residual add) fused into the GEMV it feeds (small_m_gemm.small_m_rmsnorm_linear) for
    up to dispatch.MAX_GEMV_ROWS rows x [..., K] where the small-M kernel runs this weight as a GEMV; None
    otherwise. x may be a PrenormedRow (residual is then its h, returned as it is; up to dispatch.MAX_FUSED_ROWS rows,
    a config that fuses): the GEMM scales the row the kernel before prepared."""
    if isinstance(x, PrenormedRow):
        kernel = _rows_kernel(x.weighted, weight, block)
        y = None if kernel is None else kernel.small_m_prenormed_linear(x, weight, scale, bias, block, rope=rope)
        return None if y is None else (y, residual)
    kernel = _rows_kernel(x, weight, block)
    if kernel is None or (residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype
                                                    or not residual.is_contiguous())):
        return None
    k = x.shape[-1]
    out = kernel.small_m_rmsnorm_linear(x.reshape(-1, k), norm_weight, eps,
                                        None if residual is None else residual.reshape(-1, k),
                                        weight, scale, bias, block, rope=rope)
    if out is None:
        return None
    y, h = out
    return y.reshape(*x.shape[:-1], y.shape[-1]), h.reshape(x.shape)


def small_m_linear_add_rmsnorm(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None,
                               block: tuple[int, int] | None, bias: torch.Tensor | None, residual: torch.Tensor,
                               norm_weight: torch.Tensor, eps: float, consumer: torch.Tensor,
                               consumer_block: tuple[int, int] | None,
                               after_attention: bool = False) -> tuple[PrenormedRow, torch.Tensor] | None:
    """(rows, h) for h = x @ weight^T (+ bias) + residual at up to dispatch.MAX_FUSED_ROWS rows x [..., K], from the
    GEMM's epilogue (small_m_gemm.small_m_linear_add_rmsnorm), where the table's config for this weight fuses
    (small_m_gemm_dispatch.fused_config) and can feed `rows` to the GEMM of `consumer` (the weight norm(h) goes into); None
    otherwise. after_attention: x is decode attention's output (at one row, where all of K fits one tile, the
    GEMV loads its weights while attention runs)."""
    kernel = _rows_kernel(x, weight, block)
    if kernel is None or residual.shape != (*x.shape[:-1], weight.shape[0]) or residual.dtype != x.dtype \
            or not residual.is_contiguous():
        return None
    residual2 = residual.reshape(-1, weight.shape[0])
    if not dispatch.takes_prenormed(residual2, consumer, consumer_block):
        return None
    out = kernel.small_m_linear_add_rmsnorm(x.reshape(-1, x.shape[-1]), weight, scale, bias, block, residual2,
                                            norm_weight, eps, after_attention=after_attention)
    return None if out is None else (out[0], out[1].reshape(residual.shape))


def finish_loading(model: nn.Module) -> None:
    """Each quantized layer's finish_loading, once the checkpoint (or random init) has filled the model."""
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if method is not None:
            method.finish_loading(module)


UNQUANTIZED = LinearMethod()
_current: list = [None]  # the QuantConfig of the model being built (None: unquantized)


@contextlib.contextmanager
def quantization_context(quant) -> Iterator[None]:
    """Linear layers built inside get their method from `quant` (weight_loader.build_meta_model uses it)."""
    previous, _current[0] = _current[0], quant
    try:
        yield
    finally:
        _current[0] = previous


def current_quant_config():
    """The QuantConfig of the model being built (None: unquantized); for layers other than the linears
    (the vocabulary layers, MoE experts)."""
    return _current[0]


def set_kept_dtype(layer: nn.Module, name: str, dtype: torch.dtype) -> None:
    """Record that tensor `name` of `layer` stays in `dtype` when the model is cast to its dtype."""
    if "kept_dtypes" not in layer.__dict__:
        layer.kept_dtypes = {}
    layer.kept_dtypes[name] = dtype


def restore_kept_dtypes(model: nn.Module) -> None:
    """After `model.to(dtype)` on the meta device: give quantized tensors their own dtype back (the cast
    turned fp8 weights and float32 scales into the model dtype). Parameters keep their attributes and their
    sharing (a tied int8 vocabulary table stays one parameter)."""
    new_params: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, dtype in getattr(module, "kept_dtypes", {}).items():
            if name in module._parameters:
                old = module._parameters[name]
                if id(old) not in new_params:
                    new = nn.Parameter(torch.empty(old.shape, dtype=dtype, device=old.device), requires_grad=False)
                    new.__dict__.update(old.__dict__)
                    new_params[id(old)] = new
                module._parameters[name] = new_params[id(old)]
            elif name in module._buffers:
                old = module._buffers[name]
                module._buffers[name] = torch.empty(old.shape, dtype=dtype, device=old.device)

"""The FP8 linear ops: the path for a GEMM's rows, and the W8A8 GEMM whose activation quantization runs in the
kernel before it (RMSNorm, SiLU-and-mul).

    fp8_linear(x, weight, scale, bias, input_scale, block)                  -> x @ W^T
    fp8_rmsnorm_linear(x, residual, norm_weight, eps, weight, scale, bias, block)
                                                                            -> (linear(norm(h)), h) or None
    fp8_silu_and_mul_linear(gate_up, weight, scale, bias, block)          -> linear(silu_and_mul(gate_up)) or None

Up to 16 rows (small_m_gemm_dispatch.py: up to 64 where its table says so) a linear runs the weight-only small-M
kernel: x stays in the model dtype. Above, with dynamic activation scales (per token, or per 1 x block_k group
for block-wise weights), the activations are quantized and a W8A8 GEMM runs: torch._scaled_mm or the Triton
block-scaled GEMM, or up to 64 rows, where the table has an X_FP8 entry, the small-M kernel on FP8 operands
(small_m_gemm.small_m_linear_fp8_act). A quantization kernel of its own is a launch per GEMM, whatever the
batch (docs/benchmarks.md): the fused variants quantize in the RMSNorm / SiLU-and-mul kernel that makes the
GEMM's input (fp8_ops.rmsnorm_quant_fp8, silu_and_mul_quant_fp8), with the same bits. They return None where
they do not run (decode-sized rows, a CPU, a static input scale, other dtypes, rows too wide for the one-pass
kernels): the caller then runs the norm or the activation, then fp8_linear.

Each is a `duet::` custom op while dynamo traces (the piecewise runner): a traced branch on the symbolic row
count would fix one path for every size, and a padded small batch in a graph would then compute differently
from the same batch run eagerly. So the op picks its path on its real row count when it runs.
"""

from __future__ import annotations

import torch

from model_executor.layers import triton_ops
from model_executor.layers.quantization import fp8_math
from model_executor.layers.quantization.base import small_m_act_quant, small_m_kernel

try:  # the FP8 GPU kernels (Triton is optional: a CPU install never runs FP8, see config.check_device)
    from model_executor.layers.quantization import fp8_ops
except ImportError:
    fp8_ops = None

FP8 = fp8_math.FP8_DTYPE
# Devices where the fused activation quantization runs (tests add "cpu": Triton's interpreter, torch's CPU
# _scaled_mm).
FUSED_QUANT_DEVICES = ("cuda",)


def _w8a8(xq: torch.Tensor, xs: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
          block: tuple[int, int] | None, out_dtype: torch.dtype) -> torch.Tensor:
    """The GEMM of quantized activations (xq, scales xs per token or per 1 x block_k group) and an FP8 weight."""
    if (small_m := small_m_act_quant(xq, weight, block)) is not None:  # up to 64 rows where its table says so
        kernel, cfg = small_m
        return kernel.small_m_linear_fp8_act(xq, xs, weight, scale, bias, out_dtype, cfg, block)
    if block is not None:
        out = fp8_ops.w8a8_block_fp8_matmul(xq, weight, xs, scale, block, out_dtype)
    else:  # fp8 [M, K] x fp8 weight [N, K]^T with scales [M, 1] and [N] (sm89+)
        out = torch._scaled_mm(xq, weight.t(), scale_a=xs, scale_b=scale.view(1, -1), out_dtype=out_dtype)
    return out if bias is None else out + bias


def _fp8_linear_impl(x2: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                     input_scale: torch.Tensor | None, block_n: int, block_k: int) -> torch.Tensor:
    """x2 [M, K] @ an FP8 weight [N, K] (scales per channel [N], or per (block_n, block_k) tile) -> [M, N].

    The path is chosen on x2's real row count: the weight-only small-M kernel for decode-sized M, else the
    activations are quantized (per token, per 1 x block_k group, or by a static per-tensor `input_scale`)
    for a W8A8 GEMM; on a CPU the same math in float32."""
    block = (block_n, block_k) if block_n else None
    kernel = small_m_kernel(x2, weight, block)
    if kernel is not None:  # decode-sized: weight-only FP8 (x stays in its dtype, no activation quantization)
        return kernel.small_m_linear(x2, weight, scale, bias, block)
    if not x2.is_cuda:
        return fp8_math.fp8_linear_reference(x2, weight, scale, bias, block=block, input_scale=input_scale)
    if block is None and input_scale is not None:
        xq = (x2 / input_scale).clamp(-fp8_math.FP8_MAX, fp8_math.FP8_MAX).to(FP8)
        xs = input_scale.view(1, 1).expand(x2.shape[0], 1).contiguous()
    else:
        xq, xs = fp8_ops.per_token_group_quant_fp8(x2, block_k or x2.shape[-1])
    return _w8a8(xq, xs, weight, scale, bias, block, x2.dtype)


_fp8_linear_op = torch.library.custom_op("duet::fp8_linear", _fp8_linear_impl, mutates_args=())


@_fp8_linear_op.register_fake
def _(x2, weight, scale, bias, input_scale, block_n, block_k):
    return x2.new_empty((x2.shape[0], weight.shape[0]))


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
               input_scale: torch.Tensor | None = None, block: tuple[int, int] | None = None) -> torch.Tensor:
    x2 = x.reshape(-1, x.shape[-1])
    op = torch.ops.duet.fp8_linear if torch.compiler.is_compiling() else _fp8_linear_impl
    out = op(x2, weight, scale, bias, input_scale, *(block or (0, 0)))
    return out.reshape(*x.shape[:-1], out.shape[-1])


def _quantizes_rows(x2: torch.Tensor, weight: torch.Tensor, block: tuple[int, int] | None) -> bool:
    """Whether _fp8_linear_impl would quantize x2's rows dynamically (the W8A8 path: not decode-sized)."""
    return small_m_kernel(x2, weight, block) is None


def _fp8_rmsnorm_linear_impl(x2: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor,
                             eps: float, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                             block_n: int, block_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(linear(norm_weight * rmsnorm(h)), h) for h = x2 + residual; h is empty without a residual."""
    block = (block_n, block_k) if block_n else None
    if _quantizes_rows(x2, weight, block):
        xq, xs, h = fp8_ops.rmsnorm_quant_fp8(x2, residual, norm_weight, eps, block_k or x2.shape[-1])
        return _w8a8(xq, xs, weight, scale, bias, block, x2.dtype), (x2.new_empty(0) if h is None else h)
    normed = triton_ops.rmsnorm(x2, norm_weight, eps, residual)
    normed, h = normed if residual is not None else (normed, x2.new_empty(0))
    return _fp8_linear_impl(normed, weight, scale, bias, None, block_n, block_k), h


_fp8_rmsnorm_linear_op = torch.library.custom_op("duet::fp8_rmsnorm_linear", _fp8_rmsnorm_linear_impl,
                                                 mutates_args=())


@_fp8_rmsnorm_linear_op.register_fake
def _(x2, residual, norm_weight, eps, weight, scale, bias, block_n, block_k):
    return x2.new_empty((x2.shape[0], weight.shape[0])), x2.new_empty(x2.shape if residual is not None else (0,))


def _fp8_silu_and_mul_linear_impl(x2: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                                  bias: torch.Tensor | None, block_n: int, block_k: int) -> torch.Tensor:
    """linear(silu(x2[:, :I]) * x2[:, I:])."""
    block = (block_n, block_k) if block_n else None
    if _quantizes_rows(x2[:, : x2.shape[-1] // 2], weight, block):
        xq, xs = fp8_ops.silu_and_mul_quant_fp8(x2, block_k or x2.shape[-1] // 2)
        return _w8a8(xq, xs, weight, scale, bias, block, x2.dtype)
    return _fp8_linear_impl(triton_ops.silu_and_mul(x2), weight, scale, bias, None, block_n, block_k)


_fp8_silu_and_mul_linear_op = torch.library.custom_op("duet::fp8_silu_and_mul_linear",
                                                      _fp8_silu_and_mul_linear_impl, mutates_args=())


@_fp8_silu_and_mul_linear_op.register_fake
def _(x2, weight, scale, bias, block_n, block_k):
    return x2.new_empty((x2.shape[0], weight.shape[0]))


def _fusable(x: torch.Tensor, width: int, weight: torch.Tensor, block: tuple[int, int] | None,
             *same_dtype: torch.Tensor) -> bool:
    """Whether the fused quantization can make this GEMM's input: a device it runs on, rows the W8A8 path
    takes (eager; traced, the op decides when it runs), unit stride, the GEMM's input width within the
    one-pass kernels, and one dtype for x and the tensors it is combined with."""
    if fp8_ops is None or x.device.type not in FUSED_QUANT_DEVICES or x.stride(-1) != 1:
        return False
    if not torch.compiler.is_compiling() and not _quantizes_rows(x.reshape(-1, x.shape[-1])[:, :width], weight,
                                                                 block):
        return False  # decode-sized rows: the caller's path, with the small-M kernel's own fusions
    if any(t.dtype != x.dtype for t in same_dtype):
        return False
    return fp8_ops.fused_quant_fits(width, block[1] if block else width)


def fp8_rmsnorm_linear(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                       weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                       block: tuple[int, int] | None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(fp8_linear(norm_weight * rmsnorm(h)), h) for h = x + residual (x without one), the activations
    quantized inside the norm's kernel where the W8A8 path runs; None where it cannot run (module docstring)."""
    k = x.shape[-1]
    if not _fusable(x, k, weight, block, norm_weight, *(() if residual is None else (residual,))):
        return None
    if residual is not None and (residual.shape != x.shape or residual.stride(-1) != 1):
        return None
    x2, r2 = x.reshape(-1, k), None if residual is None else residual.reshape(-1, k)
    op = torch.ops.duet.fp8_rmsnorm_linear if torch.compiler.is_compiling() else _fp8_rmsnorm_linear_impl
    y, h = op(x2, r2, norm_weight, eps, weight, scale, bias, *(block or (0, 0)))
    return y.reshape(*x.shape[:-1], y.shape[-1]), (x if residual is None else h.reshape(x.shape))


def fp8_silu_and_mul_linear(gate_up: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                            bias: torch.Tensor | None, block: tuple[int, int] | None) -> torch.Tensor | None:
    """fp8_linear(silu(gate) * up) for gate_up = [gate; up], the activations quantized inside the SiLU-and-mul
    kernel where the W8A8 path runs; None where it cannot run (module docstring)."""
    if gate_up.shape[-1] % 2 or not _fusable(gate_up, gate_up.shape[-1] // 2, weight, block):
        return None
    x2 = gate_up.reshape(-1, gate_up.shape[-1])
    op = torch.ops.duet.fp8_silu_and_mul_linear if torch.compiler.is_compiling() else _fp8_silu_and_mul_linear_impl
    y = op(x2, weight, scale, bias, *(block or (0, 0)))
    return y.reshape(*gate_up.shape[:-1], y.shape[-1])

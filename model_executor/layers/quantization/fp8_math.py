"""FP8 (e4m3) and int8 quantization math in plain PyTorch: the reference for the kernels and the CPU tests.

Scales are float32 and multiply: real value = quantized value x scale (for block-wise checkpoints the
stored `weight_scale_inv` is this same multiplier; the name is DeepSeek's). Symmetric, no zero points.
Conversions to float8_e4m3fn clamp first: PyTorch's cast does not saturate (out-of-range values become NaN).
"""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max
INT8_MAX = 127
# An all-zero row / group would get scale 0 and 0/0 = NaN; this floor keeps its scale tiny but finite.
_MIN_AMAX = 1e-12


def _to_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def quantize_fp8_per_tensor(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w -> (fp8 w, scale []): one scale for the whole tensor."""
    scale = w.abs().amax().float().clamp(min=_MIN_AMAX) / FP8_MAX
    return _to_fp8(w, scale), scale


def quantize_fp8_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (fp8 [N, K], scale [N]): one scale per output channel (row)."""
    scale = w.abs().amax(dim=-1).float().clamp(min=_MIN_AMAX) / FP8_MAX
    return _to_fp8(w, scale[:, None]), scale


def quantize_fp8_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic activation quantization: x [M, K] -> (fp8 [M, K], scale [M, 1]), one scale per token."""
    scale = x.abs().amax(dim=-1, keepdim=True).float().clamp(min=_MIN_AMAX) / FP8_MAX
    return _to_fp8(x, scale), scale


def quantize_fp8_per_token_group(x: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (fp8 [M, K], scale [M, K / group_size]): one scale per token and group of K columns."""
    m, k = x.shape
    if k % group_size:
        raise ValueError(f"K={k} is not a multiple of the group size {group_size}")
    groups = x.reshape(m, k // group_size, group_size)
    scale = groups.abs().amax(dim=-1).float().clamp(min=_MIN_AMAX) / FP8_MAX
    return _to_fp8(groups, scale[..., None]).reshape(m, k), scale


def quantize_fp8_block(w: torch.Tensor, block: tuple[int, int] = (128, 128)) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (fp8 [N, K], scale [ceil(N/bn), ceil(K/bk)]): one scale per bn x bk tile (edge tiles
    may be partial), the layout of `weight_scale_inv` in block-quantized FP8 checkpoints."""
    bn, bk = block
    n, k = w.shape
    pn, pk = -n % bn, -k % bk
    padded = torch.nn.functional.pad(w.float(), (0, pk, 0, pn))
    tiles = padded.reshape((n + pn) // bn, bn, (k + pk) // bk, bk)
    scale = tiles.abs().amax(dim=(1, 3)).clamp(min=_MIN_AMAX) / FP8_MAX
    q = _to_fp8(tiles, scale[:, None, :, None]).reshape(n + pn, k + pk)[:n, :k]
    return q.contiguous(), scale


def dequantize_fp8_block(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] = (128, 128),
                         dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The inverse of quantize_fp8_block (up to rounding): each tile times its scale."""
    bn, bk = block
    n, k = q.shape
    full = scale.float().repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    return (q.float() * full).to(dtype)


def dequantize_fp8_per_group(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """q [M, K] with per-token-group scales [M, G] (or per-channel [N, 1] / per-token [M, 1]) -> real values."""
    group = q.shape[-1] // scale.shape[-1]
    return (q.float() * scale.float().repeat_interleave(group, -1)).to(dtype)


def fp8_linear_reference(x: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None,
                         *, block: tuple[int, int] | None = None, input_scale: torch.Tensor | None = None
                         ) -> torch.Tensor:
    """What the FP8 GEMMs compute, in float32 on any device: the activations quantized as the kernels
    quantize them (per token, per 1 x block[1] group, or with a static per-tensor `input_scale`), times
    the dequantized weight. w_scale: [N] per channel, or the block scales when `block` is given."""
    x2 = x.reshape(-1, x.shape[-1])
    if block is not None:
        xq, xs = quantize_fp8_per_token_group(x2, block[1])
        w = dequantize_fp8_block(w_q, w_scale, block)
    else:
        if input_scale is not None:
            xs = input_scale.float().reshape(1, 1)
            xq = _to_fp8(x2, xs)
        else:
            xq, xs = quantize_fp8_per_token(x2)
        w = w_q.float() * w_scale.float()[:, None]
    out = dequantize_fp8_per_group(xq, xs) @ w.t()
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype).reshape(*x.shape[:-1], w_q.shape[0])


def quantize_int8_per_channel(w: torch.Tensor, scale_dtype: torch.dtype | None = None
                              ) -> tuple[torch.Tensor, torch.Tensor]:
    """Weight-only int8: w [N, K] -> (int8 [N, K], scale [N] in scale_dtype, default w's), symmetric per
    output channel. The codes are rounded against the scale as stored, so q * scale is the weight the
    kernel multiplies by (a bfloat16 scale's rounding is not added on top of int8's)."""
    scale = (w.abs().amax(dim=-1).float().clamp(min=_MIN_AMAX) / INT8_MAX).to(scale_dtype or w.dtype)
    q = torch.round(w.float() / scale.float()[:, None]).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scale


# The dtype `_weight_int8pack_mm` computes in: its vectorized CPU kernels take bfloat16 (or float16)
# activations; with float32 ones it runs a scalar loop, slower than the float32 GEMM it replaces
# (docs/benchmarks.md, bench_cpu_step --kernels).
INT8_COMPUTE_DTYPE = torch.bfloat16


# Under torch.compile the weight-only GEMMs are opaque ops: inductor's own lowering of the ATen kernels
# rejects an input it fused (the cast to bfloat16). Eager calls ATen directly (no custom-op dispatch cost).
@torch.library.custom_op("duet::int8_weight_only_mm", mutates_args=())
def _int8_mm_op(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return torch.ops.aten._weight_int8pack_mm(x, q, scale)


@_int8_mm_op.register_fake
def _(x, q, scale):
    return x.new_empty(x.shape[0], q.shape[0])


@torch.library.custom_op("duet::int4_weight_only_mm", mutates_args=())
def _int4_mm_op(x: torch.Tensor, packed: torch.Tensor, group: int, scales_and_zeros: torch.Tensor) -> torch.Tensor:
    return torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, group, scales_and_zeros)


@_int4_mm_op.register_fake
def _(x, packed, group, scales_and_zeros):
    return x.new_empty(x.shape[0], packed.shape[0])


def int8_weight_only_mm(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ (q [N, K] * scale [N, 1])^T in INT8_COMPUTE_DTYPE (scale must be in it), out in x's dtype."""
    xc = x.to(INT8_COMPUTE_DTYPE).contiguous()
    mm = _int8_mm_op if torch.compiler.is_compiling() else torch.ops.aten._weight_int8pack_mm
    return mm(xc, q, scale).to(x.dtype)


# Weight-only int4 (CPU): asymmetric, one scale and zero per group of INT4_GROUP input columns, the layout
# of ATen's `_weight_int4pack_mm_for_cpu`. A group of 32 is llama.cpp's Q4_0 / Q4_1 block: the default
# model's linear layers were published as Q4_1, so their float32 conversion re-quantizes to the same codes.
INT4_GROUP = 32


def quantize_int4_groups(w: torch.Tensor, group: int = INT4_GROUP, dtype: torch.dtype = INT8_COMPUTE_DTYPE
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (codes [N, K] uint8 in 0..15, scales_and_zeros [K / group, N, 2] in dtype) with
    w ~ (codes - 8) * scale + zero per group: the group's minimum is code 0, its maximum code 15. The codes
    are rounded against the scale and zero as stored."""
    n, k = w.shape
    g = w.float().reshape(n, k // group, group)
    lo, hi = g.amin(-1), g.amax(-1)
    scale = ((hi - lo) / 15).clamp(min=_MIN_AMAX).to(dtype)
    zero = (lo + 8 * scale.float()).to(dtype)
    codes = torch.round((g - zero.float()[..., None]) / scale.float()[..., None]) + 8
    codes = codes.clamp(0, 15).to(torch.uint8).reshape(n, k)
    return codes, torch.stack([scale.t(), zero.t()], dim=-1).contiguous()


def dequantize_int4_groups(codes: torch.Tensor, scales_and_zeros: torch.Tensor) -> torch.Tensor:
    """The float32 weight [N, K] the int4 kernel multiplies by."""
    n, k = codes.shape
    groups = scales_and_zeros.shape[0]
    scale = scales_and_zeros[..., 0].t().float()[..., None]
    zero = scales_and_zeros[..., 1].t().float()[..., None]
    return ((codes.float().reshape(n, groups, k // groups) - 8) * scale + zero).reshape(n, k)


def int4_weight_only_mm(x: torch.Tensor, packed: torch.Tensor, scales_and_zeros: torch.Tensor,
                        group: int = INT4_GROUP) -> torch.Tensor:
    """x [M, K] @ dequantized(packed)^T in the scales' dtype, out in x's dtype."""
    xc = x.to(scales_and_zeros.dtype).contiguous()
    mm = _int4_mm_op if torch.compiler.is_compiling() else torch.ops.aten._weight_int4pack_mm_for_cpu
    return mm(xc, packed, group, scales_and_zeros).to(x.dtype)

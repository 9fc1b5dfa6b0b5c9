"""Qwen3's per-head q/k RMSNorm and the rotary in one Triton kernel, in place on q and k (imports triton;
model_executor/layers/qk_norm_rope.py imports it lazily).

One program per token: every q head and k head is normalised over its head_dim (float32 math, rounded
to the input dtype before the weight multiply and after it, as norm.py's RMSNorm), then rotated with the
cos/sin row of the token's position (rotary.py's NeoX halves), and stored back. One launch instead of two
norms, their copies out of the fused qkv output, and the rotary; no host sync, capturable.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _head_rms_norm(x1, x2, w_ptr, d, d_mask, eps, dtype: tl.constexpr, HALF: tl.constexpr):
    """x1, x2: the float32 halves [BLOCK_H, BLOCK_D] of heads -> each head normalised and weighted, rounded
    as RMSNorm rounds (to dtype before the weight multiply and after it); float32 halves again. Lanes past
    HALF must be zero (they add nothing to the sum)."""
    var = (tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / (2 * HALF)
    r = tl.rsqrt(var + eps)[:, None]
    w1 = tl.load(w_ptr + d, mask=d_mask, other=0.0).to(tl.float32)[None, :]
    w2 = tl.load(w_ptr + HALF + d, mask=d_mask, other=0.0).to(tl.float32)[None, :]
    y1 = (w1 * (x1 * r).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
    y2 = (w2 * (x2 * r).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
    return y1, y2


@triton.jit
def _norm_rotate_heads(x_ptr, w_ptr, row_off, head_stride, num_heads, cos, sin, d, d_mask, eps,
                       HALF: tl.constexpr, BLOCK_H: tl.constexpr):
    h = tl.arange(0, BLOCK_H)
    offs = row_off + h[:, None].to(tl.int64) * head_stride + d[None, :]
    mask = (h[:, None] < num_heads) & d_mask[None, :]
    dtype = x_ptr.dtype.element_ty
    x1 = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + offs + HALF, mask=mask, other=0.0).to(tl.float32)
    y1, y2 = _head_rms_norm(x1, x2, w_ptr, d, d_mask, eps, dtype, HALF)
    tl.store(x_ptr + offs, (y1 * cos[None, :] - y2 * sin[None, :]).to(dtype), mask=mask)
    tl.store(x_ptr + offs + HALF, (y2 * cos[None, :] + y1 * sin[None, :]).to(dtype), mask=mask)


@triton.jit
def _qk_norm_rope_kernel(
    pos_ptr, q_ptr, k_ptr, qw_ptr, kw_ptr, cache_ptr,
    q_row_stride, q_head_stride, k_row_stride, k_head_stride, cache_stride,
    num_q_heads, num_k_heads, eps,
    HALF: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HALF
    cos = tl.load(cache_ptr + pos * cache_stride + d, mask=d_mask, other=0.0).to(tl.float32)
    sin = tl.load(cache_ptr + pos * cache_stride + HALF + d, mask=d_mask, other=0.0).to(tl.float32)
    _norm_rotate_heads(q_ptr, qw_ptr, t * q_row_stride, q_head_stride, num_q_heads, cos, sin, d, d_mask, eps,
                       HALF, BLOCK_HQ)
    _norm_rotate_heads(k_ptr, kw_ptr, t * k_row_stride, k_head_stride, num_k_heads, cos, sin, d, d_mask, eps,
                       HALF, BLOCK_HK)


def qk_norm_rope_fwd(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor,
                     k_weight: torch.Tensor, eps: float, cos_sin_cache: torch.Tensor) -> None:
    """q: [T, Hq, D], k: [T, Hk, D] (unit stride in D), normalised and rotated in place; weights: [D]."""
    num_tokens, num_q_heads, head_dim = q.shape
    if num_tokens == 0:
        return
    half = head_dim // 2
    block_hq, block_hk = triton.next_power_of_2(num_q_heads), triton.next_power_of_2(k.shape[1])
    _qk_norm_rope_kernel[(num_tokens,)](
        positions, q, k, q_weight, k_weight, cos_sin_cache,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos_sin_cache.stride(0),
        num_q_heads, k.shape[1], eps,
        HALF=half, BLOCK_D=triton.next_power_of_2(half), BLOCK_HQ=block_hq, BLOCK_HK=block_hk,
        num_warps=4 if block_hq * half <= 1024 else 8,
    )

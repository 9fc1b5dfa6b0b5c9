"""The rotary embedding and the KV store of a decode step in one Triton kernel, with Qwen3's per-head q/k
RMSNorm before the rotary where the model has it (imports triton; model_executor/layers/rotary_store_kv.py
imports it lazily).

One program per token: its q heads are rotated in place (as kernels.py's `_rotary_kernel`; normalised first
under QK_NORM, as qk_norm_rope.py's kernel), its k heads are rotated (normalised first under QK_NORM) and
written, with its v heads, straight into the pool at the token's slot (as `_store_kv_kernel`, and the
division by the pool's scales that KVCache.set_kv does for an FP8 pool). The rotated k is rounded to k's
dtype before it is stored, as the two-kernel path stores it into k first, so both paths write the same pool
values; with an FP8 scale the quotient is cast straight to FP8 (as the extend kernel stores it), not
rounded to k's dtype first. One launch instead of two (the rotary, or qk_norm_rope's norms and rotary,
then the store; four with FP8 scales); no host sync, capturable.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from model_executor.layers.triton_ops.kernels import _num_warps, _rotate_heads
from model_executor.layers.triton_ops.qk_norm_rope import _head_rms_norm, _norm_rotate_heads


@triton.jit
def _rotate_store_heads(x_ptr, row_off, head_stride, buf_ptr, buf_off, buf_head_stride, num_heads, scale,
                        cos, sin, d, d_mask, w_ptr, eps, NORM: tl.constexpr, ROTATE: tl.constexpr,
                        HALF: tl.constexpr, BLOCK_H: tl.constexpr):
    """Heads of one token -> buf at buf_off: normalised with w_ptr (NORM) and rotated (ROTATE) first,
    rounded to x's dtype, divided by scale."""
    h = tl.arange(0, BLOCK_H)[:, None].to(tl.int64)
    offs = row_off + h * head_stride + d[None, :]
    dst = buf_off + h * buf_head_stride + d[None, :]
    mask = (h < num_heads) & d_mask[None, :]
    x1 = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + offs + HALF, mask=mask, other=0.0).to(tl.float32)
    if NORM:
        x1, x2 = _head_rms_norm(x1, x2, w_ptr, d, d_mask, eps, x_ptr.dtype.element_ty, HALF)
    if ROTATE:
        o1 = x1 * cos[None, :] - x2 * sin[None, :]
        o2 = x2 * cos[None, :] + x1 * sin[None, :]
    else:
        o1 = x1
        o2 = x2
    # float32 on both sides of the (runtime) scale branch: Triton needs one type per variable there
    o1 = o1.to(x_ptr.dtype.element_ty).to(tl.float32)
    o2 = o2.to(x_ptr.dtype.element_ty).to(tl.float32)
    if scale != 1.0:  # an FP8 pool with a scale holds x / scale
        o1 = o1 / scale
        o2 = o2 / scale
    tl.store(buf_ptr + dst, o1.to(buf_ptr.dtype.element_ty), mask=mask)
    tl.store(buf_ptr + dst + HALF, o2.to(buf_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_store_kv_kernel(
    pos_ptr, loc_ptr, q_ptr, k_ptr, v_ptr, cache_ptr, k_buf_ptr, v_buf_ptr, qw_ptr, kw_ptr,
    q_row_stride, q_head_stride, k_row_stride, k_head_stride, v_row_stride, v_head_stride, cache_stride,
    k_buf_slot_stride, k_buf_head_stride, v_buf_slot_stride, v_buf_head_stride,
    num_q_heads, num_kv_heads, k_scale, v_scale, eps,
    QK_NORM: tl.constexpr, HALF: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    slot = tl.load(loc_ptr + t).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HALF
    cos = tl.load(cache_ptr + pos * cache_stride + d, mask=d_mask, other=0.0).to(tl.float32)
    sin = tl.load(cache_ptr + pos * cache_stride + HALF + d, mask=d_mask, other=0.0).to(tl.float32)
    if QK_NORM:
        _norm_rotate_heads(q_ptr, qw_ptr, t * q_row_stride, q_head_stride, num_q_heads, cos, sin, d, d_mask, eps,
                           HALF, BLOCK_HQ)
    else:
        _rotate_heads(q_ptr, t * q_row_stride, q_head_stride, num_q_heads, cos, sin, d, d_mask, HALF, BLOCK_HQ)
    _rotate_store_heads(k_ptr, t * k_row_stride, k_head_stride, k_buf_ptr, slot * k_buf_slot_stride,
                        k_buf_head_stride, num_kv_heads, k_scale, cos, sin, d, d_mask, kw_ptr, eps,
                        QK_NORM, True, HALF, BLOCK_HK)
    _rotate_store_heads(v_ptr, t * v_row_stride, v_head_stride, v_buf_ptr, slot * v_buf_slot_stride,
                        v_buf_head_stride, num_kv_heads, v_scale, cos, sin, d, d_mask, kw_ptr, eps,
                        False, False, HALF, BLOCK_HK)


def rotary_store_kv_fwd(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        cos_sin_cache: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor,
                        loc: torch.Tensor, k_scale: float, v_scale: float,
                        q_norm_weight: torch.Tensor | None = None, k_norm_weight: torch.Tensor | None = None,
                        norm_eps: float = 0.0) -> None:
    """q: [T, Hq, D], k, v: [T, Hk, D], buffers [S, Hk, D] (unit stride in D); positions, loc: [T].
    With norm weights ([D], contiguous, both or neither) q and k are RMS-normalised per head first."""
    num_tokens, num_q_heads, head_dim = q.shape
    if num_tokens == 0:
        return
    half = head_dim // 2
    num_kv_heads = k.shape[1]
    block_hq, block_hk = triton.next_power_of_2(num_q_heads), triton.next_power_of_2(num_kv_heads)
    block_d = triton.next_power_of_2(half)
    qk_norm = q_norm_weight is not None
    _rotary_store_kv_kernel[(num_tokens,)](
        positions, loc, q, k, v, cos_sin_cache, k_buffer, v_buffer,
        q_norm_weight if qk_norm else q, k_norm_weight if qk_norm else k,  # (not read without the norms)
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos_sin_cache.stride(0),
        k_buffer.stride(0), k_buffer.stride(1), v_buffer.stride(0), v_buffer.stride(1),
        num_q_heads, num_kv_heads, k_scale, v_scale, norm_eps,
        QK_NORM=qk_norm, HALF=half, BLOCK_D=block_d, BLOCK_HQ=block_hq, BLOCK_HK=block_hk,
        num_warps=_num_warps(block_hq * block_d),
    )

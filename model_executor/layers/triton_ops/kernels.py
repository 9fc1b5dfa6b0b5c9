"""The Triton kernels behind the fused ops of `ops.py`, and their launchers.

This module imports triton; `ops.py` imports it lazily, on the first call of an op, so importing the model
layers never imports triton (a CPU test process must be able to set TRITON_INTERPRET=1 first).

Every kernel does its math in float32 and rounds wherever the PyTorch reference rounds (the reference runs
each step as its own kernel in the tensor's dtype), so in bfloat16 the results agree with the PyTorch path
bit for bit up to float32 rounding order (reductions, FMA contraction, exp). Offsets that involve a row,
slot or position index are computed in int64.

The launchers allocate nothing that depends on data and never synchronise with the host: each is one launch
and can be captured in a CUDA graph (after a first, compiling call outside the capture).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def _num_warps(block: int) -> int:
    return 4 if block <= 1024 else 8 if block <= 4096 else 16


@triton.jit
def to_f16_scaled(x, SCALE: tl.constexpr):
    """x (bf16, fp16 or float32) times SCALE, a power of two that brings it into fp16's range, rounded to
    fp16, the product in float32. Written as an FMA with +0, not `(x * SCALE).to(float16)`: LLVM narrows
    fptrunc(fpext(bf16 x) * C) to fp16(x) * C (`mul.f16x2` after the conversion in the sm_90 PTX, Triton 3.6
    and 3.9), which turns |x| > 65504 into inf before the scale applies; it does not narrow an FMA.
    tests/sm90_compile.py fails a kernel with fp16 arithmetic in its PTX."""
    return tl.fma(x.to(tl.float32), SCALE, 0.0).to(tl.float16)


# ---------------------------------------------------------------- (add +) RMSNorm


@triton.jit
def rmsnorm_row(x_ptr, res_ptr, w_ptr, res_out_ptr, row, x_stride, res_stride, res_out_stride, N, eps,
                HAS_RESIDUAL: tl.constexpr, BLOCK_N: tl.constexpr):
    """weight * norm(s) of one row, float32 [BLOCK_N] (zero past N), for s = x + residual (rounded to
    res_out's dtype and stored there) or x: norm(s) is rounded to s's dtype before the weight multiply, as
    the reference does. The RMSNorm kernel's math, shared with the kernels that quantize its output."""
    cols = tl.arange(0, BLOCK_N)
    mask = cols < N
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * res_stride + cols, mask=mask, other=0.0)
        s = (x.to(tl.float32) + r.to(tl.float32)).to(res_out_ptr.dtype.element_ty)
        tl.store(res_out_ptr + row * res_out_stride + cols, s, mask=mask)
        norm_dtype = res_out_ptr.dtype.element_ty
    else:
        s = x
        norm_dtype = x_ptr.dtype.element_ty
    sf = s.to(tl.float32)
    var = tl.sum(sf * sf, axis=0) / N
    y = (sf * tl.rsqrt(var + eps)).to(norm_dtype)  # the reference casts back to the input dtype here...
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    return w.to(tl.float32) * y.to(tl.float32)  # ...and only then multiplies by the weight


@triton.jit
def _rmsnorm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr,
    x_stride, res_stride, out_stride, res_out_stride,
    N, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """One program per row: out = rmsnorm_row(...) rounded to out's dtype."""
    row = tl.program_id(0).to(tl.int64)
    out = rmsnorm_row(x_ptr, res_ptr, w_ptr, res_out_ptr, row, x_stride, res_stride, res_out_stride, N, eps,
                      HAS_RESIDUAL, BLOCK_N)
    cols = tl.arange(0, BLOCK_N)
    tl.store(out_ptr + row * out_stride + cols, out.to(out_ptr.dtype.element_ty), mask=cols < N)


def rmsnorm_fwd(x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor,
                residual: torch.Tensor | None = None, residual_out: torch.Tensor | None = None) -> None:
    """x, residual, out, residual_out: [T, N] with unit stride in N; weight: [N]."""
    num_rows, n = x.shape
    if num_rows == 0:
        return
    block = triton.next_power_of_2(n)
    has_res = residual is not None
    res = residual if has_res else x
    res_out = residual_out if has_res else out
    _rmsnorm_kernel[(num_rows,)](
        x, res, weight, out, res_out,
        x.stride(0), res.stride(0), out.stride(0), res_out.stride(0),
        n, eps,
        HAS_RESIDUAL=has_res, BLOCK_N=block, num_warps=_num_warps(block),
    )


# ---------------------------------------------------------------- rotary (NeoX halves), q and k in place


@triton.jit
def _rotate_heads(x_ptr, row_off, head_stride, num_heads, cos, sin, d, d_mask,
                  HALF: tl.constexpr, BLOCK_H: tl.constexpr):
    h = tl.arange(0, BLOCK_H)
    offs = row_off + h[:, None].to(tl.int64) * head_stride + d[None, :]
    mask = (h[:, None] < num_heads) & d_mask[None, :]
    x1 = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + offs + HALF, mask=mask, other=0.0).to(tl.float32)
    o1 = x1 * cos[None, :] - x2 * sin[None, :]
    o2 = x2 * cos[None, :] + x1 * sin[None, :]
    tl.store(x_ptr + offs, o1.to(x_ptr.dtype.element_ty), mask=mask)
    tl.store(x_ptr + offs + HALF, o2.to(x_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(
    pos_ptr, q_ptr, k_ptr, cache_ptr,
    q_row_stride, q_head_stride, k_row_stride, k_head_stride, cache_stride,
    num_q_heads, num_k_heads,
    HALF: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr,
):
    """One program per token: all its q heads and k heads, rotated with the cos/sin row of its position."""
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HALF
    cos = tl.load(cache_ptr + pos * cache_stride + d, mask=d_mask, other=0.0).to(tl.float32)
    sin = tl.load(cache_ptr + pos * cache_stride + HALF + d, mask=d_mask, other=0.0).to(tl.float32)
    _rotate_heads(q_ptr, t * q_row_stride, q_head_stride, num_q_heads, cos, sin, d, d_mask, HALF, BLOCK_HQ)
    _rotate_heads(k_ptr, t * k_row_stride, k_head_stride, num_k_heads, cos, sin, d, d_mask, HALF, BLOCK_HK)


def rotary_fwd(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
               cos_sin_cache: torch.Tensor) -> None:
    """q: [T, Hq, D], k: [T, Hk, D] (unit stride in D), rotated in place; positions: [T]; cache: [P, D]."""
    num_tokens, num_q_heads, head_dim = q.shape
    if num_tokens == 0:
        return
    half = head_dim // 2
    block_hq, block_hk = triton.next_power_of_2(num_q_heads), triton.next_power_of_2(k.shape[1])
    block_d = triton.next_power_of_2(half)
    _rotary_kernel[(num_tokens,)](
        positions, q, k, cos_sin_cache,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos_sin_cache.stride(0),
        num_q_heads, k.shape[1],
        HALF=half, BLOCK_D=block_d, BLOCK_HQ=block_hq, BLOCK_HK=block_hk,
        num_warps=_num_warps(block_hq * block_d),
    )


# ---------------------------------------------------------------- SiLU-and-mul


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, x_stride, out_stride, I, BLOCK: tl.constexpr):
    """Grid (T, cdiv(I, BLOCK)): out[t, i] = silu(x[t, i]) * x[t, I + i], silu rounded to out's dtype
    first (as F.silu returns it in the input dtype)."""
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < I
    gate = tl.load(x_ptr + t * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + t * x_stride + I + cols, mask=mask, other=0.0).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + t * out_stride + cols, (act * up).to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul_fwd(x: torch.Tensor, out: torch.Tensor) -> None:
    """x: [T, 2I], out: [T, I], both with unit stride in the last dim."""
    num_tokens, inter = out.shape
    if num_tokens == 0 or inter == 0:
        return
    block = min(1024, triton.next_power_of_2(inter))
    grid = (num_tokens, triton.cdiv(inter, block))
    _silu_and_mul_kernel[grid](x, out, x.stride(0), out.stride(0), inter, BLOCK=block, num_warps=4)


# ---------------------------------------------------------------- KV store


@triton.jit
def _store_kv_kernel(
    k_buf_ptr, v_buf_ptr, loc_ptr, k_ptr, v_ptr,
    k_buf_slot_stride, k_buf_head_stride, v_buf_slot_stride, v_buf_head_stride,
    k_row_stride, k_head_stride, v_row_stride, v_head_stride,
    num_heads, head_dim,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """One program per token: k[t] -> k_buffer[loc[t]], v[t] -> v_buffer[loc[t]], cast to the buffer dtype."""
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(loc_ptr + t).to(tl.int64)
    h = tl.arange(0, BLOCK_H)[:, None].to(tl.int64)
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = (h < num_heads) & (d < head_dim)
    kv = tl.load(k_ptr + t * k_row_stride + h * k_head_stride + d, mask=mask)
    tl.store(k_buf_ptr + slot * k_buf_slot_stride + h * k_buf_head_stride + d,
             kv.to(k_buf_ptr.dtype.element_ty), mask=mask)
    vv = tl.load(v_ptr + t * v_row_stride + h * v_head_stride + d, mask=mask)
    tl.store(v_buf_ptr + slot * v_buf_slot_stride + h * v_buf_head_stride + d,
             vv.to(v_buf_ptr.dtype.element_ty), mask=mask)


def store_kv_fwd(k_buffer: torch.Tensor, v_buffer: torch.Tensor, loc: torch.Tensor,
                 k: torch.Tensor, v: torch.Tensor) -> None:
    """Buffers: [S, H, D]; k, v: [T, H, D]; all with unit stride in D; loc: [T] slot indices."""
    num_tokens, num_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    block_h, block_d = triton.next_power_of_2(num_heads), triton.next_power_of_2(head_dim)
    _store_kv_kernel[(num_tokens,)](
        k_buffer, v_buffer, loc, k, v,
        k_buffer.stride(0), k_buffer.stride(1), v_buffer.stride(0), v_buffer.stride(1),
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        num_heads, head_dim,
        BLOCK_H=block_h, BLOCK_D=block_d, num_warps=_num_warps(block_h * block_d),
    )

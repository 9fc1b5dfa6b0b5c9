"""Fused elementwise ops of the Llama block as `duet::` custom ops, each one Triton kernel.

    rmsnorm(x, weight, eps, residual=None)         -> out, or (out, x + residual) with a residual
    apply_rotary(positions, q, k, cos_sin_cache)   -> (q, k), rotated in place
    silu_and_mul(x)                                -> silu(x[..., :I]) * x[..., I:]
    store_kv(k_buffer, v_buffer, loc, k, v)        -> None; k_buffer[loc] = k, v_buffer[loc] = v

The ops registered (torch.compile / dynamo trace them as opaque calls, through the fake implementations):

    duet::rmsnorm(x, weight, eps) -> out
    duet::fused_add_rmsnorm(x, residual, weight, eps) -> (out, residual_out)     (functional: new tensors)
    duet::apply_rotary(positions, q, k, cos_sin_cache) -> ()                     (mutates q, k)
    duet::silu_and_mul(x) -> out
    duet::store_kv(k_buffer, v_buffer, loc, k, v) -> ()                          (mutates k_buffer, v_buffer)

Semantics are those of the plain PyTorch layers (norm.py, rotary.py, activation.py, memory_pool.py), which
stay the CPU path; the layers call these only for CUDA tensors. The kernels also run on CPU tensors under
Triton's interpreter (TRITON_INTERPRET=1), which is how the CPU tests check them. Each op is one kernel
launch plus, for the functional ops, one output allocation of a shape fixed by the input shapes: no host
syncs, so all of them can be captured in a CUDA graph (warm them up once before the capture, so that
Triton compiles outside it). Triton is imported on the first call, not when this module is imported.

The wrappers below go through the registered op only while something traces (dynamo / torch.export, or
any dispatch mode such as FakeTensorMode or make_fx); in plain eager they call the implementation
directly, skipping the custom-op dispatch (host time on every call, which matters to eager
prefill with a few ops per layer, not to CUDA-graph replays).
"""

from __future__ import annotations

import torch

_kernels = None


def _k():
    global _kernels
    if _kernels is None:
        from model_executor.layers.triton_ops import kernels

        _kernels = kernels
    return _kernels


def _tracing() -> bool:
    return torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack() > 0


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as [rows, last dim] with unit stride in the last dim (a view when possible)."""
    if x.dim() != 2:
        x = x.reshape(-1, x.shape[-1])
    return x if x.stride(-1) == 1 else x.contiguous()


# ---------------------------------------------------------------- RMSNorm


def _norm_dtypes(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None = None):
    """(dtype of the normalised tensor, dtype of the output), by PyTorch's type promotion as in norm.py."""
    dtype = x.dtype if residual is None else torch.promote_types(x.dtype, residual.dtype)
    return dtype, torch.promote_types(weight.dtype, dtype)


def _rmsnorm_impl(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    out = torch.empty(x.shape, dtype=_norm_dtypes(x, weight)[1], device=x.device)
    _k().rmsnorm_fwd(_rows(x), weight, eps, out.view(-1, x.shape[-1]))
    return out


_rmsnorm_op = torch.library.custom_op("duet::rmsnorm", _rmsnorm_impl, mutates_args=())


@_rmsnorm_op.register_fake
def _(x, weight, eps):
    return x.new_empty(x.shape, dtype=_norm_dtypes(x, weight)[1])


def _fused_add_rmsnorm_impl(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                            eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    dtype, out_dtype = _norm_dtypes(x, weight, residual)
    out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    residual_out = torch.empty(x.shape, dtype=dtype, device=x.device)
    n = x.shape[-1]
    _k().rmsnorm_fwd(_rows(x), weight, eps, out.view(-1, n), _rows(residual), residual_out.view(-1, n))
    return out, residual_out


_fused_add_rmsnorm_op = torch.library.custom_op("duet::fused_add_rmsnorm", _fused_add_rmsnorm_impl,
                                                mutates_args=())


@_fused_add_rmsnorm_op.register_fake
def _(x, residual, weight, eps):
    dtype, out_dtype = _norm_dtypes(x, weight, residual)
    return x.new_empty(x.shape, dtype=out_dtype), x.new_empty(x.shape, dtype=dtype)


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """x: [..., N], weight: [N]. Without a residual: weight * norm(x); with one: (weight * norm(s), s) for
    s = x + residual. norm() works in float32 and casts back to the dtype of x (of s) before the weight
    multiply, as HF Llama does; the output dtype is that of `weight * x` (x's dtype when they match)."""
    if residual is None:
        return (torch.ops.duet.rmsnorm if _tracing() else _rmsnorm_impl)(x, weight, eps)
    fused_add_rmsnorm = torch.ops.duet.fused_add_rmsnorm if _tracing() else _fused_add_rmsnorm_impl
    return fused_add_rmsnorm(x, residual, weight, eps)


# ---------------------------------------------------------------- rotary


def _heads(x: torch.Tensor, head_dim: int) -> torch.Tensor:
    """[T, H*D] or [T, H, D] -> a [T, H, D] view of the same memory (unit stride in D required)."""
    if x.dim() == 2:
        x = x.view(x.shape[0], -1, head_dim)
    if x.dim() != 3 or x.shape[-1] != head_dim or x.stride(-1) != 1:
        raise ValueError(f"rotary expects [T, H*{head_dim}] or [T, H, {head_dim}] with unit stride in the "
                         f"last dim, got shape {tuple(x.shape)} strides {x.stride()}")
    return x


def _apply_rotary_impl(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                       cos_sin_cache: torch.Tensor) -> None:
    head_dim = cos_sin_cache.shape[-1]
    q, k = _heads(q, head_dim), _heads(k, head_dim)
    _k().rotary_fwd(positions.contiguous(), q, k, cos_sin_cache.contiguous())


_apply_rotary_op = torch.library.custom_op("duet::apply_rotary", _apply_rotary_impl, mutates_args=("q", "k"))


@_apply_rotary_op.register_fake
def _(positions, q, k, cos_sin_cache):
    return None


def apply_rotary(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor):
    """NeoX half-rotation rotary, in place on q and k; returns (q, k).

    positions: [T] (int32/int64); cos_sin_cache: [max_pos, D], cos in the first D/2 columns and sin in
    the last D/2 (float32, or the model dtype once model.to(dtype) has cast the buffer; read as float32). q: [T, Hq, D] or [T, Hq*D]; k: [T, Hk, D] or [T, Hk*D] (the 2-D form is read as
    heads of D = cos_sin_cache.shape[1]); any row / head strides (e.g. views into a fused qkv output), unit
    stride in D. Math in float32, results rounded to q's / k's dtype. Positions are not range-checked.
    """
    (torch.ops.duet.apply_rotary if _tracing() else _apply_rotary_impl)(positions, q, k, cos_sin_cache)
    return q, k


# ---------------------------------------------------------------- SiLU-and-mul


def _silu_and_mul_impl(x: torch.Tensor) -> torch.Tensor:
    inter = x.shape[-1] // 2
    out = torch.empty((*x.shape[:-1], inter), dtype=x.dtype, device=x.device)
    _k().silu_and_mul_fwd(_rows(x), out.view(-1, inter))
    return out


_silu_and_mul_op = torch.library.custom_op("duet::silu_and_mul", _silu_and_mul_impl, mutates_args=())


@_silu_and_mul_op.register_fake
def _(x):
    return x.new_empty((*x.shape[:-1], x.shape[-1] // 2))


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [..., 2I] (gate then up) -> silu(gate) * up: [..., I], in x's dtype (silu rounded to it first)."""
    if x.shape[-1] % 2:
        raise ValueError(f"silu_and_mul needs an even last dim, got {x.shape[-1]}")
    return (torch.ops.duet.silu_and_mul if _tracing() else _silu_and_mul_impl)(x)


# ---------------------------------------------------------------- KV store


def _store_kv_impl(k_buffer: torch.Tensor, v_buffer: torch.Tensor, loc: torch.Tensor,
                   k: torch.Tensor, v: torch.Tensor) -> None:
    _, num_heads, head_dim = k_buffer.shape
    k = k.view(k.shape[0], num_heads, head_dim)
    v = v.view(v.shape[0], num_heads, head_dim)
    _k().store_kv_fwd(k_buffer, v_buffer, loc.contiguous(), k, v)


_store_kv_op = torch.library.custom_op("duet::store_kv", _store_kv_impl,
                                       mutates_args=("k_buffer", "v_buffer"))


@_store_kv_op.register_fake
def _(k_buffer, v_buffer, loc, k, v):
    return None


def store_kv(k_buffer: torch.Tensor, v_buffer: torch.Tensor, loc: torch.Tensor,
             k: torch.Tensor, v: torch.Tensor) -> None:
    """k_buffer[loc] = k; v_buffer[loc] = v (cast to the buffers' dtype), in one kernel.

    Buffers: [num_slots, Hk, D] with unit stride in D; k, v: [T, Hk, D] or [T, Hk*D] (any row / head
    strides, unit stride in D); loc: [T] int64 (int32 works too) slot indices, not range-checked. Slots
    should be distinct, as in the PyTorch path where a repeated slot leaves an unspecified one of the rows.
    """
    (torch.ops.duet.store_kv if _tracing() else _store_kv_impl)(k_buffer, v_buffer, loc, k, v)

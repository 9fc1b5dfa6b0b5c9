"""`duet::rotary_store_kv`: a decode step's rotary embedding and KV store as one op (one Triton kernel,
triton_ops/rotary_store_kv.py, imported on the first call).

The triton attention backend calls it for decode batches instead of the rotary op then KVCache.set_kv:
q is rotated in place; k is rotated and stored with v at the token's KV slots (k itself is left as it
came: attention reads the pool). Semantics are those of RotaryEmbedding.forward_native followed by
KVCache.set_kv, which the CPU runs and the kernel is tested against.
"""

from __future__ import annotations

import torch

from model_executor.layers.triton_ops.ops import _tracing


def _rotary_store_kv_impl(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          cos_sin_cache: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor,
                          loc: torch.Tensor, k_scale: float, v_scale: float) -> None:
    from model_executor.layers.triton_ops.rotary_store_kv import rotary_store_kv_fwd

    rotary_store_kv_fwd(positions.contiguous(), q, k, v, cos_sin_cache.contiguous(), k_buffer, v_buffer,
                        loc.contiguous(), k_scale, v_scale)


_op = torch.library.custom_op("duet::rotary_store_kv", _rotary_store_kv_impl,
                              mutates_args=("q", "k_buffer", "v_buffer"))


@_op.register_fake
def _(positions, q, k, v, cos_sin_cache, k_buffer, v_buffer, loc, k_scale, v_scale):
    return None


def rotary_store_kv(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    cos_sin_cache: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor,
                    loc: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """q: [T, Hq, D] rotated in place; k, v: [T, Hk, D] (k rotated) stored at k_buffer[loc], v_buffer[loc].

    Any row / head strides with unit stride in D (views into the fused qkv output); buffers [S, Hk, D];
    positions, loc: [T] (int32 or int64, not range-checked); cos_sin_cache: [max_pos, D] as RotaryEmbedding
    keeps it (NeoX halves, the whole head rotated). An FP8 pool stores K / k_scale and V / v_scale.
    """
    head_dim = q.shape[-1]
    if cos_sin_cache.shape[-1] != head_dim:
        raise ValueError(f"rotary_store_kv rotates whole heads: the cos/sin table has {cos_sin_cache.shape[-1]} "
                         f"columns for heads of {head_dim}")
    if not all(x.dim() == 3 and x.stride(-1) == 1 for x in (q, k, v, k_buffer, v_buffer)):
        raise ValueError("rotary_store_kv needs [T, H, D] tensors with unit stride in the head dim")
    if k.shape != v.shape or k.shape[1:] != k_buffer.shape[1:] or v_buffer.shape != k_buffer.shape:
        raise ValueError(f"k {tuple(k.shape)}, v {tuple(v.shape)} do not fit the pool {tuple(k_buffer.shape)}")
    (torch.ops.duet.rotary_store_kv if _tracing() else _rotary_store_kv_impl)(
        positions, q, k, v, cos_sin_cache, k_buffer, v_buffer, loc, float(k_scale), float(v_scale))

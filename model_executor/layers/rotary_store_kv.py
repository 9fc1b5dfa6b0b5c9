"""`duet::rotary_store_kv`: a decode step's rotary embedding and KV store as one op (one Triton kernel,
triton_ops/rotary_store_kv.py, imported on the first call), with Qwen3's per-head q/k RMSNorm before the
rotary when the norm weights are given.

The triton attention backend calls it for decode batches instead of the rotary op (qk_norm_rope's op for
Qwen3) then KVCache.set_kv: q is normalised (with the weights) and rotated in place; k is normalised and
rotated and stored with v at the token's KV slots (k itself is left as it came: attention reads the pool).
Semantics are those of RMSNorm.forward_native per head and RotaryEmbedding.forward_native followed by
KVCache.set_kv, which the CPU runs and the kernel is tested against.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from model_executor.layers.triton_ops.ops import _tracing


def _rotary_store_kv_impl(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          cos_sin_cache: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor,
                          loc: torch.Tensor, k_scale: float, v_scale: float, q_norm_weight: torch.Tensor | None,
                          k_norm_weight: torch.Tensor | None, norm_eps: float) -> None:
    from model_executor.layers.triton_ops.rotary_store_kv import rotary_store_kv_fwd

    rotary_store_kv_fwd(positions.contiguous(), q, k, v, cos_sin_cache.contiguous(), k_buffer, v_buffer,
                        loc.contiguous(), k_scale, v_scale,
                        None if q_norm_weight is None else q_norm_weight.contiguous(),
                        None if k_norm_weight is None else k_norm_weight.contiguous(), norm_eps)


_op = torch.library.custom_op("duet::rotary_store_kv", _rotary_store_kv_impl,
                              mutates_args=("q", "k_buffer", "v_buffer"))


@_op.register_fake
def _(positions, q, k, v, cos_sin_cache, k_buffer, v_buffer, loc, k_scale, v_scale, q_norm_weight, k_norm_weight,
      norm_eps):
    return None


def rotary_store_kv(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    cos_sin_cache: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor,
                    loc: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0,
                    q_norm_weight: torch.Tensor | None = None, k_norm_weight: torch.Tensor | None = None,
                    norm_eps: float = 1e-6) -> None:
    """q: [T, Hq, D] rotated in place; k, v: [T, Hk, D] (k rotated) stored at k_buffer[loc], v_buffer[loc].

    Any row / head strides with unit stride in D (views into the fused qkv output); buffers [S, Hk, D];
    positions, loc: [T] (int32 or int64, not range-checked); cos_sin_cache: [max_pos, D] as RotaryEmbedding
    keeps it (NeoX halves, the whole head rotated). An FP8 pool stores K / k_scale and V / v_scale.
    q_norm_weight, k_norm_weight: [D], both or neither: each q and k head is RMS-normalised (norm_eps) and
    weighted before the rotary, as Qwen3's q_norm / k_norm.
    """
    head_dim = q.shape[-1]
    if cos_sin_cache.shape[-1] != head_dim:
        raise ValueError(f"rotary_store_kv rotates whole heads: the cos/sin table has {cos_sin_cache.shape[-1]} "
                         f"columns for heads of {head_dim}")
    if not all(x.dim() == 3 and x.stride(-1) == 1 for x in (q, k, v, k_buffer, v_buffer)):
        raise ValueError("rotary_store_kv needs [T, H, D] tensors with unit stride in the head dim")
    if k.shape != v.shape or k.shape[1:] != k_buffer.shape[1:] or v_buffer.shape != k_buffer.shape:
        raise ValueError(f"k {tuple(k.shape)}, v {tuple(v.shape)} do not fit the pool {tuple(k_buffer.shape)}")
    if (q_norm_weight is None) != (k_norm_weight is None):
        raise ValueError("rotary_store_kv normalises q and k together: give both norm weights or neither")
    if q_norm_weight is not None and (q_norm_weight.shape != (head_dim,) or k_norm_weight.shape != (head_dim,)):
        raise ValueError(f"the q/k norm weights {tuple(q_norm_weight.shape)}, {tuple(k_norm_weight.shape)} are "
                         f"not one weight per element of a head of {head_dim}")
    (torch.ops.duet.rotary_store_kv if _tracing() else _rotary_store_kv_impl)(
        positions, q, k, v, cos_sin_cache, k_buffer, v_buffer, loc, float(k_scale), float(v_scale),
        q_norm_weight, k_norm_weight, float(norm_eps))


@dataclass(frozen=True)
class RopeStore:
    """A few decode tokens' rotary and KV store, for a qkv GEMV that runs them in its epilogue
    (small_m_gemm's ROPE; RadixAttention.rope_store builds it): q rotated in the GEMV's output, k rotated and
    v written into the pool at slots loc, as rotary_store_kv does."""
    positions: torch.Tensor  # [T] the tokens' positions
    cos_sin_cache: torch.Tensor  # [max_position, head_dim]: cos | sin halves (NeoX)
    loc: torch.Tensor  # [T] the tokens' pool slots
    k_buffer: torch.Tensor  # [slots, num_kv_heads, head_dim]
    v_buffer: torch.Tensor
    num_q_heads: int
    num_kv_heads: int
    k_scale: float = 1.0  # an FP8 pool holds k / k_scale
    v_scale: float = 1.0

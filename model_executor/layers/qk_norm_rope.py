"""`duet::qk_norm_rope`: Qwen3's q/k head norms and the rotary as one op on CUDA tensors (in place).

The op is the fused Triton kernel (triton_ops/qk_norm_rope.py, imported on the first call); the plain path
is RMSNorm per head then RotaryEmbedding.forward_native, which the CPU runs and the kernel is tested against.
norm_and_rotate picks between them, and plain rotary without the norms: the attention layer's path wherever
its backend does not fold them into the KV store (rotary_store_kv.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from model_executor.layers.triton_ops.ops import _tracing

if TYPE_CHECKING:
    from model_executor.layers.norm import RMSNorm
    from model_executor.layers.rotary import RotaryEmbedding


def _qk_norm_rope_impl(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor,
                       k_weight: torch.Tensor, eps: float, cos_sin_cache: torch.Tensor) -> None:
    from model_executor.layers.triton_ops.qk_norm_rope import qk_norm_rope_fwd

    qk_norm_rope_fwd(positions.contiguous(), q, k, q_weight, k_weight, eps, cos_sin_cache.contiguous())


_op = torch.library.custom_op("duet::qk_norm_rope", _qk_norm_rope_impl, mutates_args=("q", "k"))


@_op.register_fake
def _(positions, q, k, q_weight, k_weight, eps, cos_sin_cache):
    return None


def qk_norm_rope(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor,
                 k_weight: torch.Tensor, eps: float, cos_sin_cache: torch.Tensor):
    """q: [T, Hq, D], k: [T, Hk, D], any row / head strides, unit stride in D (views into the fused qkv
    output); normalised per head with q_weight / k_weight [D] and rotated, in place. Returns (q, k)."""
    if q.stride(-1) != 1 or k.stride(-1) != 1:
        raise ValueError("qk_norm_rope needs unit stride in the head dim")
    (torch.ops.duet.qk_norm_rope if _tracing() else _qk_norm_rope_impl)(positions, q, k, q_weight, k_weight, eps,
                                                                       cos_sin_cache)
    return q, k


def norm_and_rotate(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, rotary_emb: RotaryEmbedding,
                    qk_norm: tuple[RMSNorm, RMSNorm] | None) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [T, Hq, D], k: [T, Hk, D] -> (q, k) normalised per head with qk_norm's (q_norm, k_norm), if given,
    and rotated: one kernel on CUDA (in place), the module forwards elsewhere."""
    if qk_norm is None:
        return rotary_emb(positions, q, k)
    q_norm, k_norm = qk_norm
    if q.is_cuda and not rotary_emb.partial:
        return qk_norm_rope(positions, q, k, q_norm.weight, k_norm.weight, q_norm.eps, rotary_emb.cos_sin_cache)
    return rotary_emb(positions, q_norm(q), k_norm(k))

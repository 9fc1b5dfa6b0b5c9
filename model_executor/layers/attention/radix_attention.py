"""RadixAttention: the model's attention layer; it holds the layer's shape and calls the backend.

Given the model's RotaryEmbedding, it also applies the rotary: q and k come in unrotated (and, given
Qwen3's per-head q/k norms, unnormalised). A backend that fuses the rotary into its KV store for the batch
(AttentionBackend.fuses_rotary: triton, decode) gets them so, with the positions, and applies the norms
too; everywhere else (other backends, extend batches, inside a piecewise pass) the norms and the rotary
run first, as their own op (qk_norm_rope.norm_and_rotate), and attention gets rotated q and k.

While a piecewise extend pass runs (model_executor/layers/attention/forward_context.py), it calls the `duet::attention` op instead,
which torch.compile sees as opaque and the piecewise runner splits the traced graph at; the op runs the
same backend call on the real tokens. Otherwise: the plain backend call.
"""

from __future__ import annotations

import torch
from torch import nn

from model_executor.forward_batch import ForwardBatch
from model_executor.layers.attention import forward_context
from model_executor.layers.attention.attention_op import unified_attention
from model_executor.layers.norm import RMSNorm
from model_executor.layers.qk_norm_rope import norm_and_rotate
from model_executor.layers.rotary import RotaryEmbedding
from model_executor.layers.rotary_store_kv import RopeStore
from model_executor.layers.triton_ops.small_m_gemm_dispatch import MAX_FUSED_ROWS as SMALL_M_FUSED_ROWS


class RadixAttention(nn.Module):
    def __init__(self, layer_id: int, num_heads: int, num_kv_heads: int, head_dim: int, scaling: float,
                 rotary_emb: RotaryEmbedding | None = None, qk_norm: tuple[RMSNorm, RMSNorm] | None = None,
                 sliding_window: int | None = None, sinks: bool = False):
        super().__init__()
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding window {sliding_window} must be at least 1")
        # A query at position p attends to positions p - sliding_window + 1 .. p (None: all before it)
        self.sliding_window = sliding_window
        self.layer_id = layer_id
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scaling = scaling
        self.rotary_emb = rotary_emb  # the model's shared table (a module registered here too, held once)
        if qk_norm is not None and rotary_emb is None:
            raise ValueError("q/k norms are applied with the rotary: give the rotary embedding too")
        # (q_norm, k_norm): the model's modules, held in a tuple so that they are not registered here too
        # (their parameters keep the checkpoint's names, under the model's attention module)
        self.qk_norm = qk_norm
        # gpt-oss: a learned logit per query head that joins each query's softmax denominator with no value
        # (loaded from the checkpoint's `self_attn.sinks`); None: plain softmax
        self.sinks = nn.Parameter(torch.empty(num_heads), requires_grad=False) if sinks else None

    def rope_store(self, fb: ForwardBatch, positions: torch.Tensor) -> RopeStore | None:
        """For a decode batch of up to SMALL_M_FUSED_ROWS tokens whose backend lets the qkv projection store
        their K/V (kv_store_target): what that projection's kernel needs to run this layer's rotary and KV
        store itself (then forward_stored). None elsewhere, and for layers with q/k norms (they need whole
        heads)."""
        # (tracing first: a traced token count compared with 1 would add a guard to the graph)
        if forward_context.is_active() or torch.compiler.is_compiling():
            return None
        if (self.rotary_emb is None or self.rotary_emb.partial or self.qk_norm is not None or positions.dim() != 1
                or positions.shape[0] > SMALL_M_FUSED_ROWS):
            return None
        target = fb.attn_backend.kv_store_target(self, fb)
        if target is None:
            return None
        k_buffer, v_buffer, loc, k_scale, v_scale = target
        return RopeStore(positions, self.rotary_emb.cos_sin_cache, loc, k_buffer, v_buffer, self.num_heads,
                         self.num_kv_heads, k_scale, v_scale)

    def forward_stored(self, q: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        """Attention of rotated q [T, Hq*D] whose K/V the qkv projection stored (rope_store)."""
        return fb.attn_backend.forward(q, None, None, self, fb, kv_stored=True)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, fb: ForwardBatch,
                positions: torch.Tensor | None = None) -> torch.Tensor:
        """q: [T, Hq*D], k, v: [T, Hk*D] -> [T, Hq*D]. With a rotary embedding, q and k are unrotated (and
        unnormalised, with q/k norms) and positions [T] is required."""
        if self.rotary_emb is not None:
            if positions is None:
                raise ValueError("this attention layer applies the rotary embedding: positions are required")
            # (inside a piecewise pass the op below is opaque to tracing: the rotary stays in the pieces)
            if (not forward_context.is_active() and not self.rotary_emb.partial
                    and fb.attn_backend.fuses_rotary(fb)):
                return fb.attn_backend.forward(q, k, v, self, fb, positions=positions)
            t = q.shape[0]
            q, k = norm_and_rotate(positions, q.view(t, -1, self.head_dim), k.view(t, -1, self.head_dim),
                                   self.rotary_emb, self.qk_norm)
            q, k = q.reshape(t, -1), k.reshape(t, -1)
        if forward_context.is_active():
            return unified_attention(q, k, v, self.layer_id)
        return fb.attn_backend.forward(q, k, v, self, fb)


def attention_layers(model: nn.Module) -> dict[int, RadixAttention]:
    """The model's attention layers by layer_id: what a forward context gives the `duet::attention` op."""
    return {m.layer_id: m for m in model.modules() if isinstance(m, RadixAttention)}

"""RadixAttention: the model's attention layer; it holds the layer's shape and calls the backend.

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


class RadixAttention(nn.Module):
    def __init__(self, layer_id: int, num_heads: int, num_kv_heads: int, head_dim: int, scaling: float):
        super().__init__()
        self.layer_id = layer_id
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scaling = scaling

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        if forward_context.is_active():
            return unified_attention(q, k, v, self.layer_id)
        return fb.attn_backend.forward(q, k, v, self, fb)

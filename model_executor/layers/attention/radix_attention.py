"""RadixAttention: the model's attention layer; it holds the layer's shape and calls the backend."""

from __future__ import annotations

import torch
from torch import nn

from model_executor.forward_batch import ForwardBatch


class RadixAttention(nn.Module):
    def __init__(self, layer_id: int, num_heads: int, num_kv_heads: int, head_dim: int, scaling: float):
        super().__init__()
        self.layer_id = layer_id
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scaling = scaling

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        return fb.attn_backend.forward(q, k, v, self, fb)

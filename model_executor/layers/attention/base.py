"""The attention-backend interface, graph hooks included, so runners never branch on the backend."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from model_executor.forward_batch import ForwardBatch
    from model_executor.layers.attention.radix_attention import RadixAttention


class AttentionBackend(ABC):
    #: Whether decode batches through this backend may be captured in a full CUDA graph.
    supports_cuda_graph: bool = False

    def init_forward_metadata(self, fb: ForwardBatch) -> None:
        """Prepare per-batch metadata for an eager forward (default: nothing to prepare)."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: RadixAttention,
                fb: ForwardBatch, out: torch.Tensor | None = None) -> torch.Tensor:
        """q: [T, Hq*D], k/v: [T, Hk*D]. Stores the new K/V in the pool and attends into `out` [T, Hq*D]
        (allocated when not given; the piecewise runner passes the buffer its next piece reads) and returns it."""
        num_tokens = q.shape[0]
        if out is None:
            out = torch.empty_like(q)
        q = q.view(num_tokens, layer.num_heads, layer.head_dim)
        k = k.view(num_tokens, layer.num_kv_heads, layer.head_dim)
        v = v.view(num_tokens, layer.num_kv_heads, layer.head_dim)
        o = out.view(num_tokens, layer.num_heads, layer.head_dim)
        if fb.mode.is_decode():
            fb.kv_cache.set_kv(layer.layer_id, fb.out_cache_loc, k, v)
            self.forward_decode(q, layer, fb, o)
        else:
            self.forward_extend(q, k, v, layer, fb, o)
        return out

    @abstractmethod
    def forward_decode(self, q: torch.Tensor, layer: RadixAttention, fb: ForwardBatch, out: torch.Tensor) -> None:
        """q, out: [bs, Hq, D]; all K/V (the new token's included) are in the pool. Writes `out`."""

    @abstractmethod
    def forward_extend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: RadixAttention,
                       fb: ForwardBatch, out: torch.Tensor) -> None:
        """q, out: [T, Hq, D], k, v: [T, Hk, D] for the new tokens. Stores k, v at fb.out_cache_loc and
        attends causally over the cached prefix + the new tokens. Writes `out`."""

    # ---- graph hooks (decode CUDA graphs) -------------------------------------------------------
    def init_cuda_graph_state(self, max_bs: int) -> None:
        """Allocate static metadata once, at the largest captured batch size."""

    def cuda_graph_state_bytes(self, max_bs: int) -> int:
        """Device bytes init_cuda_graph_state(max_bs) will allocate (reserved before the KV cache is sized)."""
        return 0

    def init_forward_metadata_capture_cuda_graph(self, fb: ForwardBatch) -> None:
        """Fill static metadata for a capture at fb.batch_size (fb holds the static buffers)."""
        self.init_forward_metadata(fb)

    def init_forward_metadata_replay_cuda_graph(self, fb: ForwardBatch) -> None:
        """Refill static metadata from the real (padded) batch before a replay, on device."""
        self.init_forward_metadata(fb)

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        """The sequence length given to padding rows of a graph batch."""
        return 1

"""The attention-backend interface, graph hooks included, so runners never branch on the backend, and
AttentionLayer: what a backend reads of the layer it serves (RadixAttention, which calls the backend)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Hashable
from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from model_executor.forward_batch import ForwardBatch
    from model_executor.layers.norm import RMSNorm
    from model_executor.layers.rotary import RotaryEmbedding


class AttentionLayer(Protocol):
    """An attention layer's shape as the backends see it (RadixAttention implements it)."""

    layer_id: int  # the KV pool's layer index
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scaling: float
    rotary_emb: RotaryEmbedding | None  # for backends that fuse the rotary into the KV store
    qk_norm: tuple[RMSNorm, RMSNorm] | None  # Qwen3's per-head q/k norms, applied with the rotary
    # A query at position p attends to positions p - sliding_window + 1 .. p; None: to all up to p
    sliding_window: int | None
    # [num_heads] sink logits (gpt-oss): each joins its head's softmax denominator as a key with no value;
    # None: none
    sinks: torch.Tensor | None


class AttentionBackend(ABC):
    #: Whether decode batches through this backend may be captured in a full CUDA graph.
    supports_cuda_graph: bool = False
    #: Whether extend batches may be captured whole (attention inside the graph): the extend kernels read every
    #: length, row and slot from device tensors and size their grids by fb.max_extend_len alone.
    supports_extend_cuda_graph: bool = False

    def init_forward_metadata(self, fb: ForwardBatch) -> None:
        """Prepare per-batch metadata for an eager forward (default: nothing to prepare)."""

    def fuses_rotary(self, fb: ForwardBatch) -> bool:
        """Whether forward() takes this batch's q and k unrotated, with their positions, and applies the
        layer's rotary (and its q/k norms, layer.qk_norm) itself while it stores K/V (`rotary_store_kv`):
        one kernel instead of two."""
        return False

    def forward(self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, layer: AttentionLayer,
                fb: ForwardBatch, out: torch.Tensor | None = None, positions: torch.Tensor | None = None,
                kv_stored: bool = False) -> torch.Tensor:
        """q: [T, Hq*D], k/v: [T, Hk*D]. Stores the new K/V in the pool and attends into `out` [T, Hq*D]
        (allocated when not given; the piecewise runner passes the buffer its next piece reads) and returns it.
        positions: given only where fuses_rotary(fb): q and k are then still to be rotated. kv_stored (a
        decode batch whose kv_store_target took them): q is rotated, K/V are in the pool, k and v are None."""
        num_tokens = q.shape[0]
        if out is None:
            out = torch.empty((num_tokens, layer.num_heads * layer.head_dim), dtype=q.dtype, device=q.device)
        if kv_stored:
            if not fb.mode.is_decode():
                raise ValueError("only decode batches reach the attention backend with their K/V stored")
            self.forward_decode_stored(q.view(num_tokens, layer.num_heads, layer.head_dim), layer, fb,
                                       out.view(num_tokens, layer.num_heads, layer.head_dim))
            return out
        q = q.view(num_tokens, layer.num_heads, layer.head_dim)
        k = k.view(num_tokens, layer.num_kv_heads, layer.head_dim)
        v = v.view(num_tokens, layer.num_kv_heads, layer.head_dim)
        o = out.view(num_tokens, layer.num_heads, layer.head_dim)
        if positions is not None:
            if not fb.mode.is_decode():
                raise ValueError("unrotated q/k reach the attention backend only in decode batches")
            self.rotary_store_kv(positions, q, k, v, layer, fb)
            self.forward_decode(q, layer, fb, o)
        elif fb.mode.is_decode():
            fb.kv_cache.set_kv(layer.layer_id, fb.out_cache_loc, k, v)
            self.forward_decode(q, layer, fb, o)
        else:
            self.forward_extend(q, k, v, layer, fb, o)
        return out

    def rotary_store_kv(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        layer: AttentionLayer, fb: ForwardBatch) -> None:
        """q: [bs, Hq, D] rotated in place; k rotated and stored with v at fb.out_cache_loc; both normalised
        per head first where layer.qk_norm is set (backends whose fuses_rotary can be True)."""
        raise NotImplementedError(f"{type(self).__name__} does not fuse the rotary into its KV store")

    def kv_store_target(self, layer: AttentionLayer, fb: ForwardBatch) -> tuple | None:
        """(k_buffer, v_buffer, slots, k_scale, v_scale) where a decode batch's K/V may be stored by the
        qkv projection's kernel (with the rotary) before forward(..., kv_stored=True); None: forward stores
        them itself (the default)."""
        return None

    def forward_decode_stored(self, q: torch.Tensor, layer: AttentionLayer, fb: ForwardBatch,
                              out: torch.Tensor) -> None:
        """forward_decode right after the qkv projection's kernel stored the batch's K/V (kv_store_target) and
        wrote q: a backend may start its kernel before that one ends (the triton backend: PDL)."""
        self.forward_decode(q, layer, fb, out)

    @abstractmethod
    def forward_decode(self, q: torch.Tensor, layer: AttentionLayer, fb: ForwardBatch,
                       out: torch.Tensor) -> None:
        """q, out: [bs, Hq, D]; all K/V (the new token's included) are in the pool. Writes `out`."""

    @abstractmethod
    def forward_extend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: AttentionLayer,
                       fb: ForwardBatch, out: torch.Tensor) -> None:
        """q, out: [T, Hq, D], k, v: [T, Hk, D] for the new tokens. Stores k, v at fb.out_cache_loc and
        attends causally over the cached prefix + the new tokens. Writes `out`."""

    # ---- graph hooks (decode CUDA graphs) -------------------------------------------------------
    def init_cuda_graph_state(self, max_bs: int) -> None:
        """Allocate static metadata once, at the largest captured batch size."""

    def cuda_graph_state_bytes(self, max_bs: int) -> int:
        """Device bytes init_cuda_graph_state(max_bs) will allocate (reserved before the KV cache is sized)."""
        return 0

    def decode_graph_variants(self, bs: int) -> tuple[Hashable, ...]:
        """The decode kernel plans this backend may launch at batch size bs. A graph fixes its kernels'
        grids, so the decode graph runner captures one graph per plan and replays the one
        decode_graph_variant picks."""
        return (None,)

    def decode_graph_variant(self, fb: ForwardBatch) -> Hashable:
        """The plan for a (padded) batch about to replay, from host values only (fb.seq_lens_cpu)."""
        return None

    def init_forward_metadata_capture_cuda_graph(self, fb: ForwardBatch, variant: Hashable = None) -> None:
        """Fill static metadata for a capture at fb.batch_size (fb holds the static buffers) of the plan
        `variant` (one of decode_graph_variants(fb.batch_size))."""
        self.init_forward_metadata(fb)

    def init_forward_metadata_replay_cuda_graph(self, fb: ForwardBatch) -> None:
        """Refill static metadata from the real (padded) batch before a replay, on device."""
        self.init_forward_metadata(fb)

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        """The sequence length given to padding rows of a graph batch."""
        return 1

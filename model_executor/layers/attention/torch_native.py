"""torch_native: attention in plain PyTorch through scaled_dot_product_attention (the CPU default; also
runs on GPU, eager only).

Decode gathers each request's K/V slots once per layer from one slot table built per step
(init_forward_metadata), padded to the longest request with a length mask; the query heads of a KV group
ride as the query-length dimension of SDPA, so grouped-query attention needs no copy of K/V. Extend runs
one SDPA per request: without a cached prefix the new tokens' own K/V with is_causal; with one, the
request's slots gathered once and a causal mask shifted by the prefix, built for a bounded block of query
rows at a time so memory stays linear in the prompt.

A layer with a sliding window W (layer.sliding_window) masks the keys more than W - 1 positions before each
query: positions are absolute (a cached prefix and earlier chunks count), and keys outside the window stay in
the pool, unread.

A layer with attention sinks (layer.sinks, gpt-oss) runs the same masks through an explicit softmax whose
denominator also takes exp(sink) of the query's head (SDPA has no such term).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from model_executor.forward_batch import ForwardBatch
from model_executor.layers.attention.base import AttentionBackend, AttentionLayer

# Query rows per SDPA call when an extend has a cached prefix: the offset mask is rows x kv_len bools.
PREFIX_QUERY_BLOCK = 1024


@dataclass
class DecodeMetadata:
    batch: ForwardBatch  # the batch these were built for
    slots: torch.Tensor  # [bs, max_len] int64 KV slots (past each request's length: row padding, masked)
    mask: torch.Tensor | None  # [bs, 1, 1, max_len] True = attend; None when every request has max_len
    window_masks: dict[int, torch.Tensor] = field(default_factory=dict)  # by window: mask and the window's

    def window_mask(self, window: int | None) -> torch.Tensor | None:
        """The mask of a layer with this sliding window (None: self.mask): request b attends to positions
        seq_len[b] - window .. seq_len[b] - 1, built once per window and batch."""
        if window is None or window >= self.slots.shape[1]:
            return self.mask
        if window not in self.window_masks:
            fb = self.batch
            positions = torch.arange(self.slots.shape[1], device=self.slots.device)[None, :]
            lens = fb.seq_lens[:, None]
            self.window_masks[window] = ((positions < lens) & (positions >= lens - window))[:, None, None, :]
        return self.window_masks[window]


class TorchNativeBackend(AttentionBackend):
    def __init__(self) -> None:
        self.decode_metadata: DecodeMetadata | None = None

    def init_forward_metadata(self, fb: ForwardBatch) -> None:
        if not fb.mode.is_decode():
            self.decode_metadata = None
            return
        max_len = max(fb.seq_lens_cpu)
        slots = fb.req_to_token_pool.req_to_token[fb.req_pool_indices, :max_len].long()
        mask = None
        if min(fb.seq_lens_cpu) != max_len:
            positions = torch.arange(max_len, device=slots.device)
            mask = (positions[None, :] < fb.seq_lens[:, None])[:, None, None, :]
        self.decode_metadata = DecodeMetadata(fb, slots, mask)

    def forward_decode(self, q: torch.Tensor, layer: AttentionLayer, fb: ForwardBatch,
                       out: torch.Tensor) -> None:
        if self.decode_metadata is None or self.decode_metadata.batch is not fb:
            self.init_forward_metadata(fb)  # a caller that runs the model directly (tests, references)
        meta = self.decode_metadata
        k_buf, v_buf = fb.kv_cache.get_kv(layer.layer_id)
        bs, hk = q.shape[0], layer.num_kv_heads
        # [bs, L, Hk, D] -> [bs, Hk, L, D]; the group's query heads are SDPA's query rows: [bs, Hk, G, D].
        k = k_buf[meta.slots].transpose(1, 2)
        v = v_buf[meta.slots].transpose(1, 2)
        qg = q.view(bs, hk, layer.num_heads // hk, layer.head_dim)
        mask = meta.window_mask(getattr(layer, "sliding_window", None))
        sinks = getattr(layer, "sinks", None)
        if sinks is not None:  # query head h = kv head h // G, row h % G of SDPA's query rows
            sinks = sinks.view(1, hk, -1, 1)
        o = _attention(qg, k.to(q.dtype), v.to(q.dtype), mask, layer.scaling, sinks)
        out.copy_(o.reshape(out.shape))

    def forward_extend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: AttentionLayer,
                       fb: ForwardBatch, out: torch.Tensor) -> None:
        fb.kv_cache.set_kv(layer.layer_id, fb.out_cache_loc, k, v)
        k_buf, v_buf = fb.kv_cache.get_kv(layer.layer_id)
        req_to_token = fb.req_to_token_pool.req_to_token
        rows = fb.req_pool_indices.tolist()
        start = 0
        window = getattr(layer, "sliding_window", None)
        for row, seq_len, ext_len in zip(rows, fb.seq_lens_cpu, fb.extend_seq_lens_cpu):
            prefix = seq_len - ext_len
            qi = q[start : start + ext_len].transpose(0, 1)[None]  # [1, Hq, T, D]
            if prefix == 0:
                ki, vi = k[start : start + ext_len], v[start : start + ext_len]
            else:
                slots = req_to_token[row, :seq_len].long()
                ki, vi = k_buf[slots].to(q.dtype), v_buf[slots].to(q.dtype)
            ki, vi = ki.transpose(0, 1)[None], vi.transpose(0, 1)[None]  # [1, Hk, S, D]
            o = _causal_attention(qi, ki, vi, prefix, layer.scaling, window, getattr(layer, "sinks", None))
            out[start : start + ext_len] = o[0].transpose(0, 1)
            start += ext_len


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float,
               sinks: torch.Tensor | None) -> torch.Tensor:
    """SDPA of q [B, H, T, D] over k/v [B, Hk, S, D] (H a multiple of Hk: grouped-query) with a boolean mask
    (True = attend; None: all), or with sinks (broadcast to [B, H, T, 1]: a logit per query row that joins its
    softmax denominator) an explicit softmax in float32."""
    if sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    group = q.shape[1] // k.shape[1]
    if group > 1:
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    sink = sinks.float().expand(*scores.shape[:-1], 1)
    probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    return torch.matmul(probs, v.float()).to(q.dtype)


def _causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix: int, scale: float,
                      window: int | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q: [1, Hq, T, D] at positions prefix..prefix+T, k/v: [1, Hk, prefix+T, D] -> [1, Hq, T, D]; with a
    window, each query sees only the `window` positions up to its own; sinks: [Hq] sink logits."""
    t, s = q.shape[2], k.shape[2]
    if window is not None and window >= s:
        window = None  # no query reaches past its window
    if sinks is not None:
        sinks = sinks.view(1, -1, 1, 1)
    if prefix == 0 and window is None and sinks is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
    blocks = []
    for lo in range(0, t, PREFIX_QUERY_BLOCK):
        hi = min(lo + PREFIX_QUERY_BLOCK, t)
        # Keys after the block's last query, or before its first query's window, are masked for every row of
        # it: leave them out of the call.
        first = 0 if window is None else max(0, prefix + lo - window + 1)
        kv_pos = torch.arange(first, prefix + hi, device=q.device)
        q_pos = torch.arange(prefix + lo, prefix + hi, device=q.device)
        mask = kv_pos[None, :] <= q_pos[:, None]
        if window is not None:
            mask &= kv_pos[None, :] > q_pos[:, None] - window
        blocks.append(_attention(q[:, :, lo:hi], k[:, :, first : prefix + hi], v[:, :, first : prefix + hi], mask,
                                 scale, sinks))
    return blocks[0] if len(blocks) == 1 else torch.cat(blocks, dim=2)

"""torch_native: the reference attention backend in plain PyTorch (CPU and GPU, eager only)."""

from __future__ import annotations

import torch

from model_executor.forward_batch import ForwardBatch
from model_executor.layers.attention.base import AttentionBackend
from model_executor.layers.attention.radix_attention import RadixAttention


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """q: [B, T, Hq, D], k/v: [B, S, Hk, D], mask: [B, T, S] (True = attend). Returns [B, T, Hq, D].

    Computed in float32; grouped-query heads share their KV head without copying it.
    """
    b, t, hq, d = q.shape
    hk = k.shape[2]
    qg = q.float().view(b, t, hk, hq // hk, d)
    scores = torch.einsum("btkgd,bskd->bkgts", qg, k.float()) * scale
    scores = scores.masked_fill(~mask[:, None, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # rows with nothing to attend give zeros
    out = torch.einsum("bkgts,bskd->btkgd", probs, v.float())
    return out.reshape(b, t, hq, d).to(q.dtype)


class TorchNativeBackend(AttentionBackend):
    def forward_decode(self, q: torch.Tensor, layer: RadixAttention, fb: ForwardBatch, out: torch.Tensor) -> None:
        k_buf, v_buf = fb.kv_cache.get_kv(layer.layer_id)
        max_len = max(fb.seq_lens_cpu)
        slots = fb.req_to_token_pool.req_to_token[fb.req_pool_indices, :max_len].long()  # [bs, L]
        positions = torch.arange(max_len, device=q.device)
        mask = (positions[None, :] < fb.seq_lens[:, None])[:, None, :]  # [bs, 1, L]
        out.copy_(masked_attention(q[:, None], k_buf[slots], v_buf[slots], mask, layer.scaling)[:, 0])

    def forward_extend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: RadixAttention,
                       fb: ForwardBatch, out: torch.Tensor) -> None:
        fb.kv_cache.set_kv(layer.layer_id, fb.out_cache_loc, k, v)
        k_buf, v_buf = fb.kv_cache.get_kv(layer.layer_id)
        req_to_token = fb.req_to_token_pool.req_to_token
        rows = fb.req_pool_indices.tolist()
        start = 0
        for row, seq_len, ext_len in zip(rows, fb.seq_lens_cpu, fb.extend_seq_lens_cpu):
            prefix = seq_len - ext_len
            slots = req_to_token[row, :seq_len].long()
            q_pos = torch.arange(prefix, seq_len, device=q.device)
            kv_pos = torch.arange(seq_len, device=q.device)
            mask = (kv_pos[None, :] <= q_pos[:, None])[None]
            qi = q[start : start + ext_len][None]
            out[start : start + ext_len] = masked_attention(qi, k_buf[slots][None], v_buf[slots][None], mask,
                                                            layer.scaling)[0]
            start += ext_len

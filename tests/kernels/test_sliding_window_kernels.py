"""The Triton decode and extend attention kernels with a sliding window against a torch reference (Triton's CPU
interpreter without CUDA): each query at position p sees positions p - W + 1 .. p only, over cached prefixes
and chunk boundaries, at split counts and tiles that put the window's first key inside a chunk or a tile."""

from __future__ import annotations

import math

import pytest
import torch

from tests import triton_mode
from tests.kernels.test_triton_ops import _extend_case, make_pool, make_req_to_token
from tests.triton_mode import DEVICE, in_process

if not triton_mode.RERUN_IN_SUBPROCESS:
    from model_executor.layers.attention.triton_ops import decode_attention as decode_mod
    from model_executor.layers.attention.triton_ops import extend_attention as extend_mod

test_in_subprocess = triton_mode.subprocess_test(__file__)


def ref_window_attention(q, k_buffer, v_buffer, slots, q_positions, sm_scale, window, sinks=None):
    """q: [n, H, D] at q_positions; slots: [L] KV slots of positions 0..L-1; sinks [H] or None (each head's
    learned logit in the softmax's denominator only). fp32 [n, H, D]."""
    group = q.shape[1] // k_buffer.shape[1]
    k = k_buffer[slots.long()].float().repeat_interleave(group, dim=1)
    v = v_buffer[slots.long()].float().repeat_interleave(group, dim=1)
    scores = torch.einsum("nhd,lhd->hnl", q.float(), k) * sm_scale
    kv_pos = torch.arange(slots.numel(), device=q.device)[None, :]
    q_pos = q_positions.to(q.device)[:, None]
    visible = (kv_pos <= q_pos) & (kv_pos > q_pos - window)
    scores = scores.masked_fill(~visible[None], float("-inf"))
    if sinks is None:
        return torch.einsum("hnl,lhd->nhd", torch.softmax(scores, dim=-1), v)
    sink = sinks.float().view(-1, 1, 1).expand(-1, scores.shape[1], 1)
    probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    return torch.einsum("hnl,lhd->nhd", probs, v)


def decode(q, k_buf, v_buf, req_to_token, rows, seq_lens, num_kv_splits, window, tile=None, fused=None):
    bs, num_heads, head_dim = q.shape
    ws = decode_mod.alloc_decode_workspace(bs + 1, num_heads, head_dim, num_kv_splits, q.device)
    ws.attn_logits.fill_(float("nan"))
    ws.attn_lse.fill_(float("nan"))
    o = torch.full_like(q, float("nan"))
    decode_mod.decode_attention_fwd(
        q, k_buf, v_buf, o, req_to_token, torch.tensor(rows, device=q.device),
        torch.tensor(seq_lens, dtype=torch.int32, device=q.device), ws.attn_logits, ws.attn_lse, num_kv_splits,
        1 / math.sqrt(head_dim), min_chunk=16, tile=tile, counters=ws.counters, fused_combine=fused,
        sliding_window=window)
    return o


@in_process
@pytest.mark.parametrize("num_kv_splits,fused", [(1, None), (4, False), (4, True)])
@pytest.mark.parametrize("window", [1, 8, 40, 1000])
def test_decode_with_window_matches_reference(window, num_kv_splits, fused):
    gen = torch.Generator().manual_seed(window)
    num_heads, num_kv_heads, head_dim = 4, 2, 64
    seq_lens, rows = [1, 7, 37, 130], [3, 1, 5, 2]
    req_to_token = make_req_to_token(seq_lens, rows, 512, 256, gen)
    k_buf, v_buf = make_pool(512, num_kv_heads, head_dim, torch.float32, gen)
    q = torch.randn(len(rows), num_heads, head_dim, generator=gen).to(DEVICE)
    o = decode(q, k_buf, v_buf, req_to_token, rows, seq_lens, num_kv_splits, window, tile=(16, 4, 1), fused=fused)
    ref = torch.cat([ref_window_attention(q[b : b + 1], k_buf, v_buf, req_to_token[r, :n], torch.tensor([n - 1]),
                                          1 / math.sqrt(head_dim), window)
                     for b, (r, n) in enumerate(zip(rows, seq_lens))])
    torch.testing.assert_close(o, ref, atol=1e-4, rtol=1e-4)
    if window < max(seq_lens):  # the window changes the result: the kernel did not attend to everything
        full = decode(q, k_buf, v_buf, req_to_token, rows, seq_lens, num_kv_splits, None, tile=(16, 4, 1))
        assert not torch.allclose(full[-1], o[-1], atol=1e-3)


def extend(q, k_buf, v_buf, req_to_token, rows, prefix_lens, extend_lens, window, config):
    """extend_attention_fwd with the new tokens' K/V taken out of the pool (their slots poisoned with NaN)."""
    seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens)]
    start_loc = [sum(extend_lens[:i]) for i in range(len(extend_lens))]
    loc = torch.cat([req_to_token[r, p : p + e] for r, p, e in zip(rows, prefix_lens, extend_lens)]).long()
    k_new, v_new = k_buf[loc].clone(), v_buf[loc].clone()
    k_buf[loc] = float("nan")
    v_buf[loc] = float("nan")
    o = torch.full_like(q, float("nan"))
    dev = q.device
    extend_mod.extend_attention_fwd(
        q, k_new, v_new, o, k_buf, v_buf, loc, req_to_token, torch.tensor(rows, device=dev),
        torch.tensor(seq_lens, device=dev), torch.tensor(extend_lens, device=dev), torch.tensor(start_loc, device=dev),
        max(extend_lens), 1 / math.sqrt(q.shape[-1]), config=config, sliding_window=window)
    return o


@in_process
@pytest.mark.parametrize("config", [(16, 16, 4, 1), (32, 16, 4, 1), (16, 16, 4, 3)])
@pytest.mark.parametrize("window", [1, 8, 25, 500])
def test_extend_with_window_matches_reference(window, config):
    # a chunk with no prefix, chunks after 17 and 70 cached tokens (the window reaches into or past the prefix)
    prefix_lens, extend_lens = [0, 17, 70, 5], [5, 40, 60, 1]
    q, k_buf, v_buf, req_to_token, rows = _extend_case(4, 2, 64, prefix_lens, extend_lens, torch.float32, seed=3)
    o = extend(q, k_buf, v_buf, req_to_token, rows, prefix_lens, extend_lens, window,
               extend_mod.ExtendConfig(*config))
    outs, start = [], 0
    for r, p, e in zip(rows, prefix_lens, extend_lens):
        outs.append(ref_window_attention(q[start : start + e], k_buf, v_buf, req_to_token[r, : p + e],
                                         torch.arange(p, p + e), 1 / math.sqrt(64), window))
        start += e
    torch.testing.assert_close(o, torch.cat(outs), atol=1e-4, rtol=1e-4)

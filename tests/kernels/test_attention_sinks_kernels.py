"""The Triton decode and extend attention kernels with attention sinks (gpt-oss: a logit per query head that
joins each query's softmax denominator with no value) against a torch reference (Triton's CPU interpreter
without CUDA), with and without a sliding window, over split counts, the fused and the separate merge, and
tiles that cut the prefix and the new tokens into several blocks."""

from __future__ import annotations

import math

import pytest
import torch

from tests import triton_mode
from tests.kernels.test_sliding_window_kernels import ref_window_attention
from tests.kernels.test_triton_ops import _extend_case, make_pool, make_req_to_token
from tests.triton_mode import DEVICE, in_process

if not triton_mode.RERUN_IN_SUBPROCESS:
    from model_executor.layers.attention.triton_ops import decode_attention as decode_mod
    from model_executor.layers.attention.triton_ops import extend_attention as extend_mod

test_in_subprocess = triton_mode.subprocess_test(__file__)

NO_WINDOW = 10**6


def _sinks(num_heads, gen):
    return (torch.randn(num_heads, generator=gen) * 2).to(DEVICE)


@in_process
@pytest.mark.parametrize("num_kv_splits,fused", [(1, None), (4, False), (4, True)])
@pytest.mark.parametrize("window", [None, 8])
def test_decode_with_sinks_matches_reference(window, num_kv_splits, fused):
    gen = torch.Generator().manual_seed(1)
    num_heads, num_kv_heads, head_dim = 4, 2, 64
    seq_lens, rows = [1, 7, 37, 130], [3, 1, 5, 2]
    req_to_token = make_req_to_token(seq_lens, rows, 512, 256, gen)
    k_buf, v_buf = make_pool(512, num_kv_heads, head_dim, torch.float32, gen)
    q = torch.randn(len(rows), num_heads, head_dim, generator=gen).to(DEVICE)
    sinks = _sinks(num_heads, gen)
    bs = len(rows)
    ws = decode_mod.alloc_decode_workspace(bs + 1, num_heads, head_dim, num_kv_splits, q.device)
    o = torch.full_like(q, float("nan"))
    decode_mod.decode_attention_fwd(
        q, k_buf, v_buf, o, req_to_token, torch.tensor(rows, device=q.device),
        torch.tensor(seq_lens, dtype=torch.int32, device=q.device), ws.attn_logits, ws.attn_lse, num_kv_splits,
        1 / math.sqrt(head_dim), min_chunk=16, tile=(16, 4, 1), counters=ws.counters, fused_combine=fused,
        sliding_window=window, sinks=sinks)
    ref = torch.cat([ref_window_attention(q[b : b + 1], k_buf, v_buf, req_to_token[r, :n], torch.tensor([n - 1]),
                                        1 / math.sqrt(head_dim), window or NO_WINDOW, sinks)
                     for b, (r, n) in enumerate(zip(rows, seq_lens))])
    torch.testing.assert_close(o, ref, atol=1e-4, rtol=1e-4)


@in_process
@pytest.mark.parametrize("config", [(16, 16, 4, 1), (32, 16, 4, 3)])
@pytest.mark.parametrize("window", [None, 25])
def test_extend_with_sinks_matches_reference(window, config):
    # a chunk with no prefix, chunks after 17 and 70 cached tokens, a one-token chunk
    prefix_lens, extend_lens = [0, 17, 70, 5], [5, 40, 60, 1]
    q, k_buf, v_buf, req_to_token, rows = _extend_case(4, 2, 64, prefix_lens, extend_lens, torch.float32, seed=3)
    sinks = _sinks(4, torch.Generator().manual_seed(2))
    seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens)]
    start_loc = [sum(extend_lens[:i]) for i in range(len(extend_lens))]
    loc = torch.cat([req_to_token[r, p : p + e] for r, p, e in zip(rows, prefix_lens, extend_lens)]).long()
    k_new, v_new = k_buf[loc].clone(), v_buf[loc].clone()
    o = torch.full_like(q, float("nan"))
    dev = q.device
    extend_mod.extend_attention_fwd(
        q, k_new, v_new, o, k_buf, v_buf, loc, req_to_token, torch.tensor(rows, device=dev),
        torch.tensor(seq_lens, device=dev), torch.tensor(extend_lens, device=dev), torch.tensor(start_loc, device=dev),
        max(extend_lens), 1 / math.sqrt(64), config=extend_mod.ExtendConfig(*config), sliding_window=window,
        sinks=sinks)
    outs, start = [], 0
    for r, p, e in zip(rows, prefix_lens, extend_lens):
        outs.append(ref_window_attention(q[start : start + e], k_buf, v_buf, req_to_token[r, : p + e],
                                       torch.arange(p, p + e), 1 / math.sqrt(64), window or NO_WINDOW, sinks))
        start += e
    torch.testing.assert_close(o, torch.cat(outs), atol=1e-4, rtol=1e-4)

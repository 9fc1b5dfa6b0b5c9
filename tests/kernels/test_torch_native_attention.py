"""torch_native (SDPA) attention equals a plain softmax reference on random paged batches: cached prefixes,
requests of different lengths (decode padding), grouped-query heads, and query blocks of a long extend."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from model_executor.forward_batch import ForwardBatch, ForwardMode
from model_executor.layers.attention import torch_native
from model_executor.layers.attention.radix_attention import RadixAttention
from model_executor.layers.attention.torch_native import TorchNativeBackend
from model_executor.memory_pool import KVCache, ReqToTokenPool

HEAD_DIM = 16


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, scale: float) -> torch.Tensor:
    """One request: q [T, Hq, D] at positions q_pos, k/v [S, Hk, D] at positions 0..S; float64 softmax."""
    group = q.shape[1] // k.shape[1]
    k = k.double().repeat_interleave(group, dim=1)
    v = v.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("thd,shd->hts", q.double(), k) * scale
    allowed = torch.arange(k.shape[0])[None, :] <= q_pos[:, None]
    scores = scores.masked_fill(~allowed[None], float("-inf"))
    return torch.einsum("hts,shd->thd", scores.softmax(-1), v).float()


@dataclass
class Case:
    fb: ForwardBatch
    layer: RadixAttention
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    full_k: list[torch.Tensor]  # per request, every position's K (prefix + new)
    full_v: list[torch.Tensor]


def make_case(mode: ForwardMode, prefixes: list[int], new: list[int], hq: int, hk: int, seed: int) -> Case:
    """Requests with `prefixes[i]` tokens already in the pool (scattered slots) and `new[i]` tokens now."""
    g = torch.Generator().manual_seed(seed)
    total = sum(prefixes) + sum(new)
    pool = ReqToTokenPool(len(prefixes), max(p + n for p, n in zip(prefixes, new)), "cpu")
    kv = KVCache(total + 8, 1, hk, HEAD_DIM, torch.float32, "cpu")
    slots = (torch.randperm(total + 8, generator=g)[:total] + 1).long()  # scattered, never slot 0
    layer = RadixAttention(0, hq, hk, HEAD_DIM, HEAD_DIM**-0.5)
    rows, full_k, full_v, out_loc, qs, ks, vs, used = [], [], [], [], [], [], [], 0
    for p, n in zip(prefixes, new):
        row = pool.alloc()
        rows.append(row)
        mine = slots[used : used + p + n]
        used += p + n
        pool.write(row, 0, mine)
        kf = torch.randn(p + n, hk, HEAD_DIM, generator=g)
        vf = torch.randn(p + n, hk, HEAD_DIM, generator=g)
        kv.set_kv(0, mine[:p], kf[:p], vf[:p])
        full_k.append(kf)
        full_v.append(vf)
        out_loc.append(mine[p:])
        qs.append(torch.randn(n, hq, HEAD_DIM, generator=g))
        ks.append(kf[p:])
        vs.append(vf[p:])
    seq_lens = [p + n for p, n in zip(prefixes, new)]
    ids = [1] * sum(new)
    fb = ForwardBatch.build(mode, ids, rows, seq_lens, torch.cat(out_loc),
                            extend_seq_lens=None if mode.is_decode() else new, req_to_token_pool=pool,
                            kv_cache=kv, attn_backend=TorchNativeBackend(), device="cpu")
    return Case(fb, layer, torch.cat(qs), torch.cat(ks), torch.cat(vs), full_k, full_v)


def expected(case: Case, prefixes: list[int], new: list[int]) -> torch.Tensor:
    outs, start = [], 0
    for i, (p, n) in enumerate(zip(prefixes, new)):
        q = case.q[start : start + n]
        outs.append(reference(q, case.full_k[i], case.full_v[i], torch.arange(p, p + n), case.layer.scaling))
        start += n
    return torch.cat(outs)


def run(case: Case) -> torch.Tensor:
    t = case.q.shape[0]
    case.fb.attn_backend.init_forward_metadata(case.fb)
    out = case.fb.attn_backend.forward(case.q.reshape(t, -1), case.k.reshape(t, -1), case.v.reshape(t, -1),
                                       case.layer, case.fb)
    return out.view(t, case.layer.num_heads, HEAD_DIM)


@pytest.mark.parametrize("hq,hk", [(4, 4), (6, 2), (8, 1)])
def test_extend_with_prefixes_matches_reference(hq, hk):
    prefixes, new = [0, 5, 17, 0], [9, 1, 6, 3]
    case = make_case(ForwardMode.EXTEND, prefixes, new, hq, hk, seed=hq * 10 + hk)
    torch.testing.assert_close(run(case), expected(case, prefixes, new), atol=1e-5, rtol=1e-5)
    # The new tokens' K/V went to their slots.
    k_buf, _ = case.fb.kv_cache.get_kv(0)
    torch.testing.assert_close(k_buf[case.fb.out_cache_loc], case.k)


@pytest.mark.parametrize("hq,hk", [(4, 4), (6, 2), (8, 1)])
def test_decode_with_padding_matches_reference(hq, hk):
    prefixes, new = [3, 20, 0, 11], [1, 1, 1, 1]  # lengths 4, 21, 1, 12: rows padded to 21 and masked
    case = make_case(ForwardMode.DECODE, prefixes, new, hq, hk, seed=hq * 10 + hk + 1)
    torch.testing.assert_close(run(case), expected(case, prefixes, new), atol=1e-5, rtol=1e-5)


def test_decode_equal_lengths_matches_reference():
    prefixes, new = [7, 7], [1, 1]  # no mask needed
    case = make_case(ForwardMode.DECODE, prefixes, new, 6, 2, seed=3)
    assert case.fb.attn_backend.decode_metadata is None
    torch.testing.assert_close(run(case), expected(case, prefixes, new), atol=1e-5, rtol=1e-5)


def test_long_prefixed_extend_in_query_blocks(monkeypatch):
    """A prefixed extend longer than a query block: each block's causal offset is its own."""
    monkeypatch.setattr(torch_native, "PREFIX_QUERY_BLOCK", 4)
    prefixes, new = [6, 2], [11, 9]
    case = make_case(ForwardMode.EXTEND, prefixes, new, 6, 2, seed=4)
    torch.testing.assert_close(run(case), expected(case, prefixes, new), atol=1e-5, rtol=1e-5)

"""Decode attention's fused combine (stage 1 merges the chunks, no stage-2 launch) against the two-stage path.

The two must give the same bits, and the arrival counters must be left at zero for the next call. In
Triton's CPU interpreter the programs run one after another, so the highest split of a (request, head
block) is always the one that combines; tests/kernels/test_decode_combine_gpu.py covers any arrival order.
"""

from __future__ import annotations

import math

import pytest
import torch

from tests import triton_mode
from tests.triton_mode import DEVICE, in_process

if not triton_mode.RERUN_IN_SUBPROCESS:
    from model_executor.layers.attention.triton_ops import decode_attention as decode_mod


test_in_subprocess = triton_mode.subprocess_test(__file__)

NUM_SLOTS = 2048


def make_inputs(seq_lens, num_heads, num_kv_heads, head_dim, seed):
    """A pool with scattered slots, request rows 1..bs (row 0 maps position 0 to the reserved slot 0)."""
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(NUM_SLOTS + 1, num_kv_heads, head_dim, generator=gen).to(DEVICE)
    v = torch.randn(NUM_SLOTS + 1, num_kv_heads, head_dim, generator=gen).to(DEVICE)
    req_to_token = torch.zeros(len(seq_lens) + 1, max(seq_lens), dtype=torch.int32)
    perm = torch.randperm(NUM_SLOTS, generator=gen).to(torch.int32) + 1
    used = 0
    for row, n in enumerate(seq_lens, start=1):
        req_to_token[row, :n] = perm[used : used + n]
        used += n
    q = torch.randn(len(seq_lens), num_heads, head_dim, generator=gen).to(DEVICE)
    return q, k, v, req_to_token.to(DEVICE)


def decode(inputs, seq_lens, workspace, num_kv_splits, fused, min_chunk, tile=None):
    q, k, v, req_to_token = inputs
    logits, lse, counters = workspace
    logits.fill_(float("nan"))  # stale partials must not reach the output
    lse.fill_(float("nan"))
    o = torch.full_like(q, float("nan"))
    decode_mod.decode_attention_fwd(
        q, k, v, o, req_to_token, torch.arange(1, len(seq_lens) + 1, device=DEVICE),
        torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE), logits, lse, num_kv_splits,
        1 / math.sqrt(q.shape[-1]), min_chunk=min_chunk, counters=counters, fused_combine=fused, tile=tile)
    return o


def ref_decode(inputs, seq_lens):
    q, k, v, req_to_token = inputs
    group = q.shape[1] // k.shape[1]
    outs = []
    for b, n in enumerate(seq_lens):
        slots = req_to_token[b + 1, :n].long()
        kk = k[slots].repeat_interleave(group, dim=1)
        vv = v[slots].repeat_interleave(group, dim=1)
        p = torch.softmax(torch.einsum("hd,lhd->hl", q[b], kk) / math.sqrt(q.shape[-1]), dim=-1)
        outs.append(torch.einsum("hl,lhd->hd", p, vv))
    return torch.stack(outs)


def chunk_plan(seq_len, num_kv_splits, min_chunk, block_n):
    """_split_bounds on the host: [(start, end)] of a request's chunks."""
    def cdiv(a, b):
        return -(-a // b)

    n = min(cdiv(seq_len, min_chunk), num_kv_splits)
    per = cdiv(cdiv(seq_len, max(n, 1)), block_n) * block_n
    return [(per * i, min(per * i + per, seq_len)) for i in range(n)]


def two_stage_then_fused(monkeypatch, inputs, seq_lens, workspace, num_kv_splits, min_chunk, tile=None):
    """Both paths on the same inputs; the fused one with stage 2 taken away, so it must merge by itself."""
    two_stage = decode(inputs, seq_lens, workspace, num_kv_splits, False, min_chunk, tile)

    class NoStage2:
        def __getitem__(self, grid):
            raise AssertionError("the fused combine launched stage 2")

    monkeypatch.setattr(decode_mod, "_decode_stage2_kernel", NoStage2())
    fused = decode(inputs, seq_lens, workspace, num_kv_splits, True, min_chunk, tile)
    monkeypatch.undo()
    return two_stage, fused


# (num_heads, num_kv_heads, head_dim): GQA with one head block per kv head; a group of 20 > BLOCK_H (two head
# blocks per kv head, the second partly masked) over two kv heads; MHA with a head dim not a power of two
@in_process
@pytest.mark.parametrize("heads", [(8, 2, 64), (40, 2, 32), (3, 3, 80)], ids=["gqa", "group20", "mha80"])
@pytest.mark.parametrize("tile", [None, (16, 2, 3, True)], ids=["rule", "warp_splits"])
def test_fused_combine_same_bits_as_two_stage(monkeypatch, heads, tile):
    num_heads, num_kv_heads, head_dim = heads
    # 1: one position; 20: shorter than one chunk; 300: every split, the last ones left empty by the
    # alignment (they must still arrive); 64 / 65: one chunk / two
    seq_lens, num_kv_splits, min_chunk = [1, 20, 300, 64, 65, 157], 8, 32
    block_n = (tile or decode_mod.stage1_tile(len(seq_lens), head_dim, num_kv_heads))[0]
    plan = chunk_plan(300, num_kv_splits, min_chunk, block_n)
    assert len(plan) == num_kv_splits and plan[-1][1] <= plan[-1][0], "the case must have an empty chunk"
    assert decode_mod.triton.cdiv(num_heads // num_kv_heads, decode_mod.BLOCK_H) == (2 if num_heads == 40 else 1)
    inputs = make_inputs(seq_lens, num_heads, num_kv_heads, head_dim, seed=0)
    workspace = decode_mod.alloc_decode_workspace(len(seq_lens) + 1, num_heads, head_dim, num_kv_splits, DEVICE)

    two_stage, fused = two_stage_then_fused(monkeypatch, inputs, seq_lens, workspace, num_kv_splits, min_chunk,
                                            tile)
    assert torch.equal(fused, two_stage)
    torch.testing.assert_close(fused, ref_decode(inputs, seq_lens), atol=1e-4, rtol=1e-4)


@in_process
def test_fused_combine_leaves_counters_zero_for_the_next_call(monkeypatch):
    """A second call with other lengths (other chunk counts) on the same workspace is still right: a counter
    left at the first call's count would never reach the second's, and its heads would stay unwritten.
    (A request of no tokens, which the engine never makes, gets zeros from both paths.)"""
    num_heads, num_kv_heads, head_dim, num_kv_splits, min_chunk = 20, 1, 32, 4, 32
    workspace = decode_mod.alloc_decode_workspace(4, num_heads, head_dim, num_kv_splits, DEVICE)
    for seed, seq_lens in enumerate([[200, 7, 90, 0], [33, 150, 1, 64]]):
        inputs = make_inputs(seq_lens, num_heads, num_kv_heads, head_dim, seed)
        two_stage, fused = two_stage_then_fused(monkeypatch, inputs, seq_lens, workspace, num_kv_splits,
                                                min_chunk)
        assert torch.equal(fused, two_stage), f"call {seed}"
        assert workspace.counters.count_nonzero().item() == 0, f"call {seed}"


@in_process
@pytest.mark.parametrize("num_kv_splits", [3, 5, 12])
def test_merge_takes_only_the_written_splits(monkeypatch, num_kv_splits):
    """Both merges load a request's splits as one tile of next_pow2(num_kv_splits) rows per head: rows past
    the split count, past the request's chunks, and chunks left empty by the alignment hold stale workspace
    (NaN here) and must be masked out; a request of no tokens gets zeros, not NaN."""
    num_heads, num_kv_heads, head_dim, min_chunk = 8, 2, 64, 32
    seq_lens = [0, 1, 33, 97, 161, 300, 515]
    block_n = decode_mod.stage1_tile(len(seq_lens), head_dim, num_kv_heads)[0]
    plans = [chunk_plan(n, num_kv_splits, min_chunk, block_n) for n in seq_lens]
    assert any(0 < len(p) < num_kv_splits for p in plans), "the case must have a request with unused splits"
    assert any(end <= start for p in plans for start, end in p), "the case must have an empty chunk"
    inputs = make_inputs(seq_lens, num_heads, num_kv_heads, head_dim, seed=num_kv_splits)
    workspace = decode_mod.alloc_decode_workspace(len(seq_lens), num_heads, head_dim, num_kv_splits, DEVICE)

    two_stage, fused = two_stage_then_fused(monkeypatch, inputs, seq_lens, workspace, num_kv_splits, min_chunk)
    assert torch.equal(fused, two_stage)
    assert torch.equal(two_stage[0], torch.zeros_like(two_stage[0]))
    torch.testing.assert_close(two_stage, ref_decode(inputs, seq_lens), atol=1e-4, rtol=1e-4)


@in_process
@pytest.mark.parametrize("bs", [1, 2])
def test_default_merges_in_stage_one_at_one_request(monkeypatch, bs):
    """Given the counters and no choice, a batch of one request merges in stage 1 (the measured default:
    fused_combine_default), two requests launch stage 2; without the counters, stage 2 always."""
    num_heads, num_kv_heads, head_dim, num_kv_splits = 8, 2, 64, 4
    seq_lens = [150, 70][:bs]
    inputs = make_inputs(seq_lens, num_heads, num_kv_heads, head_dim, seed=bs)
    q, k, v, req_to_token = inputs
    ws = decode_mod.alloc_decode_workspace(bs, num_heads, head_dim, num_kv_splits, DEVICE)
    launches = []
    stage2 = decode_mod._decode_stage2_kernel

    class CountStage2:
        def __getitem__(self, grid):
            launches.append(grid)
            return stage2[grid]

    monkeypatch.setattr(decode_mod, "_decode_stage2_kernel", CountStage2())
    rows = torch.arange(1, bs + 1, device=DEVICE)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    for counters in (ws.counters, None):
        o = torch.full_like(q, float("nan"))
        decode_mod.decode_attention_fwd(q, k, v, o, req_to_token, rows, lens, ws.attn_logits, ws.attn_lse,
                                        num_kv_splits, 1 / math.sqrt(head_dim), counters=counters)
        torch.testing.assert_close(o, ref_decode(inputs, seq_lens), atol=1e-4, rtol=1e-4)
    assert len(launches) == (1 if bs == 1 else 2)

"""Triton attention kernels (decode split-KV, extend) against a torch reference.

Without CUDA the kernels run in Triton's CPU interpreter (tests/triton_mode.py sets it up before triton is
imported; on a GPU machine they run compiled).
"""

from __future__ import annotations

import math

import pytest
import torch

from tests import triton_mode
from tests.triton_mode import DEVICE, in_process

if not triton_mode.RERUN_IN_SUBPROCESS:
    from model_executor.layers.attention.triton_ops import decode_attention as decode_mod
    from model_executor.layers.attention.triton_ops import extend_attention as extend_mod


test_in_subprocess = triton_mode.subprocess_test(__file__)


# ---------------------------------------------------------------- reference and fixtures


def ref_attention(q, k_buffer, v_buffer, slots, q_positions, sm_scale):
    """q: [n, H, D]; slots: [L] KV slots of positions 0..L-1; q_positions: [n]. Returns fp32 [n, H, D]."""
    num_heads, num_kv_heads = q.shape[1], k_buffer.shape[1]
    group = num_heads // num_kv_heads
    k = k_buffer[slots.long()].float().repeat_interleave(group, dim=1)  # [L, H, D]
    v = v_buffer[slots.long()].float().repeat_interleave(group, dim=1)
    scores = torch.einsum("nhd,lhd->hnl", q.float(), k) * sm_scale
    visible = torch.arange(slots.numel(), device=q.device)[None, :] <= q_positions.to(q.device)[:, None]
    scores = scores.masked_fill(~visible[None], float("-inf"))  # visible: [n, L]
    return torch.einsum("hnl,lhd->nhd", torch.softmax(scores, dim=-1), v)


def make_pool(num_slots, num_kv_heads, head_dim, dtype, gen, device=DEVICE):
    k = torch.randn(num_slots + 1, num_kv_heads, head_dim, generator=gen).to(device, dtype)
    v = torch.randn(num_slots + 1, num_kv_heads, head_dim, generator=gen).to(device, dtype)
    return k, v


def make_req_to_token(seq_lens, rows, num_slots, max_ctx, gen, device=DEVICE):
    """Scattered, distinct slots (1..num_slots) per request; row 0 stays all zeros (the padding row)."""
    req_to_token = torch.zeros(max(rows) + 2, max_ctx, dtype=torch.int32)
    perm = torch.randperm(num_slots, generator=gen) + 1
    used = 0
    for row, n in zip(rows, seq_lens):
        if row == 0:
            continue
        req_to_token[row, :n] = perm[used : used + n].to(torch.int32)
        used += n
    assert used <= num_slots
    return req_to_token.to(device)


# ---------------------------------------------------------------- decode


def run_decode(mod, q, k_buf, v_buf, req_to_token, rows, seq_lens, num_kv_splits, sm_scale,
               seq_dtype=torch.int32, min_chunk=None, workspace=None, tile=None):
    bs, num_heads, head_dim = q.shape
    if workspace is None:
        workspace = mod.alloc_decode_workspace(bs + 2, num_heads, head_dim, num_kv_splits, q.device)
    attn_logits, attn_lse, counters = workspace
    attn_logits.fill_(float("nan"))  # stale workspace must not leak into the result
    attn_lse.fill_(float("nan"))
    o = torch.full_like(q, float("nan"))
    mod.decode_attention_fwd(
        q, k_buf, v_buf, o, req_to_token,
        torch.tensor(rows, dtype=torch.int64, device=q.device),
        torch.tensor(seq_lens, dtype=seq_dtype, device=q.device),
        attn_logits, attn_lse, num_kv_splits, sm_scale,
        **({} if min_chunk is None else {"min_chunk": min_chunk}), tile=tile, counters=counters,
    )
    return o


def ref_decode(q, k_buf, v_buf, req_to_token, rows, seq_lens, sm_scale):
    outs = []
    for b, (row, n) in enumerate(zip(rows, seq_lens)):
        slots = req_to_token[row, :n]
        outs.append(ref_attention(q[b : b + 1], k_buf, v_buf, slots, torch.tensor([n - 1], device=q.device), sm_scale))
    return torch.cat(outs)


@in_process
@pytest.mark.parametrize(
    "num_heads,num_kv_heads,head_dim,num_kv_splits,seq_dtype",
    [
        (4, 2, 64, 4, torch.int32),   # GQA, one head block per kv head
        (20, 1, 64, 3, torch.int64),  # group 20 > BLOCK_H: two head blocks, the second partly masked
        (2, 2, 128, 8, torch.int32),  # MHA, head_dim 128
        (3, 1, 80, 2, torch.int32),   # head_dim not a power of two
    ],
)
def test_decode_matches_reference(num_heads, num_kv_heads, head_dim, num_kv_splits, seq_dtype):
    gen = torch.Generator().manual_seed(0)
    num_slots, max_ctx = 1024, 512
    # 1: a single key; 37 and 300: several chunks (rounded up to BLOCK_N), some splits left empty
    seq_lens = [1, 37, 300]
    rows = [3, 1, 5]
    req_to_token = make_req_to_token(seq_lens, rows, num_slots, max_ctx, gen)
    k_buf, v_buf = make_pool(num_slots, num_kv_heads, head_dim, torch.float32, gen)
    # q as a strided view (like a slice of a fused qkv output)
    qkv = torch.randn(len(seq_lens), num_heads * head_dim * 2, generator=gen)
    qkv = qkv.to(DEVICE)
    q = qkv[:, : num_heads * head_dim].view(len(seq_lens), num_heads, head_dim)
    assert not q.is_contiguous()
    sm_scale = 1.0 / math.sqrt(head_dim)

    o = run_decode(decode_mod, q, k_buf, v_buf, req_to_token, rows, seq_lens, num_kv_splits, sm_scale, seq_dtype)
    ref = ref_decode(q, k_buf, v_buf, req_to_token, rows, seq_lens, sm_scale)
    torch.testing.assert_close(o, ref, atol=1e-4, rtol=1e-4)


@in_process
def test_decode_padding_rows_are_finite():
    """Graph padding rows: seq_len 1, request row 0, which maps position 0 to the reserved slot 0."""
    gen = torch.Generator().manual_seed(1)
    num_heads, num_kv_heads, head_dim, num_slots = 4, 2, 64, 256
    seq_lens = [45, 1, 1]
    rows = [2, 0, 0]
    req_to_token = make_req_to_token(seq_lens, rows, num_slots, 128, gen)
    k_buf, v_buf = make_pool(num_slots, num_kv_heads, head_dim, torch.float32, gen)
    q = torch.randn(3, num_heads, head_dim, generator=gen).to(DEVICE)
    o = run_decode(decode_mod, q, k_buf, v_buf, req_to_token, rows, seq_lens, 8, 0.125)
    assert torch.isfinite(o).all()
    # a single key: the output is that key's value (slot 0), repeated over the query group
    torch.testing.assert_close(o[1], v_buf[0].repeat_interleave(2, dim=0), atol=1e-5, rtol=1e-5)
    ref = ref_decode(q, k_buf, v_buf, req_to_token, rows, seq_lens, 0.125)
    torch.testing.assert_close(o, ref, atol=1e-4, rtol=1e-4)


@in_process
def test_decode_split_counts_agree():
    """The result does not depend on the split count (up to rounding)."""
    gen = torch.Generator().manual_seed(2)
    seq_lens, rows = [150, 97, 64], [1, 2, 3]
    req_to_token = make_req_to_token(seq_lens, rows, 600, 256, gen)
    k_buf, v_buf = make_pool(600, 2, 64, torch.float32, gen)
    q = torch.randn(3, 4, 64, generator=gen).to(DEVICE)
    outs = [run_decode(decode_mod, q, k_buf, v_buf, req_to_token, rows, seq_lens, s, 0.125) for s in (1, 2, 16)]
    for o in outs[1:]:
        torch.testing.assert_close(o, outs[0], atol=1e-5, rtol=1e-5)


@in_process
def test_decode_half_precision():
    gen = torch.Generator().manual_seed(3)
    seq_lens, rows = [70, 1, 33], [1, 0, 2]
    req_to_token = make_req_to_token(seq_lens, rows, 300, 128, gen)
    k_buf, v_buf = make_pool(300, 2, 64, torch.float16, gen)
    q = torch.randn(3, 4, 64, generator=gen).to(DEVICE, torch.float16)
    o = run_decode(decode_mod, q, k_buf, v_buf, req_to_token, rows, seq_lens, 4, 0.125)
    ref = ref_decode(q, k_buf, v_buf, req_to_token, rows, seq_lens, 0.125)
    assert o.dtype == torch.float16
    torch.testing.assert_close(o.float(), ref, atol=2e-2, rtol=2e-2)


@in_process
@pytest.mark.parametrize("num_kv_splits", [1, 3, 16])
def test_decode_adaptive_splits_mixed_lengths(num_kv_splits):
    """Short and long requests in one batch, each split by its own length (min_chunk 32: up to 16 chunks
    here), one stage at num_kv_splits 1; lengths whose aligned chunks leave a last split empty (97 in 3)."""
    gen = torch.Generator().manual_seed(4)
    seq_lens = [1, 31, 33, 97, 250, 64, 515]
    rows = [1, 2, 3, 4, 5, 6, 7]
    req_to_token = make_req_to_token(seq_lens, rows, 1200, 600, gen)
    k_buf, v_buf = make_pool(1200, 2, 64, torch.float32, gen)
    q = torch.randn(len(rows), 8, 64, generator=gen).to(DEVICE)
    o = run_decode(decode_mod, q, k_buf, v_buf, req_to_token, rows, seq_lens, num_kv_splits, 0.125, min_chunk=32)
    ref = ref_decode(q, k_buf, v_buf, req_to_token, rows, seq_lens, 0.125)
    torch.testing.assert_close(o, ref, atol=1e-4, rtol=1e-4)


@in_process
@pytest.mark.parametrize("pool_dtype", [torch.float16, torch.float8_e4m3fn], ids=["fp16", "fp8"])
@pytest.mark.parametrize("num_kv_splits", [1, 8])
@pytest.mark.parametrize("seq_len", [1, 20, 64, 65, 130, 300])
def test_decode_after_qkv_preload_gives_the_same_bits(seq_len, num_kv_splits, pool_dtype):
    """One request after the qkv kernel (after_qkv): stage 1 loads its first step's K/V before it reads q, all
    but the newest position, which it reads after (on a GPU: after waiting for that kernel); the same bits as
    without, with the newest position first, inside or last in a program's first step, or past it (one stage:
    the whole request; 8 splits of 64-position chunks). Zeroing the newest slot's K/V then changes the output:
    the case reads it."""
    gen = torch.Generator().manual_seed(seq_len)
    req_to_token = make_req_to_token([seq_len], [1], 400, 320, gen)
    k_buf, v_buf = make_pool(400, 2, 64, pool_dtype, gen)
    q = torch.randn(1, 8, 64, generator=gen).to(DEVICE, torch.float16)
    ws = decode_mod.alloc_decode_workspace(1, 8, 64, num_kv_splits, DEVICE)
    tile = decode_mod.stage1_tile(1, 64, 2, decode_mod.kv_dots_in_fp16(q.dtype, pool_dtype))
    assert decode_mod.preload_after_qkv(1, tile, decode_mod.v_words_default(1, tile))

    def run(after_qkv):
        o = torch.full_like(q, float("nan"))
        decode_mod.decode_attention_fwd(q, k_buf, v_buf, o, req_to_token, torch.tensor([1], device=DEVICE),
                                        torch.tensor([seq_len], device=DEVICE), ws.attn_logits, ws.attn_lse,
                                        num_kv_splits, 0.125, min_chunk=64, counters=ws.counters, after_qkv=after_qkv)
        return o

    want = run(False)
    assert torch.equal(run(True), want)
    ref = ref_decode(q, k_buf.float(), v_buf.float(), req_to_token, [1], [seq_len], 0.125)
    torch.testing.assert_close(want.float(), ref, atol=3e-2, rtol=3e-2)
    newest = req_to_token[1, seq_len - 1].long()
    k_buf[newest], v_buf[newest] = 0, 0
    assert not torch.equal(run(False), want)


@in_process
def test_decode_preloads_after_qkv_at_one_and_two_requests_with_shared_steps_only():
    """Where it was measured faster (one and two requests, shared steps, V loaded plainly), and nowhere else."""
    assert [bs for bs in range(1, 9) if decode_mod.preload_after_qkv(bs, decode_mod.stage1_tile(bs, 128, 8), False)] \
        == [1, 2]
    one, fp8_two = decode_mod.stage1_tile(1, 128, 8), decode_mod.stage1_tile(2, 128, 8, True)
    assert not decode_mod.preload_after_qkv(1, one._replace(warp_splits=True), False)
    assert decode_mod.v_words_default(2, fp8_two) and not decode_mod.preload_after_qkv(2, fp8_two, True)


# Every tile stage1_tile gives, at both head widths, both pool kinds and a few kv-head counts (where this
# process re-runs the module in a subprocess, that one collects them)
RULE_TILES = [] if triton_mode.RERUN_IN_SUBPROCESS else sorted(
    {decode_mod.stage1_tile(bs, d, kv, f16) for bs in range(1, 513) for d in (64, 128) for kv in (1, 3, 8, 32)
     for f16 in (False, True)})


@in_process
@pytest.mark.parametrize("tile", RULE_TILES, ids=lambda t: "x".join(map(str, t[:3])) + ("s" if t[3] else ""))
@pytest.mark.parametrize("num_kv_splits", [1, 3])
def test_decode_every_stage1_tile_of_the_rule(tile, num_kv_splits):
    """Each tile stage1_tile can choose, with chunk bounds aligned to its BLOCK_N in both stages: lengths
    around the 32 and 64 boundaries, one stage and split; with warp splits, warps that see no position in a
    step (1 and 33 tokens at 16 positions a warp) or at all. A request of no tokens gets zeros."""
    gen = torch.Generator().manual_seed(6)
    seq_lens, rows = [1, 33, 64, 65, 97, 200, 0], [1, 2, 3, 4, 5, 6, 7]
    req_to_token = make_req_to_token(seq_lens, rows, 500, 256, gen)
    k_buf, v_buf = make_pool(500, 2, 128, torch.float32, gen)
    q = torch.randn(len(rows), 4, 128, generator=gen).to(DEVICE)
    o = run_decode(decode_mod, q, k_buf, v_buf, req_to_token, rows, seq_lens, num_kv_splits, 0.09, min_chunk=32,
                   tile=tile)
    torch.testing.assert_close(o[:-1], ref_decode(q[:-1], k_buf, v_buf, req_to_token, rows[:-1], seq_lens[:-1], 0.09),
                               atol=1e-4, rtol=1e-4)
    assert torch.equal(o[-1], torch.zeros_like(o[-1]))


@in_process
@pytest.mark.parametrize("max_bs", [256, 512, 1024])
def test_stage1_tile_of_a_batch_is_the_tile_of_the_graph_it_pads_to(max_bs):
    """A batch run eagerly and the default capture list's graph it would be padded to take the same stage-1
    tile (a different BLOCK_N sums the positions in other chunks: other roundings), for both head widths, both
    pool kinds and any count of kv heads per rank."""
    from runners.capture_lists import get_batch_sizes_to_capture, pick_size

    sizes = get_batch_sizes_to_capture(max_bs)
    for kv in (1, 2, 3, 4, 5, 6, 7, 8, 12, 16, 20, 32, 64, 128):
        for bs in range(1, max_bs + 1):
            padded = pick_size(sizes, bs)
            for d in (64, 128):
                for f16 in (False, True):
                    assert decode_mod.stage1_tile(bs, d, kv, f16) == decode_mod.stage1_tile(padded, d, kv, f16), (
                        bs, padded, kv, d, f16)


@in_process
def test_warp_splits_only_where_they_were_measured_faster():
    """At 8 kv heads, stage 1 takes warp splits for an FP8 pool of 128-wide heads from 16 requests and for
    bf16 pools at 128 and 256 requests, and shared steps where warp splits are slower or mixed on the H200
    (4 requests of an FP8 pool, bf16 up to 64 requests, an FP8 pool of 64-wide heads) and at one request."""
    split = {(f16, d, bs) for f16 in (False, True) for d in (64, 128) for bs in (1, 4, 16, 64, 128, 256)
             if decode_mod.stage1_tile(bs, d, 8, f16).warp_splits}
    assert split == {(True, 128, 16), (True, 128, 64), (True, 128, 128), (True, 128, 256),
                     (False, 128, 128), (False, 128, 256), (False, 64, 128), (False, 64, 256)}


@in_process
def test_decode_splits_follow_each_requests_length():
    """A request uses min(cdiv(len, min_chunk), num_kv_splits) splits: the workspace rows of its other
    splits stay untouched (here NaN); one stage (num_kv_splits 1) touches no workspace at all."""
    gen = torch.Generator().manual_seed(5)
    seq_lens, rows = [40, 100, 300], [1, 2, 3]
    req_to_token = make_req_to_token(seq_lens, rows, 600, 320, gen)
    k_buf, v_buf = make_pool(600, 1, 64, torch.float32, gen)
    q = torch.randn(3, 2, 64, generator=gen).to(DEVICE)
    ws = decode_mod.alloc_decode_workspace(3, 2, 64, 8, DEVICE)
    run_decode(decode_mod, q, k_buf, v_buf, req_to_token, rows, seq_lens, 8, 0.125, min_chunk=64, workspace=ws)
    written = torch.isfinite(ws[1]).all(dim=1).cpu()  # [bs, splits]: lse written for every head
    # 40 -> 1 split; 100 -> 2 (64 + 36); 300 -> 5 (cdiv(300, 5) = 60, aligned to 64: 64 x 4 + 44)
    assert written.tolist() == [[i < n for i in range(8)] for n in (1, 2, 5)]
    o = run_decode(decode_mod, q, k_buf, v_buf, req_to_token, rows, seq_lens, 1, 0.125, workspace=ws)
    assert torch.isnan(ws[0]).all() and torch.isnan(ws[1]).all()
    torch.testing.assert_close(o, ref_decode(q, k_buf, v_buf, req_to_token, rows, seq_lens, 0.125),
                               atol=1e-4, rtol=1e-4)


@in_process
def test_split_plan():
    f = decode_mod.get_num_kv_splits
    assert f(1) == 1 and f(64) == 1 and f(65) == 2 and f(1024) == 16 and f(131072) == 16
    assert f(4096, min_chunk=256) == 16 and f(4096, max_splits=8) == 8 and f(1000, min_chunk=256) == 4
    cap = decode_mod.decode_split_cap
    # Llama-3.2-1B (32 heads, 8 KV heads: one head block per KV head) on 132 SMs, 2 programs per SM
    assert [cap(bs, 32, 8, 132, 16, 2) for bs in (1, 2, 4, 8, 16, 32, 64)] == [16, 16, 8, 4, 2, 1, 1]
    assert cap(1, 40, 2, 4, 16, 2) == 2  # a group of 20: two head blocks per KV head, 4 programs a split
    assert cap(3, 32, 8, 132, 5, 2) == 5  # at most the workspace's splits
    # An FP8 pool read by bf16 / fp16 queries splits up to twice the programs (Llama-3.1-8B heads, 132 SMs)
    per_sm = decode_mod.programs_per_sm
    assert per_sm(torch.bfloat16, torch.bfloat16) == 4 and per_sm(torch.float32, torch.float8_e4m3fn) == 4
    assert per_sm(torch.bfloat16, torch.float8_e4m3fn) == per_sm(torch.float16, torch.float8_e4m3fn) == 8
    assert [cap(bs, 32, 8, 132, 16, 8) for bs in (32, 64, 96, 128)] == [4, 2, 1, 1]
    assert [cap(bs, 32, 8, 132, 16, 4) for bs in (32, 64, 96, 128)] == [2, 1, 1, 1]
    # ... but not into two (one split is faster there): a cap below min_splits is 1
    fewest = decode_mod.min_splits
    assert fewest(torch.bfloat16, torch.float8_e4m3fn) == 3 and fewest(torch.bfloat16, torch.bfloat16) == 2
    assert fewest(torch.float32, torch.float8_e4m3fn) == 2  # (float32 queries keep float32 dots)
    assert [cap(bs, 32, 8, 132, 16, 8, 3) for bs in (32, 40, 44, 45, 64, 66, 67)] == [4, 3, 3, 1, 1, 1, 1]
    assert cap(1, 32, 8, 132, 2, 8, 3) == 1  # a workspace of two splits: one stage
    plan = decode_mod.decode_split_plan
    assert plan(8, 128, 128) == 1 and plan(8, 129, 128) == 8 and plan(1, 5000, 128) == 1


@in_process
def test_backend_split_cap_follows_the_pool_dtype():
    """The triton backend's plan (what its decode graphs are captured for) counts FP8 pools' programs per SM."""
    from types import SimpleNamespace

    from model_executor.layers.attention.triton_backend import TritonAttnBackend

    def backend(kv_dtype):
        cfg = SimpleNamespace(num_attention_heads=32, num_key_value_heads=8, head_dim=128)
        runner = SimpleNamespace(model_config=cfg, context_len=4096, device=torch.device("cpu"), dtype=torch.bfloat16,
                                 kv_dtype=kv_dtype, req_to_token_pool=SimpleNamespace(size=128))
        b = TritonAttnBackend(runner)
        b.num_sms = 132  # the H200's (off CUDA the backend counts INTERPRETER_NUM_SMS)
        return b

    assert [backend(torch.bfloat16).split_cap(bs) for bs in (32, 64)] == [2, 1]
    assert [backend(torch.float8_e4m3fn).split_cap(bs) for bs in (32, 40, 48, 64)] == [4, 3, 1, 1]


# ---------------------------------------------------------------- extend


def run_extend(mod, q, k_buf, v_buf, req_to_token, rows, prefix_lens, extend_lens, sm_scale, config=None,
               max_extend_len=None):
    """The new tokens' K/V are taken out of the pool (their slots are poisoned with NaN) and passed as k / v,
    strided like the model's fused QKV output; the kernel must store them back and never read the NaNs."""
    seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens)]
    start_loc = [0]
    for e in extend_lens[:-1]:
        start_loc.append(start_loc[-1] + e)
    loc = torch.cat([req_to_token[r, p : p + e] for r, p, e in zip(rows, prefix_lens, extend_lens)]).long()
    num_kv_heads = k_buf.shape[1]
    kv = torch.cat([k_buf[loc], v_buf[loc]], dim=1)  # [T, 2 * Hk, D]: k and v are row-strided views
    k_new, v_new = kv[:, :num_kv_heads], kv[:, num_kv_heads:]
    k_buf[loc] = float("nan")
    v_buf[loc] = float("nan")
    o = torch.full_like(q, float("nan"))
    mod.extend_attention_fwd(
        q, k_new, v_new, o, k_buf, v_buf, loc, req_to_token,
        torch.tensor(rows, dtype=torch.int64, device=q.device),
        torch.tensor(seq_lens, dtype=torch.int64, device=q.device),
        torch.tensor(extend_lens, dtype=torch.int32, device=q.device),
        torch.tensor(start_loc, dtype=torch.int32, device=q.device),
        max_extend_len if max_extend_len is not None else max(extend_lens),
        sm_scale,
        config=config,
    )
    assert torch.equal(k_buf[loc], k_new) and torch.equal(v_buf[loc], v_new), "new K/V not stored at their slots"
    return o


def ref_extend(q, k_buf, v_buf, req_to_token, rows, prefix_lens, extend_lens, sm_scale):
    outs, start = [], 0
    for row, p, e in zip(rows, prefix_lens, extend_lens):
        slots = req_to_token[row, : p + e]
        outs.append(ref_attention(q[start : start + e], k_buf, v_buf, slots, torch.arange(p, p + e, device=q.device), sm_scale))
        start += e
    return torch.cat(outs)


def _extend_case(num_heads, num_kv_heads, head_dim, prefix_lens, extend_lens, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    rows = [4, 2, 7, 1][: len(prefix_lens)]
    seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens)]
    num_slots = sum(seq_lens) + 50
    req_to_token = make_req_to_token(seq_lens, rows, num_slots, max(seq_lens) + 8, gen)
    k_buf, v_buf = make_pool(num_slots, num_kv_heads, head_dim, dtype, gen)
    q = torch.randn(sum(extend_lens), num_heads, head_dim, generator=gen).to(DEVICE, dtype)
    return q, k_buf, v_buf, req_to_token, rows


@in_process
@pytest.mark.parametrize(
    "num_heads,num_kv_heads,head_dim,config",
    [
        (4, 2, 64, (128, 64, 4, 1)),  # the bf16 serving tiles
        (4, 2, 64, None),  # the float32 default
        (4, 2, 64, (16, 16, 4, 1)),  # small tiles: many KV blocks, unaligned prefix/band boundaries
        (3, 3, 128, (32, 16, 4, 1)),
        (6, 2, 80, (16, 32, 4, 1)),
        (4, 2, 64, (16, 16, 4, 3)),  # pipelined loops (the long-extend tiles' stages)
        (4, 2, 64, (16, 16, 4, 1, 3)),  # only the prefix's loop pipelined (the short-extend tiles')
    ],
)
def test_extend_matches_reference(num_heads, num_kv_heads, head_dim, config):
    prefix_lens = [0, 17, 70, 5]
    # 150 new tokens span two 128-row tiles; smaller tiles get there with fewer tokens
    extend_lens = [5, 40, 150 if config and config[0] == 128 else 60, 1]
    q, k_buf, v_buf, req_to_token, rows = _extend_case(
        num_heads, num_kv_heads, head_dim, prefix_lens, extend_lens, torch.float32, seed=10)
    cfg = extend_mod.ExtendConfig(*config) if config else None
    sm_scale = 1.0 / math.sqrt(head_dim)
    o = run_extend(extend_mod, q, k_buf, v_buf, req_to_token, rows, prefix_lens, extend_lens, sm_scale, cfg)
    ref = ref_extend(q, k_buf, v_buf, req_to_token, rows, prefix_lens, extend_lens, sm_scale)
    torch.testing.assert_close(o, ref, atol=1e-4, rtol=1e-4)


@in_process
def test_extend_grid_larger_than_needed_and_fp16():
    """max_extend_len above the real maximum only adds programs that exit; fp16 in/out."""
    prefix_lens, extend_lens = [9, 0], [20, 33]
    q, k_buf, v_buf, req_to_token, rows = _extend_case(4, 1, 64, prefix_lens, extend_lens, torch.float16, seed=11)
    cfg = extend_mod.ExtendConfig(16, 16, 4, 1)
    o = run_extend(extend_mod, q, k_buf, v_buf, req_to_token, rows, prefix_lens, extend_lens, 0.125, cfg,
                   max_extend_len=100)
    ref = ref_extend(q, k_buf, v_buf, req_to_token, rows, prefix_lens, extend_lens, 0.125)
    assert o.dtype == torch.float16 and torch.isfinite(o).all()
    torch.testing.assert_close(o.float(), ref, atol=2e-2, rtol=2e-2)


@in_process
def test_extend_last_token_matches_decode():
    """Extend's last new token and a decode step over the same KV give the same output."""
    prefix_lens, extend_lens = [30, 0], [12, 50]
    q, k_buf, v_buf, req_to_token, rows = _extend_case(4, 2, 64, prefix_lens, extend_lens, torch.float32, seed=12)
    o_ext = run_extend(extend_mod, q, k_buf, v_buf, req_to_token, rows, prefix_lens, extend_lens, 0.125,
                       extend_mod.ExtendConfig(16, 16, 4, 1))
    last = [extend_lens[0] - 1, sum(extend_lens) - 1]
    seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens)]
    o_dec = run_decode(decode_mod, q[last].contiguous(), k_buf, v_buf, req_to_token, rows, seq_lens, 4, 0.125)
    torch.testing.assert_close(o_dec, o_ext[last], atol=1e-5, rtol=1e-5)


@in_process
def test_short_extends_take_64_row_tiles_and_a_batch_takes_its_levels_tile():
    """16-bit heads up to 128 wide: 64x64 tiles with the new tokens' loop unpipelined up to 512 new tokens per
    request (measured faster there), 3 stages above and when the length is not given (64x64 tiles for
    head_dim 64, 128x128 for 128); the prefix's loop in 3 stages throughout. float32 and wider heads keep
    theirs. The bound is an extend level, so a batch and the graph level it pads to (the whole extend graphs
    size the grid by the level) take the same tile."""
    from runners.capture_lists import get_token_levels, pick_size

    get = extend_mod.get_extend_config
    for head_dim in (64, 128):
        assert get(head_dim, torch.bfloat16, 1) == get(head_dim, torch.float16, 512) == (64, 64, 4, 1, 3)
    assert get(64, torch.bfloat16, 513) == get(64, torch.bfloat16) == (64, 64, 4, 3, 3)
    assert get(128, torch.bfloat16, 513) == get(128, torch.bfloat16) == (128, 128, 8, 3, 3)
    # a device whose programs get less shared memory (an L40S: 99 KiB) keeps the unpipelined tiles where the
    # pipelined ones would not fit; an H100 / H200 (227 KiB) takes them all
    l40s, h200 = 101376, 232448
    assert get(128, torch.bfloat16, 100, l40s) == (64, 64, 4, 1, 0)
    assert get(128, torch.bfloat16, 513, l40s) == (128, 64, 8, 1, 0)
    assert get(64, torch.bfloat16, 100, l40s) == (64, 64, 4, 1, 3)
    assert get(64, torch.bfloat16, 513, l40s) == (64, 64, 4, 3, 3)
    for head_dim, n in ((64, 100), (64, 513), (128, 100), (128, 513)):
        assert get(head_dim, torch.bfloat16, n, h200) == get(head_dim, torch.bfloat16, n)
        assert extend_mod.shared_bytes(get(head_dim, torch.bfloat16, n), head_dim) <= h200
    assert get(256, torch.bfloat16, 100) == (64, 32, 8, 1, 0)
    assert get(64, torch.float32, 100) == (32, 32, 4, 1, 0)
    levels = get_token_levels(2048)
    for n in range(1, 2049):
        assert get(128, torch.bfloat16, n) == get(128, torch.bfloat16, pick_size(levels, n)), n

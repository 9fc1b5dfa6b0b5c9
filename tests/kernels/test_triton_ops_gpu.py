"""Triton attention kernels on a CUDA device: bf16 accuracy against an fp32 reference, CUDA-graph replay of
decode. Their timings and tile sweeps: python -m benchmarks.kernels.bench_attention.

Run: pytest -m gpu tests/kernels/test_triton_ops_gpu.py
"""

from __future__ import annotations

import math

import pytest
import torch

if not torch.cuda.is_available():
    # Skip before importing triton: on a CPU machine, importing triton here in compiled mode would stop
    # tests/kernels/test_triton_ops.py from switching on the interpreter in the same process.
    pytest.skip("needs a CUDA device", allow_module_level=True)


from model_executor.layers.attention.triton_ops import (
    alloc_decode_workspace,
    decode_attention_fwd,
    extend_attention_fwd,
    get_num_kv_splits,
)
from model_executor.layers.attention.triton_ops import decode_attention as decode_mod

pytestmark = pytest.mark.gpu

DEV = "cuda"
HEAD_CONFIGS = [(32, 8, 128), (9, 3, 64)]  # (num_heads, num_kv_heads, head_dim): Llama-3 8B/1B, SmolLM2


# ---------------------------------------------------------------- helpers


def ref_attention(q, k_buffer, v_buffer, slots, q_positions, sm_scale):
    """fp32 reference. q: [n, H, D]; slots: [L] KV slots of positions 0..L-1; q_positions: [n]."""
    group = q.shape[1] // k_buffer.shape[1]
    k = k_buffer[slots.long()].float().repeat_interleave(group, dim=1)
    v = v_buffer[slots.long()].float().repeat_interleave(group, dim=1)
    scores = torch.einsum("nhd,lhd->hnl", q.float(), k) * sm_scale
    visible = torch.arange(slots.numel(), device=q.device)[None, :] <= q_positions[:, None]
    scores = scores.masked_fill(~visible[None], float("-inf"))
    return torch.einsum("hnl,lhd->nhd", torch.softmax(scores, dim=-1), v)


def rel_err(out, ref):
    return ((out.float() - ref).norm() / ref.norm()).item()


class Pool:
    """KV pool with scattered slots: request row r (1-based) holds lens[r-1] positions; row 0 -> slot 0."""

    def __init__(self, lens, num_kv_heads, head_dim, dtype=torch.bfloat16, seed=0):
        gen = torch.Generator(device=DEV).manual_seed(seed)
        num_slots = sum(lens) + 64
        max_ctx = max(lens) + 16
        self.k = torch.randn(num_slots + 1, num_kv_heads, head_dim, device=DEV, generator=gen).to(dtype)
        self.v = torch.randn(num_slots + 1, num_kv_heads, head_dim, device=DEV, generator=gen).to(dtype)
        self.req_to_token = torch.zeros(len(lens) + 1, max_ctx, dtype=torch.int32, device=DEV)
        perm = torch.randperm(num_slots, device=DEV, generator=gen).to(torch.int32) + 1
        used = 0
        for row, n in enumerate(lens, start=1):
            self.req_to_token[row, :n] = perm[used : used + n]
            used += n
        self.lens = list(lens)


def decode_ref(pool, q, rows, seq_lens, sm_scale):
    outs = []
    for b, (row, n) in enumerate(zip(rows, seq_lens)):
        slots = pool.req_to_token[row, :n]
        outs.append(ref_attention(q[b : b + 1], pool.k, pool.v, slots, torch.tensor([n - 1], device=DEV), sm_scale))
    return torch.cat(outs)


def decode_vs_ref(pool, num_heads, splits, **kw):
    """decode_attention_fwd of random bf16 queries for request b at row b + 1 of the pool (kw: min_chunk, tile)
    and the fp32 reference: (output, reference)."""
    lens, head_dim = pool.lens, pool.k.shape[2]
    rows = list(range(1, len(lens) + 1))
    q = torch.randn(len(lens), num_heads, head_dim, device=DEV).to(torch.bfloat16)
    o = torch.empty_like(q)
    logits, lse, counters = alloc_decode_workspace(len(lens), num_heads, head_dim, splits, DEV)
    sm_scale = 1.0 / math.sqrt(head_dim)
    decode_attention_fwd(q, pool.k, pool.v, o, pool.req_to_token, torch.tensor(rows, device=DEV),
                         torch.tensor(lens, dtype=torch.int32, device=DEV), logits, lse, splits, sm_scale,
                         counters=counters, **kw)
    return o, decode_ref(pool, q, rows, lens, sm_scale)


def extend_args(prefix_lens, extend_lens):
    seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens)]
    start_loc = [0]
    for e in extend_lens[:-1]:
        start_loc.append(start_loc[-1] + e)
    rows = list(range(1, len(seq_lens) + 1))
    def as_t(x, dt):
        return torch.tensor(x, dtype=dt, device=DEV)

    return (as_t(rows, torch.int64), as_t(seq_lens, torch.int32), as_t(extend_lens, torch.int32),
            as_t(start_loc, torch.int32), max(extend_lens))


def new_kv(pool, prefix_lens, extend_lens):
    """The new tokens' slots and their K/V as row-strided views (like the model's fused QKV output)."""
    loc = torch.cat([pool.req_to_token[row, p : p + e]
                     for row, (p, e) in enumerate(zip(prefix_lens, extend_lens), start=1)]).long()
    kv = torch.cat([pool.k[loc], pool.v[loc]], dim=1)
    num_kv_heads = pool.k.shape[1]
    return loc, kv[:, :num_kv_heads], kv[:, num_kv_heads:]


def extend_ref(pool, q, prefix_lens, extend_lens, sm_scale):
    outs, start = [], 0
    for row, (p, e) in enumerate(zip(prefix_lens, extend_lens), start=1):
        slots = pool.req_to_token[row, : p + e]
        outs.append(ref_attention(q[start : start + e], pool.k, pool.v, slots,
                                  torch.arange(p, p + e, device=DEV), sm_scale))
        start += e
    return torch.cat(outs)



# ---------------------------------------------------------------- decode


@pytest.mark.parametrize("heads", HEAD_CONFIGS, ids=lambda h: f"{h[0]}q{h[1]}kv{h[2]}d")
@pytest.mark.parametrize("context", ["short", "long"])
@pytest.mark.parametrize("split", ["split", "one_stage", "min_chunk32"])
def test_decode_bf16(heads, context, split):
    num_heads, num_kv_heads, head_dim = heads
    gen = torch.Generator().manual_seed(1)
    if context == "short":
        lens = [1, 2, 17, 64, 65, 200, 256] + torch.randint(1, 257, (9,), generator=gen).tolist()
    else:
        lens = [4096, 1, 4095, 3000, 1025, 33, 2048, 4000]
    min_chunk = 32 if split == "min_chunk32" else decode_mod.MIN_CHUNK
    splits = 1 if split == "one_stage" else get_num_kv_splits(max(lens), min_chunk=min_chunk)
    o, ref = decode_vs_ref(Pool(lens, num_kv_heads, head_dim), num_heads, splits, min_chunk=min_chunk)
    assert torch.isfinite(o).all()
    assert rel_err(o, ref) < 1e-2
    for b in range(len(lens)):
        assert rel_err(o[b], ref[b]) < 1e-2, f"row {b} (len {lens[b]})"


RULE_TILES = sorted({decode_mod.stage1_tile(bs, d, kv, f16) for bs in range(1, 257) for d in (64, 128)
                     for kv in (3, 8) for f16 in (False, True)})


@pytest.mark.parametrize("heads", HEAD_CONFIGS, ids=lambda h: f"{h[0]}q{h[1]}kv{h[2]}d")
@pytest.mark.parametrize("tile", RULE_TILES, ids=lambda t: "x".join(map(str, t)))
@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=["bf16", "fp8"])
def test_decode_every_tile_of_the_rule(heads, tile, kv_dtype):
    """Each stage-1 tile stage1_tile can give, at each head width and pool dtype (an FP8 pool's V as words where
    the tile allows, as by default from 2 requests), against the fp32 reference of the same pool values: the
    sweep that picks tiles times them, this checks them."""
    num_heads, num_kv_heads, head_dim = heads
    lens = [4096, 1, 4095, 3000, 1025, 33, 2048, 4000, 64, 65, 200]
    pool = Pool(lens, num_kv_heads, head_dim, dtype=kv_dtype, seed=4)
    o, ref = decode_vs_ref(pool, num_heads, get_num_kv_splits(max(lens)), tile=tile)
    for b in range(len(lens)):
        assert rel_err(o[b], ref[b]) < 1e-2, f"row {b} (len {lens[b]})"


@pytest.mark.parametrize("splits", [get_num_kv_splits(4096), 5, 1])
def test_decode_cuda_graph_replay_matches_eager(splits):
    num_heads, num_kv_heads, head_dim = 32, 8, 128
    max_bs = 16
    gen = torch.Generator().manual_seed(2)
    lens = torch.randint(1, 4097, (max_bs,), generator=gen).tolist()
    lens[0] = 4096
    lens[1] = 70  # a short request among long ones: few of the splits
    pool = Pool(lens, num_kv_heads, head_dim)
    sm_scale = 1.0 / math.sqrt(head_dim)

    # static buffers, as a graph runner keeps them; padding rows: seq_len 1, request row 0 (slot 0)
    q = torch.zeros(max_bs, num_heads, head_dim, dtype=torch.bfloat16, device=DEV)
    o = torch.zeros_like(q)
    req_pool_indices = torch.zeros(max_bs, dtype=torch.int64, device=DEV)
    seq_lens = torch.ones(max_bs, dtype=torch.int32, device=DEV)
    logits, lse, counters = alloc_decode_workspace(max_bs, num_heads, head_dim, splits, DEV)

    def step():
        decode_attention_fwd(q, pool.k, pool.v, o, pool.req_to_token, req_pool_indices, seq_lens, logits, lse,
                             splits, sm_scale, counters=counters)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # compile outside the capture
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()

    for trial, bs in enumerate([max_bs, 5, 11, 1]):
        rows = torch.randperm(max_bs, generator=gen)[:bs] + 1
        req_pool_indices.zero_()
        seq_lens.fill_(1)
        req_pool_indices[:bs] = rows.to(DEV)
        seq_lens[:bs] = torch.tensor([lens[r - 1] for r in rows.tolist()], dtype=torch.int32, device=DEV)
        q.copy_(torch.randn(max_bs, num_heads, head_dim, device=DEV))
        graph.replay()
        torch.cuda.synchronize()
        graph_out = o.clone()
        assert torch.isfinite(graph_out).all(), f"trial {trial}"

        eager_o = torch.empty_like(o)
        eager_logits, eager_lse, eager_counters = alloc_decode_workspace(max_bs, num_heads, head_dim, splits, DEV)
        decode_attention_fwd(q, pool.k, pool.v, eager_o, pool.req_to_token, req_pool_indices, seq_lens,
                             eager_logits, eager_lse, splits, sm_scale, counters=eager_counters)
        assert torch.equal(graph_out, eager_o), f"trial {trial}"

        ref = decode_ref(pool, q[:bs], rows.tolist(), seq_lens[:bs].tolist(), sm_scale)
        assert rel_err(graph_out[:bs], ref) < 1e-2


# ---------------------------------------------------------------- extend


@pytest.mark.parametrize("heads", HEAD_CONFIGS, ids=lambda h: f"{h[0]}q{h[1]}kv{h[2]}d")
@pytest.mark.parametrize(
    "prefix_lens,extend_lens",
    [
        ([0], [2048]),  # one prompt, no prefix
        ([0, 1000, 0, 3000, 77, 5], [1024, 512, 300, 199, 12, 1]),  # 2048 new tokens, mixed prefixes
        ([4000, 0], [100, 17]),
    ],
    ids=["single2048", "mixed2048", "longprefix"],
)
def test_extend_bf16(heads, prefix_lens, extend_lens):
    num_heads, num_kv_heads, head_dim = heads
    pool = Pool([p + e for p, e in zip(prefix_lens, extend_lens)], num_kv_heads, head_dim, seed=3)
    q = torch.randn(sum(extend_lens), num_heads, head_dim, device=DEV).to(torch.bfloat16)
    o = torch.empty_like(q)
    sm_scale = 1.0 / math.sqrt(head_dim)
    rows, seq_lens, ext_lens, start_loc, max_ext = extend_args(prefix_lens, extend_lens)
    ref = extend_ref(pool, q, prefix_lens, extend_lens, sm_scale)
    loc, k, v = new_kv(pool, prefix_lens, extend_lens)
    pool.k[loc] = float("nan")  # the kernel stores the new K/V and must never read these slots
    pool.v[loc] = float("nan")
    extend_attention_fwd(q, k, v, o, pool.k, pool.v, loc, pool.req_to_token, rows, seq_lens, ext_lens, start_loc,
                         max_ext, sm_scale)
    assert torch.equal(pool.k[loc], k) and torch.equal(pool.v[loc], v)
    assert torch.isfinite(o).all()
    assert rel_err(o, ref) < 1e-2
    start = 0
    for p, e in zip(prefix_lens, extend_lens):
        assert rel_err(o[start : start + e], ref[start : start + e]) < 1e-2, f"request prefix {p} extend {e}"
        start += e

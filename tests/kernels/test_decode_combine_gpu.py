"""Decode attention's fused combine on a CUDA device: the same bits as the two-stage path whichever program
of a (request, head block) arrives last, the arrival counters back at zero after every call, and a captured
CUDA graph replaying it right for different lengths. (Under the CPU interpreter the programs run in order:
tests/kernels/test_decode_combine.py; only the GPU runs them in any order.)

Run: pytest -m gpu tests/kernels/test_decode_combine_gpu.py
"""

from __future__ import annotations

import math

import pytest
import torch

if not torch.cuda.is_available():
    # Skip before importing triton: on a CPU machine, importing triton here in compiled mode would stop
    # the CPU kernel tests from switching on the interpreter in the same process.
    pytest.skip("needs a CUDA device", allow_module_level=True)

from model_executor.layers.attention.triton_ops import decode_attention as decode_mod

pytestmark = pytest.mark.gpu

DEV = "cuda"
# (num_heads, num_kv_heads, head_dim): Llama-3.1-8B, Llama-3.2-1B, Qwen3-30B-A3B, a group of 20 (two head blocks)
HEADS = [(32, 8, 128), (32, 8, 64), (32, 4, 128), (40, 2, 128)]
REPEATS = 10  # fused calls per case: the arrival order varies from launch to launch


class Pool:
    """bf16 KV pool with scattered slots: request row r (1-based) holds lens[r-1] positions; row 0 -> slot 0."""

    def __init__(self, lens, num_kv_heads, head_dim, seed=0):
        gen = torch.Generator(device=DEV).manual_seed(seed)
        num_slots = sum(lens) + 64
        self.k = torch.randn(num_slots + 1, num_kv_heads, head_dim, device=DEV, generator=gen).bfloat16()
        self.v = torch.randn(num_slots + 1, num_kv_heads, head_dim, device=DEV, generator=gen).bfloat16()
        self.req_to_token = torch.zeros(len(lens) + 1, max(lens) + 16, dtype=torch.int32, device=DEV)
        perm = torch.randperm(num_slots, device=DEV, generator=gen).to(torch.int32) + 1
        used = 0
        for row, n in enumerate(lens, start=1):
            self.req_to_token[row, :n] = perm[used : used + n]
            used += n


def ragged_lens(bs, gen):
    """A long request, one of one position, one shorter than a chunk, one of exactly a chunk; the rest random."""
    fixed = [4096, 1, 37, decode_mod.MIN_CHUNK]
    lens = fixed[:bs] + torch.randint(1, 4097, (max(0, bs - len(fixed)),), generator=gen).tolist()
    return lens[:bs]


def run(pool, q, rows, lens, ws, splits, fused, o=None):
    o = torch.full_like(q, float("nan")) if o is None else o
    decode_mod.decode_attention_fwd(q, pool.k, pool.v, o, pool.req_to_token, rows, lens, ws.attn_logits,
                                    ws.attn_lse, splits, 1 / math.sqrt(q.shape[-1]), counters=ws.counters,
                                    fused_combine=fused)
    return o


def ref_decode(pool, q, lens):
    group = q.shape[1] // pool.k.shape[1]
    outs = []
    for b, n in enumerate(lens):
        slots = pool.req_to_token[b + 1, :n].long()
        k = pool.k[slots].float().repeat_interleave(group, dim=1)
        v = pool.v[slots].float().repeat_interleave(group, dim=1)
        p = torch.softmax(torch.einsum("hd,lhd->hl", q[b].float(), k) / math.sqrt(q.shape[-1]), dim=-1)
        outs.append(torch.einsum("hl,lhd->hd", p, v))
    return torch.stack(outs)


@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"{h[0]}q{h[1]}kv{h[2]}d")
@pytest.mark.parametrize("bs", [1, 3, 8, 64])
def test_fused_combine_same_bits_as_two_stage(heads, bs):
    num_heads, num_kv_heads, head_dim = heads
    gen = torch.Generator().manual_seed(bs)
    lens = ragged_lens(bs, gen)
    pool = Pool(lens, num_kv_heads, head_dim, seed=bs)
    q = torch.randn(bs, num_heads, head_dim, device=DEV).bfloat16()
    rows = torch.arange(1, bs + 1, device=DEV)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEV)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    max_splits = decode_mod.get_num_kv_splits(4096)
    plan = decode_mod.decode_split_cap(bs, num_heads, num_kv_heads, sms, max_splits)
    # the plan the backend takes at this size, and the most splits (the plan is 1 split at large batches)
    for splits in sorted({plan, max_splits} - {1}):
        ws = decode_mod.alloc_decode_workspace(bs, num_heads, head_dim, splits, DEV)
        two_stage = run(pool, q, rows, seq_lens, ws, splits, fused=False)
        assert torch.isfinite(two_stage).all()
        for i in range(REPEATS):
            fused = run(pool, q, rows, seq_lens, ws, splits, fused=True)
            torch.cuda.synchronize()
            assert torch.equal(fused, two_stage), f"splits {splits}, call {i}"
            assert ws.counters.count_nonzero().item() == 0, f"splits {splits}, call {i}"
        if bs <= 8:
            ref = ref_decode(pool, q, lens)
            assert ((fused.float() - ref).norm() / ref.norm()).item() < 1e-2


@pytest.mark.parametrize("heads", [(32, 8, 128), (40, 2, 128)], ids=lambda h: f"{h[0]}q{h[1]}kv{h[2]}d")
def test_fused_combine_graph_replays_for_other_lengths(heads):
    """The fused call captured once replays right for two length sets (other chunk counts per request), with
    graph padding rows (length 1, request row 0), and leaves the counters at zero (no memset in the graph)."""
    num_heads, num_kv_heads, head_dim = heads
    max_bs, splits = 8, 16
    gen = torch.Generator().manual_seed(7)
    all_lens = torch.randint(1, 4097, (max_bs,), generator=gen).tolist()
    all_lens[:3] = [4096, 1, 50]
    pool = Pool(all_lens, num_kv_heads, head_dim, seed=7)
    q = torch.zeros(max_bs, num_heads, head_dim, dtype=torch.bfloat16, device=DEV)
    o = torch.zeros_like(q)
    rows = torch.zeros(max_bs, dtype=torch.int64, device=DEV)
    seq_lens = torch.ones(max_bs, dtype=torch.int32, device=DEV)
    ws = decode_mod.alloc_decode_workspace(max_bs, num_heads, head_dim, splits, DEV)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run(pool, q, rows, seq_lens, ws, splits, fused=True, o=o)  # compile outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run(pool, q, rows, seq_lens, ws, splits, fused=True, o=o)

    eager_ws = decode_mod.alloc_decode_workspace(max_bs, num_heads, head_dim, splits, DEV)
    for trial, bs in enumerate([max_bs, 5]):
        pick = torch.randperm(max_bs, generator=gen)[:bs] + 1
        rows.zero_()
        seq_lens.fill_(1)
        rows[:bs] = pick.to(DEV)
        seq_lens[:bs] = torch.tensor([all_lens[r - 1] for r in pick.tolist()], dtype=torch.int32, device=DEV)
        q.copy_(torch.randn(max_bs, num_heads, head_dim, device=DEV))
        for replay in range(3):
            o.fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            two_stage = run(pool, q, rows, seq_lens, eager_ws, splits, fused=False)
            assert torch.equal(o, two_stage), f"trial {trial}, replay {replay}"
            assert ws.counters.count_nonzero().item() == 0, f"trial {trial}, replay {replay}"


@pytest.mark.parametrize("heads", [(32, 8, 128), (32, 8, 64), (40, 2, 128)], ids=lambda h: f"{h[0]}q{h[1]}kv{h[2]}d")
@pytest.mark.parametrize("splits", [3, 8, 12, 16])
@pytest.mark.parametrize("lens", [[0, 1, 520, 1000], [0, 1, 520, 1000, 37, 300]], ids=["bs4", "bs6"])
def test_merge_takes_only_the_written_splits(heads, splits, lens):
    """Both merges load a head block's chunks as one tile of next_pow2(splits) rows per head: the stale
    workspace (NaN here) past the split count, past a request's chunks (1 token: one chunk) and in chunks
    left empty by the alignment (520 in 8 splits, 1000 in 12) must never reach the output; a request of no
    tokens gets zeros. bs 4 takes stage 1's 8-warp tile at 128-wide heads (stage 2 the same warps), bs 6
    the 4-warp one."""
    num_heads, num_kv_heads, head_dim = heads
    bs = len(lens)
    pool = Pool(lens, num_kv_heads, head_dim, seed=splits)
    q = torch.randn(bs, num_heads, head_dim, device=DEV).bfloat16()
    rows = torch.arange(1, bs + 1, device=DEV)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEV)
    ws = decode_mod.alloc_decode_workspace(bs, num_heads, head_dim, splits, DEV)

    def stale_then_run(fused):
        ws.attn_logits.fill_(float("nan"))
        ws.attn_lse.fill_(float("nan"))
        return run(pool, q, rows, seq_lens, ws, splits, fused=fused)

    two_stage = stale_then_run(False)
    assert torch.equal(two_stage[0], torch.zeros_like(two_stage[0]))
    ref = ref_decode(pool, q, lens)
    assert ((two_stage.float() - ref).norm() / ref.norm()).item() < 1e-2
    for i in range(REPEATS):
        fused = stale_then_run(True)
        torch.cuda.synchronize()
        assert torch.equal(fused, two_stage), f"call {i}"
        assert ws.counters.count_nonzero().item() == 0, f"call {i}"

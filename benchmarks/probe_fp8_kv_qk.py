"""probe_fp8_kv_qk: decode attention over an FP8 KV pool with q . k on FP8 tensor cores.

Today's stage 1 over an FP8 pool converts every K and V value to fp16 before its dots. At large batches that
is what bounds it: Llama-3.1-8B heads at 256 requests of 528 tokens take 122.5 us, 1.89x the read of its
pool, where a bf16 pool's kernel is at 1.14x (docs/benchmarks.md, twentieth session).

Here K is never converted: the scores come from an FP8 x FP8 dot, S^T [BLOCK_N, 16] = K [BLOCK_N, D] @
q^T [D, 16], with K as loaded (the dot's left operand: 64 rows, the sm_90 wgmma tile) and q as the right one.
q is split once per program into two e4m3 terms per head (as probe_fp8_mma_gemv splits x): column 2h holds
hi = e4m3(q_h / s_h), column 2h + 1 lo = e4m3((q_h / s_h - hi) * 16), s_h = max |q_h| / 448, so a group of up
to 8 query heads fills the 16 columns and hi * s + lo * s / 16 keeps about a bf16's 8 significant bits. The
two columns of a head are added after the dot (adjacent columns: the same thread holds both). V still goes
to fp16 (as 32-bit words, as today) for acc^T [D, 16] += V^T [D, BLOCK_N] @ P^T [BLOCK_N, 16], each head's
probabilities in its two columns.

One stage (no splits: the plan at large batches), one program per (request, kv head). Compared, kernel alone in
one CUDA graph (bench_attention's pool: slots scattered), against `decode_attention_fwd` at one split and at
its split plan, default tile; the max abs difference of the outputs against a float32 reference of the dequantized pool is
printed for both.

    python -m benchmarks.probe_fp8_kv_qk --points 256x528 128x528 64x528 --json out.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys

import torch
import triton
import triton.language as tl

from benchmarks.probe_fp8_mma_gemv import LO, _split_terms
from model_executor.layers.attention.triton_ops.decode_attention import _INTERPRET, _LOG2E, _load_e4m3_rows_as_f16


@triton.jit
def fp8_qk_decode(Q, K_Buffer, V_Buffer, Req_to_token, Req_pool_indices, Seq_lens, O, qk_scale, v_scale,
                  stride_qb, stride_qh, stride_kbs, stride_kh, stride_vbs, stride_vh, stride_req_b, stride_ob,
                  stride_oh, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
                  LO: tl.constexpr, INTERPRET: tl.constexpr):
    cur_batch = tl.program_id(0)
    kv_head = tl.program_id(1)
    offs_c = tl.arange(0, 16)  # column c: term c % 2 (hi, lo) of group head c // 2
    head_c = offs_c // 2
    term_c = offs_c % 2
    mask_c = head_c < GROUP
    offs_d = tl.arange(0, HEAD_DIM)
    seq_len = tl.load(Seq_lens + cur_batch).to(tl.int32)
    req_row = tl.load(Req_pool_indices + cur_batch).to(tl.int64)

    # q^T terms [HEAD_DIM, 16] (each head's row loaded twice: once per term) and the columns' scales
    q = tl.load(Q + cur_batch.to(tl.int64) * stride_qb + (kv_head * GROUP + head_c)[None, :] * stride_qh
                + offs_d[:, None], mask=mask_c[None, :], other=0.0).to(tl.float32)
    s = tl.maximum(tl.max(tl.abs(q), 0), 1e-30) / 448.0  # [16] (448: e4m3's largest value)
    q8, col = _split_terms(q, s, term_c, mask_c, 2, LO)
    col = col * qk_scale  # log2 domain

    e_max = tl.full([16], float("-inf"), dtype=tl.float32)
    e_sum = tl.zeros([16], dtype=tl.float32)
    acc = tl.zeros([HEAD_DIM, 16], dtype=tl.float32)
    for start_n in range(0, seq_len, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        mask_n = offs_n < seq_len
        slots = tl.load(Req_to_token + req_row * stride_req_b + offs_n, mask=mask_n, other=0).to(tl.int64)
        k = tl.load(K_Buffer + slots[:, None] * stride_kbs + kv_head * stride_kh + offs_d[None, :],
                    mask=mask_n[:, None], other=0.0)  # [BLOCK_N, HEAD_DIM] e4m3, as stored
        st = tl.dot(k, q8) * col[None, :]  # [BLOCK_N, 16]: each head's two terms in adjacent columns
        hi_t, lo_t = tl.split(tl.reshape(st, [BLOCK_N, 8, 2]))
        sc = hi_t + lo_t  # [BLOCK_N, 8] a head's scores
        sc2 = tl.reshape(tl.join(sc, sc), [BLOCK_N, 16])  # back in both of its columns
        sc2 = tl.where(mask_n[:, None], sc2, float("-inf"))
        n_e_max = tl.maximum(tl.max(sc2, 0), e_max)
        re_scale = tl.exp2(e_max - n_e_max)
        p = tl.exp2(sc2 - n_e_max[None, :])  # [BLOCK_N, 16]
        v = _load_e4m3_rows_as_f16(V_Buffer, slots, kv_head * stride_vh, stride_vbs, mask_n, BLOCK_N, HEAD_DIM,
                                   INTERPRET)  # [BLOCK_N, HEAD_DIM] fp16
        acc = acc * re_scale[None, :] + tl.dot(tl.trans(v), p.to(tl.float16))
        e_sum = e_sum * re_scale + tl.sum(p, 0)
        e_max = n_e_max
    out = acc * (v_scale / tl.maximum(e_sum, 1e-30))[None, :]  # [HEAD_DIM, 16]: columns 2h, 2h + 1 equal
    o_hi, _ = tl.split(tl.reshape(out, [HEAD_DIM, 8, 2]))  # [HEAD_DIM, 8]
    offs_h = tl.arange(0, 8)
    tl.store(O + cur_batch.to(tl.int64) * stride_ob + (kv_head * GROUP + offs_h)[None, :] * stride_oh
             + offs_d[:, None], o_hi.to(O.dtype.element_ty), mask=(offs_h < GROUP)[None, :])


def fp8_qk_decode_fwd(q, k_buffer, v_buffer, o, req_to_token, req_pool_indices, seq_lens, sm_scale, k_scale=1.0,
                      v_scale=1.0, block_n=64, num_warps=4, num_stages=2):
    bs, num_heads, head_dim = q.shape
    num_kv_heads = k_buffer.shape[1]
    group = num_heads // num_kv_heads
    assert group <= 8 and k_buffer.dtype == torch.float8_e4m3fn and head_dim in (64, 128)
    fp8_qk_decode[(bs, num_kv_heads)](
        q, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens, o, sm_scale * k_scale * _LOG2E, v_scale,
        q.stride(0), q.stride(1), k_buffer.stride(0), k_buffer.stride(1), v_buffer.stride(0), v_buffer.stride(1),
        req_to_token.stride(0), o.stride(0), o.stride(1), GROUP=group, HEAD_DIM=head_dim, BLOCK_N=block_n,
        LO=LO, INTERPRET=_INTERPRET, num_warps=num_warps, num_stages=num_stages)


def reference(q, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens, sm_scale):
    """float32 attention of each request's q over its dequantized positions: [bs, heads, dim]."""
    bs, num_heads, _ = q.shape
    group = num_heads // k_buffer.shape[1]
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    for b in range(bs):
        slots = req_to_token[req_pool_indices[b], : int(seq_lens[b])].long()
        k = k_buffer[slots].float().repeat_interleave(group, dim=1)  # [L, heads, dim]
        v = v_buffer[slots].float().repeat_interleave(group, dim=1)
        s = torch.einsum("hd,lhd->hl", q[b].float(), k) * sm_scale
        out[b] = torch.einsum("hl,lhd->hd", s.softmax(-1), v)
    return out


def main(argv=None) -> int:
    from benchmarks.bench_attention import KvPool, graph_us, parse_heads, parse_point, plan_splits

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--heads", type=parse_heads, default=(32, 8, 128))
    p.add_argument("--points", type=parse_point, nargs="+", default=[(256, 528), (128, 528), (64, 528)])
    p.add_argument("--tiles", default="64x4x2,64x4x3,128x8x2", help="BLOCK_NxWARPSxSTAGES, comma separated")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("probe_fp8_kv_qk needs a CUDA device (FP8 tensor cores: sm_89 or later)", file=sys.stderr)
        return 2
    from model_executor.layers.attention.triton_ops import alloc_decode_workspace, decode_attention_fwd

    num_heads, num_kv_heads, head_dim = args.heads
    sm_scale = 1.0 / math.sqrt(head_dim)
    rows = []
    for bs, ctx in args.points:
        pool = KvPool(bs, ctx, num_kv_heads, head_dim, dtype=torch.float8_e4m3fn)
        q = torch.randn(bs, num_heads, head_dim, device="cuda").bfloat16()
        o = torch.empty_like(q)
        req = torch.arange(1, bs + 1, device="cuda")
        lens = torch.full((bs,), ctx, dtype=torch.int32, device="cuda")
        ref = reference(q[:8], pool.k, pool.v, pool.req_to_token, req[:8], lens[:8], sm_scale)
        floor_us = 2 * bs * ctx * num_kv_heads * head_dim / 4.2e6  # at 4.2 TB/s
        plan = plan_splits(args.heads, bs, ctx, q.dtype, pool.k.dtype)
        logits, lse, counters = alloc_decode_workspace(bs, num_heads, head_dim, max(plan, 1), "cuda")

        def today(splits=1):
            decode_attention_fwd(q, pool.k, pool.v, o, pool.req_to_token, req, lens, logits, lse, splits, sm_scale,
                                 counters=counters)

        def record(name, us, err):
            rows.append({"bs": bs, "ctx": ctx, "variant": name, "us": us, "x_floor": us / floor_us, "max_err": err})
            print(f"{bs:>4} {ctx:>5} {name:>28} {us:>8.2f} {us / floor_us:>6.2f} {err:>9.2e}", flush=True)

        us = graph_us(today)
        today()
        record("today (one split)", us, float((o[:8].float() - ref).abs().max()))
        if plan > 1:
            us = graph_us(lambda: today(plan))
            today(plan)
            record(f"today (plan: {plan} splits)", us, float((o[:8].float() - ref).abs().max()))
        for tile in args.tiles.split(","):
            bn, warps, stages = (int(v) for v in tile.split("x"))

            def new(bn=bn, warps=warps, stages=stages):
                fp8_qk_decode_fwd(q, pool.k, pool.v, o, pool.req_to_token, req, lens, sm_scale, block_n=bn,
                                  num_warps=warps, num_stages=stages)
            try:
                us = graph_us(new)
                o.zero_()
                new()
                record(f"fp8 q.k {bn}/{warps}/{stages}", us, float((o[:8].float() - ref).abs().max()))
            except Exception as exc:  # noqa: BLE001 - a tile that does not fit: report it, go on
                print(f"{bs:>4} {ctx:>5} fp8 q.k {tile} failed: {type(exc).__name__}: {str(exc)[:160]}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "heads": list(args.heads), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

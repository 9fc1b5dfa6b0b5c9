"""probe_warp_split_decode: decode stage 1 with each warp its own split of the positions (issue 18, 23; probe).

Today's stage 1 gives a program one kv head's query heads (16 rows, 4 of them real for Llama's groups of 4) and
BLOCK_N positions a step; its 4 warps split the positions, so each step's softmax max and sum cross warps
through shared memory (9 barriers a step in the sm_90 SASS at Llama-3.1-8B heads, 128 requests). Here a program
runs W independent splits side by side as one batched dot ([W, 16, D] x [W, D, BLOCK_N], one warp per split
when num_warps == W): no barrier but the pipeline's, and one merge of the W partials at the end. Single stage
only (the batches where the plan gives one split: 66+ requests of 8 kv heads). Times both, in one CUDA graph
each, at the given points, with the max |difference| of their outputs.

    python -m benchmarks.probe_warp_split_decode --json out.json
"""

from __future__ import annotations

import argparse
import json
import math
from functools import partial

import torch
import triton
import triton.language as tl

# (BLOCK_N, W, num_warps, num_stages)
CONFIGS = [(16, 4, 4, 2), (16, 4, 4, 3), (16, 8, 8, 2), (32, 4, 4, 2), (16, 2, 2, 3), (32, 2, 2, 3),
           (32, 1, 1, 3), (16, 4, 2, 3), (16, 2, 2, 4), (32, 2, 2, 2)]
POINTS = [(128, 528), (256, 528), (128, 2048), (96, 4096)]
HEADS = [(32, 8, 128), (32, 8, 64)]


@triton.jit
def _stage1_warp_splits(Q, K_Buffer, V_Buffer, Req_to_token, Req_pool_indices, Seq_lens, O, qk_scale, v_scale,
                        stride_qb, stride_qh, stride_kbs, stride_kh, stride_vbs, stride_vh, stride_req_b,
                        stride_ob, stride_oh,
                        KV_GROUP_NUM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr,
                        BLOCK_N: tl.constexpr, W: tl.constexpr, KV_F16: tl.constexpr, Q_PRESCALE: tl.constexpr):
    cur_batch = tl.program_id(0)
    kv_head = tl.program_id(1)
    offs_g = tl.arange(0, BLOCK_H)
    mask_h = offs_g < KV_GROUP_NUM
    heads = kv_head * KV_GROUP_NUM + offs_g
    offs_d = tl.arange(0, BLOCK_D)
    offs_w = tl.arange(0, W)
    seq_len = tl.load(Seq_lens + cur_batch).to(tl.int32)
    req_row = tl.load(Req_pool_indices + cur_batch).to(tl.int64)
    q = tl.load(Q + cur_batch.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                mask=mask_h[:, None], other=0.0)
    if KV_F16:
        q = tl.fma(q.to(tl.float32), Q_PRESCALE, 0.0).to(tl.float16)
    q3 = tl.broadcast_to(q[None, :, :], (W, BLOCK_H, BLOCK_D))
    e_max = tl.full([W, BLOCK_H], float("-inf"), dtype=tl.float32)
    e_sum = tl.zeros([W, BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([W, BLOCK_H, BLOCK_D], dtype=tl.float32)
    for start_n in range(0, seq_len, W * BLOCK_N):
        offs_n = start_n + offs_w[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]  # [W, BLOCK_N]
        mask_n = offs_n < seq_len
        slots = tl.load(Req_to_token + req_row * stride_req_b + offs_n, mask=mask_n, other=0).to(tl.int64)
        k = tl.load(K_Buffer + slots[:, None, :] * stride_kbs + kv_head * stride_kh + offs_d[None, :, None],
                    mask=mask_n[:, None, :], other=0.0)  # [W, D, BLOCK_N]
        qk = tl.dot(q3, k.to(q3.dtype)) * qk_scale
        qk = tl.where(mask_n[:, None, :], qk, float("-inf"))
        n_e_max = tl.maximum(tl.max(qk, 2), e_max)
        safe = tl.where(n_e_max == float("-inf"), 0.0, n_e_max)  # a split with no position yet
        re_scale = tl.exp2(e_max - safe)
        p = tl.exp2(qk - safe[:, :, None])
        v = tl.load(V_Buffer + slots[:, :, None] * stride_vbs + kv_head * stride_vh + offs_d[None, None, :],
                    mask=mask_n[:, :, None], other=0.0)  # [W, BLOCK_N, D]
        acc = acc * re_scale[:, :, None] + tl.dot(p.to(q3.dtype), v.to(q3.dtype))
        e_sum = e_sum * re_scale + tl.sum(p, 2)
        e_max = n_e_max
    m = tl.max(e_max, 0)
    alpha = tl.exp2(e_max - m[None, :])
    out = tl.sum(acc * alpha[:, :, None], 0) * (v_scale / tl.sum(e_sum * alpha, 0))[:, None]
    tl.store(O + cur_batch.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
             out.to(O.dtype.element_ty), mask=mask_h[:, None])


def warp_splits_fwd(q, k_buffer, v_buffer, o, req_to_token, req_pool_indices, seq_lens, sm_scale, config) -> None:
    block_n, w, num_warps, num_stages = config
    bs, num_heads, head_dim = q.shape
    num_kv_heads = k_buffer.shape[1]
    kv_f16 = k_buffer.dtype == torch.float8_e4m3fn
    prescale = 2.0**-4 if kv_f16 else 1.0
    _stage1_warp_splits[(bs, num_kv_heads)](
        q, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens, o, sm_scale * math.log2(math.e) / prescale,
        1.0, q.stride(0), q.stride(1), k_buffer.stride(0), k_buffer.stride(1), v_buffer.stride(0), v_buffer.stride(1),
        req_to_token.stride(0), o.stride(0), o.stride(1),
        KV_GROUP_NUM=num_heads // num_kv_heads, BLOCK_D=head_dim, BLOCK_H=16, BLOCK_N=block_n, W=w, KV_F16=kv_f16,
        Q_PRESCALE=prescale, num_warps=num_warps, num_stages=num_stages)


def main() -> None:
    from benchmarks.bench_attention import KvPool, graph_us
    from benchmarks.bench_one_batch import measure_copy_bandwidth
    from model_executor.layers.attention.triton_ops import alloc_decode_workspace, decode_attention_fwd
    from model_executor.layers.attention.triton_ops import decode_attention as dec

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", dest="json_out")
    p.add_argument("--kv-dtype", nargs="+", default=["bf16", "fp8_e4m3"], choices=["bf16", "fp8_e4m3"])
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("probe_warp_split_decode needs a CUDA GPU")
    copy_tb_s = measure_copy_bandwidth(torch.device("cuda")) / 1e12
    print(f"{torch.cuda.get_device_name()}: copy bandwidth {copy_tb_s:.2f} TB/s")
    rows_out = []
    for kv_name in args.kv_dtype:
        kv_dtype = {"bf16": torch.bfloat16, "fp8_e4m3": torch.float8_e4m3fn}[kv_name]
        for heads in HEADS:
            num_heads, num_kv_heads, head_dim = heads
            for bs, ctx in POINTS:
                pool = KvPool(bs, ctx, num_kv_heads, head_dim, dtype=kv_dtype)
                q = torch.randn(bs, num_heads, head_dim, device="cuda").bfloat16()
                ref, o = torch.empty_like(q), torch.empty_like(q)
                rows = torch.arange(1, bs + 1, device="cuda")
                lens = torch.full((bs,), ctx, dtype=torch.int32, device="cuda")
                scale = 1.0 / math.sqrt(head_dim)
                floor_us = 2 * bs * ctx * num_kv_heads * head_dim * pool.k.element_size() / (copy_tb_s * 1e6)
                logits, lse, counters = alloc_decode_workspace(bs, num_heads, head_dim, 1, "cuda")
                tile = dec.stage1_tile(bs, head_dim, num_kv_heads, dec.kv_dots_in_fp16(q.dtype, kv_dtype))
                today = graph_us(partial(decode_attention_fwd, q, pool.k, pool.v, ref, pool.req_to_token, rows, lens,
                                         logits, lse, 1, scale, counters=counters))
                line = f"{kv_name} {heads} {bs}x{ctx}: today {tile} {today:.2f} us ({today / floor_us:.2f}x)"
                best = None
                for cfg in CONFIGS:
                    try:
                        us = graph_us(partial(warp_splits_fwd, q, pool.k, pool.v, o, pool.req_to_token, rows, lens,
                                              scale, cfg))
                        diff = (o.float() - ref.float()).abs().max().item()
                    except Exception as exc:  # noqa: BLE001 - a config that does not fit
                        print(f"  {cfg} failed: {type(exc).__name__}: {str(exc)[:120]}")
                        continue
                    rows_out.append({"kv_dtype": kv_name, "heads": list(heads), "bs": bs, "ctx": ctx, "today_us": today,
                                     "today_tile": list(tile), "config": list(cfg), "us": us, "max_diff": diff,
                                     "floor_us": floor_us})
                    if best is None or us < best[0]:
                        best = (us, cfg, diff)
                    print(f"  {cfg}: {us:.2f} us ({us / floor_us:.2f}x) diff {diff:.2e}", flush=True)
                print(line + f"; best warp splits {best[1]} {best[0]:.2f} us ({best[0] / today:.2f} of today)",
                      flush=True)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "copy_tb_s": copy_tb_s, "rows": rows_out}, f, indent=1)


if __name__ == "__main__":
    main()

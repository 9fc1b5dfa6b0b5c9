"""probe_fp8_w8a8: can FP8 x FP8 tensor-core dots read an FP8 weight faster than the weight-only GEMV at a
handful of rows? (issue 18: 8B FP8 bs=1; the weight-only GEMV reads FP8 weights at ~3.3 TB/s where bf16
reaches ~4.0: per weight byte it converts and multiplies twice the values.)

    python -m benchmarks.probe_fp8_w8a8 --json out.json

Per (N, K) of the Llama-3.2-1B / 3.1-8B linears, at M = 1: today's small-M path (the table's config:
weight-only, x in bf16) against x quantized per token to FP8 (the existing kernel) followed by a Triton
kernel whose K loop is tl.dot(W_fp8 tile, x_fp8^T tile) (the weight tile the left operand, x's row
broadcast to 16 columns), over a sweep of tiles. Timing as tune_small_m_gemm: every call reads its own
weight copy (cold, as in a decode step), all calls in one CUDA graph. Prints a table, writes JSON.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
import triton
import triton.language as tl

SHAPES = {"1b": [(3072, 2048), (2048, 2048), (16384, 2048), (2048, 8192)],
          "8b": [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]}


@triton.jit
def _w8a8_dot_kernel(XQ, XS, W, S, Y, M, N, K, k_per_split, stride_xm, stride_wn, stride_ym,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_M: tl.constexpr,
                     ATOMIC: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows_n = tl.where(offs_n < N, offs_n, 0).to(tl.int64)
    offs_m = tl.arange(0, BLOCK_M)
    rows_m = tl.where(offs_m < M, offs_m, 0)
    offs_k = tl.arange(0, BLOCK_K)
    k_start = pid_k * k_per_split
    w_ptrs = W + rows_n[:, None] * stride_wn + (k_start + offs_k)[None, :]
    x_ptrs = XQ + rows_m[None, :] * stride_xm + (k_start + offs_k)[:, None]
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for _ in range(k_start, k_start + k_per_split, BLOCK_K):
        acc = tl.dot(tl.load(w_ptrs), tl.load(x_ptrs), acc)
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    acc = acc * tl.load(S + rows_n)[:, None] * tl.load(XS + rows_m)[None, :]
    mask = (offs_n < N)[:, None] & (offs_m < M)[None, :]
    y_ptrs = Y + offs_m[None, :] * stride_ym + offs_n[:, None]
    if ATOMIC:
        tl.atomic_add(y_ptrs, acc, mask=mask)
    else:
        tl.store(y_ptrs, acc.to(Y.dtype.element_ty), mask=mask)


def w8a8_dot(xq, xs, w, s, cfg, y32=None):
    """cfg = (BLOCK_N, BLOCK_K, SPLIT_K, num_warps, num_stages); SPLIT_K > 1 adds fp32 partials atomically
    into y32 (zeroed by the caller; a probe: not deterministic)."""
    bn, bk, split, warps, stages = cfg
    m, k = xq.shape
    n = w.shape[0]
    k_per = k // split
    assert k_per % bk == 0
    if split > 1:
        y = y32
    else:
        y = torch.empty((m, n), dtype=torch.bfloat16, device=xq.device)
    _w8a8_dot_kernel[(triton.cdiv(n, bn), split)](
        xq, xs, w, s, y, m, n, k, k_per, xq.stride(0), w.stride(0), n,
        BLOCK_N=bn, BLOCK_K=bk, BLOCK_M=16, ATOMIC=split > 1, num_warps=warps, num_stages=stages)
    return y


def configs(n: int, k: int, sms: int) -> list[tuple]:
    out = []
    for bn in (32, 64, 128):
        for bk in (128, 256, 512):
            for warps, stages in ((4, 3), (4, 4), (4, 6), (8, 4)):
                if bk * stages * bn > 200 * 1024:
                    continue
                progs = triton.cdiv(n, bn)
                for split in (1, 2, 4, 8):
                    if k % (split * bk) or (split > 1 and progs * split > 4 * sms) or (split > 1 and progs >= sms):
                        continue
                    out.append((bn, bk, split, warps, stages))
    return out


def main(argv=None) -> int:
    from benchmarks import tune_small_m_gemm as tune
    from model_executor.layers.quantization import fp8_ops
    from model_executor.layers.triton_ops import small_m_gemm as sm

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=["1b", "8b"], choices=sorted(SHAPES))
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    gen = torch.Generator(device="cuda").manual_seed(0)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    print(f"{'N x K':>14} {'today us':>9} {'TB/s':>6} {'quant us':>9} {'w8a8 us':>8} {'TB/s':>6} "
          f"{'q+w8a8':>7} {'best cfg':>24} {'rel err':>8}")
    for model in args.models:
        for n, k in SHAPES[model]:
            wts = tune.Weights("fp8", n, k, gen)
            x = torch.randn(1, k, device="cuda", generator=gen).bfloat16()
            today = tune.time_calls([lambda w=w, s=s: sm.small_m_linear(x, w, s, None, None)
                                     for w, s in zip(wts.w, wts.s)])
            xq, xs = fp8_ops.per_token_group_quant_fp8(x, k)
            quant = tune.time_calls([lambda: fp8_ops.per_token_group_quant_fp8(x, k)] * 64)
            ref = (xq.float() * xs) @ (wts.w[0].float() * wts.s[0][:, None]).t()
            y32 = torch.zeros((1, n), dtype=torch.float32, device="cuda")
            best = None
            for cfg in configs(n, k, sms):
                def call(w, s, cfg=cfg):
                    if cfg[2] > 1:
                        y32.zero_()
                    return w8a8_dot(xq, xs, w, s, cfg, y32)
                try:
                    out = call(wts.w[0], wts.s[0]).float()
                    err = ((out - ref).abs().max() / ref.abs().max()).item()
                    us = tune.time_calls([lambda w=w, s=s, call=call: call(w, s) for w, s in zip(wts.w, wts.s)])
                except Exception as exc:  # a tile this Triton cannot build: skip it, say so
                    print(f"  {n}x{k} {cfg}: {type(exc).__name__}: {str(exc)[:100]}", file=sys.stderr)
                    continue
                if best is None or us < best[0]:
                    best = (us, cfg, err)
            tb = wts.bytes / 1e6
            row = {"model": model, "n": n, "k": k, "today_us": today, "today_tb_s": tb / today,
                   "quant_us": quant, "w8a8_us": best[0], "w8a8_tb_s": tb / best[0], "cfg": best[1],
                   "rel_err": best[2]}
            rows.append(row)
            print(f"{n:>7}x{k:<6} {today:9.2f} {tb / today:6.2f} {quant:9.2f} {best[0]:8.2f} {tb / best[0]:6.2f} "
                  f"{quant + best[0]:7.2f} {str(best[1]):>24} {best[2]:8.1e}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(0), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""probe_tma_gemv: does a one-row FP8 GEMV stream its weights faster when TMA loads them?

Today's one-row GEMV (`small_m_gemm`'s GEMV configs) stages its weight tiles in shared memory with cp.async:
every thread computes addresses and issues its own 16-byte copies. The fourteenth session measured that
kernel 13-19% slower than the same tiling reading the weight with no arithmetic at all, and the read itself
below the copy bandwidth (docs/benchmarks.md, "The read alone"). On sm_90 a tensor descriptor's load is
one TMA instruction per tile, issued by one thread, with the bytes landing in shared memory on their own:
fewer instructions in the loop and the copies tracked by an mbarrier rather than per thread.

Variants per shape, on cold weights in one CUDA graph (tune_small_m_gemm.time_calls), us and TB/s of weight read:

- `today (table)`: the small-M kernel at its H200 table config;
- `read ptr BNxBK sS`: the weight read with an integer add per four bytes, pointer loads (cp.async), as
  probe_fp8_mma_gemv's read rows;
- `read tma BNxBK sS`: the same read through a tensor descriptor;
- `gemv ptr BNxBK sS wW`: today's kernel (its GEMV branch, cp.async loads) at that tile, not its table's;
- `gemv tma BNxBK sS wW`: the GEMV (e4m3 -> fp32 products with the bf16 x, summed over K, times the
  per-channel scale) with the weight tile from a tensor descriptor; its max relative error against float32
  products of the dequantized weights is printed alongside (today's kernel's too).

    python -m benchmarks.probe_tma_gemv --json out.json
    python -m benchmarks.probe_tma_gemv --tiles 16x256,16x512 --stages 4 6 --warps 4 8

Results: docs/benchmarks.md (twentieth session).
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
import triton
import triton.language as tl

from benchmarks.probe_fp8_mma_gemv import SHAPES, parse_pairs, read_rows, rel_err


@triton.jit
def tma_gemv(W_DESC, S, X, Y, K, BN: tl.constexpr, BK: tl.constexpr, STAGES: tl.constexpr):
    """y[n] = S[n] * sum_k W[n, k] x[k] for one bf16 row x and FP8 W [N, K] (read through W_DESC, [BN, BK]
    tiles); N a multiple of BN, K of BK."""
    pid = tl.program_id(0)
    offs_k = tl.arange(0, BK)
    acc = tl.zeros([BN, BK], dtype=tl.float32)
    for k in tl.range(0, K, BK, num_stages=STAGES):
        w = W_DESC.load([pid * BN, k])
        xt = tl.load(X + k + offs_k).to(tl.float32)
        acc += w.to(tl.float32) * xt[None, :]
    offs_n = pid * BN + tl.arange(0, BN)
    out = tl.sum(acc, axis=1) * tl.load(S + offs_n)
    tl.store(Y + offs_n, out.to(Y.dtype.element_ty))


@triton.jit
def tma_read_rows(W_DESC, Y, KW, BN: tl.constexpr, BKW: tl.constexpr, STAGES: tl.constexpr):
    """The read alone through a descriptor over W viewed as int32 words [N, KW]: y[n] = the sum of row n's
    words (one integer add per four bytes)."""
    pid = tl.program_id(0)
    acc = tl.zeros([BN, BKW], dtype=tl.int32)
    for k in tl.range(0, KW, BKW, num_stages=STAGES):
        acc += W_DESC.load([pid * BN, k])
    offs_n = pid * BN + tl.arange(0, BN)
    tl.store(Y + offs_n, tl.sum(acc, axis=1))


def descriptor(t: torch.Tensor, block: list[int]):
    from triton.tools.tensor_descriptor import TensorDescriptor

    return TensorDescriptor.from_tensor(t, block)


def gemv(w_desc, s, x, y, n, k, bn, bk, stages, warps):
    tma_gemv[(n // bn,)](w_desc, s, x, y, k, BN=bn, BK=bk, STAGES=stages, num_warps=warps, num_stages=stages)


def measure_shape(n: int, k: int, tiles, stages_list, warps_list, gen) -> list[dict]:
    from benchmarks.tune_small_m_gemm import Weights, time_calls
    from model_executor.layers.triton_ops import small_m_gemm as sm

    wts = Weights("fp8", n, k, gen)
    x = torch.randn(1, k, device="cuda", generator=gen).bfloat16()
    y = torch.empty(1, n, device="cuda", dtype=torch.bfloat16)
    yi = torch.empty(n, device="cuda", dtype=torch.int32)
    ref = (x.float() @ (wts.w[0].float() * wts.s[0][:, None]).t()).squeeze(0)
    rows = []

    def record(name, t, err=None, **extra):
        rows.append({"n": n, "k": k, "variant": name, "us": t, "tb_s": wts.bytes / t / 1e6, "rel_err": err, **extra})
        e = "" if err is None else f"{err:>9.2e}"
        print(f"{n:>6} {k:>6} {name:>30} {t:>8.2f} {wts.bytes / t / 1e6:>6.2f} {e}", flush=True)

    cfg = sm.choose_config(1, n, k, "fp8", sm.device_name("cuda"))
    t = time_calls([lambda w=w, s=s: sm.small_m_linear(x, w, s) for w, s in zip(wts.w, wts.s)])
    record(f"today (table {cfg.BLOCK_N}x{cfg.BLOCK_K} s{cfg.num_stages})", t,
           rel_err(sm.small_m_linear(x, wts.w[0], wts.s[0]).squeeze(0), ref))
    for bn, bk in tiles:
        if n % bn or k % bk:
            continue
        for st in stages_list:
            try:
                t = time_calls([lambda w=w, bn=bn, bk=bk, st=st: read_rows[(n // bn,)](
                    w.view(torch.int32), yi, k // 4, BN=bn, BKW=bk // 4, STAGES=st, num_warps=4, num_stages=st)
                    for w in wts.w])
                record(f"read ptr {bn}x{bk} s{st}", t)
                descs = [descriptor(w.view(torch.int32), [bn, bk // 4]) for w in wts.w]
                t = time_calls([lambda d=d, bn=bn, bk=bk, st=st: tma_read_rows[(n // bn,)](
                    d, yi, k // 4, BN=bn, BKW=bk // 4, STAGES=st, num_warps=4, num_stages=st) for d in descs])
                record(f"read tma {bn}x{bk} s{st}", t)
                descs = [descriptor(w, [bn, bk]) for w in wts.w]
                for warps in warps_list:
                    ptr = sm.GemmConfig(BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=st, GEMV=True)
                    t = time_calls([lambda w=w, s=s, c=ptr: sm.small_m_linear(x, w, s, config=c)
                                    for w, s in zip(wts.w, wts.s)])
                    record(f"gemv ptr {bn}x{bk} s{st} w{warps}", t,
                           rel_err(sm.small_m_linear(x, wts.w[0], wts.s[0], config=ptr).squeeze(0), ref))
                    t = time_calls([lambda d=d, s=s, bn=bn, bk=bk, st=st, wp=warps: gemv(d, s, x, y, n, k, bn, bk, st, wp)
                                    for d, s in zip(descs, wts.s)])
                    gemv(descs[0], wts.s[0], x, y, n, k, bn, bk, st, warps)
                    record(f"gemv tma {bn}x{bk} s{st} w{warps}", t, rel_err(y.squeeze(0), ref), tile=(bn, bk, st, warps))
            except Exception as exc:  # a tile that does not compile or fit: reported, not fatal
                print(f"{n:>6} {k:>6} {bn}x{bk} s{st} failed: {type(exc).__name__}: {str(exc)[:160]}", flush=True)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tiles", default="8x512,16x256,16x512,32x256,32x512", help="BNxBK tiles, comma separated")
    p.add_argument("--stages", type=int, nargs="+", default=[4, 6, 8])
    p.add_argument("--warps", type=int, nargs="+", default=[4])
    p.add_argument("--shapes", default=None, help="NxK shapes, comma separated (default: Llama-3.1-8B's)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("probe_tma_gemv needs a CUDA device with TMA (sm_90)", file=sys.stderr)
        return 2
    tiles = parse_pairs(args.tiles)
    shapes = SHAPES if args.shapes is None else parse_pairs(args.shapes)
    gen = torch.Generator(device="cuda").manual_seed(0)
    print(f"{'N':>6} {'K':>6} {'variant':>30} {'us':>8} {'TB/s':>6} {'rel err':>9}")
    rows = []
    for n, k in shapes:
        rows += measure_shape(n, k, tiles, args.stages, args.warps, gen)
    best = {}
    for r in rows:
        kind = r["variant"].split(" ")[0] + ("" if r["variant"].startswith("today") else " " + r["variant"].split(" ")[1])
        key = (r["n"], r["k"], kind)
        if key not in best or r["us"] < best[key]["us"]:
            best[key] = r
    print("\nbest per shape and kind:")
    for (n, k, kind), r in sorted(best.items()):
        print(f"{n:>6} {k:>6} {kind:>10} {r['variant']:>30} {r['us']:>8.2f} {r['tb_s']:>6.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""probe_fp8_gemv_f16acc: which way of reading and summing FP8 weights makes a one-row GEMV fastest?

Times, on cold weights in one CUDA graph (tune_small_m_gemm.time_calls), a minimal one-row FP8 GEMV on the
Llama-3.1-8B FP8 shapes against today's small-M kernel at its table config, and reports TB/s:

- f32 vs f16 sums (`--stages`): products and sums in f16x2 (HFMA2) drop the f16 -> f32 conversion of every
  weight (3.3 -> 2.4 loop instructions per weight in the SASS). Eleventh session: 1-3% faster only, so the
  GEMV is not bound by its instruction count (docs/benchmarks.md). Its x is scaled so that no partial sum
  can overflow (|x| * scale <= 65504 / (448 * K steps)); a real kernel would take that scale from max |x|.
- register loads (`--register-loads U ...`): no cp.async staging through shared memory (num_stages=1), the
  K loop unrolled U times so that U steps' loads can be in flight; f32 sums. Today's kernel stages every
  weight tile through shared memory (LDGSTS, then LDS) before it converts it.

    python -m benchmarks.probe_fp8_gemv_f16acc --json out.json
    python -m benchmarks.probe_fp8_gemv_f16acc --tiles 8x1024,16x512 --stages 3 6 --register-loads 2 4 8
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
import triton
import triton.language as tl

SHAPES = [(12288, 4096), (4096, 4096), (57344, 4096), (4096, 14336)]  # 8B qkv, o, gate_up (x2), down


@triton.jit
def gemv(W, S, X, Y, K, scale, BN: tl.constexpr, BK: tl.constexpr, STAGES: tl.constexpr, F16ACC: tl.constexpr,
         UNROLL: tl.constexpr = 1):
    """y = (x @ W^T) * s for one row, N and K multiples of the tile; F16ACC: products and sums in f16x2;
    STAGES 1: loads straight to registers, the loop unrolled UNROLL times."""
    offs_n = tl.program_id(0) * BN + tl.arange(0, BN)
    offs_k = tl.arange(0, BK)
    w_ptrs = W + offs_n[:, None].to(tl.int64) * K + offs_k[None, :]
    x_ptrs = X + offs_k[None, :]
    acc = tl.zeros([BN, BK], dtype=tl.float16 if F16ACC else tl.float32)
    for _ in tl.range(0, K, BK, num_stages=STAGES, loop_unroll_factor=UNROLL):
        w = tl.load(w_ptrs)
        x = tl.load(x_ptrs).to(tl.float32)
        if F16ACC:
            acc += w.to(tl.float16) * (x * scale).to(tl.float16)
        else:
            acc += w.to(tl.float32) * x
        w_ptrs += BK
        x_ptrs += BK
    out = tl.sum(acc.to(tl.float32), axis=1) * (tl.load(S + offs_n) / scale)
    tl.store(Y + offs_n, out.to(Y.dtype.element_ty))


def measure_shape(n: int, k: int, tiles, stages_list, gen, unrolls=()) -> list[dict]:
    """Today's kernel at its table config, then the probe GEMV per tile: per stage count with f32 and f16 sums,
    and per unroll factor with register loads."""
    from benchmarks.tune_small_m_gemm import Weights, time_calls
    from model_executor.layers.triton_ops import small_m_gemm as sm

    wts = Weights("fp8", n, k, gen)
    x = torch.randn(1, k, device="cuda", generator=gen).bfloat16()
    y = torch.empty(1, n, device="cuda", dtype=torch.bfloat16)
    ref = (x.float() @ (wts.w[0].float() * wts.s[0][:, None]).t()).squeeze(0)
    table_cfg = sm.choose_config(1, n, k, "fp8", sm.device_name("cuda"))
    us = time_calls([lambda w=w, s=s: sm.small_m_linear(x, w, s) for w, s in zip(wts.w, wts.s)])
    rows = [{"n": n, "k": k, "variant": f"table {table_cfg}", "us": us, "tb_s": wts.bytes / us / 1e6}]
    print(f"{n:>6} {k:>6} {'today (table)':>22} {us:>8.2f} {wts.bytes / us / 1e6:>6.2f}")
    # (stages, f16 sums, unroll): the staged variants, then the register loads
    variants = [(st, f16acc, 1) for st in stages_list for f16acc in (False, True)] + [(1, False, u) for u in unrolls]
    for bn, bk in tiles:
        for stages, f16acc, unroll in variants:
            # f16 sums: no partial sum can overflow (|w| <= 448, K / bk products per slot, a factor 2 spare)
            scale = 65504 / (448 * triton.cdiv(k, bk)) / 2 / float(x.abs().max()) if f16acc else 1.0

            def call(w, s, f16acc=f16acc, scale=scale, bn=bn, bk=bk, stages=stages, unroll=unroll):
                gemv[(triton.cdiv(n, bn),)](w, s, x, y, k, scale, BN=bn, BK=bk, STAGES=stages, F16ACC=f16acc,
                                            UNROLL=unroll, num_warps=4)

            if stages == 1:
                name = f"{bn}x{bk} regs x{unroll}"
            else:
                name = f"{bn}x{bk}/{stages} {'f16 acc' if f16acc else 'f32 acc'}"
            try:
                call(wts.w[0], wts.s[0])
                err = float((y.float().squeeze(0) - ref).abs().max() / ref.abs().max())
                us = time_calls([lambda w=w, s=s: call(w, s) for w, s in zip(wts.w, wts.s)])
            except Exception as exc:  # noqa: BLE001 (a tile over the GPU's resources: say so, go on)
                print(f"  {name}: {type(exc).__name__}")
                continue
            rows.append({"n": n, "k": k, "variant": name, "us": us, "tb_s": wts.bytes / us / 1e6,
                         "max_rel_err": err})
            print(f"{n:>6} {k:>6} {name:>22} {us:>8.2f} {wts.bytes / us / 1e6:>6.2f} {err:>11.2e}", flush=True)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiles", default="8x512,16x512,16x1024,32x512", help="BLOCK_NxBLOCK_K tiles to try")
    p.add_argument("--stages", type=int, nargs="+", default=[3, 4, 6], help="cp.async stages (f32 and f16 sums)")
    p.add_argument("--register-loads", type=int, nargs="*", default=[], metavar="U",
                   help="also register loads (no staging), the K loop unrolled U times")
    p.add_argument("--json", dest="json_out")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("probe_fp8_gemv_f16acc needs a CUDA device", file=sys.stderr)
        return 2
    tiles = [tuple(int(v) for v in t.split("x")) for t in args.tiles.split(",")]
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    print(f"{'N':>6} {'K':>6} {'variant':>22} {'us':>8} {'TB/s':>6} {'max rel err':>11}")
    for n, k in SHAPES:
        rows += measure_shape(n, k, tiles, args.stages, gen, args.register_loads)
        torch.cuda.empty_cache()
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

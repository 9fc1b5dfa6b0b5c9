"""probe_fp8_layout: does the FP8 weight's memory layout, or a persistent grid, let a one-row GEMV read faster?

The one-row FP8 GEMV streams at 3.1-3.5 TB/s on the Llama-3.1-8B shapes against 4.5 TB/s for the bf16 LM head,
and even its read alone (no arithmetic) reaches only 2.6-3.75 TB/s (docs/benchmarks.md, "The read alone").
Each K step of a [BN, BK] tile in the checkpoint's row-major layout reads BN segments of BK bytes, K bytes
apart. This probe times, on cold weights in one CUDA graph (tune_small_m_gemm.time_calls), against today's
small-M kernel at its table config:

- `rm` / `tm`: a minimal one-row GEMV (float32 sums, per-channel scales) reading the row-major weight, or the
  same weight repacked tile-major ([N / BN, K / BK, BN, BK]: every K step reads BN * BK contiguous bytes and a
  program's whole weight is one contiguous run);
- `read`: the same loops with the arithmetic replaced by one integer add per byte (the read alone);
- `persist`: G programs (a multiple of the SM count) walking the column tiles in one flattened loop, so the
  cp.async pipeline runs on across tiles (no waves, no per-program ramp).

    python -m benchmarks.probe_fp8_layout --json out.json
    python -m benchmarks.probe_fp8_layout --tiles 16x512,8x1024 --stages 4 6 --persist 1 2
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
import triton
import triton.language as tl

# Llama-3.1-8B: qkv, o, gate_up, down; a 235 MB matrix (the copy-rate end)
SHAPES = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (57344, 4096)]


@triton.jit
def gemv(W, S, X, Y, K, BN: tl.constexpr, BK: tl.constexpr, STAGES: tl.constexpr, TILED: tl.constexpr,
         READ_ONLY: tl.constexpr):
    """y = (x @ W^T) * s for one row (N, K multiples of the tile). TILED: W is [N / BN, K / BK, BN, BK]."""
    pid = tl.program_id(0)
    offs_n = pid * BN + tl.arange(0, BN)
    offs_k = tl.arange(0, BK)
    if TILED:
        w_ptrs = W + pid.to(tl.int64) * BN * K + tl.arange(0, BN)[:, None] * BK + offs_k[None, :]
        step = BN * BK
    else:
        w_ptrs = W + offs_n[:, None].to(tl.int64) * K + offs_k[None, :]
        step = BK
    x_ptrs = X + offs_k[None, :]
    if READ_ONLY:
        acc = tl.zeros([BN, BK], dtype=tl.int32)
    else:
        acc = tl.zeros([BN, BK], dtype=tl.float32)
    for _ in tl.range(0, K, BK, num_stages=STAGES):
        w = tl.load(w_ptrs)
        if READ_ONLY:
            acc += w.to(tl.int8, bitcast=True).to(tl.int32)
        else:
            acc += w.to(tl.float32) * tl.load(x_ptrs).to(tl.float32)
        w_ptrs += step
        x_ptrs += BK
    out = tl.sum(acc.to(tl.float32), axis=1) * tl.load(S + offs_n)
    tl.store(Y + offs_n, out.to(Y.dtype.element_ty))


@triton.jit
def gemv_persist(W, S, X, Y, K, num_tiles, BN: tl.constexpr, BK: tl.constexpr, STAGES: tl.constexpr,
                 TILED: tl.constexpr):
    """The GEMV above as G = grid programs, program p taking column tiles p, p + G, ..: one loop over
    (tile, K step), its sums stored and reset after a tile's last step."""
    pid = tl.program_id(0)
    grid = tl.num_programs(0)
    k_steps = K // BK
    my_tiles = tl.cdiv(num_tiles - pid, grid)
    offs_k = tl.arange(0, BK)
    acc = tl.zeros([BN, BK], dtype=tl.float32)
    for it in tl.range(0, my_tiles * k_steps, num_stages=STAGES):
        tile = pid + (it // k_steps) * grid
        ks = it % k_steps
        if TILED:
            w_ptrs = (W + (tile.to(tl.int64) * k_steps + ks) * (BN * BK) + tl.arange(0, BN)[:, None] * BK
                      + offs_k[None, :])
        else:
            w_ptrs = W + (tile * BN + tl.arange(0, BN))[:, None].to(tl.int64) * K + ks * BK + offs_k[None, :]
        acc += tl.load(w_ptrs).to(tl.float32) * tl.load(X + ks * BK + offs_k)[None, :].to(tl.float32)
        if ks == k_steps - 1:
            offs_n = tile * BN + tl.arange(0, BN)
            out = tl.sum(acc, axis=1) * tl.load(S + offs_n)
            tl.store(Y + offs_n, out.to(Y.dtype.element_ty))
            acc = tl.zeros([BN, BK], dtype=tl.float32)


def tile_major(w: torch.Tensor, bn: int, bk: int) -> torch.Tensor:
    n, k = w.shape
    return w.view(n // bn, bn, k // bk, bk).transpose(1, 2).contiguous()


def measure_shape(n: int, k: int, tiles, stages_list, persists, gen) -> list[dict]:
    from benchmarks.tune_small_m_gemm import Weights, time_calls
    from model_executor.layers.triton_ops import small_m_gemm as sm

    wts = Weights("fp8", n, k, gen)
    x = torch.randn(1, k, device="cuda", generator=gen).bfloat16()
    y = torch.empty(1, n, device="cuda", dtype=torch.bfloat16)
    ref = (x.float() @ (wts.w[0].float() * wts.s[0][:, None]).t()).squeeze(0)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    table_cfg = sm.choose_config(1, n, k, "fp8", sm.device_name("cuda"))
    us = time_calls([lambda w=w, s=s: sm.small_m_linear(x, w, s) for w, s in zip(wts.w, wts.s)])
    rows = [{"n": n, "k": k, "variant": f"today {table_cfg}", "us": us, "tb_s": wts.bytes / us / 1e6}]
    print(f"{n:>6} {k:>6} {'today (table)':>24} {us:>8.2f} {wts.bytes / us / 1e6:>6.2f}", flush=True)

    def run(name, call, ws, check=True):
        try:
            call(ws[0], wts.s[0])
            err = float((y.float().squeeze(0) - ref).abs().max() / ref.abs().max()) if check else float("nan")
            t = time_calls([lambda w=w, s=s: call(w, s) for w, s in zip(ws, wts.s)])
        except Exception as exc:  # noqa: BLE001 (a tile over the GPU's resources: say so, go on)
            print(f"  {name}: {type(exc).__name__}: {str(exc)[:100]}", flush=True)
            return
        rows.append({"n": n, "k": k, "variant": name, "us": t, "tb_s": wts.bytes / t / 1e6, "max_rel_err": err})
        print(f"{n:>6} {k:>6} {name:>24} {t:>8.2f} {wts.bytes / t / 1e6:>6.2f} {err:>11.2e}", flush=True)

    for bn, bk in tiles:
        if n % bn or k % bk:
            continue
        tiled = [tile_major(w, bn, bk) for w in wts.w]
        for layout, ws in (("rm", wts.w), ("tm", tiled)):
            for stages in stages_list:
                for read_only in (False, True):
                    def call(w, s, bn=bn, bk=bk, stages=stages, t=layout == "tm", ro=read_only):
                        gemv[(n // bn,)](w, s, x, y, k, BN=bn, BK=bk, STAGES=stages, TILED=t, READ_ONLY=ro,
                                         num_warps=4)
                    run(f"{layout} {bn}x{bk}/{stages}{' read' if read_only else ''}", call, ws, not read_only)
                for occ in persists:
                    g = min(sms * occ, n // bn)

                    def call(w, s, bn=bn, bk=bk, stages=stages, t=layout == "tm", g=g):
                        gemv_persist[(g,)](w, s, x, y, k, n // bn, BN=bn, BK=bk, STAGES=stages, TILED=t,
                                           num_warps=4)
                    run(f"{layout} {bn}x{bk}/{stages} persist {occ}", call, ws)
        del tiled
        torch.cuda.empty_cache()
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiles", default="8x1024,16x512,32x256,16x1024,64x128", help="BNxBK tiles")
    p.add_argument("--stages", type=int, nargs="+", default=[4, 6])
    p.add_argument("--persist", type=int, nargs="*", default=[1, 2],
                   help="persistent grids of this many programs per SM (at the last stage count)")
    p.add_argument("--shapes", default=",".join(f"{n}x{k}" for n, k in SHAPES))
    p.add_argument("--json", dest="json_out")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("probe_fp8_layout needs a CUDA device", file=sys.stderr)
        return 2
    tiles = [tuple(int(v) for v in t.split("x")) for t in args.tiles.split(",")]
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    print(f"{'N':>6} {'K':>6} {'variant':>24} {'us':>8} {'TB/s':>6} {'max rel err':>11}")
    for n, k in shapes:
        rows += measure_shape(n, k, tiles, args.stages, args.persist, gen)
        torch.cuda.empty_cache()
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

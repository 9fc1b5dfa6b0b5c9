"""probe_fused_mlp: one kernel for a decode row's whole MLP (gate/up, SiLU-and-mul, down), against today's two
(issues 18, 23).

At one row a layer's MLP is two GEMVs: gate/up with SiLU-and-mul in its epilogue, then down with the residual
add and the next norm's sum of squares in its. Each pays a launch's ramp and tail (docs/benchmarks.md: a 117 MB
FP8 read streams at ~3.75 TB/s, a 235 MB one at ~4.1). The MLP splits along its intermediate dimension
without a barrier: a program that owns intermediate rows [j0, j0 + R) computes their gate and up sums over all
of the hidden size, then a_j = silu(g_j) * u_j, then a_j times column j of down into an [H] vector. The
programs' vectors meet by atomic adds in an [H] buffer; the program that arrives last (an arrival counter)
adds the residual, stores h, G * h and sum(h^2) (what the next layer's qkv takes, small_m_gemm's ADD_NORM) and
zeroes the buffer and the counter for the next call. Two kernels:

- `u:P/BJ/stages/warps[/fixed]` (fused_mlp_kernel): down stored transposed, [I, H], so that column j of down is
  a contiguous row; one loop whose every step loads BJ rows of gate, up and down^T and finishes them, so the
  loads of later steps stay in flight. float32 atomic adds (the sums' order, so their bits, vary between
  calls), or with `fixed` int64 fixed point (2^-32: the same bits in any order).
- `n:R/BK/BH/ST1/ST2/PRE[/warps]` (fused_mlp_natural_kernel): down as stored, [H, I]: gate/up over H in one
  loop, then the program's R columns of down in [BH, R] tiles in a second (PRE: its first tile loaded before
  the first loop).

Measured per layer over --layers layers of cold weights, all calls in one CUDA graph: `today` (the model's
kernels: small_m_silu_and_mul then small_m_linear_add_rmsnorm, table configs) against each variant; max |h -
today's h| (sums in another order: bf16 rounding). Results: docs/benchmarks.md (thirty-second session).

    python -m benchmarks.probe_fused_mlp --model llama-3.1-8b --quantization fp8 --json out.json
    python -m benchmarks.probe_fused_mlp --model llama-3.2-1b --variants u:128/4/3/4 u:128/4/3/4/1 --repeat 3
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
import triton
import triton.language as tl

SHAPES = {"llama-3.1-8b": (4096, 14336), "llama-3.2-1b": (2048, 8192)}  # (hidden H, intermediate I)
EPS = 1e-5


@triton.jit
def _last_arrival(X, ACC, CNT, RES, G, HOUT, YOUT, POUT, H: tl.constexpr, FIXED: tl.constexpr):
    """After this program's atomic adds into ACC: count its arrival; the last program adds the residual, stores
    h, G * h and sum(h^2), and zeroes ACC and the counter."""
    offs_h = tl.arange(0, H)
    tl.debug_barrier()
    n = tl.atomic_add(CNT, 1, sem="acq_rel")
    if n == tl.num_programs(0) - 1:  # the last to arrive: every program's sums are in ACC
        tot = tl.load(ACC + offs_h, cache_modifier=".cg")
        if FIXED:
            tot = tot.to(tl.float32) * (1.0 / 4294967296.0)
        h = (tot.to(X.dtype.element_ty).to(tl.float32) + tl.load(RES + offs_h).to(tl.float32)).to(X.dtype.element_ty)
        tl.store(HOUT + offs_h, h)
        hf = h.to(tl.float32)
        tl.store(YOUT + offs_h, (hf * tl.load(G + offs_h).to(tl.float32)).to(X.dtype.element_ty))
        tl.store(POUT, tl.sum(hf * hf))
        tl.store(ACC + offs_h, tl.zeros([H], dtype=ACC.dtype.element_ty))
        tl.store(CNT, 0)


@triton.jit
def fused_mlp_kernel(X, WGU, SGU, WDT, SD, ACC, CNT, RES, G, HOUT, YOUT, POUT,
                     I: tl.constexpr, H: tl.constexpr, R: tl.constexpr, BJ: tl.constexpr,
                     STAGES: tl.constexpr, SCALED: tl.constexpr, FIXED: tl.constexpr):
    """Program p: intermediate rows [p * R, (p + 1) * R), BJ a step. WGU [2I, H] ([gate; up]), WDT down^T
    [I, H]; SGU [2I] and SD [H] per-row scales (SCALED: FP8 weights). ACC: float32, or int64 with FIXED."""
    pid = tl.program_id(0)
    offs_h = tl.arange(0, H)
    offs_j = tl.arange(0, BJ)
    offs_2 = tl.arange(0, 2)
    x = tl.load(X + offs_h).to(tl.float32)
    acc = tl.zeros([H], dtype=tl.float32)
    j0 = pid * R
    for s in tl.range(0, R, BJ, num_stages=STAGES):
        rows = j0 + s + offs_j  # [BJ]
        gu_rows = (rows[:, None] + offs_2[None, :] * I).to(tl.int64)  # [BJ, 2]: gate row j, up row I + j
        gu = tl.load(WGU + gu_rows[:, :, None] * H + offs_h[None, None, :])  # [BJ, 2, H]
        d = tl.load(WDT + rows.to(tl.int64)[:, None] * H + offs_h[None, :])  # [BJ, H]
        dots = tl.sum(gu.to(tl.float32) * x[None, None, :], axis=2)  # [BJ, 2]
        if SCALED:
            dots = dots * tl.load(SGU + gu_rows)
        g, u = tl.split(dots)
        # rounded as the linear's output, then as SiluAndMul's (bf16), as today's SILU_MUL epilogue rounds
        g = g.to(X.dtype.element_ty).to(tl.float32)
        u = u.to(X.dtype.element_ty).to(tl.float32)
        a = (g / (1.0 + tl.exp(-g)) * u).to(X.dtype.element_ty).to(tl.float32)
        acc += tl.sum(a[:, None] * d.to(tl.float32), axis=0)
    if SCALED:
        acc = acc * tl.load(SD + offs_h)
    if FIXED:  # int64 fixed point (2^-32): the same sums in any order, so the same bits every call
        tl.atomic_add(ACC + offs_h, (acc * 4294967296.0).to(tl.int64), sem="relaxed")
    else:
        tl.atomic_add(ACC + offs_h, acc, sem="relaxed")
    _last_arrival(X, ACC, CNT, RES, G, HOUT, YOUT, POUT, H, FIXED)


@triton.jit
def fused_mlp_natural_kernel(X, WGU, SGU, WD, SD, ACC, CNT, RES, G, HOUT, YOUT, POUT,
                             I: tl.constexpr, H: tl.constexpr, R: tl.constexpr, BK: tl.constexpr,
                             BH: tl.constexpr, ST1: tl.constexpr, ST2: tl.constexpr, SCALED: tl.constexpr,
                             PRE: tl.constexpr):
    """Down in its own layout [H, I]: program p owns intermediate rows [p * R, (p + 1) * R) (R bytes or
    elements of each down row: whole sectors where R * element size is a multiple of 32). Two loops: gate/up
    over H in BK steps (the GEMV's tile [R, BK] twice), then down's [BH, R] tiles of the program's columns,
    each step's BH sums added into ACC. PRE: down's first tile is loaded before the first loop."""
    pid = tl.program_id(0)
    j0 = pid * R
    offs_r = tl.arange(0, R)
    offs_k = tl.arange(0, BK)
    offs_b = tl.arange(0, BH)
    rows_g = (j0 + offs_r).to(tl.int64)
    d_ptrs = WD + offs_b.to(tl.int64)[:, None] * I + (j0 + offs_r)[None, :]
    if PRE:
        d_first = tl.load(d_ptrs)
    if SCALED:
        sg = tl.load(SGU + rows_g)
        su = tl.load(SGU + rows_g + I)
    acc_g = tl.zeros([R, BK], dtype=tl.float32)
    acc_u = tl.zeros([R, BK], dtype=tl.float32)
    g_ptrs = WGU + rows_g[:, None] * H + offs_k[None, :]
    u_ptrs = g_ptrs + I * H
    for k in tl.range(0, H, BK, num_stages=ST1):
        xk = tl.load(X + k + offs_k).to(tl.float32)[None, :]
        acc_g += tl.load(g_ptrs).to(tl.float32) * xk
        acc_u += tl.load(u_ptrs).to(tl.float32) * xk
        g_ptrs += BK
        u_ptrs += BK
    g = tl.sum(acc_g, axis=1)
    u = tl.sum(acc_u, axis=1)
    if SCALED:
        g = g * sg
        u = u * su
    g = g.to(X.dtype.element_ty).to(tl.float32)
    u = u.to(X.dtype.element_ty).to(tl.float32)
    a = (g / (1.0 + tl.exp(-g)) * u).to(X.dtype.element_ty).to(tl.float32)[None, :]  # [1, R]
    h0 = 0
    if PRE:
        part = tl.sum(d_first.to(tl.float32) * a, axis=1)
        if SCALED:
            part = part * tl.load(SD + offs_b)
        tl.atomic_add(ACC + offs_b, part, sem="relaxed")
        d_ptrs += BH * I
        h0 = BH
    for hs in tl.range(h0, H, BH, num_stages=ST2):
        part = tl.sum(tl.load(d_ptrs).to(tl.float32) * a, axis=1)
        if SCALED:
            part = part * tl.load(SD + hs + offs_b)
        tl.atomic_add(ACC + hs + offs_b, part, sem="relaxed")
        d_ptrs += BH * I
    _last_arrival(X, ACC, CNT, RES, G, HOUT, YOUT, POUT, H, False)


class Layer:
    """One layer's MLP weights (random; FP8 with per-row scales) in both layouts, and its outputs."""

    def __init__(self, h: int, i: int, fp8: bool, gen: torch.Generator, device: str):
        def make(n, k):
            w = torch.randn(n, k, device=device, generator=gen) * 0.02
            if not fp8:
                return w.bfloat16(), None
            s = (w.abs().amax(dim=1) / 448.0).float()
            return (w / s[:, None]).to(torch.float8_e4m3fn), s

        self.wgu, self.sgu = make(2 * i, h)
        self.wd, self.sd = make(h, i)
        # down^T [I, H] (FP8 through its bytes: transposing copies of float8 are not everywhere)
        self.wdt = (self.wd.view(torch.uint8).t().contiguous().view(self.wd.dtype) if fp8
                    else self.wd.t().contiguous())
        self.res = (torch.randn(1, h, device=device, generator=gen)).bfloat16()
        self.g = (1 + 0.1 * torch.randn(h, device=device, generator=gen)).bfloat16()
        self.acc = torch.zeros(h, device=device, dtype=torch.float32)
        self.acc64 = torch.zeros(h, device=device, dtype=torch.int64)
        self.cnt = torch.zeros(1, device=device, dtype=torch.int32)
        self.h = torch.empty(1, h, device=device, dtype=torch.bfloat16)
        self.y = torch.empty(1, h, device=device, dtype=torch.bfloat16)
        self.p = torch.empty(1, device=device, dtype=torch.float32)


def run_today(x: torch.Tensor, layer: Layer) -> torch.Tensor:
    from model_executor.layers.triton_ops import small_m_gemm as sm

    act = sm.small_m_silu_and_mul(x, layer.wgu, layer.sgu)
    _, h = sm.small_m_linear_add_rmsnorm(act, layer.wd, layer.sd, None, None, layer.res, layer.g, EPS)
    return h


def run_fused(x: torch.Tensor, layer: Layer, programs: int, bj: int, stages: int, warps: int,
              fixed: int = 0) -> torch.Tensor:
    h, i = layer.wd.shape
    fused_mlp_kernel[(programs,)](
        x, layer.wgu, layer.sgu, layer.wdt, layer.sd, layer.acc64 if fixed else layer.acc, layer.cnt, layer.res,
        layer.g, layer.h, layer.y, layer.p, I=i, H=h, R=i // programs, BJ=bj, STAGES=stages,
        SCALED=layer.sgu is not None, FIXED=bool(fixed), num_warps=warps)
    return layer.h


def run_natural(x: torch.Tensor, layer: Layer, r: int, bk: int, bh: int, st1: int, st2: int, pre: int,
                warps: int = 4) -> torch.Tensor:
    h, i = layer.wd.shape
    fused_mlp_natural_kernel[(i // r,)](
        x, layer.wgu, layer.sgu, layer.wd, layer.sd, layer.acc, layer.cnt, layer.res, layer.g, layer.h, layer.y,
        layer.p, I=i, H=h, R=r, BK=bk, BH=bh, ST1=st1, ST2=st2, SCALED=layer.sgu is not None, PRE=bool(pre),
        num_warps=warps)
    return layer.h


# "u:P/BJ/stages/warps[/fixed]": fused_mlp_kernel (down^T; fixed: int64 fixed-point sums); "n:R/BK/BH/ST1/ST2/PRE[/warps]": fused_mlp_natural_kernel
DEFAULT_VARIANTS = (
    "u:256/2/3/4", "u:256/1/4/4", "u:128/4/3/4", "u:256/2/4/4", "u:128/4/4/4",
    "n:64/64/128/4/4/1", "n:64/64/256/4/4/1", "n:64/128/128/4/4/1", "n:64/64/128/4/4/0", "n:64/64/128/3/4/1",
    "n:32/128/256/4/4/1", "n:32/128/512/4/4/1", "n:32/256/256/4/4/1", "n:32/128/256/4/4/0", "n:32/128/256/3/3/1",
    "n:64/64/128/4/4/1/8", "n:32/128/256/4/4/1/8",
)


def variant_step(spec: str):
    kind, _, nums = spec.partition(":")
    args = [int(v) for v in nums.split("/")]
    fn = run_fused if kind == "u" else run_natural
    return lambda x, layer: fn(x, layer, *args)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", choices=sorted(SHAPES), default="llama-3.1-8b")
    p.add_argument("--quantization", choices=["none", "fp8"], default="none")
    p.add_argument("--layers", type=int, default=4, help="layers of weights cycled (cold: over the L2)")
    p.add_argument("--variants", nargs="+", default=list(DEFAULT_VARIANTS),
                   help="u:P/BJ/stages/warps (down transposed) or n:R/BK/BH/ST1/ST2/PRE[/warps] (down as stored)")
    p.add_argument("--repeat", type=int, default=2, help="times each variant (and today) is measured")
    p.add_argument("--replays", type=int, default=20)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("probe_fused_mlp needs a CUDA device", file=sys.stderr)
        return 2
    from benchmarks.tune_small_m_gemm import time_calls

    h, i = SHAPES[args.model]
    fp8 = args.quantization == "fp8"
    gen = torch.Generator(device="cuda").manual_seed(0)
    layers = [Layer(h, i, fp8, gen, "cuda") for _ in range(args.layers)]
    x = torch.randn(1, h, device="cuda", generator=gen).bfloat16()
    wbytes = layers[0].wgu.numel() * layers[0].wgu.element_size() * 3 // 2
    print(f"{torch.cuda.get_device_name()}: {args.model} {'FP8' if fp8 else 'bf16'} MLP, {wbytes / 1e6:.1f} MB a "
          f"layer, {args.layers} layers")
    print(f"{'variant':>24} {'us/layer':>9} {'TB/s':>6} {'max diff':>9}")
    rows = []

    def report(name, step, ref=None):
        calls = [lambda layer=layer: step(x, layer) for layer in layers]
        try:
            us = time_calls(calls, args.replays)
        except (triton.runtime.errors.OutOfResources, triton.CompilationError, RuntimeError) as e:  # reported, not fatal
            print(f"{name:>24} failed: {type(e).__name__}: {str(e)[:120]}")
            return None
        torch.cuda.synchronize()
        outs = [step(x, layer).clone() for layer in layers]
        diff = None if ref is None else max(float((o.float() - r.float()).abs().max()) for o, r in zip(outs, ref))
        row = {"variant": name, "us_per_layer": us, "tb_s": wbytes / us / 1e6, "max_diff": diff}
        rows.append(row)
        print(f"{name:>24} {us:>9.2f} {row['tb_s']:>6.2f} {'' if diff is None else f'{diff:.3g}':>9}", flush=True)
        return outs

    ref = report("today", run_today)
    for rep in range(args.repeat):
        if rep:
            report("today", run_today, ref)
        for spec in args.variants:
            i_rows = int(spec.split(":")[1].split("/")[0])
            if spec.startswith("u:") and (i % i_rows or (i // i_rows) % int(spec.split("/")[1])):
                continue
            if spec.startswith("n:") and i % i_rows:
                continue
            report(spec, variant_step(spec), ref)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "model": args.model, "fp8": fp8,
                       "bytes_per_layer": wbytes, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

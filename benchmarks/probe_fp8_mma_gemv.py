"""probe_fp8_mma_gemv: can a one-row FP8 GEMV skip converting its weights by multiplying on FP8 tensor cores?

Today's one-row FP8 GEMV converts every weight (e4m3 -> fp16 -> fp32) on the CUDA cores before its FMA, and
streams below the copy bandwidth at Llama-3.1-8B's shapes. An FP8 x FP8 tl.dot takes the weight tile as it was loaded,
but needs x in e4m3 too: 4 significant bits instead of bf16's 8. One row of x fills one of the 16 columns
the dot pads to, so x can go in as two e4m3 terms at no cost in MMA work: column 0 holds hi = e4m3(x / s),
column 1 lo = e4m3((x / s - hi) * 16), and the sum hi * s + lo * s / 16 carries about 8 significant bits of
x (a bf16 x's own). s is a scale per K block of x (max |x| / 448), so both terms stay in e4m3's range.

Variants, on cold weights in one CUDA graph (tune_small_m_gemm.time_calls), against today's small-M kernel at
its table config (model_executor/layers/triton_ops/configs):

- `pre`: x quantized beforehand ([16, K] e4m3 columns, a scale per K block and column): the best case, what
  the loop costs when a producer kernel writes x in e4m3;
- `inline`: each program loads its step's x block in bf16 and splits it (a max over the block per step);
- `inline, scales given`: the same with the block scales read (as a producer kernel could leave them, e.g. by
  an atomic max per block): what building the 16-column operand every step costs without the max;
- `terms 1`: `inline` with hi only (plain W8A8 with a scale per K block): the error without the lo term.

Each row reports us per call, TB/s of weight read, and the max relative error against float32 products of
the dequantized weights and the bf16 x (today's kernel's error alongside).

- `read BNxBK`, `torch row sums` (also alone with --read-only): the weight read with no arithmetic but an
  integer add per word, at today's tile and a few others: the ceiling a one-row GEMV of that tiling can reach.

The dot needs BN >= 64 to run on FP8 wgmma (smaller tiles fall back to fp16 mma, converting the weights);
with N = 4096 that is 64 programs, so `rR` reads each weight row as R segments of K / R (R rows of the
tile; x's segments in R column pairs). Results: docs/benchmarks.md (fourteenth session).

    python -m benchmarks.probe_fp8_mma_gemv --json out.json
    python -m benchmarks.probe_fp8_mma_gemv --tiles 64x256,128x128 --stages 4 6 --r 1 2 4
    python -m benchmarks.probe_fp8_mma_gemv --read-only --shapes 28672x4096,57344x4096
    python -m benchmarks.probe_fp8_mma_gemv --chain 4

`--chain L`: probe_persistent_layer's layer chain (o_proj -> gate/up -> down -> next qkv of Llama-3.1-8B FP8,
one row, L layers of cold weights) with today's kernels against a chain of `mma_chain_gemv`: each kernel
splits its x from per-block maxima that the kernel before left by one atomic max per program (zeroed by one
memset a step), the design a model path would take. Reported: us per layer and the output's relative
difference from today's chain.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
import triton
import triton.language as tl

SHAPES = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]  # Llama-3.1-8B qkv, o, gate_up, down
LO = 16.0  # the lo term's factor: the residual of an e4m3 rounding is at most 1/16 of the value


@triton.jit
def _split_terms(xb, s, term, valid_c, TERMS: tl.constexpr, LO: tl.constexpr):
    """x blocks xb [BK, 16] (column c: segment c // TERMS) over scales s [16] -> the dot's e4m3 operand (column
    c: term c % TERMS, hi or lo) and the column scales that take the products back."""
    xs = xb * (1.0 / s)[None, :]
    hi = xs.to(tl.float8e4nv).to(tl.float32)
    if TERMS == 2:
        q = tl.where(term[None, :] == 0, hi, (xs - hi) * LO)
        col = tl.where(valid_c, tl.where(term == 0, s, s / LO), 0.0)
    else:
        q = hi
        col = tl.where(valid_c, s, 0.0)
    return q.to(tl.float8e4nv), col


@triton.jit
def _own_segments(acc, offs_v, seg, BN: tl.constexpr, R: tl.constexpr):
    """acc [BN, 16] -> [BN / R]: each virtual row's own segment's columns, the R rows of an output added."""
    own = seg[None, :] == (offs_v % R)[:, None]
    v = tl.sum(tl.where(own, acc, 0.0), axis=1)
    return tl.sum(tl.reshape(v, [BN // R, R]), axis=1)


@triton.jit
def mma_gemv(W, S, XQ, XS, X, Y, KR, BN: tl.constexpr, BK: tl.constexpr, STAGES: tl.constexpr,
             INLINE: tl.constexpr, TERMS: tl.constexpr, R: tl.constexpr, LO: tl.constexpr):
    # INLINE: 0 x pre-split (XQ, XS); 1 split here, scales from a max per step; 2 split here, scales from XS
    """y[n] = sum_k W[n, k] x[k] * S[n] for one row, W read as [N * R, KR = K / R] (row n's R segments are
    rows n * R .. n * R + R - 1), so that N = 4096 still gives enough programs of BN >= 64 rows (the wgmma
    tile). The dot is acc[BN, 16] = W_tile[BN, BK] @ xq[BK, 16]; column c holds term c % TERMS of x's segment
    c // TERMS (hi, lo), each with its scale per K block; a row keeps its own segment's columns, and the R
    rows of one output add up. BN, KR multiples of R * (BN / R) and BK."""
    offs_v = tl.program_id(0) * BN + tl.arange(0, BN)
    offs_k = tl.arange(0, BK)
    offs_c = tl.arange(0, 16)
    seg = offs_c // TERMS
    term = offs_c % TERMS
    valid_c = seg < R
    w_ptrs = W + offs_v[:, None].to(tl.int64) * KR + offs_k[None, :]
    acc = tl.zeros([BN, 16], dtype=tl.float32)
    for k in tl.range(0, KR, BK, num_stages=STAGES):
        w = tl.load(w_ptrs)
        if INLINE:  # [BK, 16]: column c has segment c // TERMS's block of x
            xb = tl.load(X + seg[None, :] * KR + (k + offs_k)[:, None], mask=valid_c[None, :], other=0.0)
            xb = xb.to(tl.float32)
            if INLINE == 2:  # the scales given (XS, as `pre` has them): only the split is done here
                given = tl.load(XS + (k // BK) * 16 + offs_c)
                s = tl.where(valid_c, tl.where(term == 0, given, given * LO), 1.0)
            else:
                s = tl.maximum(tl.max(tl.abs(xb), axis=0), 1e-30) / 448.0  # [16]
            xq, col = _split_terms(xb, s, term, valid_c, TERMS, LO)
        else:  # XQ [16, KR] e4m3 (the dot's right operand, K-major), XS [KR / BK, 16] float32
            xq = tl.load(XQ + offs_c[None, :] * KR + (k + offs_k)[:, None])
            col = tl.load(XS + (k // BK) * 16 + offs_c)
        acc += tl.dot(w, xq) * col[None, :]
        w_ptrs += BK
    out = _own_segments(acc, offs_v, seg, BN, R)
    offs_n = tl.program_id(0) * (BN // R) + tl.arange(0, BN // R)
    out = out * tl.load(S + offs_n)
    tl.store(Y + offs_n, out.to(Y.dtype.element_ty))


@triton.jit
def read_rows(W, Y, KW, BN: tl.constexpr, BKW: tl.constexpr, STAGES: tl.constexpr):
    """The read alone: W viewed as int32 words [N, KW], y[n] = the sum of row n's words (one integer add per
    four bytes), the GEMV's tile and pipeline without its conversions and products."""
    offs_n = tl.program_id(0) * BN + tl.arange(0, BN)
    offs_k = tl.arange(0, BKW)
    w_ptrs = W + offs_n[:, None].to(tl.int64) * KW + offs_k[None, :]
    acc = tl.zeros([BN, BKW], dtype=tl.int32)
    for _ in tl.range(0, KW, BKW, num_stages=STAGES):
        acc += tl.load(w_ptrs)
        w_ptrs += BKW
    tl.store(Y + offs_n, tl.sum(acc, axis=1))


@triton.jit
def mma_chain_gemv(W, S, X, XMAX, Y, YMAX, KR, BN: tl.constexpr, BK: tl.constexpr, STAGES: tl.constexpr,
                   R: tl.constexpr, LO: tl.constexpr, OUT_BK: tl.constexpr):
    """mma_gemv with x split in the kernel from block maxima a producer left (XMAX: max |x| per BK block of x,
    float32), and this kernel leaving the same for its consumer: y rounded to bf16, then one atomic max of |y|
    over the program's BN / R outputs into YMAX[first output // OUT_BK] (zeroed before the step; the outputs
    must lie in one OUT_BK block)."""
    offs_v = tl.program_id(0) * BN + tl.arange(0, BN)
    offs_k = tl.arange(0, BK)
    offs_c = tl.arange(0, 16)
    seg = offs_c // 2
    term = offs_c % 2
    valid_c = seg < R
    w_ptrs = W + offs_v[:, None].to(tl.int64) * KR + offs_k[None, :]
    acc = tl.zeros([BN, 16], dtype=tl.float32)
    for k in tl.range(0, KR, BK, num_stages=STAGES):
        w = tl.load(w_ptrs)
        xb = tl.load(X + seg[None, :] * KR + (k + offs_k)[:, None], mask=valid_c[None, :], other=0.0)
        xb = xb.to(tl.float32)
        m = tl.load(XMAX + seg * (KR // BK) + k // BK, mask=valid_c, other=1.0)
        s = tl.maximum(m, 1e-30) / 448.0
        xq, col = _split_terms(xb, s, term, valid_c, 2, LO)
        acc += tl.dot(w, xq) * col[None, :]
        w_ptrs += BK
    out = _own_segments(acc, offs_v, seg, BN, R)
    first = tl.program_id(0) * (BN // R)
    offs_n = first + tl.arange(0, BN // R)
    out = (out * tl.load(S + offs_n)).to(Y.dtype.element_ty)
    tl.store(Y + offs_n, out)
    tl.atomic_max(YMAX + first // OUT_BK, tl.max(tl.abs(out.to(tl.float32)), axis=0))


def split_x(x: torch.Tensor, bk: int, r: int, terms: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    """x [1, K] bf16 -> (xq [16, K / r] e4m3, xs [K / r / bk, 16] float32) as `inline` builds them: column c
    is term c % terms (hi, lo) of segment c // terms, with a scale per bk block of each segment."""
    k = x.shape[1]
    kr = k // r
    xq = torch.zeros(16, kr, device=x.device)
    scales = torch.zeros(kr // bk, 16, device=x.device)
    for j in range(r):
        xf = x.float()[0, j * kr:(j + 1) * kr].view(kr // bk, bk)
        s = xf.abs().amax(dim=1, keepdim=True).clamp_min(1e-30) / 448.0
        xs_ = xf * (1.0 / s)
        hi = xs_.to(torch.float8_e4m3fn).float()
        lo = ((xs_ - hi) * LO).to(torch.float8_e4m3fn).float()
        xq[terms * j] = hi.reshape(kr)
        scales[:, terms * j] = s[:, 0]
        if terms == 2:
            xq[terms * j + 1] = lo.reshape(kr)
            scales[:, terms * j + 1] = s[:, 0] / LO
    return xq.to(torch.float8_e4m3fn).contiguous(), scales.contiguous()


def parse_pairs(text: str) -> list[tuple[int, ...]]:
    """"AxB,CxD" (tiles, NxK shapes) -> [(A, B), (C, D)]."""
    return [tuple(int(v) for v in t.split("x")) for t in text.split(",")]


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.float() - ref).abs().max() / ref.abs().max())


def measure_shape(n: int, k: int, tiles, stages_list, rs, top, gen, read_only=False) -> list[dict]:
    from benchmarks.tune_small_m_gemm import Weights, time_calls
    from model_executor.layers.triton_ops import small_m_gemm as sm

    wts = Weights("fp8", n, k, gen)
    x = torch.randn(1, k, device="cuda", generator=gen).bfloat16()
    y = torch.empty(1, n, device="cuda", dtype=torch.bfloat16)
    ref = (x.float() @ (wts.w[0].float() * wts.s[0][:, None]).t()).squeeze(0)
    cfg = sm.choose_config(1, n, k, "fp8", sm.device_name("cuda"))
    us = time_calls([lambda w=w, s=s: sm.small_m_linear(x, w, s) for w, s in zip(wts.w, wts.s)])
    err = rel_err(sm.small_m_linear(x, wts.w[0], wts.s[0]).squeeze(0), ref)
    rows = [{"n": n, "k": k, "variant": f"table {cfg}", "us": us, "tb_s": wts.bytes / us / 1e6, "rel_err": err}]
    print(f"{n:>6} {k:>6} {'today (table)':>36} {us:>8.2f} {wts.bytes / us / 1e6:>6.2f} {err:>9.2e}", flush=True)
    def run(bn, bk, r, stages, mode):
        inline, terms = {"pre": (0, 2), "inline": (1, 2), "inline, scales given": (2, 2), "terms 1": (1, 1)}[mode]
        xq, xs = split_x(x, bk, r, terms)

        def call(w, s):
            mma_gemv[(n * r // bn,)](w, s, xq, xs, x, y, k // r, BN=bn, BK=bk, STAGES=stages, INLINE=inline,
                                     TERMS=terms, R=r, LO=LO, num_warps=4, num_stages=stages)
        name = f"{bn}x{bk} r{r} s{stages} {mode}"
        try:
            t = time_calls([lambda w=w, s=s: call(w, s) for w, s in zip(wts.w, wts.s)])
            call(wts.w[0], wts.s[0])
            e = rel_err(y.squeeze(0), ref)
        except Exception as exc:  # a tile that does not compile or fit: reported, not fatal
            print(f"{n:>6} {k:>6} {name:>36}  failed: {type(exc).__name__}: {str(exc)[:120]}", flush=True)
            return None
        row = {"n": n, "k": k, "variant": name, "us": t, "tb_s": wts.bytes / t / 1e6, "rel_err": e,
               "tile": (bn, bk, r, stages)}
        print(f"{n:>6} {k:>6} {name:>36} {t:>8.2f} {wts.bytes / t / 1e6:>6.2f} {e:>9.2e}", flush=True)
        rows.append(row)
        return row

    # the read alone at today's tile (when it is a GEMV config) and at a few others, and torch's row sums
    yi = torch.empty(n, device="cuda", dtype=torch.int32)
    read_tiles = [(cfg.BLOCK_N, cfg.BLOCK_K, cfg.num_stages)] if cfg is not None and cfg.GEMV else []
    for bn, bk, st in read_tiles + [(16, 512, 4), (8, 1024, 4), (32, 256, 4), (64, 256, 4)]:
        t = time_calls([lambda w=w, bn=bn, bk=bk, st=st: read_rows[(n // bn,)](
            w.view(torch.int32), yi, k // 4, BN=bn, BKW=bk // 4, STAGES=st, num_warps=4, num_stages=st)
            for w in wts.w])
        name = f"read {bn}x{bk} s{st}"
        rows.append({"n": n, "k": k, "variant": name, "us": t, "tb_s": wts.bytes / t / 1e6})
        print(f"{n:>6} {k:>6} {name:>36} {t:>8.2f} {wts.bytes / t / 1e6:>6.2f}", flush=True)
    t = time_calls([lambda w=w: w.view(torch.int32).sum(dim=1, dtype=torch.int32) for w in wts.w])
    rows.append({"n": n, "k": k, "variant": "torch row sums", "us": t, "tb_s": wts.bytes / t / 1e6})
    print(f"{n:>6} {k:>6} {'torch row sums (int32)':>36} {t:>8.2f} {wts.bytes / t / 1e6:>6.2f}", flush=True)
    if read_only:
        return rows
    # x pre-split over the grid (the loop's own cost), then x split in the kernel at the best `top` tiles
    pre = [run(bn, bk, r, st, "pre") for bn, bk in tiles for r in rs for st in stages_list
           if (k // r) % bk == 0 and (n * r) % bn == 0 and 96 <= n * r // bn <= 2048]
    best = sorted((row for row in pre if row), key=lambda row: row["us"])[:top]
    for i, row in enumerate(best):
        run(*row["tile"], "inline")
        run(*row["tile"], "inline, scales given")
        if i == 0:
            run(*row["tile"], "terms 1")
    return rows


# The chain's tiles per matrix (BN, BK, R, stages): 128 rows of 128-byte steps everywhere (one block size for
# every producer / consumer pair), R so that each matrix has 256-896 programs.
CHAIN_TILES = {"o": (128, 128, 8, 4), "gate_up": (128, 128, 4, 4), "down": (128, 128, 8, 4), "qkv": (128, 128, 8, 4)}


def measure_chain(layers_n: int, replays: int) -> list[dict]:
    """probe_persistent_layer's layer chain (o_proj -> gate/up -> down -> next qkv, one row, cold FP8 weights)
    with today's kernels and with mma_chain_gemv (x split in each kernel from the block maxima its producer
    left by atomics; the maxima zeroed by one memset a step)."""
    from benchmarks import probe_persistent_layer as pl
    from benchmarks.tune_small_m_gemm import time_calls

    gen = torch.Generator(device="cuda").manual_seed(0)
    layers = [pl.Layer(gen) for _ in range(layers_n)]
    x0 = torch.randn(pl.HIDDEN, device="cuda", generator=gen).bfloat16()
    bytes_per_layer = sum(n * k for n, k, *_ in pl.PHASES.values())
    order = pl.ORDER
    # maxima buffers: per layer and matrix, the blocks of its output as its consumer reads them
    maxima = torch.zeros(layers_n, len(order), max(n for n, *_ in pl.PHASES.values()) // 128 + 1, device="cuda")
    bk0 = CHAIN_TILES[order[0]][1]
    x0_max = x0.float().abs().view(-1, bk0).amax(dim=1)

    def today():
        x = x0
        for layer in layers:
            x = pl.run_today(x, layer)
        return x

    def mma():
        maxima.zero_()
        x, xmax = x0, x0_max
        for li, layer in enumerate(layers):
            for pi, name in enumerate(order):
                n, k = pl.PHASES[name][:2]
                bn, bk, r, st = CHAIN_TILES[name]
                out_bk = CHAIN_TILES[order[(pi + 1) % len(order)]][1]
                y, ymax = layer.y[name], maxima[li, pi]
                mma_chain_gemv[(n * r // bn,)](layer.w[name], layer.s[name], x, xmax, y, ymax, k // r, BN=bn, BK=bk,
                                               STAGES=st, R=r, LO=LO, OUT_BK=out_bk, num_warps=4, num_stages=st)
                x, xmax = y, ymax
            x = x[:pl.HIDDEN]
        return x

    rows = []
    ref = None
    for name, fn in (("today (table), 4 launches a layer", today), ("FP8 mma chain, maxima by atomics", mma)):
        us = time_calls([fn], replays) / layers_n
        out = fn().float()
        torch.cuda.synchronize()
        if ref is None:
            ref = out.clone()
        err = float((out - ref).norm() / ref.norm())
        rows.append({"variant": name, "us_per_layer": us, "tb_s": bytes_per_layer / us / 1e6, "rel_err_vs_today": err})
        print(f"{name:>36} {us:>9.2f} us/layer {bytes_per_layer / us / 1e6:>6.2f} TB/s  rel. diff vs today {err:.2e}",
              flush=True)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tiles", default="64x256,128x128,128x256",
                   help="BNxBK tiles, comma separated")
    p.add_argument("--stages", type=int, nargs="+", default=[4, 6])
    p.add_argument("--r", type=int, nargs="+", default=[1, 2, 4, 8], help="K segments per weight row")
    p.add_argument("--top", type=int, default=3, help="tiles (fastest with x pre-split) to time with x split inline")
    p.add_argument("--shapes", default=None, help="NxK shapes, comma separated (default: Llama-3.1-8B's)")
    p.add_argument("--read-only", action="store_true", help="only today's kernel and the read-alone rows")
    p.add_argument("--chain", type=int, default=0, metavar="LAYERS",
                   help="only the layer chain over this many layers: today's kernels against the FP8 mma chain")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("probe_fp8_mma_gemv needs a CUDA device (FP8 tensor cores: sm_89 or later)", file=sys.stderr)
        return 2
    tiles = parse_pairs(args.tiles)
    shapes = SHAPES if args.shapes is None else parse_pairs(args.shapes)
    gen = torch.Generator(device="cuda").manual_seed(0)
    if args.chain:
        rows = measure_chain(args.chain, replays=20)
    else:
        print(f"{'N':>6} {'K':>6} {'variant':>36} {'us':>8} {'TB/s':>6} {'rel err':>9}")
        rows = []
        for n, k in shapes:
            rows += measure_shape(n, k, tiles, args.stages, args.r, args.top, gen, args.read_only)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""probe_persistent_layer: what do the kernel boundaries between a decode layer's one-row GEMVs cost? (issues 18, 23)

Llama-3.1-8B FP8 at bs=1 spends most of a step in 129 one-row GEMVs, the small ones (o_proj, qkv) furthest
below the copy bandwidth; docs/benchmarks.md put what is left in the ramp and tail of each short kernel and
named a persistent kernel that streams a layer's matrices back to back as the way to remove them.
This probe measures that before anything is built: one CUDA graph over --layers layers of cold FP8 weights,
each layer the model's chain after attention (o_proj -> gate/up -> down -> the next layer's qkv, one row,
each GEMV's input the one before's output), run as

- `today`: the small-M kernel at its table config, four launches a layer (what the model runs, less the
  fused norm / SiLU / rotary epilogues);
- `4 kernels`: the probe's own GEMV (the table's GEMV tiles, the same loop as today's GEMV path), four launches;
- `persistent G`: one launch a layer of G programs (G a multiple of the SM count, all resident at once) that
  walk each matrix's row tiles in turn (tile t goes to program t % G) with a grid barrier between matrices
  (an arrival counter: each program adds one, then polls it until all G have arrived; the counters are zeroed
  once per replay). The same tiles and loop as `4 kernels`, so the same bits;
- `persistent flat G`: the same, each matrix as one pipelined loop over the program's (tile, K step) pairs, so
  that its loads stay in flight across its tiles (the nested version fills and drains the pipeline per tile).

Reported: us per layer, the chain's weight bytes per us (TB/s), and max |diff| against `4 kernels`. A barrier
that never completes (programs not all resident) gives up after --max-spins polls and is reported, not hung.

Results: docs/benchmarks.md (fourteenth session).

    python -m benchmarks.probe_persistent_layer --json out.json
    python -m benchmarks.probe_persistent_layer --layers 8 --per-sm 2 3
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
import triton
import triton.language as tl

HIDDEN, QKV, INTER = 4096, 6144, 14336  # Llama-3.1-8B
# (N, K, BLOCK_N, BLOCK_K, stages): the H200 table's one-row FP8 GEMV configs for these shapes
PHASES = {
    "o": (HIDDEN, HIDDEN, 8, 1024, 3),
    "gate_up": (2 * INTER, HIDDEN, 16, 512, 6),
    "down": (HIDDEN, INTER, 8, 1024, 4),
    "qkv": (QKV, HIDDEN, 16, 512, 4),
}
ORDER = ("o", "gate_up", "down", "qkv")


@triton.jit
def _gemv_phase(W, S, X, Y, N, K, pid, G, BN: tl.constexpr, BK: tl.constexpr, STAGES: tl.constexpr):
    """y[t * BN + i] for the row tiles t = pid, pid + G, ... of W [N, K] (FP8, per-row scales S), one row x."""
    offs_k = tl.arange(0, BK)
    for t in range(pid, N // BN, G):
        offs_n = t * BN + tl.arange(0, BN)
        w_ptrs = W + offs_n[:, None].to(tl.int64) * K + offs_k[None, :]
        x_ptrs = X + offs_k[None, :]
        acc = tl.zeros([BN, BK], dtype=tl.float32)
        for _ in tl.range(0, K, BK, num_stages=STAGES):
            w = tl.load(w_ptrs)
            x = tl.load(x_ptrs, cache_modifier=".cg")  # (written by other programs of this kernel: from L2)
            acc += w.to(tl.float32) * x.to(tl.float32)
            w_ptrs += BK
            x_ptrs += BK
        out = tl.sum(acc, axis=1) * tl.load(S + offs_n)
        tl.store(Y + offs_n, out.to(Y.dtype.element_ty))


@triton.jit
def _gemv_phase_flat(W, S, X, Y, N, K, pid, G, BN: tl.constexpr, BK: tl.constexpr, STAGES: tl.constexpr):
    """_gemv_phase as one loop over this program's (tile, K step) pairs: the loads stay pipelined across its
    tiles (the nested loop fills and drains the pipeline once per tile). Same sums in the same order."""
    steps = K // BK
    tiles = tl.cdiv(N // BN - pid, G)  # tiles pid, pid + G, ... (none when pid is past the last)
    offs_k = tl.arange(0, BK)
    acc = tl.zeros([BN, BK], dtype=tl.float32)
    for i in tl.range(0, tiles * steps, num_stages=STAGES):
        offs_n = (pid + (i // steps) * G) * BN + tl.arange(0, BN)
        k = (i % steps) * BK
        w = tl.load(W + offs_n[:, None].to(tl.int64) * K + (k + offs_k)[None, :])
        x = tl.load(X + k + offs_k[None, :], cache_modifier=".cg")
        acc += w.to(tl.float32) * x.to(tl.float32)
        if i % steps == steps - 1:
            out = tl.sum(acc, axis=1) * tl.load(S + offs_n)
            tl.store(Y + offs_n, out.to(Y.dtype.element_ty))
            acc = tl.zeros([BN, BK], dtype=tl.float32)


@triton.jit
def _phase(W, S, X, Y, N, K, pid, G, BN: tl.constexpr, BK: tl.constexpr, STAGES: tl.constexpr, FLAT: tl.constexpr):
    if FLAT:
        _gemv_phase_flat(W, S, X, Y, N, K, pid, G, BN, BK, STAGES)
    else:
        _gemv_phase(W, S, X, Y, N, K, pid, G, BN, BK, STAGES)


@triton.jit
def _grid_barrier(C, G, MAX_SPINS, ERR):
    """Every program's stores before it are visible to every program after it. One thread arrives (after
    the CTA barrier, with release at gpu scope: the atomic's default acq_rel), polls with volatile loads,
    and acquires by one more atomic; MAX_SPINS polls without all G arrivals set ERR and go on."""
    tl.debug_barrier()
    tl.atomic_add(C, 1)
    n = tl.load(C, volatile=True)
    spins = 0
    zero = tl.zeros([1], dtype=tl.int32)
    while (n < G) & (spins < MAX_SPINS):
        # a short sleep between polls: G programs' threads polling one L2 line compete with the
        # programs still streaming their tiles
        tl.inline_asm_elementwise("nanosleep.u32 32; mov.u32 $0, 0;", "=r,r", [zero], dtype=tl.int32,
                                  is_pure=False, pack=1)
        n = tl.load(C, volatile=True)
        spins += 1
    if spins >= MAX_SPINS:
        tl.store(ERR, 1)
    tl.atomic_add(C, 0)
    tl.debug_barrier()


@triton.jit
def gemv_kernel(W, S, X, Y, N, K, BN: tl.constexpr, BK: tl.constexpr, STAGES: tl.constexpr):
    _gemv_phase(W, S, X, Y, N, K, tl.program_id(0), tl.num_programs(0), BN, BK, STAGES)


@triton.jit
def layer_kernel(Wo, So, Wg, Sg, Wd, Sd, Wq, Sq, Xa, Yo, Yg, Yd, Yq, C, ERR, MAX_SPINS,
                 H: tl.constexpr, I2: tl.constexpr, QN: tl.constexpr,
                 BN_O: tl.constexpr, BK_O: tl.constexpr, ST_O: tl.constexpr,
                 BN_G: tl.constexpr, BK_G: tl.constexpr, ST_G: tl.constexpr,
                 BN_D: tl.constexpr, BK_D: tl.constexpr, ST_D: tl.constexpr,
                 BN_Q: tl.constexpr, BK_Q: tl.constexpr, ST_Q: tl.constexpr, FLAT: tl.constexpr):
    """o_proj -> gate/up -> down -> qkv in one launch, a grid barrier between them (down reads the first
    I2 / 2 values of gate/up's output, a stand-in for SiLU-and-mul's). FLAT: each matrix as one pipelined
    loop over the program's (tile, K step) pairs (_gemv_phase_flat)."""
    pid = tl.program_id(0)
    G = tl.num_programs(0)
    _phase(Wo, So, Xa, Yo, H, H, pid, G, BN_O, BK_O, ST_O, FLAT)
    _grid_barrier(C, G, MAX_SPINS, ERR)
    _phase(Wg, Sg, Yo, Yg, I2, H, pid, G, BN_G, BK_G, ST_G, FLAT)
    _grid_barrier(C + 1, G, MAX_SPINS, ERR)
    _phase(Wd, Sd, Yg, Yd, H, I2 // 2, pid, G, BN_D, BK_D, ST_D, FLAT)
    _grid_barrier(C + 2, G, MAX_SPINS, ERR)
    _phase(Wq, Sq, Yd, Yq, QN, H, pid, G, BN_Q, BK_Q, ST_Q, FLAT)


class Layer:
    """One layer's FP8 weights (random, per-row scales) and its activations' buffers."""

    def __init__(self, gen: torch.Generator):
        self.w, self.s = {}, {}
        for name, (n, k, *_) in PHASES.items():
            w = torch.randn(n, k, device="cuda", generator=gen) * 0.02
            self.s[name] = (w.abs().amax(dim=1) / 448.0).float()
            self.w[name] = (w / self.s[name][:, None]).to(torch.float8_e4m3fn)
        self.y = {name: torch.empty(PHASES[name][0], device="cuda", dtype=torch.bfloat16) for name in PHASES}


def run_4_kernels(x: torch.Tensor, layer: Layer) -> torch.Tensor:
    for name in ORDER:
        n, k, bn, bk, st = PHASES[name]
        gemv_kernel[(n // bn,)](layer.w[name], layer.s[name], x, layer.y[name], n, k, BN=bn, BK=bk, STAGES=st,
                                num_warps=4, num_stages=st)
        x = layer.y[name]
    return x[:HIDDEN]


def run_today(x: torch.Tensor, layer: Layer) -> torch.Tensor:
    from model_executor.layers.triton_ops import small_m_gemm as sm

    x = x.view(1, -1)
    for name in ORDER:
        k = PHASES[name][1]
        x = sm.small_m_linear(x[:, :k], layer.w[name], layer.s[name])
    return x[0, :HIDDEN]


def run_persistent(x: torch.Tensor, layer: Layer, counters: torch.Tensor, err: torch.Tensor, grid: int,
                   max_spins: int, flat: bool = False) -> torch.Tensor:
    cfg = {}
    for name, tag in zip(ORDER, ("O", "G", "D", "Q")):
        _, _, bn, bk, st = PHASES[name]
        cfg.update({f"BN_{tag}": bn, f"BK_{tag}": bk, f"ST_{tag}": st})
    y = layer.y
    compiled = layer_kernel[(grid,)](
        layer.w["o"], layer.s["o"], layer.w["gate_up"], layer.s["gate_up"], layer.w["down"], layer.s["down"],
        layer.w["qkv"], layer.s["qkv"], x, y["o"], y["gate_up"], y["down"], y["qkv"], counters, err, max_spins,
        H=HIDDEN, I2=2 * INTER, QN=QKV, FLAT=flat, num_warps=4, num_stages=4, **cfg)
    return y["qkv"][:HIDDEN], compiled


def occupancy(kernel, num_warps: int = 4) -> int:
    """Programs of a compiled kernel that fit on one SM at once (registers, shared memory, warps)."""
    props = torch.cuda.get_device_properties(0)
    regs_per_warp = -(-kernel.n_regs * 32 // 256) * 256
    by_regs = getattr(props, "regs_per_multiprocessor", 65536) // (regs_per_warp * num_warps)
    smem = getattr(props, "shared_memory_per_multiprocessor", 233472)
    by_smem = smem // (kernel.metadata.shared + 1024) if kernel.metadata.shared else 32
    return max(0, min(by_regs, by_smem, 64 // num_warps))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=4, help="layers of weights in the chain (4 x 218 MB: cold)")
    p.add_argument("--per-sm", type=int, nargs="+", default=[1, 2, 3, 4],
                   help="persistent programs per SM (capped at the kernel's occupancy)")
    p.add_argument("--replays", type=int, default=20)
    p.add_argument("--max-spins", type=int, default=1 << 22)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("probe_persistent_layer needs a CUDA device", file=sys.stderr)
        return 2
    from benchmarks.tune_small_m_gemm import time_calls

    gen = torch.Generator(device="cuda").manual_seed(0)
    layers = [Layer(gen) for _ in range(args.layers)]
    x0 = torch.randn(HIDDEN, device="cuda", generator=gen).bfloat16()
    bytes_per_layer = sum(n * k for n, k, *_ in PHASES.values())
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    counters = torch.zeros(args.layers * 3, device="cuda", dtype=torch.int32)
    err = torch.zeros(1, device="cuda", dtype=torch.int32)

    def chain(step):
        def fn():
            x = x0
            for layer in layers:
                x = step(x, layer)
            return x
        return fn

    rows = []

    def report(name, fn, ref=None):
        us = time_calls([fn], args.replays) / args.layers
        out = fn()
        torch.cuda.synchronize()
        diff = None if ref is None else float((out.float() - ref.float()).abs().max())
        row = {"variant": name, "us_per_layer": us, "tb_s": bytes_per_layer / us / 1e6, "max_diff": diff}
        rows.append(row)
        print(f"{name:>30} {us:>9.2f} {row['tb_s']:>6.2f} {'' if diff is None else f'{diff:.3g}':>9}", flush=True)
        return out

    print(f"{torch.cuda.get_device_name()}, {sms} SMs; {args.layers} layers of {bytes_per_layer / 1e6:.1f} MB")
    print(f"{'variant':>30} {'us/layer':>9} {'TB/s':>6} {'max diff':>9}")
    ref = report("4 kernels", chain(run_4_kernels)).clone()
    report("today (table)", chain(run_today))
    occupancies = {}
    for flat in (False, True):
        kind = "flat" if flat else "nested"
        # compile once (one program runs every tile alone: no barrier waits) and read its occupancy
        _, compiled = run_persistent(x0, layers[0], counters, err, 1, args.max_spins, flat)
        torch.cuda.synchronize()
        occ = occupancies[kind] = occupancy(compiled)
        print(f"persistent kernel ({kind}): {compiled.n_regs} registers, {compiled.metadata.shared} B shared "
              f"-> {occ} per SM")
        for per_sm in args.per_sm:
            if per_sm > occ:
                print(f"persistent {kind} x{per_sm}: skipped (occupancy {occ})")
                continue
            grid = sms * per_sm

            def step(x, layer, grid=grid, flat=flat):
                return run_persistent(x, layer, counters[3 * layers.index(layer):], err, grid, args.max_spins,
                                      flat)[0]

            def fn(step=step):
                counters.zero_()
                return chain(step)()
            err.zero_()
            report(f"persistent {kind} {grid} ({per_sm}/SM)", fn, ref)
            torch.cuda.synchronize()
            if int(err.item()):
                rows[-1]["barrier_timed_out"] = True
                print(f"persistent {kind} x{per_sm}: a barrier gave up (programs not all resident?)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "sms": sms, "occupancy": occupancies, "rows": rows}, f,
                      indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

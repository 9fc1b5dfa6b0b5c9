"""probe_l2_prefetch: does bringing the next weight into L2 while a latency-bound kernel runs shorten a one-row
decode step? (issues 18, 23)

Llama-3.1-8B FP8 at bs=1 spends 2.38 of 2.61 ms in 129 GEMVs at 3.37 TB/s on average (eleventh session's
profile); its decode attention, ~6.7 us a layer, reads little and leaves the memory bus nearly idle. Each
layer's o_proj (16.8 MB of FP8) fits in the H200's 50 MB L2: prefetched when attention starts (`l2_prefetch`
below: sm_90's cp.async.bulk.prefetch.L2), it would be read from L2. Measured on the H200 it does not pay: the
prefetch of one o_proj alone takes 3.34 us (it runs at HBM bandwidth, not for free), o_proj after it is not
faster, and the model with it (once bench_one_batch --l2-prefetch, since removed) was slower (8B FP8 bs=1:
2.701/2.642 ms without, 2.778/2.719 with, 2.796/2.853 with the gate/up rows' first 256 B too). This probe
stays as the record. Three measurements, each one CUDA graph over --layers layers with their own weights (the
set far exceeds L2), median of its replays:

1. `prefetch alone`: the prefetch kernel of one o_proj per call, per --chunk-kb (8 KB chunks spread one
   o_proj over ~65 programs, 512 KB over one). About a launch if nothing waits for the bytes; ~4 us (16.8 MB
   at ~4 TB/s) if a kernel's end waits for its prefetches.
2. `window -> o_proj`: a spin kernel of --window-us (attention's stand-in: one program reading the clock,
   no memory traffic), then o_proj (the small-M kernel at its table config); without, and with o_proj
   prefetched just before the window per chunk size (how many SMs' copy engines issue it matters).
   `o_proj twice`: each o_proj GEMV run twice in a row, the second from L2 (what o_proj costs from L2, for
   the difference against o_proj alone).
3. `layer chain`: qkv -> window -> o_proj -> gate/up with SiLU-and-mul -> down, as a decode layer runs them
   (without the norms fused into them), prefetching (`Variant`): nothing; o_proj before the window; that and
   the first --gate-up-row-bytes of every gate/up row; o_proj on a side stream from qkv's start (a graph
   branch, joined after qkv's GEMV: it takes qkv's GEMV time, if qkv's 25 MB do not evict it); o_proj before
   the window and, on a side stream from each GEMV's start, the first --next-row-bytes of every row of the
   next GEMV's weight (for the next kernel's ramp; lines that the running GEMV's own stream evicts are
   wasted).

    python -m benchmarks.probe_l2_prefetch --json out.json
    python -m benchmarks.probe_l2_prefetch --window-us 0 6.7 --gate-up-row-bytes 256 512 --next-row-bytes 512
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

HIDDEN, Q_ROWS, KV_ROWS, INTER = 4096, 4096, 1024, 14336  # Llama-3.1-8B

# The prefetch: bytes per instruction, a multiple of 16 as the instruction requires (sm_90 keeps size / 16 in
# 16 bits). Small chunks and one warp a program spread a weight over many SMs (each SM's copy engine turns its
# bulk requests into line requests at a bounded rate).
CHUNK = 8 * 1024
MAX_CHUNK = (1 << 20) - 16
ALIGN = 16
BLOCK = 32  # chunks per program: one per thread of its one warp


@triton.jit
def _l2_prefetch_kernel(P, row_stride, row_bytes, chunk, chunks_per_row, total, BLOCK: tl.constexpr):
    """One cp.async.bulk.prefetch.L2.global per element e: chunk e % chunks_per_row of row e // chunks_per_row,
    i.e. bytes [c * chunk, +chunk) of it, cut at row_bytes (all multiples of 16). A hint with no result that
    the program waits for; on the H200 the kernel still took as long as reading the bytes at ~5 TB/s."""
    e = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    row = (e // chunks_per_row).to(tl.int64)
    start = (e % chunks_per_row).to(tl.int64) * chunk
    size = tl.minimum(row_bytes - start, chunk)
    size = tl.where(e < total, size, 0).to(tl.int32)
    ptrs = P + row * row_stride + start
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.gt.s32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r", [ptrs, size], dtype=tl.int32, is_pure=False, pack=1)


def plan(t: torch.Tensor, row_bytes: int | None, chunk: int = CHUNK) -> tuple[int, int, int, int, int, int]:
    """_launch's arguments after the tensor: (row stride, row bytes, chunk; in bytes), chunks per row, chunks,
    programs."""
    if not 0 < chunk <= MAX_CHUNK or chunk % ALIGN:
        raise ValueError(f"chunk must be a multiple of {ALIGN} bytes in (0, {MAX_CHUNK}], got {chunk}")
    size = t.element_size()
    if row_bytes is None:  # the whole tensor as one row
        if not t.is_contiguous():
            raise ValueError("prefetching a whole tensor needs it contiguous")
        rows, stride, row_bytes = 1, 0, t.numel() * size
    else:
        if t.dim() != 2 or t.stride(1) != 1:
            raise ValueError("prefetching rows needs a 2-D tensor with contiguous rows")
        rows, stride = t.shape[0], t.stride(0) * size
        row_bytes = min(row_bytes, t.shape[1] * size)
        if stride % ALIGN:
            raise ValueError(f"the row stride ({stride} bytes) is not a multiple of {ALIGN}")
    row_bytes -= row_bytes % ALIGN  # the instruction's sizes are multiples of 16: a short tail stays unfetched
    chunks_per_row = max(1, triton.cdiv(row_bytes, chunk))
    total = rows * chunks_per_row
    return stride, row_bytes, chunk, chunks_per_row, total, triton.cdiv(total, BLOCK)


def l2_prefetch(t: torch.Tensor, row_bytes: int | None = None, chunk: int = CHUNK) -> None:
    """Prefetch into L2 the first row_bytes of each row of t (2-D), or all of t (row_bytes None). Off a CUDA
    device of compute capability 9 or more it does nothing."""
    if not (t.is_cuda and torch.cuda.get_device_capability(t.device)[0] >= 9) or t.numel() == 0:
        return
    if t.data_ptr() % ALIGN:
        raise ValueError(f"l2_prefetch needs a {ALIGN}-byte aligned tensor")
    args = plan(t, row_bytes, chunk)
    if args[1]:  # (row bytes: none when the rows are shorter than 16 bytes)
        _launch(t.view(torch.uint8), *args)


def _launch(t: torch.Tensor, stride: int, row_bytes: int, chunk: int, chunks_per_row: int, total: int,
            programs: int) -> None:
    _l2_prefetch_kernel[(programs,)](t, stride, row_bytes, chunk, chunks_per_row, total, BLOCK=BLOCK, num_warps=1)


@triton.jit
def _spin_kernel(OUT, ns):
    """One program that waits ns nanoseconds on the global timer (no memory traffic but one store)."""
    zero = tl.program_id(0)
    start = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r", [zero], dtype=tl.int64, is_pure=False,
                                      pack=1)
    now = start
    while now - start < ns:
        now = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r", [zero], dtype=tl.int64,
                                        is_pure=False, pack=1)
    tl.store(OUT, now - start)


class Layer:
    """One decode layer's FP8 weights (per-channel scales), random."""

    def __init__(self, gen: torch.Generator):
        from model_executor.layers.quantization import fp8_math as fm

        def weight(n: int, k: int):
            return fm.quantize_fp8_per_channel((torch.randn(n, k, device="cuda", generator=gen) * 0.02).bfloat16())

        self.qkv = weight(Q_ROWS + 2 * KV_ROWS, HIDDEN)
        self.o = weight(HIDDEN, Q_ROWS)
        self.gate_up = weight(2 * INTER, HIDDEN)
        self.down = weight(HIDDEN, INTER)


@dataclass(frozen=True)
class Variant:
    """What the layer chain prefetches."""

    name: str
    o_at_window: bool = False  # o_proj, in the stream just before the window
    o_at_qkv: bool = False  # o_proj, on a side stream from qkv's start (over qkv's GEMV; joined after it)
    gate_up_row_bytes: int = 0  # the first bytes of every gate/up row too, before the window
    next_row_bytes: int = 0  # from each GEMV's start, on a side stream: the first bytes of the next one's rows


def chain_variants(args) -> list[Variant]:
    return ([Variant("none"), Variant("o_proj at the window", o_at_window=True)]
            + [Variant(f"o_proj + gate/up rows' first {b} B at the window", o_at_window=True, gate_up_row_bytes=b)
               for b in args.gate_up_row_bytes]
            + [Variant("o_proj from qkv's start (side stream)", o_at_qkv=True)]
            + [Variant(f"o_proj at the window + next GEMV rows' first {b} B (side stream)", o_at_window=True,
                       next_row_bytes=b) for b in args.next_row_bytes])


def replay_ms(calls) -> float:
    """Median milliseconds of one replay of a CUDA graph that runs calls() once."""
    from benchmarks.tune_small_m_gemm import time_calls

    return time_calls([calls]) / 1e3


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--window-us", type=float, nargs="+", default=[6.7], help="attention's stand-in per layer")
    p.add_argument("--gate-up-row-bytes", type=int, nargs="+", default=[256],
                   help="bytes of every gate/up row also prefetched in the window")
    p.add_argument("--chunk-kb", type=int, nargs="+", default=[8, 64, 512],
                   help="prefetch chunk sizes for the prefetch-alone and window -> o_proj rows (the chain: 8)")
    p.add_argument("--next-row-bytes", type=int, nargs="+", default=[256, 1024],
                   help="bytes of every row of the next GEMV's weight prefetched from each GEMV's start")
    p.add_argument("--json", dest="json_out")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("probe_l2_prefetch needs a CUDA device", file=sys.stderr)
        return 2
    from model_executor.layers.triton_ops import small_m_gemm as sm

    gen = torch.Generator(device="cuda").manual_seed(0)
    layers = [Layer(gen) for _ in range(args.layers)]
    x = torch.randn(1, HIDDEN, device="cuda", generator=gen).bfloat16()
    act = torch.randn(1, INTER, device="cuda", generator=gen).bfloat16()
    clock = torch.zeros(1, dtype=torch.int64, device="cuda")
    if sm.small_m_silu_and_mul(x, *layers[0].gate_up) is None:
        print("probe_l2_prefetch: no fused gate/up GEMV config for this GPU (the small-M table)", file=sys.stderr)
        return 2
    o_bytes = layers[0].o[0].numel()
    rows = []

    def spin(us: float):
        if us > 0:
            _spin_kernel[(1,)](clock, int(us * 1000), num_warps=1)

    side = torch.cuda.Stream()
    forked = False  # side has work from the current stream since the last join

    # Under capture the current stream may only wait on side once side has joined the capture (by waiting on
    # the capturing stream): waiting on its work from the warm-up outside the capture fails the capture
    # ("dependency created on uncaptured work in another stream"). So every use of side starts from the
    # current stream, and join() waits only after such a fork.
    def fork_prefetch(w: torch.Tensor, row_bytes: int | None):
        """l2_prefetch on a side stream, from this point of the current stream on (joined by join())."""
        nonlocal forked
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            l2_prefetch(w, row_bytes=row_bytes)
        forked = True

    def join():
        nonlocal forked
        if forked:
            torch.cuda.current_stream().wait_stream(side)
            forked = False

    def chain(v: Variant, window: float):
        nonlocal forked
        forked = False
        seq = [(name, l, w, a) for l in layers
               for name, w, a in (("qkv", l.qkv, x), ("o", l.o, x), ("gate_up", l.gate_up, x), ("down", l.down, act))]
        for i, (name, l, (w, s), a) in enumerate(seq):
            nxt = seq[i + 1][2][0] if i + 1 < len(seq) else None
            if name == "o":
                if v.o_at_window:
                    l2_prefetch(w)
                if v.gate_up_row_bytes:
                    l2_prefetch(l.gate_up[0], row_bytes=v.gate_up_row_bytes)
                spin(window)
            if name == "qkv" and v.o_at_qkv:
                fork_prefetch(l.o[0], None)
            elif v.next_row_bytes and nxt is not None:
                fork_prefetch(nxt, v.next_row_bytes)
            if name == "gate_up":
                sm.small_m_silu_and_mul(a, w, s)
            else:
                sm.small_m_linear(a, w, s)
            join()

    def report(section: str, variant: str, ms: float, **extra):
        per_layer = ms * 1e3 / args.layers
        rows.append({"section": section, "variant": variant, "ms": ms, "us_per_layer": per_layer, **extra})
        print(f"{section:>18} {variant:>66} {ms:>9.3f} {per_layer:>9.2f}", flush=True)

    print(f"{'section':>18} {'variant':>66} {'graph ms':>9} {'us/layer':>9}")
    for kb in args.chunk_kb:
        report("prefetch alone", f"o_proj {o_bytes / 1e6:.1f} MB in {kb} KB chunks",
               replay_ms(lambda kb=kb: [l2_prefetch(l.o[0], chunk=kb * 1024) for l in layers]), chunk_kb=kb)

    # o_proj read twice in a row: the second read finds the weight in L2 (16.8 MB of 50) if anything does. Its
    # time less o_proj alone's (the first window row) is what o_proj costs from L2: near o_proj alone, the GEMV
    # is not bound by DRAM at one row; much less, a prefetch that landed would have paid.
    report("o_proj twice", "the second from L2", replay_ms(lambda: [sm.small_m_linear(x, *l.o) for l in layers
                                                                   for _ in range(2)]))

    for window in args.window_us:
        for kb in [None, *args.chunk_kb]:  # None: no prefetch
            def window_then_o(window=window, kb=kb):
                for l in layers:
                    if kb is not None:
                        l2_prefetch(l.o[0], chunk=kb * 1024)
                    spin(window)
                    sm.small_m_linear(x, *l.o)

            report("window -> o_proj", f"window {window} us, " + (
                "none" if kb is None else f"o_proj prefetched in {kb} KB chunks"),
                replay_ms(window_then_o), window_us=window, chunk_kb=kb)
        report("window alone", f"window {window} us", replay_ms(lambda window=window: [spin(window) for _ in layers]),
               window_us=window)

        for v in chain_variants(args):
            report("layer chain", f"window {window} us, {v.name}", replay_ms(lambda v=v, w=window: chain(v, w)),
                   window_us=window, **dataclasses.asdict(v))
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "layers": args.layers, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

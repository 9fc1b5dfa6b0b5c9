"""probe_l2_warm: would a decode GEMV run faster if the first K steps of its first wave were already in L2?

While decode attention runs, the memory bus is mostly idle (o_proj's programs load their own weights there,
docs/benchmarks.md); the gate/up GEMV that follows starts cold. This probe measures what it would gain if some
of its first bytes were in L2 when it starts: each timed pair is a warm-up read of a slice of a weight, then the
GEMV (today's kernel at its table config), on cold weights in one CUDA graph (tune_small_m_gemm.time_calls).
The warm-up reads the GEMV's own weight (`same`) or another copy of it (`other`, the cost of the read alone);
their difference is the GEMV's gain. The slice: the rows the GEMV's first wave of programs reads (gate and
up rows for the SiLU-and-mul GEMV), the first S column steps of them.

    python -m benchmarks.probe_l2_warm --steps 1 2 4 --json out.json
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
import triton
import triton.language as tl


@triton.jit
def _touch(W, OUT, rows0, rows1, stride, cols, BR: tl.constexpr, BC: tl.constexpr):
    """Reads W[rows0 + r] and W[rows1 + r] (r < BR per program), columns [0, cols): max byte to OUT."""
    r = tl.program_id(0) * BR + tl.arange(0, BR)
    acc = tl.zeros([BR, BC], dtype=tl.int32)
    for c in range(0, cols, BC):
        offs = c + tl.arange(0, BC)
        acc = tl.maximum(acc, tl.load(W + (rows0 + r)[:, None].to(tl.int64) * stride + offs[None, :]).to(tl.int32))
        acc = tl.maximum(acc, tl.load(W + (rows1 + r)[:, None].to(tl.int64) * stride + offs[None, :]).to(tl.int32))
    tl.store(OUT + tl.program_id(0), tl.max(tl.max(acc, axis=1), axis=0))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--waves", type=float, nargs="+", default=[1.0], help="rows of this many first waves")
    p.add_argument("--json", dest="json_out")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("probe_l2_warm needs a CUDA device", file=sys.stderr)
        return 2
    from benchmarks.tune_small_m_gemm import Weights, time_calls
    from model_executor.layers.triton_ops import small_m_gemm as sm

    gen = torch.Generator(device="cuda").manual_seed(0)
    n2, k = 28672, 4096  # Llama-3.1-8B [gate; up]
    wts = Weights("fp8", n2, k, gen)
    other = Weights("fp8", n2, k, gen)
    x = torch.randn(1, k, device="cuda", generator=gen).bfloat16()
    cfg = sm.silu_and_mul_config(n2, k, "fp8", sm.device_name("cuda"))
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    out = torch.empty(1 << 16, dtype=torch.int32, device="cuda")
    print(f"gate/up {n2} x {k} FP8, config {cfg}")

    def gemv(w, s):
        return sm.small_m_silu_and_mul(x, w, s, config=cfg)

    base = time_calls([lambda w=w, s=s: gemv(w, s) for w, s in zip(wts.w, wts.s)])
    rows = [{"variant": "gemv alone", "us": base}]
    print(f"{'gemv alone':>34} {base:8.2f} us")
    # programs per SM from a smem estimate is unreliable: take the waves in units of 4 programs an SM
    for waves in args.waves:
        wave_rows = min(n2 // 2, int(waves * sms * 4) * cfg.BLOCK_N // 2 * 2)
        br = 16
        wave_rows -= wave_rows % br
        for steps in args.steps:
            cols = steps * cfg.BLOCK_K
            mb = 2 * wave_rows * cols / 1e6

            def touch(w, wave_rows=wave_rows, br=br, cols=cols):
                _touch[(wave_rows // br,)](w.view(torch.uint8), out, 0, n2 // 2, k, cols, BR=br,
                                           BC=min(cols, 512))

            alone = time_calls([lambda w=w: touch(w) for w in wts.w])
            t = {}
            for name, src in (("same", wts.w), ("other", other.w)):
                t[name] = time_calls([lambda w=w, s=s, o=o: (touch(o), gemv(w, s))
                                      for w, s, o in zip(wts.w, wts.s, src)])
            gain = t["other"] - t["same"]
            rows.append({"waves": waves, "steps": steps, "mb": mb, "touch_alone_us": alone, "same_us": t["same"],
                         "other_us": t["other"], "gemv_gain_us": gain})
            print(f"{waves:4.1f} waves {steps} steps ({mb:5.1f} MB): touch {alone:6.2f}, touch+gemv same "
                  f"{t['same']:7.2f} other {t['other']:7.2f}: gain {gain:6.2f} us", flush=True)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "config": str(cfg), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

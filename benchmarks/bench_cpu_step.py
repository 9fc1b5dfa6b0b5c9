"""bench_cpu_step: the CPU decode step in-process, per weight format, against this machine's memory bandwidth.

    python -m benchmarks.bench_cpu_step [--quantization none int8 int4] [--batch-size 1 16] [--kernels] [--json out.json]

A bs=1 decode step of a small dense model reads every weight once, so its floor is (bytes read) / (read
bandwidth). This measures, in one process:

* the read and copy bandwidth of a 500 MB tensor (`sum`, `copy_`) at 1 thread and at torch's threads;
* the eager decode step (`ModelRunner.forward_eager`, no HTTP, no scheduler) of each --quantization variant
  at each batch size: ms per step, weight bytes read per step, implied GB/s and the step over its floor;
* one extend of --prefill-len tokens per variant (the weight-only kernels are made for few rows: a long
  prompt's GEMMs are compute-bound, where they may lose to float32);
* with --kernels, the linear layers alone (the model's GEMM shapes, every layer's own weights so the last
  level cache does not hold them) in each weight-only format this CPU offers, at each batch size.

Variants run interleaved, --repeats times; each number is the median over repeats (the machine may be
shared). The load average before and after is recorded next to the numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from datetime import datetime, timezone

import torch
import torch.nn.functional as F

from benchmarks.bench_one_batch import prepare, time_steps
from runners.model_runner import ModelRunner, RunnerConfig

BANDWIDTH_BYTES = 500 * 10**6


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_cpu_step",
                                description=__doc__.splitlines()[0])
    p.add_argument("--model-path", help="HF folder (default: the converted default model)")
    p.add_argument("--quantization", nargs="+", default=["none", "int8", "int4"], choices=("none", "int8", "int4"))
    p.add_argument("--batch-size", type=int, nargs="+", default=[1, 16])
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--steps", type=int, default=16, help="decode steps timed per measurement (median)")
    p.add_argument("--prefill-len", type=int, default=1024, help="tokens of the timed extend (0: none)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--kernels", action="store_true", help="also time the linear layers alone per weight format")
    p.add_argument("--json", dest="json_out", help="write the results here")
    return p.parse_args(argv)


def load_average() -> float:
    return round(os.getloadavg()[0], 2)


def bandwidth(threads: int, nbytes: int = BANDWIDTH_BYTES, iters: int = 5) -> dict:
    """GB/s of reading a float32 tensor (`sum`) and of copying it (bytes read + written), median of iters."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        a = torch.ones(nbytes // 4)
        b = torch.empty_like(a)
        out = {}
        for name, fn, moved in (("read_gb_s", a.sum, nbytes), ("copy_gb_s", lambda: b.copy_(a), 2 * nbytes)):
            fn()
            times = []
            for _ in range(iters):
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
            out[name] = round(moved / statistics.median(times) / 1e9, 2)
        return out
    finally:
        torch.set_num_threads(before)


def step_read_bytes(model: torch.nn.Module) -> int:
    """Weight bytes a decode step reads: every parameter once (a tied table once: the LM head reads all of
    it, the embedding a few rows) and the quantized tensors' scales."""
    tensors = {t.data_ptr(): t for t in model.parameters()}
    tensors.update({t.data_ptr(): t for name, t in model.named_buffers() if name.endswith("weight_scale")})
    return sum(t.numel() * t.element_size() for t in tensors.values())


# ---- the decode step ------------------------------------------------------------------------------------


def build_runner(args, quantization: str) -> ModelRunner:
    max_bs = max(args.batch_size)
    ctx = max(args.input_len + args.steps, args.prefill_len + 1) + 8
    return ModelRunner(RunnerConfig(model_path=args.model_path, device="cpu", max_running_requests=max_bs,
                                    max_total_tokens=max_bs * ctx + 16, context_length=ctx,
                                    quantization=quantization, disable_cuda_graph=True))


def time_step(runner: ModelRunner, bs: int, args) -> float:
    batches, _, (rows, loc) = prepare(runner, bs, args.input_len, args.steps)
    try:
        return time_steps(runner.forward_eager, batches, runner.device)
    finally:
        runner.allocator.free(loc)
        for row in rows:
            runner.req_to_token_pool.free(row)


def time_prefill(runner: ModelRunner, n: int) -> float:
    """ms of one eager extend of n tokens (one request)."""
    _, prefill_ms, (rows, loc) = prepare(runner, 1, n, 1, seed=1)
    runner.allocator.free(loc)
    for row in rows:
        runner.req_to_token_pool.free(row)
    return prefill_ms


# ---- the linear layers alone, per weight format -----------------------------------------------------------


def linear_shapes(runner: ModelRunner) -> list[tuple[int, int]]:
    """(N, K) of every GEMM of a decode step, the LM head last."""
    cfg = runner.model_config
    h, inter, hd = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    qkv = (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * hd
    layer = [(qkv, h), (h, cfg.num_attention_heads * hd), (2 * inter, h), (h, inter)]
    return layer * cfg.num_hidden_layers + [(cfg.vocab_size, h)]


def _int4_pack(w: torch.Tensor, group: int, dtype: torch.dtype):
    n, k = w.shape
    g = w.reshape(n, k // group, group)
    lo = g.amin(-1)
    scale = ((g.amax(-1) - lo) / 15).clamp(min=1e-12)
    q = torch.round((g - lo[..., None]) / scale[..., None]).clamp(0, 15).to(torch.int32).reshape(n, k)
    # the kernel's dequantization: (q - 8) * scale + zero
    sz = torch.stack([scale.t(), (lo + 8 * scale).t()], -1).contiguous().to(dtype)
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1), sz


FORMATS = {  # name -> (activation dtype, make weights, run one GEMM)
    "fp32 F.linear": (torch.float32, lambda w: (w,), lambda x, t: F.linear(x, t[0])),
    "bf16 F.linear": (torch.bfloat16, lambda w: (w.bfloat16(),), lambda x, t: F.linear(x, t[0])),
    "int8 (fp32 activations)": (
        torch.float32, lambda w: _int8(w, torch.float32),
        lambda x, t: torch.ops.aten._weight_int8pack_mm(x, *t)),
    "int8 (bf16 activations)": (
        torch.bfloat16, lambda w: _int8(w, torch.bfloat16),
        lambda x, t: torch.ops.aten._weight_int8pack_mm(x, *t)),
    "int4 g32 (fp32 activations)": (
        torch.float32, lambda w: _int4_pack(w, 32, torch.float32),
        lambda x, t: torch.ops.aten._weight_int4pack_mm_for_cpu(x, t[0], 32, t[1])),
    "int4 g32 (bf16 activations)": (
        torch.bfloat16, lambda w: _int4_pack(w, 32, torch.bfloat16),
        lambda x, t: torch.ops.aten._weight_int4pack_mm_for_cpu(x, t[0], 32, t[1])),
}


def _int8(w: torch.Tensor, dtype: torch.dtype):
    from model_executor.layers.quantization.fp8_math import quantize_int8_per_channel

    q, s = quantize_int8_per_channel(w)
    return q, s.to(dtype)


def time_linears(shapes, batch_sizes: list[int], iters: int = 7) -> list[dict]:
    gen = torch.Generator().manual_seed(0)
    rows = []
    for name, (dtype, make, run) in FORMATS.items():
        weights = [make(torch.randn(n, k, generator=gen) * 0.02) for n, k in shapes]
        nbytes = sum(t.numel() * t.element_size() for w in weights for t in w)
        for bs in batch_sizes:
            xs = {k: torch.randn(bs, k, generator=gen).to(dtype) for k in {k for _, k in shapes}}

            def one_pass(xs=xs, weights=weights, run=run):
                for (_, k), w in zip(shapes, weights):
                    run(xs[k], w)

            one_pass()
            times = []
            for _ in range(iters):
                t0 = time.perf_counter()
                one_pass()
                times.append(time.perf_counter() - t0)
            ms = statistics.median(times) * 1e3
            rows.append({"format": name, "batch_size": bs, "weight_bytes": nbytes, "ms": round(ms, 3),
                         "gb_s": round(nbytes / ms / 1e6, 2)})
            print(f"  {name:28s} bs={bs:<3d} {nbytes / 1e6:7.1f} MB {ms:8.2f} ms {nbytes / ms / 1e6:6.1f} GB/s",
                  flush=True)
        del weights
    return rows


# ---- main -----------------------------------------------------------------------------------------------


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.model_path is None:
        from model_executor.default_model import ensure_default_model

        args.model_path = str(ensure_default_model())
    threads = torch.get_num_threads()
    load_before = load_average()
    bw = {"1_thread": bandwidth(1), f"{threads}_threads": bandwidth(threads)}
    read_bw = bw[f"{threads}_threads"]["read_gb_s"]
    print(f"threads {threads}, load average {load_before}; bandwidth (500 MB, GB/s): "
          + "; ".join(f"{k}: read {v['read_gb_s']}, copy {v['copy_gb_s']}" for k, v in bw.items()), flush=True)
    runners = {q: build_runner(args, q) for q in args.quantization}
    read_bytes = {q: step_read_bytes(r.model) for q, r in runners.items()}
    times: dict[tuple[str, int], list[float]] = {(q, bs): [] for q in runners for bs in args.batch_size}
    prefill: dict[str, list[float]] = {q: [] for q in runners}
    for rep in range(args.repeats):
        order = list(runners) if rep % 2 == 0 else list(reversed(runners))  # neither always goes first
        for q in order:
            for bs in args.batch_size:
                times[(q, bs)].append(time_step(runners[q], bs, args))
            if args.prefill_len:
                prefill[q].append(time_prefill(runners[q], args.prefill_len))
    rows = []
    for (q, bs), ts in times.items():
        ms = statistics.median(ts)
        floor_ms = read_bytes[q] / (read_bw * 1e9) * 1e3
        rows.append({"quantization": q, "batch_size": bs, "read_bytes": read_bytes[q], "ms": round(ms, 3),
                     "ms_runs": [round(t, 3) for t in ts], "tok_s": round(bs / ms * 1e3, 1),
                     "implied_gb_s": round(read_bytes[q] / ms / 1e6, 2), "floor_ms": round(floor_ms, 3),
                     "over_floor": round(ms / floor_ms, 2)})
    base = {r["batch_size"]: r["ms"] for r in rows if r["quantization"] == args.quantization[0]}
    print(f"decode step, eager, {args.input_len}-token prompts, median of {args.repeats} x median of "
          f"{args.steps} steps; floor = bytes / read bandwidth {read_bw} GB/s")
    print(f"{'quantization':>12} {'bs':>4} {'MB read':>8} {'ms/step':>8} {'tok/s':>7} {'GB/s':>6} {'floor ms':>9} "
          f"{'x floor':>8} {'speedup':>8}")
    for r in rows:
        r["speedup_vs_first"] = round(base[r["batch_size"]] / r["ms"], 2)
        print(f"{r['quantization']:>12} {r['batch_size']:>4} {r['read_bytes'] / 1e6:>8.1f} {r['ms']:>8.2f} "
              f"{r['tok_s']:>7.1f} {r['implied_gb_s']:>6.1f} {r['floor_ms']:>9.2f} {r['over_floor']:>8.2f} "
              f"{r['speedup_vs_first']:>8.2f}")
    prefill_rows = []
    if args.prefill_len:
        base_ms = statistics.median(prefill[args.quantization[0]])
        print(f"extend of {args.prefill_len} tokens (one request), median of {args.repeats}:")
        for q, ts in prefill.items():
            ms = statistics.median(ts)
            prefill_rows.append({"quantization": q, "tokens": args.prefill_len, "ms": round(ms, 1),
                                 "ms_runs": [round(t, 1) for t in ts], "speedup_vs_first": round(base_ms / ms, 2)})
            print(f"{q:>12} {ms:>9.1f} ms {base_ms / ms:>6.2f}x")
    kernels = None
    if args.kernels:
        del runners
        shapes = linear_shapes(build_runner(args, "none"))
        print("linear layers alone (every GEMM of a step, own weights each), median of 7 passes:")
        kernels = time_linears(shapes, args.batch_size)
    load_after = load_average()
    print(f"load average before {load_before}, after {load_after}")
    report = {"benchmark": "bench_cpu_step", "model": args.model_path, "threads": threads,
              "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "torch": torch.__version__,
              "load_average": {"before": load_before, "after": load_after}, "bandwidth": bw,
              "args": vars(args), "steps": rows, "prefill": prefill_rows,
              "kernels": kernels}
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(report, f, indent=2)
        print("wrote", args.json_out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Sampler time per call, pytorch against flashinfer (`--sampling-backend`), by batch size and filter.

    python -m benchmarks.kernels.bench_sampler --out out/bench_sampler.json

For each batch size (--bs) and case (greedy, top-k 50, top-p 0.9, top-p 0.9 with top-k 50, min-p 0.05; every
row alike, temperature 0.8, no seed), it times `Sampler(logits, info)` on float32 logits [bs, --vocab] of
scale --logit-scale (random normal; the rejection sampler's rounds depend on how peaked the rows are):
--warmup calls, then --iters calls each timed with CUDA events (perf_counter on a CPU), reporting the median
and the 10th/90th percentiles. The info is built once per case: this is the sampler, not the batch set-up.
flashinfer is skipped (and said so) where it is not installed or not on a GPU. Prints a table, writes JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from model_executor.sampler import Sampler, SamplingBatchInfo
from model_executor.sampling_flashinfer import SamplingBackendError, create_flashinfer_sampler
from model_executor.sampling_params import SamplingParams

CASES = {
    "greedy": SamplingParams(temperature=0.0),
    "top_k_50": SamplingParams(temperature=0.8, top_k=50),
    "top_p_0.9": SamplingParams(temperature=0.8, top_p=0.9),
    "top_p_0.9+top_k_50": SamplingParams(temperature=0.8, top_p=0.9, top_k=50),
    "min_p_0.05": SamplingParams(temperature=0.8, min_p=0.05),
}


def time_calls(fn, device: torch.device, warmup: int, iters: int) -> list[float]:
    """Milliseconds of each of `iters` calls after `warmup`."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return times


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.kernels.bench_sampler",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--bs", type=int, nargs="+", default=[1, 64, 256])
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--logit-scale", type=float, default=3.0)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", type=Path, default=Path("out/bench_sampler.json"))
    args = parser.parse_args(argv)
    device = torch.device(args.device)

    samplers = {"pytorch": Sampler()}
    try:
        samplers["flashinfer"] = Sampler(create_flashinfer_sampler("flashinfer", device), flashinfer_always=True)
    except SamplingBackendError as e:
        print(f"flashinfer skipped: {e}")

    results = []
    with torch.inference_mode():
        for bs in args.bs:
            g = torch.Generator(device=device).manual_seed(0)
            logits = torch.randn(bs, args.vocab, device=device, generator=g) * args.logit_scale
            for case, params in CASES.items():
                info = SamplingBatchInfo.from_params([params] * bs, [0] * bs, device)
                for backend, sampler in samplers.items():
                    ms = time_calls(lambda s=sampler, x=logits, i=info: s(x, i), device, args.warmup, args.iters)
                    results.append({"bs": bs, "case": case, "backend": backend, "median_ms": statistics.median(ms),
                                    "p10_ms": percentile(ms, 0.1), "p90_ms": percentile(ms, 0.9)})

    names = list(samplers)
    header = f"{'bs':>4} {'case':<20}" + "".join(f" {n + ' ms':>14}" for n in names)
    header += f" {'speed-up':>9}" if len(names) == 2 else ""
    print(f"Sampler per call, vocab {args.vocab}, logit scale {args.logit_scale}, {device}: median of {args.iters}")
    print(header)
    for bs in args.bs:
        for case in CASES:
            row = {r["backend"]: r["median_ms"] for r in results if r["bs"] == bs and r["case"] == case}
            line = f"{bs:>4} {case:<20}" + "".join(f" {row[n]:>14.3f}" for n in names)
            if len(names) == 2:
                line += f" {row['pytorch'] / row['flashinfer']:>8.2f}x"
            print(line)

    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    report = {"vocab": args.vocab, "logit_scale": args.logit_scale, "warmup": args.warmup, "iters": args.iters,
              "device": str(device), "device_name": device_name, "torch": torch.__version__, "backends": names,
              "results": results}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out}")
    return report


if __name__ == "__main__":
    main()

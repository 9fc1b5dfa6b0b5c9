"""probe_pdl_step: the decode step with o_proj launched with PDL after attention, and without, in one process
(issues 18, 23)

bench_one_batch compares trees across processes, whose step times differ by ~0.5% run to run. This probe builds
one model and captures the decode graph twice at one batch size: as the tree runs it (o_proj after attention
launched with PDL, triton_ops/pdl.py) and with o_proj's `after_attention` off (llama.py's call patched during
that capture). It then times both back to back (bench_one_batch's b2b: the steps launched one after another,
one sync at the end), alternating for --rounds rounds, and checks that both graphs give the same logits.

    python -m benchmarks.probe_pdl_step --model llama-3.1-8b --quantization fp8 --json out.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.probe_pdl_step", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="llama-3.1-8b")
    p.add_argument("--quantization", default=None, choices=("fp8",))
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--json", dest="json_out")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("probe_pdl_step needs a CUDA device", file=sys.stderr)
        return 2
    from benchmarks.bench_one_batch import prepare, time_back_to_back
    from model_executor.configs import shape_path
    from model_executor.models import llama
    from runners.cuda_graph_runner import CudaGraphRunner
    from runners.model_runner import ModelRunner, RunnerConfig

    runner = ModelRunner(RunnerConfig(
        model_path=str(shape_path(args.model)), device="cuda", random_weights=True, quantization=args.quantization,
        max_running_requests=max(8, args.batch_size), context_length=4096,
        max_total_tokens=max(16384, args.batch_size * (args.input_len + args.steps + 8)),
        disable_cuda_graph=True, disable_piecewise_cuda_graph=True))
    batches, _, _ = prepare(runner, args.batch_size, args.input_len, args.steps)
    graphs = {"pdl": CudaGraphRunner(runner, [args.batch_size])}
    real = llama.linear_add_rmsnorm
    llama.linear_add_rmsnorm = lambda *a, after_attention=False, **kw: real(*a, **kw)
    try:
        graphs["no pdl"] = CudaGraphRunner(runner, [args.batch_size])
    finally:
        llama.linear_add_rmsnorm = real
    with torch.inference_mode():
        logits = {name: g.replay(batches[0]).float().clone() for name, g in graphs.items()}
    same = torch.equal(logits["pdl"], logits["no pdl"])
    times = {name: [] for name in graphs}
    for _ in range(args.rounds):
        for name, g in graphs.items():
            times[name].append(time_back_to_back(g.replay, batches, runner.device))
    print(f"{torch.cuda.get_device_name(0)}; {args.model} {args.quantization or 'bf16'} bs={args.batch_size}, "
          f"{args.input_len} tokens; logits equal: {same}")
    for name, ms in times.items():
        print(f"{name:<8} b2b ms {' '.join(f'{t:.4f}' for t in ms)}  median {statistics.median(ms):.4f}")
    delta = statistics.median(a - b for a, b in zip(times["pdl"], times["no pdl"]))
    print(f"pdl - no pdl, median of the rounds' differences: {delta * 1e3:+.1f} us")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"probe": "probe_pdl_step", "gpu": torch.cuda.get_device_name(0), "model": args.model,
                       "quantization": args.quantization, "batch_size": args.batch_size, "input_len": args.input_len,
                       "b2b_ms": times, "delta_us": delta * 1e3, "logits_equal": same}, f, indent=1)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())

"""probe_pdl_step: the decode step with o_proj launched with PDL after attention, and without, in one process
(issues 18, 23)

bench_one_batch compares trees across processes, whose step times differ by ~0.5% run to run. This probe builds
one model and captures the decode graph several times at one batch size (--order): as the tree runs it (`pdl`:
o_proj after attention launched with PDL, triton_ops/pdl.py) and with o_proj's `after_attention` off (`no-pdl`:
llama.py's call patched during that capture), alternating, since a graph captured later in a process can run
slower (the first run of this probe: the second graph 56 us slower at 8B FP8 bs=1, 33 us at 1B). It then times
each back to back (bench_one_batch's b2b: the steps launched one after another, one sync at the end), in turn
for --rounds rounds, and checks that all give the same logits.

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
    p.add_argument("--context-length", type=int, default=4096,
                   help="the runner's context length (the decode workspace's split count follows it; bench_one_batch "
                        "uses input + steps + 16)")
    p.add_argument("--max-total-tokens", type=int, default=16384)
    p.add_argument("--max-running-requests", type=int, default=8)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--order", nargs="+", default=["no-pdl", "pdl", "no-pdl", "pdl"], choices=("pdl", "no-pdl"),
                   help="the graphs, in capture order")
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
        max_running_requests=max(args.max_running_requests, args.batch_size), context_length=args.context_length,
        max_total_tokens=max(args.max_total_tokens, args.batch_size * (args.input_len + args.steps + 8)),
        disable_cuda_graph=True, disable_piecewise_cuda_graph=True))
    batches, _, _ = prepare(runner, args.batch_size, args.input_len, args.steps)
    real = llama.linear_add_rmsnorm
    graphs = {}
    for i, name in enumerate(args.order):  # captured in this order (a later capture may run slower)
        if name == "no-pdl":
            llama.linear_add_rmsnorm = lambda *a, after_attention=False, **kw: real(*a, **kw)
        try:
            graphs[f"{i} {name}"] = CudaGraphRunner(runner, [args.batch_size])
        finally:
            llama.linear_add_rmsnorm = real
    with torch.inference_mode():
        logits = [g.replay(batches[0]).float().clone() for g in graphs.values()]
    same = all(torch.equal(t, logits[0]) for t in logits)
    times = {name: [] for name in graphs}
    for _ in range(args.rounds):
        for name, g in graphs.items():
            times[name].append(time_back_to_back(g.replay, batches, runner.device))
    print(f"{torch.cuda.get_device_name(0)}; {args.model} {args.quantization or 'bf16'} bs={args.batch_size}, "
          f"{args.input_len} tokens, context length {args.context_length}, {args.max_total_tokens} KV slots; "
          f"logits equal: {same}")
    for name, ms in times.items():
        print(f"{name:<10} b2b ms {' '.join(f'{t:.4f}' for t in ms)}  median {statistics.median(ms):.4f}")
    by_kind = {kind: [statistics.median(ms) for name, ms in times.items() if name.split()[1] == kind]
               for kind in ("pdl", "no-pdl")}
    delta = statistics.mean(by_kind["pdl"]) - statistics.mean(by_kind["no-pdl"]) if all(by_kind.values()) else 0.0
    print(f"pdl - no pdl, the mean of each graph's median: {delta * 1e3:+.1f} us")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"probe": "probe_pdl_step", "gpu": torch.cuda.get_device_name(0), "model": args.model,
                       "quantization": args.quantization, "batch_size": args.batch_size, "input_len": args.input_len,
                       "b2b_ms": times, "delta_us": delta * 1e3, "logits_equal": same}, f, indent=1)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())

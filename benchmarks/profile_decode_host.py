"""Host time of one decode graph replay, part by part: what `bench_one_batch`'s "host ms" is made of.

    python -m benchmarks.profile_decode_host --model llama-3.2-1b --batch-size 1 --json out.json

bench_one_batch's graph ms (each step from the call until its sync returns) is the GPU's step plus the host
time before the graph is queued (its "host ms", which can be a sizeable share of a small model's step:
docs/benchmarks.md). Each row here runs one part of `CudaGraphRunner.replay` on its own, back to
back, and reports the host microseconds per call (median of `--rounds` rounds of `--iters` calls, synchronized
between rounds) and per call made right after a synchronize, as bench_one_batch's per-step loop makes them,
beside two references: a one-element kernel launch and a tensor view. Then bench_one_batch's own step loop
runs in this process: over its batches, over one batch, after 32 eager steps (as the bench times eager first),
and after a garbage collection, to tell the batches, the process's history and the code apart.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time

import torch

from benchmarks.bench_one_batch import prepare, time_steps_and_launch
from model_executor.configs import SHAPES, shape_path
from runners.capture_lists import pick_size
from runners.cuda_graph_runner import CudaGraphRunner
from runners.model_runner import ModelRunner, RunnerConfig


def host_us(fn, iters: int, rounds: int) -> float:
    """Median over rounds of the host microseconds per call of `iters` back-to-back calls."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    per_call = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        per_call.append((time.perf_counter() - t0) * 1e6 / iters)
        torch.cuda.synchronize()
    return statistics.median(per_call)


def synced_host_us(fn, calls: int) -> float:
    """Median host microseconds of one call made right after a synchronize (the GPU idle), as
    bench_one_batch's per-step loop makes its replays."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(calls):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
    torch.cuda.synchronize()
    return statistics.median(times)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.profile_decode_host", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="llama-3.2-1b", choices=SHAPES)
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--iters", type=int, default=20, help="calls per round (graph replays queue on the GPU)")
    p.add_argument("--rounds", type=int, default=21)
    p.add_argument("--json", dest="json_out")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("profile_decode_host needs a CUDA device", file=sys.stderr)
        return 2
    bs = args.batch_size
    cfg = RunnerConfig(model_path=str(shape_path(args.model)), device="cuda", attention_backend="triton",
                       max_running_requests=max(bs, 8), max_total_tokens=bs * (args.input_len + 64) + 16,
                       context_length=args.input_len + 64, random_weights=True, disable_cuda_graph=True,
                       disable_piecewise_cuda_graph=True)
    runner = ModelRunner(cfg)
    gr = CudaGraphRunner(runner, [bs])
    batches, _, _ = prepare(runner, bs, args.input_len, 32)
    fb = batches[0]
    buf = gr.buffers
    padded = pick_size(gr.batch_sizes, bs)
    static = gr.static_batches[padded]
    variant = gr.backend.decode_graph_variant(static)
    graph = gr.graphs[padded, variant]
    dst = buf.rows(bs)[0]
    src = [fb.input_ids, fb.positions, fb.req_pool_indices, fb.out_cache_loc, fb.seq_lens]
    one = torch.zeros(1, device="cuda")

    def metadata():
        static.seq_lens_cpu = fb.seq_lens_cpu + [buf.seq_len_fill] * (padded - bs)
        gr.backend.decode_graph_variant(static)
        gr.backend.init_forward_metadata_replay_cuda_graph(static)

    parts = {
        "replay(fb), whole": lambda: gr.replay(fb),
        "buffers.load (cached views + one multi-tensor copy)": lambda: buf.load(fb, padded),
        "the five destination slices (as before the cached views)": lambda: [buf.input_ids[:bs], buf.positions[:bs], buf.req_pool_indices[:bs],
                                                buf.out_cache_loc[:bs], buf.seq_lens[:bs]],
        "_foreach_copy_ over prebuilt views": lambda: torch._foreach_copy_(dst, src, non_blocking=True),
        "the split plan and backend metadata": metadata,
        "CUDAGraph.replay()": graph.replay,
        "logits[:bs] (as before the cached views)": lambda: buf.logits[:bs],
        "reference: one-element zero_() (a launch)": one.zero_,
        "reference: a view (one[:1])": lambda: one[:1],
    }
    rows = []
    print(f"{args.model} bs={bs}: host us per call, back to back (median of {args.rounds} rounds of {args.iters}) "
          f"and right after a synchronize (median of {args.rounds * args.iters} calls)")
    print(f"{'b2b us':>9} {'synced us':>9}  part")
    with torch.inference_mode():
        for name, fn in parts.items():
            us = host_us(fn, args.iters, args.rounds)
            synced = synced_host_us(fn, args.rounds * args.iters)
            rows.append({"part": name, "host_us": round(us, 2), "synced_host_us": round(synced, 2)})
            print(f"{us:>9.2f} {synced:>9.2f}  {name}", flush=True)
    # bench_one_batch's own loop (a step, then its sync), over its 32 batches and over one batch 32 times:
    # whether the batches, rather than the process, make its host ms larger than a synced replay above.
    # Then the same loop after the eager steps bench_one_batch times first (its processes' host ms ran higher).
    loops = {}

    def bench_loop(name, bats):
        step_ms, host_ms = time_steps_and_launch(gr.replay, bats, torch.device("cuda"))
        loops[name] = {"step_ms": round(step_ms, 4), "host_ms": round(host_ms, 4)}
        print(f"{name}: step {step_ms:.4f} ms, host {host_ms:.4f} ms", flush=True)

    for i in range(2):
        bench_loop(f"bench loop, 32 batches (#{i + 1})", batches)
        bench_loop(f"bench loop, one batch 32 times (#{i + 1})", [fb] * 32)
    time_steps_and_launch(runner.forward_eager, batches, torch.device("cuda"))
    for i in range(2):
        bench_loop(f"bench loop, 32 batches, after 32 eager steps (#{i + 1})", batches)
    gc.collect()
    gc.freeze()
    bench_loop("bench loop, 32 batches, after gc.collect() + gc.freeze()", batches)
    bench_loop("bench loop, 32 batches, again", batches)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "model": args.model, "batch_size": bs, "rows": rows,
                       "bench_loops": loops}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""probe_graph_launch: what a CUDA graph's launch costs the host, and whether the GPU waits for all of it.

A graph of N GEMV-sized kernels (a [1, K] x [K, N] bf16 product, ~10 us each on cold weights) is replayed as
one graph, or as P graphs of N / P kernels each, launched one after another. Per layout: the host time of the
launch calls alone, the time of launch + sync (what bench_one_batch's "graph ms" counts) and the GPU time per
step with launches back to back (its "b2b ms"). If the GPU starts only once the whole graph is submitted,
splitting it lets the GPU start after the first piece: launch + sync falls toward b2b + the first piece's
launch.

    python -m benchmarks.probe_graph_launch --json out.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch


def build(pieces: int, n: int, weights, x):
    graphs = []
    per = n // pieces
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for w in weights[:2]:
            x @ w
    torch.cuda.current_stream().wait_stream(s)
    for p in range(pieces):
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for i in range(p * per, (p + 1) * per):
                x @ weights[i % len(weights)]
        graphs.append(g)
    return graphs


def measure(graphs, iters: int) -> dict:
    def launch():
        for g in graphs:
            g.replay()

    for _ in range(5):
        launch()
    torch.cuda.synchronize()
    host, step = [], []
    for _ in range(iters):
        t0 = time.perf_counter()
        launch()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        host.append((t1 - t0) * 1e3)
        step.append((t2 - t0) * 1e3)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        launch()
    end.record()
    end.synchronize()
    return {"host_ms": statistics.median(host), "step_ms": statistics.median(step),
            "b2b_ms": start.elapsed_time(end) / iters}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kernels", type=int, nargs="+", default=[1, 16, 85, 256])
    p.add_argument("--pieces", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--k", type=int, default=2048)
    p.add_argument("--n", type=int, default=2048)
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--json", dest="json_out")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("probe_graph_launch needs a CUDA device", file=sys.stderr)
        return 2
    x = torch.randn(1, args.k, device="cuda", dtype=torch.bfloat16)
    weights = [torch.randn(args.k, args.n, device="cuda", dtype=torch.bfloat16) for _ in range(16)]  # > L2
    rows = []
    print(f"{'kernels':>8} {'pieces':>7} {'host ms':>8} {'step ms':>8} {'b2b ms':>8} {'step-b2b':>9}")
    for n in args.kernels:
        for pieces in args.pieces:
            if n % pieces or n < pieces:
                continue
            r = {"kernels": n, "pieces": pieces, **measure(build(pieces, n, weights, x), args.iters)}
            rows.append(r)
            print(f"{n:>8} {pieces:>7} {r['host_ms']:>8.4f} {r['step_ms']:>8.4f} {r['b2b_ms']:>8.4f} "
                  f"{r['step_ms'] - r['b2b_ms']:>9.4f}", flush=True)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "k": args.k, "n": args.n, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

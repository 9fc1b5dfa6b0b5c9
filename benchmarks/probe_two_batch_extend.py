"""probe_two_batch_extend: would two-batch overlap speed up a short extend? (issue 23)

A 128-token Llama-3.2-1B extend is latency-bound: its cuBLAS GEMMs at 128 rows run no faster from L2 than from
HBM (docs/benchmarks.md, thirty-third session), so the GPU has room that a second, independent stream of work
could use. This probe bounds what splitting the extend into k micro-batches on k streams could give, before
anything is built: the backbone (embedding -> layers -> final norm, no LM head) of --tokens tokens as one whole
extend graph, against k graphs of tokens / k tokens each (micro-batch i extends a cached prefix of
i * tokens / k tokens, as the real split would), replayed on k streams at once with no dependency between them
(the real split needs one per layer: micro-batch i's attention reads i - 1's K/V), and one after another.
Concurrent replays that are not faster than the one graph rule the idea out: each micro-batch reads every
weight again.

    python -m benchmarks.probe_two_batch_extend --model llama-3.2-1b --tokens 128 --splits 2 4 --json out.json

Graph replays timed with CUDA events, the median of --iters after --warmup. Needs CUDA.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from datetime import datetime, timezone

import torch

from model_executor.configs import SHAPES, shape_path


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.probe_two_batch_extend",
                                description=__doc__.splitlines()[0])
    p.add_argument("--model", default="llama-3.2-1b", choices=SHAPES, help="a model shape, random weights")
    p.add_argument("--tokens", type=int, default=128, help="tokens of the whole extend")
    p.add_argument("--splits", type=int, nargs="+", default=[2, 4], help="micro-batch counts k")
    p.add_argument("--iters", type=int, default=60)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--json", dest="json_out", help="write the results here")
    args = p.parse_args(argv)
    bad = [k for k in args.splits if k < 2 or args.tokens % k]
    if bad:
        p.error(f"--splits: each k must be >= 2 and divide --tokens {args.tokens}; got {bad}")
    return args


def micro_batches(tokens: int, k: int) -> list[tuple[int, int]]:
    """(new tokens, cached prefix) of each of k micro-batches of one request's extend of `tokens` tokens."""
    part = tokens // k
    return [(part, i * part) for i in range(k)]


def time_ms(fn, iters: int, warmup: int) -> float:
    """bench_prefill's timing (CUDA events, each run synchronised, the median) of fn()."""
    from benchmarks.bench_prefill import time_ms as median_ms

    return median_ms(lambda _: fn(), None, torch.device("cuda"), iters, warmup)


def replay_serial(graphs: list) -> None:
    for g in graphs:
        g.replay()


def replay_overlapped(graphs: list, streams: list) -> None:
    """Each graph on its own stream, all after the work queued so far and before the work queued next."""
    main_stream = torch.cuda.current_stream()
    for g, s in zip(graphs, streams):
        s.wait_stream(main_stream)
        with torch.cuda.stream(s):
            g.replay()
    for s in streams:
        main_stream.wait_stream(s)


def main(argv=None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("probe_two_batch_extend needs a CUDA device", file=sys.stderr)
        return 2
    from benchmarks.bench_prefill import prepare
    from runners.full_extend_graph_runner import FullExtendGraphRunner
    from runners.graph_seam import CudaGraphCapturer
    from runners.model_runner import ModelRunner, RunnerConfig

    device = torch.device("cuda")
    # a request row per graph, and KV slots for every graph's prefix and tokens (prepare keeps them)
    requests = 1 + sum(args.splits)
    slots = args.tokens + sum(t + prefix for k in args.splits for t, prefix in micro_batches(args.tokens, k))
    runner = ModelRunner(RunnerConfig(
        model_path=str(shape_path(args.model)), device="cuda", max_running_requests=requests,
        max_total_tokens=slots + 64, context_length=args.tokens + 64, random_weights=True,
        disable_cuda_graph=True, disable_piecewise_cuda_graph=True))

    def graph(tokens: int, prefix: int, seed: int):
        """A whole extend graph of `tokens` tokens, its own pool (graphs replayed at once must not share one),
        loaded with one request extending a `prefix`-token prefix."""
        full = FullExtendGraphRunner(runner, [tokens], max_requests=1, capturer=CudaGraphCapturer(device))
        fb, _, _ = prepare(runner, tokens, 1, prefix, seed=seed)
        full.buffers.load(fb, 1)
        return full.graphs[tokens, 1]

    report = {"benchmark": "probe_two_batch_extend", "model": args.model, "tokens": args.tokens,
              "gpu": torch.cuda.get_device_name(device), "torch": torch.__version__,
              "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "splits": {}}
    with torch.inference_mode():
        whole = graph(args.tokens, 0, 0)
        report["one_graph_ms"] = time_ms(whole.replay, args.iters, args.warmup)
        for k in args.splits:
            graphs = [graph(t, prefix, 10 + i) for i, (t, prefix) in enumerate(micro_batches(args.tokens, k))]
            streams = [torch.cuda.Stream(device) for _ in graphs]

            report["splits"][str(k)] = {
                "one_micro_batch_ms": time_ms(graphs[0].replay, args.iters, args.warmup),
                "serial_ms": time_ms(functools.partial(replay_serial, graphs), args.iters, args.warmup),
                "overlapped_ms": time_ms(functools.partial(replay_overlapped, graphs, streams), args.iters,
                                         args.warmup)}
        report["one_graph_ms_again"] = time_ms(whole.replay, args.iters, args.warmup)
    print(f"{args.model}, {args.tokens}-token extend backbone on {report['gpu']}: one graph "
          f"{report['one_graph_ms']:.3f} ms (again at the end: {report['one_graph_ms_again']:.3f})")
    print(f"{'k':>3} {'one micro-batch ms':>19} {'k serial ms':>12} {'k overlapped ms':>16} {'overlapped / one graph':>23}")
    for k, r in report["splits"].items():
        print(f"{k:>3} {r['one_micro_batch_ms']:>19.3f} {r['serial_ms']:>12.3f} {r['overlapped_ms']:>16.3f} "
              f"{r['overlapped_ms'] / report['one_graph_ms']:>23.2f}")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

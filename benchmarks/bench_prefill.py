"""bench_prefill: one extend (prefill) batch of N tokens, eager vs piecewise vs whole-backbone CUDA graphs in
the same run.

    python -m benchmarks.bench_prefill --model llama-3.2-1b --sizes 16 128 512 2048 --json out.json
    python -m benchmarks.bench_prefill --model llama-3.2-1b --sizes 512 2048 --batch 8 --prefix-len 256
    python -m benchmarks.bench_prefill --sizes 128 512 --full-max-tokens 512 --full-requests 1 8 32

Each size N is one batch of --batch requests (N tokens in all, split evenly) extending --prefix-len cached
tokens each. The piecewise runner captures the default token levels up to the first level >= the largest
size (44 levels for 2048, as the server would), or --levels. With --full-max-tokens, the levels up to it
also get whole-backbone graphs (runners/full_extend_graph_runner.py), once per --full-requests row count, in
the pieces' pool as in the server. Times are CUDA-event medians of --iters runs
after --warmup runs; the trace, capture time and capture memory are those of the runner's start-up.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from datetime import datetime, timezone

import torch

from model_executor.configs import SHAPES, shape_path
from model_executor.forward_batch import ForwardMode
from runners.capture_lists import get_token_levels, pick_size
from runners.full_extend_graph_runner import DEFAULT_MAX_REQUESTS, FullExtendGraphRunner
from runners.graph_seam import default_capturer
from runners.model_runner import ModelRunner, RunnerConfig
from runners.piecewise_cuda_graph_runner import PiecewiseCudaGraphRunner


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_prefill",
                                description=__doc__.splitlines()[0])
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", default="llama-3.2-1b", choices=SHAPES, help="a model shape, random weights")
    src.add_argument("--model-path", help="an HF folder (config.json; real weights unless --random-weights)")
    p.add_argument("--random-weights", action="store_true", help="with --model-path: random weights")
    p.add_argument("--sizes", type=int, nargs="+", default=[16, 128, 512, 2048], help="tokens per batch")
    p.add_argument("--batch", type=int, default=1, help="requests per batch (the tokens split evenly)")
    p.add_argument("--prefix-len", type=int, default=0, help="cached tokens before each request's extend")
    p.add_argument("--levels", type=int, nargs="+", help="token levels to capture (default: the server's)")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--attention-backend", default="auto")
    p.add_argument("--enable-torch-compile", action="store_true", help="inductor inside the pieces")
    p.add_argument("--quantization", choices=("none", "fp8", "int8"), help="weight quantization (default: the "
                   "checkpoint's)")
    p.add_argument("--full-max-tokens", type=int, default=0,
                   help="also capture whole-backbone graphs at the levels up to this many tokens (0: none)")
    p.add_argument("--full-requests", type=int, nargs="+", default=[DEFAULT_MAX_REQUESTS],
                   help="request rows of the whole graphs: one runner per value")
    p.add_argument("--json", dest="json_out", help="write the results here")
    return p.parse_args(argv)


def default_levels(max_size: int) -> list[int]:
    """The server's levels up to the first one that holds max_size."""
    levels = get_token_levels(max_size + 512)
    top = pick_size(levels, max_size)
    return [t for t in levels if t <= top]


def split_evenly(total: int, parts: int) -> list[int]:
    base, extra = divmod(total, parts)
    return [base + (i < extra) for i in range(parts)]


def prepare(runner: ModelRunner, size: int, batch: int, prefix_len: int, seed: int = 0):
    """Requests with random prompts, their prefixes prefilled; returns the extend batch of `size` tokens."""
    g = torch.Generator().manual_seed(seed)
    vocab = runner.model_config.vocab_size
    ext_lens = split_evenly(size, batch)
    rows, locs, ids = [], [], []
    for ext in ext_lens:
        row = runner.req_to_token_pool.alloc()
        loc = runner.allocator.alloc(prefix_len + ext)
        runner.req_to_token_pool.write(row, 0, loc)
        prompt = torch.randint(0, vocab, (prefix_len + ext,), generator=g).tolist()
        if prefix_len:
            with torch.inference_mode():
                runner.forward_eager(runner.build_batch(ForwardMode.EXTEND, prompt[:prefix_len], [row], [prefix_len],
                                                        loc[:prefix_len], extend_seq_lens=[prefix_len]))
        rows.append(row)
        locs.append(loc)
        ids += prompt[prefix_len:]
    fb = runner.build_batch(ForwardMode.EXTEND, ids, rows, [prefix_len + e for e in ext_lens],
                            torch.cat([loc[prefix_len:] for loc in locs]), extend_seq_lens=ext_lens)
    return fb, rows, torch.cat(locs)


def compare(eager_logits: torch.Tensor, graph_logits: torch.Tensor) -> tuple[float, bool]:
    """Max |logit difference| and whether the greedy tokens agree."""
    return ((eager_logits - graph_logits).abs().max().item(),
            bool(torch.equal(eager_logits.argmax(-1), graph_logits.argmax(-1))))


def time_ms(fn, fb, device: torch.device, iters: int, warmup: int) -> float:
    """Median ms of fn(fb): CUDA events on GPU (each run synchronised), wall clock on CPU."""
    with torch.inference_mode():
        for _ in range(warmup):
            fn(fb)
        times = []
        for _ in range(iters):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn(fb)
                end.record()
                torch.cuda.synchronize(device)
                times.append(start.elapsed_time(end))
            else:
                t0 = time.perf_counter()
                fn(fb)
                times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def main(argv=None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    model_path = args.model_path or str(shape_path(args.model))
    levels = sorted(set(args.levels)) if args.levels else default_levels(max(args.sizes))
    max_size = max(args.sizes)
    cfg = RunnerConfig(model_path=model_path, device=args.device, dtype=args.dtype,
                       attention_backend=args.attention_backend,
                       max_running_requests=max(args.batch, 8, *args.full_requests),
                       max_total_tokens=max_size + args.batch * args.prefix_len + 64,
                       context_length=max_size + args.prefix_len + 64,
                       random_weights=args.model_path is None or args.random_weights,
                       disable_cuda_graph=True, disable_piecewise_cuda_graph=True,
                       enable_torch_compile=args.enable_torch_compile, quantization=args.quantization)
    runner = ModelRunner(cfg)
    pw = PiecewiseCudaGraphRunner(runner, levels, capturer=default_capturer(device))
    info = pw.info()
    full_levels = [t for t in levels if t <= args.full_max_tokens]
    fulls = {r: FullExtendGraphRunner(runner, full_levels, max_requests=r, capturer=pw.capturer)
             for r in args.full_requests} if full_levels else {}
    results = []
    for size in args.sizes:
        fb, rows, loc = prepare(runner, size, args.batch, args.prefix_len)
        with torch.inference_mode():
            eager_logits = runner.forward_eager(fb).clone()
            graph_logits = pw.replay(fb).clone() if pw.can_run(fb) else eager_logits
        max_diff, same_tokens = compare(eager_logits, graph_logits)
        eager_ms = time_ms(runner.forward_eager, fb, device, args.iters, args.warmup)
        graph_ms = time_ms(pw.replay, fb, device, args.iters, args.warmup) if pw.can_run(fb) else None
        entry = {"tokens": size, "batch": args.batch, "prefix_len": args.prefix_len,
                 "level": pick_size(levels, size), "eager_ms": round(eager_ms, 4),
                 "piecewise_ms": graph_ms and round(graph_ms, 4),
                 "speedup": graph_ms and round(eager_ms / graph_ms, 3),
                 "piecewise_vs_eager_max_abs_diff": max_diff, "greedy_tokens_equal": same_tokens, "full": {}}
        for r, full in fulls.items():
            if not full.can_run(fb):
                continue
            with torch.inference_mode():
                full_diff, full_same = compare(eager_logits, full.replay(fb))
            entry["full"][str(r)] = {"ms": round(time_ms(full.replay, fb, device, args.iters, args.warmup), 4),
                                     "vs_eager_max_abs_diff": full_diff, "greedy_tokens_equal": full_same}
        results.append(entry)
        runner.allocator.free(loc)
        for row in rows:
            runner.req_to_token_pool.free(row)
    report = {
        "benchmark": "bench_prefill", "model": args.model_path or args.model, "device": str(device),
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "dtype": str(runner.dtype).replace("torch.", ""), "quantization": args.quantization,
        "attention_backend": type(runner.attn_backend).__name__,
        "piece_compiler": "inductor" if args.enable_torch_compile else "eager",
        "num_levels": len(levels), "max_level": levels[-1], "num_pieces": len(pw.pieces),
        "num_traces": pw.num_traces, **info,
        "full_graphs": {str(r): full.info() for r, full in fulls.items()},
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "torch": torch.__version__,
        "results": results,
    }
    print(f"model {report['model']} on {report['gpu']} ({report['dtype']}, {report['attention_backend']}, "
          f"{report['piece_compiler']} pieces): {len(pw.pieces)} pieces x {len(levels)} levels up to {levels[-1]}; "
          f"trace {info['extend_compile_seconds']:.1f} s, capture {info['extend_capture_seconds']:.1f} s, "
          f"{info['extend_capture_gib']:.3f} GiB; traces {pw.num_traces}")
    print(f"{'tokens':>7} {'batch':>5} {'level':>6} {'eager ms':>10} {'piecewise ms':>13} {'speedup':>8} "
          f"{'max|diff|':>10} {'tokens=':>7}")
    for r in results:
        graphed = r["piecewise_ms"] is not None
        pw_ms = f"{r['piecewise_ms']:.3f}" if graphed else "eager"
        speedup = f"{r['speedup']:.2f}" if graphed else "-"
        print(f"{r['tokens']:>7} {r['batch']:>5} {r['level']!s:>6} {r['eager_ms']:>10.3f} {pw_ms:>13} {speedup:>8} "
              f"{r['piecewise_vs_eager_max_abs_diff']:>10.2e} {r['greedy_tokens_equal']!s:>7}")
    for request_rows, full in fulls.items():
        fi = full.info()
        print(f"whole graphs, {request_rows} request rows: levels up to {fi['full_extend_graph_tokens'][-1]}, "
              f"capture {fi['full_extend_capture_seconds']:.1f} s, {fi['full_extend_capture_gib']:.3f} GiB")
        for r in results:
            if str(request_rows) in r["full"]:
                f = r["full"][str(request_rows)]
                pw_ms = r["piecewise_ms"]
                vs = f" ({pw_ms / f['ms']:.2f}x piecewise)" if pw_ms else ""
                print(f"  {r['tokens']:>7} tokens: {f['ms']:.3f} ms{vs}, max|diff| vs eager "
                      f"{f['vs_eager_max_abs_diff']:.2e}, tokens equal {f['greedy_tokens_equal']}")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())

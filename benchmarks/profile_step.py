"""Profile one decode graph replay, one piecewise extend replay and one whole extend graph replay; print where the
time goes.

    python -m benchmarks.profile_step --model llama-3.2-1b --decode-bs 1 --extend-tokens 128 [--input-len 512]
    python -m benchmarks.profile_step --model llama-3.1-8b --quantization fp8 --decode-bs 1 --extend-tokens 0
    python -m benchmarks.profile_step --model llama-3.1-8b --quantization fp8 --kv-cache-dtype fp8_e4m3 --decode-bs 256
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.bench_one_batch import prepare
from model_executor.configs import SHAPES, shape_path
from model_executor.forward_batch import ForwardMode
from runners.cuda_graph_runner import CudaGraphRunner
from runners.full_extend_graph_runner import FullExtendGraphRunner
from runners.model_runner import ModelRunner, RunnerConfig
from runners.piecewise_cuda_graph_runner import PiecewiseCudaGraphRunner


def summarize(prof, title: str, n: int = 20) -> None:
    events = prof.key_averages()
    cuda = sorted(events, key=lambda e: e.device_time_total, reverse=True)[:n]
    cpu = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:n]
    total_gpu = sum(e.self_device_time_total for e in events) / 1e3
    print(f"== {title}: GPU kernel time {total_gpu:.3f} ms per {PROFILE_ITERS} iters")
    print("  top GPU:", "; ".join(f"{e.key[:50]} {e.device_time_total / 1e3:.3f}ms x{e.count}" for e in cuda))
    print("  top self CPU:", "; ".join(f"{e.key[:40]} {e.self_cpu_time_total / 1e3:.3f}ms x{e.count}" for e in cpu))


PROFILE_ITERS = 10


def write_kernels(prof, path: str) -> None:
    """The profiled GPU kernels in start order as JSON: [[name, start us, duration us], ...] (all replays)."""
    kernels = sorted((e.time_range.start, e.time_range.elapsed_us(), e.name) for e in prof.events()
                     if e.device_type == torch.autograd.DeviceType.CUDA)
    with open(path, "w") as f:
        json.dump([[name, start, dur] for start, dur, name in kernels], f)


def profile_replays(replay, fb):
    """Three warm-up replays, then PROFILE_ITERS replays under the profiler."""
    with torch.inference_mode():
        for _ in range(3):
            replay(fb)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(PROFILE_ITERS):
                replay(fb)
            torch.cuda.synchronize()
    return prof


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.profile_step")
    p.add_argument("--model", default="llama-3.2-1b", choices=SHAPES)
    p.add_argument("--decode-bs", type=int, default=1)
    p.add_argument("--extend-tokens", type=int, default=128, help="0: the decode step only")
    p.add_argument("--attention-backend", default="triton")
    p.add_argument("--input-len", type=int, default=512, help="the decode requests' context (prompt) length")
    p.add_argument("--quantization", default=None, choices=("none", "fp8"), help="weight quantization")
    p.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "fp8_e4m3"), help="auto: the model dtype")
    p.add_argument("--kernels-json", help="write the decode replays' kernels in order (name, start us, duration us)")
    args = p.parse_args(argv)
    if not 1 <= args.input_len <= 4000:
        p.error(f"--input-len must be between 1 and 4000 (the profile's context is 4096), got {args.input_len}")
    cfg = RunnerConfig(model_path=str(shape_path(args.model)), device="cuda", attention_backend=args.attention_backend,
                       max_running_requests=max(64, args.decode_bs),
                       max_total_tokens=max(64 * 1024, args.decode_bs * (args.input_len + 8) + args.extend_tokens),
                       context_length=4096, random_weights=True,
                       disable_cuda_graph=True, disable_piecewise_cuda_graph=True,
                       quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype)
    runner = ModelRunner(cfg)
    decode = CudaGraphRunner(runner, [args.decode_bs])
    batches, _, _ = prepare(runner, args.decode_bs, args.input_len, 4)
    prof = profile_replays(decode.replay, batches[0])
    summarize(prof, f"decode graph bs={args.decode_bs} context {args.input_len}")
    if args.kernels_json:
        write_kernels(prof, args.kernels_json)
    if args.extend_tokens == 0:
        return 0
    extend = PiecewiseCudaGraphRunner(runner, [args.extend_tokens])
    n = args.extend_tokens
    row = runner.req_to_token_pool.alloc()
    loc = runner.allocator.alloc(n)
    runner.req_to_token_pool.write(row, 0, loc)
    fb = runner.build_batch(ForwardMode.EXTEND, list(range(100, 100 + n)), [row], [n], loc, extend_seq_lens=[n])
    summarize(profile_replays(extend.replay, fb), f"piecewise extend {n} tokens")
    whole = FullExtendGraphRunner(runner, [n], capturer=extend.capturer)
    summarize(profile_replays(whole.replay, fb), f"whole extend graph {n} tokens")
    return 0


if __name__ == "__main__":
    sys.exit(main())

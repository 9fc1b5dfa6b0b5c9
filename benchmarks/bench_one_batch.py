"""bench_one_batch: prefill + N decode steps at fixed batch sizes, eager vs CUDA graph in the same run,
against the weight-read floor (weight bytes / device-to-device bandwidth measured in the same run).

The floor counts the bytes a step really reads (step_read_bytes): every weight but the embedding table and
the MoE experts (attention, MLPs, norms, routers, the LM head); of an embedding table that the head does not
share, the rows of the batch's tokens (bs at most: a lookup reads nothing else); in each MoE layer, the
experts the batch's tokens route to: top_k of them at bs=1, and E * (1 - (1 - top_k/E)^bs) at bs (the
expected number of distinct experts under uniform routing), each expert's w13 and w2 (and biases).

    python -m benchmarks.bench_one_batch --model llama-3.2-1b --batch-size 1 32 256 --input-len 512 --json out.json
    python -m benchmarks.bench_one_batch --model llama-3.1-8b --quantization fp8 --kv-cache-dtype fp8_e4m3 ...
    python -m benchmarks.bench_one_batch --model-path /tmp/qwen3-8b-fp8-block --random-weights ...

(the last: a folder holding a shape's config.json with a block-FP8 `quantization_config` added, as the
GPU tests' block_fp8_shape fixture writes one; random weights in that checkpoint's layout)

With --quantization fp8 the floor is the FP8 weights' read time (FP8 linears and MoE experts and their
scales; the embedding, LM head and MoE routers' gates in bf16).

Graph rows time each step on its own (host launch, replay, sync: the latency a synchronous loop sees; the
"graph ms" column) and the same steps launched back to back with
one sync at the end ("b2b ms": the GPU's time per step, as the overlap scheduler keeps it busy). "host ms"
is the part of a graph step before the replay call returns (input copies and the graph launch queued): of
graph ms minus b2b ms, what the host spends launching rather than what the sync's wake-up adds.

--tp-size N runs N spawned ranks (one GPU each, NCCL; gloo on CPU), every rank timing the same batches;
rank 0 reports. The weight floor is then one rank's shard over one GPU's bandwidth.
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
from model_executor.distributed import parallel_state as ps
from model_executor.forward_batch import ForwardMode
from runners.capture_lists import get_batch_sizes_to_capture
from runners.cuda_graph_runner import CudaGraphRunner
from runners.model_runner import ModelRunner, RunnerConfig


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_one_batch",
                                description=__doc__.splitlines()[0])
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", default="llama-3.2-1b", choices=SHAPES, help="a model shape, random weights")
    src.add_argument("--model-path", help="an HF folder with real weights")
    p.add_argument("--random-weights", action="store_true",
                   help="with --model-path: random weights of the folder's config.json (e.g. one declaring a "
                        "block-FP8 quantization_config, which no shape in --model does)")
    p.add_argument("--batch-size", type=int, nargs="+", default=[1])
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=32, help="decode steps timed per mode")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--attention-backend", default="auto")
    p.add_argument("--quantization", default=None, choices=("none", "fp8", "int8"),
                   help="weight quantization (default: the checkpoint's)")
    p.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "fp8_e4m3"))
    p.add_argument("--capture-default-list", action="store_true",
                   help="also capture the default decode list (max_bs 256, the server's runner) and report its time "
                        "and memory, and each batch size's b2b ms replayed from it")
    p.add_argument("--json", dest="json_out", help="write the results here")
    p.add_argument("--tp-size", type=int, default=1, help="tensor-parallel ranks (one process and GPU each)")
    p.add_argument("--disable-custom-all-reduce", action="store_true",
                   help="with --tp-size > 1: NCCL for every sum (default: the one-shot kernel for small ones)")
    args = p.parse_args(argv)
    if args.random_weights and not args.model_path:
        p.error("--random-weights goes with --model-path (the shapes of --model always have random weights)")
    if args.tp_size < 1:
        p.error(f"--tp-size must be a positive integer, got {args.tp_size}")
    if args.device == "cuda" and torch.cuda.device_count() < args.tp_size:
        p.error(f"--tp-size {args.tp_size} needs {args.tp_size} GPUs, {torch.cuda.device_count()} are visible")
    return args


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_copy_bandwidth(device: torch.device, nbytes: int = 1 << 30, iters: int = 20) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read + written."""
    if device.type != "cuda":
        nbytes, iters = 64 << 20, 5
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    sync(device)
    t0 = time.perf_counter()
    for _ in range(iters):
        dst.copy_(src)
    sync(device)
    return 2 * nbytes * iters / (time.perf_counter() - t0)


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes a decode step reads: the parameters (a tied weight once) and quantized layers' scale buffers."""
    seen, total = set(), 0
    scales = [b for m in model.modules() if hasattr(m, "quant_method") for b in m.buffers(recurse=False)]
    for p in [*model.parameters(), *scales]:
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += p.numel() * p.element_size()
    return total


def step_read_bytes(model: torch.nn.Module, bs: int) -> int:
    """Weight bytes a decode step of bs tokens reads (see the module docstring)."""
    from model_executor.layers.embedding import ParallelLMHead, VocabParallelEmbedding
    from model_executor.layers.moe import FusedMoE
    from model_executor.models.gpt_oss import GptOssExperts

    total = weight_bytes(model)
    heads = {m.weight.data_ptr() for m in model.modules() if isinstance(m, ParallelLMHead)}
    for emb in (m for m in model.modules() if type(m) is VocabParallelEmbedding):
        if emb.weight.data_ptr() in heads:
            continue  # tied: the head reads the whole table
        table = emb.weight.numel() * emb.weight.element_size()
        total += min(bs, emb.weight.shape[0]) * (table // emb.weight.shape[0]) - table  # the tokens' rows
    for moe in (m for m in model.modules() if isinstance(m, (FusedMoE, GptOssExperts))):
        # w13 and w2 (and FP8 experts' scales, gpt-oss's biases: every tensor of the layer is indexed by expert first)
        own = (*moe.parameters(recurse=False), *moe.buffers(recurse=False))
        per_expert = sum(t.numel() * t.element_size() for t in own) // moe.num_experts
        distinct = moe.num_experts * (1 - (1 - moe.top_k / moe.num_experts) ** bs)
        total += round(distinct * per_expert) - moe.num_experts * per_expert
    return total


PREFILL_TOKENS = 16384  # the most prompt tokens prepare() puts in one extend


def prepare(runner: ModelRunner, bs: int, input_len: int, steps: int, seed: int = 0):
    """Prefill bs random prompts; return the decode batches of the next `steps` tokens (slots pre-allocated)."""
    g = torch.Generator().manual_seed(seed)
    vocab = runner.model_config.vocab_size
    rows = [runner.req_to_token_pool.alloc() for _ in range(bs)]
    loc = runner.allocator.alloc(bs * (input_len + steps))
    for i, row in enumerate(rows):
        runner.req_to_token_pool.write(row, 0, loc[i * (input_len + steps) : (i + 1) * (input_len + steps)])
    ids = torch.randint(0, vocab, (bs * input_len,), generator=g).tolist()
    # A few requests per extend (at most PREFILL_TOKENS tokens, at least one request): a large batch of long
    # prompts in one extend would need activations for all its tokens at once (bs 128 x 4k on an 8B: 30 GB).
    per_extend = max(1, PREFILL_TOKENS // input_len)
    prefill_ms = 0.0
    for first in range(0, bs, per_extend):
        group = range(first, min(bs, first + per_extend))
        prefill_loc = torch.cat([loc[i * (input_len + steps) : i * (input_len + steps) + input_len] for i in group])
        fb = runner.build_batch(ForwardMode.EXTEND, ids[first * input_len : group[-1] * input_len + input_len],
                                [rows[i] for i in group], [input_len] * len(group), prefill_loc,
                                extend_seq_lens=[input_len] * len(group))
        sync(runner.device)
        t0 = time.perf_counter()
        with torch.inference_mode():
            runner.forward_eager(fb)
        sync(runner.device)
        prefill_ms += (time.perf_counter() - t0) * 1e3
    batches = []
    for t in range(steps):
        step_loc = torch.stack([loc[i * (input_len + steps) + input_len + t] for i in range(bs)])
        tokens = torch.randint(0, vocab, (bs,), generator=g).tolist()
        batches.append(runner.build_batch(ForwardMode.DECODE, tokens, rows, [input_len + t + 1] * bs, step_loc))
    return batches, prefill_ms, (rows, loc)


def _warm_up(fn, batches, device) -> None:
    for fb in batches[:3]:
        fn(fb)
    sync(device)


def time_steps_and_launch(fn, batches, device) -> tuple[float, float]:
    """(median ms per decode step, median ms of it before fn returned) over the batches, after one warm-up
    pass: each step from the call until the sync returns, and until the call itself returns (the host's
    part: input copies and launches queued, nothing waited for)."""
    with torch.inference_mode():
        _warm_up(fn, batches, device)
        steps, launches = [], []
        for fb in batches:
            t0 = time.perf_counter()
            fn(fb)
            t1 = time.perf_counter()
            sync(device)
            launches.append((t1 - t0) * 1e3)
            steps.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(steps), statistics.median(launches)


def time_steps(fn, batches, device) -> float:
    """Median ms per decode step over the batches (after one warm-up pass)."""
    return time_steps_and_launch(fn, batches, device)[0]


def time_back_to_back(fn, batches, device) -> float:
    """Mean ms per decode step with the steps launched one after another and one sync at the end (after one
    warm-up pass): the GPU's time per step, as the overlap scheduler keeps it busy, without time_steps' host
    launch and sync between steps (which a synchronous server loop does pay)."""
    with torch.inference_mode():
        _warm_up(fn, batches, device)
        t0 = time.perf_counter()
        for fb in batches:
            fn(fb)
        sync(device)
        return (time.perf_counter() - t0) * 1e3 / len(batches)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.tp_size == 1:
        return run(args)
    import torch.multiprocessing as mp

    from server.parallel import free_port

    mp.spawn(_rank_main, args=(args, f"tcp://127.0.0.1:{free_port()}"), nprocs=args.tp_size, join=True)
    return 0


def _rank_main(rank: int, args: argparse.Namespace, init_method: str) -> None:
    run(args, rank, init_method)


def run(args: argparse.Namespace, tp_rank: int = 0, init_method: str | None = None) -> int:
    device = torch.device(f"cuda:{tp_rank}" if args.device == "cuda" else args.device)
    model_path = args.model_path or str(shape_path(args.model))
    max_bs = max(args.batch_size)
    steps = args.output_len
    cfg = RunnerConfig(model_path=model_path, device=str(device), dtype=args.dtype,
                       attention_backend=args.attention_backend, max_running_requests=max(max_bs, 256),
                       max_total_tokens=max_bs * (args.input_len + steps) + 16,
                       context_length=args.input_len + steps + 16,
                       random_weights=args.model_path is None or args.random_weights,
                       disable_cuda_graph=True, disable_piecewise_cuda_graph=True,
                       tp_rank=tp_rank, tp_size=args.tp_size, dist_init_method=init_method,
                       custom_all_reduce=not args.disable_custom_all_reduce, quantization=args.quantization,
                       kv_cache_dtype=args.kv_cache_dtype)
    runner = ModelRunner(cfg)
    bandwidth = measure_copy_bandwidth(device)
    wbytes = weight_bytes(runner.model)
    all_weights_floor_ms = wbytes / bandwidth * 1e3
    # CUDA graphs only on a GPU: the CPU stand-in re-runs Python, so its timings are not graph timings.
    graphs = device.type == "cuda"
    graph_runner = CudaGraphRunner(runner, sorted(set(args.batch_size))) if graphs else None
    default_capture, full = None, None
    if args.capture_default_list and graphs:
        sizes = get_batch_sizes_to_capture(256)
        full = CudaGraphRunner(runner, sizes)
        default_capture = {"sizes": len(sizes), "seconds": round(full.capture_seconds, 2),
                           "gib": round(full.capture_bytes / 2**30, 3)}
    results = []
    for bs in args.batch_size:
        batches, prefill_ms, (rows, loc) = prepare(runner, bs, args.input_len, steps)
        eager_ms = time_steps(runner.forward_eager, batches, device)
        read_bytes = step_read_bytes(runner.model, bs)
        floor_ms = read_bytes / bandwidth * 1e3
        row = {"batch_size": bs, "prefill_ms": round(prefill_ms, 3), "eager_ms": round(eager_ms, 4),
               "floor_bytes": read_bytes, "floor_ms": round(floor_ms, 4),
               "eager_over_floor": round(eager_ms / floor_ms, 3)}
        if graphs:
            with torch.inference_mode():
                eager_logits = runner.forward_eager(batches[0]).clone()
                graph_logits = graph_runner.replay(batches[0]).clone()
            graph_ms, host_ms = time_steps_and_launch(graph_runner.replay, batches, device)
            b2b_ms = time_back_to_back(graph_runner.replay, batches, device)
            row.update({"graph_ms": round(graph_ms, 4), "speedup": round(eager_ms / graph_ms, 3),
                        "graph_host_ms": round(host_ms, 4),
                        "graph_over_floor": round(graph_ms / floor_ms, 3), "graph_b2b_ms": round(b2b_ms, 4),
                        "graph_b2b_over_floor": round(b2b_ms / floor_ms, 3),
                        "graph_vs_eager_max_abs_diff": (eager_logits - graph_logits).abs().max().item(),
                        "greedy_tokens_equal": bool(torch.equal(eager_logits.argmax(-1), graph_logits.argmax(-1)))})
            if full is not None:  # the same steps from the server's runner (a graph among all sizes)
                row["default_list_b2b_ms"] = round(time_back_to_back(full.replay, batches, device), 4)
        results.append(row)
        runner.allocator.free(loc)
        for row in rows:
            runner.req_to_token_pool.free(row)
    del full
    if tp_rank != 0:
        return 0
    report = {
        "benchmark": "bench_one_batch", "model": args.model_path or args.model, "device": str(device),
        "tp_size": args.tp_size, "all_reduce": ps.describe_all_reduce(),
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "dtype": str(runner.dtype).replace("torch.", ""), "attention_backend": type(runner.attn_backend).__name__,
        "quantization": runner.quant.method if runner.quant else None,
        "kv_cache_dtype": str(runner.kv_dtype).replace("torch.", ""),
        "input_len": args.input_len, "decode_steps": steps, "weight_bytes": wbytes,
        "copy_bandwidth_tb_s": round(bandwidth / 1e12, 3),
        "capture_seconds": round(graph_runner.capture_seconds, 2) if graphs else None,
        "capture_gib": round(graph_runner.capture_bytes / 2**30, 3) if graphs else None,
        "default_list_capture": default_capture,
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "torch": torch.__version__,
        "results": results,
    }
    weights_kind = f"{report['quantization']} weights" if report["quantization"] else "weights"
    sums = f" (all-reduce: {report['all_reduce']})" if args.tp_size > 1 else ""
    print(f"model {report['model']} on {report['gpu']} x{args.tp_size}{sums} ({report['dtype']}, {report['attention_backend']}, "
          f"KV {report['kv_cache_dtype']}), input {args.input_len}, {steps} decode steps; {weights_kind} "
          f"{wbytes / 1e9:.3f} GB, copy bandwidth {bandwidth / 1e12:.2f} TB/s, "
          f"{'FP8 weight-read ' if report['quantization'] and 'fp8' in report['quantization'] else 'all-weights '}floor "
          f"{all_weights_floor_ms:.3f} ms"
          + ("; each row's floor counts the bytes its step reads (embedding rows, routed experts)"
             if step_read_bytes(runner.model, 1) < wbytes else ""))
    print(f"{'bs':>5} {'eager ms':>10} {'graph ms':>10} {'speedup':>8} {'floor ms':>9} {'graph/floor' if graphs else 'eager/floor':>12} "
          f"{'max|diff|':>10} {'tokens=':>7}" + (f" {'b2b ms':>8} {'b2b/floor':>10} {'host ms':>8}" if graphs else ""))
    for r in results:
        if graphs:
            print(f"{r['batch_size']:>5} {r['eager_ms']:>10.3f} {r['graph_ms']:>10.3f} {r['speedup']:>8.2f} "
                  f"{r['floor_ms']:>9.3f} {r['graph_over_floor']:>12.2f} {r['graph_vs_eager_max_abs_diff']:>10.2e} "
                  f"{r['greedy_tokens_equal']!s:>7} {r['graph_b2b_ms']:>8.3f} {r['graph_b2b_over_floor']:>10.2f} "
                  f"{r['graph_host_ms']:>8.3f}")
        else:  # no graphs on the CPU: eager against the floor
            print(f"{r['batch_size']:>5} {r['eager_ms']:>10.3f} {'-':>10} {'-':>8} {r['floor_ms']:>9.3f} "
                  f"{r['eager_over_floor']:>12.2f} {'-':>10} {'-':>7}")
    if default_capture:
        print(f"default decode list: {default_capture['sizes']} graphs captured in {default_capture['seconds']} s, "
              f"{default_capture['gib']} GiB; b2b ms from it: "
              + ", ".join(f"bs {r['batch_size']} {r['default_list_b2b_ms']:.3f}" for r in results))
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())

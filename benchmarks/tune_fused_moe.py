"""tune_fused_moe: time block-size configs of the fused MoE kernels per token count on this GPU and write the
fastest as a table (moe/tuning.py reads it at start-up: `E=..,N=..,K=..,device=<GPU>.json`).

    python -m benchmarks.tune_fused_moe --model qwen3-30b-a3b --out-dir model_executor/layers/moe/configs

Each config is timed in a CUDA graph of REPEAT calls (the align kernel, both GEMMs and the combine: what a
decode step runs), median of a few replays, on random bf16 experts and softmax-top-k routing of random
logits (uniform-ish routing, as in serving). Prints a table and writes JSON (with --json, the timings too).
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from model_executor.configs import SHAPES, shape_path
from model_executor.layers.moe import kernels
from model_executor.layers.moe.layer import select_experts
from model_executor.layers.moe.tuning import CONFIG_DIR, default_config, device_name, table_path
from model_executor.model_config import ModelConfig

DEFAULT_BS = [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256]  # decode; add extend sizes by --batch-size
REPEAT = 10


def candidates(num_tokens: int) -> list[dict]:
    """A grid pruned by batch size: small M tiles for decode batches, larger ones for extends."""
    block_ms = (16, 32) if num_tokens <= 64 else (16, 32, 64) if num_tokens <= 512 else (32, 64, 128)
    out = []
    for bm, bn, bk, (warps, stages) in itertools.product(block_ms, (32, 64, 128), (64, 128), ((4, 3), (8, 4))):
        if bm >= 128 and bn >= 128 and bk >= 128:
            continue  # over the shared-memory budget
        out.append({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 1 if num_tokens <= 64 else 8,
                    "num_warps": warps, "num_stages": stages})
    return out


def time_config(x, w13, w2, weights, ids, config, flags=(True, True)) -> float:
    """Median microseconds per fused_experts call, replayed from a CUDA graph (flags: renormalize and
    round_weights, as the model passes them)."""
    kernels.fused_experts_triton(x, w13, w2, weights, ids, *flags, config=config)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(REPEAT):
            kernels.fused_experts_triton(x, w13, w2, weights, ids, *flags, config=config)
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / REPEAT)
    del graph
    return statistics.median(times)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.tune_fused_moe", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen3-30b-a3b", choices=SHAPES, help="an MoE model shape")
    p.add_argument("--batch-size", type=int, nargs="+", default=DEFAULT_BS, help="token counts to tune")
    p.add_argument("--out-dir", default=str(CONFIG_DIR), help="where the table goes")
    p.add_argument("--json", dest="json_out", help="also write every timing here")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("tune_fused_moe needs a CUDA device", file=sys.stderr)
        return 2
    cfg = ModelConfig.from_pretrained(shape_path(args.model))
    if not cfg.num_experts:
        print(f"--model {args.model} has no experts", file=sys.stderr)
        return 2
    num_experts, inter, hidden, top_k = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size, cfg.num_experts_per_tok
    g = torch.Generator(device="cuda").manual_seed(0)
    w13 = (torch.randn(num_experts, 2 * inter, hidden, device="cuda", generator=g) * 0.02).bfloat16()
    w2 = (torch.randn(num_experts, hidden, inter, device="cuda", generator=g) * 0.02).bfloat16()
    table, timings = {}, {}
    t0 = time.perf_counter()
    print(f"{args.model}: E={num_experts} N={2 * inter} K={hidden} top_k={top_k} on {torch.cuda.get_device_name()}")
    per_expert = 3 * inter * hidden * 2
    print(f"{'tokens':>7} {'default us':>11} {'best us':>9} {'speedup':>8} {'best TB/s':>9}  best config "
          f"(TB/s: the routed experts' bytes per call / time)")
    for bs in args.batch_size:
        x = torch.randn(bs, hidden, device="cuda", generator=g).bfloat16()
        weights, ids = select_experts(torch.randn(bs, num_experts, device="cuda", generator=g), top_k, False)
        flags = (cfg.norm_topk_prob, cfg.architecture == "Qwen3MoeForCausalLM")
        default_us = time_config(x, w13, w2, weights, ids, default_config(bs), flags)
        results = []
        for config in candidates(bs):
            try:
                results.append((time_config(x, w13, w2, weights, ids, config, flags), config))
            except Exception as e:  # noqa: BLE001 (a config over the GPU's resources: skip it, say so)
                print(f"  skipped {config}: {type(e).__name__}: {str(e).splitlines()[0][:100]}")
        best_us, best = min(results, key=lambda r: r[0])
        if default_us <= best_us:
            best_us, best = default_us, default_config(bs)
        table[str(bs)] = best
        expert_bytes = torch.unique(ids).numel() * per_expert
        timings[str(bs)] = {"default_us": round(default_us, 2), "best_us": round(best_us, 2), "best": best,
                            "expert_bytes": expert_bytes, "all": [[round(us, 2), c] for us, c in results]}
        print(f"{bs:>7} {default_us:>11.1f} {best_us:>9.1f} {default_us / best_us:>8.2f} "
              f"{expert_bytes / best_us / 1e6:>9.2f}  {best}")
    dev = device_name("cuda")
    out = Path(args.out_dir) / table_path(num_experts, 2 * inter, hidden, dev).name
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(table, indent=1) + "\n")
    print(f"wrote {out} ({time.perf_counter() - t0:.0f} s)")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"model": args.model, "gpu": torch.cuda.get_device_name(),
                                                   "torch": torch.__version__, "timings": timings}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""tune_fused_moe: time block-size configs of the fused MoE kernels per token count on this GPU and write the
fastest as a table per model shape and weight dtype (moe/tuning.py reads it at start-up from
model_executor/layers/moe/configs/: `E=..,N=..,K=..,device=<GPU>[,dtype=fp8_w8].json`).

    python -m benchmarks.tune_fused_moe --model qwen3-30b-a3b mixtral-8x7b --dtype bf16 fp8 --quick --out $OUT \
        --json $OUT/tune.json
    python -m benchmarks.tune_fused_moe --install tune.json   # elsewhere: its tables into moe/configs/

--out is a folder: the tables are written there under the names tuning.py looks for (default: the configs
folder itself), so they can be copied into model_executor/layers/moe/configs/ and committed. --quick
tunes fewer token counts on a smaller grid (a few minutes per model on an H200, compiles included).

Each config is timed in a CUDA graph of REPEAT calls (the align kernel, both GEMMs and the combine: what a
decode step runs), median of a few replays, on random experts (bf16, or FP8 with per-row scales as
--quantization fp8 loads them) and softmax-top-k routing of random logits (uniform-ish routing, as in
serving). Prints a table and writes the tables (with --json, also one JSON file of the tables and timings).
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
from model_executor.layers.moe.router import select_experts
from model_executor.layers.moe.tuning import CONFIG_DIR, default_config, device_name, table_path
from model_executor.layers.quantization.fp8_math import quantize_fp8_per_channel
from model_executor.model_config import ModelConfig

DEFAULT_BS = [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256]  # decode; add extend sizes by --batch-size
QUICK_BS = [1, 2, 4, 8, 16, 32, 64, 128, 256]
REPEAT = 10
DEVICE = "cuda"  # (a CPU test swaps it, with a stand-in for time_config)
SMEM_BUDGET = 227 * 1024  # an H100/H200 block's shared memory (a config over it fails to compile: skipped)
DTYPES = {"bf16": None, "fp8": "fp8_w8"}  # --dtype -> the table's dtype key (tuning.table_path)


def candidates(num_tokens: int, quick: bool = False) -> list[dict]:
    """A grid pruned by batch size: small M tiles for decode batches, larger ones for extends. quick: the
    part of it that wins at decode sizes on Hopper (wide N and K tiles stream the weights), fewer compiles."""
    if quick:
        block_ms = (16,) if num_tokens <= 32 else (16, 32) if num_tokens <= 128 else (32, 64)
        grid = itertools.product(block_ms, (32, 64, 128), (64, 128, 256), ((4, 3),))
    else:
        block_ms = (16, 32) if num_tokens <= 64 else (16, 32, 64) if num_tokens <= 512 else (32, 64, 128)
        grid = itertools.product(block_ms, (32, 64, 128), (64, 128, 256), ((4, 3), (4, 4), (8, 4)))
    out = []
    for bm, bn, bk, (warps, stages) in grid:
        if stages * (bm * bk + 2 * bk * bn) * 2 > SMEM_BUDGET:
            continue  # the gated GEMM's A tile and two B tiles per stage would not fit (compiling it fails)
        # GROUP_M only orders the programs (few M blocks at decode sizes); quick keeps fewer distinct compiles
        group_m = (8 if bm >= 64 else 1) if quick else (1 if num_tokens <= 64 else 8)
        out.append({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": group_m,
                    "num_warps": warps, "num_stages": stages})
    return out


def time_config(x, w13, w2, weights, ids, config, flags=(False, True), scales=(None, None)) -> float:
    """Median microseconds per fused_experts call, replayed from a CUDA graph (flags: renormalize and
    round_weights, as the model passes them; scales: FP8 weights' per-row scales)."""
    def call():
        kernels.fused_experts_triton(x, w13, w2, weights, ids, *flags, config=config, w13_scale=scales[0],
                                     w2_scale=scales[1])

    call()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(REPEAT):
            call()
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


def tune(model: str, dtype: str, batch_sizes: list[int], quick: bool, out_dir: Path,
         deadline: float = float("inf")) -> dict:
    """Tune one model shape and weight dtype; write its table into out_dir; return the timings. Past
    `deadline` (time.perf_counter) no further token count starts: the table holds those done (a lookup takes
    the nearest one), and says so."""
    cfg = ModelConfig.from_pretrained(shape_path(model))
    num_experts, inter, hidden = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
    top_k = cfg.num_experts_per_tok
    g = torch.Generator(device=DEVICE).manual_seed(0)
    w13 = (torch.randn(num_experts, 2 * inter, hidden, device=DEVICE, generator=g) * 0.02).bfloat16()
    w2 = (torch.randn(num_experts, hidden, inter, device=DEVICE, generator=g) * 0.02).bfloat16()
    scales = (None, None)
    if dtype == "fp8":  # quantized per row, expert by expert (as the online loader does)
        w13, s13 = quantize_experts(w13)
        w2, s2 = quantize_experts(w2)
        scales = (s13, s2)
    table, timings = {}, {}
    t0 = time.perf_counter()
    print(f"{model} {dtype}: E={num_experts} N={2 * inter} K={hidden} top_k={top_k} on {device_name(DEVICE)}")
    per_expert = 3 * inter * hidden * w13.element_size()
    print(f"{'tokens':>7} {'default us':>11} {'best us':>9} {'speedup':>8} {'best TB/s':>9} {'elapsed s':>9}  best "
          f"config (TB/s: the routed experts' bytes per call / time)")
    # As the model calls it: the router renormalises, the GEMM rounds Qwen3-MoE's weights to bf16.
    flags = (False, cfg.architecture == "Qwen3MoeForCausalLM")
    for bs in batch_sizes:
        if time.perf_counter() > deadline:
            print(f"time limit: stopped before {bs} tokens; the table holds {', '.join(table)} only")
            break
        x = torch.randn(bs, hidden, device=DEVICE, generator=g).bfloat16()
        logits = torch.randn(bs, num_experts, device=DEVICE, generator=g)
        weights, ids = select_experts(logits, top_k, cfg.norm_topk_prob)
        default_us = time_config(x, w13, w2, weights, ids, default_config(bs), flags, scales)
        results = []
        for config in candidates(bs, quick):
            try:
                results.append((time_config(x, w13, w2, weights, ids, config, flags, scales), config))
            except Exception as e:  # noqa: BLE001 (a config over the GPU's resources: skip it, say so)
                print(f"  skipped {config}: {type(e).__name__}: {str(e).splitlines()[0][:100]}")
        best_us, best = min(results, key=lambda r: r[0]) if results else (default_us, default_config(bs))
        if default_us <= best_us:
            best_us, best = default_us, default_config(bs)
        table[str(bs)] = best
        expert_bytes = torch.unique(ids).numel() * per_expert
        timings[str(bs)] = {"default_us": round(default_us, 2), "best_us": round(best_us, 2), "best": best,
                            "expert_bytes": expert_bytes, "all": [[round(us, 2), c] for us, c in results]}
        print(f"{bs:>7} {default_us:>11.1f} {best_us:>9.1f} {default_us / best_us:>8.2f} "
              f"{expert_bytes / best_us / 1e6:>9.2f} {time.perf_counter() - t0:>9.0f}  {best}")
    name = table_path(num_experts, 2 * inter, hidden, device_name(DEVICE), DTYPES[dtype]).name
    out = out_dir / name
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(table, indent=1) + "\n")
    print(f"wrote {out} ({time.perf_counter() - t0:.0f} s)")
    return {"table_name": name, "table": table, "timings": timings}


def quantize_experts(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    pairs = [quantize_fp8_per_channel(e) for e in w]
    return torch.stack([q for q, _ in pairs]), torch.stack([s for _, s in pairs])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.tune_fused_moe", description=__doc__.splitlines()[0])
    p.add_argument("--model", nargs="+", default=["qwen3-30b-a3b"], choices=SHAPES, help="MoE model shapes")
    p.add_argument("--dtype", nargs="+", default=["bf16"], choices=list(DTYPES),
                   help="expert weight dtypes to tune (fp8: the FP8 weight-only experts of --quantization fp8)")
    p.add_argument("--batch-size", type=int, nargs="+", help="token counts to tune (default: decode sizes 1..256)")
    p.add_argument("--quick", action="store_true", help="fewer token counts, a smaller grid")
    p.add_argument("--out", "--out-dir", dest="out", default=str(CONFIG_DIR),
                   help="folder the tables are written to (under the names moe/tuning.py reads)")
    p.add_argument("--json", dest="json_out", help="also write the tables and every timing here")
    p.add_argument("--install", metavar="JSON", help="write the tables of a --json file into --out and exit (no "
                   "GPU needed: for a file brought back from the GPU host, whose table names may not travel)")
    p.add_argument("--time-limit-s", type=float, default=float("inf"),
                   help="start no token count after this many seconds (tables keep what is done)")
    args = p.parse_args(argv)
    if args.install:
        return install(Path(args.install), Path(args.out))
    if not torch.cuda.is_available():
        print("tune_fused_moe needs a CUDA device", file=sys.stderr)
        return 2
    for model in args.model:
        if not ModelConfig.from_pretrained(shape_path(model)).num_experts:
            print(f"--model {model} has no experts", file=sys.stderr)
            return 2
    batch_sizes = args.batch_size or (QUICK_BS if args.quick else DEFAULT_BS)
    results = {}
    deadline = time.perf_counter() + args.time_limit_s
    for model in args.model:
        for dtype in args.dtype:
            results[f"{model}/{dtype}"] = tune(model, dtype, batch_sizes, args.quick, Path(args.out), deadline)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"gpu": device_name(DEVICE), "torch": torch.__version__,
                                                   "quick": args.quick, "results": results}, indent=1))
    return 0


def install(json_file: Path, out_dir: Path) -> int:
    try:
        results = json.loads(json_file.read_text())["results"]
    except (OSError, ValueError, KeyError) as e:
        print(f"--install {json_file}: not a tune_fused_moe --json file ({type(e).__name__}: {e})", file=sys.stderr)
        return 2
    out_dir.mkdir(parents=True, exist_ok=True)
    for result in results.values():
        name = result["table_name"]
        if "/" in name or not name.startswith("E="):
            print(f"--install {json_file}: unexpected table name {name!r}", file=sys.stderr)
            return 2
        (out_dir / name).write_text(json.dumps(result["table"], indent=1) + "\n")
        print(f"wrote {out_dir / name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""tune_fused_moe: time block-size configs of the fused MoE kernels per token count on this GPU and write the
fastest as a table per model shape and weight dtype (moe/tuning.py reads it at start-up from
model_executor/layers/moe/configs/: `E=..,N=..,K=..,device=<GPU>[,dtype=fp8_w8].json`).

    python -m benchmarks.tuning.tune_fused_moe --model qwen3-30b-a3b mixtral-8x7b --dtype bf16 fp8 --quick \\
        --out $OUT --json $OUT/tune.json
    python -m benchmarks.tuning.tune_fused_moe --install tune.json   # elsewhere: its tables into moe/configs/

--out is a folder: the tables are written there under the names tuning.py looks for (default: the configs
folder itself), so they can be copied into model_executor/layers/moe/configs/ and committed. --quick
tunes fewer token counts on a smaller grid (a few minutes per model on an H200, compiles included).

Each config is timed in a CUDA graph of REPEAT calls (the align kernel, both GEMMs and the combine: what a
decode step runs), median of a few replays, on random experts (bf16, or FP8 with per-row scales as
--quantization fp8 loads them) and softmax-top-k routing of random logits (uniform-ish routing, as in
serving). The calls cycle over LAYERS copies of the experts, so each call reads its weights cold from HBM
as a decode step does (one layer's routed experts fit in L2 at small batches; four layers' do not). Prints a
table and writes the tables (with --json, also one JSON file of the tables and timings).

Up to tuning.SMALL_BATCH_MAX_TOKENS tokens the small-batch path (moe/small_batch.py) is tuned too (its
gate-up kernel's tiles, then its down kernel's) and the table entry records the faster path ("path") and the
small kernels' best config ("small_batch"), which fused_experts_triton then follows.

    python -m benchmarks.tuning.tune_fused_moe --model qwen3-30b-a3b --compare-paths --json $OUT/paths.json

--compare-paths tunes nothing: it times one MoE layer (router GEMM, top-k kernel, experts) on both paths
with the configs the installed tables (else the defaults) give, at --batch-size (default 1..16), and
prints the ratio to the floor of the experts' bytes at the measured copy bandwidth.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from model_executor.configs import SHAPES, shape_path
from model_executor.layers.moe import kernels
from model_executor.layers.moe.router import select_experts
from model_executor.layers.moe.tuning import (
    CONFIG_DIR,
    SMALL_BATCH_MAX_TOKENS,
    default_config,
    default_small_config,
    device_name,
    get_config,
    get_small_config,
    table_path,
)
from model_executor.layers.quantization.fp8_math import quantize_fp8_per_channel
from model_executor.model_config import ModelConfig

DEFAULT_BS = [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256]  # decode; add extend sizes by --batch-size
QUICK_BS = [1, 2, 4, 8, 16, 32, 64, 128, 256]
REPEAT = 12
LAYERS = 4  # copies of the experts the timed calls cycle over (cold weights)
COMPARE_BS = list(range(1, SMALL_BATCH_MAX_TOKENS + 1))
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


def small_candidates(top_k: int, quick: bool = False) -> tuple[list[dict], list[dict]]:
    """The small-batch kernels' tiles, each kernel's apart (tune() times the gate-up ones with the default
    down tiles, then the down ones with the best gate-up tiles), at most 64 float32 accumulators a thread
    (the gate-up kernel holds two [BLOCK_N, BLOCK_K] tiles, the down kernel one [k, BLOCK_N, BLOCK_K])."""
    if quick:
        up_n, up_k, down_n, down_k, warps, stages = (8, 16, 32), (256, 512), (2, 4, 8), (128, 256), (4, 8), (1, 3)
    else:
        up_n, up_k, down_n, down_k, warps, stages = ((8, 16, 32, 64), (128, 256, 512), (2, 4, 8, 16), (64, 128, 256, 512),
                                                     (2, 4, 8), (1, 2, 3))
    k_p2 = 1 << (top_k - 1).bit_length()
    gate_up = [{"BLOCK_N": n, "BLOCK_K": k, "num_warps": w, "num_stages": s}
               for n, k, w, s in itertools.product(up_n, up_k, warps, stages) if 2 * n * k // (32 * w) <= 64]
    down = [{"DOWN_BLOCK_N": n, "DOWN_BLOCK_K": k, "down_num_warps": w, "down_num_stages": s}
            for n, k, w, s in itertools.product(down_n, down_k, warps, stages) if k_p2 * n * k // (32 * w) <= 64]
    return gate_up, down


@dataclass
class Experts:
    """One layer's experts (and its router gate, for --compare-paths)."""

    w13: torch.Tensor
    w2: torch.Tensor
    w13_scale: torch.Tensor | None = None
    w2_scale: torch.Tensor | None = None
    gate: torch.Tensor | None = None


def time_config(x, layers: list[Experts], weights, ids, config, flags=(False, True), path="grouped") -> float:
    """Median microseconds per fused_experts call, replayed from a CUDA graph of REPEAT calls cycling over
    `layers` (flags: renormalize and round_weights, as the model passes them; path: which kernels)."""
    def call(layer: Experts):
        kernels.fused_experts_triton(x, layer.w13, layer.w2, weights, ids, *flags, config=config,
                                     w13_scale=layer.w13_scale, w2_scale=layer.w2_scale, path=path)

    return time_graph(call, layers)


def time_graph(call, layers: list[Experts]) -> float:
    call(layers[0])  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(REPEAT):
            call(layers[i % len(layers)])
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
    layers = random_layers(cfg, dtype, g)
    w13 = layers[0].w13
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
        default_us = time_config(x, layers, weights, ids, default_config(bs), flags)
        results = []
        for config in candidates(bs, quick):
            timed = _try_time(x, layers, weights, ids, config, flags, "grouped")
            if timed is not None:
                results.append((timed, config))
        best_us, best = min(results, key=lambda r: r[0]) if results else (default_us, default_config(bs))
        if default_us <= best_us:
            best_us, best = default_us, default_config(bs)
        table[str(bs)] = dict(best)
        expert_bytes = torch.unique(ids).numel() * per_expert
        timings[str(bs)] = {"default_us": round(default_us, 2), "best_us": round(best_us, 2), "best": best,
                            "expert_bytes": expert_bytes, "all": [[round(us, 2), c] for us, c in results]}
        print(f"{bs:>7} {default_us:>11.1f} {best_us:>9.1f} {default_us / best_us:>8.2f} "
              f"{expert_bytes / best_us / 1e6:>9.2f} {time.perf_counter() - t0:>9.0f}  {best}")
        if bs <= SMALL_BATCH_MAX_TOKENS:
            small_us, small, small_all = tune_small_batch(x, layers, weights, ids, flags, quick)
            path = "small_batch" if small_us < best_us else "grouped"
            table[str(bs)].update(path=path, small_batch=small)
            timings[str(bs)].update(small_batch_us=round(small_us, 2), small_batch=small, path=path,
                                    small_batch_all=small_all)
            print(f"{'':>7} {'small-batch':>11} {small_us:>9.1f} {best_us / small_us:>8.2f} "
                  f"{expert_bytes / small_us / 1e6:>9.2f} {time.perf_counter() - t0:>9.0f}  {small} -> {path}")
    name = table_path(num_experts, 2 * inter, hidden, device_name(DEVICE), DTYPES[dtype]).name
    out = out_dir / name
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(table, indent=1) + "\n")
    print(f"wrote {out} ({time.perf_counter() - t0:.0f} s)")
    return {"table_name": name, "table": table, "timings": timings}


def _try_time(x, layers, weights, ids, config, flags, path) -> float | None:
    try:
        return time_config(x, layers, weights, ids, config, flags, path)
    except Exception as e:  # noqa: BLE001 (a config over the GPU's resources: skip it, say so)
        print(f"  skipped {config}: {type(e).__name__}: {str(e).splitlines()[0][:100]}")
        return None


def tune_small_batch(x, layers, weights, ids, flags, quick: bool) -> tuple[float, dict, list]:
    """The small-batch kernels' fastest tiles: the gate-up kernel's with the default down tiles, then the
    down kernel's with those. Returns (microseconds, config, every timing)."""
    best = default_small_config(x.shape[0])
    best_us = time_config(x, layers, weights, ids, best, flags, "small_batch")
    timed = [[round(best_us, 2), best]]
    for part in small_candidates(ids.shape[1], quick):
        for tiles in part:
            config = dict(best, **tiles)
            us = _try_time(x, layers, weights, ids, config, flags, "small_batch")
            if us is not None:
                timed.append([round(us, 2), config])
                if us < best_us:
                    best_us, best = us, config
    return best_us, best, timed


def random_layers(cfg: ModelConfig, dtype: str, g: torch.Generator, with_gate: bool = False) -> list[Experts]:
    """LAYERS copies of random experts (std 0.02) in bf16, or FP8 quantized per row as the online loader
    does; with_gate: each with a random router gate [E, H] in bf16."""
    e, i, h = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
    layers = []
    for _ in range(LAYERS):
        w13 = (torch.randn(e, 2 * i, h, device=DEVICE, generator=g) * 0.02).bfloat16()
        w2 = (torch.randn(e, h, i, device=DEVICE, generator=g) * 0.02).bfloat16()
        layer = Experts(w13, w2)
        if dtype == "fp8":
            (layer.w13, layer.w13_scale), (layer.w2, layer.w2_scale) = quantize_experts(w13), quantize_experts(w2)
        if with_gate:
            layer.gate = (torch.randn(e, h, device=DEVICE, generator=g) * 0.02).bfloat16()
        layers.append(layer)
    return layers


def compare_paths(model: str, dtype: str, batch_sizes: list[int]) -> dict:
    """One MoE layer (router GEMM, top-k kernel, experts) on each path, with the configs the installed
    tables (else the defaults) give; the floor: the routed experts' bytes at the copy bandwidth."""
    from benchmarks.bench_one_batch import measure_copy_bandwidth

    cfg = ModelConfig.from_pretrained(shape_path(model))
    e, i, h, top_k = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size, cfg.num_experts_per_tok
    g = torch.Generator(device=DEVICE).manual_seed(0)
    layers = random_layers(cfg, dtype, g, with_gate=True)
    bandwidth = measure_copy_bandwidth(torch.device(DEVICE))
    per_expert = 3 * i * h * layers[0].w13.element_size()
    round_weights = cfg.architecture == "Qwen3MoeForCausalLM"
    table_dtype = DTYPES[dtype]
    print(f"{model} {dtype}: one MoE layer (router + top-k + experts), E={e} N={2 * i} K={h} top_k={top_k}, "
          f"copy bandwidth {bandwidth / 1e12:.2f} TB/s, {LAYERS} layers' weights cycled (cold)")
    print(f"{'tokens':>7} {'grouped us':>11} {'small us':>9} {'speedup':>8} {'floor us':>9} {'small/floor':>11}")
    rows = {}
    for bs in batch_sizes:
        x = torch.randn(bs, h, device=DEVICE, generator=g).bfloat16()
        configs = {"grouped": get_config(e, 2 * i, h, bs, DEVICE, table_dtype),
                   "small_batch": get_small_config(e, 2 * i, h, bs, DEVICE, table_dtype)}
        us = {}
        for path, config in configs.items():
            def call(layer: Experts, x=x, path=path, config=config):
                weights, ids = select_experts(F.linear(x, layer.gate), top_k, cfg.norm_topk_prob)
                kernels.fused_experts_triton(x, layer.w13, layer.w2, weights, ids, False, round_weights,
                                             config=config, w13_scale=layer.w13_scale, w2_scale=layer.w2_scale,
                                             path=path)

            us[path] = time_graph(call, layers)
        ids = select_experts(F.linear(x, layers[0].gate), top_k, cfg.norm_topk_prob)[1]
        expert_bytes = torch.unique(ids).numel() * per_expert
        floor_us = expert_bytes / bandwidth * 1e6
        rows[str(bs)] = {"grouped_us": round(us["grouped"], 2), "small_batch_us": round(us["small_batch"], 2),
                         "floor_us": round(floor_us, 4), "expert_bytes": expert_bytes, "configs": configs}
        print(f"{bs:>7} {us['grouped']:>11.1f} {us['small_batch']:>9.1f} {us['grouped'] / us['small_batch']:>8.2f} "
              f"{floor_us:>9.1f} {us['small_batch'] / floor_us:>11.2f}")
    return {"copy_bandwidth": bandwidth, "rows": rows}


def quantize_experts(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    pairs = [quantize_fp8_per_channel(e) for e in w]
    return torch.stack([q for q, _ in pairs]), torch.stack([s for _, s in pairs])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.tuning.tune_fused_moe",
                                description=__doc__.splitlines()[0])
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
    p.add_argument("--compare-paths", action="store_true", help="tune nothing: time one MoE layer on the "
                   "small-batch and the grouped path at --batch-size (default 1..16) with the installed tables")
    p.add_argument("--time-limit-s", type=float, default=float("inf"),
                   help="start no token count after this many seconds (tables keep what is done)")
    args = p.parse_args(argv)
    if args.compare_paths and args.install:
        p.error("--compare-paths and --install do not go together")
    if args.install:
        return install(Path(args.install), Path(args.out))
    if not torch.cuda.is_available():
        print("tune_fused_moe needs a CUDA device", file=sys.stderr)
        return 2
    for model in args.model:
        if not ModelConfig.from_pretrained(shape_path(model)).num_experts:
            print(f"--model {model} has no experts", file=sys.stderr)
            return 2
    if args.compare_paths:
        results = {f"{m}/{d}": compare_paths(m, d, args.batch_size or COMPARE_BS) for m in args.model
                   for d in args.dtype}
        if args.json_out:
            Path(args.json_out).write_text(json.dumps({"gpu": device_name(DEVICE), "torch": torch.__version__,
                                                       "compare_paths": results}, indent=1))
        return 0
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

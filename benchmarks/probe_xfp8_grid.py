"""probe_xfp8_grid: the X_FP8 small-M GEMM's configs at 2-64 rows over a joint grid, per row count (issue 18)

Until the twenty-seventh session the tuner (tune_small_m_gemm) searched X_FP8 greedily at every row count:
column x K tiles at about two programs an SM with 4 warps and 4 stages, then the split count of the best tile,
then warps / stages of the best of those. At 32-64 rows its picks for Llama-3.1-8B FP8 ran at 1.3-3.4x their
weights' read (4096 x 4096 at 64 rows: 13.1 us against 3.9). This probe times every config of the joint grid
(tune_small_m_gemm.xfp8_joint_grid: tiles x splits x warps x stages, which the tuner now searches too) for
each (N, K) of a model's linear layers at each row count given, not only at the buckets' own, next to the
table's entry, on cold weights in one CUDA graph (tune_small_m_gemm.time_config), and prints the best few. The
kernels compile first in parallel worker processes (Triton's disk cache then serves the timing process).

    python -m benchmarks.probe_xfp8_grid --m 24 32 40 48 56 64 --json out.json --table-out table.json
    python -m benchmarks.probe_xfp8_grid --model qwen3-8b --kind fp8_block --table-out table.json

--table-out writes the server's table with each timed bucket's entry replaced by the probe's choice where that is
faster than the entry by --margin (for an A/B of the step; the server reads only its own file). A bucket serves
every row count up to it from the one below, so the choice is the config with the least mean, over the bucket's
timed row counts, of its time over that row count's fastest.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import torch

from benchmarks.tune_small_m_gemm import (
    BLOCK,
    Weights,
    linear_shapes,
    precompile_xfp8,
    time_config,
    xfp8_calls,
    xfp8_joint_grid,
)
from model_executor.configs import SHAPES, shape_path
from model_executor.model_config import ModelConfig


def bucket_choice(by_m: dict) -> tuple:
    """(config, its score, the table entry's score) for one M bucket: the config with the least mean over the
    bucket's timed row counts of its time over that row count's best (a bucket serves all of them)."""
    rel = {c: sum(times[c] / min(times.values()) for times, _ in by_m.values()) / len(by_m)
           for c in next(iter(by_m.values()))[0]}
    best = min(rel, key=rel.get)
    table = sum(table_us / min(times.values()) for times, table_us in by_m.values()) / len(by_m)
    return best, rel[best], table


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.probe_xfp8_grid", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="llama-3.1-8b", choices=SHAPES)
    p.add_argument("--kind", default="fp8", choices=("fp8", "fp8_block"),
                   help="weight scales: per output channel, or per 128 x 128 block")
    p.add_argument("--m", type=int, nargs="+", default=[24, 32, 40, 48, 56, 64],
                   help="row counts (2-64; up to 16 the dot pads them to 16)")
    p.add_argument("--workers", type=int, default=12, help="compile processes")
    p.add_argument("--top", type=int, default=4, help="configs printed per case")
    p.add_argument("--margin", type=float, default=0.97, help="--table-out: replace an entry below this ratio")
    p.add_argument("--json", dest="json_out")
    p.add_argument("--table-out")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("probe_xfp8_grid needs a CUDA device", file=sys.stderr)
        return 2
    from model_executor.layers.quantization import fp8_ops
    from model_executor.layers.triton_ops import small_m_gemm as sm
    from model_executor.layers.triton_ops import small_m_gemm_config as smc

    if any(not 1 < m <= sm.MAX_M_FP8 for m in args.m):
        p.error(f"--m: row counts from 2 up to {sm.MAX_M_FP8}")
    cfg = ModelConfig.from_pretrained(shape_path(args.model))
    shapes = sorted(set(linear_shapes(cfg, 1).values()))
    dev = sm.device_name("cuda")
    buckets = sorted({sm.m_bucket(m) for m in args.m})
    block = BLOCK if args.kind == "fp8_block" else None
    precompile_xfp8([(c, b, n, k, block) for b in buckets for n, k in shapes for c in xfp8_joint_grid(k, args.kind)],
                    args.workers)

    gen = torch.Generator(device="cuda").manual_seed(0)
    print(f"{'N':>6} {'K':>6} {'M':>3} {'read us':>8} {'table us':>9} {'best us':>8} {'best/table':>10}  best configs "
          "(BLOCK_N, BLOCK_K, SPLIT_K, warps, stages: us)")
    results, best_of = [], {}
    for n, k in shapes:
        wts = Weights(args.kind, n, k, gen)
        grid = xfp8_joint_grid(k, args.kind)
        by_m = {}  # m -> ({config: us}, the table entry's us)
        for m in args.m:
            x = torch.randn(m, k, device="cuda", generator=gen).bfloat16()
            act = fp8_ops.per_token_group_quant_fp8(x, k if block is None else block[1])

            def measure(c, act=act, wts=wts):
                return time_config(lambda: xfp8_calls(sm, act, wts, c), c)

            if m == args.m[0]:  # a throwaway first timing of each weight set: it ran 5-10% slow on the largest
                # ones (twenty-eighth session: gate/up's table entry 36.93 us first, 33.49 in the grid after it)
                measure(grid[0])
            table_cfg = (sm.tuned_configs(dev, args.kind, n, k) or {}).get(sm.m_bucket(m))
            table_us = measure(table_cfg) if table_cfg is not None and table_cfg.X_FP8 else float("nan")
            timed = sorted(((measure(c), c) for c in grid), key=lambda r: r[0])
            by_m[m] = ({c: us for us, c in timed}, table_us)
            best_us, best = timed[0]
            read_us = wts.bytes / 4.25e6  # (at the H200's measured copy bandwidth)
            tops = "; ".join(f"{c.BLOCK_N},{c.BLOCK_K},{c.SPLIT_K},{c.num_warps},{c.num_stages}: {us:.2f}"
                             for us, c in timed[:args.top])
            print(f"{n:>6} {k:>6} {m:>3} {read_us:>8.2f} {table_us:>9.2f} {best_us:>8.2f} {best_us / table_us:>10.3f}  {tops}",
                  flush=True)
            results.append({"n": n, "k": k, "m": m, "read_us": round(read_us, 2), "table_us": round(table_us, 2),
                            "table": None if table_cfg is None else dataclasses.asdict(table_cfg),
                            "timed": [[round(us, 2), dataclasses.asdict(c)] for us, c in timed]})
        for bucket in sorted({sm.m_bucket(m) for m in by_m}):
            best, score, table_score = bucket_choice({m: v for m, v in by_m.items() if sm.m_bucket(m) == bucket})
            print(f"{n:>6} {k:>6} bucket {bucket}: {best} at {score:.3f}x the best of each row count, the table's "
                  f"entry {table_score:.3f}x")
            if score < args.margin * table_score:
                best_of[(n, k, bucket)] = best
        del wts
        torch.cuda.empty_cache()
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "model": args.model,
                                                   "kind": args.kind, "results": results}, indent=1))
    if args.table_out:
        table = json.loads(smc.table_path(dev).read_text())
        for (n, k, b), c in best_of.items():
            table[args.kind].setdefault(f"{n},{k}", {})[str(b)] = sm.config_to_json(c, args.kind)
        Path(args.table_out).write_text(json.dumps(table, indent=1) + "\n")
        print(f"wrote {args.table_out}: {len(best_of)} entries replaced")
    return 0


if __name__ == "__main__":
    sys.exit(main())

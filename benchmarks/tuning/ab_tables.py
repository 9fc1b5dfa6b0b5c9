"""ab_tables: the decode step with each of several small-M GEMM config tables, in one process, the tables
alternating round by round: b2b ms per table and batch size, their medians, and the change against the first.

    python -m benchmarks.tuning.ab_tables --model llama-3.2-1b --batch-size 1 2 3 4 --rounds 2 \\
        --tables model_executor/layers/triton_ops/configs/small_m_gemm_NVIDIA_H200.json new.json --json out.json

A table change is kept on the step's time, not on the tuner's per-kernel times: the two can disagree by more
than the gaps between the tuner's top configs (docs/benchmarks.md). The model is loaded and each batch size
prefilled once; every (round, table) then points the table loader at that file and captures fresh decode graphs
(a graph bakes in the kernels and configs the table chooses), checks the graph against eager on the first step,
and times the steps back to back as bench_one_batch's "b2b ms" does. On a CPU the steps run eagerly and no table
is read (the small-M kernel is CUDA's): that checks the plumbing only.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
from collections.abc import Iterator
from datetime import datetime, timezone
from pathlib import Path

import torch

from benchmarks.bench_one_batch import prepare, time_back_to_back
from model_executor.configs import SHAPES, shape_path
from runners.cuda_graph_runner import CudaGraphRunner
from runners.model_runner import ModelRunner, RunnerConfig


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.tuning.ab_tables",
                                description=__doc__.splitlines()[0])
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", default="llama-3.2-1b", choices=SHAPES, help="a model shape, random weights")
    src.add_argument("--model-path", help="an HF folder (its weights)")
    p.add_argument("--tables", nargs="+", required=True, help="two or more table files; the first is the baseline")
    p.add_argument("--batch-size", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=32, help="decode steps timed per (round, table, batch size)")
    p.add_argument("--rounds", type=int, default=2, help="passes over the tables, in the same order each time")
    p.add_argument("--quantization", default=None, choices=("none", "fp8", "int8"))
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--json", dest="json_out", help="write the results here")
    args = p.parse_args(argv)
    if len(args.tables) < 2:
        p.error(f"--tables needs two or more files to compare, got {len(args.tables)}")
    for table in args.tables:
        try:
            content = json.loads(Path(table).read_text())
        except (OSError, ValueError) as e:
            p.error(f"--tables: {table} is not a readable JSON table ({type(e).__name__})")
        if not isinstance(content, dict):
            p.error(f"--tables: {table} is not a small-M config table (a JSON object)")
    if args.rounds < 1 or min(args.batch_size) < 1:
        p.error("--rounds and --batch-size must be positive")
    return args


@contextlib.contextmanager
def table_in_use(path: str | Path) -> Iterator[None]:
    """While active, the small-M kernel reads its configs from `path`, whatever the device (the loader's caches
    cleared on entry and exit)."""
    from model_executor.layers.triton_ops import small_m_gemm_config as smc

    saved = smc.table_path
    smc.table_path = lambda device: Path(path)
    smc.forget_tables()
    try:
        yield
    finally:
        smc.table_path = saved
        smc.forget_tables()


def summarize(rows: list[dict], tables: list[str]) -> list[dict]:
    """Per (table, batch size): every round's b2b ms, the median, and its change against the first table's."""
    out = []
    for bs in sorted({r["batch_size"] for r in rows}):
        base = None
        for table in tables:
            runs = [r["b2b_ms"] for r in rows if r["table"] == table and r["batch_size"] == bs]
            median = statistics.median(runs)
            base = median if base is None else base
            out.append({"table": table, "batch_size": bs, "b2b_ms": runs, "median_ms": round(median, 4),
                        "change": round(median / base - 1, 4)})
    return out


def run(args: argparse.Namespace) -> dict:
    device = torch.device(args.device)
    steps, sizes = args.output_len, sorted(set(args.batch_size))
    runner = ModelRunner(RunnerConfig(
        model_path=args.model_path or str(shape_path(args.model)), device=str(device),
        max_running_requests=max(sum(sizes), 8), max_total_tokens=sum(sizes) * (args.input_len + steps) + 16,
        context_length=args.input_len + steps + 16, random_weights=args.model_path is None,
        disable_cuda_graph=True, disable_piecewise_cuda_graph=True, quantization=args.quantization))
    batches = {bs: prepare(runner, bs, args.input_len, steps, seed=bs)[0] for bs in sizes}
    graphs_on = device.type == "cuda"  # (a CPU stand-in graph re-runs Python: no graph timing there)
    rows = []
    for rnd in range(args.rounds):
        for table in args.tables:
            with table_in_use(table):
                graphs = CudaGraphRunner(runner, sizes) if graphs_on else None
                step = graphs.replay if graphs_on else runner.forward_eager
                for bs in sizes:
                    with torch.inference_mode():
                        eager = runner.forward_eager(batches[bs][0]).float()
                        diff = (step(batches[bs][0]).float() - eager).abs().max().item()
                    b2b = time_back_to_back(step, batches[bs], device)
                    rows.append({"round": rnd, "table": table, "batch_size": bs, "b2b_ms": round(b2b, 4),
                                 "graph_vs_eager_max_abs_diff": diff})
                    print(f"round {rnd} {Path(table).name:>40} bs {bs:>3}: {b2b:.3f} ms "
                          f"(graph vs eager {diff:.1e})", flush=True)
                del graphs
                if graphs_on:
                    torch.cuda.empty_cache()
    summary = summarize(rows, args.tables)
    print(f"{'table':>40} {'bs':>4} {'median ms':>10} {'vs first':>9}  rounds")
    for s in summary:
        print(f"{Path(s['table']).name:>40} {s['batch_size']:>4} {s['median_ms']:>10.3f} {s['change']:>+8.1%}  "
              + ", ".join(f"{v:.3f}" for v in s["b2b_ms"]))
    return {"benchmark": "ab_tables", "model": args.model_path or args.model, "device": str(device),
            "gpu": torch.cuda.get_device_name(device) if graphs_on else "cpu", "graphs": graphs_on,
            "quantization": args.quantization, "input_len": args.input_len, "decode_steps": steps,
            "tables": args.tables, "rounds": args.rounds, "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "torch": torch.__version__, "runs": rows, "summary": summary}


def main(argv=None) -> int:
    args = parse_args(argv)
    report = run(args)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

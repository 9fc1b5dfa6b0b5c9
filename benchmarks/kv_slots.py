"""kv_slots: how many KV-cache slots a model gets from GPU memory, per KV dtype, at equal memory settings.

    python -m benchmarks.kv_slots --model llama-3.1-8b --kv-cache-dtype auto fp8_e4m3 --json out.json

Builds the model runner (random weights of the shape, no graphs) once per KV dtype and reports its memory
split: weights, KV cache bytes and slots. Prints a table, writes JSON.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
from pathlib import Path

import torch

from model_executor.configs import SHAPES, shape_path


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.kv_slots", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="llama-3.1-8b", choices=SHAPES)
    p.add_argument("--kv-cache-dtype", nargs="+", default=["auto", "fp8_e4m3"], choices=["auto", "fp8_e4m3"])
    p.add_argument("--mem-fraction-static", type=float, default=0.85)
    p.add_argument("--context-length", type=int, default=8192)
    p.add_argument("--json", dest="json_out")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("kv_slots: needs a CUDA device (the KV cache is sized from GPU memory)", file=sys.stderr)
        return 2
    from runners.model_runner import ModelRunner, RunnerConfig

    rows = {}
    print(f"{'kv dtype':>10} {'slots':>10} {'KV GiB':>7} {'weights GiB':>11}")
    for kv in args.kv_cache_dtype:
        runner = ModelRunner(RunnerConfig(model_path=str(shape_path(args.model)), device="cuda", random_weights=True,
                                          kv_cache_dtype=kv, mem_fraction_static=args.mem_fraction_static,
                                          context_length=args.context_length, disable_cuda_graph=True,
                                          disable_piecewise_cuda_graph=True))
        split = runner.memory_split
        rows[kv] = {"num_slots": split.num_slots, "kv_gib": round(split.kv / 2**30, 2),
                    "weights_gib": round(split.weights / 2**30, 2)}
        print(f"{kv:>10} {split.num_slots:>10} {rows[kv]['kv_gib']:>7} {rows[kv]['weights_gib']:>11}")
        del runner
        gc.collect()
        torch.cuda.empty_cache()
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"model": args.model, "gpu": torch.cuda.get_device_name(),
                                                   "kv": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

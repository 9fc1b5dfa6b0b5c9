"""table_candidates: from a tuner run's timings, small-M config tables that each change one entry of a table to
one of the tuner's runners-up, for benchmarks/tuning/ab_tables.py to judge in the decode step.

    python -m benchmarks.tuning.tune_small_m_gemm --model llama-3.1-8b --tp 1 --kind bf16 --m 2 4 \\
        --shapes 28672,4096 --out /tmp/tuned.json --json /tmp/tune.json
    python -m benchmarks.tuning.table_candidates --timings /tmp/tune.json --case bf16,28672,4096,2 --top 3 \\
        --out-dir /tmp/cands
    python -m benchmarks.tuning.ab_tables --model llama-3.1-8b --batch-size 2 --tables \\
        model_executor/layers/triton_ops/configs/small_m_gemm_NVIDIA_H200.json /tmp/cands/*.json

The tuner times a layer's kernel (and, where the layer fuses, its neighbours' kernels) alone; the step has
disagreed with it by more than the gaps between its top configs (docs/benchmarks.md).
So the tuner's ranking only proposes: per case (kind, N, K, M bucket) this takes the `--top` configs (or the
other path: "cublas", "w8a8") the tuner ranked best by what they cost the step (best_of's measure), skips the
table's own entry, and writes one table per candidate: the base table with that one entry replaced (the file
names say which). Each candidate changes one entry, so the step's answer is about that entry alone.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from benchmarks.tuning.tune_small_m_gemm import Fusion, fusable
from model_executor.layers.triton_ops import small_m_gemm_config as smc

DEFAULT_TABLE = smc.table_path("NVIDIA_H200")


def parse_case(spec: str) -> tuple[str, int, int, int]:
    """"kind,N,K,M" -> (kind, N, K, M); ValueError naming the spec otherwise."""
    parts = spec.split(",")
    try:
        kind, n, k, m = parts[0], int(parts[1]), int(parts[2]), int(parts[3])
    except (IndexError, ValueError):
        raise ValueError(f"a case is kind,N,K,M (e.g. bf16,28672,4096,2), got {spec!r}") from None
    if len(parts) != 4 or min(n, k, m) < 1:
        raise ValueError(f"a case is kind,N,K,M with positive sizes, got {spec!r}")
    return kind, n, k, m


def ranked(case: dict, kind: str) -> list[tuple[float, object]]:
    """A tuner case's distinct choices, fastest first, by what each costs the step: [(us, entry)], an entry a
    config dict or the other path's name. A config that runs fused (FUSE not false, in a form the layer fuses:
    the tuner measured it fused) costs its time; any other config costs its time plus the neighbours' kernels
    (neighbour_us); the other path costs base_us (the tuner adds the neighbours to it). A config timed more
    than once counts its fastest time. (A case without "fusion", from before the tuner wrote it: a paired layer's.)
    In a fused layer a fusable config the tuner timed with FUSE null (its default config) ran fused, so its entry
    says FUSE true: the step runs a null tl.dot entry plain."""
    neighbour_us = case.get("neighbour_us", 0.0)
    paired = case.get("fusion") is None or Fusion(case["fusion"]).paired
    fused_layer = case.get("fusion") is not None or neighbour_us > 0
    best: dict[str, tuple[float, dict]] = {}
    for us, entry in case["all"]:
        cfg = smc.GemmConfig(**entry)
        fused = fusable(cfg, paired)
        if fused_layer and fused and cfg.FUSE is None:
            entry = {**entry, "FUSE": True}
        cost = us + (0.0 if fused else neighbour_us)
        key = json.dumps(entry, sort_keys=True)
        if key not in best or cost < best[key][0]:
            best[key] = (cost, entry)
    return sorted([*best.values(), (case["base_us"], smc.OTHER_PATHS[kind])], key=lambda c: c[0])


def same_entry(a, b) -> bool:
    """Whether two table values run the same way (a config's FUSE absent and null are the same)."""
    if isinstance(a, str) or isinstance(b, str):
        return a == b
    return smc.GemmConfig(**a) == smc.GemmConfig(**b)


def candidates(table: dict, timings: dict, case: tuple[str, int, int, int],
               top: int) -> list[tuple[str, object, float]]:
    """Up to `top` (file stem, entry, tuner us) for one case: the tuner's best-ranked entries other than the
    table's own. KeyError naming the case where the timings lack it."""
    kind, n, k, m = case
    key = f"{kind},{n},{k},{m}"
    if key not in timings:
        raise KeyError(f"the timings have no case {key} (they have {', '.join(sorted(timings)) or 'none'})")
    current = table.get(kind, {}).get(f"{n},{k}", {}).get(str(m))
    out = []
    for us, entry in ranked(timings[key], kind):
        if current is not None and same_entry(entry, current):
            continue
        stem = f"{kind}_{n}x{k}_m{m}_{len(out) + 1}"
        out.append((stem, entry, us))
        if len(out) == top:
            break
    return out


def with_entry(table: dict, case: tuple[str, int, int, int], entry) -> dict:
    """A copy of `table` whose entry for the case is `entry` (the rest untouched; _meta says what changed)."""
    kind, n, k, m = case
    out = json.loads(json.dumps(table))
    out.setdefault(kind, {}).setdefault(f"{n},{k}", {})[str(m)] = entry
    out["_meta"] = {**out.get("_meta", {}), "candidate": {"case": f"{kind},{n},{k},{m}", "entry": entry}}
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.tuning.table_candidates",
                                description=__doc__.splitlines()[0])
    p.add_argument("--timings", required=True, help="tune_small_m_gemm's --json file")
    p.add_argument("--table", default=str(DEFAULT_TABLE), help="the base table (default: the H200's)")
    p.add_argument("--case", nargs="+", required=True, metavar="KIND,N,K,M", help="the entries to vary")
    p.add_argument("--top", type=int, default=3, help="candidates per case")
    p.add_argument("--out-dir", required=True, help="where the candidate tables go")
    args = p.parse_args(argv)
    if args.top < 1:
        p.error(f"--top must be positive, got {args.top}")
    try:
        cases = [parse_case(c) for c in args.case]
    except ValueError as e:
        p.error(f"--case: {e}")
    try:
        table = json.loads(Path(args.table).read_text())
        timings = json.loads(Path(args.timings).read_text())["timings"]
    except (OSError, ValueError, KeyError) as e:
        p.error(f"--table / --timings: not a table and a tuner --json file ({type(e).__name__}: {e})")
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for case in cases:
        try:
            found = candidates(table, timings, case, args.top)
        except KeyError as e:
            p.error(f"--case: {e.args[0]}")
        kind, n, k, m = case
        print(f"{kind} {n}x{k} M={m}: table {table.get(kind, {}).get(f'{n},{k}', {}).get(str(m))}")
        for stem, entry, us in found:
            path = out_dir / f"{stem}.json"
            path.write_text(json.dumps(with_entry(table, case, entry), indent=1) + "\n")
            print(f"  {path}: {us:.1f} us (tuner)  {entry}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Charts for benchmark results (matplotlib, Agg backend; writes PNG/SVG/PDF by --out's suffix).

Serving sweeps (JSON files from ``benchmarks.bench_serving``), one series per label::

    python -m benchmarks.plot serving duet_r1.json duet_r4.json vllm_r1.json vllm_r4.json \\
        --labels duet duet vllm vllm --out serving.png

  -> output token throughput vs request rate, and p50 (solid) / p99 (dashed) TPOT vs request rate.
  Without --labels each file's "label" field (bench_serving --label) or its "model" is used.
  A request rate of "inf" is drawn right of the largest finite rate and ticked "inf".

Single-batch step times (JSON from bench_one_batch:
``{"model": str, "results": [{"batch_size": int, "eager_ms": float, "graph_ms": float,
"floor_ms": float, ...}]}``)::

    python -m benchmarks.plot one-batch one_batch.json --out one_batch.png

  -> ms/step vs batch size for eager, graph and floor (missing/null values are skipped).
"""

from __future__ import annotations

import argparse
import json
import math
import os
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt


def _load(path: str) -> dict[str, Any]:
    with open(path) as f:
        return json.load(f)


def _rate(value: Any) -> float:
    if value is None:
        return float("nan")
    if isinstance(value, str):
        return float("inf") if value.strip().lower() in ("inf", "infinity") else float(value)
    return float(value)


def _pick(d: dict[str, Any], *keys: str) -> float | None:
    for k in keys:
        v = d.get(k)
        if v is not None:
            return float(v)
    return None


def group_serving(
    paths: Sequence[str], labels: Sequence[str] | None = None
) -> OrderedDict[str, list[dict[str, Any]]]:
    """label -> results sorted by request rate."""
    if labels is not None and len(labels) != len(paths):
        raise SystemExit(f"--labels has {len(labels)} entries for {len(paths)} files")
    groups: OrderedDict[str, list[dict[str, Any]]] = OrderedDict()
    for i, path in enumerate(paths):
        data = _load(path)
        label = labels[i] if labels is not None else (data.get("label") or data.get("model") or path)
        groups.setdefault(str(label), []).append(data)
    for runs in groups.values():
        runs.sort(key=lambda d: _rate(d.get("request_rate")))
    return groups


def plot_serving(
    paths: Sequence[str], out: str, labels: Sequence[str] | None = None, title: str | None = None
) -> str:
    groups = group_serving(paths, labels)
    finite = [
        _rate(d.get("request_rate"))
        for runs in groups.values()
        for d in runs
        if math.isfinite(_rate(d.get("request_rate")))
    ]
    inf_x = max(finite) * 1.25 if finite else 1.0

    def x_of(d: dict[str, Any]) -> float:
        r = _rate(d.get("request_rate"))
        return inf_x if math.isinf(r) else r

    fig, (ax_tp, ax_tpot) = plt.subplots(1, 2, figsize=(12, 4.5))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    any_inf = False
    for i, (label, runs) in enumerate(groups.items()):
        c = colors[i % len(colors)]
        xs = [x_of(d) for d in runs]
        any_inf |= any(math.isinf(_rate(d.get("request_rate"))) for d in runs)
        tp = [_pick(d, "output_throughput") for d in runs]
        p50 = [_pick(d, "median_tpot_ms", "p50_tpot_ms") for d in runs]
        p99 = [_pick(d, "p99_tpot_ms") for d in runs]
        ax_tp.plot(xs, [float("nan") if v is None else v for v in tp], "o-", color=c, label=label)
        ax_tpot.plot(xs, [float("nan") if v is None else v for v in p50], "o-", color=c, label=f"{label} p50")
        ax_tpot.plot(
            xs, [float("nan") if v is None else v for v in p99], "s--", color=c, label=f"{label} p99"
        )

    for ax in (ax_tp, ax_tpot):
        ax.set_xlabel("request rate (req/s)")
        ax.grid(True, alpha=0.3)
        if any_inf:
            ticks = sorted(set(finite)) + [inf_x]
            ax.set_xticks(ticks)
            ax.set_xticklabels([f"{t:g}" for t in ticks[:-1]] + ["inf"])
    ax_tp.set_ylabel("output throughput (tok/s)")
    ax_tp.set_title("Output token throughput")
    ax_tp.set_ylim(bottom=0)
    ax_tpot.set_ylabel("TPOT (ms)")
    ax_tpot.set_title("TPOT p50 (solid) / p99 (dashed)")
    ax_tpot.set_ylim(bottom=0)
    ax_tp.legend(fontsize="small")
    ax_tpot.legend(fontsize="small")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    _save(fig, out)
    return out


def plot_one_batch(paths: Sequence[str], out: str, title: str | None = None) -> str:
    fig, ax = plt.subplots(figsize=(7, 4.5))
    series = (("eager_ms", "eager", "o-"), ("graph_ms", "graph", "s-"), ("floor_ms", "floor", "^--"))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    models = []
    all_bs: set[int] = set()
    for fi, path in enumerate(paths):
        data = _load(path)
        model = str(data.get("model", os.path.basename(path)))
        models.append(model)
        rows = sorted(data.get("results") or [], key=lambda r: int(r["batch_size"]))
        prefix = f"{model} " if len(paths) > 1 else ""
        for si, (key, name, style) in enumerate(series):
            pts = [(int(r["batch_size"]), float(r[key])) for r in rows if r.get(key) is not None]
            if not pts:
                continue
            all_bs.update(b for b, _ in pts)
            color = colors[(fi * len(series) + si) % len(colors)]
            ax.plot([b for b, _ in pts], [v for _, v in pts], style, color=color, label=prefix + name)
    if all_bs and min(all_bs) > 0 and max(all_bs) / min(all_bs) >= 8:
        ax.set_xscale("log", base=2)
        ticks = sorted(all_bs)
        ax.set_xticks(ticks)
        ax.set_xticklabels([str(t) for t in ticks])
    ax.set_xlabel("batch size")
    ax.set_ylabel("ms / step")
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    ax.set_title(title or ("decode step time: " + ", ".join(dict.fromkeys(models))))
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize="small")
    fig.tight_layout()
    _save(fig, out)
    return out


def _save(fig: Any, out: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> str:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.plot",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = p.add_subparsers(dest="kind", required=True)
    s = sub.add_parser("serving", help="throughput and TPOT vs request rate (bench_serving JSONs)")
    s.add_argument("files", nargs="+")
    s.add_argument("--labels", nargs="+", default=None, help="one label per file; same label = same series")
    s.add_argument("--title", default=None)
    s.add_argument("--out", default="serving.png")
    o = sub.add_parser("one-batch", help="ms/step vs batch size (bench_one_batch JSON)")
    o.add_argument("files", nargs="+")
    o.add_argument("--title", default=None)
    o.add_argument("--out", default="one_batch.png")
    args = p.parse_args(argv)
    if args.kind == "serving":
        out = plot_serving(args.files, args.out, args.labels, args.title)
    else:
        out = plot_one_batch(args.files, args.out, args.title)
    print(f"wrote {out}")
    return out


if __name__ == "__main__":
    main()

"""tune_fused_gemv: time the one-row GEMVs that carry a fused epilogue or prologue on this GPU, config by
config, and add the fastest to the small-M GEMM table as entries of their own ("<kind>:<fusion>", M = 1).

    python -m benchmarks.tune_fused_gemv --model llama-3.2-1b llama-3.1-8b --kind bf16 fp8

At one decode row a layer's GEMVs run with something fused in (small_m_gemm.py): "silu" (gate/up with the
SiLU-and-mul epilogue, its input a PrenormedRow), "rope" (qkv with the rotary and KV-store epilogue, its
input a PrenormedRow) and "add_norm" (o_proj and down with the residual add and the next RMSNorm's partial
sums in the epilogue). Without an entry of their own they run the plain GEMV's tuned config (halved for the
paired ones), which was timed without them. Here each is timed as it runs: cold weights (copies rotating
past L2), many calls in one CUDA graph (tune_small_m_gemm.time_calls). Search: column tiles (BLOCK_N: pairs
for the paired ones) x K tiles at 4 warps and 4 stages, then warps / stages for the best tile; the entry is
written only where it beats the plain-derived config (timed in the same run) by the tuner's margin.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from pathlib import Path

import torch

from benchmarks.tune_small_m_gemm import (
    GEMV_WARPS_STAGES,
    OTHER_MARGIN,
    Weights,
    linear_shapes,
    merge_tables,
    time_calls,
)
from model_executor.configs import SHAPES, shape_path
from model_executor.layers.triton_ops.small_m_gemm import FUSIONS
from model_executor.model_config import ModelConfig

KINDS = ("bf16", "fp8", "fp8_block")
NUM_PARTIALS = 512  # the PrenormedRow's partial sums (a producer's program count at the 1B / 8B shapes)


def fused_shapes(cfg: ModelConfig) -> list[tuple[str, tuple[int, int]]]:
    """(fusion, weight (N, K)) of one decoder layer's fused one-row GEMVs (never under tensor parallelism)."""
    s = linear_shapes(cfg, 1)
    out = [("rope", s["qkv"]), ("add_norm", s["o"])]
    if "gate_up" in s:
        out += [("silu", s["gate_up"]), ("add_norm", s["down"])]
    return out


def tile_grid(kind: str, k: int, paired: bool) -> list[tuple[int, int]]:
    """(BLOCK_N, BLOCK_K): 1-8 rows (pairs) over K tiles of 1-4 KB of a weight row (block FP8: the block)."""
    bks = (128,) if kind == "fp8_block" else (512, 1024, 2048) if kind == "bf16" else (1024, 2048, 4096)
    bns = (1, 2, 4, 8) if paired else (2, 4, 8, 16)
    return [(bn, bk) for bn in bns for bk in bks if bk <= max(k, bks[0])]


class FusedCase:
    """The operands of one fused GEMV and its calls over a Weights' rotating copies."""

    def __init__(self, fusion: str, kind: str, n: int, k: int, cfg: ModelConfig, gen: torch.Generator):
        from model_executor.layers.norm import PrenormedRow
        from model_executor.layers.rotary_store_kv import RopeStore

        self.fusion, self.paired = fusion, fusion in ("silu", "rope")
        self.wts = Weights(kind, n, k, gen)
        row = torch.randn(1, k, device="cuda", generator=gen).bfloat16()
        partials = torch.rand(NUM_PARTIALS, device="cuda", generator=gen) * k / NUM_PARTIALS
        self.row = PrenormedRow(row, partials, 1e-5)
        self.residual = torch.randn(1, n, device="cuda", generator=gen).bfloat16()
        self.norm_weight = torch.randn(n, device="cuda", generator=gen).bfloat16()
        if fusion == "rope":
            d, hq, hkv = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
            cache = torch.randn(4096, d, device="cuda", generator=gen)
            pools = [torch.zeros(64, hkv, d, dtype=torch.bfloat16, device="cuda") for _ in range(2)]
            pos = torch.tensor([517], device="cuda")
            self.rope = RopeStore(pos, cache, torch.tensor([9], device="cuda"), pools[0], pools[1], hq, hkv)

    def calls(self, sm, config):
        wts, block = self.wts, self.wts.block
        if self.fusion == "silu":
            return [lambda w=w, s=s: sm.small_m_silu_and_mul(self.row, w, s, block, config=config)
                    for w, s in zip(wts.w, wts.s)]
        if self.fusion == "rope":
            return [lambda w=w, s=s: sm.small_m_prenormed_linear(self.row, w, s, None, block, rope=self.rope,
                                                                  config=config) for w, s in zip(wts.w, wts.s)]
        return [lambda w=w, s=s: sm.small_m_linear_add_rmsnorm(self.row.weighted, w, s, None, block, self.residual,
                                                                self.norm_weight, 1e-5, config=config)
                for w, s in zip(wts.w, wts.s)]


def tune_case(sm, case: FusedCase, kind: str, n: int, k: int, dev: str, log: list) -> dict:
    """The fastest config of one fused GEMV, and the plain-derived config's time (what runs without an
    entry); every timing goes to `log`."""

    def measure(cfg):
        try:
            us = time_calls(case.calls(sm, cfg))
        except Exception as e:  # noqa: BLE001 (over the GPU's resources: skip it, say so)
            print(f"    skipped {cfg}: {type(e).__name__}: {str(e).splitlines()[0][:90]}")
            return math.inf
        log.append([round(us, 2), dataclasses.asdict(cfg)])
        return us

    derived = sm.fused_gemv_config(n, k, kind, dev, paired=case.paired)  # (fusion None: the plain table's)
    results = [(measure(derived), derived)] if derived is not None else []
    for bn, bk in tile_grid(kind, k, case.paired):
        cfg = sm.GemmConfig(BLOCK_N=bn, BLOCK_K=bk, num_warps=4, num_stages=4, GEMV=True)
        results.append((measure(cfg), cfg))
    best_us, best = min(results, key=lambda r: r[0])
    for warps, stages in GEMV_WARPS_STAGES:
        cfg = dataclasses.replace(best, num_warps=warps, num_stages=stages)
        if cfg != best:
            results.append((measure(cfg), cfg))
    best_us, best = min(results, key=lambda r: r[0])
    derived_us = results[0][0] if derived is not None else math.inf
    return {"best": best, "best_us": best_us, "derived": derived, "derived_us": derived_us}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.tune_fused_gemv", description=__doc__.splitlines()[0])
    p.add_argument("--model", nargs="+", default=["llama-3.2-1b", "llama-3.1-8b"], choices=SHAPES)
    p.add_argument("--kind", nargs="+", default=["bf16", "fp8"], choices=KINDS)
    p.add_argument("--fusion", nargs="+", default=list(FUSIONS), choices=FUSIONS)
    p.add_argument("--out", help="the table file to add to (default: the one the server reads, for this GPU)")
    p.add_argument("--json", dest="json_out", help="also write every timing here")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("tune_fused_gemv needs a CUDA device", file=sys.stderr)
        return 2
    from model_executor.layers.triton_ops import small_m_gemm as sm

    if any(kind.startswith("fp8") for kind in args.kind) and torch.cuda.get_device_capability() < (8, 9):
        p.error("FP8 kinds need an sm89+ GPU; pass --kind bf16")
    dev = sm.device_name("cuda")
    out = Path(args.out) if args.out else sm.table_path(dev)
    cases = []
    for name in args.model:
        cfg = ModelConfig.from_pretrained(shape_path(name))
        cases += [(fusion, nk, cfg) for fusion, nk in fused_shapes(cfg) if fusion in args.fusion]
    cases = list({(f, nk): (f, nk, c) for f, nk, c in cases}.values())  # a shape two models share: once
    gen = torch.Generator(device="cuda").manual_seed(0)
    t0 = time.perf_counter()
    print(f"{'kind':>9} {'fusion':>8} {'N':>6} {'K':>6} {'derived us':>10} {'best us':>8} {'gain':>6} {'TB/s':>5}  "
          "entry (derived: the plain GEMV's config, halved where paired)")
    table: dict = {}
    timings = {}
    kept = json.loads(out.read_text()) if out.exists() else {}

    def save():  # after every case: a run stopped midway keeps what it measured
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"_meta": kept.get("_meta", {}), **merge_tables(kept, table)}, indent=1) + "\n")
        if args.json_out:
            Path(args.json_out).write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "timings": timings},
                                                      indent=1))

    for kind in args.kind:
        for fusion, (n, k), cfg in cases:
            case = FusedCase(fusion, kind, n, k, cfg, gen)
            log: list = []
            r = tune_case(sm, case, kind, n, k, dev, log)
            wins = r["best_us"] < OTHER_MARGIN * r["derived_us"]
            if wins:
                table.setdefault(f"{kind}:{fusion}", {})[f"{n},{k}"] = {"1": dataclasses.asdict(r["best"])}
            timings[f"{kind}:{fusion},{n},{k}"] = {"derived_us": round(r["derived_us"], 2),
                                                   "best_us": round(r["best_us"], 2), "all": log}
            print(f"{kind:>9} {fusion:>8} {n:>6} {k:>6} {r['derived_us']:>10.2f} {r['best_us']:>8.2f} "
                  f"{r['derived_us'] / r['best_us']:>5.2f}x {case.wts.bytes / r['best_us'] / 1e6:>5.2f}  "
                  f"{dataclasses.asdict(r['best']) if wins else 'none (derived kept)'}", flush=True)
            del case
            torch.cuda.empty_cache()
            save()
    print(f"wrote {sum(len(v) for v in table.values())} fused entries to {out} ({time.perf_counter() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""bench_attention: the Triton attention kernels alone, for tuning their constants.

    python -m benchmarks.kernels.bench_attention --json out.json  # decode plans + tiles, extend tiles
    python -m benchmarks.kernels.bench_attention --decode-only --heads 32,8,128 --points 256x520 64x520
    python -m benchmarks.kernels.bench_attention --combine --json combine.json  # two-stage vs fused combine
    python -m benchmarks.kernels.bench_attention --decode-only --kv-dtype fp8_e4m3 --points 128x4096  # an FP8 pool
    python -m benchmarks.kernels.bench_attention --decode-only --kv-dtype fp8_e4m3 --splits 1 2 --points 64x528  # splits only

Decode: for each head shape (num_heads, num_kv_heads, head_dim) and (batch, context) point, both stages of
`decode_attention_fwd` captured in one CUDA graph (no launch overhead, as in the decode graphs): the split plan
the triton backend picks, other split counts and min_chunk values (the constants MIN_CHUNK, PROGRAMS_PER_SM,
SINGLE_STAGE_MAX_LEN), and a sweep of the stage-1 tile (BLOCK_N, num_warps, num_stages, and whether the warps
share each step or take warp splits: "s" after the tile) at the plan. Each row
gives the KV bytes read per microsecond against the measured copy bandwidth. Extend: `extend_attention_fwd` at
a few token counts with its tile configs, against torch SDPA on contiguous K/V (its default pick, cuDNN on the
H200 with torch 2.11, and its FA2 kernel).

--combine (alone, decode only): at the split plan of each point, the chunks merged by a second launch
(stage 2) against merged in stage 1 (fused_combine), both in CUDA graphs, with a check that they give the
same bits; where the plan is one stage, that time and both paths at 2 splits. Its default points are
COMBINE_HEADS x COMBINE_POINTS; --heads / --points replace them.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import sys
from pathlib import Path

import torch

from benchmarks.tuning.tune_small_m_gemm import time_calls

GRAPH_CALLS = 20
# (num_heads, num_kv_heads, head_dim): Llama-3.1-8B, Llama-3.2-1B, SmolLM2-135M
HEAD_SHAPES = [(32, 8, 128), (32, 8, 64), (9, 3, 64)]
DECODE_POINTS = [(1, 520), (1, 2048), (8, 520), (32, 520), (64, 520), (256, 520), (32, 4096), (128, 2048)]
# Llama-3.1-8B, Llama-3.2-1B, Qwen3-30B-A3B; a 512-token prompt a few tokens into its decode, and longer
COMBINE_HEADS = [(32, 8, 128), (32, 8, 64), (32, 4, 128)]
COMBINE_POINTS = [(1, 520), (4, 520), (8, 520), (32, 520), (64, 520), (256, 520), (1, 2048), (8, 2048)]
# Stage-1 tiles (decode_attention.Stage1Tile): (BLOCK_N, num_warps, num_stages) with the warps sharing each
# step, and with warp splits (each warp its own BLOCK_N a step)
TILES = [(64, 8, 2), (64, 4, 2), (64, 4, 3), (32, 4, 2),
         (16, 1, 2, True), (16, 1, 3, True), (32, 1, 2, True), (32, 1, 3, True), (64, 1, 2, True), (16, 2, 2, True),
         (16, 2, 3, True), (32, 2, 2, True), (32, 2, 3, True), (16, 4, 2, True), (32, 4, 2, True)]
EXTEND_TILES = [(128, 64, 8, 1), (128, 64, 8, 2), (128, 128, 8, 1), (64, 64, 4, 2), (128, 32, 4, 2),
                (64, 128, 8, 2), (128, 64, 4, 1), (64, 64, 4, 1), (32, 64, 4, 1), (32, 64, 4, 2), (32, 32, 4, 2),
                (16, 64, 4, 1),
                # the new tokens' loop pipelined (ExtendConfig's num_stages, then the prefix loop's stages)
                (128, 64, 8, 3, 3), (128, 64, 4, 3, 3), (64, 64, 4, 3, 3), (128, 128, 8, 2, 3), (64, 128, 4, 3, 3)]


def parse_point(text: str) -> tuple[int, int]:
    bs, _, ctx = text.partition("x")
    if not (bs.isdigit() and ctx.isdigit() and int(bs) > 0 and int(ctx) > 0):
        raise argparse.ArgumentTypeError(f"a point is BATCHxCONTEXT, e.g. 256x520; got {text!r}")
    return int(bs), int(ctx)


def parse_heads(text: str) -> tuple[int, int, int]:
    parts = text.split(",")
    if len(parts) != 3 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise argparse.ArgumentTypeError(f"heads are NUM_HEADS,NUM_KV_HEADS,HEAD_DIM, e.g. 32,8,128; got {text!r}")
    heads, kv_heads, dim = map(int, parts)
    if heads % kv_heads:
        raise argparse.ArgumentTypeError(f"num_heads {heads} is not a multiple of num_kv_heads {kv_heads}")
    return heads, kv_heads, dim


def graph_us(fn) -> float:
    """Median microseconds per fn call, GRAPH_CALLS calls captured in one CUDA graph."""
    return time_calls([fn] * GRAPH_CALLS)


KV_DTYPES = {"bf16": torch.bfloat16, "fp8_e4m3": torch.float8_e4m3fn}


class KvPool:
    """A KV pool (bf16, or FP8 as --kv-cache-dtype fp8_e4m3 stores it) whose requests' slots are scattered
    (as after a server has run a while)."""

    def __init__(self, bs: int, ctx: int, num_kv_heads: int, head_dim: int, seed: int = 0,
                 dtype: torch.dtype = torch.bfloat16):
        gen = torch.Generator(device="cuda").manual_seed(seed)
        slots = bs * ctx
        self.k = torch.randn(slots + 1, num_kv_heads, head_dim, device="cuda", generator=gen).to(dtype)
        self.v = torch.randn(slots + 1, num_kv_heads, head_dim, device="cuda", generator=gen).to(dtype)
        perm = torch.randperm(slots, device="cuda", generator=gen).to(torch.int32) + 1
        self.req_to_token = torch.zeros(bs + 1, ctx + 16, dtype=torch.int32, device="cuda")
        self.req_to_token[1:, :ctx] = perm.view(bs, ctx)


def plan_splits(heads, bs: int, ctx: int, q_dtype: torch.dtype, kv_dtype: torch.dtype) -> int:
    """The split count the triton backend's plan gives a batch of bs requests of ctx tokens on this GPU."""
    from model_executor.layers.attention.triton_ops import decode_attention as dec

    num_heads, num_kv_heads, _ = heads
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    cap = dec.decode_split_cap(bs, num_heads, num_kv_heads, sms, dec.get_num_kv_splits(131072),
                               dec.programs_per_sm(q_dtype, kv_dtype), dec.min_splits(q_dtype, kv_dtype))
    return dec.decode_split_plan(cap, ctx)


def decode_rows(heads, bs: int, ctx: int, copy_tb_s: float, plan_only: bool = False,
                kv_dtype: torch.dtype = torch.bfloat16, splits_only: list[int] | None = None) -> list[dict]:
    from model_executor.layers.attention.triton_ops import alloc_decode_workspace, decode_attention_fwd
    from model_executor.layers.attention.triton_ops import decode_attention as dec

    num_heads, num_kv_heads, head_dim = heads
    pool = KvPool(bs, ctx, num_kv_heads, head_dim, dtype=kv_dtype)
    q = torch.randn(bs, num_heads, head_dim, device="cuda").bfloat16()
    o = torch.empty_like(q)
    rows = torch.arange(1, bs + 1, device="cuda")
    lens = torch.full((bs,), ctx, dtype=torch.int32, device="cuda")
    plan = plan_splits(heads, bs, ctx, q.dtype, kv_dtype)
    kv_bytes = 2 * bs * ctx * num_kv_heads * head_dim * pool.k.element_size()
    floor_us = kv_bytes / (copy_tb_s * 1e6)
    out = []

    def measure(splits: int, min_chunk: int, tile) -> None:  # (a decode_attention.Stage1Tile)
        logits, lse, counters = alloc_decode_workspace(bs, num_heads, head_dim, splits, "cuda")
        try:
            us = graph_us(lambda: decode_attention_fwd(q, pool.k, pool.v, o, pool.req_to_token, rows, lens, logits,
                                                       lse, splits, 1.0 / math.sqrt(head_dim), min_chunk=min_chunk,
                                                       tile=tile, counters=counters))
        except Exception as exc:  # noqa: BLE001 - a tile that does not fit: report it, go on
            us = None
            print(f"  tile {tile} failed: {type(exc).__name__}: {str(exc)[:100]}")
        out.append({"heads": list(heads), "bs": bs, "ctx": ctx, "kv_dtype": str(kv_dtype).removeprefix("torch."),
                    "splits": splits, "plan": splits == plan,
                    "min_chunk": min_chunk, "block_n": tile.block_n, "num_warps": tile.num_warps,
                    "num_stages": tile.num_stages, "warp_splits": tile.warp_splits,
                    "us": None if us is None else round(us, 2),
                    "x_floor": None if us is None else round(us / floor_us, 2), "floor_us": round(floor_us, 2)})

    default_tile = dec.stage1_tile(bs, head_dim, num_kv_heads, dec.kv_dots_in_fp16(q.dtype, kv_dtype))
    if splits_only:  # only these split counts and the plan's, at the default tile and MIN_CHUNK
        for splits in sorted({*splits_only, plan}):
            measure(splits, dec.MIN_CHUNK, default_tile)
        return out
    for splits in [plan] if plan_only else sorted({1, 2, 4, 8, 16, plan}):
        for min_chunk in ([32, 64, 128, 256] if splits > 1 and not plan_only else [dec.MIN_CHUNK]):
            measure(splits, min_chunk, default_tile)
    for tile in (dec.Stage1Tile(*t) for t in TILES):
        if tile != default_tile:
            measure(plan, dec.MIN_CHUNK, tile)
    return out


def combine_rows(heads, bs: int, ctx: int) -> list[dict]:
    """Two-stage against fused combine at the split plan of (heads, bs, ctx) (see the module docstring)."""
    from model_executor.layers.attention.triton_ops import alloc_decode_workspace, decode_attention_fwd
    from model_executor.layers.attention.triton_ops import decode_attention as dec

    num_heads, num_kv_heads, head_dim = heads
    pool = KvPool(bs, ctx, num_kv_heads, head_dim)
    q = torch.randn(bs, num_heads, head_dim, device="cuda").bfloat16()
    rows = torch.arange(1, bs + 1, device="cuda")
    lens = torch.full((bs,), ctx, dtype=torch.int32, device="cuda")
    plan = plan_splits(heads, bs, ctx, q.dtype, pool.k.dtype)
    base = {"heads": list(heads), "bs": bs, "ctx": ctx, "fused_default": dec.fused_combine_default(bs)}

    def timed(splits: int, fused: bool) -> tuple[float, torch.Tensor]:
        ws = alloc_decode_workspace(bs, num_heads, head_dim, splits, "cuda")
        o = torch.empty_like(q)
        us = graph_us(lambda: decode_attention_fwd(q, pool.k, pool.v, o, pool.req_to_token, rows, lens,
                                                   ws.attn_logits, ws.attn_lse, splits, 1.0 / math.sqrt(head_dim),
                                                   counters=ws.counters, fused_combine=fused))
        assert ws.counters.count_nonzero().item() == 0, "the fused combine left a counter set"
        return us, o

    out = []
    for splits in [plan] if plan > 1 else [1, 2]:
        if splits == 1:
            us, _ = timed(1, False)
            out.append({**base, "splits": 1, "plan": True, "one_stage_us": round(us, 2)})
            continue
        two_us, two_o = timed(splits, False)
        fused_us, fused_o = timed(splits, True)
        out.append({**base, "splits": splits, "plan": splits == plan, "two_stage_us": round(two_us, 2),
                    "fused_us": round(fused_us, 2), "saved_us": round(two_us - fused_us, 2),
                    "same_bits": torch.equal(two_o, fused_o)})
    return out


def print_combine(rows: list[dict]) -> None:
    for r in rows:
        head = f"{'/'.join(map(str, r['heads'])):>10} {r['bs']:>4} {r['ctx']:>5} {r['splits']:>6}"
        if "one_stage_us" in r:
            print(f"{head} {'one stage':>10} {r['one_stage_us']:>9.2f}  plan")
        else:
            print(f"{head} {r['two_stage_us']:>10.2f} {r['fused_us']:>9.2f} {r['saved_us']:>7.2f} "
                  f"{'yes' if r['same_bits'] else 'NO':>9}{'  plan' if r['plan'] else ''}")


def extend_rows(heads, n_tok: int) -> list[dict]:
    from model_executor.layers.attention.triton_ops import ExtendConfig, extend_attention_fwd

    num_heads, num_kv_heads, head_dim = heads
    pool = KvPool(1, n_tok, num_kv_heads, head_dim, seed=5)
    q = torch.randn(n_tok, num_heads, head_dim, device="cuda").bfloat16()
    o = torch.empty_like(q)
    loc = pool.req_to_token[1, :n_tok].long()
    k, v = pool.k[loc], pool.v[loc]
    as_t = lambda x, dt: torch.tensor(x, dtype=dt, device="cuda")
    args = (as_t([1], torch.int64), as_t([n_tok], torch.int32), as_t([n_tok], torch.int32), as_t([0], torch.int32),
            n_tok)
    flops = 4 * n_tok * n_tok / 2 * num_heads * head_dim
    out = []
    for cfg in [None] + [ExtendConfig(*c) for c in EXTEND_TILES]:
        try:
            us = graph_us(lambda cfg=cfg: extend_attention_fwd(q, k, v, o, pool.k, pool.v, loc, pool.req_to_token,
                                                               *args, 1.0 / math.sqrt(head_dim), config=cfg))
        except Exception as exc:  # noqa: BLE001 - a tile that does not fit
            print(f"  extend {cfg} failed: {type(exc).__name__}: {str(exc)[:100]}")
            continue
        out.append({"heads": list(heads), "tokens": n_tok, "config": "default" if cfg is None else list(cfg),
                    "us": round(us, 2), "tflops": round(flops / us / 1e6, 1)})
    # torch's SDPA on the same (contiguous) K/V: its default pick (cuDNN on the H200 with torch 2.11) and FA2
    from torch.nn.attention import SDPBackend, sdpa_kernel

    qs, ks, vs = q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None]
    for name, backends in (("torch_sdpa_contiguous", None), ("torch_sdpa_flash", [SDPBackend.FLASH_ATTENTION])):
        def sdpa(backends=backends):
            with sdpa_kernel(backends) if backends else contextlib.nullcontext():
                return torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True)

        us = graph_us(sdpa)
        out.append({"heads": list(heads), "tokens": n_tok, "config": name, "us": round(us, 2),
                    "tflops": round(flops / us / 1e6, 1)})
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.kernels.bench_attention",
                                description=__doc__.splitlines()[0])
    p.add_argument("--heads", type=parse_heads, nargs="+", help="NUM_HEADS,NUM_KV_HEADS,HEAD_DIM")
    p.add_argument("--points", type=parse_point, nargs="+", help="decode BATCHxCONTEXT")
    p.add_argument("--extend-tokens", type=int, nargs="+", default=[128, 512, 2048])
    p.add_argument("--decode-only", action="store_true")
    p.add_argument("--plan-only", action="store_true", help="decode: only the split plan, with every tile")
    p.add_argument("--splits", type=int, nargs="+", default=None,
                   help="decode: only these split counts and the plan's, at the default tile (no tile sweep)")
    p.add_argument("--combine", action="store_true",
                   help="only decode's merge of the chunks: second launch (stage 2) vs fused into stage 1")
    p.add_argument("--kv-dtype", choices=KV_DTYPES, default="bf16", help="decode: the pool's dtype")
    p.add_argument("--json", dest="json_out")
    args = p.parse_args(argv)
    if args.combine and args.plan_only:
        p.error("--combine and --plan-only are separate runs; give one of them")
    if args.splits and (args.plan_only or args.combine or any(n < 1 for n in args.splits)):
        p.error("--splits takes split counts >= 1, without --plan-only or --combine")
    if args.kv_dtype != "bf16" and not args.decode_only:
        p.error("--kv-dtype is for the decode rows: add --decode-only")
    heads_list = args.heads or (COMBINE_HEADS if args.combine else HEAD_SHAPES)
    points = args.points or (COMBINE_POINTS if args.combine else DECODE_POINTS)
    if not torch.cuda.is_available():
        print("bench_attention: needs a CUDA device (the kernels are timed inside CUDA graphs)", file=sys.stderr)
        return 2
    from benchmarks.bench_one_batch import measure_copy_bandwidth

    copy_tb_s = measure_copy_bandwidth(torch.device("cuda")) / 1e12
    print(f"{torch.cuda.get_device_name()}: copy bandwidth {copy_tb_s:.2f} TB/s")
    result = {"gpu": torch.cuda.get_device_name(), "copy_tb_s": round(copy_tb_s, 3), "decode": [], "extend": []}
    if args.combine:
        result = {"gpu": result["gpu"], "combine": []}
        print(f"{'heads':>10} {'bs':>4} {'ctx':>5} {'splits':>6} {'2-stage us':>10} {'fused us':>9} {'saved':>7} "
              f"{'same bits':>9}")
        for heads in heads_list:
            for bs, ctx in points:
                rows = combine_rows(heads, bs, ctx)
                result["combine"] += rows
                print_combine(rows)
        write_json(result, args.json_out)
        return 0
    print(f"{'heads':>10} {'bs':>4} {'ctx':>5} {'splits':>6} {'chunk':>5} {'tile':>10} {'us':>9} {'x floor':>8}")
    for heads in heads_list:
        for bs, ctx in points:
            rows = decode_rows(heads, bs, ctx, copy_tb_s, args.plan_only, KV_DTYPES[args.kv_dtype], args.splits)
            result["decode"] += rows
            for r in rows:
                tile = f"{r['block_n']}/{r['num_warps']}/{r['num_stages']}{'s' if r['warp_splits'] else ''}"
                us = "failed" if r["us"] is None else f"{r['us']:.1f}"
                print(f"{'/'.join(map(str, heads)):>10} {bs:>4} {ctx:>5} {r['splits']:>6} {r['min_chunk']:>5} "
                      f"{tile:>10} {us:>9} {r['x_floor'] or '':>8}{'  plan' if r['plan'] else ''}")
    if not args.decode_only:
        for heads in heads_list:
            for n_tok in args.extend_tokens:
                for r in extend_rows(heads, n_tok):
                    result["extend"].append(r)
                    print(f"extend {'/'.join(map(str, heads))} tokens={n_tok:<5} {r['config']!s:<22} "
                          f"{r['us']:9.1f} us {r['tflops']:6.1f} TFLOP/s")
    write_json(result, args.json_out)
    return 0


def write_json(result: dict, path: str | None) -> None:
    if path:
        Path(path).write_text(json.dumps(result, indent=2))
        print(f"wrote {path}")


if __name__ == "__main__":
    sys.exit(main())

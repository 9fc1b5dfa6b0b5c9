"""probe_pdl_oproj: does o_proj loading its weights while decode attention runs shorten a one-row decode layer?
(issues 18, 23)

Llama-3.1-8B FP8 at bs=1: decode attention (one request, 512 tokens) takes ~6.7 us a layer and reads ~2 MB, so
the memory bus idles while it runs; o_proj's GEMV that follows reads 16.8 MB in ~8 us, at about half the copy
bandwidth. With programmatic dependent launch (model_executor/layers/triton_ops/pdl.py) attention signals at its
start, o_proj is launched with PDL and loads its first weight tile before it waits for attention's output
(small_m_gemm's PRELOAD): with BLOCK_K = K that is the program's whole weight slice, so the read overlaps
attention. The sixth and tenth sessions measured PDL on every GEMV (a first tile each) slower: there the early
programs competed with the streaming GEMV before them.

One CUDA graph over --layers layers, each with its own cold weights and KV, as a decode layer runs them at one
row (the model's kernels and their table configs): qkv GEMV -> decode attention (the backend's split plan) ->
o_proj GEMV with the add + RMSNorm epilogue -> gate/up GEMV + SiLU-and-mul on the pre-normed row -> down GEMV.
Variants change only o_proj: `table` (its table config, no PDL); `preload derived, no PDL` (preload_config's
config and its preloaded tile, launched without PDL: the config's own effect); with PDL (attention signals at its
start), `pdl table` (the table config: its first K step preloaded), `pdl derived` (small_m_gemm.preload_config:
all of K preloaded where that fits) and `pdl BN/BK/warps/stages`. (An earlier variant signalled from attention
after its positions' loop instead: 1.6-2.2 us a layer slower than at its start with all of K preloaded, 0.1
faster with the table config's first step, 8B FP8.) Each PDL variant's output is compared bit for bit with the same
config run without PDL (`bits`). Reported: us a layer (median of replays, --rounds rounds alternating the
variants), and the difference from `table` in the same round.

    python -m benchmarks.probe_pdl_oproj --json out.json
    python -m benchmarks.probe_pdl_oproj --model llama-3.2-1b --kind bf16 --configs 4/2048/4/1
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER = 4096, 32, 8, 128, 14336  # Llama-3.1-8B (set_shapes: --model)
QKV = (HEADS + 2 * KV_HEADS) * HEAD_DIM
DEVICE = "cuda"


def set_shapes(model: str) -> None:
    """The module's layer shapes from model_executor/configs/<model>."""
    from model_executor.configs import shape_path
    from model_executor.model_config import ModelConfig

    global HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER, QKV
    cfg = ModelConfig.from_pretrained(str(shape_path(model)))
    HIDDEN, HEADS, KV_HEADS = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads
    HEAD_DIM, INTER = cfg.head_dim, cfg.intermediate_size
    QKV = (HEADS + 2 * KV_HEADS) * HEAD_DIM


def parse_config(text: str):
    from model_executor.layers.triton_ops.small_m_gemm import GemmConfig

    bn, bk, warps, stages = (int(v) for v in text.split("/"))
    return GemmConfig(BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=stages, GEMV=True)


class Layer:
    """One layer's weights (FP8 with per-channel scales, or bf16), norm weight and KV pool of one request."""

    def __init__(self, gen: torch.Generator, context: int, kind: str = "fp8"):
        from model_executor.layers.quantization import fp8_math as fm

        def weight(n, k):
            w = (torch.randn(n, k, device=DEVICE, generator=gen) * 0.02).bfloat16()
            return fm.quantize_fp8_per_channel(w) if kind == "fp8" else (w, None)

        self.qkv, self.o, self.gate_up, self.down = (weight(QKV, HIDDEN), weight(HIDDEN, HIDDEN),
                                                     weight(2 * INTER, HIDDEN), weight(HIDDEN, INTER))
        self.g = (torch.rand(HIDDEN, device=DEVICE, generator=gen) + 0.5).bfloat16()
        slots = context + 1
        self.k = torch.randn(slots, KV_HEADS, HEAD_DIM, device=DEVICE, generator=gen).bfloat16()
        self.v = torch.randn(slots, KV_HEADS, HEAD_DIM, device=DEVICE, generator=gen).bfloat16()


def chain(layers, x0, residual0, plan, o_config, pdl: bool, other_config=None):
    """The layers' decode chain at one row; returns the last layer's (output, residual) buffers. The GEMVs but
    o_proj take other_config (default: their table configs)."""
    from model_executor.layers.attention.triton_ops.decode_attention import decode_attention_fwd
    from model_executor.layers.triton_ops import small_m_gemm as sm

    req_to_token, req_rows, seq_lens, ws, splits = plan
    x, residual = x0, residual0
    for layer in layers:
        qkv = sm.small_m_linear(x, layer.qkv[0], layer.qkv[1], config=other_config)
        q = qkv[:, :HEADS * HEAD_DIM].view(1, HEADS, HEAD_DIM)
        o = torch.empty(1, HEADS, HEAD_DIM, dtype=torch.bfloat16, device=DEVICE)
        decode_attention_fwd(q, layer.k, layer.v, o, req_to_token, req_rows, seq_lens, ws.attn_logits, ws.attn_lse,
                             splits, HEAD_DIM**-0.5, counters=ws.counters)
        row, residual = sm.small_m_linear_add_rmsnorm(o.view(1, HIDDEN), layer.o[0], layer.o[1], None, None,
                                                      residual, layer.g, 1e-5, config=o_config,
                                                      after_attention=pdl)
        act = sm.small_m_silu_and_mul(row, layer.gate_up[0], layer.gate_up[1], config=other_config)
        x = sm.small_m_linear(act, layer.down[0], layer.down[1], config=other_config)
    return x, residual


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.probe_pdl_oproj", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="llama-3.1-8b", help="a shape in model_executor/configs")
    p.add_argument("--kind", default="fp8", choices=("fp8", "bf16"))
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--configs", nargs="*", default=[],
                   help="more o_proj configs BLOCK_N/BLOCK_K/warps/stages run with PDL")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--replays", type=int, default=200)
    p.add_argument("--json", dest="json_out")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("probe_pdl_oproj needs a CUDA device", file=sys.stderr)
        return 2
    from model_executor.layers.attention.triton_ops import decode_attention as dec
    from model_executor.layers.triton_ops import small_m_gemm as sm
    from model_executor.layers.triton_ops.pdl import pdl_supported

    set_shapes(args.model)
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    layers = [Layer(gen, args.context, args.kind) for _ in range(args.layers)]
    req_to_token = torch.arange(args.context + 1, dtype=torch.int32, device=DEVICE)[None, :].contiguous()
    req_rows = torch.zeros(1, dtype=torch.int64, device=DEVICE)
    seq_lens = torch.tensor([args.context], dtype=torch.int32, device=DEVICE)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    cap = dec.decode_split_cap(1, HEADS, KV_HEADS, sms, dec.get_num_kv_splits(args.context))
    splits = dec.decode_split_plan(cap, args.context)
    ws = dec.alloc_decode_workspace(1, HEADS, HEAD_DIM, splits, DEVICE)
    plan = (req_to_token, req_rows, seq_lens, ws, splits)
    x0 = (torch.randn(1, HIDDEN, device=DEVICE, generator=gen) * 0.5).bfloat16()
    r0 = torch.randn(1, HIDDEN, device=DEVICE, generator=gen).bfloat16()
    table = sm.fused_config(HIDDEN, HEADS * HEAD_DIM, args.kind, sm.device_name("cuda"))
    derived = sm.preload_config(table, layers[0].o[0], None) or table  # (None: all of K does not fit)
    print(f"{torch.cuda.get_device_name(0)}; PDL supported: {pdl_supported(x0.device)}; {args.model} {args.kind}, "
          f"{args.layers} layers, {args.context} tokens, {splits} kv splits; o_proj's table config {table}, "
          f"with PDL {derived}", flush=True)

    # name: (o_proj config, preloaded first tile, launched with PDL)
    variants = {"table": (table, False, False), "preload derived, no PDL": (derived, True, False),
                "pdl table": (table, True, True), "pdl derived": (derived, True, True)}
    for text in args.configs:
        variants[f"pdl {text}"] = (parse_config(text), True, True)

    graphs, same = {}, {}
    try:
        for name, (cfg, pdl, launch_pdl) in variants.items():
            sm.pdl_supported = pdl_supported if launch_pdl else (lambda device: False)
            for _ in range(2):  # compile outside the capture
                chain(layers, x0, r0, plan, cfg, pdl)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = chain(layers, x0, r0, plan, cfg, pdl)
            graph.replay()
            torch.cuda.synchronize()
            graphs[name] = graph
            ref = chain(layers, x0, r0, plan, cfg, False)  # the same config without PDL, eagerly: the same bits
            same[name] = all(torch.equal(a, b) for a, b in zip(out, ref))
    finally:
        sm.pdl_supported = pdl_supported

    rounds = {name: [] for name in variants}
    for _ in range(args.rounds):
        for name, graph in graphs.items():
            times = []
            for _ in range(args.replays):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                graph.replay()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) * 1e3 / args.layers)
            rounds[name].append(statistics.median(times))

    base = rounds["table"]
    print(f"{'variant':<22} {'us a layer (rounds)':<30} {'median':>8} {'vs table':>9} bits")
    rows = []
    for name, times in rounds.items():
        delta = statistics.median(t - b for t, b in zip(times, base))
        print(f"{name:<22} {' '.join(f'{t:.2f}' for t in times):<30} {statistics.median(times):8.2f} "
              f"{delta:+9.2f} {'same' if same[name] else 'DIFFER'}")
        rows.append({"variant": name, "us_per_layer": times, "median": statistics.median(times),
                     "delta_vs_table": delta, "bits_equal_without_pdl": same[name]})
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"probe": "probe_pdl_oproj", "gpu": torch.cuda.get_device_name(0), "layers": args.layers,
                       "context": args.context, "kv_splits": splits, "rows": rows}, f, indent=1)
    return 0 if all(r["bits_equal_without_pdl"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())

"""bench_fused_ops: the fused Triton ops of a decode layer against what they replace, per call inside a CUDA
graph.

    python -m benchmarks.kernels.bench_fused_ops --json out.json
    python -m benchmarks.kernels.bench_fused_ops --shapes 8b qwen3-30b-a3b --tokens 1
    python -m benchmarks.kernels.bench_fused_ops --gemv --shapes 1b 8b

For each shape and token count: add+RMSNorm, rotary, SiLU-and-mul and the KV store against their PyTorch
forward_native; the decode rotary + KV store kernel against the rotary kernel then the store kernel; for Qwen3
shapes, q/k RMSNorm + rotary + KV store in one kernel against qk_norm_rope then the store. Each call is
repeated CALLS times in one graph (no launch overhead, as in the decode graphs). --gemv: at one row, the
RMSNorm folded into the qkv GEMV against add+RMSNorm then the GEMV, and o_proj + residual add + the
post-attention norm + gate/up + SiLU in two kernels against three, over copies of cold weights. Prints a
table, writes JSON.
The builders are shared with tests/kernels/test_fused_ops_gpu.py (bf16 at serving shapes).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from benchmarks.tuning.tune_small_m_gemm import time_calls

DEV = "cuda"
BF16 = torch.bfloat16
CALLS = 32
# (hidden, intermediate, num_heads, num_kv_heads, head_dim): Llama-3.2-1B, Llama-3.1-8B, SmolLM2-135M
SHAPES = {"1b": (2048, 8192, 32, 8, 64), "8b": (4096, 14336, 32, 8, 128), "135m": (576, 1536, 9, 3, 64)}
# (num_heads, num_kv_heads, head_dim): Qwen3-30B-A3B, Qwen3-8B
QWEN3_SHAPES = {"30b-a3b": (32, 4, 128), "8b": (32, 8, 128)}
LLAMA3_SCALING = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 8192}


def randn(*shape, gen, dtype=BF16, scale=1.0):
    return (torch.randn(*shape, generator=gen, device=DEV) * scale).to(dtype)


def make_norm(hidden, gen):
    from model_executor.layers.norm import RMSNorm

    norm = RMSNorm(hidden, 1e-5).to(DEV)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(hidden, generator=gen, device=DEV) * 0.4 + 0.8)
    return norm.to(BF16)


def make_rope(head_dim):
    from model_executor.layers.rotary import RotaryEmbedding

    # the model casts every floating buffer to the serving dtype (build_model's model.to(dtype)): so do we
    return RotaryEmbedding(head_dim, 131072, 500000.0, LLAMA3_SCALING).to(DEV, BF16)


def make_qkv(num_tokens, num_heads, num_kv_heads, head_dim, gen):
    qkv = randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, gen=gen)
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    return (q.view(num_tokens, num_heads, head_dim), k.view(num_tokens, num_kv_heads, head_dim),
            v.view(num_tokens, num_kv_heads, head_dim))


def llama_pairs(shape, num_tokens, gen) -> dict:
    """{op: (fused call, what it replaces)} on fresh inputs of a Llama shape."""
    from model_executor.layers.activation import SiluAndMul
    from model_executor.layers.rotary_store_kv import rotary_store_kv
    from model_executor.memory_pool import KVCache

    hidden, inter, num_heads, num_kv_heads, head_dim = SHAPES[shape]
    norm, rope, act = make_norm(hidden, gen), make_rope(head_dim), SiluAndMul()
    pool = KVCache(1024, 1, num_kv_heads, head_dim, BF16, DEV)
    x, residual = randn(num_tokens, hidden, gen=gen), randn(num_tokens, hidden, gen=gen)
    q, k, v = make_qkv(num_tokens, num_heads, num_kv_heads, head_dim, gen)
    positions, loc = torch.arange(num_tokens, device=DEV), torch.arange(num_tokens, device=DEV) + 1
    gate_up = randn(num_tokens, 2 * inter, gen=gen)

    def native_set_kv():
        pool.k_buffers[0][loc] = k.to(BF16)
        pool.v_buffers[0][loc] = v.to(BF16)

    def rotary_then_set_kv():
        rope(positions, q, k)
        pool.set_kv(0, loc, k, v)

    return {
        "add+rmsnorm vs pytorch": (lambda: norm(x, residual), lambda: norm.forward_native(x, residual)),
        "rotary vs pytorch": (lambda: rope(positions, q, k), lambda: rope.forward_native(positions, q, k)),
        "silu_and_mul vs pytorch": (lambda: act(gate_up), lambda: act.forward_native(gate_up)),
        "set_kv vs pytorch": (lambda: pool.set_kv(0, loc, k, v), native_set_kv),
        "rot+set_kv vs rotary, set_kv": (
            lambda: rotary_store_kv(positions, q, k, v, rope.cos_sin_cache, *pool.get_kv(0), loc),
            rotary_then_set_kv),
    }


def qwen3_pairs(shape, num_tokens, gen) -> dict:
    """{op: (fused call, the two kernels it replaces)} on fresh inputs of a Qwen3 attention shape."""
    from model_executor.layers.qk_norm_rope import qk_norm_rope
    from model_executor.layers.rotary_store_kv import rotary_store_kv
    from model_executor.memory_pool import KVCache

    num_heads, num_kv_heads, head_dim = QWEN3_SHAPES[shape]
    rope, q_norm, k_norm = make_rope(head_dim), make_norm(head_dim, gen), make_norm(head_dim, gen)
    pool = KVCache(1024, 1, num_kv_heads, head_dim, BF16, DEV)
    q, k, v = make_qkv(num_tokens, num_heads, num_kv_heads, head_dim, gen)
    positions, loc = torch.arange(num_tokens, device=DEV), torch.arange(num_tokens, device=DEV) + 1

    def fused():
        rotary_store_kv(positions, q, k, v, rope.cos_sin_cache, *pool.get_kv(0), loc,
                        q_norm_weight=q_norm.weight, k_norm_weight=k_norm.weight, norm_eps=q_norm.eps)

    def two_kernels():
        qk_norm_rope(positions, q, k, q_norm.weight, k_norm.weight, q_norm.eps, rope.cos_sin_cache)
        pool.set_kv(0, loc, k, v)

    return {"qk_norm+rot+set_kv vs qk_norm_rope, set_kv": ([fused] * CALLS, [two_kernels] * CALLS)}


def gemv_pairs(shape, kind, gen) -> dict:
    """{op: (fused calls, the calls they replace)} at one decode row: the input RMSNorm (with its residual
    add) folded into the qkv GEMV, against the add+RMSNorm kernel and then the GEMV; each list walks copies
    of the weight (Weights: more bytes than the L2 holds), as a step does."""
    from benchmarks.tuning.tune_small_m_gemm import Weights
    from model_executor.layers.triton_ops import small_m_gemm as sm

    hidden, _, num_heads, num_kv_heads, head_dim = SHAPES[shape]
    norm = make_norm(hidden, gen)
    x, residual = randn(1, hidden, gen=gen), randn(1, hidden, gen=gen)
    wts = Weights(kind, (num_heads + 2 * num_kv_heads) * head_dim, hidden, gen)
    fused = [lambda w=w, s=s: sm.small_m_rmsnorm_linear(x, norm.weight, norm.eps, residual, w, s)
             for w, s in zip(wts.w, wts.s)]
    other = [lambda w=w, s=s: sm.small_m_linear(norm(x, residual)[0], w, s) for w, s in zip(wts.w, wts.s)]
    if fused[0]() is None:
        print(f"{shape} {kind} qkv: no single-split GEMV in the table, skipped")
        return {}
    return {f"{kind} rmsnorm+qkv vs add+rmsnorm, qkv": (fused, other), **post_norm_pairs(shape, kind, gen)}


def post_norm_pairs(shape, kind, gen) -> dict:
    """At one decode row: o_proj with the residual add and the norm's sums in its epilogue, then the gate/up
    + SiLU GEMV on the pre-normed row (two kernels), against o_proj, add+RMSNorm, gate/up + SiLU (three)."""
    from benchmarks.tuning.tune_small_m_gemm import Weights
    from model_executor.layers.triton_ops import small_m_gemm as sm

    hidden, inter, num_heads, _, head_dim = SHAPES[shape]
    norm = make_norm(hidden, gen)
    x, residual = randn(1, num_heads * head_dim, gen=gen), randn(1, hidden, gen=gen)
    o_wts, gu_wts = Weights(kind, hidden, num_heads * head_dim, gen), Weights(kind, 2 * inter, hidden, gen)
    copies, n_o, n_gu = max(len(o_wts.w), len(gu_wts.w)), len(o_wts.w), len(gu_wts.w)
    pairs = [(o_wts.w[i % n_o], o_wts.s[i % n_o], gu_wts.w[i % n_gu], gu_wts.s[i % n_gu]) for i in range(copies)]
    def fused_pair(w, s, gw, gs):
        out = sm.small_m_linear_add_rmsnorm(x, w, s, None, None, residual, norm.weight, norm.eps)
        return None if out is None else sm.small_m_silu_and_mul(out[0], gw, gs)

    fused = [lambda w=w, s=s, gw=gw, gs=gs: fused_pair(w, s, gw, gs) for w, s, gw, gs in pairs]
    other = [lambda w=w, s=s, gw=gw, gs=gs: sm.small_m_silu_and_mul(
        norm(sm.small_m_linear(x, w, s), residual)[0], gw, gs) for w, s, gw, gs in pairs]
    if fused[0]() is None or other[0]() is None:
        print(f"{shape} {kind} o_proj, gate/up: no single-split GEMVs in the table, skipped")
        return {}
    return {f"{kind} o_proj+add+norm, gate/up+silu vs 3 kernels": (fused, other)}


def parse_shape(text: str) -> str:
    names = [*SHAPES, *(f"qwen3-{s}" for s in QWEN3_SHAPES)]
    if text not in names:
        raise argparse.ArgumentTypeError(f"unknown shape {text!r}: one of {', '.join(names)}")
    return text


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.kernels.bench_fused_ops",
                                description=__doc__.splitlines()[0])
    p.add_argument("--shapes", type=parse_shape, nargs="+", default=["1b", "8b", "qwen3-30b-a3b"])
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 64])
    p.add_argument("--gemv", action="store_true",
                   help="instead: the RMSNorm folded into the one-row qkv GEMV (bf16 and FP8 weights, table configs)")
    p.add_argument("--json", dest="json_out")
    args = p.parse_args(argv)
    if any(t < 1 for t in args.tokens):
        p.error("--tokens must be positive")
    if not torch.cuda.is_available():
        print("bench_fused_ops: needs a CUDA device (the kernels are timed inside CUDA graphs)", file=sys.stderr)
        return 2
    gen = torch.Generator(device=DEV).manual_seed(0)
    rows = []
    print(f"{torch.cuda.get_device_name()}, bf16, {CALLS} calls per graph, us per call")
    print(f"{'shape':>14} {'T':>4}  {'op':<42} {'fused us':>9} {'other us':>9} {'speed-up':>8}")
    for shape in args.shapes:
        for num_tokens in ([1] if args.gemv else args.tokens):
            if args.gemv:
                if shape not in SHAPES:
                    continue
                pairs = {**gemv_pairs(shape, "bf16", gen), **gemv_pairs(shape, "fp8", gen)}
            elif shape.startswith("qwen3-"):
                pairs = qwen3_pairs(shape.removeprefix("qwen3-"), num_tokens, gen)
            else:
                pairs = {op: ([f] * CALLS, [o] * CALLS) for op, (f, o) in llama_pairs(shape, num_tokens, gen).items()}
            for op, (fused, other) in pairs.items():
                fused_us, other_us = time_calls(fused), time_calls(other)
                rows.append({"shape": shape, "tokens": num_tokens, "op": op, "fused_us": round(fused_us, 2),
                             "other_us": round(other_us, 2)})
                print(f"{shape:>14} {num_tokens:>4}  {op:<42} {fused_us:>9.2f} {other_us:>9.2f} "
                      f"{other_us / fused_us:>7.2f}x")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

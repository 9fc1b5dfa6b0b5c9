"""tune_small_m_gemm: time the small-M GEMM kernel's configs on this GPU for the linear layers of the model
shapes (M = 1 .. 16 rows; FP8 weights also 32 and 64) and write the fastest per (weight kind, N, K, M bucket) as the table that
model_executor/layers/triton_ops/small_m_gemm_config.py reads at start-up.

    python -m benchmarks.tuning.tune_small_m_gemm                      # all shapes, tp 1 and 2; writes the table
    python -m benchmarks.tuning.tune_small_m_gemm --quick --out $OUT/small_m_gemm_NVIDIA_H200.json

Weight kinds: "bf16" (against F.linear, i.e. cuBLAS: the table says "cublas" where that is faster), "fp8"
(per-channel scales, against the W8A8 path it replaces: _scaled_mm on activations quantized beforehand) and
"fp8_block" (128x128 block scales, against the block-scaled Triton GEMM); for both FP8 kinds the table says
"w8a8" where the path it replaces is faster. The W8A8 baseline leaves the activation quantization out of its
time: three of a layer's four linears quantize inside the RMSNorm or SiLU-and-mul kernel before them
(quantization/fp8_linear.py), so their GEMM is what the kernel has to beat.

Timing: every call of a measurement reads its own copy of the weight, enough copies that together they exceed
the L2 cache (a decode step reads each weight once, cold), all captured in one CUDA graph (a decode step is a
graph replay: no launch overhead); the median of a few replays over the number of calls. A layer that fuses its
neighbours' work at up to 4 rows (qkv, gate_up; at tp 1 o and down: Fusion) has each config it can fuse (a
single-split GEMV or tl.dot tile; qkv and gate_up pair their rows) timed in both forms: fused, as it runs (FUSE
true in the table), and plain (FUSE false). The plain forms, the other configs and the baseline pay the time of
the neighbours' own kernels, measured at the same rows (the RMSNorm, and the rotary + KV store or the
SiLU-and-mul; after o and down the add + RMSNorm): what each choice costs the step. (Kernel times apart are not
the step: a table change is kept on the step's measurement, benchmarks/tuning/table_candidates.py and
ab_tables.py; see README.md here.)
Search, per (kind, N, K, M): column/K tiles (up to 4 rows also the GEMV variant's; for both FP8 kinds
above one row also the X_FP8 variant's, FP8 x on FP8 tensor cores, an entry the W8A8 path runs instead of
_scaled_mm or the block GEMM)
at a split count that gives about two programs per SM, then the split count for the best tile (of each
variant), then warps/stages for the best of those (skipped with --quick). Without --quick the X_FP8 variant's
configs are instead the joint grid XFP8_JOINT_TILES x XFP8_SPLITS, compiled first in --compile-workers processes.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import dataclasses
import json
import math
import multiprocessing as mp
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from model_executor.configs import SHAPES, shape_path
from model_executor.layers.triton_ops.small_m_gemm_dispatch import MAX_FUSED_ROWS as SMALL_M_FUSED_ROWS
from model_executor.model_config import ModelConfig

DEFAULT_MODELS = ("llama-3.2-1b", "llama-3.1-8b", "qwen3-8b")
KINDS = ("bf16", "fp8", "fp8_block")
ROTATE_BYTES = 128 << 20  # weight copies per measurement: over twice an H100/H200 L2 (50 MB)
MIN_COPIES = 2
REPLAYS = 5
# The kernel replaces cuBLAS (bf16) only when this much faster; FP8's other path must be this much faster
# than the kernel to keep its place: no flips on noise.
OTHER_MARGIN = 0.98
BLOCK = (128, 128)  # the block-wise FP8 checkpoints' scale block
DEVICE = "cuda"  # (a CPU smoke run of the search logic swaps it)


def linear_shapes(cfg: ModelConfig, tp: int) -> dict[str, tuple[int, int]]:
    """One rank's (N, K) of each linear of a decoder layer (as models/llama.py builds them)."""
    from model_executor.distributed.parallel_state import heads_per_rank, kv_heads_per_rank

    h, d = cfg.hidden_size, cfg.head_dim
    q = heads_per_rank(cfg.num_attention_heads, tp) * d
    kv = kv_heads_per_rank(cfg.num_key_value_heads, tp) * d
    inter = cfg.intermediate_size // tp
    shapes = {"qkv": (q + 2 * kv, h), "o": (h, q)}
    if len(cfg.moe_layers) < cfg.num_hidden_layers:  # some layers have a dense MLP
        shapes.update(gate_up=(2 * inter, h), down=(h, inter))
    return shapes


def router_shape(cfg: ModelConfig) -> tuple[int, int] | None:
    """An MoE model's router gate (replicated on every rank and never quantized: layers/moe/layer.py)."""
    return (cfg.num_experts, cfg.hidden_size) if cfg.moe_layers else None


@dataclass(frozen=True)
class Fusion:
    """A linear whose single-split kernel takes its neighbours' work at up to SMALL_M_FUSED_ROWS rows
    (quantization/base.py, models/llama.py): "qkv" takes the input RMSNorm (a PrenormedRow from the down
    projection before it) and the rotary + KV store; "gate_up" the post-attention RMSNorm (from o_proj) and the
    SiLU-and-mul; "o" and "down" (one rank: tp 1) the residual add and the sums of squares of the norm after
    them (the add + RMSNorm epilogue, which makes that PrenormedRow); "head" (the LM head, one rank: tp 1) the final
    RMSNorm, as a PrenormedRow from the last down projection. heads: qkv's (q heads, kv heads, head dim).

    A norm's kernel goes only where both the layer before it and the one after fuse; each side's plain forms
    pay for it (neighbour_calls), so each side is ranked as if the other fused. The step judges the pair
    (benchmarks/tuning/table_candidates.py, ab_tables.py)."""
    layer: str
    heads: tuple[int, int, int] = (0, 0, 0)

    @property
    def paired(self) -> bool:
        """Whether the fused kernel pairs its rows (the SiLU's gate and up, a head's two halves): half the tile."""
        return self.layer in PAIRED_LAYERS

    @property
    def needs_pairs(self) -> bool:
        """Whether only a config whose tile pairs (smc.pairs) runs fused: a paired layer's, and the LM head's (the
        down projection before it makes a PrenormedRow only for a consumer whose config pairs:
        small_m_gemm.takes_prenormed)."""
        return self.paired or self.layer == "head"


PAIRED_LAYERS = ("qkv", "gate_up")
EPILOGUE_LAYERS = ("o", "down")  # fused at tp 1 only: at tp 2 their all-reduce comes before the add
FUSED_LAYERS = (*PAIRED_LAYERS, *EPILOGUE_LAYERS)
# The unfused kernels' calls per measurement (small activations: no weight copies to rotate).
NEIGHBOUR_CALLS = 32


def fused_shapes(cfgs: list[ModelConfig], tps: list[int]) -> dict[tuple[int, int], Fusion]:
    """{(N, K): its Fusion} for the layers that fuse their neighbours' work, over the models and tps."""
    from model_executor.distributed.parallel_state import heads_per_rank, kv_heads_per_rank

    fused: dict[tuple[int, int], Fusion] = {}
    for cfg in cfgs:
        for tp in tps:
            for name, shape in linear_shapes(cfg, tp).items():
                if name in FUSED_LAYERS and (tp == 1 or name not in EPILOGUE_LAYERS):
                    heads = (heads_per_rank(cfg.num_attention_heads, tp),
                             kv_heads_per_rank(cfg.num_key_value_heads, tp), cfg.head_dim)
                    fused.setdefault(shape, Fusion(name, heads if name == "qkv" else (0, 0, 0)))
            if tp == 1:
                fused.setdefault(lm_head_shape(cfg, tp), Fusion("head"))
    return fused


def fusable(cfg, paired: bool = True) -> bool:
    """Whether a fused layer's paths can run this config fused (small_m_gemm.fused_config): single_split, not
    marked plain (FUSE False), and for a layer that pairs its rows (Fusion.needs_pairs) pairs()."""
    from model_executor.layers.triton_ops import small_m_gemm_config as smc

    return cfg.FUSE is not False and smc.single_split(cfg) and (smc.pairs(cfg) or not paired)


def best_of(results: list, neighbour_us: float = 0.0, paired: bool = True) -> tuple[float, object]:
    """The fastest (us, config) of `results` by what the layer's step costs: a fusable config's time (measured
    fused, where the layer fuses), any other's (FUSE false included) plus neighbour_us, the time of the kernels
    the fusion would have saved (0 where the layer fuses nothing). paired: the layer's Fusion.paired."""
    def cost(r) -> float:
        return r[0] + (0.0 if fusable(r[1], paired) else neighbour_us)

    us, cfg = min(results, key=cost)
    return cost((us, cfg)), cfg


def lm_head_shape(cfg: ModelConfig, tp: int) -> tuple[int, int]:
    """One rank's LM head GEMM (layers/embedding.py: the vocabulary split in equal blocks)."""
    return (-(-cfg.vocab_size // tp), cfg.hidden_size)


def time_calls(calls: list[Callable[[], object]], replays: int = REPLAYS) -> float:
    """Median microseconds per call over `replays` replays of one CUDA graph holding every call."""
    calls[0]()  # compile / pick kernels outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / len(calls))
    del graph
    return statistics.median(times)


class Weights:
    """Copies of one random weight of a kind (and its scales), rotating so the set exceeds the L2 cache."""

    def __init__(self, kind: str, n: int, k: int, gen: torch.Generator):
        from model_executor.layers.quantization import fp8_math as fm

        w = (torch.randn(n, k, device=DEVICE, generator=gen) * 0.02).bfloat16()
        self.block = BLOCK if kind == "fp8_block" else None
        if kind == "bf16":
            w_q, scale = w, None
        elif kind == "fp8":
            w_q, scale = fm.quantize_fp8_per_channel(w)
        else:
            w_q, scale = fm.quantize_fp8_block(w, BLOCK)
        self.bytes = w_q.numel() * w_q.element_size()
        copies = max(MIN_COPIES, math.ceil(ROTATE_BYTES / self.bytes))
        self.w = [w_q.clone() for _ in range(copies)]
        self.s = [None if scale is None else scale.clone() for _ in range(copies)]


def kernel_calls(sm, x: torch.Tensor, wts: Weights, cfg) -> list[Callable[[], object]]:
    return [lambda w=w, s=s: sm.small_m_linear(x, w, s, None, wts.block, config=cfg)
            for w, s in zip(wts.w, wts.s)]


def xfp8_calls(sm, act, wts: Weights, cfg, out_dtype: torch.dtype = torch.bfloat16) -> list[Callable[[], object]]:
    """The X_FP8 GEMM of FP8 rows `act` (codes, scales) with each of wts' weight copies, a call each."""
    return [lambda w=w, s=s: sm.small_m_linear_fp8_act(*act, w, s, None, out_dtype, config=cfg, block=wts.block)
            for w, s in zip(wts.w, wts.s)]


def rope_store(fusion: Fusion, m: int):
    """A RopeStore for m decode tokens of a qkv Fusion's heads (random cos / sin, slots 0 .. m-1 of a small pool)."""
    from model_executor.layers.rotary_store_kv import RopeStore

    hq, hkv, d = fusion.heads
    pool = [torch.zeros(64, hkv, d, device=DEVICE, dtype=torch.bfloat16) for _ in range(2)]
    return RopeStore(torch.arange(m, device=DEVICE) * 37 + 100, torch.randn(4096, d, device=DEVICE),
                     torch.arange(m, device=DEVICE), pool[0], pool[1], hq, hkv)


def fused_calls(sm, fusion: Fusion, x: torch.Tensor, wts: Weights, cfg) -> list[Callable[[], object]]:
    """A fusable config's calls as the fused layer runs it: on a PrenormedRow of x's rows, with the SiLU-and-mul
    (gate_up) or the rotary and KV store (qkv) in its epilogue, at half the column tile (paired rows, as
    small_m_gemm.fused_config gives it), or nothing more (the LM head); o and down on x, with the residual add
    and the norm's sums of squares in the epilogue."""
    from model_executor.layers.norm import PrenormedRow

    if fusion.layer in EPILOGUE_LAYERS:
        n = wts.w[0].shape[0]
        residual = torch.randn(x.shape[0], n, device=DEVICE, dtype=x.dtype)
        norm_weight = torch.rand(n, device=DEVICE, dtype=x.dtype) + 0.5
        return [lambda w=w, s=s: sm.small_m_linear_add_rmsnorm(x, w, s, None, wts.block, residual, norm_weight, 1e-5,
                                                               config=cfg)
                for w, s in zip(wts.w, wts.s)]
    row = PrenormedRow(x, torch.rand(x.shape[0] * 16, device=DEVICE) + 0.5, 1e-5)
    if fusion.layer == "head":
        return [lambda w=w, s=s: sm.small_m_prenormed_linear(row, w, s, None, wts.block, config=cfg)
                for w, s in zip(wts.w, wts.s)]
    paired = dataclasses.replace(cfg, BLOCK_N=cfg.BLOCK_N // 2)
    if fusion.layer == "gate_up":
        return [lambda w=w, s=s: sm.small_m_silu_and_mul(row, w, s, wts.block, config=paired)
                for w, s in zip(wts.w, wts.s)]
    rope = rope_store(fusion, x.shape[0])
    return [lambda w=w, s=s: sm.small_m_prenormed_linear(row, w, s, None, wts.block, rope=rope, config=paired)
            for w, s in zip(wts.w, wts.s)]


def neighbour_calls(fusion: Fusion, x: torch.Tensor, n: int) -> list[Callable[[], object]]:
    """The kernels the layer runs besides its GEMM where it does not fuse (the fused GEMV does their work): the
    RMSNorm (with the residual add) of x's rows, then the SiLU-and-mul of the [gate; up] output, or the rotary
    and KV store of the qkv output (the LM head: nothing more); o and down: the RMSNorm (with the residual add) of
    their output's rows. NEIGHBOUR_CALLS calls."""
    from model_executor.layers.activation import SiluAndMul
    from model_executor.layers.norm import RMSNorm
    from model_executor.layers.rotary_store_kv import rotary_store_kv

    m, k = x.shape
    y = torch.randn(m, n, device=DEVICE, dtype=x.dtype)
    if fusion.layer in EPILOGUE_LAYERS:
        out_norm, out_residual = RMSNorm(n).to(device=DEVICE, dtype=x.dtype), torch.randn_like(y)
        return [lambda: out_norm(y, out_residual)] * NEIGHBOUR_CALLS
    norm = RMSNorm(k).to(device=DEVICE, dtype=x.dtype)
    residual = torch.randn_like(x)
    if fusion.layer == "head":
        return [lambda: norm(x, residual)] * NEIGHBOUR_CALLS
    if fusion.layer == "gate_up":
        act = SiluAndMul()
        return [lambda: (norm(x, residual), act(y))] * NEIGHBOUR_CALLS
    hq, hkv, d = fusion.heads
    rope = rope_store(fusion, m)
    q, k_, v = y.view(m, -1, d).split([hq, hkv, hkv], dim=1)
    return [lambda: (norm(x, residual), rotary_store_kv(rope.positions, q, k_, v, rope.cos_sin_cache, rope.k_buffer,
                                                        rope.v_buffer, rope.loc))] * NEIGHBOUR_CALLS


def time_config(make_calls: Callable[[], list], cfg) -> float:
    """time_calls of a config's calls; inf (and a line saying so) where the config cannot run on this GPU."""
    try:
        return time_calls(make_calls())
    except Exception as e:  # noqa: BLE001 (over the GPU's resources: skip it, say so)
        print(f"    skipped {cfg}: {type(e).__name__}: {str(e).splitlines()[0][:90]}")
        return math.inf


def baseline_calls(kind: str, x: torch.Tensor, wts: Weights) -> list[Callable[[], object]]:
    """What runs today at this M: F.linear (bf16), or activation quantization + the W8A8 GEMM (FP8)."""
    import torch.nn.functional as F

    from model_executor.layers.quantization import fp8_ops

    if kind == "bf16":
        return [lambda w=w: F.linear(x, w) for w in wts.w]
    if kind == "fp8":  # (x quantized once, outside the timed calls: module docstring)
        xq, xs = fp8_ops.per_token_group_quant_fp8(x, x.shape[-1])
        return [lambda w=w, s=s: torch._scaled_mm(xq, w.t(), scale_a=xs, scale_b=s.view(1, -1), out_dtype=x.dtype)
                for w, s in zip(wts.w, wts.s)]
    xq, xs = fp8_ops.per_token_group_quant_fp8(x, BLOCK[1])
    return [lambda w=w, s=s: fp8_ops.w8a8_block_fp8_matmul(xq, w, xs, s, BLOCK, x.dtype)
            for w, s in zip(wts.w, wts.s)]


def tile_grid(kind: str, quick: bool, m: int = 1) -> list[tuple[int, int]]:
    """(BLOCK_N, BLOCK_K): K tiles of 256-512 bytes of a weight row (block-wise FP8: at most the scale
    block). Above 16 rows (FP8) also shorter K tiles: x's tile [BLOCK_K, rows] grows with the rows."""
    if m > 16:
        bks = (128,) if kind == "fp8_block" else (128, 256)
        return [(bn, bk) for bn in (32, 64, 128) for bk in bks]
    if kind == "fp8_block":
        bks = (128,)
    elif kind == "fp8":
        bks = (256,) if quick else (256, 512)
    else:
        bks = (128,) if quick else (128, 256)
    tiles = [(bn, bk) for bn in (16, 32, 64) for bk in bks]
    # FP8: wide column tiles spread the conversion of x to fp16 (once per program and step) over more rows
    return tiles + [(128, bks[0])] if kind.startswith("fp8") else tiles


def gemv_grid(kind: str, quick: bool, m: int = 1) -> list[tuple[int, int]]:
    """(BLOCK_N, BLOCK_K) of the GEMV configs: narrow column tiles over long K tiles, 8-32 KB of weight per
    step (the step's loads are pipelined: num_stages of them in flight per program). Above one row (up to
    MAX_GEMV_ROWS) each row keeps a float32 tile of sums: K tiles shrink with the rows, at most 16K sums."""
    if kind == "fp8_block":
        return [(8, 128)] if quick and m == 1 else [(bn, 128) for bn in (8, 16, 32) if bn * 128 * m <= 1 << 14]
    bk = 1024 if kind == "fp8" else 512
    if m > 1:
        return [(bn, b) for bn in (4, 8, 16) for b in (bk // m, 2 * bk // m) if bn * b * m <= 1 << 14]
    if quick:
        return [(8, bk), (16, bk)]
    return [(4, 2 * bk), (8, bk), (8, 2 * bk), (16, bk // 2), (16, bk), (32, bk // 2)]


# The warps / stages pass (not with --quick): for the tl.dot tiles, and wider for GEMV configs (their
# pipelining depth is the main knob of a one-row read). 2 warps: at 4 a 32-row tile's mma is split 2 x 2 over
# the warps and each weight is loaded and converted twice (FP8 32 x 256: 5.1 -> 4.3 instructions a weight in
# the sm_90 SASS).
DOT_WARPS_STAGES = ((4, 3), (8, 4), (2, 4))
GEMV_WARPS_STAGES = ((4, 2), (4, 3), (4, 6), (8, 2), (8, 3), (8, 4))


# The X_FP8 configs (not with --quick): every (BLOCK_N, BLOCK_K, num_warps, num_stages) here at every split of
# XFP8_SPLITS, timed jointly: a greedy search (tiles at 4 warps, then splits, then warps) misses the fastest of
# them for most Llama-3.1-8B shapes at 8-64 rows, by 2-35% (docs/benchmarks.md): 32-wide tiles on 2 warps (fp16
# mma.sync), 64 on one warpgroup, 128 on one or two, 256 on two (FP8 wgmma).
XFP8_JOINT_TILES = ([(32, 128, 2, s) for s in (3, 4)] + [(64, bk, 4, s) for bk in (128, 256) for s in (3, 4)]
                    + [(128, bk, w, s) for bk in (128, 256) for w in (4, 8) for s in (3, 4)]
                    + [(256, 128, 8, s) for s in (2, 3)])
XFP8_SPLITS = (1, 2, 4, 8)


def xfp8_config(bn: int, bk: int, split: int, warps: int, stages: int):
    """An X_FP8 config (BLOCK_N, BLOCK_K, SPLIT_K, num_warps, num_stages)."""
    from model_executor.layers.triton_ops import small_m_gemm as sm

    return sm.GemmConfig(BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=split, num_warps=warps, num_stages=stages, X_FP8=True)


def xfp8_joint_grid(k: int, kind: str = "fp8") -> list:
    """The joint grid's X_FP8 configs for a weight of K columns (block scales: K steps of at most a scale block)."""
    return [xfp8_config(bn, bk, s, w, st) for bn, bk, w, st in XFP8_JOINT_TILES for s in XFP8_SPLITS
            if k // s >= bk and (kind == "fp8" or bk <= BLOCK[1])]


def _xfp8_inputs(m: int, n: int, k: int, block: tuple[int, int] | None):
    """FP8 rows, their scales, an FP8 weight and its scales (per channel, or per block)."""
    xq = torch.randn(m, k, device=DEVICE).to(torch.float8_e4m3fn)
    w = torch.randn(n, k, device=DEVICE).to(torch.float8_e4m3fn)
    if block is None:
        return xq, torch.rand(m, device=DEVICE), w, torch.rand(n, device=DEVICE)
    return (xq, torch.rand(m, -(-k // block[1]), device=DEVICE), w,
            torch.rand(-(-n // block[0]), -(-k // block[1]), device=DEVICE))


def _compile_xfp8(jobs: list) -> int:
    """Worker: launch each (config, m, n, k, block) once, so that its kernel is in Triton's disk cache."""
    from model_executor.layers.triton_ops import small_m_gemm as sm

    done = 0
    for cfg, m, n, k, block in jobs:
        try:
            sm.small_m_linear_fp8_act(*_xfp8_inputs(m, n, k, block), None, torch.bfloat16, config=cfg, block=block)
            torch.cuda.synchronize()
            done += 1
        except Exception as e:  # noqa: BLE001 (over the GPU's resources: the timing pass says so too)
            print(f"    compile skipped {cfg}: {type(e).__name__}: {str(e).splitlines()[0][:90]}", flush=True)
    return done


def precompile_xfp8(jobs: list, workers: int) -> None:
    """Compile the X_FP8 kernel of every (config, m, n, k, block) job in `workers` processes, round robin (a
    joint grid is 64 kernels a row bucket, 40 with block scales: compiled one by one in the timing process they
    would take minutes)."""
    if not jobs or workers < 1:
        return
    t0 = time.perf_counter()
    chunks = [c for c in (jobs[i::workers] for i in range(workers)) if c]
    with cf.ProcessPoolExecutor(len(chunks), mp_context=mp.get_context("spawn")) as pool:
        done = sum(pool.map(_compile_xfp8, chunks))
    print(f"compiled {done} of {len(jobs)} X_FP8 kernels in {time.perf_counter() - t0:.0f} s ({len(chunks)} processes)")


def tune_one(sm, kind: str, n: int, k: int, m: int, wts: Weights, gen, quick: bool, log: list,
             fusion: Fusion | None = None) -> dict:
    """Best config for one (kind, N, K, M) and the baseline's time; every timing goes to `log`. fusion: the
    layer fuses its neighbours' work at M rows: fusable configs are timed fused, and the other configs' times and
    the baseline's include the neighbours' kernels (neighbour_us, best_of)."""
    x = torch.randn(m, k, device=DEVICE, generator=gen).bfloat16()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    paired = fusion is None or fusion.needs_pairs

    act = None
    if kind.startswith("fp8") and m > 1:  # the X_FP8 variant: x quantized beforehand, per token or per 1 x 128
        from model_executor.layers.quantization import fp8_ops  # group (as the W8A8 path has it)

        act = fp8_ops.per_token_group_quant_fp8(x, k if wts.block is None else wts.block[1])

    def calls(cfg):
        if cfg.X_FP8:
            return xfp8_calls(sm, act, wts, cfg, x.dtype)
        if fusion is not None and fusable(cfg, paired):
            return fused_calls(sm, fusion, x, wts, cfg)
        return kernel_calls(sm, x, wts, cfg)

    def measure(cfg):
        us = time_config(lambda: calls(cfg), cfg)
        if us < math.inf:
            log.append([round(us, 2), sm.config_to_json(cfg)])
        return us

    def measure_forms(cfg) -> list:
        """[(us, cfg)]; where the layer can fuse this config, its fused form (FUSE True) and its plain one (FUSE
        False, the neighbours' kernels run apart): the table entry says which the step runs. A tl.dot tile of a
        layer that pairs its rows is also timed fused with PAIR_DOT (its two halves as one dot)."""
        if fusion is None or not fusable(cfg, paired):
            return [(measure(cfg), cfg)]
        forms = [dataclasses.replace(cfg, FUSE=True), dataclasses.replace(cfg, FUSE=False)]
        if fusion.paired and not cfg.GEMV:
            forms.append(dataclasses.replace(cfg, FUSE=True, PAIR_DOT=True))
        return [(measure(c), c) for c in forms]


    results = []
    joint = act is not None and not quick  # the X_FP8 variant: the joint grid
    tiles = [(bn, bk, False) for bn, bk in tile_grid(kind, quick, m)]
    if fusion is not None and fusion.paired and not kind.startswith("fp8"):  # a paired 64 + 64-row tile (wgmma)
        tiles += [(128, bk, False) for bk in (128, 256) if (128, bk) not in tile_grid(kind, quick, m)]
    if m <= sm.MAX_GEMV_ROWS:
        tiles += [(bn, bk, True) for bn, bk in gemv_grid(kind, quick, m)]
    if act is not None and not joint:
        tiles += [(bn, bk, None) for bn, bk in tile_grid(kind, quick, m)]  # (None: X_FP8)
    for bn, bk, gemv in tiles:
        split = sm.split_for(n, k, bn, bk, sms)
        # A fused layer also times each weight-only tile at one split, the only split its fusions run (the paired
        # 64 + 64-row tile is the one whose dots stay on sm_90's wgmma: docs/benchmarks.md)
        for s in sorted({split, 1}) if fusion is not None and gemv is not None else (split,):
            cfg = sm.GemmConfig(BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=s, num_warps=4, num_stages=4, GEMV=bool(gemv),
                                X_FP8=gemv is None)
            results += measure_forms(cfg)
    for x_fp8 in (False, True) if act is not None and not joint else (False,):  # the split pass for the best of each
        best_us, best = min((r for r in results if r[1].X_FP8 == x_fp8), key=lambda r: r[0])
        for split in (1, 2, 4, 8, 16):
            if split != best.SPLIT_K and k // split >= best.BLOCK_K:
                cfg = dataclasses.replace(best, SPLIT_K=split, FUSE=None, PAIR_DOT=False)
                results += measure_forms(cfg)
    if joint:
        results += [(measure(cfg), cfg) for cfg in xfp8_joint_grid(k, kind)]
    neighbour_us = time_calls(neighbour_calls(fusion, x, n)) if fusion is not None else 0.0
    best_us, best = best_of(results, neighbour_us, paired)
    if not quick and not (joint and best.X_FP8):  # (the joint grid has its warps and stages)
        for warps, stages in GEMV_WARPS_STAGES if best.GEMV else DOT_WARPS_STAGES:
            cfg = dataclasses.replace(best, num_warps=warps, num_stages=stages)  # (in best's form, FUSE as it is)
            results.append((measure(cfg), cfg))
        best_us, best = best_of(results, neighbour_us, paired)
    default = sm.default_config(m, n, k, kind)
    default_us = next((us for us, c in results if c == default), None) or measure(default)
    base_us = time_calls(baseline_calls(kind, x, wts)) + neighbour_us
    return {"best": best, "best_us": best_us, "default_us": best_of([(default_us, default)], neighbour_us, paired)[0],
            "base_us": base_us, "neighbour_us": neighbour_us}


def table_entry(kind: str, result: dict):
    """The kernel's best config, or the other path's name ("cublas", "w8a8") where the kernel is not
    faster by the margin (bf16) or where the other path is faster by it (FP8: weight-only should win). (Where
    the layer fuses, both times include what the fusion saves: tune_one.)"""
    from model_executor.layers.triton_ops.small_m_gemm import OTHER_PATHS

    if kind.startswith("fp8"):
        other_wins = result["base_us"] < OTHER_MARGIN * result["best_us"]
    else:
        other_wins = result["best_us"] > OTHER_MARGIN * result["base_us"]
    return OTHER_PATHS[kind] if other_wins else result["best"]


def merge_tables(kept: dict, tuned: dict) -> dict:
    """`kept` (a table file's content) with `tuned`'s entries put in or replaced, per (kind, N, K, M
    bucket): a run that tuned only some M buckets keeps the others; no _meta."""
    merged = {kind: {nk: dict(per_m) for nk, per_m in entries.items()}
              for kind, entries in kept.items() if kind != "_meta"}
    for kind, entries in tuned.items():
        for nk, per_m in entries.items():
            merged.setdefault(kind, {}).setdefault(nk, {}).update(per_m)
    return merged


def merge_base(out: Path, server_table: Path) -> Path | None:
    """The table a --merge run keeps entries from: --out where it exists, else the server's table (so a tuned
    copy written elsewhere is whole: ab_tables would otherwise run its missing entries on the other path), or
    None where neither exists."""
    return next((p for p in (out, server_table) if p.exists()), None)


def only_shapes(spec: list[str], shapes: list, heads: list) -> tuple[list, list]:
    """--shapes: the (N, K) of `shapes` and `heads` that `spec` ("N,K" strings) names; ValueError for a bad
    spec or a shape the models do not have."""
    try:
        only = {(int(n), int(k)) for n, k in (s.split(",") for s in spec)}
    except ValueError:
        raise ValueError(f"expected N,K pairs, got {spec}") from None
    if only - set(shapes) - set(heads):
        raise ValueError(f"{sorted(only - set(shapes) - set(heads))} are not the models' linears")
    return [s for s in shapes if s in only], [s for s in heads if s in only]


def model_summary(models, tps, kinds, ms, results) -> list[str]:
    """Per model, tp, kind and M: the decoder linears' time per step (layers x the four GEMMs, plus the LM
    head for bf16 when it was tuned), today's path vs the table's choice."""
    lines = []
    for name in models:
        cfg = ModelConfig.from_pretrained(shape_path(name))
        for tp in tps:
            shapes = linear_shapes(cfg, tp).values()
            for kind in kinds:
                for m in ms:
                    rs = [results.get((kind, n, k, m)) for n, k in shapes]
                    if None in rs:
                        continue
                    rs = rs * cfg.num_hidden_layers
                    router = results.get((kind, *router_shape(cfg), m)) if router_shape(cfg) else None
                    rs += [router] * len(cfg.moe_layers) if router is not None else []
                    head = results.get((kind, *lm_head_shape(cfg, tp), m))
                    rs += [head] if head is not None else []
                    base = sum(r["base_us"] for r in rs)
                    chosen = sum(r["base_us"] if isinstance(table_entry(kind, r), str) else r["best_us"]
                                 for r in rs)
                    what = "GEMMs per step" + (" + head" if head else "")
                    lines.append(f"{name:>13} tp{tp} {kind:>9} M={m:<2} {what}: today {base / 1e3:.3f} ms, "
                                 f"table {chosen / 1e3:.3f} ms ({base / chosen:.2f}x)")
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.tuning.tune_small_m_gemm",
                                description=__doc__.splitlines()[0])
    p.add_argument("--model", nargs="+", default=list(DEFAULT_MODELS), choices=SHAPES, help="model shapes")
    p.add_argument("--tp", type=int, nargs="+", default=[1, 2],
                   help="tensor-parallel sizes (one rank's shapes)")
    p.add_argument("--kind", nargs="+", default=list(KINDS), choices=KINDS, help="weight kinds")
    p.add_argument("--m", type=int, nargs="+", default=[1, 2, 4, 8, 16], choices=(1, 2, 4, 8, 16, 32, 64),
                   help="row counts: the table's M buckets (a batch uses the next one up; 32 and 64: FP8 only)")
    p.add_argument("--no-lm-head", dest="lm_head", action="store_false",
                   help="skip the LM heads (bf16 only: the head is never quantized)")
    p.add_argument("--quick", action="store_true", help="a smaller grid (tiles, no warps/stages pass)")
    p.add_argument("--budget-s", type=float, default=150.0,
                   help="past this many seconds the remaining cases are tuned as with --quick")
    p.add_argument("--out", help="the table file (default: the one the server reads, for this GPU)")
    p.add_argument("--merge", action="store_true",
                   help="keep the --out table's entries (where --out does not exist yet: the server's table's) for the "
                        "cases this run does not tune (default: replace it)")
    p.add_argument("--json", dest="json_out", help="also write every timing here")
    p.add_argument("--shapes", nargs="+", metavar="N,K",
                   help="only these (N, K) of the models' linears (default: all of them)")
    p.add_argument("--compile-workers", type=int, default=12,
                   help="processes that compile the X_FP8 joint grid before the timing; 0: none")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("tune_small_m_gemm needs a CUDA device", file=sys.stderr)
        return 2
    from model_executor.layers.triton_ops import small_m_gemm as sm
    from model_executor.layers.triton_ops import small_m_gemm_config as smc

    ms = sorted(set(args.m))
    if "fp8" in "".join(args.kind) and torch.cuda.get_device_capability() < (8, 9):
        p.error("FP8 kinds need an sm89+ GPU; pass --kind bf16")
    cfgs = [ModelConfig.from_pretrained(shape_path(name)) for name in args.model]
    shapes = sorted({s for cfg in cfgs for tp in args.tp for s in linear_shapes(cfg, tp).values()})
    fused = fused_shapes(cfgs, args.tp)
    heads = sorted({lm_head_shape(cfg, tp) for cfg in cfgs for tp in args.tp}) if args.lm_head else []
    heads += sorted({router_shape(cfg) for cfg in cfgs if router_shape(cfg)} - set(heads))  # bf16 only, too
    if args.shapes:
        try:
            shapes, heads = only_shapes(args.shapes, shapes, heads)
        except ValueError as e:
            p.error(f"--shapes: {e}")
    dev = sm.device_name("cuda")
    out = Path(args.out) if args.out else smc.table_path(dev)
    gen = torch.Generator(device="cuda").manual_seed(0)
    t0 = time.perf_counter()
    print(f"{len(shapes)} (N, K) shapes x {args.kind} (+ {len(heads)} LM heads / routers, bf16) x M {ms} on "
          f"{torch.cuda.get_device_name()}"
          f"{' (quick)' if args.quick else ''}")
    print(f"{'kind':>9} {'N':>6} {'K':>6} {'M':>3} {'today us':>9} {'default':>8} {'best us':>8} "
          f"{'vs today':>8} {'TB/s':>5}  table entry (today: F.linear = cublas for bf16, "
          f"act-quant + W8A8 GEMM = w8a8 for fp8)")
    if not args.quick:
        precompile_xfp8([(cfg, m, n, k, BLOCK if kind == "fp8_block" else None)
                         for kind in args.kind if kind.startswith("fp8") for n, k in shapes
                         for m in ms if 1 < m <= sm.max_rows(kind) for cfg in xfp8_joint_grid(k, kind)],
                        args.compile_workers)
    table: dict = {kind: {} for kind in args.kind}
    results, timings = {}, {}
    over_budget = False
    for kind in args.kind:
        for n, k in shapes + (heads if kind == "bf16" else []):
            wts = Weights(kind, n, k, gen)
            entries = table[kind].setdefault(f"{n},{k}", {})
            for m in (m for m in ms if m <= sm.max_rows(kind)):
                log: list = []
                quick = args.quick or time.perf_counter() - t0 > args.budget_s
                if quick and not args.quick and not over_budget:
                    over_budget = True
                    print(f"  (past --budget-s {args.budget_s:.0f}: "
                          "the remaining cases get the --quick grid)")
                fusion = fused.get((n, k)) if m <= SMALL_M_FUSED_ROWS else None
                r = tune_one(sm, kind, n, k, m, wts, gen, quick, log, fusion=fusion)
                results[(kind, n, k, m)] = r
                entry = table_entry(kind, r)
                entries[str(m)] = sm.config_to_json(None if isinstance(entry, str) else entry, kind)
                timings[f"{kind},{n},{k},{m}"] = {key: round(r[key], 2)
                                                  for key in ("base_us", "best_us", "default_us", "neighbour_us")}
                timings[f"{kind},{n},{k},{m}"]["all"] = log
                timings[f"{kind},{n},{k},{m}"]["fusion"] = fusion.layer if fusion is not None else None
                chosen = r["base_us"] if isinstance(entry, str) else r["best_us"]
                print(f"{kind:>9} {n:>6} {k:>6} {m:>3} {r['base_us']:>9.1f} {r['default_us']:>8.1f} "
                      f"{r['best_us']:>8.1f} {r['base_us'] / chosen:>7.2f}x "
                      f"{wts.bytes / chosen / 1e6:>5.2f}  {entries[str(m)]}")
            del wts
            torch.cuda.empty_cache()
    for line in model_summary(args.model, args.tp, args.kind, ms, results):
        print(line)
    meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
            "triton": __import__("triton").__version__, "quick": args.quick,
            "written": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    base = merge_base(out, smc.table_path(dev)) if args.merge else None
    if base is not None:  # (the kept table's _meta stays, with a line for this run)
        kept = json.loads(base.read_text())
        table = merge_tables(kept, table)
        meta = {**kept.get("_meta", {}), f"merged {meta['written']}": {
            **meta, "models": args.model, "tp": args.tp, "kinds": args.kind, "m": ms, "shapes": args.shapes}}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"_meta": meta, **table}, indent=1) + "\n")
    print(f"wrote {out} ({time.perf_counter() - t0:.0f} s)")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({**meta, "timings": timings}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Compile duet's Triton kernels for an H100 / H200 (sm_90) on a machine without a GPU.

The CPU tests run the kernels in Triton's interpreter, which executes their Python: it does not type-check
them as the compiler does, nor lower them (a module-level float read inside a kernel runs there and is a
compile error on a GPU). This script calls the launchers with CPU tensors while each kernel's `run` only
records its arguments, then compiles every recorded launch for GPUTarget("cuda", 90, 32) with the
specializations a GPU launch would give (16-byte aligned pointers, integers divisible by 16 marked so, an
integer 1 a constant), down
to a cubin through the ptxas that Triton's wheel carries. It prints one line per case and exits non-zero if
any case does not compile, has fp16 arithmetic in its PTX (FP16_MATH), or is a small-M GEMM whose wgmma chain
ptxas serialized (WGMMA_SERIALIZED) or, in a case whose name says wgmma, that has none. tests/kernels/test_sm90_compile.py runs it in a subprocess with Triton in compiled
mode.

    python tests/sm90_compile.py
    python tests/sm90_compile.py --table PATH --model llama-3.1-8b llama-3.2-1b

--table: each bf16 entry of a small-M table for the models' linears (tp 1), compiled plain and, where the layer
fuses it, in the fused form it runs (benchmarks/tuning/tune_small_m_gemm.py: fused_calls, at the paired layers' half
tile): a line each with the tile the kernel ran, whether it uses wgmma, ptxas's registers and spill bytes, and
SERIALIZED where ptxas serialized its wgmma chain. It exits non-zero if any does not compile or is serialized.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.pop("TRITON_INTERPRET", None)

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import get_ptxas  # (the one Triton compiles sm_90 with)
from triton.compiler import ASTSource

TARGET = GPUTarget("cuda", 90, 32)
POINTER = {torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32", torch.int32: "*i32",
           torch.int64: "*i64", torch.float8_e4m3fn: "*fp8e4nv", torch.uint8: "*u8", torch.int8: "*i8"}
OPTIONS = ("num_warps", "num_stages", "num_ctas", "launch_pdl")
# fp16 multiplies / FMAs / adds. Every kernel computes in float32 and uses fp16 only as a tensor-core operand;
# LLVM narrows fptrunc(fpext(bf16 x) * 2^-4) to an fp16 multiply after the conversion, which overflows for
# |x| > 65504 (kernels.to_f16_scaled avoids it).
FP16_MATH = re.compile(r"\b(?:mul|fma|add|sub)(?:\.rn)?(?:\.ftz)?\.f16(?:x2)?\b")
# ptxas's advisory that it serialized a kernel's wgmma chain (a wait after every wgmma): a small-M tl.dot tile whose
# ADD_NORM residual was held in registers across its loop ran 1.5x slower on the H200 (docs/benchmarks.md).
WGMMA_SERIALIZED = "C7514"


class Recorder:
    """While active, the given kernels record their launches instead of running."""

    def __init__(self, *kernels):
        self.kernels, self.launches = kernels, []

    def __enter__(self):
        for kernel in self.kernels:
            kernel.run = lambda *args, grid, warmup, _k=kernel, **kw: self.launches.append((_k, args, kw))
        return self

    def __exit__(self, *exc):
        for kernel in self.kernels:
            del kernel.run


def compile_launch(kernel, args, kwargs):
    """Compile one recorded launch for sm_90; returns Triton's compiled kernel."""
    kwargs = dict(kwargs)
    if kwargs.get("DOT_F32"):  # the interpreter's bf16-dot workaround (CPU tensors); off in a GPU launch
        kwargs["DOT_F32"] = False
        if "DOT_PRECISION" in kwargs:
            kwargs["DOT_PRECISION"] = "tf32"
    options = {k: kwargs.pop(k) for k in list(kwargs) if k in OPTIONS}
    values = dict(zip(kernel.arg_names, args), **kwargs)
    unspecialized = {kernel.arg_names[i] if isinstance(i, int) else i for i in (kernel.do_not_specialize or ())}
    signature, constexprs, attrs = {}, {}, {}
    for i, name in enumerate(kernel.arg_names):
        value = values[name]
        if i in kernel.constexprs or value is None or isinstance(value, (bool, str)):
            signature[name], constexprs[name] = "constexpr", value
        elif isinstance(value, torch.Tensor):
            signature[name] = POINTER[value.dtype]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(value, int) and value == 1 and name not in unspecialized:
            signature[name], constexprs[name] = "constexpr", 1  # as a launch specializes a 1 (a unit stride)
        elif isinstance(value, int):
            signature[name] = "i32" if -(2**31) <= value < 2**31 else "i64"
            if value % 16 == 0 and value and name not in unspecialized:
                attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(value, float):
            signature[name] = "fp32"
        else:
            raise TypeError(f"{kernel.fn.__name__}: argument {name} of type {type(value).__name__}")
    src = ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=TARGET, options=options)


def ptxas_report(compiled) -> str:
    """What ptxas -v says assembling the kernel's PTX for sm_90a (registers, spills, advisories)."""
    with tempfile.TemporaryDirectory() as tmp:
        ptx = Path(tmp) / "kernel.ptx"
        ptx.write_text(compiled.asm["ptx"])
        out = subprocess.run([get_ptxas(TARGET.arch).path, "--gpu-name", "sm_90a", "-v", str(ptx), "-o",
                              str(Path(tmp) / "kernel.cubin")], capture_output=True, text=True, check=True)
    return out.stdout + out.stderr


def wgmma_serialized(compiled, report: str | None = None) -> bool:
    """Whether ptxas, assembling the kernel's PTX for sm_90a, says it serialized the kernel's wgmma chain (report:
    ptxas_report's, where the caller has it)."""
    return "warp_group_dot" in compiled.asm["ttgir"] and WGMMA_SERIALIZED in (report or ptxas_report(compiled))


def with_pdl(module, launch):
    """launch() with the module's pdl_supported answering True, as on an sm_90 GPU (the CPU has no PDL)."""
    saved = module.pdl_supported
    module.pdl_supported = lambda device: True
    try:
        return launch()
    finally:
        module.pdl_supported = saved


def cases():
    """(name, the kernels it launches, a function that launches them with CPU tensors)."""
    from model_executor.layers.attention.triton_ops import decode_attention as dec
    from model_executor.layers.attention.triton_ops import extend_attention as ext
    from model_executor.layers.moe import kernels as moe
    from model_executor.layers.moe import router_kernel, small_batch
    from model_executor.layers.norm import PrenormedRow
    from model_executor.layers.quantization import fp8_ops
    from model_executor.layers.rotary_store_kv import RopeStore
    from model_executor.layers.triton_ops import kernels, qk_norm_rope, rotary_store_kv
    from model_executor.layers.triton_ops import small_m_gemm as sm

    bf16, fp8 = torch.bfloat16, torch.float8_e4m3fn
    gemv = sm.GemmConfig(BLOCK_N=4, BLOCK_K=256, num_warps=4, num_stages=3, GEMV=True)
    x = torch.randn(1, 512, dtype=bf16)
    w = torch.randn(256, 512, dtype=bf16)
    w8, s8 = torch.randn(256, 512).to(fp8), torch.rand(256)
    row = PrenormedRow(x, torch.rand(8), 1e-5)
    gemm = (sm._small_m_gemm_kernel, sm._split_k_reduce_kernel)

    x3 = torch.randn(3, 512, dtype=bf16)
    x2 = torch.randn(2, 512, dtype=bf16)
    x8 = torch.randn(8, 512, dtype=bf16)

    def rope(tokens=1):
        heads, d = 4 + 2 * 2, 32
        return RopeStore(torch.arange(3, 3 + tokens), torch.randn(16, d), torch.arange(5, 5 + tokens),
                         torch.zeros(8, 2, d, dtype=bf16), torch.zeros(8, 2, d, dtype=bf16), 4, 2), \
            torch.randn(heads * d, 512, dtype=bf16)

    def decode(pool_dtype, fused, v_words=None, tile=None, bs=2, after_qkv=False, splits=4, sinks=None, window=None):
        hq, hk, d = 8, 2, 64
        q = torch.randn(bs, hq, d, dtype=bf16)
        pool = torch.randn(64, hk, d).to(pool_dtype)
        logits, lse, counters = dec.alloc_decode_workspace(bs, hq, d, 4, "cpu")
        dec.decode_attention_fwd(q, pool, pool, torch.empty_like(q), torch.zeros(3, 64, dtype=torch.int32),
                                 torch.tensor([1, 2][:bs]), torch.tensor([40, 50][:bs]), logits, lse, splits, 0.125,
                                 counters=counters, fused_combine=fused, v_words=v_words, tile=tile,
                                 after_qkv=after_qkv, sliding_window=window,
                                 sinks=None if sinks is None else torch.randn(hq, dtype=sinks))

    def extend(pool_dtype, sinks=None, window=None):
        n, hq, hk, d = 16, 8, 2, 64
        q, k = torch.randn(n, hq, d, dtype=bf16), torch.randn(n, hk, d, dtype=bf16)
        pool = torch.randn(64, hk, d).to(pool_dtype)
        t = lambda *v: torch.tensor(v)
        ext.extend_attention_fwd(q, k, k.clone(), torch.empty_like(q), pool, pool, torch.arange(n),
                                 torch.zeros(2, 64, dtype=torch.int32), t(1), t(40), t(n), t(0), n, 1 / math.sqrt(d),
                                 sliding_window=window, sinks=None if sinks is None else torch.randn(hq, dtype=sinks))

    def w8a8_block():
        a = torch.randn(20, 256, dtype=bf16)
        aq, a_s = fp8_ops._per_token_group_quant_impl(a, 128)
        fp8_ops._w8a8_block_matmul_impl(aq, torch.randn(256, 256).to(fp8), a_s, torch.rand(2, 2), 128, 128, bf16)

    def norms():
        t = torch.randn(3, 512, dtype=bf16)
        kernels.rmsnorm_fwd(t, torch.ones(512, dtype=bf16), 1e-5, torch.empty_like(t), t.clone(), torch.empty_like(t))
        kernels.silu_and_mul_fwd(torch.randn(3, 1024, dtype=bf16), torch.empty(3, 512, dtype=bf16))

    def rotary_store(qk_norm):
        q, k = torch.randn(2, 8, 64, dtype=bf16), torch.randn(2, 2, 64, dtype=bf16)
        pool = torch.zeros(16, 2, 64, dtype=bf16)
        norm = {"q_norm_weight": torch.ones(64, dtype=bf16), "k_norm_weight": torch.ones(64, dtype=bf16),
                "norm_eps": 1e-6} if qk_norm else {}
        rotary_store_kv.rotary_store_kv_fwd(torch.tensor([3, 4]), q, k, k.clone(), torch.randn(16, 64), pool,
                                            pool.clone(), torch.tensor([5, 6]), 1.0, 1.0, **norm)

    def experts(path, fp8_weights):
        e, hidden, inter, tokens, top_k = 8, 256, 128, 3, 2
        w13, w2 = torch.randn(e, 2 * inter, hidden, dtype=bf16), torch.randn(e, hidden, inter, dtype=bf16)
        scales = {}
        if fp8_weights:
            w13, w2 = w13.to(fp8), w2.to(fp8)
            scales = {"w13_scale": torch.rand(e, 2 * inter), "w2_scale": torch.rand(e, hidden)}
        ids = torch.randint(0, e, (tokens, top_k), generator=torch.Generator().manual_seed(0)).to(torch.int32)
        moe.fused_experts_triton(torch.randn(tokens, hidden, dtype=bf16), w13, w2, torch.rand(tokens, top_k), ids,
                                 path=path, **scales)

    def extend_rotary_and_store():
        q, k = torch.randn(5, 8, 64, dtype=bf16), torch.randn(5, 2, 64, dtype=bf16)
        pos, cache, pool = torch.arange(5), torch.randn(16, 64), torch.zeros(16, 2, 64, dtype=bf16)
        kernels.rotary_fwd(pos, q, k, cache)
        qk_norm_rope.qk_norm_rope_fwd(pos, q, k, torch.ones(64, dtype=bf16), torch.ones(64, dtype=bf16), 1e-6, cache)
        kernels.store_kv_fwd(pool, pool.clone(), torch.arange(5), k, k.clone())

    def router():
        router_kernel.topk_softmax(torch.randn(3, 64, dtype=bf16), 4, True)

    moe_gemvs = (small_batch._gate_up_gemv_kernel, small_batch._down_gemv_combine_kernel)
    return [
        ("MoE experts, small-batch GEMVs, bf16", moe_gemvs, lambda: experts("small_batch", False)),
        ("MoE experts, small-batch GEMVs, FP8 per channel", moe_gemvs, lambda: experts("small_batch", True)),
        ("MoE experts, align + grouped GEMMs, bf16", (moe._moe_align_kernel, moe._fused_moe_gemm_kernel),
         lambda: experts("grouped", False)),
        ("MoE router top-k softmax", (router_kernel._topk_softmax_kernel,), router),
        ("small-M GEMV bf16", gemm, lambda: sm._launch(x, w, None, None, None, gemv)),
        ("small-M GEMV bf16, SiLU-and-mul on a PrenormedRow", gemm,
         lambda: sm._launch(x, w, None, None, None, gemv, silu_mul=True, prenormed=row)),
        ("small-M GEMV bf16, RMSNorm + residual, rotary + KV store", gemm,
         lambda: sm._launch(x, rope()[1], None, None, None, gemv, rope=rope()[0],
                            norm=sm.RmsNormInput(torch.ones(512, dtype=bf16), 1e-5, x.clone(), torch.empty_like(x)))),
        ("small-M GEMV bf16, rotary + KV store, signalling PDL dependents", gemm,
         lambda: with_pdl(sm, lambda: sm._launch(x, rope()[1], None, None, None, gemv, rope=rope()[0],
                                                 prenormed=row))),
        ("small-M GEMV FP8, 3 rows, RMSNorm + residual, rotary + KV store", gemm,
         lambda: sm._launch(x3, rope(3)[1].to(fp8), torch.rand(rope(3)[1].shape[0]), None, None, gemv,
                            rope=rope(3)[0], norm=sm.RmsNormInput(torch.ones(512, dtype=bf16), 1e-5, x3.clone(),
                                                                  torch.empty_like(x3)))),
        ("small-M GEMV bf16, add + RMSNorm epilogue", gemm,
         lambda: sm._launch(x, w, None, None, None, gemv, add_norm=sm.AddRmsNormOutput(
             torch.randn(1, 256, dtype=bf16), torch.ones(256, dtype=bf16), torch.empty(1, 256, dtype=bf16),
             torch.empty(64)))),
        ("small-M GEMV bf16, 3 rows: add + RMSNorm epilogue; SiLU-and-mul on their PrenormedRow", gemm,
         lambda: (sm._launch(x3, w, None, None, None, gemv, add_norm=sm.AddRmsNormOutput(
             torch.randn(3, 256, dtype=bf16), torch.ones(256, dtype=bf16), torch.empty(3, 256, dtype=bf16),
             torch.empty(3 * 64))), sm._launch(x3, w, None, None, None, gemv, silu_mul=True,
                                               prenormed=PrenormedRow(x3, torch.rand(3 * 8), 1e-5)))),
        ("small-M tl.dot FP8 block scales, single split, 3 rows: SiLU-and-mul on a PrenormedRow; add + RMSNorm",
         gemm, lambda: (sm._launch(x3, w8, torch.rand(2, 4), None, (128, 128), sm.GemmConfig(BLOCK_N=32, BLOCK_K=128),
                                   silu_mul=True, prenormed=PrenormedRow(x3, torch.rand(3 * 8), 1e-5)),
                        sm._launch(x3, w8, torch.rand(2, 4), None, (128, 128), sm.GemmConfig(BLOCK_N=32, BLOCK_K=128),
                                   add_norm=sm.AddRmsNormOutput(torch.randn(3, 256, dtype=bf16),
                                                                torch.ones(256, dtype=bf16),
                                                                torch.empty(3, 256, dtype=bf16), torch.empty(3 * 8))))),
        ("small-M tl.dot bf16, single split, 2 rows: rotary + KV store on a PrenormedRow", gemm,
         lambda: sm._launch(x2, rope(2)[1], None, None, None, sm.GemmConfig(BLOCK_N=32, BLOCK_K=128),
                            rope=rope(2)[0], prenormed=PrenormedRow(x2, torch.rand(2 * 8), 1e-5))),
        ("small-M tl.dot bf16, a 64-wide wgmma tile, 8 rows: add + RMSNorm epilogue", gemm,
         lambda: sm.small_m_linear_add_rmsnorm(torch.randn(8, 512, dtype=bf16), w, None, None, None,
                                               torch.randn(8, 256, dtype=bf16), torch.ones(256, dtype=bf16), 1e-5,
                                               config=sm.GemmConfig(BLOCK_N=64, BLOCK_K=256))),
        ("small-M tl.dot bf16, paired halves as one 64-row wgmma dot, 8 rows: rotary + KV store on a PrenormedRow",
         gemm, lambda: sm._launch(x8, rope(8)[1], None, None, None,
                                  sm.GemmConfig(BLOCK_N=32, BLOCK_K=256, PAIR_DOT=True), rope=rope(8)[0],
                                  prenormed=PrenormedRow(x8, torch.rand(8 * 8), 1e-5))),
        ("small-M GEMV FP8 per channel", gemm, lambda: sm._launch(x, w8, s8, None, None, gemv)),
        ("small-M GEMV FP8, add + RMSNorm epilogue, PDL (its first weight tile before gdc_wait)", gemm,
         lambda: with_pdl(sm, lambda: sm._launch(x, w8, s8, None, None, gemv, pdl=True, add_norm=sm.AddRmsNormOutput(
             torch.randn(1, 256, dtype=bf16), torch.ones(256, dtype=bf16), torch.empty(1, 256, dtype=bf16),
             torch.empty(64))))),
        ("small-M GEMV FP8 block scales, preloaded first tile, PDL", gemm,
         lambda: with_pdl(sm, lambda: sm._launch(x, w8, torch.rand(2, 4), None, (128, 128),
                                                 sm.GemmConfig(BLOCK_N=8, BLOCK_K=128, GEMV=True), pdl=True))),
        ("small-M GEMV FP8 per channel, 3 rows", gemm,
         lambda: sm._launch(torch.randn(3, 512, dtype=bf16), w8, s8, None, None, gemv)),
        ("small-M GEMV FP8 block scales, 4 rows, split K", gemm,
         lambda: sm._launch(torch.randn(4, 512, dtype=bf16), w8, torch.rand(2, 4), None, (128, 128),
                            sm.GemmConfig(BLOCK_N=8, BLOCK_K=128, SPLIT_K=2, GEMV=True))),
        ("small-M tl.dot FP8 block scales, split K", gemm,
         lambda: sm._launch(torch.randn(3, 512, dtype=bf16), w8, torch.rand(2, 4), None, (128, 128),
                            sm.GemmConfig(BLOCK_N=32, BLOCK_K=128, SPLIT_K=2))),
        ("small-M tl.dot FP8 weights, 32 rows (the dot padded to 32)", gemm,
         lambda: sm._launch(torch.randn(24, 512, dtype=bf16), w8, s8, None, None,
                            sm.GemmConfig(BLOCK_N=64, BLOCK_K=128, SPLIT_K=2))),
        ("RMSNorm + residual, FP8 quantization per 128-group", (fp8_ops._rmsnorm_quant_kernel,),
         lambda: fp8_ops._rmsnorm_quant_impl(torch.randn(3, 640, dtype=bf16), torch.randn(3, 640, dtype=bf16),
                                             torch.ones(640, dtype=bf16), 1e-6, 128)),
        ("SiLU-and-mul, FP8 quantization per token", (fp8_ops._silu_and_mul_quant_kernel,),
         lambda: fp8_ops._silu_and_mul_quant_impl(torch.randn(3, 2 * 1536, dtype=bf16), 1536)),
        ("small-M X_FP8: FP8 rows on FP8 tensor cores, 64 rows, split K", gemm,
         lambda: sm.small_m_linear_fp8_act(torch.randn(40, 512).to(fp8), torch.rand(40, 1), w8, s8, None, bf16,
                                           sm.GemmConfig(BLOCK_N=64, BLOCK_K=128, SPLIT_K=2, X_FP8=True))),
        ("small-M X_FP8 with 128 x 128 block scales, 32 rows, split K", gemm,
         lambda: sm.small_m_linear_fp8_act(torch.randn(20, 512).to(fp8), torch.rand(20, 4), w8,
                                           torch.rand(2, 4), None, bf16,
                                           sm.GemmConfig(BLOCK_N=64, BLOCK_K=128, SPLIT_K=2, X_FP8=True),
                                           (128, 128))),
        ("decode attention, bf16 pool, merge in stage 1", (dec._decode_stage1_kernel, dec._decode_stage2_kernel),
         lambda: decode(bf16, True)),
        ("decode attention, FP8 pool, V loaded as bytes, stage 2", (dec._decode_stage1_kernel,
                                                                     dec._decode_stage2_kernel),
         lambda: decode(fp8, False, v_words=False)),
        ("decode attention, FP8 pool, V loaded as 32-bit words", (dec._decode_stage1_kernel, dec._decode_stage2_kernel),
         lambda: decode(fp8, False, v_words=True)),
        ("decode attention signalling PDL dependents, both stages", (dec._decode_stage1_kernel,
                                                                      dec._decode_stage2_kernel),
         lambda: with_pdl(dec, lambda: (decode(bf16, True), decode(fp8, False)))),
        ("decode attention after the qkv kernel, one request: first step preloaded, PDL, both pools",
         (dec._decode_stage1_kernel,),
         lambda: with_pdl(dec, lambda: (decode(bf16, True, bs=1, after_qkv=True),
                                        decode(fp8, True, bs=1, after_qkv=True)))),
        ("decode attention, warp splits, both pools (FP8: V as words)",
         (dec._decode_stage1_kernel, dec._decode_stage2_kernel),
         lambda: (decode(bf16, True, tile=(16, 2, 3, True)), decode(fp8, False, tile=(32, 1, 3, True)))),
        ("decode attention with attention sinks and a window: one stage, merge in stage 1, stage 2",
         (dec._decode_stage1_kernel, dec._decode_stage2_kernel),
         lambda: (decode(bf16, None, splits=1, sinks=bf16, window=8), decode(bf16, True, sinks=bf16, window=8),
                  decode(bf16, False, sinks=bf16))),
        ("extend attention with attention sinks and a window", (ext._extend_kernel,),
         lambda: extend(bf16, sinks=bf16, window=8)),
        ("extend attention, bf16 pool", (ext._extend_kernel,), lambda: extend(bf16)),
        ("extend attention, FP8 pool", (ext._extend_kernel,), lambda: extend(fp8)),
        ("FP8 activation quantization + W8A8 block GEMM",
         (fp8_ops._per_token_group_quant_kernel, fp8_ops._w8a8_block_matmul_kernel), w8a8_block),
        ("add + RMSNorm, SiLU-and-mul", (kernels._rmsnorm_kernel, kernels._silu_and_mul_kernel), norms),
        ("rotary + KV store", (rotary_store_kv._rotary_store_kv_kernel,), lambda: rotary_store(False)),
        ("extend: rotary, q/k norm + rotary, KV store",
         (kernels._rotary_kernel, qk_norm_rope._qk_norm_rope_kernel, kernels._store_kv_kernel),
         extend_rotary_and_store),
        ("q/k norm + rotary + KV store", (rotary_store_kv._rotary_store_kv_kernel,), lambda: rotary_store(True)),
    ]


def table_main(path: str, models: list[str]) -> int:
    """--table: the table's bf16 entries for the models' linears, plain and fused, as the module docstring says."""
    import types

    import benchmarks.tuning.tune_small_m_gemm as tune
    from model_executor.configs import shape_path
    from model_executor.layers.triton_ops import small_m_gemm as sm
    from model_executor.layers.triton_ops import small_m_gemm_config as smc
    from model_executor.model_config import ModelConfig

    tune.DEVICE = "cpu"
    table = json.loads(Path(path).read_text())["bf16"]
    cfgs = [ModelConfig.from_pretrained(shape_path(name)) for name in models]
    fused = tune.fused_shapes(cfgs, [1])
    shapes = sorted({s for c in cfgs for s in tune.linear_shapes(c, 1).values()}
                    | {tune.lm_head_shape(c, 1) for c in cfgs})
    failed = 0
    for n, k in shapes:
        fusion = fused.get((n, k))
        wts = types.SimpleNamespace(w=[torch.randn(n, k, dtype=torch.bfloat16)], s=[None], block=None)
        for m_key, entry in table.get(f"{n},{k}", {}).items():
            if entry == "cublas":
                continue
            cfg, m = smc.GemmConfig(**entry), int(m_key)
            x = torch.randn(m, k, dtype=torch.bfloat16)
            forms = {"plain": tune.kernel_calls(sm, x, wts, cfg)}
            if fusion and m <= sm.MAX_FUSED_ROWS and smc.fuses(cfg) and tune.fusable(cfg, fusion.needs_pairs):
                forms[f"fused {fusion.layer}"] = tune.fused_calls(sm, fusion, x, wts, cfg)
            for form, calls in forms.items():
                case = f"{n},{k} m={m} {form}"
                try:
                    with Recorder(sm._small_m_gemm_kernel, sm._split_k_reduce_kernel) as rec:
                        calls[0]()
                    kernel, args, kwargs = next(r for r in rec.launches if r[0] is sm._small_m_gemm_kernel)
                    compiled = compile_launch(kernel, args, kwargs)
                    report = ptxas_report(compiled)
                    regs = re.search(r"Used (\d+) registers", report)
                    spill = re.search(r"(\d+) bytes spill stores", report)
                    serialized = wgmma_serialized(compiled, report)
                    failed += serialized
                    print(f"{case}: {'gemv' if cfg.GEMV else 'dot'} BLOCK_N {kwargs['BLOCK_N']} of {cfg.BLOCK_N}, "
                          f"BLOCK_K {cfg.BLOCK_K}, split {cfg.SPLIT_K}, {cfg.num_warps} warps, {cfg.num_stages} stages"
                          f"{', PAIR_DOT' if cfg.PAIR_DOT else ''}: wgmma {'warp_group_dot' in compiled.asm['ttgir']}, "
                          f"{regs.group(1) if regs else '?'} registers, {spill.group(1) if spill else 0} B spilled"
                          f"{', SERIALIZED' if serialized else ''}", flush=True)
                except Exception:  # noqa: BLE001 (report every case, then fail)
                    failed += 1
                    print(f"FAILED {case}:\n{traceback.format_exc(limit=-3)}", flush=True)
    return 1 if failed else 0


def main() -> int:
    failed = 0
    for name, kernels_, launch in cases():
        try:
            with Recorder(*kernels_) as rec:
                launch()
            if not rec.launches:
                raise RuntimeError("no launch recorded")
            built = [compile_launch(*launch_) for launch_ in rec.launches]
            for (k, _, _), c in zip(rec.launches, built):
                if FP16_MATH.search(c.asm["ptx"]):  # no kernel means to: the compiler narrowed a float32 op
                    raise RuntimeError(f"{k.fn.__name__}: fp16 arithmetic in the PTX "
                                       f"({sorted(set(FP16_MATH.findall(c.asm['ptx'])))})")
                if k.fn.__name__ == "_small_m_gemm_kernel" and wgmma_serialized(c):
                    raise RuntimeError(f"{k.fn.__name__}: ptxas serialized its wgmma chain ({WGMMA_SERIALIZED})")
                if "wgmma" in name and k.fn.__name__ == "_small_m_gemm_kernel" \
                        and "warp_group_dot" not in c.asm["ttgir"]:  # (a case named so must run one)
                    raise RuntimeError(f"{k.fn.__name__}: no wgmma (warp_group_dot) in its TTGIR")
            print(f"ok {name}: " + ", ".join(f"{k.fn.__name__} ({len(c.asm['cubin'])} B cubin)"
                                             for (k, _, _), c in zip(rec.launches, built)), flush=True)
        except Exception:  # noqa: BLE001 (report every case, then fail)
            failed += 1
            print(f"FAILED {name}:\n{traceback.format_exc(limit=-3)}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    if "--table" in sys.argv:
        import argparse

        parser = argparse.ArgumentParser(description="compile a small-M table's bf16 entries for sm_90")
        parser.add_argument("--table", required=True)
        parser.add_argument("--model", nargs="+", default=["llama-3.1-8b", "llama-3.2-1b"])
        opts = parser.parse_args()
        sys.exit(table_main(opts.table, opts.model))
    sys.exit(main())

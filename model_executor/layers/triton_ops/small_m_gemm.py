"""Small-M GEMM: y[M, N] = x[M, K] @ W[N, K]^T (+ bias) for decode-sized M, streaming W at memory bandwidth.

At a handful of rows a linear layer is a read of its weight and nothing else; cuBLAS's small-N kernels
leave bandwidth unused (split-K plus a separate reduce, tiles shaped for larger M). Here each program owns
BLOCK_N output columns for every row of x and walks its K range once, so each weight byte is read once.

Layouts (row-major, unit stride in the last dim):
    x      [M, K]  bfloat16 / float16, M <= MAX_M (FP8 weights: MAX_M_FP8)
    W      [N, K]  x's dtype, or float8_e4m3fn dequantized in the kernel (weight-only: x stays in its dtype,
                   no activation quantization; e4m3 values are exact in bf16/fp16, so the only roundings
                   are fp32's, in the sums and the scale products, and the final cast)
    scale  per output channel [N] float32, or per (bn x bk) block [ceil(N / bn), ceil(K / bk)] float32
           (Fp8BlockMethod's `weight_scale_inv`): real weight = W x scale
    bias   [N] (any float dtype; added in fp32)
    y      [M, N]  x's dtype, fp32 accumulation

With FP8 weights the tensor-core dot runs in fp16 (see X_PRESCALE: bf16 x is rescaled into fp16's range
by a power of two, losslessly in practice), because converting e4m3 to bf16 costs a second instruction per
value, enough to make the kernel conversion-bound below memory bandwidth.

Why the dot is "swapped": tl.dot needs every dimension >= 16, and the row count is the small one, so the
kernel computes y^T tiles: acc[BLOCK_N, 16] = W_tile[BLOCK_N, BLOCK_K] @ x_tile^T[BLOCK_K, 16]. The weight
tile is the left operand (the large dimension, where the MMA shapes want it) and x's rows are padded to 16
(FP8 rows above 16: to the next power of two, BLOCK_M) with zeros (masked loads; padding rows are never
stored). With one row, that row is loaded and converted once per step and broadcast to the
16 columns (FP8: the conversion of x would otherwise cost half as much again as the weight's).

For up to MAX_GEMV_ROWS rows a config may instead ask for GEMV: CUDA-core products of a [BLOCK_N, BLOCK_K]
weight tile and each x row, summed over K at the end (no padding to 16 rows, narrower column tiles; with
several rows the tile is converted once and each row has its own float32 sums); the tuner picks whichever
is faster at M = 1, 2 and 4. Its K loop names its pipeline depth (num_stages) itself: Triton pipelines the
loads of a loop without tl.dot only then. Each fusion below takes up to MAX_GEMV_ROWS rows, where the table's
config for the weight at that row count fuses() (a single-split GEMV; a single-split tl.dot tile where its
FUSE says so; the RMSNorm inside the K loop: a GEMV only). `small_m_silu_and_mul` runs decode rows' [gate; up]
GEMV and the SiLU-and-mul in one such kernel; `small_m_rmsnorm_linear` folds the RMSNorm (and residual add)
that feeds the qkv projection of decode tokens into its GEMV and, given a RopeStore, runs their rotary and
KV store in the epilogue (rows paired within each head, as the SiLU pairs gate and up rows). A norm between
two GEMVs can also go in pieces: `small_m_linear_add_rmsnorm` adds the residual in its epilogue and writes
norm weight * h and the sums of h^2 per row and program (a PrenormedRow), and the next GEMV
(`small_m_silu_and_mul`, `small_m_prenormed_linear`, with the rotary epilogue too) takes those rows and
scales each by its 1 / rms at the end: a decode layer's post-attention norm between o_proj and gate/up, and
the next layer's input norm between down and qkv.

Split-K (SPLIT_K > 1) gives small-N layers enough programs to fill the GPU. It is deterministic: each split
writes its fp32 partial to a workspace [splits, M, N], and the splits are added in order 0..S-1, the bias
added and the sum cast, so the same inputs give the same bits (graph replay equals eager). Up to
IN_KERNEL_REDUCE_MAX_ROWS rows the GEMM does that itself: each split counts its arrival on its column tile's
counter and the one that arrives last adds the tile (which split that is does not change the order of the
sums) and zeroes the counter; above, a second kernel does. The workspace is allocated per call with a size
fixed by (splits, M, N), the counters once per device (split_counters, zeros between calls): no host sync,
CUDA-graph safe. One stream at a time: two split-K GEMMs running at once on one device would share counters.

Configs (BLOCK_N, BLOCK_K, SPLIT_K, num_warps, num_stages, GEMV) come from a table tuned per GPU by
benchmarks/tune_small_m_gemm.py (configs/small_m_gemm_<GPU>.json, read once, at the first decode-sized
GEMM: the warm-up before graph capture; never tuned while serving): per weight kind
("bf16", "fp16", "fp8", "fp8_block"), (N, K) and M bucket, a config, or the name of the path the layer
takes otherwise where that measured faster: "cublas" (F.linear) for bf16/fp16, "w8a8" (activation
quantization + the FP8 GEMM) for FP8. Without an entry, bf16/fp16 weights keep F.linear and FP8 weights
use `default_config`: weight-only FP8 reads half the bytes of bf16 and skips the activation-quantization
kernel, so it needs no table to win.

`small_m_linear` is the entry point. While something traces (dynamo, a dispatch mode) it goes through the
`duet::small_m_gemm` custom op (a fake implementation gives the output's shape), otherwise it calls the
implementation directly, as triton_ops/ops.py does.
"""

from __future__ import annotations

import functools
import json
import logging
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
import triton
import triton.language as tl

from model_executor.layers.norm import PrenormedRow
from model_executor.layers.quantization.base import SMALL_M_BUCKETS, SMALL_M_GEMV_ROWS
from model_executor.layers.rotary_store_kv import RopeStore
from model_executor.layers.triton_ops.kernels import to_f16_scaled
from model_executor.layers.triton_ops.pdl import pdl_supported

logger = logging.getLogger("duet.small_m_gemm")

MAX_M = 16  # rows of x (bf16 / fp16 weights); the dot's padded row count (tl.dot's minimum) up to it
# FP8 weights up to this many rows, above MAX_M only where the table has a config for the row count's bucket:
# the weight-only read against activation quantization + the W8A8 GEMM, whose cuBLAS kernels at 17-64 rows
# are far from the weights' read (docs/benchmarks.md). Above MAX_M the dot pads the rows to a power of two.
MAX_M_FP8 = 64
# A GEMV config (CUDA-core products) runs up to this many rows: the weight tile is loaded and converted once
# and multiplied into each row's accumulator (a tile of float32 sums per row: registers bound the count).
# Defined beside SMALL_M_MAX, where the layers check it without importing Triton.
MAX_GEMV_ROWS = SMALL_M_GEMV_ROWS
CONFIG_DIR = Path(__file__).parent / "configs"
M_BUCKETS = SMALL_M_BUCKETS  # the row counts the tuner times; a batch uses the next bucket up
FP8 = torch.float8_e4m3fn
# FP8 weights: the dot runs in fp16 (e4m3 -> fp16 is one packed instruction per two values; e4m3 -> bf16
# needs a second conversion per value, which caps the kernel below bandwidth), so bf16 x goes to fp16
# times this power of two: exact for |x| from about 2^-13 up to fp16's max / X_PRESCALE (~1e6), far wider
# than a linear's inputs; below it the error is under 2^-21 absolute, less than bf16's own spacing there.
X_PRESCALE = 2.0**-4


@dataclass(frozen=True)
class GemmConfig:
    BLOCK_N: int
    BLOCK_K: int
    SPLIT_K: int = 1
    num_warps: int = 4
    num_stages: int = 4
    GEMV: bool = False  # <= MAX_GEMV_ROWS rows: CUDA-core products instead of tl.dot (BLOCK_N may be below 16)
    # FP8 weights: x quantized per token (FP8 codes and a scale per row), the dot on FP8 tensor cores. A table
    # entry with it is a config of the W8A8 path (fp8_linear._w8a8), which quantizes x anyway, not of this
    # weight-only one.
    X_FP8: bool = False
    # Whether the layer's fused paths (fused_config) take this config where it is single_split: True / False as
    # the tuner measured the fused form against the plain kernel plus the neighbours' own kernels; None (entries
    # tuned before tl.dot tiles could fuse, layers not timed fused): a GEMV does, a tl.dot tile does not.
    FUSE: bool | None = None

    def __post_init__(self):
        for name in ("BLOCK_N", "BLOCK_K"):
            v = getattr(self, name)
            least = 1 if name == "BLOCK_N" and self.GEMV else 16
            if v < least or v & (v - 1):
                raise ValueError(f"{name} must be a power of two >= {least}, got {v}")
        if self.SPLIT_K < 1 or self.num_warps < 1 or self.num_stages < 1 or (self.X_FP8 and self.GEMV):
            raise ValueError(f"bad small-M GEMM config {self}")


# ---------------------------------------------------------------- kernels


@triton.jit
def _rope_operands(offs_n, rows_m, POS, LOC, COS, stride_cos, HALF: tl.constexpr):
    """The ROPE epilogue's loads, taken before the weights stream (their latency hides under it): each token's
    KV slot and the cos / sin of its position for the program's half rows offs_n ([1, BLOCK_M] int64, then
    [BLOCK_N, BLOCK_M] float32 twice)."""
    j = (offs_n % HALF)[:, None]
    pos = tl.load(POS + rows_m).to(tl.int64)[None, :]
    slot = tl.load(LOC + rows_m).to(tl.int64)[None, :]
    cos = tl.load(COS + pos * stride_cos + j).to(tl.float32)
    sin = tl.load(COS + pos * stride_cos + HALF + j).to(tl.float32)
    return slot, cos, sin


@triton.jit
def _rope_store(a, b, offs_n, rows_n, rows_b, offs_m, N, M, Y, stride_ym, slot, cos, sin, KB, VB,
                stride_kb_slot, stride_kb_head, stride_vb_slot, stride_vb_head, num_q_heads,
                num_kv_heads, k_scale, v_scale, HALF: tl.constexpr):
    """The ROPE epilogue: a, b [BLOCK_N, BLOCK_M] float32 sums of rows rows_n and rows_b = rows_n + HALF (half
    rows offs_n), a column per token (offs_m), with _rope_operands' slot, cos and sin. Rounded to y's dtype
    first, as the linear's output, then as rotary_store_kv computes."""
    a = a.to(Y.dtype.element_ty).to(tl.float32)
    b = b.to(Y.dtype.element_ty).to(tl.float32)
    valid = (offs_n < N)[:, None] & (offs_m < M)[None, :]
    head = (offs_n // HALF)[:, None]
    j = (offs_n % HALF)[:, None]
    ra = a * cos - b * sin
    rb = b * cos + a * sin
    is_q = head < num_q_heads
    is_k = (head >= num_q_heads) & (head < num_q_heads + num_kv_heads)
    is_v = head >= num_q_heads + num_kv_heads
    # y: the q heads rotated (in place, as rotary_store_kv leaves q); k and v as the linear gives them
    y_row = Y + offs_m[None, :] * stride_ym
    tl.store(y_row + rows_n[:, None], tl.where(is_q, ra, a).to(Y.dtype.element_ty), mask=valid)
    tl.store(y_row + rows_b[:, None], tl.where(is_q, rb, b).to(Y.dtype.element_ty), mask=valid)
    k_off = slot * stride_kb_slot + (head - num_q_heads).to(tl.int64) * stride_kb_head + j
    ka = ra.to(Y.dtype.element_ty).to(tl.float32) / k_scale
    kb = rb.to(Y.dtype.element_ty).to(tl.float32) / k_scale
    tl.store(KB + k_off, ka.to(KB.dtype.element_ty), mask=valid & is_k)
    tl.store(KB + k_off + HALF, kb.to(KB.dtype.element_ty), mask=valid & is_k)
    v_off = slot * stride_vb_slot + (head - num_q_heads - num_kv_heads).to(tl.int64) * stride_vb_head + j
    tl.store(VB + v_off, (a / v_scale).to(VB.dtype.element_ty), mask=valid & is_v)
    tl.store(VB + v_off + HALF, (b / v_scale).to(VB.dtype.element_ty), mask=valid & is_v)


@triton.jit
def _gemv_row_step(acc2, up2, sq, wf, wf_up, g, x_ptrs, r_ptrs, h_ptrs, k_mask, store_h,
                   EVEN_K: tl.constexpr, PAIRED: tl.constexpr, NORM: tl.constexpr, HAS_RESIDUAL: tl.constexpr):
    """One row's K step of the GEMV: its input (NORM: h = x (+ r, rounded to x's dtype as torch adds them;
    stored to H where store_h), whose squares go into sq, times the norm weight g) times the float32 weight
    tile into acc2, and the paired tile into up2. (Unmasked loads where K is even: masked loads of a runtime
    bound are not vectorized.)"""
    xt = tl.load(x_ptrs) if EVEN_K else tl.load(x_ptrs, mask=k_mask, other=0.0)
    if NORM:
        if HAS_RESIDUAL:
            r = tl.load(r_ptrs) if EVEN_K else tl.load(r_ptrs, mask=k_mask, other=0.0)
            xt = (xt.to(tl.float32) + r.to(tl.float32)).to(xt.dtype)
            if store_h:
                if EVEN_K:
                    tl.store(h_ptrs, xt)
                else:
                    tl.store(h_ptrs, xt, mask=k_mask)
        xf = xt.to(tl.float32)
        sq += xf * xf
        xf = xf * g
    else:
        xf = xt.to(tl.float32)
    acc2 += wf * xf
    if PAIRED:
        up2 += wf_up * xf
    return acc2, up2, sq


@triton.jit
def _gemv_column(acc2, sq, K, eps, NORM: tl.constexpr):
    """A row's [BLOCK_N, 1] sums from its [BLOCK_N, BLOCK_K] tile of them, scaled by 1 / rms(h) with NORM."""
    acc = tl.sum(acc2, axis=1)[:, None]
    if NORM:
        acc = acc * (1.0 / tl.sqrt(tl.sum(sq) / K + eps))
    return acc


# M and the workspace stride (a multiple of M) are not specialized on: one compile serves every row count
# (a GEMV of several rows compiles per row count: ROWS).
@triton.jit(do_not_specialize=["M", "stride_yk"])
def _small_m_gemm_kernel(
    X, W, S, BIAS, Y, YF, CNT, R, G, H, P, POS, LOC, COS, KB, VB, XS, M, N, K, k_per_split, eps, num_p,
    stride_xm, stride_wn, stride_ym, stride_sn, stride_yk,
    stride_cos, stride_kb_slot, stride_kb_head, stride_vb_slot, stride_vb_head, num_q_heads, num_kv_heads,
    k_scale, v_scale,
    SCALE: tl.constexpr,  # 0: none, 1: per output channel, 2: per (SCALE_BN x SCALE_BK) block
    SCALE_BN: tl.constexpr, SCALE_BK: tl.constexpr,
    HAS_BIAS: tl.constexpr, PARTIAL: tl.constexpr, SPLITS: tl.constexpr, REDUCE: tl.constexpr,
    EVEN_K: tl.constexpr,
    DOT_F32: tl.constexpr, DOT_PRECISION: tl.constexpr, GEMV: tl.constexpr,
    F16_DOT: tl.constexpr, X_PRESCALE: tl.constexpr, ONE_ROW: tl.constexpr, SILU_MUL: tl.constexpr,
    NORM: tl.constexpr, HAS_RESIDUAL: tl.constexpr, ROPE: tl.constexpr, HALF: tl.constexpr,
    ADD_NORM: tl.constexpr, PRENORMED: tl.constexpr, NUM_P: tl.constexpr, X_FP8: tl.constexpr, ROWS: tl.constexpr,
    PRELOAD: tl.constexpr, ONE_STEP: tl.constexpr, PDL: tl.constexpr, PDL_SIGNAL: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr,
):
    """Program (n, s): columns [n * BLOCK_N, +BLOCK_N) over K range [s * k_per_split, +k_per_split).
    PARTIAL (SPLITS > 1 programs along K): store fp32 sums to Y + s * stride_yk (the workspace); with REDUCE,
    then count the arrival on the column tile's int32 counter CNT[n]: the split that arrives last adds the
    tile's partials in split order (0, 1, ..), adds the bias, stores YF in its dtype and puts the counter back
    to 0 (split K's reduce without a second launch; without REDUCE, _split_k_reduce_kernel does it).
    Otherwise add the bias and store in Y's dtype. GEMV (ROWS = M <= 4 rows): no tensor cores, the
    products accumulate elementwise in a [BLOCK_N, BLOCK_K] fp32 tile per row summed over K once at the end
    (every fusion below takes every row; one row has a loop of its own). SILU_MUL, ROPE, ADD_NORM and
    PRENORMED run in any single-split weight-only config, a GEMV or a tl.dot tile; NORM in a GEMV only.
    SILU_MUL (one split, no bias): W is [gate; up] with 2N rows; the program also sums the up rows
    n + N and stores silu(gate) * up, rounded as the linear followed by SiluAndMul would round them.
    NORM (GEMV, one split, not with SILU_MUL): each input row is G * rmsnorm(h) for h = x (+ R, rounded to
    x's dtype, as torch adds them; program 0 stores h to H): each step multiplies h by G and sums h^2 as it
    goes, and the sums are scaled by 1 / rms(h) at the end (no pass over x before the weights stream, no
    normed row in memory; one rounding fewer than RMSNorm then the GEMM, which rounds the normed row).
    ROPE (one split; the qkv projection of decode tokens, a row each, heads of 2 * HALF rows): N
    counts half rows; index t is row j = t % HALF of head t // HALF, paired like the SiLU's up rows with row
    j + HALF of the same head. The epilogue stores y with the q heads rotated (NeoX halves, cos/sin of row
    r's position POS[r] from COS), and writes the rotated k heads and the v heads into the KV pool KB / VB
    at slot LOC[r] (divided by k_scale / v_scale), rounded as the rotary_store_kv kernel rounds them.
    ADD_NORM (one split, not paired; decode tokens' o_proj or down, whose output feeds an RMSNorm):
    h = y + R (y rounded to its dtype first, as the linear's output; h rounded as torch adds) goes to H, each
    row's sum of h^2 over the program's columns to P[row * programs + pid_n], and Y receives G * h (rounded):
    the next GEMV's input before the 1 / rms(h) that only the sum of the row's P gives. PRENORMED (one split): x
    holds such G * h rows and P their partial sums, num_p a row (NUM_P: a power of two >= num_p); each row's
    sums are scaled by 1 / sqrt(sum(its P) / K + eps) at the end, as NORM scales them. X_FP8 (tl.dot): x holds
    FP8 codes and XS their float32 scales, one per row (per-channel or no weight scales: the sums are scaled by
    it at the end) or one per row and 1 x SCALE_BK group (block scales: each step's dot is scaled by its
    column); the dot runs on FP8 operands (the W8A8 GEMM's math).
    PRELOAD (a one-row plain GEMV: not paired, x not normed in the kernel): the first K step's weight tile is
    loaded before anything else and the step taken outside the loop (the same sums in the same order). PDL
    (with PRELOAD; launched with programmatic dependent launch): the kernel may start while the kernel before
    it still runs, and waits for it (gdc_wait) after that load and before it reads x or anything else that
    kernel may have written: a decode token's o_proj loads its weights while decode attention, which reads
    little, runs (see pdl_supported). PDL_SIGNAL (ROPE): decode attention launched with PDL after this kernel
    may start now; it loads the pool's older positions before it waits for this kernel (decode_attention.py)."""
    if PDL_SIGNAL:
        tl.extra.cuda.gdc_launch_dependents()
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    PAIRED: tl.constexpr = SILU_MUL or ROPE  # a second row per output: up (n + N), or the head's other half
    # Out-of-range columns re-read a valid one (loads need no mask; their results are not stored); rows_m keeps
    # the padding rows' pointers in range (the dot's loads of x mask them).
    if ROPE:
        rows_n = tl.where(offs_n < N, (offs_n // HALF) * (2 * HALF) + offs_n % HALF, 0).to(tl.int64)
        rows_b = rows_n + HALF
    else:
        rows_n = tl.where(offs_n < N, offs_n, 0).to(tl.int64)
        rows_b = rows_n + N
    rows_m = tl.where(offs_m < M, offs_m, 0)
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    w_ptrs = W + rows_n[:, None] * stride_wn + (k_start + offs_k)[None, :]
    if SCALE == 2:
        s_ptrs = S + (rows_n // SCALE_BN) * stride_sn
    # What the epilogue reads besides the sums, loaded before the weights stream so that its latency hides under
    # them rather than following them (none of it is written by a kernel this one may overlap: PDL).
    if SCALE == 1:
        scale_n = tl.load(S + rows_n)[:, None]
        if PAIRED:
            scale_b = tl.load(S + rows_b)[:, None]
    if ROPE:
        rope_slot, rope_cos, rope_sin = _rope_operands(offs_n, rows_m, POS, LOC, COS, stride_cos, HALF)
    if not (GEMV and ROWS == 1):  # (the one-row GEMV loads them after its PDL wait, below)
        if ADD_NORM:  # the rows' residual [BLOCK_N, BLOCK_M] (R and H: contiguous [M, N]) and the norm weight
            r_n = tl.load(R + rows_m[None, :] * N + rows_n[:, None]).to(tl.float32)
            g_n = tl.load(G + rows_n).to(tl.float32)[:, None]
        if PRENORMED:  # each row's partial sums of h^2 [BLOCK_M, NUM_P], summed after the loop
            offs_p = tl.arange(0, NUM_P)
            p_sums = tl.load(P + rows_m[:, None] * num_p + offs_p[None, :], mask=(offs_p < num_p)[None, :],
                             other=0.0)
    if GEMV and ROWS == 1:  # (its own loop: the multi-row form below measured 0.9% slower at 8B FP8 bs 1)
        x_ptrs = X + (k_start + offs_k)[None, :]  # row 0 as [1, BLOCK_K]
        acc2 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        if NORM:
            g_ptrs = G + (k_start + offs_k)[None, :]
            sumsq = tl.zeros([1, BLOCK_K], dtype=tl.float32)
            if HAS_RESIDUAL:
                r_ptrs = R + (k_start + offs_k)[None, :]
                h_ptrs = H + (k_start + offs_k)[None, :]  # (program 0 stores h)
        if PAIRED:
            up_ptrs = W + rows_b[:, None] * stride_wn + (k_start + offs_k)[None, :]
            acc2_up = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
            if SCALE == 2:
                s_up_ptrs = S + (rows_b // SCALE_BN) * stride_sn
        if PRELOAD:  # the first step's weight tile: weights never depend on the kernel before
            if EVEN_K:
                w_first = tl.load(w_ptrs)
            else:
                w_first = tl.load(w_ptrs, mask=(k_start + offs_k)[None, :] < k_end, other=0.0)
        if PDL:  # what follows may read what the kernel before wrote: wait for it (griddepcontrol.wait)
            tl.extra.cuda.gdc_wait()
        if ADD_NORM:  # this program's columns of the residual and the norm weight, before the weights stream
            r_n = tl.load(R + rows_n).to(tl.float32)[:, None]
            g_n = tl.load(G + rows_n).to(tl.float32)[:, None]
        if PRENORMED:  # the row's partial sums of h^2 (L2-resident: the kernel before wrote them), summed after
            # the loop: a program's weights start streaming before they arrive
            offs_p = tl.arange(0, NUM_P)
            p_sums = tl.load(P + offs_p, mask=offs_p < num_p, other=0.0)
        k_loop = k_start
        if PRELOAD:  # the loop's first step, taken with the tile loaded above (the loop's arithmetic)
            if EVEN_K:
                xt = tl.load(x_ptrs)
            else:
                xt = tl.load(x_ptrs, mask=(k_start + offs_k)[None, :] < k_end, other=0.0)
            prod = w_first.to(tl.float32) * xt.to(tl.float32)
            if SCALE == 2:
                prod = prod * tl.load(s_ptrs + k_start // SCALE_BK)[:, None]
            if ONE_STEP:  # (0 + prod: the same sums; no [BLOCK_N, BLOCK_K] float32 tile held across a loop)
                acc2 = prod
            else:
                acc2 += prod
            w_ptrs += BLOCK_K
            x_ptrs += BLOCK_K
            k_loop = k_start + BLOCK_K
        # An explicit stage count: Triton software-pipelines a loop's loads only when they feed a tl.dot,
        # or when the loop itself asks for stages; without it each step waits for its own loads.
        for k in tl.range(k_loop, k_end if not ONE_STEP else k_loop, BLOCK_K, num_stages=NUM_STAGES):
            k_mask = (k + offs_k)[None, :] < k_end
            if EVEN_K:
                w = tl.load(w_ptrs)
                xt = tl.load(x_ptrs)
            else:
                w = tl.load(w_ptrs, mask=k_mask, other=0.0)
                xt = tl.load(x_ptrs, mask=k_mask, other=0.0)
            if NORM:  # (unmasked where K is even: masked loads of a runtime bound are not vectorized)
                if HAS_RESIDUAL:
                    r = tl.load(r_ptrs) if EVEN_K else tl.load(r_ptrs, mask=k_mask, other=0.0)
                    xt = (xt.to(tl.float32) + r.to(tl.float32)).to(X.dtype.element_ty)
                    if pid_n == 0:
                        if EVEN_K:
                            tl.store(h_ptrs, xt)
                        else:
                            tl.store(h_ptrs, xt, mask=k_mask)
                    r_ptrs += BLOCK_K
                    h_ptrs += BLOCK_K
                xf = xt.to(tl.float32)
                sumsq += xf * xf
                g = tl.load(g_ptrs) if EVEN_K else tl.load(g_ptrs, mask=k_mask, other=0.0)
                xf = xf * g.to(tl.float32)
                g_ptrs += BLOCK_K
            else:
                xf = xt.to(tl.float32)
            prod = w.to(tl.float32) * xf
            if SCALE == 2:
                prod = prod * tl.load(s_ptrs + k // SCALE_BK)[:, None]
            acc2 += prod
            if PAIRED:
                if EVEN_K:
                    w_up = tl.load(up_ptrs)
                else:
                    w_up = tl.load(up_ptrs, mask=k_mask, other=0.0)
                prod_up = w_up.to(tl.float32) * xf
                if SCALE == 2:
                    prod_up = prod_up * tl.load(s_up_ptrs + k // SCALE_BK)[:, None]
                acc2_up += prod_up
                up_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
            x_ptrs += BLOCK_K
        acc = tl.sum(acc2, axis=1)[:, None]  # [BLOCK_N, 1]
        if PAIRED:
            acc_up = tl.sum(acc2_up, axis=1)[:, None]
        if NORM:  # (one split: this program saw all of K)
            rstd = 1.0 / tl.sqrt(tl.sum(sumsq) / K + eps)
        if PRENORMED:
            rstd = 1.0 / tl.sqrt(tl.sum(p_sums) / K + eps)
        if NORM or PRENORMED:
            acc = acc * rstd
            if PAIRED:
                acc_up = acc_up * rstd
    elif GEMV:  # 2-4 rows
        # Row r of x (and of the residual and h: contiguous [M, K] with NORM) at the K step: ptrs + r * stride.
        x_ptrs = X + (k_start + offs_k)[None, :]
        r_ptrs = R + (k_start + offs_k)[None, :]
        h_ptrs = H + (k_start + offs_k)[None, :]  # (NORM with a residual: program 0 stores h)
        g_ptrs = G + (k_start + offs_k)[None, :]
        zeros = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        zeros_k = tl.zeros([1, BLOCK_K], dtype=tl.float32)
        # per row (up to 4): the sums of products, of the paired rows' products, of h^2 (NORM)
        acc2_0, up2_0, sq_0 = zeros, zeros, zeros_k
        acc2_1, up2_1, sq_1 = zeros, zeros, zeros_k
        acc2_2, up2_2, sq_2 = zeros, zeros, zeros_k
        acc2_3, up2_3, sq_3 = zeros, zeros, zeros_k
        if PAIRED:
            up_ptrs = W + rows_b[:, None] * stride_wn + (k_start + offs_k)[None, :]
            if SCALE == 2:
                s_up_ptrs = S + (rows_b // SCALE_BN) * stride_sn
        # An explicit stage count: Triton software-pipelines a loop's loads only when they feed a tl.dot,
        # or when the loop itself asks for stages; without it each step waits for its own loads.
        for k in tl.range(k_start, k_end, BLOCK_K, num_stages=NUM_STAGES):
            k_mask = (k + offs_k)[None, :] < k_end
            # the weight tile (and the paired one) converted and block-scaled once, then a product per row
            wf = (tl.load(w_ptrs) if EVEN_K else tl.load(w_ptrs, mask=k_mask, other=0.0)).to(tl.float32)
            if SCALE == 2:
                wf = wf * tl.load(s_ptrs + k // SCALE_BK)[:, None]
            wf_up = wf
            if PAIRED:
                wf_up = (tl.load(up_ptrs) if EVEN_K else tl.load(up_ptrs, mask=k_mask, other=0.0)).to(tl.float32)
                if SCALE == 2:
                    wf_up = wf_up * tl.load(s_up_ptrs + k // SCALE_BK)[:, None]
                up_ptrs += BLOCK_K
            g = 1.0
            if NORM:
                g = (tl.load(g_ptrs) if EVEN_K else tl.load(g_ptrs, mask=k_mask, other=0.0)).to(tl.float32)
            acc2_0, up2_0, sq_0 = _gemv_row_step(acc2_0, up2_0, sq_0, wf, wf_up, g, x_ptrs, r_ptrs, h_ptrs,
                                                 k_mask, pid_n == 0, EVEN_K, PAIRED, NORM, HAS_RESIDUAL)
            if ROWS > 1:
                acc2_1, up2_1, sq_1 = _gemv_row_step(acc2_1, up2_1, sq_1, wf, wf_up, g, x_ptrs + stride_xm,
                                                     r_ptrs + K, h_ptrs + K, k_mask, pid_n == 0, EVEN_K, PAIRED,
                                                     NORM, HAS_RESIDUAL)
            if ROWS > 2:
                acc2_2, up2_2, sq_2 = _gemv_row_step(acc2_2, up2_2, sq_2, wf, wf_up, g, x_ptrs + 2 * stride_xm,
                                                     r_ptrs + 2 * K, h_ptrs + 2 * K, k_mask, pid_n == 0, EVEN_K,
                                                     PAIRED, NORM, HAS_RESIDUAL)
            if ROWS > 3:
                acc2_3, up2_3, sq_3 = _gemv_row_step(acc2_3, up2_3, sq_3, wf, wf_up, g, x_ptrs + 3 * stride_xm,
                                                     r_ptrs + 3 * K, h_ptrs + 3 * K, k_mask, pid_n == 0, EVEN_K,
                                                     PAIRED, NORM, HAS_RESIDUAL)
            w_ptrs += BLOCK_K
            x_ptrs += BLOCK_K
            r_ptrs += BLOCK_K
            h_ptrs += BLOCK_K
            g_ptrs += BLOCK_K
        # [BLOCK_N, BLOCK_M]: row r's sums in column r, scaled by its 1 / rms (NORM: one split, so this
        # program saw all of K)
        acc = _gemv_column(acc2_0, sq_0, K, eps, NORM)
        acc_up = _gemv_column(up2_0, sq_0, K, eps, NORM)
        if ROWS > 1:
            acc = tl.where(offs_m[None, :] == 1, _gemv_column(acc2_1, sq_1, K, eps, NORM), acc)
            acc_up = tl.where(offs_m[None, :] == 1, _gemv_column(up2_1, sq_1, K, eps, NORM), acc_up)
        if ROWS > 2:
            acc = tl.where(offs_m[None, :] == 2, _gemv_column(acc2_2, sq_2, K, eps, NORM), acc)
            acc_up = tl.where(offs_m[None, :] == 2, _gemv_column(up2_2, sq_2, K, eps, NORM), acc_up)
        if ROWS > 3:
            acc = tl.where(offs_m[None, :] == 3, _gemv_column(acc2_3, sq_3, K, eps, NORM), acc)
            acc_up = tl.where(offs_m[None, :] == 3, _gemv_column(up2_3, sq_3, K, eps, NORM), acc_up)
    else:
        x_ptrs = X + rows_m[None, :] * stride_xm + (k_start + offs_k)[:, None]  # x^T tile [BLOCK_K, BLOCK_M]
        x1_ptrs = X + k_start + offs_k  # ONE_ROW: row 0 as [BLOCK_K]
        # The padding rows (M to BLOCK_M) load nothing: zeros. (Re-reading row 0 there, as before, put up to
        # BLOCK_M - M requests a step on the same L2 lines from every program at once: 48 rows of the 8B's
        # gate/up took 1.6x the time of 64 on the H200, docs/benchmarks.md.)
        x_rows = (offs_m < M)[None, :]
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        if PAIRED:  # (not with X_FP8) the paired rows' tile and sums, as the GEMVs pair them
            up_ptrs = W + rows_b[:, None] * stride_wn + (k_start + offs_k)[None, :]
            acc_up = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
            if SCALE == 2:
                s_up_ptrs = S + (rows_b // SCALE_BN) * stride_sn
        for k in range(k_start, k_end, BLOCK_K):  # (loads feeding tl.dot: pipelined with num_stages)
            if EVEN_K:
                w = tl.load(w_ptrs)
                if PAIRED:
                    w_up = tl.load(up_ptrs)
                if ONE_ROW:
                    xt = tl.load(x1_ptrs)
                else:
                    xt = tl.load(x_ptrs, mask=x_rows, other=0.0)
            else:
                k_mask = (k + offs_k) < k_end
                w = tl.load(w_ptrs, mask=k_mask[None, :], other=0.0)
                if PAIRED:
                    w_up = tl.load(up_ptrs, mask=k_mask[None, :], other=0.0)
                if ONE_ROW:
                    xt = tl.load(x1_ptrs, mask=k_mask, other=0.0)
                else:
                    xt = tl.load(x_ptrs, mask=k_mask[:, None] & x_rows, other=0.0)
            if F16_DOT and not X_FP8:  # FP8 weights: float8 -> fp16 is one packed conversion (-> bf16: another)
                w = w.to(tl.float16)
                if PAIRED:
                    w_up = w_up.to(tl.float16)
                if xt.dtype != tl.float16:  # bf16 x, scaled by a power of two into fp16's range: exact there
                    xt = to_f16_scaled(xt, X_PRESCALE)
            if ONE_ROW:  # converted once, then the same column BLOCK_M times (padding columns: never stored)
                xt = tl.broadcast_to(xt[:, None], [BLOCK_K, BLOCK_M])
            if DOT_F32:  # the interpreter's bfloat16 tl.dot is wrong; float32 operands give the same products
                w = w.to(tl.float32)
                xt = xt.to(tl.float32)
                if PAIRED:
                    w_up = w_up.to(tl.float32)
            if PAIRED:
                if SCALE == 2:
                    acc_up += (tl.dot(w_up, xt, input_precision=DOT_PRECISION)
                               * tl.load(s_up_ptrs + k // SCALE_BK)[:, None])
                else:
                    acc_up = tl.dot(w_up, xt, acc_up, input_precision=DOT_PRECISION)
                up_ptrs += BLOCK_K
            if SCALE == 2:  # BLOCK_K divides SCALE_BK and steps are aligned: one scale column per step
                part = tl.dot(w, xt, input_precision=DOT_PRECISION) * tl.load(s_ptrs + k // SCALE_BK)[:, None]
                if X_FP8:  # x's scales per 1 x SCALE_BK group: the step's column of them
                    part = part * tl.load(XS + rows_m * tl.cdiv(K, SCALE_BK) + k // SCALE_BK)[None, :]
                acc += part  # (a fresh dot each step: its FP8 sums go into float32 every BLOCK_K)
            elif X_FP8:  # sm_90's FP8 MMA accumulates with fewer mantissa bits than float32 (Triton's default
                # leaves all of K to it: over 4096-14336 the sums drift past a bf16 ulp); each step's BLOCK_K
                # products go into the float32 acc instead (DeepSeek-V3's FP8 GEMMs promote every 128)
                acc = tl.dot(w, xt, acc, input_precision=DOT_PRECISION, max_num_imprecise_acc=BLOCK_K)
            else:
                acc = tl.dot(w, xt, acc, input_precision=DOT_PRECISION)
            w_ptrs += BLOCK_K
            x_ptrs += BLOCK_K
            x1_ptrs += BLOCK_K
        if F16_DOT and X_PRESCALE != 1.0:
            acc = acc * (1.0 / X_PRESCALE)  # a power of two: exact
            if PAIRED:
                acc_up = acc_up * (1.0 / X_PRESCALE)
        if X_FP8 and SCALE != 2:
            acc = acc * tl.load(XS + rows_m)[None, :]
    if PRENORMED and not (GEMV and ROWS == 1):  # each row (column of acc) by its 1 / rms
        rstd = (1.0 / tl.sqrt(tl.sum(p_sums, axis=1) / K + eps))[None, :]
        acc = acc * rstd
        if PAIRED:
            acc_up = acc_up * rstd
    if SCALE == 1:
        acc = acc * scale_n
        if PAIRED:
            acc_up = acc_up * scale_b
    out_mask = (offs_n < N)[:, None] & (offs_m < M)[None, :]
    y_ptrs = offs_m[None, :] * stride_ym + offs_n[:, None]
    if PARTIAL:
        tl.store(Y + pid_k * stride_yk + y_ptrs, acc, mask=out_mask)
        if REDUCE:
            tl.debug_barrier()  # every thread's partial stored before the one thread's atomic releases them
            # acq_rel at gpu scope (the default): the last arrival sees every other split's partial. In Triton's
            # CPU interpreter the programs run one after another, so there the last split always adds them;
            # on a GPU any split may (tests/test_small_m_gemm.py, compiled there, checks the bits).
            if tl.atomic_add(CNT + pid_n, 1) == SPLITS - 1:
                total = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
                # Unrolled: every split's loads in flight at once, then added in order. .cg: from L2, past this
                # SM's L1, which the other programs' stores did not update.
                for s in tl.static_range(SPLITS):
                    total += tl.load(Y + s * stride_yk + y_ptrs, mask=out_mask, other=0.0, cache_modifier=".cg")
                if HAS_BIAS:
                    total += tl.load(BIAS + rows_n).to(tl.float32)[:, None]
                tl.store(YF + y_ptrs, total.to(YF.dtype.element_ty), mask=out_mask)
                tl.store(CNT + pid_n, 0)  # every split has arrived: zero for the next call (or graph replay)
    elif ROPE:
        if HAS_BIAS:
            acc += tl.load(BIAS + rows_n).to(tl.float32)[:, None]
            acc_up += tl.load(BIAS + rows_b).to(tl.float32)[:, None]
        _rope_store(acc, acc_up, offs_n, rows_n, rows_b, offs_m, N, M, Y, stride_ym, rope_slot, rope_cos,
                    rope_sin, KB, VB, stride_kb_slot, stride_kb_head, stride_vb_slot, stride_vb_head, num_q_heads,
                    num_kv_heads, k_scale, v_scale, HALF)
    else:
        if HAS_BIAS:
            acc += tl.load(BIAS + rows_n).to(tl.float32)[:, None]
        if SILU_MUL:  # gate and up rounded to y's dtype, then SiLU rounded, then the product (SiluAndMul's steps)
            gate = acc.to(Y.dtype.element_ty).to(tl.float32)
            silu = (gate / (1.0 + tl.exp(-gate))).to(Y.dtype.element_ty).to(tl.float32)
            acc = silu * acc_up.to(Y.dtype.element_ty).to(tl.float32)
        if ADD_NORM:  # (H has Y's layout: contiguous [M, N])
            h = (acc.to(Y.dtype.element_ty).to(tl.float32) + r_n).to(Y.dtype.element_ty)
            tl.store(H + y_ptrs, h, mask=out_mask)
            hf = h.to(tl.float32)
            tl.store(P + offs_m * tl.num_programs(0) + pid_n, tl.sum(tl.where(out_mask, hf * hf, 0.0), axis=0),
                     mask=offs_m < M)
            acc = hf * g_n
        tl.store(Y + y_ptrs, acc.to(Y.dtype.element_ty), mask=out_mask)


@triton.jit
def _split_k_reduce_kernel(WS, BIAS, Y, N, splits, stride_wsk, stride_wsm, stride_ym,
                           HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    """y[m, n] = the sum over s = 0, 1, .., splits - 1 (in that order) of ws[s, m, n] (+ bias), in y's
    dtype."""
    m = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    ptrs = WS + m * stride_wsm + offs
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for s in range(splits):
        acc += tl.load(ptrs + s * stride_wsk, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(BIAS + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + m * stride_ym + offs, acc.to(Y.dtype.element_ty), mask=mask)


# ---------------------------------------------------------------- launch


def weight_kind(weight: torch.Tensor, block: tuple[int, int] | None) -> str:
    """The table's key for a weight: "bf16", "fp16", "fp8" (per-channel scales) or "fp8_block"."""
    if weight.dtype == FP8:
        return "fp8_block" if block is not None else "fp8"
    return {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(weight.dtype, str(weight.dtype))


def _kernel_block_k(block_k: int) -> bool:
    """Whether K steps (powers of two >= 16, at most block_k) can tile a scale block of block_k columns."""
    return block_k >= 16 and not block_k & (block_k - 1)


def _check(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None, bias: torch.Tensor | None,
           block: tuple[int, int] | None, x_scale: torch.Tensor | None = None) -> None:
    m, k = x.shape
    n = weight.shape[0]
    if x_scale is not None:
        if x.dtype != FP8 or weight.dtype != FP8:
            raise ValueError("small-M GEMM: FP8 activations go with FP8 weights")
        want = (m,) if block is None else (m, triton.cdiv(k, block[1]))  # per row, or per 1 x block_k group
        if x_scale.dtype != torch.float32 or tuple(x_scale.shape) != want or not x_scale.is_contiguous():
            raise ValueError(f"small-M GEMM: FP8 activations need float32 scales {list(want)}, "
                             f"got {tuple(x_scale.shape)}")
    limit = max_rows(weight_kind(weight, block))
    if m > limit:
        raise ValueError(f"small-M GEMM takes at most {limit} rows of this weight, got {m}")
    if x.dtype not in (torch.bfloat16, torch.float16) and x_scale is None:
        raise ValueError(f"small-M GEMM: x must be bfloat16 or float16, got {x.dtype}")
    if weight.dim() != 2 or weight.shape[1] != k:
        raise ValueError(f"small-M GEMM: weight {tuple(weight.shape)} does not match x {tuple(x.shape)}")
    if weight.stride(-1) != 1:
        raise ValueError("small-M GEMM: the weight needs unit stride in K")
    if weight.dtype == FP8:
        if scale is None or scale.dtype != torch.float32 or scale.stride(-1) != 1:
            raise ValueError("small-M GEMM: an FP8 weight needs float32 scales (unit stride in the last dim)")
        if block is None and scale.shape != (n,):
            raise ValueError(f"small-M GEMM: per-channel scales must be [{n}], got {tuple(scale.shape)}")
        if block is not None:
            want = (triton.cdiv(n, block[0]), triton.cdiv(k, block[1]))
            if tuple(scale.shape) != want or scale.stride(-1) != 1:
                raise ValueError(f"small-M GEMM: block scales must be {list(want)}, got {tuple(scale.shape)}")
            if not _kernel_block_k(block[1]):
                raise ValueError(f"small-M GEMM: the scale block's K size must be a power of two >= 16, "
                                 f"got {block[1]}")
    elif weight.dtype != x.dtype or scale is not None:
        raise ValueError(f"small-M GEMM: weight {weight.dtype} with x {x.dtype} "
                         "(scales only with FP8 weights)")
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"small-M GEMM: bias must be [{n}], got {tuple(bias.shape)}")


@dataclass(frozen=True)
class RmsNormInput:
    """A GEMM input given before its RMSNorm: the rows are weight * rmsnorm(x + residual) (residual
    optional), as RMSNorm(x, residual) computes them; `sum_out` receives x + residual."""
    weight: torch.Tensor  # [K]
    eps: float
    residual: torch.Tensor | None = None  # [1, K], x's dtype
    sum_out: torch.Tensor | None = None  # [1, K], x's dtype; required with a residual


@dataclass(frozen=True)
class AddRmsNormOutput:
    """The ADD_NORM epilogue's operands: h = y + residual goes to `h`, its sums of h^2 per program to
    `partials`, and the kernel's own output becomes norm_weight * h."""
    residual: torch.Tensor  # [M, N], x's dtype
    norm_weight: torch.Tensor  # [N]
    h: torch.Tensor  # [M, N], x's dtype
    partials: torch.Tensor  # [M * programs] float32, row by row


def _launch(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None, bias: torch.Tensor | None,
            block: tuple[int, int] | None, cfg: GemmConfig, silu_mul: bool = False,
            norm: RmsNormInput | None = None, rope: RopeStore | None = None,
            add_norm: AddRmsNormOutput | None = None, prenormed: PrenormedRow | None = None,
            x_scale: torch.Tensor | None = None, out_dtype: torch.dtype | None = None,
            preload: bool = False, pdl: bool = False, y_out: torch.Tensor | None = None) -> torch.Tensor:
    """y = x @ weight^T (+ bias); silu_mul: weight is [gate; up] and y = silu(x @ gate^T) * (x @ up^T);
    norm: x is first normed (and added to a residual) as `norm` says; rope: weight is a qkv projection
    and the epilogue runs the rotary and the KV store (the q heads of y rotated); add_norm: the epilogue
    adds the residual and prepares the next GEMM's PrenormedRow (y is its weighted row); prenormed: the
    input is that row (x is prenormed.weighted); x_scale: x holds FP8 codes with these scales, per row or
    per row and block_k group (an X_FP8 config; y in out_dtype); preload: the first weight tile loaded
    before anything else (a one-row, single-split plain GEMV); pdl: that, and launched with programmatic
    dependent launch where the device has it (pdl.py: after a kernel that leaves the memory bus idle);
    y_out: y goes there (contiguous [M, N] in out_dtype, not with the rotary's paired rows) and is returned."""
    if cfg.X_FP8 != (x_scale is not None):
        raise ValueError(f"FP8 activations (x_scale) go with an X_FP8 config and only with one, got {cfg}")
    if (add_norm is not None or prenormed is not None) and not single_split(cfg):
        raise ValueError(f"a pre-normed input or an add + RMSNorm epilogue runs in a single-split config, got {cfg}")
    if add_norm is not None and (silu_mul or norm is not None or rope is not None or prenormed is not None):
        raise ValueError("the add + RMSNorm epilogue goes with a plain GEMV only")
    if prenormed is not None and norm is not None:
        raise ValueError("an input is either pre-normed or normed in the kernel, not both")
    preload = preload or pdl
    has_pdl = pdl_supported(x.device)
    pdl = pdl and has_pdl  # (elsewhere the tile is preloaded, with nothing to wait for)
    if preload and (not cfg.GEMV or cfg.SPLIT_K != 1 or x.shape[0] != 1 or silu_mul or norm is not None
                    or rope is not None):
        raise ValueError(f"a preloaded weight tile (PDL) goes with a one-row, single-split plain GEMV, got {cfg}")
    _check(x, weight, scale, bias, block, x_scale)
    if cfg.GEMV and x.shape[0] > MAX_GEMV_ROWS:
        raise ValueError(f"a GEMV config runs at most {MAX_GEMV_ROWS} rows, got {x.shape[0]}")
    if silu_mul and (not single_split(cfg) or bias is not None or weight.shape[0] % 2):
        raise ValueError(f"SiLU-and-mul runs in a single-split config without bias on an even row count, got {cfg}")
    if norm is not None:
        if silu_mul:
            raise ValueError("a fused RMSNorm does not go with the fused SiLU-and-mul")
        _check_norm(x, norm, cfg)
    if rope is not None:
        _check_rope(x, weight, rope, cfg, silu_mul)
    if add_norm is not None:
        _check_add_norm(x, weight, add_norm, cfg)
    if prenormed is not None:
        _check_prenormed(x, prenormed)
    if x.stride(-1) != 1:
        x = x.contiguous()
    if bias is not None and bias.stride(-1) != 1:
        bias = bias.contiguous()
    m, k = x.shape
    n = weight.shape[0] // 2 if silu_mul or rope is not None else weight.shape[0]  # (paired: half the rows)
    if y_out is None:
        y = torch.empty((m, weight.shape[0] if rope is not None else n), dtype=out_dtype or x.dtype, device=x.device)
    elif (rope is not None or y_out.shape != (m, n) or y_out.dtype != (out_dtype or x.dtype)
          or not y_out.is_contiguous()):
        raise ValueError(f"y_out must be a contiguous [{m}, {n}] {out_dtype or x.dtype} tensor (no rotary), got "
                         f"{tuple(y_out.shape)} {y_out.dtype}")
    else:
        y = y_out
    if m == 0 or n == 0:
        return y
    block_k = cfg.BLOCK_K
    if block is not None:  # one scale column per K step
        block_k = min(block_k, block[1])
    # K per split: whole BLOCK_K steps (and so aligned to the scale blocks); the split count follows from it.
    k_per_split = triton.cdiv(triton.cdiv(k, cfg.SPLIT_K), block_k) * block_k
    splits = triton.cdiv(k, k_per_split)
    scale_mode = 0 if scale is None else 2 if block is not None else 1
    partial = splits > 1  # (never with silu_mul: SPLIT_K 1 was checked above)
    dot_f32 = x.device.type == "cpu" and x.dtype in (torch.bfloat16, FP8)
    f16_dot = weight.dtype == FP8
    out = torch.empty((splits, m, n), dtype=torch.float32, device=x.device) if partial else y
    residual = norm.residual if norm is not None else None
    rope_ptrs, rope_scalars = _rope_args(rope, x)
    if add_norm is not None:
        residual, norm_weight, h_out, partials = add_norm.residual, add_norm.norm_weight, add_norm.h, add_norm.partials
    else:
        norm_weight = norm.weight if norm is not None else x
        h_out = norm.sum_out if residual is not None else x
        partials = prenormed.partials if prenormed is not None else x
    eps = norm.eps if norm is not None else prenormed.eps if prenormed is not None else 0.0
    num_p = partials.numel() // m if prenormed is not None else 0  # (a pre-normed row's partial sums)
    tiles = triton.cdiv(n, cfg.BLOCK_N)
    reduce_in_kernel = partial and m <= IN_KERNEL_REDUCE_MAX_ROWS and tiles <= MAX_SPLIT_TILES
    counters = split_counters(x.device) if reduce_in_kernel else x
    _small_m_gemm_kernel[(tiles, splits)](
        x, weight, scale if scale is not None else x, bias if bias is not None else x, out, y, counters,
        residual if residual is not None else x, norm_weight, h_out, partials, *rope_ptrs,
        x_scale if x_scale is not None else x,
        m, n, k, k_per_split, eps, num_p,
        x.stride(0), weight.stride(0), out.stride(-2),  # (y's row stride: 2N with the rotary's paired rows)
        scale.stride(0) if scale_mode == 2 else 0, m * n, *rope_scalars,
        SCALE=scale_mode, SCALE_BN=block[0] if block else 1, SCALE_BK=block[1] if block else 1,
        HAS_BIAS=bias is not None, PARTIAL=partial, SPLITS=splits, REDUCE=reduce_in_kernel,
        EVEN_K=k % k_per_split == 0,  # every split a whole number of full K steps: no K mask
        DOT_F32=dot_f32, DOT_PRECISION="ieee" if dot_f32 else "tf32",  # (tf32: the default; bf16 ignores it)
        GEMV=cfg.GEMV, F16_DOT=f16_dot, ONE_ROW=m == 1, SILU_MUL=silu_mul,
        NORM=norm is not None, HAS_RESIDUAL=norm is not None and residual is not None,
        ROPE=rope is not None, HALF=rope.cos_sin_cache.shape[-1] // 2 if rope is not None else 1,
        ADD_NORM=add_norm is not None, PRENORMED=prenormed is not None,
        NUM_P=triton.next_power_of_2(num_p) if prenormed is not None else 1, X_FP8=cfg.X_FP8,
        ROWS=m if cfg.GEMV else 1, PRELOAD=preload, ONE_STEP=preload and k_per_split <= block_k,
        PDL=pdl, PDL_SIGNAL=rope is not None and has_pdl,
        X_PRESCALE=X_PRESCALE if f16_dot and x.dtype == torch.bfloat16 else 1.0,
        BLOCK_M=triton.next_power_of_2(m) if cfg.GEMV else max(MAX_M, triton.next_power_of_2(m)),
        BLOCK_N=cfg.BLOCK_N, BLOCK_K=block_k,
        NUM_STAGES=cfg.num_stages,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **({"launch_pdl": True} if pdl else {}))
    if partial and not reduce_in_kernel:
        reduce_block = min(1024, triton.next_power_of_2(n))
        _split_k_reduce_kernel[(m, triton.cdiv(n, reduce_block))](
            out, bias if bias is not None else out, y, n, splits, m * n, n, n,
            HAS_BIAS=bias is not None, BLOCK=reduce_block, num_warps=4)
    return y


def single_split(cfg: GemmConfig) -> bool:
    """Whether a config can run the epilogue fusions (the SiLU-and-mul, the rotary + KV store, the add +
    RMSNorm) and take pre-normed rows: one split (each program sees all of K), weight-only (no X_FP8)."""
    return cfg.SPLIT_K == 1 and not cfg.X_FP8


def pairs(cfg: GemmConfig) -> bool:
    """Whether a config's column tile can be split into paired halves (the SiLU's gate and up rows, a head's two
    halves): a GEMV's of 2 or more, a tl.dot tile's of 32 or more (16 rows a dot)."""
    return cfg.BLOCK_N >= (2 if cfg.GEMV else 32)


def fuses(cfg: GemmConfig) -> bool:
    """Whether the layers' fused paths take this table config: single_split, and FUSE (None: a GEMV)."""
    return single_split(cfg) and (cfg.FUSE if cfg.FUSE is not None else cfg.GEMV)


def _rope_args(rope: RopeStore | None, x: torch.Tensor) -> tuple[tuple, tuple]:
    """The kernel's ROPE arguments: (POS, LOC, COS, KB, VB), then the strides, head counts and scales;
    placeholders (never read) without a rope."""
    if rope is None:
        return (x,) * 5, (0, 0, 0, 0, 0, 0, 0, 1.0, 1.0)
    kb, vb, cache = rope.k_buffer, rope.v_buffer, rope.cos_sin_cache
    return ((rope.positions, rope.loc, cache, kb, vb),
            (cache.stride(0), kb.stride(0), kb.stride(1), vb.stride(0), vb.stride(1), rope.num_q_heads,
             rope.num_kv_heads, float(rope.k_scale), float(rope.v_scale)))


def _check_rope(x: torch.Tensor, weight: torch.Tensor, rope: RopeStore, cfg: GemmConfig, silu_mul: bool) -> None:
    if not single_split(cfg) or silu_mul:
        raise ValueError(f"the rotary + KV store epilogue runs in a single-split config, got {cfg}")
    d = rope.cos_sin_cache.shape[-1]
    heads = rope.num_q_heads + 2 * rope.num_kv_heads
    if d % 2 or weight.shape[0] != heads * d or rope.cos_sin_cache.stride(-1) != 1:
        raise ValueError(f"rotary: a qkv weight of {heads} heads of {d} rows, got {tuple(weight.shape)}")
    for buf in (rope.k_buffer, rope.v_buffer):
        if buf.dim() != 3 or tuple(buf.shape[1:]) != (rope.num_kv_heads, d) or buf.stride(-1) != 1:
            raise ValueError(f"KV store: pool buffers must be [slots, {rope.num_kv_heads}, {d}] with unit "
                             f"stride, got {tuple(buf.shape)}")
    if rope.positions.numel() != x.shape[0] or rope.loc.numel() != x.shape[0]:
        raise ValueError(f"rotary + KV store: a position and a slot for each of the {x.shape[0]} tokens")


def _check_norm(x: torch.Tensor, norm: RmsNormInput, cfg: GemmConfig) -> None:
    if not cfg.GEMV or cfg.SPLIT_K != 1:
        raise ValueError(f"a fused RMSNorm runs in a single-split GEMV (each program sees all of K), got {cfg}")
    k = x.shape[1]
    if norm.weight.shape != (k,) or norm.weight.stride(-1) != 1:
        raise ValueError(f"RMSNorm weight must be [{k}] with unit stride, got {tuple(norm.weight.shape)}")
    for name in ("residual", "sum_out"):
        t = getattr(norm, name)
        if norm.residual is not None and (t is None or t.shape != x.shape or t.dtype != x.dtype
                                          or not t.is_contiguous()):
            raise ValueError(f"RMSNorm {name} must be a contiguous {tuple(x.shape)} {x.dtype} tensor")
    if norm.residual is None and norm.sum_out is not None:
        raise ValueError("RMSNorm sum_out without a residual (the sum is x itself)")
    if x.stride(-1) != 1 or not x.is_contiguous():
        raise ValueError("a fused RMSNorm needs a contiguous x")


def _check_add_norm(x: torch.Tensor, weight: torch.Tensor, add_norm: AddRmsNormOutput, cfg: GemmConfig) -> None:
    m, n = x.shape[0], weight.shape[0]
    if add_norm.norm_weight.shape != (n,) or add_norm.norm_weight.stride(-1) != 1:
        raise ValueError(f"RMSNorm weight must be [{n}] with unit stride, got {tuple(add_norm.norm_weight.shape)}")
    for name in ("residual", "h"):
        t = getattr(add_norm, name)
        if t.shape != (m, n) or t.dtype != x.dtype or not t.is_contiguous():
            raise ValueError(f"RMSNorm {name} must be a contiguous ({m}, {n}) {x.dtype} tensor, got "
                             f"{tuple(t.shape)} {t.dtype}")
    want = m * triton.cdiv(n, cfg.BLOCK_N)
    if add_norm.partials.shape != (want,) or add_norm.partials.dtype != torch.float32:
        raise ValueError(f"the partial sums must be [{want}] float32 (one per row and program)")


def _check_prenormed(x: torch.Tensor, row: PrenormedRow) -> None:
    if x is not row.weighted or not x.is_contiguous():
        raise ValueError("a pre-normed input is its weighted rows, contiguous")
    p = row.partials
    if p.dim() != 1 or p.dtype != torch.float32 or not p.is_contiguous() or p.numel() == 0 or p.numel() % x.shape[0]:
        raise ValueError(f"pre-normed partial sums must be a contiguous 1-d float32 tensor, the same number a row, "
                         f"got {tuple(p.shape)} for {x.shape[0]} rows")


# ---------------------------------------------------------------- configs


def m_bucket(m: int) -> int:
    return next(b for b in M_BUCKETS if b >= m)


@functools.cache
def device_name(device: str = "cuda") -> str:
    """The GPU's name as the config files spell it (the MoE tables' convention); "cpu" without CUDA."""
    if device.startswith("cuda") and torch.cuda.is_available():
        return torch.cuda.get_device_name(torch.device(device)).replace(" ", "_")
    return "cpu"


@functools.cache
def _sm_count(device: str) -> int:
    if device.startswith("cuda") and torch.cuda.is_available():
        return torch.cuda.get_device_properties(torch.device(device)).multi_processor_count
    return 4  # the interpreter: a few splits keep the split-K path exercised


# The split-K arrival counters a device has: 64K int32, far above any layer's N / BLOCK_N (a launch with more
# column tiles leaves its reduce to the second kernel).
MAX_SPLIT_TILES = 1 << 16
# Split K's reduce runs in the GEMM (the last split of a tile adds the partials) up to this many rows, and as
# a second kernel above. Llama-3.1-8B FP8 decode on the H200 (docs/benchmarks.md, twenty-sixth session), b2b
# step against the second kernel everywhere: 1.7-3.2% faster at 4-16 rows, 2.6-4.1% slower at 32-64 rows
# (the 17-64-row X_FP8 tiles hold 2-4x the partial sums a tile).
IN_KERNEL_REDUCE_MAX_ROWS = MAX_M


@functools.cache
def split_counters(device: torch.device) -> torch.Tensor:
    """The device's split-K arrival counters: MAX_SPLIT_TILES int32 zeros, left zeros by every launch."""
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise RuntimeError("small-M GEMM: split-K counters are allocated at the first eager call on a device "
                           "(a warm-up run before graph capture), not during capture")
    return torch.zeros(MAX_SPLIT_TILES, dtype=torch.int32, device=device)


def table_path(device: str) -> Path:
    return CONFIG_DIR / f"small_m_gemm_{device}.json"


@functools.cache
def _table(device: str) -> dict:
    path = table_path(device)
    if not path.is_file():
        return {}
    table = json.loads(path.read_text())
    logger.info("small-M GEMM configs for %s: %s", device, path.name)
    return table


OTHER_PATHS = {"bf16": "cublas", "fp16": "cublas", "fp8": "w8a8", "fp8_block": "w8a8"}


def parse_entry(entry) -> GemmConfig | None:
    """A table value: the other path's name ("cublas", "w8a8") -> None, else a config."""
    if isinstance(entry, str):
        if entry not in OTHER_PATHS.values():
            raise ValueError(f"small-M GEMM table: unknown entry {entry!r}")
        return None
    return GemmConfig(**entry)


@functools.cache
def tuned_configs(device: str, kind: str, n: int, k: int) -> dict[int, GemmConfig | None] | None:
    """The table's entries for one weight shape: M bucket -> config (None: cuBLAS), or None if absent."""
    entries = _table(device).get(kind, {}).get(f"{n},{k}")
    if not entries:
        return None
    return {int(m): parse_entry(e) for m, e in entries.items()}


@functools.cache
def default_config(m: int, n: int, k: int, kind: str, device: str = "cuda") -> GemmConfig:
    """Untuned: narrow column tiles, split K until there are about two programs per SM (bounded so each
    split still streams several K steps)."""
    block_n = 32
    block_k = 256 if kind == "fp8" else 128  # rows of 256 bytes per step (block scales: one scale block)
    split = split_for(n, k, block_n, block_k, _sm_count(device))
    return GemmConfig(BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split, num_warps=4, num_stages=4)


def split_for(n: int, k: int, block_n: int, block_k: int, sms: int) -> int:
    """Split K (doubling) until there are about two programs per SM, each split keeping two K steps."""
    split, tiles = 1, triton.cdiv(n, block_n)
    while tiles * split < 2 * sms and k // (2 * split) >= 2 * block_k:
        split *= 2
    return split


def max_rows(kind: str) -> int:
    """The most rows the kernel takes for a weight kind (module docstring)."""
    return MAX_M_FP8 if kind.startswith("fp8") else MAX_M


def choose_config(m: int, n: int, k: int, kind: str, device: str) -> GemmConfig | None:
    """The config for an (M, N, K) GEMM on `device` (a name as device_name gives it), or None: the layer's
    other path (cuBLAS, or W8A8 for FP8). Tuned entries first (the next M bucket up); otherwise the default
    for FP8 up to MAX_M rows (above it only a tuned entry) and the other path for the rest."""
    if m > max_rows(kind):
        return None
    tuned = tuned_configs(device, kind, n, k)
    if tuned is not None:
        bucket = m_bucket(m)
        if bucket in tuned and (tuned[bucket] is None or not tuned[bucket].GEMV or m <= MAX_GEMV_ROWS):
            return None if tuned[bucket] is not None and tuned[bucket].X_FP8 else tuned[bucket]
    return default_config(m, n, k, kind) if kind.startswith("fp8") and m <= MAX_M else None


def config_to_json(cfg: GemmConfig | None, kind: str = "bf16"):
    return OTHER_PATHS[kind] if cfg is None else asdict(cfg)


# ---------------------------------------------------------------- entry points


def _device_key(x: torch.Tensor) -> str:
    return device_name(str(x.device)) if x.is_cuda else "cpu"


def _run(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None, bias: torch.Tensor | None,
         block_n: int, block_k: int, out_dtype: torch.dtype | None = None,
         y_out: torch.Tensor | None = None) -> torch.Tensor:
    """The launch at the table's config (or the default)."""
    block = (block_n, block_k) if block_n > 0 else None
    m, n, k = x.shape[0], weight.shape[0], weight.shape[1]
    kind = weight_kind(weight, block)
    cfg = choose_config(m, n, k, kind, _device_key(x)) or default_config(m, n, k, kind)
    return _launch(x, weight, scale, bias, block, cfg, out_dtype=out_dtype, y_out=y_out)


def _impl(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None, bias: torch.Tensor | None,
          block_n: int, block_k: int) -> torch.Tensor:
    """The traced op (x's dtype out: small_m_linear's caller converts while something traces)."""
    return _run(x, weight, scale, bias, block_n, block_k)


_op = torch.library.custom_op("duet::small_m_gemm", _impl, mutates_args=())


@_op.register_fake
def _(x, weight, scale, bias, block_n, block_k):
    return x.new_empty((x.shape[0], weight.shape[0]))


def _tracing() -> bool:
    return torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack() > 0


def small_m_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None = None,
                   bias: torch.Tensor | None = None, block: tuple[int, int] | None = None,
                   config: GemmConfig | None = None, out_dtype: torch.dtype | None = None,
                   y_out: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] (M <= max_rows) @ dequantized weight^T (+ bias) -> [M, N] in out_dtype (default: x's dtype;
    while something traces always x's: the caller converts), written into y_out if given (not while
    something traces); see the module docstring for the layouts.
    `config` overrides the table (the tuner and tests); otherwise the config is chosen per call from the
    table (cheap: cached), or the default when the table has none."""
    if config is not None:
        return _launch(x, weight, scale, bias, block, config, out_dtype=out_dtype, y_out=y_out)
    block_n, block_k = block if block is not None else (0, 0)
    if _tracing():
        return _op(x, weight, scale, bias, block_n, block_k)
    return _run(x, weight, scale, bias, block_n, block_k, out_dtype, y_out)


def fused_config(n: int, k: int, kind: str, device: str, paired: bool = False, m: int = 1,
                 gemv: bool = False) -> GemmConfig | None:
    """The config of an m-row GEMM with something fused into it (a SiLU-and-mul, the rotary and KV store, an
    add + RMSNorm epilogue, pre-normed rows; `gemv`: an RMSNorm inside its K loop, which only the GEMV runs):
    the table's choice for the weight at m rows where it fuses() (and is a GEMV with `gemv`), else None.
    paired (the SiLU-and-mul, the rotary): each program takes half its rows from one block (gate; a head's
    first half) and half from the other (up; the second half): the same bytes per program, the same grid (a
    tl.dot tile keeps at least 16 rows a block)."""
    if paired and n % 2:
        return None
    cfg = choose_config(m, n, k, kind, device)
    if cfg is None or not fuses(cfg) or (gemv and not cfg.GEMV):
        return None
    if paired and not pairs(cfg):
        return None
    return replace(cfg, BLOCK_N=cfg.BLOCK_N // 2) if paired else cfg


def silu_and_mul_config(n2: int, k: int, kind: str, device: str) -> GemmConfig | None:
    """The fused [gate; up] GEMM + SiLU-and-mul's config at one row (fused_config, paired)."""
    return fused_config(n2, k, kind, device, paired=True)


def _fused_config(x: torch.Tensor, weight: torch.Tensor, block: tuple[int, int] | None,
                  config: GemmConfig | None, paired: bool, gemv: bool = False) -> GemmConfig | None:
    """`config`, else the table's fused_config for x's rows; None above MAX_GEMV_ROWS rows or while
    something traces."""
    if not 0 < x.shape[0] <= MAX_GEMV_ROWS or _tracing():
        return None
    if config is not None:
        return config
    return fused_config(weight.shape[0], weight.shape[1], weight_kind(weight, block), _device_key(x), paired,
                        x.shape[0], gemv)


def small_m_silu_and_mul(x: torch.Tensor | PrenormedRow, weight: torch.Tensor, scale: torch.Tensor | None = None,
                         block: tuple[int, int] | None = None,
                         config: GemmConfig | None = None) -> torch.Tensor | None:
    """silu(x @ gate^T) * (x @ up^T) for up to MAX_GEMV_ROWS rows x [M, K] (or a PrenormedRow: the rows it
    stands for) and a [gate; up] weight [2I, K] (FP8: with its scales, as small_m_linear) -> [M, I], in one
    kernel: a decode step's MLP without the activation's own launch. None where the table's config for M rows
    does not fuse (fused_config), or while something traces: the caller then runs the linear and SiluAndMul."""
    prenormed = x if isinstance(x, PrenormedRow) else None
    row = x.weighted if prenormed is not None else x
    config = _fused_config(row, weight, block, config, paired=True)
    if config is None:
        return None
    return _launch(row, weight, scale, None, block, config, silu_mul=True, prenormed=prenormed)


def small_m_linear_add_rmsnorm(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None,
                               bias: torch.Tensor | None, block: tuple[int, int] | None, residual: torch.Tensor,
                               norm_weight: torch.Tensor, eps: float, config: GemmConfig | None = None,
                               after_attention: bool = False) -> tuple[PrenormedRow, torch.Tensor] | None:
    """(rows, h) for up to MAX_GEMV_ROWS rows x [M, K]: h = x @ W^T (+ bias) + residual, and `rows`, the
    PrenormedRow of norm_weight * rmsnorm(h) for the GEMV that h's norm feeds, in one kernel: decode tokens'
    o_proj with the residual add and the post-attention RMSNorm's work in its epilogue (the norm's own launch
    goes). after_attention (one row): x is decode attention's output; where preload_config gives a config (all
    of K in one preloaded tile) the GEMV is launched with PDL and loads its weights while attention runs
    (pdl.py); an explicit config is launched so as given (its first step preloaded). None where the table's
    config for M rows does not fuse (fused_config), or while something traces."""
    explicit = config is not None
    config = _fused_config(x, weight, block, config, paired=False)
    if config is None:
        return None
    pdl = False
    if after_attention and x.shape[0] == 1:  # PDL where all of K is loaded before the wait (explicit: as given)
        preloaded = config if explicit else preload_config(config, weight, block)
        pdl = preloaded is not None
        config = preloaded or config
    n = weight.shape[0]
    out = AddRmsNormOutput(residual, norm_weight, torch.empty_like(residual),
                           torch.empty(x.shape[0] * triton.cdiv(n, config.BLOCK_N), dtype=torch.float32,
                                       device=x.device))
    weighted = _launch(x, weight, scale, bias, block, config, add_norm=out, pdl=pdl)
    return PrenormedRow(weighted, out.partials, eps), out.h


# A preloaded weight tile's bytes per thread (64 registers) up to which preload_config loads all of K before the wait.
PRELOAD_MAX_BYTES_PER_THREAD = 256


def preload_config(cfg: GemmConfig, weight: torch.Tensor, block: tuple[int, int] | None) -> GemmConfig | None:
    """The config of a one-row GEMV launched with PDL after decode attention (pdl.py), from its table config:
    all of K in the one step loaded before the wait (BLOCK_K = K rounded up to a power of two, one stage), where
    that tile is at most PRELOAD_MAX_BYTES_PER_THREAD a thread; else None, and the GEMV runs its table config
    without PDL (with only its first step preloaded, the Llama-3.1-8B bf16 step measured slower,
    docs/benchmarks.md). Block scales keep their steps (one scale column a step): None."""
    k_p2 = triton.next_power_of_2(weight.shape[1])
    per_thread = cfg.BLOCK_N * k_p2 * weight.element_size() // (32 * cfg.num_warps)
    if block is not None or per_thread > PRELOAD_MAX_BYTES_PER_THREAD:
        return None
    return replace(cfg, BLOCK_K=k_p2, num_stages=1)


def takes_prenormed(x: torch.Tensor, weight: torch.Tensor, block: tuple[int, int] | None) -> bool:
    """Whether a GEMM of this weight at x's rows can take a PrenormedRow (the table's config for that many
    rows fuses, paired or not: the SiLU-and-mul and the rotary epilogue take half the column tile)."""
    return _fused_config(x, weight, block, None, paired=True) is not None


def small_m_prenormed_linear(row: PrenormedRow, weight: torch.Tensor, scale: torch.Tensor | None = None,
                             bias: torch.Tensor | None = None, block: tuple[int, int] | None = None,
                             rope: RopeStore | None = None, config: GemmConfig | None = None,
                             out_dtype: torch.dtype | None = None,
                             y_out: torch.Tensor | None = None) -> torch.Tensor | None:
    """The GEMM of rmsnorm(h) for the h a PrenormedRow stands for (up to MAX_GEMV_ROWS rows):
    small_m_rmsnorm_linear's y with the norm's work already done by the kernel that made h, in out_dtype
    (default: the row's; into y_out if given). With `rope`, the qkv projection's rotary and KV store run in the
    same kernel. None where the table's config for that many rows does not fuse, or while something traces."""
    config = _fused_config(row.weighted, weight, block, config, paired=rope is not None)
    if config is None:
        return None
    return _launch(row.weighted, weight, scale, bias, block, config, rope=rope, prenormed=row, out_dtype=out_dtype,
                   y_out=y_out)


def small_m_rmsnorm_linear(x: torch.Tensor, norm_weight: torch.Tensor, eps: float, residual: torch.Tensor | None,
                           weight: torch.Tensor, scale: torch.Tensor | None = None, bias: torch.Tensor | None = None,
                           block: tuple[int, int] | None = None, rope: RopeStore | None = None,
                           config: GemmConfig | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(y, h) for up to MAX_GEMV_ROWS rows x [M, K]: h = x + residual (x without one) and y = the GEMM of
    norm_weight * rmsnorm(h) (per row), in one kernel: RMSNorm's launch folded into the linear it feeds (a
    decode step's qkv projection). With `rope` the weight is that qkv projection and the same kernel runs the
    rotary and the KV store of each row's token: y's q heads come out rotated, k and v go into the pool (a
    paired config: half the table's column tile). None where the table has no single-split GEMV for M rows,
    or while something traces (the caller then runs RMSNorm, the linear and the attention's own rotary and
    store). Not offered with the fused SiLU-and-mul: measured slower there than the two kernels (H200,
    docs/benchmarks.md)."""
    config = _fused_config(x, weight, block, config, paired=rope is not None, gemv=True)
    if config is None:
        return None
    norm = RmsNormInput(norm_weight, eps, residual, None if residual is None else torch.empty_like(x))
    y = _launch(x, weight, scale, bias, block, config, norm=norm, rope=rope)
    return y, (x if residual is None else norm.sum_out)


def small_m_linear_fp8_act(xq: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                           bias: torch.Tensor | None, out_dtype: torch.dtype, config: GemmConfig | None = None,
                           block: tuple[int, int] | None = None) -> torch.Tensor:
    """The W8A8 GEMM of FP8 rows xq [M, K] and an FP8 weight, on FP8 tensor cores in this kernel: y [M, N] in
    out_dtype. Per-channel weight scales with x_scale a float32 scale per row ([M] or [M, 1]); block scales
    (`block`) with x_scale per 1 x block_k group [M, K / block_k]. `config` overrides the table's X_FP8 entry."""
    config = config or act_quant_config(xq, weight, block)
    if config is None:
        raise ValueError(f"no X_FP8 config for {tuple(xq.shape)} x {tuple(weight.shape)}")
    x_scale = x_scale.reshape(-1) if block is None else x_scale
    return _launch(xq, weight, scale, bias, block, config, x_scale=x_scale, out_dtype=out_dtype)


def _may_take(m: int, weight: torch.Tensor, block: tuple[int, int] | None) -> bool:
    """Whether the kernel can take M rows of this weight at all: 1 <= M <= its row limit, K steps that tile
    the scale blocks, and not while dynamo compiles (the piecewise runner traces a symbolic token count once
    for every size: a branch on it would add a guard and a recompile, so its pieces keep the other path)."""
    if torch.compiler.is_compiling() or not 0 < m <= max_rows(weight_kind(weight, block)):
        return False
    return block is None or _kernel_block_k(block[1])  # steps must not straddle two scale blocks


def act_quant_config(xq: torch.Tensor, weight: torch.Tensor,
                     block: tuple[int, int] | None = None) -> GemmConfig | None:
    """The table's X_FP8 config for FP8 rows xq [M, K] and an FP8 weight (per-channel or block scales): the
    W8A8 path then runs this kernel instead of torch._scaled_mm or the block GEMM. None otherwise."""
    m = xq.shape[0]
    if not _may_take(m, weight, block):
        return None
    tuned = tuned_configs(_device_key(xq), weight_kind(weight, block), weight.shape[0], weight.shape[1])
    cfg = None if tuned is None else tuned.get(m_bucket(m))
    return cfg if cfg is not None and cfg.X_FP8 else None


def use_small_m(x2: torch.Tensor, weight: torch.Tensor, block: tuple[int, int] | None = None) -> bool:
    """Whether a CUDA linear with these rows takes the kernel (weight-only): a table entry, or for FP8
    weights up to MAX_M rows the default config (see _may_take and choose_config)."""
    m = x2.shape[0]
    if not _may_take(m, weight, block):
        return False
    n, k = weight.shape
    return choose_config(m, n, k, weight_kind(weight, block), _device_key(x2)) is not None

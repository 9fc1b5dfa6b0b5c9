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
loads of a loop without tl.dot only then. Each fusion below takes up to MAX_FUSED_ROWS rows, where the table's
config for the weight at that row count fuses() (a single-split GEMV, up to MAX_GEMV_ROWS rows; a single-split
tl.dot tile where its FUSE says so, up to its 16 padded rows; the RMSNorm inside the K loop: a GEMV only).
`small_m_silu_and_mul` runs decode rows' [gate; up] GEMV and the SiLU-and-mul in one such kernel;
`small_m_rmsnorm_linear` folds the RMSNorm (and residual add) that feeds the qkv projection of decode tokens into
its GEMV and, given a RopeStore, runs their rotary and KV store in the epilogue (rows paired within each head, as
the SiLU pairs gate and up rows; `small_m_rope_linear`: the same epilogue for rows normed by their own kernel). A
norm between two GEMVs can also go in pieces: `small_m_linear_add_rmsnorm` adds the residual in its epilogue and
writes norm weight * h and the sums of h^2 per row and program (a PrenormedRow), and the next GEMV
(`small_m_silu_and_mul`, `small_m_prenormed_linear`, with the rotary epilogue too) takes those rows and scales each
by its 1 / rms at the end: a decode layer's post-attention norm between o_proj and gate/up, and the next layer's
input norm between down and qkv.

Split-K (SPLIT_K > 1) gives small-N layers enough programs to fill the GPU. It is deterministic: each split
writes its fp32 partial to a workspace [splits, M, N], and the splits are added in order 0..S-1, the bias
added and the sum cast, so the same inputs give the same bits (graph replay equals eager). Up to
IN_KERNEL_REDUCE_MAX_ROWS rows the GEMM does that itself: each split counts its arrival on its column tile's
counter and the one that arrives last adds the tile (which split that is does not change the order of the
sums) and zeroes the counter; above, a second kernel does. The workspace is allocated per call with a size
fixed by (splits, M, N), the counters once per device (split_counters, zeros between calls): no host sync,
CUDA-graph safe. One stream at a time: two split-K GEMMs running at once on one device would share counters.

Configs (BLOCK_N, BLOCK_K, SPLIT_K, num_warps, num_stages, GEMV, X_FP8, FUSE, PAIR_DOT) come from a table
tuned per GPU (small_m_gemm_config.py reads it); small_m_gemm_dispatch.py says which config (or which other
path) a layer takes at a row count. The Triton kernels are in small_m_gemm_kernel.py; this module checks
operands and launches them.

`small_m_linear` is the entry point. While something traces (dynamo, a dispatch mode) it goes through the
`duet::small_m_gemm` custom op (a fake implementation gives the output's shape), otherwise it calls the
implementation directly, as triton_ops/ops.py does.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch
import triton

from model_executor.layers.norm import PrenormedRow
from model_executor.layers.rotary_store_kv import RopeStore
from model_executor.layers.triton_ops.pdl import pdl_supported
from model_executor.layers.triton_ops.small_m_gemm_config import (
    FP8,
    OTHER_PATHS,
    GemmConfig,
    config_to_json,
    default_config,
    device_name,
    forget_tables,
    fuses,
    pairs,
    parse_entry,
    single_split,
    split_for,
    tiles_scale_block,
    tuned_configs,
    weight_kind,
)
from model_executor.layers.triton_ops.small_m_gemm_dispatch import (
    M_BUCKETS,
    MAX_FUSED_ROWS,
    MAX_GEMV_ROWS,
    MAX_M,
    MAX_M_FP8,
    act_quant_config,
    choose_config,
    device_key,
    fused_config,
    m_bucket,
    max_rows,
    paired_config,
    silu_and_mul_config,
    takes_prenormed,
    tracing,
    use_small_m,
)
from model_executor.layers.triton_ops.small_m_gemm_kernel import _small_m_gemm_kernel, _split_k_reduce_kernel

# FP8 weights: the dot runs in fp16 (e4m3 -> fp16 is one packed instruction per two values; e4m3 -> bf16
# needs a second conversion per value, which caps the kernel below bandwidth), so bf16 x goes to fp16
# times this power of two: exact for |x| from about 2^-13 up to fp16's max / X_PRESCALE (~1e6), far wider
# than a linear's inputs; below it the error is under 2^-21 absolute, less than bf16's own spacing there.
X_PRESCALE = 2.0**-4

# The public API: the entry points, and for their callers the table's API (small_m_gemm_config.py) and the
# dispatch's (small_m_gemm_dispatch.py) (point the loader elsewhere through small_m_gemm_config itself: its
# CONFIG_DIR, table_path).
__all__ = [
    "FP8",
    "IN_KERNEL_REDUCE_MAX_ROWS",
    "MAX_FUSED_ROWS",
    "MAX_GEMV_ROWS",
    "MAX_M",
    "MAX_M_FP8",
    "M_BUCKETS",
    "OTHER_PATHS",
    "X_PRESCALE",
    "AddRmsNormOutput",
    "GemmConfig",
    "RmsNormInput",
    "act_quant_config",
    "choose_config",
    "config_to_json",
    "default_config",
    "device_name",
    "forget_tables",
    "fused_config",
    "fuses",
    "m_bucket",
    "max_rows",
    "paired_config",
    "pairs",
    "parse_entry",
    "preload_config",
    "silu_and_mul_config",
    "single_split",
    "small_m_linear",
    "small_m_linear_add_rmsnorm",
    "small_m_linear_fp8_act",
    "small_m_prenormed_linear",
    "small_m_rmsnorm_linear",
    "small_m_silu_and_mul",
    "split_counters",
    "split_for",
    "takes_prenormed",
    "tiles_scale_block",
    "tuned_configs",
    "use_small_m",
    "weight_kind",
]


# ---------------------------------------------------------------- launch


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
            if not tiles_scale_block(block[1]):
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
        GEMV=cfg.GEMV, F16_DOT=f16_dot, ONE_ROW=m == 1, SILU_MUL=silu_mul, PAIR_DOT=cfg.PAIR_DOT,
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


# ---------------------------------------------------------------- split-K counters


# The split-K arrival counters a device has: 64K int32, far above any layer's N / BLOCK_N (a launch with more
# column tiles leaves its reduce to the second kernel).
MAX_SPLIT_TILES = 1 << 16
# Split K's reduce runs in the GEMM (the last split of a tile adds the partials) up to this many rows, and as
# a second kernel above, where the 17-64-row X_FP8 tiles hold 2-4x the partial sums a tile (docs/kernels.md).
IN_KERNEL_REDUCE_MAX_ROWS = MAX_M


@functools.cache
def split_counters(device: torch.device) -> torch.Tensor:
    """The device's split-K arrival counters: MAX_SPLIT_TILES int32 zeros, left zeros by every launch."""
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise RuntimeError("small-M GEMM: split-K counters are allocated at the first eager call on a device "
                           "(a warm-up run before graph capture), not during capture")
    return torch.zeros(MAX_SPLIT_TILES, dtype=torch.int32, device=device)


# ---------------------------------------------------------------- entry points


def _run(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None, bias: torch.Tensor | None,
         block_n: int, block_k: int, out_dtype: torch.dtype | None = None,
         y_out: torch.Tensor | None = None) -> torch.Tensor:
    """The launch at the table's config (or the default)."""
    block = (block_n, block_k) if block_n > 0 else None
    m, n, k = x.shape[0], weight.shape[0], weight.shape[1]
    kind = weight_kind(weight, block)
    cfg = choose_config(m, n, k, kind, device_key(x)) or default_config(m, n, k, kind)
    return _launch(x, weight, scale, bias, block, cfg, out_dtype=out_dtype, y_out=y_out)


def _impl(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None, bias: torch.Tensor | None,
          block_n: int, block_k: int) -> torch.Tensor:
    """The traced op (x's dtype out: small_m_linear's caller converts while something traces)."""
    return _run(x, weight, scale, bias, block_n, block_k)


_op = torch.library.custom_op("duet::small_m_gemm", _impl, mutates_args=())


@_op.register_fake
def _(x, weight, scale, bias, block_n, block_k):
    return x.new_empty((x.shape[0], weight.shape[0]))


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
    if tracing():
        return _op(x, weight, scale, bias, block_n, block_k)
    return _run(x, weight, scale, bias, block_n, block_k, out_dtype, y_out)


def _fused_config(x: torch.Tensor, weight: torch.Tensor, block: tuple[int, int] | None,
                  config: GemmConfig | None, paired: bool, gemv: bool = False) -> GemmConfig | None:
    """`config`, else the table's fused_config for x's rows; None above MAX_FUSED_ROWS rows or while
    something traces."""
    if not 0 < x.shape[0] <= MAX_FUSED_ROWS or tracing():
        return None
    if config is not None:
        return config
    return fused_config(weight.shape[0], weight.shape[1], weight_kind(weight, block), device_key(x), paired,
                        x.shape[0], gemv)


def small_m_silu_and_mul(x: torch.Tensor | PrenormedRow, weight: torch.Tensor, scale: torch.Tensor | None = None,
                         block: tuple[int, int] | None = None,
                         config: GemmConfig | None = None) -> torch.Tensor | None:
    """silu(x @ gate^T) * (x @ up^T) for up to MAX_FUSED_ROWS rows x [M, K] (or a PrenormedRow: the rows it
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
    """(rows, h) for up to MAX_FUSED_ROWS rows x [M, K]: h = x @ W^T (+ bias) + residual, and `rows`, the
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
    without PDL (PDL with only its first step preloaded is slower: docs/kernels.md). Block scales keep their
    steps (one scale column a step): None."""
    k_p2 = triton.next_power_of_2(weight.shape[1])
    per_thread = cfg.BLOCK_N * k_p2 * weight.element_size() // (32 * cfg.num_warps)
    if block is not None or per_thread > PRELOAD_MAX_BYTES_PER_THREAD:
        return None
    return replace(cfg, BLOCK_K=k_p2, num_stages=1)


def small_m_prenormed_linear(row: PrenormedRow, weight: torch.Tensor, scale: torch.Tensor | None = None,
                             bias: torch.Tensor | None = None, block: tuple[int, int] | None = None,
                             rope: RopeStore | None = None, config: GemmConfig | None = None,
                             out_dtype: torch.dtype | None = None,
                             y_out: torch.Tensor | None = None) -> torch.Tensor | None:
    """The GEMM of rmsnorm(h) for the h a PrenormedRow stands for (up to MAX_FUSED_ROWS rows):
    small_m_rmsnorm_linear's y with the norm's work already done by the kernel that made h, in out_dtype
    (default: the row's; into y_out if given). With `rope`, the qkv projection's rotary and KV store run in the
    same kernel. None where the table's config for that many rows does not fuse, or while something traces."""
    config = _fused_config(row.weighted, weight, block, config, paired=rope is not None)
    if config is None:
        return None
    return _launch(row.weighted, weight, scale, bias, block, config, rope=rope, prenormed=row, out_dtype=out_dtype,
                   y_out=y_out)


def small_m_rope_linear(x: torch.Tensor, weight: torch.Tensor, rope: RopeStore, scale: torch.Tensor | None = None,
                        bias: torch.Tensor | None = None, block: tuple[int, int] | None = None,
                        config: GemmConfig | None = None) -> torch.Tensor | None:
    """The qkv GEMM of normed rows x [M, K] with the rotary and KV store in its epilogue: small_m_rmsnorm_linear's
    rope for rows whose RMSNorm ran as its own kernel (above MAX_GEMV_ROWS rows, or where the table's config is a
    tl.dot tile: only a GEMV runs the norm in its K loop). `config`: paired_config's, got beforehand (the norm
    runs between). None where the table's config for M rows does not fuse, or while something traces."""
    config = _fused_config(x, weight, block, config, paired=True)
    if config is None:
        return None
    return _launch(x, weight, scale, bias, block, config, rope=rope)


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
    store). Not offered with the fused SiLU-and-mul: there the two kernels are faster (docs/kernels.md)."""
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

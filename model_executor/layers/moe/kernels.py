"""The fused MoE Triton kernels and their launcher (imports triton; fused_moe.py imports this lazily).

    moe_align_block_size: the T*k (token, expert) assignments sorted by expert, each expert's group padded
        to a multiple of BLOCK_M with a sentinel (T*k), the expert of each BLOCK_M block, and the padded
        total. An id outside 0..E-1 counts as expert E-1. One program for small batches (decode, small
        extends); torch ops for large ones (a single program would loop too long). Neither syncs with the host.
    grouped GEMM (one kernel, two uses): each program takes BLOCK_M sorted assignments of one expert and
        BLOCK_N output columns. First use: x @ w13[e].T with gate and up accumulated side by side and
        SiLU-and-mul in the epilogue -> act [T*k, I]. Second: act @ w2[e].T times the routing weight ->
        [T*k, H]. Blocks past the padded total return at once.
    combine: the k rows of each token summed (torch, float32 accumulation).
    gpt-oss (HAS_BIAS, SWIGLU, off for the other models): the experts' biases added in both GEMMs' epilogues,
        the clamped SwiGLU in place of SiLU-and-mul.

Up to a few tokens fused_experts_triton runs moe/small_batch.py instead (two GEMV kernels: no align, no
combine); moe/tuning.py says which path at which token count.

Every buffer's size depends only on T (min(T*k + E*(BLOCK_M-1), T*k*BLOCK_M) sorted slots), so a launch sequence can
be captured in a CUDA graph. Block sizes come from moe/tuning.py (a tuned table, else a default).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from model_executor.layers.moe import small_batch
from model_executor.layers.moe.tuning import PATHS, get_config, get_small_config, select_path

_TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}
ALIGN_ONE_PROGRAM_MAX = 4096  # assignments (T*k) up to which the one-program align kernel runs
_ALIGN_CHUNK = 64


@triton.jit
def _load_ids(ids_ptr, offs, numel, num_experts):
    """The expert ids at offs, clamped into 0..E-1 (as the small-batch kernels clamp theirs): an id outside
    would be counted in no expert's group yet scattered over expert 0's first slots, dropping real tokens'
    assignments. Past numel: -1, no expert."""
    ids = tl.load(ids_ptr + offs, mask=offs < numel, other=0).to(tl.int32)
    return tl.where(offs < numel, tl.minimum(tl.maximum(ids, 0), num_experts - 1), -1)


@triton.jit
def _moe_align_kernel(ids_ptr, sorted_ptr, expert_ids_ptr, total_ptr, numel, num_experts, max_padded, max_blocks,
                      BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, CHUNK: tl.constexpr, FILL: tl.constexpr):
    e_idx = tl.arange(0, BLOCK_E)
    e_valid = e_idx < num_experts
    counts = tl.zeros([BLOCK_E], dtype=tl.int32)
    for start in range(0, numel, CHUNK):
        offs = start + tl.arange(0, CHUNK)
        ids = _load_ids(ids_ptr, offs, numel, num_experts)
        counts += tl.sum((ids[:, None] == e_idx[None, :]).to(tl.int32), axis=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    cum = tl.cumsum(padded, axis=0)
    tl.store(total_ptr, tl.sum(padded, axis=0))
    # The expert of each block: how many experts' padded groups end at or before its first slot.
    for b0 in range(0, max_blocks, CHUNK):
        b = b0 + tl.arange(0, CHUNK)
        before = (cum[None, :] <= (b * BLOCK_M)[:, None]) & e_valid[None, :]
        expert = tl.minimum(tl.sum(before.to(tl.int32), axis=1), num_experts - 1)  # past the end: skipped
        tl.store(expert_ids_ptr + b, expert, mask=b < max_blocks)
    for p0 in range(0, max_padded, FILL):  # stores only: wide steps (few loop trips at decode sizes)
        p = p0 + tl.arange(0, FILL)
        tl.store(sorted_ptr + p, numel, mask=p < max_padded)
    tl.debug_barrier()  # the sentinel fill lands before the scatter below overwrites part of it
    offset = cum - padded  # next free slot of each expert
    i = tl.arange(0, CHUNK)
    for start in range(0, numel, CHUNK):
        offs = start + i
        ids = _load_ids(ids_ptr, offs, numel, num_experts)
        onehot = ids[:, None] == e_idx[None, :]
        base = tl.sum(tl.where(onehot, offset[None, :], 0), axis=1)
        rank = tl.sum(((ids[None, :] == ids[:, None]) & (i[None, :] < i[:, None])).to(tl.int32), axis=1)
        tl.store(sorted_ptr + base + rank, offs, mask=offs < numel)
        offset += tl.sum(onehot.to(tl.int32), axis=0)


def max_padded_slots(numel: int, num_experts: int, block_m: int) -> int:
    """An upper bound of the padded total: each expert pads fewer than block_m slots, and a block holds at
    least one assignment (the second bound is the smaller one for decode batches: few blocks to visit)."""
    return min(numel + num_experts * (block_m - 1), numel * block_m)


def moe_align_block_size(topk_ids: torch.Tensor, block_m: int, num_experts: int):
    """Returns (sorted_ids int32 [max_padded], expert_ids int32 [max_padded / block_m], total int32 [1]).

    sorted_ids lists flat assignment indices (token * k + j) grouped by expert, in token order within an
    expert, each group padded to a multiple of block_m with the sentinel T*k. Ids outside 0..E-1 (a router's
    NaN row once gave E) are clamped into it."""
    numel = topk_ids.numel()
    max_padded = max_padded_slots(numel, num_experts, block_m)
    max_blocks = triton.cdiv(max_padded, block_m)
    device = topk_ids.device
    if numel <= ALIGN_ONE_PROGRAM_MAX:
        sorted_ids = torch.empty(max_padded, dtype=torch.int32, device=device)
        expert_ids = torch.empty(max_blocks, dtype=torch.int32, device=device)
        total = torch.empty(1, dtype=torch.int32, device=device)
        _moe_align_kernel[(1,)](topk_ids, sorted_ids, expert_ids, total, numel, num_experts, max_padded,
                                max_blocks, BLOCK_M=block_m, BLOCK_E=triton.next_power_of_2(num_experts),
                                CHUNK=_ALIGN_CHUNK, FILL=1024, num_warps=4)
        return sorted_ids, expert_ids, total
    return _align_torch(topk_ids.flatten(), block_m, num_experts, max_padded, max_blocks)


def _align_torch(flat: torch.Tensor, block_m: int, num_experts: int, max_padded: int, max_blocks: int):
    """The same result from torch ops of fixed sizes (no host sync): for large batches."""
    # int64 scatter indices (the fused router's ids are int32), clamped into 0..E-1 as the kernel clamps them
    flat = flat.long().clamp(0, num_experts - 1)
    numel, device = flat.numel(), flat.device
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    cum = padded.cumsum(0)
    order = torch.argsort(flat, stable=True)
    expert_of = flat[order]
    rank = torch.arange(numel, device=device) - (counts.cumsum(0) - counts)[expert_of]
    sorted_ids = torch.full((max_padded,), numel, dtype=torch.int32, device=device)
    sorted_ids.scatter_(0, (cum - padded)[expert_of] + rank, order.to(torch.int32))
    starts = torch.arange(max_blocks, device=device) * block_m
    expert_ids = torch.searchsorted(cum, starts, right=True).clamp_(max=num_experts - 1).to(torch.int32)
    return sorted_ids, expert_ids, cum[-1:].to(torch.int32)


@triton.jit
def _fused_moe_gemm_kernel(
    a_ptr, b_ptr, c_ptr, weights_ptr, sorted_ptr, expert_ids_ptr, total_ptr, b_scale_ptr, bias_ptr,
    N, K, numel, max_padded,
    stride_am, stride_ak, stride_be, stride_bn, stride_bk, stride_cm, stride_cn, stride_se, stride_sn, stride_sk,
    stride_bias_e, swiglu_alpha, swiglu_limit,
    A_ROWS_PER_ASSIGNMENT: tl.constexpr, GATED: tl.constexpr, MUL_WEIGHT: tl.constexpr, DOT_F32: tl.constexpr,
    DOT_PRECISION: tl.constexpr, W_SCALE: tl.constexpr, SCALE_BN: tl.constexpr, SCALE_BK: tl.constexpr,
    TOP_K: tl.constexpr, TOP_K_P2: tl.constexpr, RENORMALIZE: tl.constexpr, WEIGHT_DTYPE: tl.constexpr,
    HAS_BIAS: tl.constexpr, SWIGLU: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    """C[a, n] = (A[a // A_ROWS_PER_ASSIGNMENT] @ B[e].T)[n] for the sorted assignments a of expert e.

    GATED: B has 2N rows (gate, then up); C = silu(gate) * up, each rounded to C's dtype where the torch
    path rounds. MUL_WEIGHT: C = (A @ B.T rounded) * w[a], w[a] = weights[a], divided by the sum of its
    token's TOP_K weights with RENORMALIZE, then rounded to WEIGHT_DTYPE (the router's epilogue done here:
    no kernels of its own).

    W_SCALE: B holds FP8 codes (weight-only: A stays in its dtype, each B tile is converted to A's dtype
    before the dot). 1: one scale per output row, b_scale[e, n], multiplied into the accumulator after the
    K loop (before the activation). 2: one scale per SCALE_BN x SCALE_BK tile, b_scale[e, n // SCALE_BN,
    k // SCALE_BK], multiplied into each B tile (BLOCK_K divides SCALE_BK: one scale column per tile).

    HAS_BIAS: bias[e, n] (bias[e, N + n] for up) added to the rounded GEMM output and rounded again, before
    the activation and the routing weight. SWIGLU (GATED): gpt-oss's clamped SwiGLU instead of SiLU-and-mul
    (small_batch.gate_up_epilogue)."""
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(max_padded, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    group = GROUP_M * num_pid_n  # grouped order: programs sharing B columns run close together
    first_m = (pid // group) * GROUP_M
    group_m = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % group) % group_m
    pid_n = (pid % group) // group_m
    if pid_m * BLOCK_M >= tl.load(total_ptr):
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    assignment = tl.load(sorted_ptr + offs_m).to(tl.int64)
    valid = assignment < numel
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    rows = assignment // A_ROWS_PER_ASSIGNMENT
    a_ptrs = a_ptr + rows[:, None] * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = b_ptr + expert * stride_be + offs_n[None, :].to(tl.int64) * stride_bn + offs_k[:, None] * stride_bk
    s_ptrs = b_scale_ptr + expert * stride_se + (offs_n // SCALE_BN) * stride_sn  # W_SCALE: this tile's scales
    s_up_ptrs = b_scale_ptr + expert * stride_se + ((N + offs_n) // SCALE_BN) * stride_sn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = offs_k < K - k0
        a = tl.load(a_ptrs, mask=valid[:, None] & k_mask[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        if W_SCALE == 2:
            b = (b.to(tl.float32) * tl.load(s_ptrs + (k0 // SCALE_BK) * stride_sk, mask=n_mask)[None, :]).to(a.dtype)
        elif W_SCALE == 1:
            b = b.to(a.dtype)
        if DOT_F32:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc += tl.dot(a, b, input_precision=DOT_PRECISION)
        if GATED:
            b_up = tl.load(b_ptrs + N * stride_bn, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
            if W_SCALE == 2:
                s_up = tl.load(s_up_ptrs + (k0 // SCALE_BK) * stride_sk, mask=n_mask)
                b_up = (b_up.to(tl.float32) * s_up[None, :]).to(a.dtype)
            elif W_SCALE == 1:
                b_up = b_up.to(a.dtype)
            if DOT_F32:
                b_up = b_up.to(tl.float32)
            acc_up += tl.dot(a, b_up, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    if W_SCALE == 1:
        acc = acc * tl.load(s_ptrs, mask=n_mask, other=0.0)[None, :]
        if GATED:
            acc_up = acc_up * tl.load(s_up_ptrs, mask=n_mask, other=0.0)[None, :]
    out_dtype = c_ptr.dtype.element_ty
    bias_ptrs = bias_ptr + expert * stride_bias_e + offs_n[None, :]
    if GATED:
        acc = small_batch.gate_up_epilogue(acc, acc_up, bias_ptrs, bias_ptrs + N, n_mask[None, :], out_dtype,
                                           HAS_BIAS, SWIGLU, swiglu_alpha, swiglu_limit)
    elif HAS_BIAS:
        acc = (acc.to(out_dtype).to(tl.float32) + tl.load(bias_ptrs, mask=n_mask[None, :], other=0.0).to(tl.float32))
    if MUL_WEIGHT:
        w = tl.load(weights_ptr + assignment, mask=valid, other=0.0).to(tl.float32)
        if RENORMALIZE:
            j = tl.arange(0, TOP_K_P2)
            first = (assignment // TOP_K) * TOP_K
            row = tl.load(weights_ptr + first[:, None] + j[None, :], mask=valid[:, None] & (j[None, :] < TOP_K),
                          other=0.0).to(tl.float32)
            w = w / tl.where(valid, tl.sum(row, axis=1), 1.0)
        w = w.to(WEIGHT_DTYPE).to(tl.float32)
        acc = acc.to(out_dtype).to(tl.float32) * w[:, None]
    c_ptrs = c_ptr + assignment[:, None] * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(out_dtype), mask=valid[:, None] & n_mask[None, :])


def _gemm(a, b, c, weights, sorted_ids, expert_ids, total, n, k, numel, rows_per_assignment, gated, mul_weight,
          config: dict, top_k: int = 1, renormalize: bool = False, weight_dtype: torch.dtype = torch.float32,
          b_scale: torch.Tensor | None = None, block: tuple[int, int] | None = None, bias: torch.Tensor | None = None,
          swiglu: tuple[float, float] | None = None) -> None:
    """b_scale: FP8 B's scales, [E, rows] per output row, or [E, rows / bn, K / bk] per tile with block=(bn, bk).
    bias: [E, rows] (rows contiguous); swiglu: (alpha, limit) of the clamped SwiGLU (gated only)."""
    max_padded = sorted_ids.numel()
    bm, bn, bk = config["BLOCK_M"], config["BLOCK_N"], config["BLOCK_K"]
    if b_scale is None:
        w_scale, scale, strides, scale_bn, scale_bk = 0, b, (0, 0, 0), 1, 1
    elif block is None:
        w_scale, scale, scale_bn, scale_bk = 1, b_scale, 1, 1
        strides = (b_scale.stride(0), b_scale.stride(1), 0)
    else:
        w_scale, scale, (scale_bn, scale_bk) = 2, b_scale, block
        strides = b_scale.stride()
        bk = min(bk, scale_bk)  # a B tile within one scale column
        if scale_bk % bk:
            raise ValueError(f"BLOCK_K {bk} does not divide the weight scales' block {scale_bk}")
    grid = (triton.cdiv(max_padded, bm) * triton.cdiv(n, bn),)
    _fused_moe_gemm_kernel[grid](
        a, b, c, weights, sorted_ids, expert_ids, total, scale, b if bias is None else bias,
        n, k, numel, max_padded,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), b.stride(2), c.stride(0), c.stride(1), *strides,
        0 if bias is None else bias.stride(0), *(swiglu or (0.0, 0.0)),
        A_ROWS_PER_ASSIGNMENT=rows_per_assignment, GATED=gated, MUL_WEIGHT=mul_weight,
        W_SCALE=w_scale, SCALE_BN=scale_bn, SCALE_BK=scale_bk,
        # Triton's CPU interpreter computes bfloat16 tl.dot wrongly (garbage): it gets float32 operands
        DOT_F32=a.device.type == "cpu" and a.dtype == torch.bfloat16,
        # float32 models (tests) get float32 products, not TF32, as torch's matmul (TF32 off by default)
        DOT_PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        TOP_K=top_k, TOP_K_P2=triton.next_power_of_2(top_k), RENORMALIZE=renormalize,
        WEIGHT_DTYPE=_TL_DTYPES[weight_dtype], HAS_BIAS=bias is not None, SWIGLU=swiglu is not None,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=config["GROUP_M"],
        num_warps=config["num_warps"], num_stages=config["num_stages"],
    )


def _checked_bias(bias: torch.Tensor | None, shape: tuple[int, int]) -> torch.Tensor | None:
    """An expert bias with its rows contiguous (the kernels index bias[e, n] as e * stride + n)."""
    if bias is None:
        return None
    if tuple(bias.shape) != shape:
        raise ValueError(f"expert bias of shape {tuple(bias.shape)}, expected {shape}")
    return bias if bias.stride(-1) == 1 else bias.contiguous()


def fused_experts_triton(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                         topk_ids: torch.Tensor, renormalize: bool = False, round_weights: bool = False,
                         config: dict | None = None, weight_dtype: torch.dtype | None = None,
                         w13_scale: torch.Tensor | None = None, w2_scale: torch.Tensor | None = None,
                         block: tuple[int, int] | None = None, path: str | None = None,
                         w13_bias: torch.Tensor | None = None, w2_bias: torch.Tensor | None = None,
                         swiglu: tuple[float, float] | None = None) -> torch.Tensor:
    """fused_moe.fused_experts on the Triton path (CUDA, or CPU tensors under TRITON_INTERPRET=1).

    w13_scale, w2_scale: with FP8 w13 / w2, their scales (fused_moe.fused_experts says the layouts).

    path: "small_batch" (moe/small_batch.py) or "grouped" (align + grouped GEMMs + combine); None: the one
    moe/tuning.select_path picks for this token count, or "grouped" when a config is given. config: the
    path's block sizes (tuning's SMALL_KEYS or KEYS); None: the tuned table's, else the default.

    weight_dtype: what round_weights rounds the routing weights to (x's dtype unless given; a test picks
    float16 with float32 activations, where the rounding stands far above the float32 noise).

    w13_bias [E, 2I], w2_bias [E, H]: the experts' biases (gpt-oss); swiglu: (alpha, limit) of gpt-oss's
    clamped SwiGLU, None for SiLU-and-mul."""
    weight_dtype = (weight_dtype or x.dtype) if round_weights else torch.float32
    num_tokens, hidden = x.shape
    top_k = topk_ids.shape[1]
    num_experts, inter = w2.shape[0], w2.shape[2]
    w13_bias, w2_bias = _checked_bias(w13_bias, (num_experts, 2 * inter)), _checked_bias(w2_bias, (num_experts, hidden))
    numel = num_tokens * top_k
    if num_tokens == 0:
        return torch.empty_like(x)
    table_dtype = "fp8_w8" if w13_scale is not None else None
    if path is None and config is None:
        path, config = select_path(num_experts, 2 * inter, hidden, num_tokens, str(x.device), table_dtype)
    path = path or "grouped"
    if path not in PATHS:
        raise ValueError(f"path {path!r} is none of {PATHS}")
    if path == "small_batch":
        config = config or get_small_config(num_experts, 2 * inter, hidden, num_tokens, str(x.device), table_dtype)
        return small_batch.fused_experts_small_batch(x, w13, w2, topk_weights, topk_ids, renormalize, weight_dtype,
                                                     config, w13_scale, w2_scale, block, w13_bias, w2_bias, swiglu)
    if config is None:
        config = get_config(num_experts, 2 * inter, hidden, num_tokens, str(x.device), table_dtype)
    x = x if x.stride(-1) == 1 else x.contiguous()
    sorted_ids, expert_ids, total = moe_align_block_size(topk_ids.contiguous(), config["BLOCK_M"], num_experts)
    act = torch.empty(numel, inter, dtype=x.dtype, device=x.device)
    _gemm(x, w13, act, topk_weights, sorted_ids, expert_ids, total, inter, hidden, numel, top_k, True, False, config,
          b_scale=w13_scale, block=block, bias=w13_bias, swiglu=swiglu)
    down = torch.empty(numel, hidden, dtype=x.dtype, device=x.device)
    weights = topk_weights.contiguous()
    _gemm(act, w2, down, weights, sorted_ids, expert_ids, total, hidden, inter, numel, 1, False, True, config,
          top_k, renormalize, weight_dtype, b_scale=w2_scale, block=block, bias=w2_bias)
    out = torch.empty_like(x)
    torch.sum(down.view(num_tokens, top_k, hidden), dim=1, out=out)
    return out

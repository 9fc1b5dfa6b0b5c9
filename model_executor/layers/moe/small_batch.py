"""The small-batch (decode) path of the fused MoE: two GEMV kernels, no align and no combine kernel.

    gate-up GEMV: one program per (assignment t*k+j, BLOCK_N columns of I): the expert e = ids[t, j] read
        from the router's output, x[t] @ w13[e].T over the full K for its gate and up columns, SiLU-and-mul
        -> act [T*k, I].
    down GEMV + combine: one program per (token t, BLOCK_N columns of H): act[t*k+j] @ w2[e_j].T for its k
        experts at once, each scaled by its routing weight, summed in float32 -> out[t] (no atomics:
        deterministic).

At decode sizes an MoE layer moves a few tens of MB of weights (microseconds at HBM speed), so the grouped
path's fixed costs (the align kernel's sort, GEMM tiles of BLOCK_M rows for one or two real rows, the
combine's torch.sum) weigh more than the bytes; here an MoE layer is the router GEMM, the top-k kernel and
these two. Each program reads one row of activations and the expert's weight tile, so nothing is sorted:
the programs of one column tile of all assignments are launched together (assignment is the fastest grid
axis), and tokens that share an expert read its tile from L2 rather than HBM. The K loops are
software-pipelined (NUM_STAGES: the next tiles' loads go out through shared memory while this one is
summed): at one token there are few programs per SM, and one K step in flight each would not cover the
memory latency.

Buffers depend only on T (act [T*k, I]), nothing syncs with the host: CUDA-graph safe. The rounding steps
are those of the grouped kernel and of fused_moe.fused_experts_torch (gate and up rounded to x's dtype,
SiLU rounded, the product rounded; the down projection rounded before the routing weight; the k weighted
rows summed in float32 and rounded once). FP8 weights: per output row scales after the K loop, or one
scale per SCALE_BN x SCALE_BK tile applied to each weight tile (rounded to x's dtype, as the reference
dequantizes), as the grouped kernel's W_SCALE modes. gpt-oss: the experts' biases and its clamped SwiGLU
(HAS_BIAS, SWIGLU: gate_up_epilogue, shared with the grouped kernel), compiled only where asked for.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


@triton.jit
def _weight_tile(w_ptrs, s_ptrs, k0, mask, n_mask, X_DTYPE: tl.constexpr, W_SCALE: tl.constexpr,
                 SCALE_BK: tl.constexpr, stride_sk):
    """A [BLOCK_N, BLOCK_K] weight tile in float32, as the reference's dequantized weight in x's dtype."""
    w = tl.load(w_ptrs, mask=mask, other=0.0)
    if W_SCALE == 2:
        s = tl.load(s_ptrs + (k0 // SCALE_BK) * stride_sk, mask=n_mask, other=0.0)
        w = (w.to(tl.float32) * s[:, None]).to(X_DTYPE)
    return w.to(tl.float32)  # FP8 codes (W_SCALE 1) are exact in every activation dtype


@triton.jit
def gate_up_epilogue(gate, up, gate_bias_ptrs, up_bias_ptrs, bias_mask, OUT_DTYPE: tl.constexpr,
                     HAS_BIAS: tl.constexpr, SWIGLU: tl.constexpr, swiglu_alpha, swiglu_limit):
    """The gate and up GEMMs' float32 sums -> the activation (float32 holding OUT_DTYPE values), rounded
    where fused_moe.fused_experts_torch rounds: gate and up to OUT_DTYPE, plus their biases (HAS_BIAS)
    rounded again; then SiLU(gate) * up, or with SWIGLU gpt-oss's clamped SwiGLU: gate clamped above at
    limit, up to +-limit, (up + 1) * gate * sigmoid(alpha * gate). Shared by the grouped and GEMV kernels."""
    gate = gate.to(OUT_DTYPE).to(tl.float32)
    up = up.to(OUT_DTYPE).to(tl.float32)
    if HAS_BIAS:
        gate = (gate + tl.load(gate_bias_ptrs, mask=bias_mask, other=0.0).to(tl.float32)).to(OUT_DTYPE)
        up = (up + tl.load(up_bias_ptrs, mask=bias_mask, other=0.0).to(tl.float32)).to(OUT_DTYPE)
        gate = gate.to(tl.float32)
        up = up.to(tl.float32)
    if SWIGLU:
        gate = tl.minimum(gate, swiglu_limit)
        up = tl.minimum(tl.maximum(up, -swiglu_limit), swiglu_limit)
        glu = (gate / (1.0 + tl.exp(-swiglu_alpha * gate))).to(OUT_DTYPE).to(tl.float32)
        return glu * (up + 1.0).to(OUT_DTYPE).to(tl.float32)
    return (gate / (1.0 + tl.exp(-gate))).to(OUT_DTYPE).to(tl.float32) * up


@triton.jit
def _gate_up_gemv_kernel(
    x_ptr, w_ptr, act_ptr, ids_ptr, scale_ptr, bias_ptr, N, K, num_experts,
    stride_xm, stride_we, stride_wn, stride_am, stride_se, stride_sn, stride_sk, stride_bias_e,
    swiglu_alpha, swiglu_limit,
    TOP_K: tl.constexpr, W_SCALE: tl.constexpr, SCALE_BN: tl.constexpr, SCALE_BK: tl.constexpr,
    HAS_BIAS: tl.constexpr, SWIGLU: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr,
):
    """act[a, n] = silu(x[a // TOP_K] @ w[e, n].T) * (x[a // TOP_K] @ w[e, N + n].T), e = ids[a]; w is
    [E, 2N, K] with K contiguous (gate rows, then up rows)."""
    a = tl.program_id(0)
    pid_n = tl.program_id(1)
    # (clamped: a router given NaN logits, e.g. a garbage padded row, may name no expert; never read past w)
    expert = tl.minimum(tl.load(ids_ptr + a), num_experts - 1).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + (a // TOP_K).to(tl.int64) * stride_xm + offs_k
    w_ptrs = w_ptr + expert * stride_we + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
    up_ptrs = w_ptrs + N * stride_wn
    s_ptrs = scale_ptr + expert * stride_se + (offs_n // SCALE_BN) * stride_sn
    s_up_ptrs = scale_ptr + expert * stride_se + ((N + offs_n) // SCALE_BN) * stride_sn
    x_dtype = x_ptr.dtype.element_ty
    # One row: products summed in a [BLOCK_N, BLOCK_K] float32 tile, reduced once after the K loop (a
    # tl.dot would pad the row to 16).
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
        k_mask = offs_k < K - k0
        x = tl.load(x_ptrs, mask=k_mask, other=0.0).to(tl.float32)
        mask = n_mask[:, None] & k_mask[None, :]
        acc += x[None, :] * _weight_tile(w_ptrs, s_ptrs, k0, mask, n_mask, x_dtype, W_SCALE, SCALE_BK, stride_sk)
        acc_up += x[None, :] * _weight_tile(up_ptrs, s_up_ptrs, k0, mask, n_mask, x_dtype, W_SCALE, SCALE_BK,
                                            stride_sk)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
        up_ptrs += BLOCK_K
    gate = tl.sum(acc, axis=1)
    up = tl.sum(acc_up, axis=1)
    if W_SCALE == 1:
        gate = gate * tl.load(s_ptrs, mask=n_mask, other=0.0)
        up = up * tl.load(s_up_ptrs, mask=n_mask, other=0.0)
    bias_ptrs = bias_ptr + expert * stride_bias_e + offs_n
    act = gate_up_epilogue(gate, up, bias_ptrs, bias_ptrs + N, n_mask, x_dtype, HAS_BIAS, SWIGLU, swiglu_alpha,
                           swiglu_limit)
    tl.store(act_ptr + a.to(tl.int64) * stride_am + offs_n, act.to(x_dtype), mask=n_mask)


@triton.jit
def _down_gemv_combine_kernel(
    act_ptr, w_ptr, out_ptr, ids_ptr, weights_ptr, scale_ptr, bias_ptr, N, K, num_experts,
    stride_am, stride_we, stride_wn, stride_om, stride_se, stride_sn, stride_sk, stride_bias_e,
    TOP_K: tl.constexpr, TOP_K_P2: tl.constexpr, RENORMALIZE: tl.constexpr, WEIGHT_DTYPE: tl.constexpr,
    W_SCALE: tl.constexpr, SCALE_BN: tl.constexpr, SCALE_BK: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr,
):
    """out[t, n] = sum over j of w[t, j] * (act[t*TOP_K + j] @ w2[e, n].T rounded), e = ids[t, j], summed in
    float32 (a fixed tree over j: deterministic); w[t, j] = weights[t, j], divided by the sum of the row with
    RENORMALIZE, rounded to WEIGHT_DTYPE (as the grouped kernel's MUL_WEIGHT epilogue).

    The k experts' tiles are one [TOP_K, BLOCK_N, BLOCK_K] load per K step, not a loop over the experts: at
    one token this kernel has few programs, and a loop over k would leave each with one small tile in flight
    at a time (latency-bound); this way each K step has all k experts' bytes in flight."""
    t = tl.program_id(0).to(tl.int64)
    pid_n = tl.program_id(1)
    j = tl.arange(0, TOP_K_P2)
    j_mask = j < TOP_K
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    out_dtype = out_ptr.dtype.element_ty
    a = t * TOP_K + j
    expert = tl.minimum(tl.load(ids_ptr + a, mask=j_mask, other=0), num_experts - 1).to(tl.int64)
    a_ptrs = act_ptr + a[:, None] * stride_am + offs_k[None, :]  # [TOP_K, BLOCK_K]
    w_ptrs = (w_ptr + expert[:, None, None] * stride_we + offs_n[None, :, None].to(tl.int64) * stride_wn
              + offs_k[None, None, :])  # [TOP_K, BLOCK_N, BLOCK_K]
    s_ptrs = scale_ptr + expert[:, None] * stride_se + (offs_n // SCALE_BN)[None, :] * stride_sn  # [TOP_K, BLOCK_N]
    jn_mask = j_mask[:, None] & n_mask[None, :]
    acc = tl.zeros((TOP_K_P2, BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
        k_mask = offs_k < K - k0
        v = tl.load(a_ptrs, mask=j_mask[:, None] & k_mask[None, :], other=0.0).to(tl.float32)
        tile = tl.load(w_ptrs, mask=jn_mask[:, :, None] & k_mask[None, None, :], other=0.0)
        if W_SCALE == 2:
            scale = tl.load(s_ptrs + (k0 // SCALE_BK) * stride_sk, mask=jn_mask, other=0.0)
            tile = (tile.to(tl.float32) * scale[:, :, None]).to(out_dtype)
        acc += v[:, None, :] * tile.to(tl.float32)  # FP8 codes (W_SCALE 1) are exact in every activation dtype
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    y = tl.sum(acc, axis=2)  # [TOP_K, BLOCK_N]
    if W_SCALE == 1:
        y = y * tl.load(s_ptrs, mask=jn_mask, other=0.0)
    y = y.to(out_dtype).to(tl.float32)
    if HAS_BIAS:  # each expert's bias, weighted with the rest of its output
        bias = tl.load(bias_ptr + expert[:, None] * stride_bias_e + offs_n[None, :], mask=jn_mask, other=0.0)
        y = (y + bias.to(tl.float32)).to(out_dtype).to(tl.float32)
    w = tl.load(weights_ptr + a, mask=j_mask, other=0.0).to(tl.float32)
    if RENORMALIZE:
        w = w / tl.sum(w)
    w = w.to(WEIGHT_DTYPE).to(tl.float32)
    total = tl.sum(y * w[:, None], axis=0)
    tl.store(out_ptr + t * stride_om + offs_n, total.to(out_dtype), mask=n_mask)


def _scale_args(scale: torch.Tensor | None, weight: torch.Tensor, block: tuple[int, int] | None, block_k: int):
    """(W_SCALE mode, scale tensor, its strides, SCALE_BN, SCALE_BK, the K tile) for one weight."""
    if scale is None:
        return 0, weight, (0, 0, 0), 1, 1, block_k
    if block is None:
        return 1, scale, (scale.stride(0), scale.stride(1), 0), 1, 1, block_k
    scale_bn, scale_bk = block
    block_k = min(block_k, scale_bk)  # a weight tile within one scale column
    if scale_bk % block_k:
        raise ValueError(f"BLOCK_K {block_k} does not divide the weight scales' block {scale_bk}")
    return 2, scale, scale.stride(), scale_bn, scale_bk, block_k


def fused_experts_small_batch(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                              topk_ids: torch.Tensor, renormalize: bool, weight_dtype: torch.dtype, config: dict,
                              w13_scale: torch.Tensor | None = None, w2_scale: torch.Tensor | None = None,
                              block: tuple[int, int] | None = None, w13_bias: torch.Tensor | None = None,
                              w2_bias: torch.Tensor | None = None,
                              swiglu: tuple[float, float] | None = None) -> torch.Tensor:
    """out [T, H] in x's dtype (kernels.fused_experts_triton validated the arguments; weight_dtype: what the
    routing weights are rounded to, float32 for no rounding). config: moe/tuning.SMALL_KEYS. w13_bias [E, 2I],
    w2_bias [E, H] (contiguous rows); swiglu: (alpha, limit) of the clamped SwiGLU, None for SiLU-and-mul."""
    num_tokens, hidden = x.shape
    top_k = topk_ids.shape[1]
    inter = w2.shape[2]
    x = x if x.stride(-1) == 1 else x.contiguous()
    ids = topk_ids.contiguous()
    weights = topk_weights.contiguous()
    if w13.stride(-1) != 1 or w2.stride(-1) != 1:
        raise ValueError("the experts' weights must have their K dimension contiguous")
    out = torch.empty_like(x)
    act = torch.empty(num_tokens * top_k, inter, dtype=x.dtype, device=x.device)
    mode, scale, strides, sbn, sbk, bk = _scale_args(w13_scale, w13, block, config["BLOCK_K"])
    bn = config["BLOCK_N"]
    _gate_up_gemv_kernel[(num_tokens * top_k, triton.cdiv(inter, bn))](
        x, w13, act, ids, scale, w13 if w13_bias is None else w13_bias, inter, hidden, w13.shape[0],
        x.stride(0), w13.stride(0), w13.stride(1), act.stride(0), *strides,
        0 if w13_bias is None else w13_bias.stride(0), *(swiglu or (0.0, 0.0)),
        TOP_K=top_k, W_SCALE=mode, SCALE_BN=sbn, SCALE_BK=sbk, HAS_BIAS=w13_bias is not None,
        SWIGLU=swiglu is not None, BLOCK_N=bn, BLOCK_K=bk,
        NUM_STAGES=config["num_stages"], num_warps=config["num_warps"])
    mode, scale, strides, sbn, sbk, bk = _scale_args(w2_scale, w2, block, config["DOWN_BLOCK_K"])
    bn = config["DOWN_BLOCK_N"]
    _down_gemv_combine_kernel[(num_tokens, triton.cdiv(hidden, bn))](
        act, w2, out, ids, weights, scale, w2 if w2_bias is None else w2_bias, hidden, inter, w2.shape[0],
        act.stride(0), w2.stride(0), w2.stride(1), out.stride(0), *strides, 0 if w2_bias is None else w2_bias.stride(0),
        TOP_K=top_k, TOP_K_P2=triton.next_power_of_2(top_k), RENORMALIZE=renormalize,
        WEIGHT_DTYPE=_TL_DTYPES[weight_dtype], W_SCALE=mode, SCALE_BN=sbn, SCALE_BK=sbk,
        HAS_BIAS=w2_bias is not None,
        BLOCK_N=bn, BLOCK_K=bk, NUM_STAGES=config["down_num_stages"], num_warps=config["down_num_warps"])
    return out

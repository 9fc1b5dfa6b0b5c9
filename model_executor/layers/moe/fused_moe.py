"""The experts' computation: out[t] = sum_j w[t, j] * down_e(silu(gate_e(x[t])) * up_e(x[t])), e = ids[t, j].

    fused_experts(x, w13, w2, topk_weights, topk_ids, renormalize, round_weights) -> out [T, H]

gpt-oss's experts (both off by default): per-expert biases (w13_bias [E, 2I] on the gate and up outputs, w2_bias
[E, H] on the down output, weighted by w with the rest of the expert's output), and its clamped SwiGLU in place of
SiLU-and-mul (swiglu=(alpha, limit): gate = min(gate, limit), up = clamp(up, -limit, limit),
act = (up + 1) * gate * sigmoid(alpha * gate)).

w is topk_weights, divided by its row's sum with renormalize, rounded to x's dtype with round_weights (the
router's last steps, which the Triton path does inside its second GEMM instead of three small kernels).

One function for every caller. FP8 expert weights (weight-only: the activations stay in x's dtype) come
with their scales: per output row (w13_scale [E, 2I], w2_scale [E, H]; online quantization) or per
block_n x block_k tile (w13_scale [E, 2I / bn, H / bk], w2_scale [E, H / bn, I / bk]; block-quantized
checkpoints). The Triton GEMMs convert each FP8 tile in registers (per-row scales in the epilogue, tile
scales on the tile); the torch path dequantizes each expert's weights and runs the unquantized math. On CUDA it runs the
Triton path (moe/kernels.py: align the token -> expert assignments to the GEMM block, a grouped GEMM with
SiLU-and-mul, a grouped GEMM scaled by the routing weights, a sum over the k experts of each token): fixed
shapes for a given token count and no host sync, so it runs inside decode graphs and the piecewise pieces.
On CPU (and as the reference of the kernels) the plain torch path below.

While something traces (dynamo, FakeTensorMode) the call goes through the registered `duet::fused_experts`
op, opaque to the tracer (the torch path's data-dependent indexing would not trace); in eager, directly.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from model_executor.layers.quantization import fp8_math
from model_executor.layers.triton_ops.ops import _tracing


def routing_weights(topk_weights: torch.Tensor, renormalize: bool, round_weights: bool,
                    dtype: torch.dtype) -> torch.Tensor:
    """The weights the experts' outputs are scaled by (float32 math, as HF's routers)."""
    weights = topk_weights.float()
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(dtype) if round_weights else weights


def dequantize_expert(w: torch.Tensor, scale: torch.Tensor | None, block: tuple[int, int] | None,
                      dtype: torch.dtype) -> torch.Tensor:
    """One expert's weight [rows, K] in `dtype`: FP8 codes times their scales (per row, or per tile)."""
    if scale is None:
        return w
    if block is not None:
        return fp8_math.dequantize_fp8_block(w, scale, block, dtype)
    return (w.float() * scale.float()[:, None]).to(dtype)


def gated_activation(gate_up: torch.Tensor, swiglu: tuple[float, float] | None) -> torch.Tensor:
    """[T, 2I] (gate columns, then up) -> [T, I] in gate_up's dtype: SiLU(gate) * up, or gpt-oss's clamped
    SwiGLU with swiglu = (alpha, limit) (HF's GptOssExperts' steps)."""
    inter = gate_up.shape[-1] // 2
    gate, up = gate_up[..., :inter], gate_up[..., inter:]
    if swiglu is None:
        return F.silu(gate) * up
    alpha, limit = swiglu
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def fused_experts_torch(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                        topk_ids: torch.Tensor, renormalize: bool = False, round_weights: bool = False,
                        w13_scale: torch.Tensor | None = None, w2_scale: torch.Tensor | None = None,
                        block: tuple[int, int] | None = None, w13_bias: torch.Tensor | None = None,
                        w2_bias: torch.Tensor | None = None,
                        swiglu: tuple[float, float] | None = None) -> torch.Tensor:
    """The reference: each expert's tokens gathered, its MLP in x's dtype (as HF's experts loop), the
    weighted outputs summed per token in float32, rounded once to x's dtype. FP8 experts: each expert's
    weights dequantized to x's dtype first. Biases are added to the rounded GEMM outputs."""
    topk_weights = routing_weights(topk_weights, renormalize, round_weights, x.dtype)
    num_tokens, top_k = topk_ids.shape
    out = torch.zeros(num_tokens, x.shape[1], dtype=torch.float32, device=x.device)
    flat = topk_ids.flatten()
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=w13.shape[0]).tolist()  # a host sync: fine off the GPU
    weights = topk_weights.flatten()
    start = 0
    for expert, n in enumerate(counts):
        if n == 0:
            continue
        picked = order[start : start + n]
        start += n
        tokens = picked // top_k
        e13 = dequantize_expert(w13[expert], None if w13_scale is None else w13_scale[expert], block, x.dtype)
        e2 = dequantize_expert(w2[expert], None if w2_scale is None else w2_scale[expert], block, x.dtype)
        gate_up = F.linear(x[tokens], e13)
        if w13_bias is not None:
            gate_up = gate_up + w13_bias[expert]
        y = F.linear(gated_activation(gate_up, swiglu), e2)
        if w2_bias is not None:
            y = y + w2_bias[expert]
        out.index_add_(0, tokens, y.float() * weights[picked, None].float())
    return out.to(x.dtype)


def _fused_experts_impl(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                        topk_ids: torch.Tensor, renormalize: bool, round_weights: bool,
                        w13_scale: torch.Tensor | None = None, w2_scale: torch.Tensor | None = None,
                        block_n: int = 0, block_k: int = 0, w13_bias: torch.Tensor | None = None,
                        w2_bias: torch.Tensor | None = None, swiglu_alpha: float | None = None,
                        swiglu_limit: float | None = None) -> torch.Tensor:
    block = (block_n, block_k) if block_n else None
    swiglu = None if swiglu_alpha is None else (swiglu_alpha, swiglu_limit)
    if x.is_cuda:
        from model_executor.layers.moe import kernels

        return kernels.fused_experts_triton(x, w13, w2, topk_weights, topk_ids, renormalize, round_weights,
                                            w13_scale=w13_scale, w2_scale=w2_scale, block=block, w13_bias=w13_bias,
                                            w2_bias=w2_bias, swiglu=swiglu)
    return fused_experts_torch(x, w13, w2, topk_weights, topk_ids, renormalize, round_weights, w13_scale, w2_scale,
                               block, w13_bias, w2_bias, swiglu)


_fused_experts_op = torch.library.custom_op("duet::fused_experts", _fused_experts_impl, mutates_args=())


@_fused_experts_op.register_fake
def _(x, w13, w2, topk_weights, topk_ids, renormalize, round_weights, w13_scale=None, w2_scale=None, block_n=0,
      block_k=0, w13_bias=None, w2_bias=None, swiglu_alpha=None, swiglu_limit=None):
    return torch.empty_like(x)


def fused_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor, renormalize: bool = False, round_weights: bool = False,
                  w13_scale: torch.Tensor | None = None, w2_scale: torch.Tensor | None = None,
                  block: tuple[int, int] | None = None, w13_bias: torch.Tensor | None = None,
                  w2_bias: torch.Tensor | None = None, swiglu: tuple[float, float] | None = None) -> torch.Tensor:
    """x: [T, H]; w13: [E, 2I, H] (gate rows then up rows); w2: [E, H, I]; topk_weights: [T, k] float32
    (or x's dtype); topk_ids: [T, k] int32 or int64; FP8 weights' scales and tile (see above); the experts'
    biases w13_bias [E, 2I] and w2_bias [E, H], and swiglu = (alpha, limit) (gpt-oss). Returns [T, H] in x's
    dtype."""
    op = torch.ops.duet.fused_experts if _tracing() else _fused_experts_impl
    block_n, block_k = block or (0, 0)
    alpha, limit = swiglu or (None, None)
    return op(x, w13, w2, topk_weights, topk_ids, renormalize, round_weights, w13_scale, w2_scale, block_n, block_k,
              w13_bias, w2_bias, alpha, limit)

"""The experts' computation: out[t] = sum_j w[t, j] * down_e(silu(gate_e(x[t])) * up_e(x[t])), e = ids[t, j].

    fused_experts(x, w13, w2, topk_weights, topk_ids, renormalize, round_weights) -> out [T, H]

w is topk_weights, divided by its row's sum with renormalize, rounded to x's dtype with round_weights (the
router's last steps, which the Triton path does inside its second GEMM instead of three small kernels).

One function for every caller (an FP8 variant of the expert GEMMs goes behind it too). On CUDA it runs the
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

from model_executor.layers.triton_ops.ops import _tracing


def routing_weights(topk_weights: torch.Tensor, renormalize: bool, round_weights: bool,
                    dtype: torch.dtype) -> torch.Tensor:
    """The weights the experts' outputs are scaled by (float32 math, as HF's routers)."""
    weights = topk_weights.float()
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(dtype) if round_weights else weights


def fused_experts_torch(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                        topk_ids: torch.Tensor, renormalize: bool = False, round_weights: bool = False) -> torch.Tensor:
    """The reference: each expert's tokens gathered, its MLP in x's dtype (as HF's experts loop), the
    weighted outputs summed per token in float32, rounded once to x's dtype."""
    topk_weights = routing_weights(topk_weights, renormalize, round_weights, x.dtype)
    num_tokens, top_k = topk_ids.shape
    inter = w2.shape[2]
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
        gate_up = F.linear(x[tokens], w13[expert])
        act = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        y = F.linear(act, w2[expert])
        out.index_add_(0, tokens, y.float() * weights[picked, None].float())
    return out.to(x.dtype)


def _fused_experts_impl(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                        topk_ids: torch.Tensor, renormalize: bool, round_weights: bool) -> torch.Tensor:
    if x.is_cuda:
        from model_executor.layers.moe import kernels

        return kernels.fused_experts_triton(x, w13, w2, topk_weights, topk_ids, renormalize, round_weights)
    return fused_experts_torch(x, w13, w2, topk_weights, topk_ids, renormalize, round_weights)


_fused_experts_op = torch.library.custom_op("duet::fused_experts", _fused_experts_impl, mutates_args=())


@_fused_experts_op.register_fake
def _(x, w13, w2, topk_weights, topk_ids, renormalize, round_weights):
    return torch.empty_like(x)


def fused_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor, renormalize: bool = False, round_weights: bool = False) -> torch.Tensor:
    """x: [T, H]; w13: [E, 2I, H] (gate rows then up rows); w2: [E, H, I]; topk_weights: [T, k] float32
    (or x's dtype); topk_ids: [T, k] int32 or int64. Returns [T, H] in x's dtype."""
    op = torch.ops.duet.fused_experts if _tracing() else _fused_experts_impl
    return op(x, w13, w2, topk_weights, topk_ids, renormalize, round_weights)

"""The MoE router's selection: softmax over the experts, the top k, optional renormalisation.

    select_experts(router_logits, top_k, renormalize) -> (weights float32 [T, k], ids [T, k])

On CUDA one Triton kernel (moe/router_kernel.py) does all three steps (the torch path launches several
small kernels per MoE layer) and returns int32 ids; on CPU (and as its reference) the torch path, which
returns int64 ids as torch.topk does.

Ties: the kernel ranks the float32 logits (softmax is monotonic) and gives an exact tie to the lower expert
index, as sorting the probabilities stably would. torch.topk documents no tie order and on the CPU does not
keep the lower index (of equal logits it may take the higher expert), so at an exact tie on the k-th
place the two paths may choose different experts of equal weight; without ties they choose the same ones.
The kernel ranks a NaN logit below every number, so a row of garbage (a padding row) names experts in range.

While something traces (dynamo, FakeTensorMode) the CUDA call goes through the registered
`duet::topk_softmax` op, opaque to the tracer; in eager, directly.
"""

from __future__ import annotations

import torch

from model_executor.layers.triton_ops.ops import _tracing


def select_experts_torch(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """HF's router: softmax in float32, torch.topk, the k weights divided by their sum when renormalize."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def _topk_softmax_impl(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    if router_logits.is_cuda:
        from model_executor.layers.moe import router_kernel

        return router_kernel.topk_softmax(router_logits, top_k, renormalize)
    weights, ids = select_experts_torch(router_logits, top_k, renormalize)
    return weights, ids.to(torch.int32)  # the op's ids are int32 on every device (its fake impl says so)


_topk_softmax_op = torch.library.custom_op("duet::topk_softmax", _topk_softmax_impl, mutates_args=())


@_topk_softmax_op.register_fake
def _(router_logits, top_k, renormalize):
    shape = (router_logits.shape[0], top_k)
    return (router_logits.new_empty(shape, dtype=torch.float32), router_logits.new_empty(shape, dtype=torch.int32))


def select_experts(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] (any float dtype). Returns (weights float32 [T, k] in descending order, ids [T, k]:
    int32 from the CUDA kernel, int64 from the torch path)."""
    if not router_logits.is_cuda:
        return select_experts_torch(router_logits, top_k, renormalize)
    op = torch.ops.duet.topk_softmax if _tracing() else _topk_softmax_impl
    return op(router_logits, top_k, renormalize)

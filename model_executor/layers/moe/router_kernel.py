"""The fused router kernel (imports triton; moe/router.py imports this lazily): softmax over E experts, the
top k, optional renormalisation, for BLOCK_T tokens per program. No host sync and output shapes that depend
only on T, so it runs inside decode graphs and the piecewise pieces."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _topk_softmax_kernel(logits_ptr, weights_ptr, ids_ptr, num_tokens, num_experts, stride_t,
                         TOP_K: tl.constexpr, TOP_K_P2: tl.constexpr, RENORMALIZE: tl.constexpr,
                         BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_valid = t < num_tokens
    t_safe = tl.minimum(t, num_tokens - 1).to(tl.int64)  # rows past the end repeat the last one, not stored
    e = tl.arange(0, BLOCK_E)
    e_valid = e < num_experts
    x = tl.load(logits_ptr + t_safe[:, None] * stride_t + e[None, :], mask=e_valid[None, :],
                other=float("-inf")).to(tl.float32)
    # A NaN logit (a garbage padded row in a graph) ranks below every number: every pick below stays an
    # expert index (a NaN row would otherwise match no logit and name expert BLOCK_E, past the weights).
    x = tl.where(x >= float("-inf"), x, float("-inf"))  # (false only for NaN)
    row_max = tl.max(x, axis=1)
    ex = tl.where(e_valid[None, :], tl.exp(x - row_max[:, None]), 0.0)
    denom = tl.sum(ex, axis=1)
    j = tl.arange(0, TOP_K_P2)
    weights = tl.zeros((BLOCK_T, TOP_K_P2), dtype=tl.float32)
    ids = tl.zeros((BLOCK_T, TOP_K_P2), dtype=tl.int32)
    free = e_valid[None, :] & (t_safe[:, None] >= 0)  # [BLOCK_T, BLOCK_E]: not taken yet
    for slot in tl.static_range(TOP_K):
        # The largest logit left; of equal ones the lowest expert index.
        best = tl.max(tl.where(free, x, float("-inf")), axis=1)
        pick = tl.min(tl.where(free & (x == best[:, None]), e[None, :], BLOCK_E), axis=1)
        chosen = e[None, :] == pick[:, None]
        w = tl.sum(tl.where(chosen, ex, 0.0), axis=1) / denom
        weights = tl.where(j[None, :] == slot, w[:, None], weights)
        ids = tl.where(j[None, :] == slot, pick[:, None], ids)
        free = free & ~chosen
    if RENORMALIZE:
        weights = weights / tl.sum(weights, axis=1)[:, None]
    out = t[:, None].to(tl.int64) * TOP_K + j[None, :]
    mask = t_valid[:, None] & (j[None, :] < TOP_K)
    tl.store(weights_ptr + out, weights, mask=mask)
    tl.store(ids_ptr + out, ids, mask=mask)


def topk_softmax(router_logits: torch.Tensor, top_k: int, renormalize: bool,
                 block_t: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] -> (weights float32 [T, k], ids int32 [T, k]); see moe/router.py."""
    num_tokens, num_experts = router_logits.shape
    if not 0 < top_k <= num_experts:
        raise ValueError(f"top_k {top_k} must be in 1..{num_experts} (the number of experts)")
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=router_logits.device)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int32, device=router_logits.device)
    if num_tokens == 0:
        return weights, ids
    if router_logits.stride(-1) != 1:
        router_logits = router_logits.contiguous()
    block_e = triton.next_power_of_2(num_experts)
    # A few tokens per program: a [BLOCK_T, BLOCK_E] tile of a few thousand elements keeps registers in check;
    # no more rows than there are tokens (a decode step's handful).
    block_t = block_t or max(1, min(16, 2048 // block_e, triton.next_power_of_2(num_tokens)))
    # The k picks are k dependent reductions over the tile: with few elements one warp does each by shuffles,
    # where four warps would add a shared-memory round trip and a barrier to every one of them.
    num_warps = max(1, min(4, block_t * block_e // 256))
    _topk_softmax_kernel[(triton.cdiv(num_tokens, block_t),)](
        router_logits, weights, ids, num_tokens, num_experts, router_logits.stride(0),
        TOP_K=top_k, TOP_K_P2=triton.next_power_of_2(top_k), RENORMALIZE=renormalize,
        BLOCK_T=block_t, BLOCK_E=block_e, num_warps=num_warps)
    return weights, ids

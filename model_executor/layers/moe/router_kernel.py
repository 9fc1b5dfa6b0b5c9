"""The fused router kernel (imports triton; moe/router.py imports this lazily): softmax over E experts, the
top k, optional renormalisation, for BLOCK_T tokens per program. No host sync and output shapes that depend
only on T, so it runs inside decode graphs and the piecewise pieces."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _topk_rows(x, e, free, TOP_K: tl.constexpr, TOP_K_P2: tl.constexpr, RENORMALIZE: tl.constexpr,
               BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr):
    """Rows of float32 logits x [BLOCK_T, BLOCK_E] (experts e; `free`: the valid ones) -> the top k's softmax
    weights and expert ids [BLOCK_T, TOP_K_P2] (columns past TOP_K unused)."""
    row_max = tl.max(tl.where(free, x, float("-inf")), axis=1)
    ex = tl.where(free, tl.exp(x - row_max[:, None]), 0.0)
    denom = tl.sum(ex, axis=1)
    denom = tl.where(denom > 0, denom, 1.0)  # a row with nothing valid (padding): zeros, not 0/0
    j = tl.arange(0, TOP_K_P2)
    weights = tl.zeros((BLOCK_T, TOP_K_P2), dtype=tl.float32)
    ids = tl.zeros((BLOCK_T, TOP_K_P2), dtype=tl.int32)
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
        total = tl.sum(weights, axis=1)
        weights = weights / tl.where(total > 0, total, 1.0)[:, None]
    return weights, ids


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
    free = e_valid[None, :] & (t_safe[:, None] >= 0)  # [BLOCK_T, BLOCK_E]: not taken yet
    weights, ids = _topk_rows(x, e, free, TOP_K, TOP_K_P2, RENORMALIZE, BLOCK_T, BLOCK_E)
    j = tl.arange(0, TOP_K_P2)
    out = t[:, None].to(tl.int64) * TOP_K + j[None, :]
    mask = t_valid[:, None] & (j[None, :] < TOP_K)
    tl.store(weights_ptr + out, weights, mask=mask)
    tl.store(ids_ptr + out, ids, mask=mask)


@triton.jit
def _gate_topk_softmax_kernel(x_ptr, w_ptr, partial_ptr, counter_ptr, weights_ptr, ids_ptr,
                              num_tokens, num_experts, hidden, stride_x, stride_w, k_per_split,
                              TOP_K: tl.constexpr, TOP_K_P2: tl.constexpr, RENORMALIZE: tl.constexpr,
                              BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
                              E_P2: tl.constexpr, SPLIT_K: tl.constexpr):
    """Program (i, s): the gate's logits of experts [i*BLOCK_E, (i+1)*BLOCK_E) over the s-th slice of the
    hidden size, for every token, into partial[s]. The last program to finish (a counter it resets) sums the
    slices in order (the result does not depend on which program was last), rounds the logits to the model
    dtype as the gate's GEMM would write them, and picks the top k."""
    pid_e = tl.program_id(0)
    pid_k = tl.program_id(1)
    t = tl.arange(0, BLOCK_T)
    t_valid = t < num_tokens
    e = pid_e * BLOCK_E + tl.arange(0, BLOCK_E)
    e_valid = e < num_experts
    acc = tl.zeros((BLOCK_T, BLOCK_E), dtype=tl.float32)
    k_start = pid_k * k_per_split
    for k0 in range(k_start, k_start + k_per_split, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_valid = k < hidden
        xt = tl.load(x_ptr + t[:, None].to(tl.int64) * stride_x + k[None, :],
                     mask=t_valid[:, None] & k_valid[None, :], other=0.0)
        wt = tl.load(w_ptr + e[None, :].to(tl.int64) * stride_w + k[:, None],
                     mask=e_valid[None, :] & k_valid[:, None], other=0.0)  # [BLOCK_K, BLOCK_E]
        # float32 operands (exact products of 16-bit inputs), ieee: a 16-token GEMV slice has no use for
        # tensor-core precision modes, and every device (the interpreter too) sums the same way.
        acc = tl.dot(xt.to(tl.float32), wt.to(tl.float32), acc, input_precision="ieee")
    slot = (pid_k * BLOCK_T + t[:, None]) * E_P2 + e[None, :]
    tl.store(partial_ptr + slot, acc, mask=t_valid[:, None] & e_valid[None, :])
    # Every thread's stores are in before the one atomic that publishes them (release); the last program's
    # acquire makes all of them visible to it.
    tl.debug_barrier()
    done = tl.atomic_add(counter_ptr, 1, sem="acq_rel")
    if done == tl.num_programs(0) * tl.num_programs(1) - 1:
        ee = tl.arange(0, E_P2)
        free = t_valid[:, None] & (ee[None, :] < num_experts)
        total = tl.zeros((BLOCK_T, E_P2), dtype=tl.float32)
        for s in tl.static_range(SPLIT_K):
            total += tl.load(partial_ptr + (s * BLOCK_T + t[:, None]) * E_P2 + ee[None, :], mask=free,
                             other=0.0, cache_modifier=".cg")
        logits = total.to(x_ptr.dtype.element_ty).to(tl.float32)
        weights, ids = _topk_rows(logits, ee, free, TOP_K, TOP_K_P2, RENORMALIZE, BLOCK_T, E_P2)
        j = tl.arange(0, TOP_K_P2)
        out = t[:, None].to(tl.int64) * TOP_K + j[None, :]
        mask = t_valid[:, None] & (j[None, :] < TOP_K)
        tl.store(weights_ptr + out, weights, mask=mask)
        tl.store(ids_ptr + out, ids, mask=mask)
        tl.atomic_xchg(counter_ptr, 0)  # ready for the next launch (stream order) or graph replay


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


# The fused gate + top-k kernel: for decode-sized token counts (its tokens are one tl.dot tile).
GATE_MAX_TOKENS = 16
_GATE_BLOCK_E = 16
_GATE_BLOCK_K = 256
_counters: dict[torch.device, torch.Tensor] = {}


def _counter(device: torch.device) -> torch.Tensor:
    """One int32 per device, zero between launches (each launch's last program resets it). Made on the
    first call; the graph runners warm up eagerly before they capture, so that is outside a capture."""
    counter = _counters.get(device)
    if counter is None:
        counter = _counters[device] = torch.zeros(1, dtype=torch.int32, device=device)
    return counter


def gate_topk_softmax(x: torch.Tensor, gate_weight: torch.Tensor, top_k: int,
                      renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, H] (T <= GATE_MAX_TOKENS), gate_weight [E, H] -> (weights float32 [T, k], ids int32 [T, k]): the
    router's GEMM, softmax, top k and renormalisation in one launch; see moe/router.py."""
    num_tokens, hidden = x.shape
    num_experts = gate_weight.shape[0]
    if not 0 < num_tokens <= GATE_MAX_TOKENS:
        raise ValueError(f"{num_tokens} tokens: the fused gate takes 1..{GATE_MAX_TOKENS}")
    if not 0 < top_k <= num_experts:
        raise ValueError(f"top_k {top_k} must be in 1..{num_experts} (the number of experts)")
    x = x if x.stride(-1) == 1 else x.contiguous()
    gate_weight = gate_weight if gate_weight.stride(-1) == 1 else gate_weight.contiguous()
    # Slices of the hidden size as programs (a few hundred columns each): many small loads in flight at once
    # instead of one program walking the whole row.
    split_k = max(1, min(16, triton.cdiv(hidden, _GATE_BLOCK_K)))
    k_per_split = triton.cdiv(triton.cdiv(hidden, split_k), _GATE_BLOCK_K) * _GATE_BLOCK_K
    e_p2 = max(triton.next_power_of_2(num_experts), _GATE_BLOCK_E)
    partial = torch.empty(split_k, GATE_MAX_TOKENS, e_p2, dtype=torch.float32, device=x.device)
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=x.device)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int32, device=x.device)
    grid = (triton.cdiv(num_experts, _GATE_BLOCK_E), split_k)
    _gate_topk_softmax_kernel[grid](
        x, gate_weight, partial, _counter(x.device), weights, ids,
        num_tokens, num_experts, hidden, x.stride(0), gate_weight.stride(0), k_per_split,
        TOP_K=top_k, TOP_K_P2=triton.next_power_of_2(top_k), RENORMALIZE=renormalize,
        BLOCK_T=GATE_MAX_TOKENS, BLOCK_E=_GATE_BLOCK_E, BLOCK_K=_GATE_BLOCK_K, E_P2=e_p2, SPLIT_K=split_k,
        num_warps=4)
    return weights, ids

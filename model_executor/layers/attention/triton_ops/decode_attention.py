"""Split-KV (flash-decoding) attention for decode batches over the token-level KV pool (page size 1).

One query token per request. Keys and values (the new token's included: it is written into the pool
before attention runs) are gathered from `k_buffer` / `v_buffer` through `req_to_token`.

Stage 1 (grid `(bs, num_kv_heads * head_blocks, num_kv_splits)`): one program takes every query head of a
KV head (GQA-grouped, up to BLOCK_H query heads per program) and one chunk of the positions; it writes the
chunk's normalised partial output and its log-sum-exp into the workspace. Stage 2 (grid `(bs, num_heads)`)
merges the chunks. The chunk bounds come from `seq_lens` read on the device, so the grid, the workspace and
every launch argument are fixed for a batch size: the call is CUDA-graph capturable.

Chunking: a request of length L uses chunks of `round_up(cdiv(L, num_kv_splits), BLOCK_N)` positions, so
short requests use fewer, fuller chunks; chunks past the end are empty and their programs only exit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Stage-1 tile: query heads per program (tl.dot needs M >= 16) and KV positions per loop step.
BLOCK_H = 16
BLOCK_N = 32
STAGE1_NUM_WARPS = 4
STAGE1_NUM_STAGES = 2
STAGE2_NUM_WARPS = 4

_LOG2E = 1.4426950408889634


def get_num_kv_splits(max_context_len: int, min_chunk: int = 256, max_splits: int = 16) -> int:
    """The split count for a pool whose requests may reach `max_context_len` tokens.

    A power of two such that a full-length request's chunks hold at least `min_chunk` positions, clamped
    to [1, max_splits]: 1 up to 256 tokens, 4 at 1024, 16 from 4096 on. Shorter requests in the batch
    simply leave the tail splits empty. Allocate the workspace with the same number.
    """
    splits = triton.next_power_of_2(max(1, triton.cdiv(max_context_len, min_chunk)))
    return max(1, min(splits, max_splits))


def alloc_decode_workspace(max_bs: int, num_heads: int, head_dim: int, num_kv_splits: int,
                           device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    """The (attn_logits, attn_lse) float32 workspace for `decode_attention_fwd`, sized for `max_bs` rows."""
    attn_logits = torch.empty((max_bs, num_heads, num_kv_splits, head_dim), dtype=torch.float32, device=device)
    attn_lse = torch.empty((max_bs, num_heads, num_kv_splits), dtype=torch.float32, device=device)
    return attn_logits, attn_lse


@triton.jit
def _split_bounds(seq_len, split_id, NUM_KV_SPLITS: tl.constexpr, SPLIT_ALIGN: tl.constexpr):
    per_split = tl.cdiv(tl.cdiv(seq_len, NUM_KV_SPLITS), SPLIT_ALIGN) * SPLIT_ALIGN
    start = per_split * split_id
    end = tl.minimum(start + per_split, seq_len)
    return start, end


@triton.jit
def _decode_stage1_kernel(
    Q, K_Buffer, V_Buffer, Req_to_token, Req_pool_indices, Seq_lens, Att_Out, Att_Lse,
    qk_scale, v_scale,
    stride_qb, stride_qh,
    stride_kbs, stride_kh,
    stride_vbs, stride_vh,
    stride_req_b,
    stride_mid_ob, stride_mid_oh, stride_mid_os,
    stride_lse_b, stride_lse_h,
    KV_GROUP_NUM: tl.constexpr,
    HEAD_BLOCKS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_KV_SPLITS: tl.constexpr,
    IN_PRECISION: tl.constexpr,
):
    cur_batch = tl.program_id(0)
    pid_h = tl.program_id(1)
    split_id = tl.program_id(2)
    kv_head = pid_h // HEAD_BLOCKS
    head_block = pid_h % HEAD_BLOCKS

    offs_g = head_block * BLOCK_H + tl.arange(0, BLOCK_H)  # index within the kv head's query group
    mask_h = offs_g < KV_GROUP_NUM
    heads = kv_head * KV_GROUP_NUM + offs_g
    offs_d = tl.arange(0, BLOCK_D)
    if BLOCK_D == HEAD_DIM:  # all-true splat: keeps the loads vectorised
        mask_d = tl.full([BLOCK_D], 1, tl.int1)
    else:
        mask_d = offs_d < HEAD_DIM

    seq_len = tl.load(Seq_lens + cur_batch).to(tl.int32)
    req_row = tl.load(Req_pool_indices + cur_batch).to(tl.int64)
    split_start, split_end = _split_bounds(seq_len, split_id, NUM_KV_SPLITS, BLOCK_N)

    if split_end > split_start:
        q = tl.load(Q + cur_batch.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                    mask=mask_h[:, None] & mask_d[None, :], other=0.0)
        e_max = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
        e_sum = tl.zeros([BLOCK_H], dtype=tl.float32)
        acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
        for start_n in range(split_start, split_end, BLOCK_N):
            offs_n = start_n + tl.arange(0, BLOCK_N)
            mask_n = offs_n < split_end
            slots = tl.load(Req_to_token + req_row * stride_req_b + offs_n, mask=mask_n, other=0).to(tl.int64)
            # K gathered transposed: [BLOCK_D, BLOCK_N]
            k = tl.load(K_Buffer + slots[None, :] * stride_kbs + kv_head * stride_kh + offs_d[:, None],
                        mask=mask_n[None, :] & mask_d[:, None], other=0.0)
            # (an FP8 pool is cast up here; its K scale is folded into qk_scale, its V scale applied at the end)
            qk = tl.dot(q, k.to(q.dtype), input_precision=IN_PRECISION) * qk_scale  # log2 domain
            qk = tl.where(mask_n[None, :], qk, float("-inf"))
            n_e_max = tl.maximum(tl.max(qk, 1), e_max)
            re_scale = tl.exp2(e_max - n_e_max)
            p = tl.exp2(qk - n_e_max[:, None])
            v = tl.load(V_Buffer + slots[:, None] * stride_vbs + kv_head * stride_vh + offs_d[None, :],
                        mask=mask_n[:, None] & mask_d[None, :], other=0.0)
            acc = acc * re_scale[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=IN_PRECISION)
            e_sum = e_sum * re_scale + tl.sum(p, 1)
            e_max = n_e_max

        mid_o = (cur_batch * stride_mid_ob + heads[:, None] * stride_mid_oh + split_id * stride_mid_os
                 + offs_d[None, :])
        tl.store(Att_Out + mid_o, acc * (v_scale / e_sum)[:, None], mask=mask_h[:, None] & mask_d[None, :])
        mid_lse = cur_batch * stride_lse_b + heads * stride_lse_h + split_id
        tl.store(Att_Lse + mid_lse, e_max + tl.log2(e_sum), mask=mask_h)


@triton.jit
def _decode_stage2_kernel(
    Att_Out, Att_Lse, O, Seq_lens,
    stride_mid_ob, stride_mid_oh, stride_mid_os,
    stride_lse_b, stride_lse_h,
    stride_ob, stride_oh,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    NUM_KV_SPLITS: tl.constexpr,
    SPLIT_ALIGN: tl.constexpr,
):
    cur_batch = tl.program_id(0)
    cur_head = tl.program_id(1)
    offs_d = tl.arange(0, BLOCK_D)
    if BLOCK_D == HEAD_DIM:  # all-true splat: keeps the loads vectorised
        mask_d = tl.full([BLOCK_D], 1, tl.int1)
    else:
        mask_d = offs_d < HEAD_DIM
    seq_len = tl.load(Seq_lens + cur_batch).to(tl.int32)

    e_max = float("-inf")
    e_sum = 0.0
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    mid_o = Att_Out + cur_batch * stride_mid_ob + cur_head * stride_mid_oh + offs_d
    mid_lse = Att_Lse + cur_batch * stride_lse_b + cur_head * stride_lse_h
    for split_id in range(NUM_KV_SPLITS):
        split_start, split_end = _split_bounds(seq_len, split_id, NUM_KV_SPLITS, SPLIT_ALIGN)
        if split_end > split_start:  # empty splits wrote nothing: their workspace is stale
            part = tl.load(mid_o + split_id * stride_mid_os, mask=mask_d, other=0.0)
            lse = tl.load(mid_lse + split_id)
            n_e_max = tl.maximum(lse, e_max)
            old_scale = tl.exp2(e_max - n_e_max)
            new_w = tl.exp2(lse - n_e_max)
            acc = acc * old_scale + part * new_w
            e_sum = e_sum * old_scale + new_w
            e_max = n_e_max

    # seq_len == 0 (never produced by the engine) gives zeros rather than NaN.
    out = acc / tl.maximum(e_sum, 1e-30)
    tl.store(O + cur_batch.to(tl.int64) * stride_ob + cur_head * stride_oh + offs_d,
             out.to(O.dtype.element_ty), mask=mask_d)


def decode_attention_fwd(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    o: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    attn_logits: torch.Tensor,
    attn_lse: torch.Tensor,
    num_kv_splits: int,
    sm_scale: float,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Decode attention; writes `o` in place.

    q, o: [bs, num_heads, head_dim] (last dim contiguous; other strides free).
    k_buffer, v_buffer: [num_slots + 1, num_kv_heads, head_dim] (last dim contiguous).
    req_to_token: int32 [num_rows, max_context_len]; req_pool_indices: [bs] row of each request;
    seq_lens: [bs] int32/int64 KV length of each request, the new token included (read on the device).
    attn_logits: float32 [>= bs, num_heads, num_kv_splits, head_dim]; attn_lse: float32
    [>= bs, num_heads, num_kv_splits] - workspace, contents need not be initialised.
    num_kv_splits: fixed split count (see `get_num_kv_splits`); sm_scale: softmax scale.
    k_scale, v_scale: the pool's dequantization scales (an FP8 pool holds K / k_scale, V / v_scale).
    No host reads of device data, no allocations: safe to capture in a CUDA graph.
    """
    bs, num_heads, head_dim = q.shape
    num_kv_heads = k_buffer.shape[1]
    assert num_heads % num_kv_heads == 0, "num_heads must be a multiple of num_kv_heads"
    assert k_buffer.shape[2] == head_dim and v_buffer.shape[2] == head_dim and o.shape == q.shape
    assert q.stride(-1) == 1 and o.stride(-1) == 1 and k_buffer.stride(-1) == 1 and v_buffer.stride(-1) == 1
    assert req_to_token.stride(-1) == 1
    assert attn_logits.dtype == torch.float32 and attn_lse.dtype == torch.float32
    assert attn_logits.shape[0] >= bs and attn_logits.shape[1] == num_heads
    assert attn_logits.shape[2] >= num_kv_splits and attn_logits.shape[3] == head_dim
    assert attn_logits.stride(-1) == 1 and attn_lse.stride(-1) == 1
    assert attn_lse.shape[0] >= bs and attn_lse.shape[2] >= num_kv_splits
    if bs == 0:
        return

    group = num_heads // num_kv_heads
    head_blocks = triton.cdiv(group, BLOCK_H)
    block_d = triton.next_power_of_2(head_dim)
    in_precision = "tf32x3" if q.dtype == torch.float32 else "tf32"  # fp32: ~fp32 accuracy

    _decode_stage1_kernel[(bs, num_kv_heads * head_blocks, num_kv_splits)](
        q, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens, attn_logits, attn_lse,
        sm_scale * k_scale * _LOG2E, v_scale,
        q.stride(0), q.stride(1),
        k_buffer.stride(0), k_buffer.stride(1),
        v_buffer.stride(0), v_buffer.stride(1),
        req_to_token.stride(0),
        attn_logits.stride(0), attn_logits.stride(1), attn_logits.stride(2),
        attn_lse.stride(0), attn_lse.stride(1),
        KV_GROUP_NUM=group,
        HEAD_BLOCKS=head_blocks,
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        BLOCK_H=BLOCK_H,
        BLOCK_N=BLOCK_N,
        NUM_KV_SPLITS=num_kv_splits,
        IN_PRECISION=in_precision,
        num_warps=STAGE1_NUM_WARPS,
        num_stages=STAGE1_NUM_STAGES,
    )
    _decode_stage2_kernel[(bs, num_heads)](
        attn_logits, attn_lse, o, seq_lens,
        attn_logits.stride(0), attn_logits.stride(1), attn_logits.stride(2),
        attn_lse.stride(0), attn_lse.stride(1),
        o.stride(0), o.stride(1),
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        NUM_KV_SPLITS=num_kv_splits,
        SPLIT_ALIGN=BLOCK_N,
        num_warps=STAGE2_NUM_WARPS,
    )

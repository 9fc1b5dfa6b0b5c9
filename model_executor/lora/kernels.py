"""Triton kernels of the LoRA update (layer.py says what it computes), in two steps per layer:

    shrink:  s[t] = x[t] @ A[slot_t].T * scaling[slot_t]        [T, parts * R], float32
    expand:  y[t, part p] += s[t, pR:(p+1)R] @ B[slot_t, part p].T

Eager extend batches run SGMV: one program per (request, BLOCK_M tokens of it, BLOCK_N outputs), the request's
slot read once, tl.dot tiles. Decode rows (and decode graphs) run one program per (row, BLOCK_N outputs), a
matrix-vector product. Rows of slot 0 (no adapter) return at once: shrink leaves their s unwritten and expand
never reads it.

Extend graphs run the token-block kernels: one program per (BLOCK_M consecutive tokens, BLOCK_N outputs),
reading each token's slot from the slot-id buffer alone (no per-request metadata, so a graph captured at a
token count serves any split of it into requests). A block's tokens share one slot but at request boundaries;
a block loops over the slots it holds, one tl.dot per slot over that slot's rows. Padding tokens have slot 0.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _sgmv_shrink(x_ptr, a_ptr, s_ptr, scaling_ptr, seg_start_ptr, seg_len_ptr, seg_slot_ptr, K, N,
                 stride_xm, stride_as, stride_an, stride_sm,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    seg = tl.program_id(0)
    slot = tl.load(seg_slot_ptr + seg)
    length = tl.load(seg_len_ptr + seg)
    m0 = tl.program_id(1) * BLOCK_M
    if slot == 0 or m0 >= length:
        return
    start = tl.load(seg_start_ptr + seg)
    rows = m0 + tl.arange(0, BLOCK_M)
    cols = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + (start + rows)[:, None] * stride_xm + ks[None, :],
                    mask=(rows < length)[:, None] & (ks < K)[None, :], other=0.0)
        a = tl.load(a_ptr + slot * stride_as + cols[None, :] * stride_an + ks[:, None],
                    mask=(cols < N)[None, :] & (ks < K)[:, None], other=0.0)
        acc += tl.dot(x.to(tl.float32), a.to(tl.float32))
    acc *= tl.load(scaling_ptr + slot)
    tl.store(s_ptr + (start + rows)[:, None] * stride_sm + cols[None, :], acc,
             mask=(rows < length)[:, None] & (cols < N)[None, :])


@triton.jit
def _sgmv_expand(s_ptr, b_ptr, y_ptr, seg_start_ptr, seg_len_ptr, seg_slot_ptr, R, N, s_off, y_off,
                 stride_sm, stride_bs, stride_bn, stride_ym,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr):
    seg = tl.program_id(0)
    slot = tl.load(seg_slot_ptr + seg)
    length = tl.load(seg_len_ptr + seg)
    m0 = tl.program_id(1) * BLOCK_M
    if slot == 0 or m0 >= length:
        return
    start = tl.load(seg_start_ptr + seg)
    rows = m0 + tl.arange(0, BLOCK_M)
    cols = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    rs = tl.arange(0, BLOCK_R)
    row_ok = rows < length
    s = tl.load(s_ptr + (start + rows)[:, None] * stride_sm + s_off + rs[None, :],
                mask=row_ok[:, None] & (rs < R)[None, :], other=0.0)
    b = tl.load(b_ptr + slot * stride_bs + (y_off + cols)[None, :] * stride_bn + rs[:, None],
                mask=(cols < N)[None, :] & (rs < R)[:, None], other=0.0)
    delta = tl.dot(s, b.to(tl.float32))
    y_ptrs = y_ptr + (start + rows)[:, None] * stride_ym + y_off + cols[None, :]
    mask = row_ok[:, None] & (cols < N)[None, :]
    y = tl.load(y_ptrs, mask=mask, other=0.0)
    tl.store(y_ptrs, (y.to(tl.float32) + delta).to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _row_shrink(x_ptr, a_ptr, s_ptr, scaling_ptr, slots_ptr, K, N, stride_xm, stride_as, stride_an, stride_sm,
                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    row = tl.program_id(0)
    slot = tl.load(slots_ptr + row)
    if slot == 0:
        return
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + row * stride_xm + ks, mask=ks < K, other=0.0).to(tl.float32)
        a = tl.load(a_ptr + slot * stride_as + cols[:, None] * stride_an + ks[None, :],
                    mask=(cols < N)[:, None] & (ks < K)[None, :], other=0.0).to(tl.float32)
        acc += tl.sum(a * x[None, :], axis=1)
    acc *= tl.load(scaling_ptr + slot)
    tl.store(s_ptr + row * stride_sm + cols, acc, mask=cols < N)


@triton.jit
def _row_expand(s_ptr, b_ptr, y_ptr, slots_ptr, R, N, s_off, y_off, stride_sm, stride_bs, stride_bn, stride_ym,
                BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr):
    row = tl.program_id(0)
    slot = tl.load(slots_ptr + row)
    if slot == 0:
        return
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rs = tl.arange(0, BLOCK_R)
    s = tl.load(s_ptr + row * stride_sm + s_off + rs, mask=rs < R, other=0.0)
    b = tl.load(b_ptr + slot * stride_bs + (y_off + cols)[:, None] * stride_bn + rs[None, :],
                mask=(cols < N)[:, None] & (rs < R)[None, :], other=0.0).to(tl.float32)
    delta = tl.sum(b * s[None, :], axis=1)
    y_ptrs = y_ptr + row * stride_ym + y_off + cols
    y = tl.load(y_ptrs, mask=cols < N, other=0.0)
    tl.store(y_ptrs, (y.to(tl.float32) + delta).to(y_ptr.dtype.element_ty), mask=cols < N)


@triton.jit
def _token_shrink(x_ptr, a_ptr, s_ptr, scaling_ptr, slots_ptr, T, K, N, stride_xm, stride_as, stride_an, stride_sm,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < T
    slots = tl.load(slots_ptr + rows, mask=row_ok, other=0)
    hi = tl.max(slots)
    if hi == 0:
        return
    lo = tl.min(tl.where(slots > 0, slots, hi))
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    out = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for slot in range(lo, hi + 1):
        sel = slots == slot
        if tl.max(sel.to(tl.int32)) > 0:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                ks = k0 + tl.arange(0, BLOCK_K)
                x = tl.load(x_ptr + rows[:, None] * stride_xm + ks[None, :], mask=sel[:, None] & (ks < K)[None, :],
                            other=0.0)
                a = tl.load(a_ptr + slot * stride_as + cols[None, :] * stride_an + ks[:, None],
                            mask=(cols < N)[None, :] & (ks < K)[:, None], other=0.0)
                acc += tl.dot(x.to(tl.float32), a.to(tl.float32))
            out += acc * tl.load(scaling_ptr + slot)
    # Rows of slot 0 get zeros: the expand of a block that mixes them with adapters' rows reads them.
    tl.store(s_ptr + rows[:, None] * stride_sm + cols[None, :], out, mask=row_ok[:, None] & (cols < N)[None, :])


@triton.jit
def _token_expand(s_ptr, b_ptr, y_ptr, slots_ptr, T, R, N, s_off, y_off, stride_sm, stride_bs, stride_bn, stride_ym,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < T
    slots = tl.load(slots_ptr + rows, mask=row_ok, other=0)
    hi = tl.max(slots)
    if hi == 0:
        return
    lo = tl.min(tl.where(slots > 0, slots, hi))
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rs = tl.arange(0, BLOCK_R)
    s = tl.load(s_ptr + rows[:, None] * stride_sm + s_off + rs[None, :], mask=row_ok[:, None] & (rs < R)[None, :],
                other=0.0)
    delta = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for slot in range(lo, hi + 1):
        sel = slots == slot
        if tl.max(sel.to(tl.int32)) > 0:
            b = tl.load(b_ptr + slot * stride_bs + (y_off + cols)[None, :] * stride_bn + rs[:, None],
                        mask=(cols < N)[None, :] & (rs < R)[:, None], other=0.0)
            delta += tl.where(sel[:, None], tl.dot(s, b.to(tl.float32)), 0.0)
    y_ptrs = y_ptr + rows[:, None] * stride_ym + y_off + cols[None, :]
    mask = (row_ok & (slots > 0))[:, None] & (cols < N)[None, :]
    y = tl.load(y_ptrs, mask=mask, other=0.0)
    tl.store(y_ptrs, (y.to(tl.float32) + delta).to(y_ptr.dtype.element_ty), mask=mask)


BLOCK_M = 16
BLOCK_N = 64
BLOCK_K = 64


def lora_update(x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scaling: torch.Tensor,
                batch, out_slices: list[tuple[int, int]], rank: int) -> None:
    """y += each row's LoRA update (layer.py), in place. x [T, K], y [T, out]; a [slots, parts * R, K],
    b [slots, out, R] contiguous; batch a LoraBatch: its segments for an eager extend, else its token_slots
    alone (per row for decode, token blocks for an extend graph)."""
    if x.stride(1) != 1:
        x = x.contiguous()
    T, K = x.shape
    n_s = a.shape[1]
    s = torch.empty(T, n_s, dtype=torch.float32, device=x.device)
    block_r = max(16, triton.next_power_of_2(rank))
    if batch.decode:
        slots = batch.token_slots
        _row_shrink[(T, triton.cdiv(n_s, BLOCK_N))](
            x, a, s, scaling, slots, K, n_s, x.stride(0), a.stride(0), a.stride(1), s.stride(0),
            BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K)
        for p, (off, size) in enumerate(out_slices):
            _row_expand[(T, triton.cdiv(size, BLOCK_N))](
                s, b, y, slots, rank, size, p * rank, off, s.stride(0), b.stride(0), b.stride(1), y.stride(0),
                BLOCK_N=BLOCK_N, BLOCK_R=block_r)
        return
    if batch.seg_slot is None:  # an extend graph: the slot ids only
        slots = batch.token_slots
        m_blocks = triton.cdiv(T, BLOCK_M)
        _token_shrink[(m_blocks, triton.cdiv(n_s, BLOCK_N))](
            x, a, s, scaling, slots, T, K, n_s, x.stride(0), a.stride(0), a.stride(1), s.stride(0),
            BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K)
        for p, (off, size) in enumerate(out_slices):
            _token_expand[(m_blocks, triton.cdiv(size, BLOCK_N))](
                s, b, y, slots, T, rank, size, p * rank, off, s.stride(0), b.stride(0), b.stride(1), y.stride(0),
                BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_R=block_r)
        return
    nseg, m_blocks = batch.seg_slot.shape[0], triton.cdiv(batch.max_seg_len, BLOCK_M)
    _sgmv_shrink[(nseg, m_blocks, triton.cdiv(n_s, BLOCK_N))](
        x, a, s, scaling, batch.seg_start, batch.seg_len, batch.seg_slot, K, n_s, x.stride(0), a.stride(0),
        a.stride(1), s.stride(0), BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K)
    for p, (off, size) in enumerate(out_slices):
        _sgmv_expand[(nseg, m_blocks, triton.cdiv(size, BLOCK_N))](
            s, b, y, batch.seg_start, batch.seg_len, batch.seg_slot, rank, size, p * rank, off, s.stride(0),
            b.stride(0), b.stride(1), y.stride(0), BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_R=block_r)

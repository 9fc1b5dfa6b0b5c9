"""Triton kernels of the LoRA update (layer.py says what it computes), two launches per LoRA layer:

    shrink:  s[t] = x[t] @ A[slot_t].T * scaling[slot_t]        [T, parts * R], float32
    expand:  y[t, part p] += s[t, pR:(p+1)R] @ B[slot_t, part p].T   (all parts in one launch)

The shrink splits K into chunks, one program per chunk (with its rows and block of s columns), each writing its
chunk's scaled partial sums to a [T, splits, parts * R] float32 buffer (no atomics, nothing to zero); the
expand sums the partials of the rank slices it needs while loading them. The expand covers the layer's whole
output (its parts are contiguous column ranges, at most three: q, k, v or gate, up): a block of output columns
takes each part it overlaps from that part's rank slice of s. Chunks and buffer sizes depend only on the shapes,
so every path is graph-safe. Programs whose rows are all slot 0 (no adapter) return at once: shrink leaves
their partials unwritten and expand never reads them (a token block mixing them with adapters' rows gives them
zero partials and leaves their y alone).

Decode rows (and decode graphs) run matrix-vector kernels: shrink programs (row, K chunk, s column block),
chunks of 128, one loop step (longer for large batches); expand programs (row, 128 output columns).

Eager extend batches run SGMV: programs (request, BLOCK_M tokens of it, s column block x K chunk), the
request's slot read once. Extend graphs run the token-block kernels: programs (BLOCK_M consecutive tokens,
s column block x K chunk), reading each token's slot from the slot-id buffer alone (no per-request metadata, so
a graph captured at a token count serves any split of it into requests). A block's tokens share one slot but at
request boundaries; a block loops over the slots it holds, one tl.dot per slot over that slot's rows. Padding
tokens have slot 0. K is split only until there are about EXTEND_PROGRAMS shrink programs (a long extend has
enough without). Both extend kernels multiply in the input's dtype on the tensor cores (bf16 x bf16, float32
accumulation); the expand rounds s to B's dtype for its dot, as the torch path's bf16 matmuls do. (Triton's CPU
interpreter, which runs them in the tests, gets the same products in float32: its bf16 tl.dot is wrong.)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# ---------------------------------------------------------------------------------------------------- decode


@triton.jit
def _row_shrink(x_ptr, a_ptr, p_ptr, scaling_ptr, slots_ptr, K, N, stride_xm, stride_as, stride_an,
                stride_pm, stride_pk, CHUNK: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Program (row, split, column block): the split's K chunk of the row's s, scaled, into p[row, split]."""
    row = tl.program_id(0)
    slot = tl.load(slots_ptr + row)
    if slot == 0:
        return
    split = tl.program_id(1)
    cols = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    a_rows = a_ptr + slot * stride_as + cols[:, None] * stride_an
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, CHUNK, BLOCK_K):
        ks = split * CHUNK + k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        x = tl.load(x_ptr + row * stride_xm + ks, mask=k_ok, other=0.0).to(tl.float32)
        a = tl.load(a_rows + ks[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        acc += a * x[None, :]
    s = tl.sum(acc, axis=1) * tl.load(scaling_ptr + slot)
    tl.store(p_ptr + row * stride_pm + split * stride_pk + cols, s, mask=col_ok)


@triton.jit
def _row_part(p_row, b_slot, cols, lo, hi, s_off, R, n_splits, stride_pk, stride_bn,
              BLOCK_R: tl.constexpr, BLOCK_S: tl.constexpr):
    """One part's contribution to a row's output columns `cols` (zero outside [lo, hi)): its rank slice of s
    summed over the splits, times B."""
    rs = tl.arange(0, BLOCK_R)
    ss = tl.arange(0, BLOCK_S)
    r_ok = rs < R
    parts = tl.load(p_row + ss[:, None] * stride_pk + s_off + rs[None, :],
                    mask=(ss < n_splits)[:, None] & r_ok[None, :], other=0.0)
    s = tl.sum(parts, axis=0)
    in_part = (cols >= lo) & (cols < hi)
    b = tl.load(b_slot + cols[:, None] * stride_bn + rs[None, :], mask=in_part[:, None] & r_ok[None, :],
                other=0.0).to(tl.float32)
    return tl.sum(b * s[None, :], axis=1)


@triton.jit
def _row_expand(p_ptr, b_ptr, y_ptr, slots_ptr, R, n_splits, c0, e0, e1, e2, stride_pm, stride_pk,
                stride_bs, stride_bn, stride_ym, NPARTS: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_R: tl.constexpr, BLOCK_S: tl.constexpr):
    """Program (row, column block) of the whole output [c0, e_last): parts [c0, e0), [e0, e1), [e1, e2)."""
    row = tl.program_id(0)
    slot = tl.load(slots_ptr + row)
    if slot == 0:
        return
    n0 = c0 + tl.program_id(1) * BLOCK_N
    cols = n0 + tl.arange(0, BLOCK_N)
    p_row = p_ptr + row * stride_pm
    b_slot = b_ptr + slot * stride_bs
    delta = tl.zeros((BLOCK_N,), dtype=tl.float32)
    if n0 < e0:
        delta += _row_part(p_row, b_slot, cols, c0, e0, 0, R, n_splits, stride_pk, stride_bn, BLOCK_R, BLOCK_S)
    end = e0
    if NPARTS > 1:
        end = e1
        if (n0 < e1) & (n0 + BLOCK_N > e0):
            delta += _row_part(p_row, b_slot, cols, e0, e1, R, R, n_splits, stride_pk, stride_bn, BLOCK_R,
                               BLOCK_S)
    if NPARTS > 2:
        end = e2
        if n0 + BLOCK_N > e1:
            delta += _row_part(p_row, b_slot, cols, e1, e2, 2 * R, R, n_splits, stride_pk, stride_bn, BLOCK_R,
                               BLOCK_S)
    y_ptrs = y_ptr + row * stride_ym + cols
    ok = cols < end
    y = tl.load(y_ptrs, mask=ok, other=0.0)
    tl.store(y_ptrs, (y.to(tl.float32) + delta).to(y_ptr.dtype.element_ty), mask=ok)


# ---------------------------------------------------------------------------------------------------- extend


@triton.jit
def _dot(p, q, F32_DOT: tl.constexpr):
    """p @ q, float32 accumulation: on the tensor cores in the operands' dtype (bf16 x bf16), or where F32_DOT
    (Triton's CPU interpreter, whose bf16 tl.dot is wrong) in float32: the same products, bf16's are exact."""
    if F32_DOT:
        out = tl.dot(p.to(tl.float32), q.to(tl.float32))
    else:
        out = tl.dot(p, q)
    return out


@triton.jit
def _tile_part(p_rows, row_ok, b_slot, cols, lo, hi, s_off, R, n_splits, stride_pk, stride_bn,
               BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, F32_DOT: tl.constexpr):
    """One part's contribution to a tile of rows x output columns `cols` (zero outside [lo, hi)): the rows'
    rank slice of s (the partials at row pointers `p_rows` summed over the splits) in B's dtype, times B, with
    float32 accumulation."""
    rs = tl.arange(0, BLOCK_R)
    r_ok = rs < R
    s = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for sp in range(n_splits):
        s += tl.load(p_rows[:, None] + sp * stride_pk + s_off + rs[None, :], mask=row_ok[:, None] & r_ok[None, :],
                     other=0.0)
    in_part = (cols >= lo) & (cols < hi)
    b = tl.load(b_slot + cols[None, :] * stride_bn + rs[:, None], mask=in_part[None, :] & r_ok[:, None], other=0.0)
    return _dot(s.to(b.dtype), b, F32_DOT)


@triton.jit
def _tile_parts(p_rows, row_ok, b_slot, n0, c0, e0, e1, e2, R, n_splits, stride_pk, stride_bn, NPARTS: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, F32_DOT: tl.constexpr):
    """All parts' contributions to the tile of rows x columns [n0, n0 + BLOCK_N) (the parts it overlaps)."""
    cols = n0 + tl.arange(0, BLOCK_N)
    delta = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if n0 < e0:
        delta += _tile_part(p_rows, row_ok, b_slot, cols, c0, e0, 0, R, n_splits, stride_pk, stride_bn, BLOCK_M,
                            BLOCK_R, F32_DOT)
    if NPARTS > 1:  # noqa: SIM102 (a constexpr test, then a runtime one: not one `and` in a kernel)
        if (n0 < e1) & (n0 + BLOCK_N > e0):
            delta += _tile_part(p_rows, row_ok, b_slot, cols, e0, e1, R, R, n_splits, stride_pk, stride_bn,
                                BLOCK_M, BLOCK_R, F32_DOT)
    if NPARTS > 2:  # noqa: SIM102
        if n0 + BLOCK_N > e1:
            delta += _tile_part(p_rows, row_ok, b_slot, cols, e1, e2, 2 * R, R, n_splits, stride_pk, stride_bn,
                                BLOCK_M, BLOCK_R, F32_DOT)
    return delta


@triton.jit
def _sgmv_shrink(x_ptr, a_ptr, p_ptr, scaling_ptr, seg_start_ptr, seg_len_ptr, seg_slot_ptr, K, N, n_splits,
                 stride_xm, stride_as, stride_an, stride_pm, stride_pk, CHUNK: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, F32_DOT: tl.constexpr):
    """Program (request, BLOCK_M of its tokens, column block x K chunk): the chunk's scaled partial s."""
    seg = tl.program_id(0)
    slot = tl.load(seg_slot_ptr + seg)
    length = tl.load(seg_len_ptr + seg)
    m0 = tl.program_id(1) * BLOCK_M
    if slot == 0 or m0 >= length:
        return
    start = tl.load(seg_start_ptr + seg)
    split = tl.program_id(2) % n_splits
    rows = m0 + tl.arange(0, BLOCK_M)
    row_ok = rows < length
    cols = (tl.program_id(2) // n_splits) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, CHUNK, BLOCK_K):
        ks = split * CHUNK + k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + (start + rows)[:, None] * stride_xm + ks[None, :],
                    mask=row_ok[:, None] & (ks < K)[None, :], other=0.0)
        a = tl.load(a_ptr + slot * stride_as + cols[None, :] * stride_an + ks[:, None],
                    mask=(cols < N)[None, :] & (ks < K)[:, None], other=0.0)
        acc += _dot(x, a.to(x.dtype), F32_DOT)
    acc *= tl.load(scaling_ptr + slot)
    tl.store(p_ptr + (start + rows)[:, None] * stride_pm + split * stride_pk + cols[None, :], acc,
             mask=row_ok[:, None] & (cols < N)[None, :])


@triton.jit
def _sgmv_expand(p_ptr, b_ptr, y_ptr, seg_start_ptr, seg_len_ptr, seg_slot_ptr, R, n_splits, c0, e0, e1, e2,
                 stride_pm, stride_pk, stride_bs, stride_bn, stride_ym, NPARTS: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, F32_DOT: tl.constexpr):
    seg = tl.program_id(0)
    slot = tl.load(seg_slot_ptr + seg)
    length = tl.load(seg_len_ptr + seg)
    m0 = tl.program_id(1) * BLOCK_M
    if slot == 0 or m0 >= length:
        return
    start = tl.load(seg_start_ptr + seg)
    rows = m0 + tl.arange(0, BLOCK_M)
    row_ok = rows < length
    n0 = c0 + tl.program_id(2) * BLOCK_N
    cols = n0 + tl.arange(0, BLOCK_N)
    delta = _tile_parts(p_ptr + (start + rows) * stride_pm, row_ok, b_ptr + slot * stride_bs, n0, c0, e0, e1, e2,
                        R, n_splits, stride_pk, stride_bn, NPARTS, BLOCK_M, BLOCK_N, BLOCK_R, F32_DOT)
    end = e2 if NPARTS > 2 else (e1 if NPARTS > 1 else e0)
    y_ptrs = y_ptr + (start + rows)[:, None] * stride_ym + cols[None, :]
    mask = row_ok[:, None] & (cols < end)[None, :]
    y = tl.load(y_ptrs, mask=mask, other=0.0)
    tl.store(y_ptrs, (y.to(tl.float32) + delta).to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _token_shrink(x_ptr, a_ptr, p_ptr, scaling_ptr, slots_ptr, T, K, N, n_splits, stride_xm, stride_as, stride_an,
                  stride_pm, stride_pk, CHUNK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr, F32_DOT: tl.constexpr):
    """Program (BLOCK_M tokens, column block x K chunk): the chunk's scaled partial s of each token."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < T
    slots = tl.load(slots_ptr + rows, mask=row_ok, other=0)
    hi = tl.max(slots)
    if hi == 0:
        return
    lo = tl.min(tl.where(slots > 0, slots, hi))
    split = tl.program_id(1) % n_splits
    cols = (tl.program_id(1) // n_splits) * BLOCK_N + tl.arange(0, BLOCK_N)
    out = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for slot in range(lo, hi + 1):
        sel = slots == slot
        if tl.max(sel.to(tl.int32)) > 0:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for k0 in range(0, CHUNK, BLOCK_K):
                ks = split * CHUNK + k0 + tl.arange(0, BLOCK_K)
                x = tl.load(x_ptr + rows[:, None] * stride_xm + ks[None, :], mask=sel[:, None] & (ks < K)[None, :],
                            other=0.0)
                a = tl.load(a_ptr + slot * stride_as + cols[None, :] * stride_an + ks[:, None],
                            mask=(cols < N)[None, :] & (ks < K)[:, None], other=0.0)
                acc += _dot(x, a.to(x.dtype), F32_DOT)
            out += acc * tl.load(scaling_ptr + slot)
    # Rows of slot 0 get zeros: the expand of a block that mixes them with adapters' rows reads them.
    tl.store(p_ptr + rows[:, None] * stride_pm + split * stride_pk + cols[None, :], out,
             mask=row_ok[:, None] & (cols < N)[None, :])


@triton.jit
def _token_expand(p_ptr, b_ptr, y_ptr, slots_ptr, T, R, n_splits, c0, e0, e1, e2, stride_pm, stride_pk, stride_bs,
                  stride_bn, stride_ym, NPARTS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_R: tl.constexpr, F32_DOT: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < T
    slots = tl.load(slots_ptr + rows, mask=row_ok, other=0)
    hi = tl.max(slots)
    if hi == 0:
        return
    lo = tl.min(tl.where(slots > 0, slots, hi))
    n0 = c0 + tl.program_id(1) * BLOCK_N
    cols = n0 + tl.arange(0, BLOCK_N)
    p_rows = p_ptr + rows * stride_pm
    delta = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for slot in range(lo, hi + 1):
        sel = slots == slot
        if tl.max(sel.to(tl.int32)) > 0:
            part = _tile_parts(p_rows, row_ok, b_ptr + slot * stride_bs, n0, c0, e0, e1, e2, R, n_splits, stride_pk,
                               stride_bn, NPARTS, BLOCK_M, BLOCK_N, BLOCK_R, F32_DOT)
            delta += tl.where(sel[:, None], part, 0.0)
    end = e2 if NPARTS > 2 else (e1 if NPARTS > 1 else e0)
    y_ptrs = y_ptr + rows[:, None] * stride_ym + cols[None, :]
    mask = (row_ok & (slots > 0))[:, None] & (cols < end)[None, :]
    y = tl.load(y_ptrs, mask=mask, other=0.0)
    tl.store(y_ptrs, (y.to(tl.float32) + delta).to(y_ptr.dtype.element_ty), mask=mask)


# ---------------------------------------------------------------------------------------------------- launcher

BLOCK_M = 16  # extend: tokens per program
BLOCK_N = 64  # extend: s columns per shrink program
BLOCK_K = 64  # extend shrink: K elements per loop step
EXPAND_N = 128  # extend expand: output columns per program
EXTEND_PROGRAMS = 512  # extend shrink: K is split until about this many programs (a few per SM)
ROW_BLOCK_K = 128  # decode shrink: K elements per loop step
ROW_EXPAND_N = 128  # decode expand: output columns per program
MAX_PARTS = 3


def split_chunk(rows: int, k: int) -> int:
    """The decode shrink's K chunk per program: one loop step (every load of a program in flight at once; many
    programs even for one row), doubled while rows x splits would exceed 1024 programs (large decode batches have
    parallelism of their own)."""
    chunk = ROW_BLOCK_K
    while rows * triton.cdiv(k, chunk) > 1024 and chunk < k:
        chunk *= 2
    return chunk


def extend_chunk(programs: int, k: int) -> int:
    """The extend shrink's K chunk per program, given its programs without a split: K split in up to
    EXTEND_PROGRAMS // programs chunks of at least 4 loop steps, a multiple of BLOCK_K."""
    splits = max(1, min(EXTEND_PROGRAMS // max(programs, 1), triton.cdiv(k, 4 * BLOCK_K)))
    return triton.cdiv(triton.cdiv(k, splits), BLOCK_K) * BLOCK_K


def _part_ends(out_slices: list[tuple[int, int]]) -> tuple[int, int, int, int]:
    """(start, end of part 0, of part 1, of part 2) of contiguous parts; ends past the last repeat it."""
    if not 1 <= len(out_slices) <= MAX_PARTS:
        raise ValueError(f"a LoRA layer has 1 to {MAX_PARTS} output parts, not {len(out_slices)}")
    ends, pos = [], out_slices[0][0]
    for off, size in out_slices:
        if off != pos:
            raise ValueError(f"a LoRA layer's output parts must be contiguous: {out_slices}")
        pos = off + size
        ends.append(pos)
    ends += [pos] * (MAX_PARTS - len(ends))
    return out_slices[0][0], ends[0], ends[1], ends[2]


def lora_update(x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scaling: torch.Tensor,
                batch, out_slices: list[tuple[int, int]], rank: int) -> None:
    """y += each row's LoRA update (layer.py), in place. x [T, K], y [T, out]; a [slots, parts * R, K],
    b [slots, out, R] contiguous; batch a LoraBatch: its segments for an eager extend, else its token_slots
    alone (per row for decode, token blocks for an extend graph). Two launches; every size is the shapes'."""
    if x.stride(1) != 1:
        x = x.contiguous()
    T, K = x.shape
    n_s = a.shape[1]
    c0, e0, e1, e2 = _part_ends(out_slices)
    nparts, width = len(out_slices), e2 - c0
    block_r = max(16, triton.next_power_of_2(rank))
    f32_dot = x.device.type == "cpu"  # the interpreter
    if batch.decode:
        slots = batch.token_slots
        chunk = split_chunk(T, K)
        n_splits = triton.cdiv(K, chunk)
        block_n = min(64, max(16, triton.next_power_of_2(n_s)))
        partials = torch.empty(T, n_splits, n_s, dtype=torch.float32, device=x.device)
        _row_shrink[(T, n_splits, triton.cdiv(n_s, block_n))](
            x, a, partials, scaling, slots, K, n_s, x.stride(0), a.stride(0), a.stride(1), partials.stride(0),
            partials.stride(1), CHUNK=chunk, BLOCK_N=block_n, BLOCK_K=ROW_BLOCK_K)
        _row_expand[(T, triton.cdiv(width, ROW_EXPAND_N))](
            partials, b, y, slots, rank, n_splits, c0, e0, e1, e2, partials.stride(0), partials.stride(1),
            b.stride(0), b.stride(1), y.stride(0), NPARTS=nparts, BLOCK_N=ROW_EXPAND_N, BLOCK_R=block_r,
            BLOCK_S=max(2, triton.next_power_of_2(n_splits)))
        return
    n_blocks = triton.cdiv(n_s, BLOCK_N)
    if batch.seg_slot is None:  # an extend graph: the slot ids only
        slots = batch.token_slots
        m_blocks = triton.cdiv(T, BLOCK_M)
        chunk = extend_chunk(m_blocks * n_blocks, K)
        n_splits = triton.cdiv(K, chunk)
        partials = torch.empty(T, n_splits, n_s, dtype=torch.float32, device=x.device)
        _token_shrink[(m_blocks, n_blocks * n_splits)](
            x, a, partials, scaling, slots, T, K, n_s, n_splits, x.stride(0), a.stride(0), a.stride(1),
            partials.stride(0), partials.stride(1), CHUNK=chunk, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
            F32_DOT=f32_dot)
        _token_expand[(m_blocks, triton.cdiv(width, EXPAND_N))](
            partials, b, y, slots, T, rank, n_splits, c0, e0, e1, e2, partials.stride(0), partials.stride(1),
            b.stride(0), b.stride(1), y.stride(0), NPARTS=nparts, BLOCK_M=BLOCK_M, BLOCK_N=EXPAND_N,
            BLOCK_R=block_r, F32_DOT=f32_dot)
        return
    nseg, m_blocks = batch.seg_slot.shape[0], triton.cdiv(batch.max_seg_len, BLOCK_M)
    chunk = extend_chunk(triton.cdiv(T, BLOCK_M) * n_blocks, K)
    n_splits = triton.cdiv(K, chunk)
    partials = torch.empty(T, n_splits, n_s, dtype=torch.float32, device=x.device)
    _sgmv_shrink[(nseg, m_blocks, n_blocks * n_splits)](
        x, a, partials, scaling, batch.seg_start, batch.seg_len, batch.seg_slot, K, n_s, n_splits, x.stride(0),
        a.stride(0), a.stride(1), partials.stride(0), partials.stride(1), CHUNK=chunk, BLOCK_M=BLOCK_M,
        BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, F32_DOT=f32_dot)
    _sgmv_expand[(nseg, m_blocks, triton.cdiv(width, EXPAND_N))](
        partials, b, y, batch.seg_start, batch.seg_len, batch.seg_slot, rank, n_splits, c0, e0, e1, e2,
        partials.stride(0), partials.stride(1), b.stride(0), b.stride(1), y.stride(0), NPARTS=nparts,
        BLOCK_M=BLOCK_M, BLOCK_N=EXPAND_N, BLOCK_R=block_r, F32_DOT=f32_dot)

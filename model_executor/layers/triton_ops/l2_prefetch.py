"""Bring a weight into the GPU's L2 cache ahead of the kernel that reads it (sm_90: Hopper).

A one-row decode step streams every weight once through an L2 far smaller than the model (50 MB on an
H200), one bandwidth-bound GEMV after another, with latency-bound kernels between some of them (attention:
a few microseconds a layer at a short context, with the memory bus nearly idle). A prefetch issued just
before such a window lets the memory system fill L2 with the next GEMV's weight while the window runs.

`l2_prefetch(t, row_bytes)` issues sm_90's `cp.async.bulk.prefetch.L2.global`, one instruction per chunk of
up to `chunk` bytes, from one thread each (32 a program): either over the first `row_bytes` of every row of a 2-D tensor
(rows contiguous; every program of a row-blocked GEMV then finds the start of its rows in L2) or over the
whole tensor (`row_bytes=None`). The instruction is a hint with no result: nothing waits for the bytes, and
no program result depends on it. Off a CUDA device of compute capability 9 or more it does nothing.
`benchmarks/probe_l2_prefetch.py` measures whether it pays.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Bytes per prefetch instruction: a multiple of 16, as the instruction requires (sm_90 encodes at most 1 MB).
# Small chunks and one warp a program spread a weight over many SMs: each SM's copy engine turns its bulk
# requests into line requests at a bounded rate, so a few SMs could not keep the memory bus busy.
CHUNK = 8 * 1024
MAX_CHUNK = (1 << 20) - 16  # the SASS keeps size / 16 in 16 bits
ALIGN = 16
BLOCK = 32  # chunks per program: one per thread of its one warp


@triton.jit
def _l2_prefetch_kernel(P, row_stride, row_bytes, chunk, chunks_per_row, total, BLOCK: tl.constexpr):
    """Element e: chunk e % chunks_per_row of row e // chunks_per_row, i.e. bytes [c * chunk, +chunk) of it,
    cut at row_bytes (all multiples of 16)."""
    e = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    row = (e // chunks_per_row).to(tl.int64)
    start = (e % chunks_per_row).to(tl.int64) * chunk
    size = tl.minimum(row_bytes - start, chunk)
    size = tl.where(e < total, size, 0).to(tl.int32)
    ptrs = P + row * row_stride + start
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.gt.s32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r", [ptrs, size], dtype=tl.int32, is_pure=False, pack=1)


def supported(t: torch.Tensor) -> bool:
    return t.is_cuda and torch.cuda.get_device_capability(t.device)[0] >= 9


def plan(t: torch.Tensor, row_bytes: int | None, chunk: int = CHUNK) -> tuple[int, int, int, int, int, int]:
    """_launch's arguments after the tensor: (row stride, row bytes, chunk; in bytes), chunks per row, chunks,
    programs."""
    if not 0 < chunk <= MAX_CHUNK or chunk % ALIGN:
        raise ValueError(f"chunk must be a multiple of {ALIGN} bytes in (0, {MAX_CHUNK}], got {chunk}")
    size = t.element_size()
    if row_bytes is None:  # the whole tensor as one row
        if not t.is_contiguous():
            raise ValueError("prefetching a whole tensor needs it contiguous")
        rows, stride, row_bytes = 1, 0, t.numel() * size
    else:
        if t.dim() != 2 or t.stride(1) != 1:
            raise ValueError("prefetching rows needs a 2-D tensor with contiguous rows")
        rows, stride = t.shape[0], t.stride(0) * size
        row_bytes = min(row_bytes, t.shape[1] * size)
        if stride % ALIGN:
            raise ValueError(f"the row stride ({stride} bytes) is not a multiple of {ALIGN}")
    row_bytes -= row_bytes % ALIGN  # the instruction's sizes are multiples of 16: a short tail stays unfetched
    chunks_per_row = max(1, triton.cdiv(row_bytes, chunk))
    total = rows * chunks_per_row
    return stride, row_bytes, chunk, chunks_per_row, total, triton.cdiv(total, BLOCK)


def l2_prefetch(t: torch.Tensor, row_bytes: int | None = None, chunk: int = CHUNK) -> None:
    """Prefetch into L2 the first row_bytes of each row of t (2-D), or all of t (row_bytes None)."""
    if not supported(t) or t.numel() == 0:
        return
    if t.data_ptr() % ALIGN:
        raise ValueError(f"l2_prefetch needs a {ALIGN}-byte aligned tensor")
    args = plan(t, row_bytes, chunk)
    if args[1]:  # (row bytes: none when the rows are shorter than 16 bytes)
        _launch(t.view(torch.uint8), *args)


def _launch(t: torch.Tensor, stride: int, row_bytes: int, chunk: int, chunks_per_row: int, total: int,
            programs: int) -> None:
    _l2_prefetch_kernel[(programs,)](t, stride, row_bytes, chunk, chunks_per_row, total, BLOCK=BLOCK, num_warps=1)

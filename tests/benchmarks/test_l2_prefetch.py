"""benchmarks/probe_l2_prefetch.py's l2_prefetch, host side: how a weight is cut into prefetch chunks (the kernel
itself is a hint with no result; tests/sm90_compile.py compiles it for sm_90, the probe times it on a GPU)."""

from __future__ import annotations

import pytest
import torch

from benchmarks import probe_l2_prefetch as l2


def chunks(t: torch.Tensor, row_bytes, chunk: int) -> list[tuple[int, int]]:
    """(byte offset, size) of every prefetch the kernel issues, from its plan, as the kernel computes them."""
    stride, row_bytes, chunk, per_row, total, programs = l2.plan(t, row_bytes, chunk)
    assert programs * l2.BLOCK >= total > (programs - 1) * l2.BLOCK
    out = []
    for e in range(programs * l2.BLOCK):
        start = (e % per_row) * chunk
        size = min(row_bytes - start, chunk) if e < total else 0
        if size > 0:
            out.append(((e // per_row) * stride + start, size))
    return out


def test_rows_mode_covers_the_first_bytes_of_every_row_in_16_byte_multiples():
    w = torch.zeros(300, 1000, dtype=torch.bfloat16)  # rows of 2000 bytes
    got = chunks(w, 1000, 512)
    assert got == [(r * 2000 + c, n) for r in range(300) for c, n in ((0, 512), (512, 480))]  # 1000 -> 992


def test_rows_mode_stops_at_the_row_and_whole_mode_covers_the_tensor():
    w = torch.zeros(3, 64, dtype=torch.float32)  # rows of 256 bytes
    assert chunks(w, 10**6, 128) == [(r * 256 + c, 128) for r in range(3) for c in (0, 128)]
    t = torch.zeros(1000, dtype=torch.uint8)
    got = chunks(t, None, 256)
    assert got == [(0, 256), (256, 256), (512, 256), (768, 224)]  # 1000 -> 992 bytes


def test_bad_requests_are_refused():
    with pytest.raises(ValueError, match="multiple of 16"):
        l2.plan(torch.zeros(4, 64), 64, chunk=100)
    with pytest.raises(ValueError, match="multiple of 16"):
        l2.plan(torch.zeros(4, 64), 64, chunk=1 << 20)
    with pytest.raises(ValueError, match="contiguous rows"):
        l2.plan(torch.zeros(64, 4).t(), 64)
    with pytest.raises(ValueError, match="contiguous"):
        l2.plan(torch.zeros(64, 4).t(), None)
    with pytest.raises(ValueError, match="row stride"):
        l2.plan(torch.zeros(4, 3, dtype=torch.uint8), 3)


def test_off_a_hopper_gpu_it_does_nothing():
    l2.l2_prefetch(torch.zeros(4, 64))  # a CPU tensor: no launch, no error

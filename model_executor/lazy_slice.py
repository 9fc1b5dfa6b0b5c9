"""A checkpoint tensor not read yet: a safetensors slice that the layers narrow to their shard first.

With tensor parallelism each rank needs only its rows or columns of most tensors. The loader hands the
layers a LazySlice instead of a tensor; `narrow` and `to` only record what is wanted, and `materialize`
(called by the layers' checked copy) reads just that region from the memory-mapped file.
"""

from __future__ import annotations

import torch


class LazySlice:
    def __init__(self, source, shape: tuple[int, ...], ranges: tuple[tuple[int, int], ...] | None = None,
                 dtype: torch.dtype | None = None):
        self._source = source  # safetensors' PySafeSlice: indexing with slices reads that region only
        self._ranges = ranges if ranges is not None else tuple((0, n) for n in shape)
        self._dtype = dtype

    @property
    def shape(self) -> torch.Size:
        return torch.Size(b - a for a, b in self._ranges)

    def dim(self) -> int:
        return len(self._ranges)

    def narrow(self, dim: int, start: int, length: int) -> LazySlice:
        a, b = self._ranges[dim]
        if start < 0 or length < 0 or a + start + length > b:
            raise RuntimeError(f"narrow({dim}, {start}, {length}) is out of range for shape {tuple(self.shape)}")
        ranges = list(self._ranges)
        ranges[dim] = (a + start, a + start + length)
        return LazySlice(self._source, (), tuple(ranges), self._dtype)

    def to(self, dtype: torch.dtype) -> LazySlice:
        return LazySlice(self._source, (), self._ranges, dtype)

    def materialize(self) -> torch.Tensor:
        if not self._ranges:  # a scalar
            t = self._source[...]
        else:
            t = self._source[tuple(slice(a, b) for a, b in self._ranges)]
        return t if self._dtype is None else t.to(self._dtype)


def materialize(x: torch.Tensor | LazySlice) -> torch.Tensor:
    return x if isinstance(x, torch.Tensor) else x.materialize()

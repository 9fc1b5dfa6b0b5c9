"""The graph mechanism behind a small interface: real CUDA graphs on GPU, a stand-in on CPU.

A capturer turns a callable that reads static input buffers and writes static output buffers into a
graph with `replay()`. The CPU stand-in re-runs the callable on replay, so capture order, bisect,
padding and slicing are tested in CI without a GPU.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable
from typing import Protocol

import torch


class Graph(Protocol):
    def replay(self) -> None: ...


class GraphCapturer(Protocol):
    def capture(self, fn: Callable[[], None]) -> Graph: ...

    def memory_in_use(self) -> int: ...

    def synchronize(self) -> None: ...


class CudaGraphCapturer:
    """One memory pool and one side stream shared by every capture, so graphs captured smaller-after-larger
    reuse the largest one's memory (DESIGN.md §8: a new stream per capture defeats the sharing)."""

    def __init__(self, device: torch.device, pool=None):
        self.device = device
        self.pool = pool if pool is not None else torch.cuda.graph_pool_handle()
        self.stream = torch.cuda.Stream(device=device)

    def capture(self, fn: Callable[[], None]) -> Graph:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, stream=self.stream):
            fn()
        return graph

    def memory_in_use(self) -> int:
        # torch.cuda.graph() empties the allocator cache on entry; empty it here too so the numbers
        # before and after a capture both count only memory that is really held.
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        return total - free

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)


class _StandInGraph:
    def __init__(self, fn: Callable[[], None]):
        self._fn = fn

    def replay(self) -> None:
        self._fn()


class StandInCapturer:
    """CPU stand-in: 'capture' runs the callable once (as capture would record it); replay re-runs it."""

    def __init__(self):
        self.captured_order: list = []

    def capture(self, fn: Callable[[], None]) -> Graph:
        fn()
        return _StandInGraph(fn)

    def memory_in_use(self) -> int:
        return 0

    def synchronize(self) -> None:
        pass


def default_capturer(device: torch.device) -> GraphCapturer:
    return CudaGraphCapturer(device) if device.type == "cuda" else StandInCapturer()


@contextlib.contextmanager
def frozen_gc():
    """No garbage collection during capture: a collection could free tensors the graph still reads."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()

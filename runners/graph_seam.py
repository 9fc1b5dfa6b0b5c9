"""The graph mechanism behind a small interface: real CUDA graphs on GPU, a stand-in on CPU.

A capturer turns a callable that reads static input buffers and writes static output buffers into a
graph with `replay()`. The CPU stand-in re-runs the callable on replay, but the way a graph would run it:
the host-side state of the objects named at capture is put back to what it was at capture (a graph bakes
Python values in and reads tensors at the addresses it captured), so capture order, bisect, padding,
slicing and what a graph may read on the host are tested in CI without a GPU.
"""

from __future__ import annotations

import contextlib
import copy
import gc
from collections.abc import Callable, Sequence
from typing import Protocol

import torch


class Graph(Protocol):
    def replay(self) -> None: ...


class GraphCapturer(Protocol):
    def capture(self, fn: Callable[[], None], host_state: Sequence[object] = ()) -> Graph:
        """Capture fn. host_state: the objects whose attributes fn reads (the static batch, the backend)."""

    def memory_in_use(self) -> int: ...

    def synchronize(self) -> None: ...


class CudaGraphCapturer:
    """One memory pool and one side stream shared by every capture, so graphs captured smaller-after-larger
    reuse the largest one's memory (a new stream per capture would defeat the sharing)."""

    def __init__(self, device: torch.device, pool=None):
        self.device = device
        self.pool = pool if pool is not None else torch.cuda.graph_pool_handle()
        self.stream = torch.cuda.Stream(device=device)

    def capture(self, fn: Callable[[], None], host_state: Sequence[object] = ()) -> Graph:
        # A real graph freezes host state by itself: host_state is for the stand-in.
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


def _bake(attrs: dict) -> dict:
    """Attributes as a graph captured over them sees them: containers copied (their values are baked in),
    everything else by reference (a tensor stays the same storage, so its contents stay live)."""
    return {k: copy.copy(v) if isinstance(v, (list, dict, set)) else v for k, v in attrs.items()}


class _StandInGraph:
    def __init__(self, fn: Callable[[], None], host_state: Sequence[object]):
        self._fn = fn
        self._frozen = [(obj, _bake(vars(obj))) for obj in host_state]

    def replay(self) -> None:
        """Runs fn with every host_state object's attributes as they were at capture, then puts the live
        ones back: a runner that updates a Python value (a host list, a rebound tensor) instead of the
        contents of a captured tensor replays stale inputs here, as it would on a GPU."""
        live = [(obj, dict(vars(obj))) for obj, _ in self._frozen]
        try:
            for obj, frozen in self._frozen:
                vars(obj).update(_bake(frozen))  # a fresh copy: edits during one replay do not carry over
            self._fn()
        finally:
            for obj, attrs in live:
                vars(obj).clear()
                vars(obj).update(attrs)


class StandInCapturer:
    """CPU stand-in: 'capture' runs the callable once (as capture would record it) and snapshots the
    host-side state of host_state; replay re-runs the callable over that snapshot."""

    def capture(self, fn: Callable[[], None], host_state: Sequence[object] = ()) -> Graph:
        graph = _StandInGraph(fn, host_state)
        fn()
        return graph

    def memory_in_use(self) -> int:
        return 0

    def synchronize(self) -> None:
        pass


class AuxOut:
    """The aux hidden states a graph's model writes (an EAGLE-3 target's, ForwardBatch.aux_hidden_states), copied
    inside the graph into one static buffer (allocated by the first, uncaptured warm-up run), so that every
    replay, and the CPU stand-in's re-run alike, leaves them at the same place."""

    def __init__(self, max_rows: int):
        self.max_rows = max_rows
        self.buffer: torch.Tensor | None = None

    def write(self, aux: torch.Tensor | None) -> None:
        if aux is None:
            return
        if self.buffer is None:
            self.buffer = aux.new_empty(self.max_rows, aux.shape[1])
        self.buffer[: aux.shape[0]].copy_(aux)

    def read(self, n: int) -> torch.Tensor | None:
        """The first n rows of the last replay's (a copy: callers keep them past the next replay); None: the
        model gives none."""
        return None if self.buffer is None else self.buffer[:n].clone()


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

"""The LoRA update of one linear layer, for a batch whose rows use different adapters.

A fused layer (qkv_proj: q, k, v; gate_up_proj: gate, up) has one A per part stacked as [slots, parts * R, in]
and its B as [slots, out, R] (each part's output rows); R is the pool's max rank, an adapter of a smaller rank
fills the first r rows of A and columns of B and leaves the rest zero. For each row with slot s:

    y[:, part p] += (x @ A[s, pR:(p+1)R].T) @ B[s, part p].T * scaling[s]

Slot 0 is "no adapter" (zeros, scaling 0): its rows are left as they are.

Three ways to run it, the same numbers: `segments` (eager torch: one GEMM pair per adapter in the batch, over its
rows; the rows of each adapter are known on the host), `gather` (torch, graph-safe: each row's A and B gathered,
batched matrix-vector products; for decode graphs on a CPU stand-in), and the Triton kernels
(model_executor/lora/kernels.py: SGMV over each request's tokens for extend, per row for decode).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class LoraBatch:
    """A batch's adapters, what every LoRA layer of the forward reads (ForwardBatch.lora)."""

    token_slots: torch.Tensor  # [num_tokens] int64 on the device: each token's pool slot (0: none)
    # Eager batches: (slot, the token rows that use it) per adapter in the batch (slot 0's rows left out),
    # the row index tensors on the device. None in a captured graph (the slots are read from token_slots).
    groups: list[tuple[int, torch.Tensor]] | None = None
    # Eager extend batches (the Triton SGMV kernels): each request's first token, token count and slot,
    # [bs] int32 on the device, and the longest count.
    seg_start: torch.Tensor | None = None
    seg_len: torch.Tensor | None = None
    seg_slot: torch.Tensor | None = None
    max_seg_len: int = 0
    decode: bool = False  # one token per request (the per-row kernels)

    @classmethod
    def build(cls, req_slots: list[int], extend_lens: list[int] | None, device) -> LoraBatch | None:
        """From each request's slot and (extend) token count; None when no request uses an adapter."""
        if not any(req_slots):
            return None
        lens = extend_lens if extend_lens is not None else [1] * len(req_slots)
        token_slots = [s for s, n in zip(req_slots, lens) for _ in range(n)]
        starts, acc = [], 0
        for n in lens:
            starts.append(acc)
            acc += n
        groups = []
        for slot in sorted(set(req_slots) - {0}):
            rows = [i for i, s in enumerate(token_slots) if s == slot]
            groups.append((slot, torch.tensor(rows, dtype=torch.int64, device=device)))
        seg = torch.tensor([starts, lens, req_slots], dtype=torch.int32, device=device)
        return cls(token_slots=torch.tensor(token_slots, dtype=torch.int64, device=device), groups=groups,
                   seg_start=seg[0], seg_len=seg[1], seg_slot=seg[2], max_seg_len=max(lens),
                   decode=extend_lens is None)


class LoraLayer:
    """The LoRA tensors of one linear layer (views of the pool's) and its update. `state.batch` is the batch
    being run (set by the model runner before each forward; None: no request uses an adapter)."""

    def __init__(self, state, a: torch.Tensor, b: torch.Tensor, out_slices: list[tuple[int, int]], rank: int):
        self.state = state  # LoraManager: .batch, .scaling, .backend
        self.a = a  # [slots, parts * R, in]
        self.b = b  # [slots, out, R]
        self.out_slices = out_slices  # each part's (offset, size) in the layer's output
        self.rank = rank  # R

    def apply(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y (the layer's output on x) plus each row's adapter update."""
        batch: LoraBatch | None = self.state.batch
        if batch is None:
            return y
        x2 = x.reshape(-1, x.shape[-1])
        y2 = y.reshape(-1, y.shape[-1])
        if self.state.backend == "triton":
            from model_executor.lora import kernels

            kernels.lora_update(x2, y2, self.a, self.b, self.state.scaling, batch, self.out_slices, self.rank)
        elif batch.groups is not None:
            self._segments(x2, y2, batch.groups)
        else:
            self._gather(x2, y2, batch.token_slots)
        return y

    def _segments(self, x: torch.Tensor, y: torch.Tensor, groups: list[tuple[int, torch.Tensor]]) -> None:
        scaling = self.state.scaling_host
        for slot, rows in groups:
            s = (x[rows] @ self.a[slot].T) * scaling[slot]  # [n, parts * R]
            delta = torch.cat([s[:, p * self.rank:(p + 1) * self.rank] @ self.b[slot, off:off + size].T
                               for p, (off, size) in enumerate(self.out_slices)], dim=-1)
            y.index_add_(0, rows, delta.to(y.dtype))

    def _gather(self, x: torch.Tensor, y: torch.Tensor, slots: torch.Tensor) -> None:
        """Graph-safe: no host values, every row computed (slot 0's update is zero)."""
        s = torch.bmm(self.a[slots], x.unsqueeze(-1)).squeeze(-1)  # [T, parts * R]
        s = s * self.state.scaling[slots].unsqueeze(-1).to(s.dtype)
        r = self.rank
        for p, (off, size) in enumerate(self.out_slices):
            b = self.b[slots, off:off + size]  # [T, size, R]
            y[:, off:off + size] += torch.bmm(b, s[:, p * r:(p + 1) * r].unsqueeze(-1)).squeeze(-1).to(y.dtype)

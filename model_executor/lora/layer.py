"""The LoRA update of one linear layer, for a batch whose rows use different adapters.

A fused layer (qkv_proj: q, k, v; gate_up_proj: gate, up) has one A per part stacked as [slots, parts * R, in]
and its B as [slots, out, R] (each part's output rows); R is the pool's max rank, an adapter of a smaller rank
fills the first r rows of A and columns of B and leaves the rest zero. For each row with slot s:

    y[:, part p] += (x @ A[s, pR:(p+1)R].T) @ B[s, part p].T * scaling[s]

Slot 0 is "no adapter" (zeros, scaling 0): its rows are left as they are.

Three ways to run it, the same numbers: `segments` (eager torch: one GEMM pair per adapter in the batch, over its
rows; the rows of each adapter are known on the host), `dense` (torch, graph-safe: every slot's shrink in one
GEMM, each row keeps its own slot's, and one expand GEMM over all slots' ranks; rank-sized work per slot, no
gathered weights), and the Triton kernels (model_executor/lora/kernels.py: SGMV over each request's tokens for
eager extends, per row for decode, token blocks for extend graphs).

A graph's batch (decode, piecewise and whole extend graphs) carries only the slot-id buffer; its update goes
through the `duet::lora_update` op, opaque to torch.compile's trace (the piecewise runner's pieces hold it like
any other kernel), which picks the graph-safe path of the backend.
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
    def of_graph(cls, token_slots: torch.Tensor, decode: bool) -> LoraBatch:
        """A graph's batch: each token's slot from a static buffer, nothing on the host."""
        return cls(token_slots=token_slots, decode=decode)

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
        self.offsets = [off for off, _ in out_slices]
        self.sizes = [size for _, size in out_slices]
        self.rank = rank  # R

    def apply(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y (the layer's output on x) plus each row's adapter update."""
        batch: LoraBatch | None = self.state.batch
        if batch is None:
            return y
        x2 = x.reshape(-1, x.shape[-1])
        y2 = y.reshape(-1, y.shape[-1])
        if batch.groups is None:  # a graph's batch: the slot ids only
            torch.ops.duet.lora_update(x2, y2, self.a, self.b, self.state.scaling, batch.token_slots, self.offsets,
                                       self.sizes, self.rank, batch.decode, self.state.backend)
        elif self.state.backend == "triton":
            from model_executor.lora import kernels

            kernels.lora_update(x2, y2, self.a, self.b, self.state.scaling, batch, self.out_slices, self.rank)
        else:
            self._segments(x2, y2, batch.groups)
        return y

    def _segments(self, x: torch.Tensor, y: torch.Tensor, groups: list[tuple[int, torch.Tensor]]) -> None:
        scaling = self.state.scaling_host
        for slot, rows in groups:
            s = (x[rows] @ self.a[slot].T) * scaling[slot]  # [n, parts * R]
            delta = torch.cat([s[:, p * self.rank:(p + 1) * self.rank] @ self.b[slot, off:off + size].T
                               for p, (off, size) in enumerate(self.out_slices)], dim=-1)
            y.index_add_(0, rows, delta.to(y.dtype))


@torch.library.custom_op("duet::lora_update", mutates_args=("y",))
def lora_update(x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scaling: torch.Tensor,
                token_slots: torch.Tensor, offsets: list[int], sizes: list[int], rank: int, decode: bool,
                backend: str) -> None:
    """y += each row's update, reading nothing but tensors (graph-safe): the Triton per-row (decode) or
    token-block (extend) kernels, or the torch `dense` path."""
    slices = list(zip(offsets, sizes))
    if backend == "triton":
        from model_executor.lora import kernels

        kernels.lora_update(x, y, a, b, scaling, LoraBatch.of_graph(token_slots, decode), slices, rank)
    else:
        _dense(x, y, a, b, scaling, token_slots, slices, rank)


@lora_update.register_fake
def _(x, y, a, b, scaling, token_slots, offsets, sizes, rank, decode, backend):
    return None


def _dense(x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scaling: torch.Tensor,
           slots: torch.Tensor, slices: list[tuple[int, int]], rank: int) -> None:
    """Every slot's shrink for every row (one GEMM: slots x parts x R columns), each row's own slot kept and
    scaled (the rest zeroed), then each part's expand as one GEMM over all slots' ranks."""
    n_slots, pr, k = a.shape
    t = x.shape[0]
    s = (x.to(a.dtype) @ a.reshape(n_slots * pr, k).T).view(t, n_slots, pr)
    keep = (slots[:, None] == torch.arange(n_slots, device=slots.device)).to(scaling.dtype) * scaling
    s = s * keep.to(s.dtype).unsqueeze(-1)
    for p, (off, size) in enumerate(slices):
        sp = s[:, :, p * rank:(p + 1) * rank].reshape(t, n_slots * rank)
        bp = b[:, off:off + size].transpose(1, 2).reshape(n_slots * rank, size)
        y[:, off:off + size] += (sp @ bp).to(y.dtype)

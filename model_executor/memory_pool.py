"""Token-level paged KV memory (page size 1): request rows, per-layer K/V slot buffers, a slot allocator.

Slot 0 is reserved: it is never handed out, and padded rows of graph batches write their K/V there.
"""

from __future__ import annotations

import torch

from model_executor.layers import triton_ops


class OutOfSlotsError(RuntimeError):
    """The KV pool cannot hand out the slots asked for."""


class ReqToTokenPool:
    """`req_to_token[row, pos]` is the KV slot of token `pos` of the request living in `row`.

    Row 0 is reserved for padding rows of graph batches (all its entries point at slot 0).

    On a GPU the table is mirrored on the host (`req_to_token_cpu`), written together with the device copy,
    so the scheduler reads a finished request's slots without waiting for the batch in flight.
    """

    def __init__(self, max_requests: int, max_context_len: int, device: torch.device | str):
        self.size = max_requests
        self.max_context_len = max_context_len
        self.req_to_token = torch.zeros((max_requests + 1, max_context_len), dtype=torch.int32, device=device)
        self.req_to_token_cpu = (self.req_to_token if self.req_to_token.device.type == "cpu"
                                 else torch.zeros_like(self.req_to_token, device="cpu"))
        self._free_rows = list(range(max_requests, 0, -1))

    def available_size(self) -> int:
        return len(self._free_rows)

    def alloc(self) -> int:
        if not self._free_rows:
            raise OutOfSlotsError("no free request rows")
        return self._free_rows.pop()

    def free(self, row: int) -> None:
        assert 0 < row <= self.size and row not in self._free_rows, f"bad free of request row {row}"
        self._free_rows.append(row)

    def write(self, row: int, start: int, slots: torch.Tensor) -> None:
        """Record `slots` (host tensor) as the KV slots of positions start.. of the request in `row`."""
        end = start + slots.numel()
        self.req_to_token_cpu[row, start:end] = slots
        if self.req_to_token_cpu is not self.req_to_token:
            self.req_to_token[row, start:end] = slots.to(self.req_to_token.device, torch.int32, non_blocking=True)

    def write_decode(self, rows: list[int], positions: list[int], slots: torch.Tensor,
                     rows_dev: torch.Tensor, positions_dev: torch.Tensor, slots_dev: torch.Tensor) -> None:
        """One slot per request (a decode step): host lists/tensors for the mirror, device tensors for the table."""
        self.req_to_token_cpu[rows, positions] = slots.to(torch.int32)
        if self.req_to_token_cpu is not self.req_to_token:
            self.req_to_token[rows_dev, positions_dev] = slots_dev.to(torch.int32)

    def slots(self, row: int, n: int) -> torch.Tensor:
        """The KV slots of the first n tokens of the request in `row` (host int64; no device sync)."""
        return self.req_to_token_cpu[row, :n].to(torch.int64)


class KVCache:
    """Per-layer K and V buffers of shape [num_slots + 1, num_kv_heads, head_dim].

    An FP8 pool (dtype float8_e4m3fn) stores K / k_scales[layer] and V / v_scales[layer] (1.0 unless the
    checkpoint gives scales); the attention kernels multiply the scales back in."""

    def __init__(
        self,
        num_slots: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
        k_scales: list[float] | None = None,
        v_scales: list[float] | None = None,
    ):
        self.num_slots = num_slots
        self.dtype = dtype
        self.k_scales = list(k_scales) if k_scales is not None else [1.0] * num_layers
        self.v_scales = list(v_scales) if v_scales is not None else [1.0] * num_layers
        if len(self.k_scales) != num_layers or len(self.v_scales) != num_layers:
            raise ValueError(f"KV scales must be given for all {num_layers} layers")
        shape = (num_slots + 1, num_kv_heads, head_dim)
        self.k_buffers = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v_buffers = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    @staticmethod
    def bytes_per_slot(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    def set_kv(self, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v: [T, Hk, D] rows written at slots loc [T] (int64)."""
        if self.k_scales[layer_id] != 1.0:
            k = k / self.k_scales[layer_id]
        if self.v_scales[layer_id] != 1.0:
            v = v / self.v_scales[layer_id]
        if k.is_cuda:  # one Triton kernel for both buffers (its casts to FP8 saturate)
            triton_ops.store_kv(self.k_buffers[layer_id], self.v_buffers[layer_id], loc, k, v)
            return
        self.k_buffers[layer_id][loc] = k.to(self.dtype)
        self.v_buffers[layer_id][loc] = v.to(self.dtype)

    def get_scales(self, layer_id: int) -> tuple[float, float]:
        return self.k_scales[layer_id], self.v_scales[layer_id]

    def get_kv(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k_buffers[layer_id], self.v_buffers[layer_id]


class SlotAllocator:
    """Free list of KV slots 1..num_slots (slot 0 is reserved), kept on the host.

    `is_free` mirrors the free list so double frees and frees of slot 0 are caught cheaply.
    """

    def __init__(self, num_slots: int):
        if num_slots < 1:
            raise ValueError("the KV pool needs at least one slot")
        self.num_slots = num_slots
        self._free = torch.arange(1, num_slots + 1, dtype=torch.int64)
        self._num_free = num_slots
        self._is_free = torch.ones(num_slots + 1, dtype=torch.bool)
        self._is_free[0] = False

    def available_size(self) -> int:
        return self._num_free

    def alloc(self, n: int) -> torch.Tensor:
        if n > self._num_free:
            raise OutOfSlotsError(f"asked for {n} KV slots but only {self._num_free} are free")
        start = self._num_free - n
        slots = self._free[start : self._num_free].clone()
        self._num_free = start
        self._is_free[slots] = False
        return slots

    def free(self, slots: torch.Tensor) -> None:
        slots = slots.to("cpu", torch.int64).flatten()
        if slots.numel() == 0:
            return
        if not bool(self._is_free[slots].logical_not().all()) or bool((slots == 0).any()):
            raise AssertionError("double free or free of the reserved slot 0")
        if torch.unique(slots).numel() != slots.numel():
            raise AssertionError("the same slot freed twice in one call")
        self._is_free[slots] = True
        self._free[self._num_free : self._num_free + slots.numel()] = slots
        self._num_free += slots.numel()

    def check_invariant(self, num_held: int) -> None:
        """free + held (by requests and the prefix cache) must equal the pool size."""
        if self._num_free + num_held != self.num_slots:
            raise AssertionError(
                f"KV slot leak: free {self._num_free} + held {num_held} != total {self.num_slots}"
            )
        assert int(self._is_free.sum()) == self._num_free

"""One-shot all-reduce through peer memory, for tensor parallelism's small sums on one host.

A decode step at tp N sums two [batch, hidden] tensors a layer: kilobytes, where NCCL's ring pays its
latency (two steps and a protocol per call). The one-shot sum is one kernel,
`torch.ops.symm_mem.one_shot_all_reduce_copy_out` (torch symmetric memory): every rank copies its input
into its own symmetric buffer, the ranks meet at a barrier over signal pads, each reads every peer's buffer
over NVLink and sums them into its output, and a second barrier keeps the buffers untouched until every
peer has read them. The buffers are allocated and exchanged once, at start-up, so the kernel is captured in
CUDA graphs like any other (the pointers never change).

What it uses is peer-to-peer loads only: no NVLink multicast (the multimem ops; hosts that share their GPUs
keep it off with TORCH_SYMM_MEM_DISABLE_MULTICAST=1, and this module leaves that variable alone).

Every rank must take the same path for the same call, or one waits in NCCL while the other waits at the
barrier: `fits` decides from the tensor's size and dtype only, which every rank has in common.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

logger = logging.getLogger("duet.custom_all_reduce")

# The largest sum that goes one-shot; larger ones go through NCCL. Every rank reads all N inputs, so past a
# size NCCL's ring (each rank moves about 2/N of it) is faster: for two H200s the crossover measured by
# `benchmarks/bench_all_reduce.py` is in docs/benchmarks.md (issue 21).
MAX_BYTES = 2 << 20
DTYPES = (torch.bfloat16, torch.float32)  # what the symm_mem kernel sums (no float16)
ALIGN = 16  # the kernel's widest vector: inputs and sizes on 16-byte multiples take the fast path everywhere


class OneShotAllReduce:
    """Symmetric buffers of `max_bytes` for each dtype of DTYPES, exchanged with the group's peers."""

    def __init__(self, group: dist.ProcessGroup, device: torch.device, max_bytes: int = MAX_BYTES):
        import torch.distributed._symmetric_memory as symm_mem

        self.group_name = group.group_name
        self.device_type = device.type
        self.max_bytes = max_bytes
        self.buffers: dict[torch.dtype, torch.Tensor] = {}
        for dtype in DTYPES:
            buf = symm_mem.empty(max_bytes // dtype.itemsize, dtype=dtype, device=device)
            symm_mem.rendezvous(buf, self.group_name)  # collective: maps every peer's buffer into this process
            self.buffers[dtype] = buf
        self.calls = 0  # host-side calls (eager, or captured into a graph): tests read it

    def fits(self, x: torch.Tensor) -> bool:
        """Whether x goes one-shot. Shape and dtype only, so every rank decides alike."""
        return (x.device.type == self.device_type and x.dtype in self.buffers and 0 < x.numel()
                and x.numel() * x.element_size() <= self.max_bytes and x.numel() * x.element_size() % ALIGN == 0)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        if x.storage_offset() * x.element_size() % ALIGN:  # a view that starts mid-vector: the kernel needs
            x = x.clone()  # the input aligned like the buffer
        out = torch.empty_like(x)
        buf = self.buffers[x.dtype][: x.numel()].view(x.shape)
        torch.ops.symm_mem.one_shot_all_reduce_copy_out(buf, x, "sum", self.group_name, out)
        self.calls += 1
        return out


def create_one_shot_all_reduce(group: dist.ProcessGroup, cpu_group: dist.ProcessGroup,
                               device: torch.device) -> OneShotAllReduce | None:
    """The one-shot path where every rank of the group could set it up, else None (NCCL for every sum).

    The ranks agree through `cpu_group` before anyone uses it, so a rank whose set-up failed cannot leave
    the others waiting at a barrier it never reaches."""
    one_shot, why = None, ""
    try:
        one_shot = OneShotAllReduce(group, device)
    except (ImportError, AttributeError, RuntimeError) as e:  # no symm_mem here, no peer access, a failed rendezvous
        why = f"{type(e).__name__}: {e}"
    ok = torch.tensor([1 if one_shot is not None else 0], dtype=torch.int64)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=cpu_group)
    if int(ok.item()) == 0:
        logger.warning("one-shot all-reduce unavailable (%s): NCCL for every sum",
                       why or "another rank could not set it up")
        return None
    logger.info("one-shot all-reduce over symmetric memory for sums up to %d KiB", one_shot.max_bytes >> 10)
    return one_shot

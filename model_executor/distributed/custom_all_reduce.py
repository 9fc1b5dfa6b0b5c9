"""One-shot all-reduce through peer memory, for tensor parallelism's small sums on one host.

A decode step at tp N sums two [batch, hidden] tensors a layer: kilobytes, where NCCL's ring pays its
latency (two steps and a protocol per call). Here a sum is one Triton kernel with no barrier (the
"Lamport" scheme of TensorRT-LLM's one-shot all-reduce): every rank owns a receive buffer in torch
symmetric memory with a region per rank, filled with -0.0, the mark of a value not yet arrived. Each rank
writes its input straight into its own region of every rank's buffer over NVLink (a -0.0 of its input
sent as +0.0, which sums alike), then waits on its own buffer until no element of its share is -0.0 and
adds the regions in rank order, so every rank gets the same bits. Three buffers rotate: a call writes
slot s, and sets slot s - 1 (which every rank read in the previous call) back to -0.0. A peer can run one
call ahead, not two (each call waits on every rank's input), so the slot it may write next, s + 1, was
cleared a call ago and the one being cleared is no longer written. The slot number lives on the device
(the last program of a call moves it on), so the kernel needs nothing from the host per call and is
captured in CUDA graphs like any other, eager calls and graph replays mixed; each dtype has its own
buffers and slot count. A rank waits inside the kernel for its peers, so a dead peer hangs it: the
server's watchdog (--watchdog-timeout) stops a tensor-parallel server whose rank stops making progress.

The buffers are exchanged once, at start-up (`symm_mem.rendezvous`); only peer-to-peer stores are used,
no NVLink multicast (hosts that share their GPUs keep it off with TORCH_SYMM_MEM_DISABLE_MULTICAST=1).

Every rank must take the same path for the same call, or one waits in NCCL while the other waits in this
kernel: `fits` decides from the tensor's size and dtype only, which every rank has in common.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist
import triton
import triton.language as tl

logger = logging.getLogger("duet.custom_all_reduce")

# The largest sum that goes one-shot; larger ones go through NCCL. Each rank writes its whole input to every
# peer, so past a size NCCL's ring (each rank sends about 2/N of it) is faster: for two H200s the crossover
# measured by `benchmarks/kernels/bench_all_reduce.py` is in docs/benchmarks.md.
MAX_BYTES = 2 << 20
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
SLOTS = 3
# (elements a program handles at a time, warps): the fastest of bench_all_reduce's --tiles on two H200s,
# 512 x 4 up to 256 KiB (3.4 us for 8 KiB, against 3.9 at 1024 x 4), 1024 x 8 at 2 MiB (docs/benchmarks.md).
SMALL_TILE, LARGE_TILE, LARGE_FROM_BYTES = (512, 4), (1024, 8), 512 << 10
# Programs per call at most, each looping over its chunks: few enough to be resident at once on either GPU
# (a program waits for its peer's program of the same chunks; one that never got an SM would hang both).
MAX_PROGRAMS = 128


@triton.jit
def _one_shot_kernel(x_ptr, out_ptr, buf_ptr, peers_ptr, state_ptr, numel, lane_numel,
                     res_ptr, norm_w_ptr, h_ptr, partials_ptr, RANK: tl.constexpr,
                     WORLD: tl.constexpr, SLOTS: tl.constexpr, INT_T: tl.constexpr, SIGN: tl.constexpr,
                     BLOCK: tl.constexpr, ADD_NORM: tl.constexpr):
    """out = the sum over ranks of x, BLOCK elements a program at a time. buf_ptr: this rank's
    SLOTS x WORLD x lane_numel receive buffer; peers_ptr: every rank's buffer address (int64); state_ptr:
    int32 [slot, programs done, numel each slot last held]. INT_T: an integer type of the element's width,
    SIGN: its sign bit alone (-0.0's bits). ADD_NORM (one row): the sum s, rounded, is added to the
    residual, h = s + residual goes to h_ptr, out_ptr gets norm_w * h and partials_ptr each chunk's sum of
    h^2 (a PrenormedRow for the GEMV after, as small_m_gemm's ADD_NORM epilogue makes one)."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    slot = tl.load(state_ptr, volatile=True)
    base = slot * WORLD * lane_numel
    nchunks = tl.cdiv(numel, BLOCK)
    # 1. this rank's input into its region of every rank's slot
    for c in range(pid, nchunks, nprog):
        offs = c * BLOCK + tl.arange(0, BLOCK)
        mask = offs < numel
        bits = tl.load(x_ptr + offs, mask=mask, other=0.0).to(INT_T, bitcast=True)
        # -0.0 marks "not arrived": send +0.0 instead (on the bits: no float rule may fold it away)
        x = tl.where(bits == SIGN, tl.zeros_like(bits), bits).to(buf_ptr.dtype.element_ty, bitcast=True)
        for r in tl.static_range(WORLD):
            peer = tl.load(peers_ptr + r).to(tl.pointer_type(buf_ptr.dtype.element_ty))
            tl.store(peer + base + RANK * lane_numel + offs, x, mask=mask)
    # 2. wait for every rank's region of this program's chunks, add them in rank order
    for c in range(pid, nchunks, nprog):
        offs = c * BLOCK + tl.arange(0, BLOCK)
        mask = offs < numel
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for r in tl.static_range(WORLD):
            src = buf_ptr + base + r * lane_numel + offs
            v = tl.load(src, mask=mask, other=1.0, volatile=True)
            while tl.sum((v.to(INT_T, bitcast=True) == SIGN).to(tl.int32), axis=0) > 0:
                v = tl.load(src, mask=mask, other=1.0, volatile=True)
            acc += v.to(tl.float32)
        total = acc.to(out_ptr.dtype.element_ty, fp_downcast_rounding="rtne")
        if ADD_NORM:
            res = tl.load(res_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            h = (total.to(tl.float32) + res).to(out_ptr.dtype.element_ty, fp_downcast_rounding="rtne")
            tl.store(h_ptr + offs, h, mask=mask)
            hf = h.to(tl.float32)
            tl.store(partials_ptr + c, tl.sum(tl.where(mask, hf * hf, 0.0), axis=0))
            g = tl.load(norm_w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            total = (hf * g).to(out_ptr.dtype.element_ty, fp_downcast_rounding="rtne")
        tl.store(out_ptr + offs, total, mask=mask)
    # 3. the previous call's slot back to -0.0, as far as that call filled it
    prev = (slot + SLOTS - 1) % SLOTS
    used = tl.load(state_ptr + 2 + prev, volatile=True)
    empty = tl.full([BLOCK], SIGN, dtype=INT_T).to(buf_ptr.dtype.element_ty, bitcast=True)  # -0.0
    for c in range(pid, tl.cdiv(used, BLOCK), nprog):
        offs = c * BLOCK + tl.arange(0, BLOCK)
        for r in tl.static_range(WORLD):
            tl.store(buf_ptr + prev * WORLD * lane_numel + r * lane_numel + offs, empty, mask=offs < used)
    # 4. the last program done moves the slot on (every program has read it by then)
    if tl.atomic_add(state_ptr + 1, 1) == nprog - 1:
        tl.store(state_ptr + 1, 0)
        tl.store(state_ptr + 2 + slot, numel)
        tl.store(state_ptr, (slot + 1) % SLOTS)


_INT_TYPES = {1: tl.int8, 2: tl.int16, 4: tl.int32}


@dataclass
class Lane:
    """One dtype's receive buffers: `buf` (SLOTS x world x numel, this rank's), `peers` (every rank's `buf`
    address, int64 on the device) and `state` (int32: slot, programs done, numel each slot last held)."""
    buf: torch.Tensor
    peers: torch.Tensor
    state: torch.Tensor
    numel: int

    @classmethod
    def empty_state(cls, device) -> torch.Tensor:
        return torch.zeros(2 + SLOTS, dtype=torch.int32, device=device)


def tile_for(nbytes: int) -> tuple[int, int]:
    """(block, num_warps) for a sum of nbytes: the size alone picks it, so every rank launches alike."""
    return LARGE_TILE if nbytes >= LARGE_FROM_BYTES else SMALL_TILE


def one_shot_sum(x: torch.Tensor, lane: Lane, rank: int, world: int, block: int | None = None,
                 num_warps: int | None = None, add_norm: tuple[torch.Tensor, torch.Tensor] | None = None):
    """The kernel's launch: the sum of x over the ranks (x: at most lane.numel elements). Every rank must
    launch it with the same block (a program waits for the same chunks from its peers): by default
    tile_for's. add_norm: (residual, norm weight) of one row; then (norm weight * h, h, partial sums of h^2
    per chunk, float32) for h = the sum + residual, instead of the sum."""
    x = x.contiguous()
    out = torch.empty_like(x)
    n = x.numel()
    if block is None:
        block, num_warps = tile_for(n * x.element_size())
    grid = (min(triton.cdiv(n, block), MAX_PROGRAMS),)
    h = partials = residual = norm_weight = x  # (unused without add_norm)
    if add_norm is not None:
        residual, norm_weight = add_norm
        h = torch.empty_like(x)
        partials = torch.empty(triton.cdiv(n, block), dtype=torch.float32, device=x.device)
    _one_shot_kernel[grid](x, out, lane.buf, lane.peers, lane.state, n, lane.numel, residual, norm_weight, h,
                           partials, RANK=rank, WORLD=world, SLOTS=SLOTS, INT_T=_INT_TYPES[x.element_size()],
                           SIGN=-(1 << (8 * x.element_size() - 1)), BLOCK=block, ADD_NORM=add_norm is not None,
                           num_warps=num_warps)
    return out if add_norm is None else (out, h, partials)


class OneShotAllReduce:
    """A Lane for each dtype of DTYPES, sized for sums of up to `max_bytes`, exchanged with the group."""

    def __init__(self, group: dist.ProcessGroup, device: torch.device, max_bytes: int = MAX_BYTES):
        import torch.distributed._symmetric_memory as symm_mem

        self.rank, self.world = group.rank(), group.size()
        self.device_type = device.type
        self.max_bytes = max_bytes
        self.lanes: dict[torch.dtype, Lane] = {}
        for dtype in DTYPES:
            numel = max_bytes // dtype.itemsize
            buf = symm_mem.empty(SLOTS * self.world * numel, dtype=dtype, device=device)
            buf.fill_(-0.0)
            torch.cuda.synchronize(device)
            handle = symm_mem.rendezvous(buf, group.group_name)  # collective: maps every peer's buffer here
            ptrs = [handle.get_buffer(r, [buf.numel()], dtype, 0).data_ptr() for r in range(self.world)]
            if ptrs[self.rank] != buf.data_ptr():
                raise RuntimeError("symmetric memory gave this rank's buffer at another address")
            handle.barrier()  # every rank's buffer holds -0.0 before any rank writes into it
            self.lanes[dtype] = Lane(buf, torch.tensor(ptrs, dtype=torch.int64, device=device),
                                     Lane.empty_state(device), numel)
        self.calls = self.add_norm_calls = 0  # host-side calls (eager, or captured in a graph), for tests

    def fits(self, x: torch.Tensor) -> bool:
        """Whether x goes one-shot. Shape and dtype only, so every rank decides alike."""
        return (x.device.type == self.device_type and x.dtype in self.lanes
                and 0 < x.numel() <= self.lanes[x.dtype].numel)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return one_shot_sum(x, self.lanes[x.dtype], self.rank, self.world)

    def add_rmsnorm(self, x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor):
        """One row's sum with the residual add and RMSNorm's first step: (norm_weight * h, h, partials)."""
        self.calls += 1
        self.add_norm_calls += 1
        return one_shot_sum(x, self.lanes[x.dtype], self.rank, self.world,
                            add_norm=(residual.contiguous(), norm_weight))


def create_one_shot_all_reduce(group: dist.ProcessGroup, cpu_group: dist.ProcessGroup,
                               device: torch.device) -> OneShotAllReduce | None:
    """The one-shot path where every rank of the group could set it up, else None (NCCL for every sum).

    The ranks agree through `cpu_group` before anyone uses it, so a rank whose set-up failed cannot leave
    the others waiting in a kernel it never runs."""
    one_shot, why = None, ""
    try:
        one_shot = OneShotAllReduce(group, device)
    except (ImportError, AttributeError, RuntimeError) as e:  # no symm_mem, no peer access, a failed swap
        why = f"{type(e).__name__}: {e}"
    ok = torch.tensor([1 if one_shot is not None else 0], dtype=torch.int64)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=cpu_group)
    if int(ok.item()) == 0:
        logger.warning("one-shot all-reduce unavailable (%s): NCCL for every sum",
                       why or "another rank could not set it up")
        return None
    logger.info("one-shot all-reduce over symmetric memory for sums up to %d KiB", one_shot.max_bytes >> 10)
    return one_shot

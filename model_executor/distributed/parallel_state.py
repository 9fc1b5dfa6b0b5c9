"""Tensor-parallel process-group state: which rank this process is, and the collectives the layers use.

One process per TP rank. `init_tensor_parallel` joins the group (torch.distributed: NCCL for the device
group on CUDA, gloo on CPU) plus a gloo "CPU group" for host-side messages (the scheduler's broadcast of
received requests, the KV-size minimum). At tp 1 nothing is initialised and every helper is a no-op, so
the single-process path runs the same model code with no communication.

The device all-reduce is the custom op `duet::all_reduce`: dynamo (the piecewise runner's tracer) sees one
opaque call that returns a new tensor, and CUDA-graph capture records its kernel inside whichever graph it
runs in (decode graphs and extend pieces alike). On one host with CUDA, sums up to 2 MiB take the one-shot
kernel over peer memory (custom_all_reduce.py), larger ones NCCL.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

if TYPE_CHECKING:  # (its module imports triton: loaded only where a CUDA group sets it up)
    from model_executor.distributed.custom_all_reduce import OneShotAllReduce

logger = logging.getLogger("duet.parallel_state")

DEFAULT_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class TensorParallelInfo:
    rank: int
    size: int


@dataclass
class _GroupState:
    rank: int
    size: int
    device_group: dist.ProcessGroup | None
    cpu_group: dist.ProcessGroup | None
    one_shot: OneShotAllReduce | None = None  # the small sums' kernel; None: NCCL (or gloo) for all


_STATE = _GroupState(rank=0, size=1, device_group=None, cpu_group=None)


def init_tensor_parallel(rank: int, size: int, init_method: str, device: torch.device,
                         timeout_s: float = DEFAULT_TIMEOUT_S, custom_all_reduce: bool = True) -> None:
    """Join the TP group of `size` ranks at `init_method` (tcp://host:port or file://path).

    Every collective, host or device, fails after `timeout_s` instead of hanging on a rank that stopped
    answering. With `custom_all_reduce` on CUDA (every rank on one host), small sums take the one-shot
    kernel. tp 1 initialises nothing."""
    global _STATE
    if size == 1:
        _STATE = _GroupState(rank=0, size=1, device_group=None, cpu_group=None)
        return
    if dist.is_initialized():
        raise RuntimeError("torch.distributed is already initialised in this process")
    if device.type == "cuda" and device.index is None:
        raise ValueError("a tensor-parallel rank needs its own GPU: a device cuda:N, not cuda")
    backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = datetime.timedelta(seconds=timeout_s)
    kwargs = {"device_id": device} if device.type == "cuda" else {}
    dist.init_process_group(backend, init_method=init_method, world_size=size, rank=rank, timeout=timeout,
                            **kwargs)
    device_group = dist.group.WORLD
    cpu_group = dist.new_group(list(range(size)), backend="gloo", timeout=timeout) if backend != "gloo" \
        else device_group
    _STATE = _GroupState(rank=rank, size=size, device_group=device_group, cpu_group=cpu_group)
    if device.type == "cuda":
        # NCCL creates its communicator at the first collective; that must not happen inside a graph capture.
        warm = torch.ones(1, device=device)
        dist.all_reduce(warm, group=device_group)
        torch.cuda.synchronize(device)
        if custom_all_reduce:
            from model_executor.distributed.custom_all_reduce import create_one_shot_all_reduce

            _STATE.one_shot = create_one_shot_all_reduce(device_group, cpu_group, device)
    logger.info("tensor-parallel rank %d of %d (%s) joined at %s", rank, size, backend, init_method)


TEARDOWN_BARRIER = datetime.timedelta(seconds=10)


def destroy_tensor_parallel() -> None:
    """Leave the group. An NCCL group is left to the process's exit instead: destroying one whose
    collectives were captured in CUDA graphs hangs forever (pytorch/pytorch#115388, seen on two H200s even
    after the graphs were dropped), so a process that used NCCL cannot join another group; one that used
    gloo (CPU) can. A gloo group is left once every rank has reached this point, so that no rank closes its
    connections while a peer is still in a collective with it (otherwise a CPU tp 2 rank can abort in its
    teardown: "terminate called without an active exception"). The wait is bounded
    (TEARDOWN_BARRIER): a rank that leaves on an error while its peers still step waits that long at most,
    then leaves all the same, and the peers' next collective fails."""
    global _STATE
    if dist.is_initialized() and dist.get_backend(_STATE.device_group) != "nccl":
        try:
            dist.monitored_barrier(group=_STATE.cpu_group, timeout=TEARDOWN_BARRIER)
        except RuntimeError as e:  # (a peer gone, or still stepping: nothing to wait for)
            logger.warning("tensor-parallel teardown: not every rank reached it (%s); leaving the group",
                           str(e).splitlines()[0])
        dist.destroy_process_group()
    _STATE = _GroupState(rank=0, size=1, device_group=None, cpu_group=None)


def get_tp_rank() -> int:
    return _STATE.rank


def get_tp_size() -> int:
    return _STATE.size


def get_tp_info() -> TensorParallelInfo:
    return TensorParallelInfo(_STATE.rank, _STATE.size)


@contextlib.contextmanager
def shard_as(rank: int, size: int) -> Iterator[None]:
    """Build (and load) layers as rank `rank` of `size` without a process group: for weight-sharding
    checks and tests. Collectives must not run inside (there is no group)."""
    global _STATE
    saved = _STATE
    _STATE = _GroupState(rank=rank, size=size, device_group=None, cpu_group=None)
    try:
        yield
    finally:
        _STATE = saved


def heads_per_rank(num_heads: int, tp_size: int) -> int:
    if num_heads % tp_size:
        raise ValueError(f"{num_heads} attention heads cannot be split over {tp_size} tensor-parallel ranks")
    return num_heads // tp_size


def kv_heads_per_rank(num_kv_heads: int, tp_size: int) -> int:
    """KV heads held by one rank: a share of them, or one (replicated) when there are more ranks than heads."""
    if tp_size >= num_kv_heads:
        if tp_size % num_kv_heads:
            raise ValueError(f"{num_kv_heads} KV heads cannot be replicated evenly over {tp_size} ranks")
        return 1
    if num_kv_heads % tp_size:
        raise ValueError(f"{num_kv_heads} KV heads cannot be split over {tp_size} tensor-parallel ranks")
    return num_kv_heads // tp_size


def kv_head_start(num_kv_heads: int, tp_rank: int, tp_size: int) -> int:
    """Index of the first KV head rank `tp_rank` holds (replicated heads: every tp_size/num_kv_heads ranks
    share one)."""
    if tp_size >= num_kv_heads:
        return tp_rank // (tp_size // num_kv_heads)
    return tp_rank * (num_kv_heads // tp_size)


# ---- device collectives (the model's forward) -----------------------------------------------------


def describe_all_reduce() -> str:
    """The device sum's path, for start-up lines and benchmark reports."""
    if _STATE.size == 1:
        return "none (tp 1)"
    if _STATE.one_shot is not None:
        return f"one-shot up to {_STATE.one_shot.max_bytes >> 10} KiB, NCCL above"
    return dist.get_backend(_STATE.device_group)


def one_shot_calls(add_norm: bool = False) -> int | None:
    """Sums the one-shot kernel took (eager or captured; add_norm: those with the residual add and the norm's
    sums); None where it is not set up."""
    if _STATE.one_shot is None:
        return None
    return _STATE.one_shot.add_norm_calls if add_norm else _STATE.one_shot.calls


def _all_reduce_impl(x: torch.Tensor) -> torch.Tensor:
    if _STATE.one_shot is not None and _STATE.one_shot.fits(x):
        return _STATE.one_shot(x)
    out = x.clone()
    dist.all_reduce(out, group=_STATE.device_group)
    return out


_all_reduce_op = torch.library.custom_op("duet::all_reduce", _all_reduce_impl, mutates_args=())


@_all_reduce_op.register_fake
def _(x):
    return torch.empty_like(x)


def can_all_reduce_add_rmsnorm(x: torch.Tensor) -> bool:
    """Whether all_reduce_add_rmsnorm takes x (one row the one-shot kernel sums; not while dynamo traces)."""
    return (_STATE.one_shot is not None and not torch.compiler.is_compiling() and x.numel() == x.shape[-1]
            and _STATE.one_shot.fits(x))


def all_reduce_add_rmsnorm(x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor):
    """For one row x that can_all_reduce_add_rmsnorm takes: h = the sum of x over the group + residual, in
    one kernel with what RMSNorm(h) needs first: (norm_weight * h, h, float32 sums of h^2 by chunk)."""
    return _STATE.one_shot.add_rmsnorm(x, residual, norm_weight)


def tensor_model_parallel_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum over the TP group (the row-parallel layers' partial outputs); x itself at tp 1."""
    if _STATE.size == 1:
        return x
    return torch.ops.duet.all_reduce(x)


def _all_gather_impl(x: torch.Tensor) -> torch.Tensor:
    x = x.contiguous()
    out = torch.empty((_STATE.size * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    dist.all_gather_into_tensor(out, x, group=_STATE.device_group)
    return out


_all_gather_op = torch.library.custom_op("duet::all_gather", _all_gather_impl, mutates_args=())


@_all_gather_op.register_fake
def _(x):
    return x.new_empty((_STATE.size * x.shape[0], *x.shape[1:]))


def tensor_model_parallel_all_gather(x: torch.Tensor) -> torch.Tensor:
    """[n, d] on each rank -> [n, size * d]: rank r's columns at r * d (the vocab-parallel logits)."""
    if _STATE.size == 1:
        return x
    if x.device.type == "cpu":  # gloo has no all_gather_into_tensor
        parts = [torch.empty_like(x) for _ in range(_STATE.size)]
        dist.all_gather(parts, x.contiguous(), group=_STATE.device_group)
        return torch.cat(parts, dim=-1)
    return rank_major_to_columns(torch.ops.duet.all_gather(x), _STATE.size)


def rank_major_to_columns(gathered: torch.Tensor, size: int) -> torch.Tensor:
    """all_gather_into_tensor's [size * n, d] (rank r's rows at r * n) -> [n, size * d] (its columns at r * d)."""
    n, d = gathered.shape[0] // size, gathered.shape[1]
    return gathered.view(size, n, d).transpose(0, 1).reshape(n, size * d)


def broadcast_from_rank0(x: torch.Tensor) -> torch.Tensor:
    """Rank 0's tensor on every rank, in place (the sampled token ids)."""
    if _STATE.size > 1:
        dist.broadcast(x, src=0, group=_STATE.device_group)
    return x


# ---- host collectives (the scheduler) -------------------------------------------------------------


def broadcast_object(obj=None):
    """Rank 0's picklable object on every rank (the scheduler's received messages)."""
    if _STATE.size == 1:
        return obj
    box = [obj if _STATE.rank == 0 else None]
    dist.broadcast_object_list(box, src=0, group=_STATE.cpu_group)
    return box[0]


def all_reduce_min_int(value: int) -> int:
    """The minimum of an integer over the TP group (the KV-cache size every rank can hold)."""
    if _STATE.size == 1:
        return value
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=_STATE.cpu_group)
    return int(t.item())

"""The one-shot all-reduce's dispatch, without a GPU: which sums take it (shape and dtype only, so every
rank decides alike), that parallel_state routes them there and the rest to the process group, that the
ranks agree to fall back together when one of them could not set it up, and the flag that turns it off.
The kernel itself runs in tests/gpu/test_custom_all_reduce_gpu.py (two GPUs)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest
import torch

from model_executor.distributed import custom_all_reduce as car
from model_executor.distributed import parallel_state as ps


class FakeOneShot(car.OneShotAllReduce):
    """The real `fits`, on CPU tensors, with buffers of max_bytes; calls recorded instead of summed."""

    def __init__(self, max_bytes: int = 1024):
        self.device_type, self.max_bytes, self.calls = "cpu", max_bytes, 0
        self.buffers = {dt: torch.empty(max_bytes // dt.itemsize, dtype=dt) for dt in car.DTYPES}
        self.seen: list[tuple[int, ...]] = []

    def __call__(self, x):
        self.calls += 1
        self.seen.append(tuple(x.shape))
        return x * 2  # what a two-rank sum of equal inputs gives


@pytest.mark.parametrize("shape, dtype, fits", [
    ((1, 256), torch.bfloat16, True),       # 512 bytes
    ((2, 256), torch.bfloat16, True),       # 1024: the whole buffer
    ((3, 256), torch.bfloat16, False),      # 1536: larger than the buffer
    ((1, 128), torch.float32, True),
    ((1, 260), torch.bfloat16, False),      # 520 bytes: not a 16-byte multiple
    ((4, 64), torch.float16, False),        # a dtype the kernel does not sum
    ((0, 256), torch.bfloat16, False),
])
def test_fits_depends_on_size_and_dtype(shape, dtype, fits):
    assert FakeOneShot().fits(torch.zeros(shape, dtype=dtype)) is fits


def test_fits_refuses_another_device_type():
    assert not FakeOneShot().fits(torch.zeros(1, 256, dtype=torch.bfloat16, device="meta"))


def test_small_sums_go_one_shot_and_large_ones_to_the_group(monkeypatch):
    fake = FakeOneShot()
    sent = []
    monkeypatch.setattr(ps, "_STATE", ps._GroupState(rank=0, size=2, device_group=None, cpu_group=None,
                                                    one_shot=fake))
    monkeypatch.setattr(ps.dist, "all_reduce", lambda t, group=None: sent.append(tuple(t.shape)))
    small, large = torch.ones(2, 256, dtype=torch.bfloat16), torch.ones(8, 256, dtype=torch.bfloat16)
    assert torch.equal(ps._all_reduce_impl(small), small * 2)
    out = ps._all_reduce_impl(large)
    assert fake.seen == [(2, 256)] and sent == [(8, 256)]
    assert out.data_ptr() != large.data_ptr()  # the group's path sums a copy, never the caller's tensor
    assert ps.one_shot_calls() == 1 and "one-shot up to 1 KiB" in ps.describe_all_reduce()
    monkeypatch.setattr(ps, "_STATE", ps._GroupState(rank=0, size=2, device_group=None, cpu_group=None))
    ps._all_reduce_impl(small)
    assert sent == [(8, 256), (2, 256)] and ps.one_shot_calls() is None


def _agree_rank(rank: int, init: str, fail_rank: int, out_dir: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=init, world_size=2, rank=rank)

    def build(group, device):
        if rank == fail_rank:
            raise RuntimeError("no peer access")
        return FakeOneShot()

    car.OneShotAllReduce = build  # this rank's stand-in for the symmetric-memory set-up
    got = car.create_one_shot_all_reduce(dist.group.WORLD, dist.group.WORLD, torch.device("cpu"))
    with open(os.path.join(out_dir, f"rank{rank}"), "w") as f:
        f.write("one-shot" if got is not None else "none")
    dist.destroy_process_group()


@pytest.mark.parametrize("fail_rank", [1, -1])
def test_ranks_fall_back_together_when_one_cannot_set_up(fail_rank):
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as d:
        mp.spawn(_agree_rank, args=(f"file://{d}/init", fail_rank, d), nprocs=2, join=True)
        got = [Path(d, f"rank{r}").read_text() for r in range(2)]
    assert got == (["none", "none"] if fail_rank >= 0 else ["one-shot", "one-shot"])


@pytest.mark.parametrize("argv, expected", [
    ([], True),
    (["--disable-custom-all-reduce"], False),
    (["--nnodes", "2", "--tp-size", "2", "--dist-init-addr", "h:1"], False),  # peer memory is one host's
])
def test_the_flag_reaches_the_runner(argv, expected):
    from scheduler.scheduler_process import runner_config
    from server.args import ServerArgs, build_parser
    from server.parallel import plan_ranks

    args = ServerArgs(**vars(build_parser().parse_args(["--device", "cpu", "--tp-size", "2", *argv])))
    assert runner_config(args, plan_ranks(args)[0]).custom_all_reduce is expected

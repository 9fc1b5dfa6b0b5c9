"""The one-shot all-reduce without a GPU: its kernel's protocol in Triton's interpreter (rank 0 of two,
the peer's writes staged by hand), which sums take it (shape and dtype only, so every rank decides alike),
that parallel_state routes them there and the rest to the process group, that the ranks agree to fall back
together when one of them could not set it up, and the flag that turns it off. Two real ranks run it in
tests/parallel/test_custom_all_reduce_gpu.py."""

from __future__ import annotations

import os
import tempfile
import threading
from pathlib import Path

import pytest
import torch

from model_executor.distributed import custom_all_reduce as car
from model_executor.distributed import parallel_state as ps
from tests import triton_mode
from tests.triton_mode import HAS_CUDA, in_process

test_in_subprocess = triton_mode.subprocess_test(__file__)


class FakeOneShot(car.OneShotAllReduce):
    """The real `fits`, on CPU tensors, with lanes of max_bytes; calls recorded instead of summed."""

    def __init__(self, max_bytes: int = 1024):
        self.device_type, self.max_bytes, self.calls = "cpu", max_bytes, 0
        self.lanes = {dt: car.Lane(torch.empty(0, dtype=dt), torch.empty(0), torch.empty(0), max_bytes // dt.itemsize)
                      for dt in car.DTYPES}
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
    ((1, 260), torch.float16, True),        # any size up to the buffer, any alignment
    ((4, 64), torch.int32, False),          # a dtype the kernel does not sum
    ((0, 256), torch.bfloat16, False),
])
def test_fits_depends_on_size_and_dtype(shape, dtype, fits):
    assert FakeOneShot().fits(torch.zeros(shape, dtype=dtype)) is fits


NEG_ZERO_BITS = {2: -(1 << 15), 4: -(1 << 31)}


def _is_neg_zero(t: torch.Tensor) -> torch.Tensor:
    ints = t.view(torch.int16 if t.element_size() == 2 else torch.int32)
    return ints == NEG_ZERO_BITS[t.element_size()]


def _run_with_deadline(fn, seconds: float = 120.0):
    """fn() in a thread: a kernel that waits for data that never comes fails the test instead of hanging it."""
    box = {}
    t = threading.Thread(target=lambda: box.setdefault("out", fn()), daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), "the one-shot kernel is still waiting for a peer's data"
    return box["out"]


@in_process
@pytest.mark.skipif(HAS_CUDA, reason="CPU buffers stand in for peer memory: interpreter only (GPU: *_gpu.py)")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_kernel_sums_rotates_its_slots_and_clears_what_it_read(dtype):
    """Rank 0 of two. Before each call the peer's input is written into rank 0's buffer (what the peer's
    kernel would have sent); the call must send rank 0's input into the peer's buffer, return the sum
    rounded once, move the slot on and set the previous call's slot back to -0.0 as far as it was filled
    (a larger earlier call included), and never send -0.0 (the "not arrived" mark)."""
    world, lane_numel = 2, 2500
    mine = torch.full((car.SLOTS * world * lane_numel,), -0.0, dtype=dtype)
    peer = torch.full_like(mine, -0.0)
    assert _is_neg_zero(mine).all()
    lane = car.Lane(mine, torch.tensor([mine.data_ptr(), peer.data_ptr()]), car.Lane.empty_state("cpu"), lane_numel)
    region = lambda buf, slot, rank, n: buf.view(car.SLOTS, world, lane_numel)[slot, rank, :n]
    gen = torch.Generator().manual_seed(0)
    for call, n in enumerate([2500, 5, 1030, 7, 2048, 3]):  # several chunks, one, the whole lane
        slot = int(lane.state[0])
        assert slot == call % car.SLOTS
        x, theirs = (torch.randn(n, generator=gen).to(dtype) for _ in range(2))
        x[0], theirs[-1] = -0.0, 0.0
        region(mine, slot, 1, n).copy_(theirs)
        out = _run_with_deadline(lambda x=x: car.one_shot_sum(x, lane, rank=0, world=world))
        # the sum in float32, rounded once (to nearest on a GPU; the interpreter truncates to bf16: 1 ulp)
        torch.testing.assert_close(out.float(), (x.float() + theirs.float()).to(dtype).float(), atol=0,
                                   rtol=0 if dtype == torch.float32 else 2**-7)
        sent = region(peer, slot, 0, n)
        assert torch.equal(sent, x) and not _is_neg_zero(sent).any()  # -0.0 went out as +0.0
        assert lane.state.tolist()[:2] == [(slot + 1) % car.SLOTS, 0] and int(lane.state[2 + slot]) == n
        prev = (slot - 1) % car.SLOTS
        assert _is_neg_zero(mine.view(car.SLOTS, world, lane_numel)[prev, 1]).all(), (call, prev)


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
    from server.args import ServerArgs, build_parser
    from server.parallel import plan_ranks
    from server.scheduler_entry import runner_config

    args = ServerArgs(**vars(build_parser().parse_args(["--device", "cpu", "--tp-size", "2", *argv])))
    assert runner_config(args, plan_ranks(args)[0]).custom_all_reduce is expected


@in_process
@pytest.mark.skipif(HAS_CUDA, reason="CPU buffers stand in for peer memory: interpreter only (GPU: *_gpu.py)")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_kernel_adds_the_residual_and_prepares_the_norm(dtype):
    """ADD_NORM (one row, what the gate/up GEMV after it reads as a PrenormedRow): h = the sum, rounded,
    plus the residual; out = norm weight * h; one float32 sum of h^2 per chunk. The sum itself goes out to
    the peer as in a plain call."""
    world, lane_numel, n = 2, 4096, 3000
    mine = torch.full((car.SLOTS * world * lane_numel,), -0.0, dtype=dtype)
    peer = torch.full_like(mine, -0.0)
    lane = car.Lane(mine, torch.tensor([mine.data_ptr(), peer.data_ptr()]), car.Lane.empty_state("cpu"), lane_numel)
    gen = torch.Generator().manual_seed(1)
    x, theirs, residual = (torch.randn(1, n, generator=gen).to(dtype) for _ in range(3))
    weight = torch.rand(n, generator=gen).to(dtype) + 0.5
    mine.view(car.SLOTS, world, lane_numel)[0, 1, :n].copy_(theirs.view(-1))
    block, _ = car.tile_for(n * x.element_size())
    weighted, h, partials = _run_with_deadline(lambda: car.one_shot_sum(x, lane, 0, world,
                                                                        add_norm=(residual, weight)))
    s = (x.float() + theirs.float()).to(dtype)
    want_h = (s.float() + residual.float()).to(dtype)
    # float32 exact; bf16 within the interpreter's truncating roundings (a dropped residual or weight is O(1))
    tol = {"atol": 0, "rtol": 0} if dtype == torch.float32 else {"atol": 0.05, "rtol": 2**-6}
    torch.testing.assert_close(h.float(), want_h.float(), **tol)
    torch.testing.assert_close(weighted.float(), (h.float() * weight.float()).to(dtype).float(), **tol)
    chunks = h.float().view(-1).split(block)
    assert partials.shape == (len(chunks),) and partials.dtype == torch.float32
    torch.testing.assert_close(partials, torch.stack([(c * c).sum() for c in chunks]), rtol=1e-5, atol=0)
    assert torch.equal(peer.view(car.SLOTS, world, lane_numel)[0, 0, :n], x.view(-1))
    assert lane.state.tolist()[:2] == [1, 0]


def test_o_proj_hands_its_partial_sum_to_the_add_norm_kernel_at_tp2(monkeypatch):
    """linear.all_reduce_add_rmsnorm: at tp 2 the row's partial o_proj output goes to the sum's kernel with
    the residual and the norm weight, and its (weighted, h, partials) become the consumer's PrenormedRow;
    at tp 1, or where the consumer's GEMV is not the small-M kernel's, or the sum cannot take the row, the
    caller's separate path runs (None)."""
    from model_executor.layers import linear as lin
    from model_executor.layers.norm import RMSNorm

    with ps.shard_as(0, 2):
        o_proj = lin.RowParallelLinear(8, 4)
        gate_up = lin.MergedColumnParallelLinear(4, [6, 6])
    with ps.shard_as(0, 1):
        o_proj_tp1 = lin.RowParallelLinear(8, 4)
    norm = RMSNorm(4, eps=1e-5)
    torch.nn.init.normal_(norm.weight)
    x, residual = torch.randn(1, 4), torch.randn(1, 4)
    sent = []

    def fake_sum(y, res, weight):  # the peer sent the same partial sum
        sent.append((y, res, weight))
        h = 2 * y + res
        return weight * h, h, (h * h).sum().reshape(1)

    monkeypatch.setattr(ps, "can_all_reduce_add_rmsnorm", lambda t: True)
    monkeypatch.setattr(ps, "all_reduce_add_rmsnorm", fake_sum)
    monkeypatch.setattr(lin, "small_m_kernel", lambda *a: object())
    row, h = lin.all_reduce_add_rmsnorm(o_proj, x, residual, norm, gate_up)
    y = o_proj.quant_method.apply(o_proj, x)
    assert torch.equal(sent[0][0], y) and sent[0][1] is residual and sent[0][2] is norm.weight
    assert torch.equal(h, 2 * y + residual) and torch.equal(row.weighted, norm.weight * h) and row.eps == 1e-5
    assert lin.all_reduce_add_rmsnorm(o_proj_tp1, x, residual, norm, gate_up) is None
    monkeypatch.setattr(lin, "small_m_kernel", lambda *a: None)
    assert lin.all_reduce_add_rmsnorm(o_proj, x, residual, norm, gate_up) is None
    monkeypatch.setattr(lin, "small_m_kernel", lambda *a: object())
    monkeypatch.setattr(ps, "can_all_reduce_add_rmsnorm", lambda t: False)
    assert lin.all_reduce_add_rmsnorm(o_proj, x, residual, norm, gate_up) is None
    assert len(sent) == 1

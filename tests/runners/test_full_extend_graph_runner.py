"""Whole-backbone extend graphs (runners/full_extend_graph_runner.py) on the CPU: the triton backend's extend
kernel in Triton's interpreter, inside the stand-in graph, which replays with the static batch's and the
backend's host state frozen at capture as a CUDA graph would. Replay equals eager (logits and the KV it
stores) at captured and padded sizes, with cached prefixes, with fewer requests than the last replay left in
the buffers; capture order; what goes to the piecewise runner instead."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from model_executor.forward_batch import ForwardMode
from runners.full_extend_graph_runner import FullExtendGraphRunner
from runners.graph_seam import StandInCapturer
from runners.model_runner import ModelRunner, RunnerConfig
from tests import triton_mode
from tests.runners.test_cuda_graph_runner import make_triton_runner
from tests.runners.test_piecewise_runner import make_extend_batch, release
from tests.triton_mode import DEVICE, in_process

LEVELS = [4, 8, 16, 32]
MAX_REQUESTS = 3

test_in_subprocess = triton_mode.subprocess_test(__file__)


@pytest.fixture(scope="module")
def runner(tiny_llama):
    return make_triton_runner(tiny_llama[0], max_total_tokens=1024)


@pytest.fixture(scope="module")
def graphs(runner):
    return FullExtendGraphRunner(runner, LEVELS, max_requests=MAX_REQUESTS, capturer=StandInCapturer())


@pytest.fixture
def extend_batch(runner):
    """make(ext_lens, prefix_lens, seed) -> (extend batch, its new slots); rows and slots go back after the test."""
    made = []

    def make(ext_lens, prefix_lens, seed):
        fb, rows = make_extend_batch(runner, ext_lens, prefix_lens, seed)
        made.append((rows, fb))
        return fb, fb.out_cache_loc

    yield make
    for rows, fb in made:
        release(runner, rows, fb)


def _kv(runner) -> list[torch.Tensor]:
    return [buf.clone() for buf in runner.kv_cache.k_buffers + runner.kv_cache.v_buffers]


def assert_replay_equals_eager(runner, graphs, fb, loc) -> None:
    """Logits of the replay against eager (float32; eager runs the real token count, the graph the level), the
    K/V the replay stores at the batch's slots against eager's, and no other slot written."""
    kv_before = _kv(runner)
    eager = runner.forward_eager(fb).clone()
    kv_eager = _kv(runner)
    real = loc.to(DEVICE)
    for buf in runner.kv_cache.k_buffers + runner.kv_cache.v_buffers:
        buf[real] = float("nan")  # the replay must write them again
    graphed = graphs.replay(fb)
    assert graphed.shape == eager.shape
    torch.testing.assert_close(graphed, eager, rtol=1e-4, atol=1e-4)
    untouched = torch.ones(kv_before[0].shape[0], dtype=torch.bool, device=DEVICE)
    untouched[real] = False
    for after, ref, before in zip(_kv(runner), kv_eager, kv_before):
        torch.testing.assert_close(after[real], ref[real], rtol=1e-5, atol=1e-5)
        assert torch.equal(after[untouched], before[untouched])


CASES = {  # (new tokens per request, cached prefix per request)
    "one_on_level": ([8], [0]),
    "one_between_levels": ([5], [0]),
    "one_at_max": ([32], [0]),
    "one_on_a_prefix": ([11], [9]),
    "several_with_prefixes": ([4, 9, 3], [6, 0, 13]),
    "two_padded": ([1, 2], [3, 0]),
}


@in_process
@pytest.mark.parametrize("case", list(CASES))
def test_replay_equals_eager(runner, graphs, extend_batch, case):
    ext, pre = CASES[case]
    fb, loc = extend_batch(ext, pre, seed=len(case))
    assert graphs.can_run(fb)
    assert_replay_equals_eager(runner, graphs, fb, loc)


@in_process
def test_fewer_requests_than_the_last_replay_left(runner, graphs, extend_batch):
    """Rows past the batch must get no new tokens: the previous replay's lengths and starts are still in the
    buffers, and its requests' programs would write over this batch's outputs and into their old slots."""
    fb, loc = extend_batch([5, 4, 6], [0, 2, 0], seed=1)
    graphs.replay(fb)
    fb, loc = extend_batch([9, 4], [0, 0], seed=2)
    assert graphs.key(fb) == (16, MAX_REQUESTS)  # the graph of the first batch, with a row to spare
    assert graphs.buffers.extend_seq_lens[2].item() == 6  # stale from the first batch
    assert_replay_equals_eager(runner, graphs, fb, loc)


@in_process
def test_capture_largest_first_at_each_level(runner):
    order = []

    class Recorder(StandInCapturer):
        def capture(self, fn, host_state=()):
            shapes = []
            hook = runner.model.model.register_forward_pre_hook(lambda _m, args: shapes.append(args[0].shape[0]))
            try:
                return super().capture(fn, host_state)
            finally:
                hook.remove()
                order.append(shapes)

    graphs = FullExtendGraphRunner(runner, LEVELS, max_requests=MAX_REQUESTS, capturer=Recorder())
    assert order == [[level] for level in sorted(LEVELS, reverse=True) for _ in range(2)]
    keys = [(level, rows) for level in LEVELS for rows in (1, MAX_REQUESTS)]
    assert sorted(graphs.graphs) == keys
    assert [graphs.static_batches[key].batch_size for key in keys] == [key[1] for key in keys]
    assert [graphs.static_batches[key].max_extend_len for key in keys] == [key[0] for key in keys]
    # A level below the row count holds only as many rows as tokens.
    assert sorted(FullExtendGraphRunner(runner, [2], max_requests=MAX_REQUESTS).graphs) == [(2, 1), (2, 2)]


@in_process
@pytest.mark.parametrize("ext,key", [([5], (8, 1)), ([8], (8, 1)), ([2, 3], (8, MAX_REQUESTS)),
                                     ([20, 1, 1], (32, MAX_REQUESTS))])
def test_replay_takes_the_graph_of_its_level_and_rows(runner, graphs, extend_batch, monkeypatch, ext, key):
    replayed = []
    for k, graph in graphs.graphs.items():
        monkeypatch.setattr(graph, "replay", lambda k=k, replay=graph.replay: (replayed.append(k), replay()))
    fb, loc = extend_batch(ext, [0] * len(ext), seed=7)
    assert_replay_equals_eager(runner, graphs, fb, loc)
    assert replayed == [key]


@in_process
def test_what_goes_elsewhere(runner, graphs, extend_batch):
    """Above the largest level or above the request rows: not this runner; decode batches never."""
    fb, _ = extend_batch([33], [0], seed=3)
    assert not graphs.can_run(fb)
    fb, _ = extend_batch([1, 1, 1, 1], [0, 0, 0, 0], seed=4)
    assert not graphs.can_run(fb)
    assert not graphs.can_run(SimpleNamespace(mode=ForwardMode.DECODE, num_tokens=1, batch_size=1))


def test_model_runner_builds_it_only_where_the_backend_can(tiny_llama, monkeypatch):
    """On the GPU path with piecewise levels: whole graphs at the levels up to the max, sharing the pieces'
    capturer; a backend whose extend attention cannot be captured gets none (the pieces still run)."""
    from runners import model_runner as mr

    built = {}

    class FakePiecewise:
        def __init__(self, runner, levels):
            self.levels, self.capturer = sorted({max(2, t) for t in levels}), object()  # (as the real one)

    class FakeFull:
        def __init__(self, runner, levels, capturer):
            built.update(levels=levels, capturer=capturer)

    monkeypatch.setattr("runners.piecewise_cuda_graph_runner.PiecewiseCudaGraphRunner", FakePiecewise)
    monkeypatch.setattr("runners.full_extend_graph_runner.FullExtendGraphRunner", FakeFull)
    runner = ModelRunner(RunnerConfig(model_path=str(tiny_llama[0]), max_running_requests=4, max_total_tokens=256,
                                      disable_cuda_graph=True, disable_piecewise_cuda_graph=True))
    runner.device = torch.device("cuda")  # init_graph_runners only; nothing is allocated on it
    runner.config = mr.replace(runner.config, disable_piecewise_cuda_graph=False,
                               piecewise_cuda_graph_tokens=(1, 2, 4, 8, 16, 32), full_extend_graph_max_tokens=16)
    runner.attn_backend.supports_extend_cuda_graph = True
    runner.init_graph_runners()
    # the whole graphs get the list's level 1, which the pieces serve at 2 (a one-token extend then runs the
    # one-row GEMMs eager runs)
    assert built["levels"] == [1, 2, 4, 8, 16] and built["capturer"] is runner.extend_graph_runner.capturer
    built.clear()
    runner.full_extend_graph_runner = None
    runner.attn_backend.supports_extend_cuda_graph = False
    runner.init_graph_runners()
    assert not built and runner.full_extend_graph_runner is None
    assert isinstance(runner.extend_graph_runner, FakePiecewise)


@in_process
def test_model_runner_takes_the_whole_graph_first(runner, graphs, extend_batch):
    runner.full_extend_graph_runner = graphs
    try:
        fb, _ = extend_batch([6], [0], seed=5)
        graph_before, replays = runner.path_counts["extend_graph"], graphs.replays
        runner.forward(fb)
        assert graphs.replays == replays + 1 and runner.path_counts["extend_graph"] == graph_before + 1
        fb, _ = extend_batch([1, 1, 1, 1], [0, 0, 0, 0], seed=6)
        eager_before = runner.path_counts["extend_eager"]
        runner.forward(fb)  # more requests than rows, and no pieces in this runner: eager
        assert graphs.replays == replays + 1 and runner.path_counts["extend_eager"] == eager_before + 1
    finally:
        runner.full_extend_graph_runner = None

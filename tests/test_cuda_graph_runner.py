"""Decode graph runner logic on the CPU through the stand-in graph: capture order, bisect, padding, slicing."""

from __future__ import annotations

import pytest
import torch

from model_executor.forward_batch import ForwardMode
from runners.model_runner import ModelRunner, RunnerConfig
from runners.capture_lists import get_batch_sizes_to_capture, pick_size
from runners.cuda_graph_runner import CudaGraphRunner
from runners.graph_seam import StandInCapturer

GiB = 1024**3


def test_default_capture_list():
    sizes = get_batch_sizes_to_capture(256)
    assert sizes[:8] == [1, 2, 4, 8, 12, 16, 24, 32]
    assert sizes[-1] == 256 and len(sizes) == 36
    big = get_batch_sizes_to_capture(512)
    assert big[36:44] == [272, 288, 304, 320, 336, 352, 368, 384] and big[-2:] == [480, 496, 512][-2:]
    assert 496 in big and 512 in big and 504 not in big
    assert get_batch_sizes_to_capture(10) == [1, 2, 4, 8]


def test_default_max_bs_from_memory():
    assert get_batch_sizes_to_capture(None, gpu_memory_bytes=16 * GiB)[-1] == 8
    assert get_batch_sizes_to_capture(None, gpu_memory_bytes=24 * GiB)[-1] == 24
    assert get_batch_sizes_to_capture(None, gpu_memory_bytes=40 * GiB)[-1] == 32
    assert get_batch_sizes_to_capture(None, gpu_memory_bytes=80 * GiB)[-1] == 256
    assert get_batch_sizes_to_capture(None, gpu_memory_bytes=141 * GiB)[-1] == 256
    assert get_batch_sizes_to_capture(None, gpu_memory_bytes=180 * GiB)[-1] == 512


def test_explicit_list_and_max_running_cut():
    assert get_batch_sizes_to_capture(256, (16, 1, 4, 2, 8)) == [1, 2, 4, 8, 16]
    assert get_batch_sizes_to_capture(None, (3, 1, 7)) == [1, 3, 7]
    assert get_batch_sizes_to_capture(256, None, max_running_requests=20) == [1, 2, 4, 8, 12, 16]
    assert get_batch_sizes_to_capture(None, (1, 2, 64), max_running_requests=32) == [1, 2]


def test_pick_size_bisects():
    sizes = [1, 2, 4, 8, 12, 16]
    assert [pick_size(sizes, n) for n in (1, 2, 3, 5, 8, 9, 13, 16, 17)] == [1, 2, 4, 8, 8, 12, 16, 16, None]


SIZES = [1, 2, 4, 8, 12, 16]


@pytest.fixture(scope="module")
def runner(tiny_llama):
    return ModelRunner(RunnerConfig(model_path=str(tiny_llama[0]), max_running_requests=20, max_total_tokens=2048))


def make_decode_batch(runner: ModelRunner, bs: int, seed: int):
    """bs requests with random prompts prefilled eagerly; returns the decode batch of their next token."""
    g = torch.Generator().manual_seed(seed)
    rows, seq_lens, last = [], [], []
    for _ in range(bs):
        n = int(torch.randint(2, 30, (1,), generator=g))
        ids = torch.randint(3, 320, (n,), generator=g).tolist()
        row = runner.req_to_token_pool.alloc()
        loc = runner.allocator.alloc(n)
        runner.req_to_token_pool.write(row, 0, loc)
        runner.forward_eager(runner.build_batch(ForwardMode.EXTEND, ids, [row], [n], loc, extend_seq_lens=[n]))
        rows.append(row)
        seq_lens.append(n + 1)
        last.append(ids[-1])
    loc = runner.allocator.alloc(bs)
    for i, row in enumerate(rows):
        runner.req_to_token_pool.write(row, seq_lens[i] - 1, loc[i : i + 1])
    fb = runner.build_batch(ForwardMode.DECODE, last, rows, seq_lens, loc)
    return fb, rows, loc


def release(runner, rows, fb):
    for row, n in zip(rows, fb.seq_lens_cpu):
        runner.allocator.free(runner.req_to_token_pool.req_to_token[row, :n].long())
        runner.req_to_token_pool.free(row)


def test_capture_largest_first(runner):
    order = []

    class Capturer(StandInCapturer):
        def capture(self, fn):
            order.append(cr_sizes.pop())
            return super().capture(fn)

    cr_sizes = sorted(SIZES)  # pops the largest first if capture goes largest first
    expected = sorted(SIZES, reverse=True)
    CudaGraphRunner(runner, SIZES, capturer=Capturer())
    assert order == expected


@pytest.mark.parametrize("bs", SIZES + [3, 5, 13, max(SIZES) - 1])
def test_replay_equals_eager(runner, bs):
    graph_runner = CudaGraphRunner(runner, SIZES, capturer=StandInCapturer())
    fb, rows, loc = make_decode_batch(runner, bs, seed=bs)
    eager = runner.forward_eager(fb).clone()
    k_eager = runner.kv_cache.k_buffers[0].clone()
    assert graph_runner.can_run(fb)
    graphed = graph_runner.replay(fb)
    assert graphed.shape == eager.shape
    torch.testing.assert_close(graphed, eager, rtol=1e-5, atol=1e-5)
    assert torch.equal(graphed.argmax(-1), eager.argmax(-1))
    # Padding rows wrote only slot 0: every real slot holds exactly what the eager pass wrote.
    assert torch.equal(runner.kv_cache.k_buffers[0][1:], k_eager[1:])
    release(runner, rows, fb)


def test_eager_fallback_above_max_bs(runner):
    graph_runner = CudaGraphRunner(runner, [1, 2, 4], capturer=StandInCapturer())
    runner.decode_graph_runner = graph_runner
    try:
        fb, rows, _ = make_decode_batch(runner, 5, seed=7)
        assert not graph_runner.can_run(fb)
        before = dict(runner.path_counts)
        runner.forward(fb)
        assert runner.path_counts["decode_eager"] == before.get("decode_eager", 0) + 1
        release(runner, rows, fb)
        fb, rows, _ = make_decode_batch(runner, 3, seed=8)
        runner.forward(fb)
        assert runner.path_counts["decode_graph"] == before.get("decode_graph", 0) + 1
        release(runner, rows, fb)
        # Extend batches never take the decode graph.
        ext = runner.build_batch(ForwardMode.EXTEND, [5, 6], [1], [2], torch.tensor([1, 2]), extend_seq_lens=[2])
        assert not graph_runner.can_run(ext)
    finally:
        runner.decode_graph_runner = None


def test_padding_rows_point_at_slot_zero(runner):
    graph_runner = CudaGraphRunner(runner, [4], capturer=StandInCapturer())
    fb, rows, loc = make_decode_batch(runner, 3, seed=11)
    graph_runner.replay(fb)
    b = graph_runner.buffers
    assert b.out_cache_loc[3].item() == 0 and b.req_pool_indices[3].item() == 0
    assert b.seq_lens[3].item() == runner.attn_backend.get_cuda_graph_seq_len_fill_value()
    assert torch.equal(b.out_cache_loc[:3], loc)
    assert torch.all(runner.req_to_token_pool.req_to_token[0] == 0)
    release(runner, rows, fb)

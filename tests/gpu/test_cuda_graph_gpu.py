"""Decode CUDA graphs on the GPU: replay equals eager at every captured and padded size; the shared pool."""

from __future__ import annotations

import pytest
import torch

from model_executor.configs import shape_path
from runners.model_runner import ModelRunner, RunnerConfig
from runners.capture_lists import get_batch_sizes_to_capture
from runners.cuda_graph_runner import CudaGraphRunner
from runners.graph_seam import CudaGraphCapturer

pytestmark = pytest.mark.gpu

SIZES = [1, 2, 4, 8, 12, 16, 24, 32]


@pytest.fixture(scope="module")
def runner():
    cfg = RunnerConfig(model_path=str(shape_path("smollm2-135m")), device="cuda", attention_backend="triton",
                       max_running_requests=64, max_total_tokens=64 * 300, context_length=512,
                       random_weights=True, disable_cuda_graph=True, disable_piecewise_cuda_graph=True)
    return ModelRunner(cfg)


def _decode_batch(runner, bs, seed):
    from tests.test_cuda_graph_runner import make_decode_batch

    return make_decode_batch(runner, bs, seed)


@pytest.fixture(scope="module")
def graph_runner(runner):
    return CudaGraphRunner(runner, SIZES)


@pytest.mark.parametrize("bs", SIZES + [3, 5, 13, 31])
def test_graph_replay_equals_eager(runner, graph_runner, bs):
    from tests.test_cuda_graph_runner import release

    fb, rows, loc = _decode_batch(runner, bs, seed=100 + bs)
    with torch.inference_mode():
        eager = runner.forward_eager(fb).clone()
        kv_after_eager = [k[1:].clone() for k in runner.kv_cache.k_buffers[:2]]
        graphed = graph_runner.replay(fb).clone()
    assert torch.equal(eager.argmax(-1), graphed.argmax(-1))
    torch.testing.assert_close(graphed, eager, rtol=2e-2, atol=2e-2)
    for k, ref in zip(runner.kv_cache.k_buffers[:2], kv_after_eager):
        assert torch.equal(k[1:], ref)  # padding rows wrote only slot 0
    release(runner, rows, fb)


def test_shared_pool_memory(runner):
    sizes = get_batch_sizes_to_capture(64)
    shared = CudaGraphRunner(runner, sizes)
    largest_alone = CudaGraphRunner(runner, [sizes[-1]])
    private_total = 0
    for bs in sizes[-4:]:  # a private pool each, a few sizes suffice to show the difference
        private_total += CudaGraphRunner(runner, [bs], capturer=CudaGraphCapturer(runner.device)).capture_bytes
    print(f"\nshared pool, {len(sizes)} graphs: {shared.capture_bytes / 2**20:.1f} MiB; largest alone: "
          f"{largest_alone.capture_bytes / 2**20:.1f} MiB; private pools for the 4 largest: "
          f"{private_total / 2**20:.1f} MiB")
    assert shared.capture_bytes <= 1.3 * max(largest_alone.capture_bytes, 2 << 20)

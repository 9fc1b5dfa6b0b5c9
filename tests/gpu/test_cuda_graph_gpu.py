"""Decode CUDA graphs on the GPU: replay equals eager at every size of the default capture list and at padded
sizes between them, with short prompts (the triton backend's single-stage decode graphs) and long ones (its
split graphs, at the sizes that split); the shared pool."""

from __future__ import annotations

import pytest
import torch

from model_executor.configs import shape_path
from runners.capture_lists import get_batch_sizes_to_capture, pick_size
from runners.cuda_graph_runner import CudaGraphRunner
from runners.graph_seam import CudaGraphCapturer
from runners.model_runner import ModelRunner, RunnerConfig

pytestmark = pytest.mark.gpu

SIZES = get_batch_sizes_to_capture(256)  # the default list on an 80+ GiB GPU
PADDED = [3, 5, 13, 31, 100, 255]  # between captured sizes: padding rows
# Prompt lengths: short batches take the single-stage decode graph; long ones (over the backend's
# single_stage_max_len) the split graph at the sizes where the split cap is above 1 (smaller batches).
PROMPTS = {"short": (2, 30), "long": (130, 300)}
LONG_SIZES = [s for s in SIZES if s <= 32] + [3, 5, 13, 31]
CASES = [(bs, "short") for bs in SIZES + PADDED] + [(bs, "long") for bs in LONG_SIZES]


@pytest.fixture(scope="module")
def runner():
    # Rows and slots for the largest batch (prompts under 30 tokens) with room to spare.
    cfg = RunnerConfig(model_path=str(shape_path("smollm2-135m")), device="cuda", attention_backend="triton",
                       max_running_requests=SIZES[-1] + 8, max_total_tokens=(SIZES[-1] + 8) * 64,
                       context_length=512, random_weights=True, disable_cuda_graph=True,
                       disable_piecewise_cuda_graph=True)
    return ModelRunner(cfg)


@pytest.fixture(scope="module")
def graph_runner(runner):
    return CudaGraphRunner(runner, SIZES)


@pytest.fixture
def decode_batch(runner):
    """make(bs, seed) -> (decode batch, its KV slots); rows and slots go back even when the test fails."""
    from tests.test_cuda_graph_runner import make_decode_batch, release

    made = []

    def make(bs, seed, **kw):
        fb, rows, loc = make_decode_batch(runner, bs, seed, **kw)
        made.append((rows, fb))
        return fb, loc

    yield make
    for rows, fb in made:
        release(runner, rows, fb)


def _kv(runner) -> list[torch.Tensor]:
    return [buf.clone() for buf in runner.kv_cache.k_buffers + runner.kv_cache.v_buffers]


@pytest.mark.parametrize("bs,prompts", CASES)
def test_graph_replay_equals_eager(runner, graph_runner, decode_batch, bs, prompts):
    low, high = PROMPTS[prompts]
    fb, loc = decode_batch(bs, seed=100 + bs, min_prompt=low, max_prompt=high)
    with torch.inference_mode():
        kv_before = _kv(runner)
        eager = runner.forward_eager(fb).clone()
        kv_eager = _kv(runner)
        graphed = graph_runner.replay(fb).clone()
    # Eager runs bs rows, the graph the padded size: bfloat16 GEMMs may pick other kernels and round apart.
    torch.testing.assert_close(graphed, eager, rtol=2e-2, atol=2e-2)
    # The plan the replay picked its graph by: single stage for short batches, else the padded size's cap.
    backend = runner.attn_backend
    assert backend._decode_splits[1] == (1 if prompts == "short" else backend.split_cap(pick_size(SIZES, bs)))
    real = loc.to(runner.device)
    untouched = torch.ones(kv_before[0].shape[0], dtype=torch.bool, device=runner.device)
    untouched[real] = False
    untouched[0] = False  # padding rows write slot 0
    for after, ref, before in zip(_kv(runner), kv_eager, kv_before):
        torch.testing.assert_close(after[real], ref[real], rtol=2e-2, atol=2e-2)
        assert torch.equal(after[untouched], before[untouched])


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
    # One pool: all sizes cost about what the largest costs alone. Not exactly: since each size has two graphs
    # (a split-KV and a single-stage attention plan) the pool fragments a little (74.0 vs 56.0 MiB measured on
    # the H200, 2026-12-01); a private pool per graph costs the sum (218 MiB for just the 4 largest).
    assert shared.capture_bytes <= 1.5 * max(largest_alone.capture_bytes, 2 << 20)
    assert shared.capture_bytes < private_total / 2

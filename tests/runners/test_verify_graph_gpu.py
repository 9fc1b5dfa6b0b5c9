"""Speculative verify graphs on the GPU (real CUDA graphs, bf16, triton attention): a verify batch's replay equals
its eager forward (logits at every token, the K/V stored, no other slot written) at every size of the default
decode capture list up to 64 and at padded sizes between them, with requests verifying fewer tokens than the
bound; the graphs share the decode graphs' pool.

Run: pytest -m gpu tests/runners/test_verify_graph_gpu.py
"""

from __future__ import annotations

import pytest
import torch

from model_executor.configs import shape_path
from runners.capture_lists import get_batch_sizes_to_capture
from runners.cuda_graph_runner import CudaGraphRunner
from runners.model_runner import ModelRunner, RunnerConfig
from runners.verify_graph_runner import VerifyGraphRunner
from tests.runners.test_piecewise_runner import make_extend_batch, release

pytestmark = pytest.mark.gpu

SIZES = get_batch_sizes_to_capture(64)
TOKENS = 5
PADDED = [3, 5, 13, 31, 63]


@pytest.fixture(scope="module")
def runner():
    return ModelRunner(RunnerConfig(model_path=str(shape_path("smollm2-135m")), device="cuda",
                                    attention_backend="triton", max_running_requests=72, max_total_tokens=72 * 128,
                                    context_length=512, random_weights=True, disable_cuda_graph=True,
                                    disable_piecewise_cuda_graph=True))


@pytest.fixture(scope="module")
def graphs(runner):
    decode = CudaGraphRunner(runner, SIZES)
    return VerifyGraphRunner(runner, SIZES, TOKENS, capturer=decode.capturer)


def _kv(runner) -> list[torch.Tensor]:
    return [buf.clone() for buf in runner.kv_cache.k_buffers + runner.kv_cache.v_buffers]


@pytest.mark.parametrize("bs", SIZES + PADDED)
def test_verify_replay_equals_eager(runner, graphs, bs):
    g = torch.Generator().manual_seed(bs)
    ext = torch.randint(1, TOKENS + 1, (bs,), generator=g).tolist()
    ext[0] = TOKENS
    prefix = torch.randint(1, 100, (bs,), generator=g).tolist()
    fb, rows = make_extend_batch(runner, ext, prefix, seed=bs)
    fb.all_token_logits = True
    try:
        with torch.inference_mode():
            kv_before = _kv(runner)
            eager = runner.forward_eager(fb).clone()
            kv_eager = _kv(runner)
            graphed = graphs.replay(fb).clone()
        assert graphed.shape == eager.shape == (sum(ext), runner.model_config.vocab_size)
        torch.testing.assert_close(graphed, eager, rtol=2e-2, atol=2e-2)
        real = fb.out_cache_loc
        untouched = torch.ones(kv_before[0].shape[0], dtype=torch.bool, device=runner.device)
        untouched[real] = False
        for after, ref, before in zip(_kv(runner), kv_eager, kv_before):
            torch.testing.assert_close(after[real], ref[real], rtol=2e-2, atol=2e-2)
            assert torch.equal(after[untouched], before[untouched])
    finally:
        release(runner, rows, fb)

"""The decode batch on CUDA: the pinned host tensor, its upload and the device request table (the CPU run of the
same check is tests/runners/test_decode_batch.py)."""

from __future__ import annotations

import pytest

from model_executor.configs import shape_path
from runners.model_runner import ModelRunner, RunnerConfig
from tests.runners.test_decode_batch import check_decode_batch

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("with_input_ids", [False, True])
def test_decode_batch_from_host_lists_on_cuda(with_input_ids):
    runner = ModelRunner(RunnerConfig(model_path=str(shape_path("smollm2-135m")), device="cuda",
                                      max_running_requests=8, max_total_tokens=256, context_length=64,
                                      random_weights=True, disable_cuda_graph=True,
                                      disable_piecewise_cuda_graph=True))
    assert runner.pin_memory
    check_decode_batch(runner, with_input_ids)

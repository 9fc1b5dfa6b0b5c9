"""L2 prefetch on the GPU (model_executor/layers/triton_ops/l2_prefetch.py): the kernel runs over whole tensors
and row prefixes of odd sizes without a fault and changes no byte, and a decode step with every layer's plan
(o_proj, the gate/up rows' first bytes) gives the same logits as without it, eager and graph-replayed at
captured and padded sizes. Whether it pays is benchmarks/probe_l2_prefetch.py's question, not a test's."""

from __future__ import annotations

import pytest
import torch

from model_executor.configs import shape_path
from model_executor.layers.triton_ops.l2_prefetch import l2_prefetch
from model_executor.models.llama import enable_l2_prefetch
from runners.cuda_graph_runner import CudaGraphRunner
from runners.model_runner import ModelRunner, RunnerConfig

pytestmark = pytest.mark.gpu


def test_prefetch_changes_nothing():
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("cp.async.bulk.prefetch needs sm_90")
    t = torch.randn(1000, 4104, device="cuda").to(torch.bfloat16)  # rows of 8208 bytes
    before = t.clone()
    for row_bytes in (None, 16, 1000, 8208, 10**6):
        l2_prefetch(t, row_bytes)
    l2_prefetch(t[1:], 4096)  # a view from the second row
    l2_prefetch(torch.zeros(7, device="cuda"))  # 28 bytes: one 16-byte chunk
    torch.cuda.synchronize()
    assert torch.equal(t, before)


SIZES = [1, 2, 4]  # captured
RUN = [1, 2, 3, 4]  # 3: padded to 4


def test_decode_with_prefetch_equals_without():
    from tests.test_cuda_graph_runner import make_decode_batch, release

    runner = ModelRunner(RunnerConfig(model_path=str(shape_path("llama-3.2-1b")), device="cuda",
                                      attention_backend="triton", max_running_requests=16, max_total_tokens=4096,
                                      context_length=512, random_weights=True, disable_cuda_graph=True,
                                      disable_piecewise_cuda_graph=True))
    plain = CudaGraphRunner(runner, SIZES)
    assert enable_l2_prefetch(runner.model, gate_up_row_bytes=256) == 16
    prefetching = CudaGraphRunner(runner, SIZES)
    for bs in RUN:
        fb, rows, _ = make_decode_batch(runner, bs, seed=bs, min_prompt=20, max_prompt=200)
        try:
            with torch.inference_mode():
                eager_on = runner.forward_eager(fb).clone()
                graph_on = prefetching.replay(fb).clone()
                graph_off = plain.replay(fb).clone()
                enable_l2_prefetch(runner.model, on=False)
                eager_off = runner.forward_eager(fb).clone()
                enable_l2_prefetch(runner.model, gate_up_row_bytes=256)
            assert torch.equal(eager_on, eager_off)
            assert torch.equal(graph_on, graph_off)
        finally:
            release(runner, rows, fb)

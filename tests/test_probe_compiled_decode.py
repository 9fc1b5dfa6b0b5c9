"""benchmarks/probe_compiled_decode's runner on the CPU: the compiled decode forward (dynamo, here with the
eager backend: the tracing and the plumbing, not inductor's code) captured in the stand-in graph replays
equal to eager at every captured and a padded size, with the triton backend in Triton's interpreter."""

from __future__ import annotations

import pytest
import torch
import triton_mode
from triton_mode import DEVICE, in_process

from benchmarks.probe_compiled_decode import CompiledDecodeGraphRunner
from model_executor.layers.attention.triton_backend import TritonAttnBackend
from runners.graph_seam import StandInCapturer
from runners.model_runner import ModelRunner, RunnerConfig
from tests.test_cuda_graph_runner import make_decode_batch, release

SIZES = [1, 2, 4]

test_in_subprocess = triton_mode.subprocess_test(__file__)


@pytest.fixture(scope="module")
def runner(tiny_llama):
    runner = ModelRunner(RunnerConfig(model_path=str(tiny_llama[0]), device=DEVICE, dtype="float32",
                                      attention_backend="torch_native", max_running_requests=8,
                                      max_total_tokens=512, disable_cuda_graph=True,
                                      disable_piecewise_cuda_graph=True))
    runner.attn_backend = TritonAttnBackend(runner)
    return runner


@pytest.fixture(scope="module")
def compiled(runner):
    torch._dynamo.reset()
    return CompiledDecodeGraphRunner(runner, SIZES, backend="eager", capturer=StandInCapturer())


@in_process
@pytest.mark.parametrize("bs", SIZES + [3])
def test_compiled_replay_equals_eager(runner, compiled, bs):
    fb, rows, _ = make_decode_batch(runner, bs, seed=40 + bs, max_prompt=12)
    with torch.inference_mode():
        eager = runner.forward_eager(fb).clone()
        graphed = compiled.replay(fb).clone()
    torch.testing.assert_close(graphed, eager, rtol=1e-4, atol=1e-4)
    assert sorted(compiled.compile_seconds) == SIZES  # each size traced once, at capture
    release(runner, rows, fb)

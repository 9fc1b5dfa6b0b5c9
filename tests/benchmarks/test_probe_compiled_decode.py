"""benchmarks/probe_compiled_decode's runner on the CPU: the compiled decode forward (dynamo, here with the
eager backend: the tracing and the plumbing, not inductor's code) captured in the stand-in graph replays
equal to eager at every captured and a padded size, with the triton backend in Triton's interpreter."""

from __future__ import annotations

import pytest
import torch

from benchmarks.probe_compiled_decode import CompiledDecodeGraphRunner
from runners.graph_seam import StandInCapturer
from tests import triton_mode
from tests.runners import test_cuda_graph_runner
from tests.runners.test_cuda_graph_runner import make_decode_batch, release
from tests.triton_mode import in_process

SIZES = [1, 2, 4]

test_in_subprocess = triton_mode.subprocess_test(__file__)
triton_runner = test_cuda_graph_runner.triton_runner  # the tiny model with the triton backend (a fixture)


@pytest.fixture(scope="module")
def compiled(triton_runner):
    torch._dynamo.reset()
    return CompiledDecodeGraphRunner(triton_runner, SIZES, backend="eager", capturer=StandInCapturer())


@in_process
@pytest.mark.parametrize("bs", SIZES + [3])
def test_compiled_replay_equals_eager(triton_runner, compiled, bs):
    runner = triton_runner
    fb, rows, _ = make_decode_batch(runner, bs, seed=40 + bs, max_prompt=12)
    with torch.inference_mode():
        eager = runner.forward_eager(fb).clone()
        graphed = compiled.replay(fb).clone()
    torch.testing.assert_close(graphed, eager, rtol=1e-4, atol=1e-4)
    assert sorted(compiled.compile_seconds) == SIZES  # each size traced once, at capture
    release(runner, rows, fb)

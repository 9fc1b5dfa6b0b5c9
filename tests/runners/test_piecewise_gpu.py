"""Piecewise extend graphs on the GPU (triton attention, bf16, random weights of real shapes): replay equals
eager for batches with and without cached prefixes, one trace, and the capture's time and memory.

Run: pytest -m gpu tests/runners/test_piecewise_gpu.py -s   (-s shows capture time and memory)
"""

from __future__ import annotations

import pytest
import torch

from model_executor.configs import shape_path
from runners.capture_lists import get_token_levels
from runners.model_runner import ModelRunner, RunnerConfig

pytestmark = pytest.mark.gpu

LEVELS = (8, 32, 128, 512)


@pytest.fixture(scope="module", autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture(scope="module")
def runner():
    """The extend runner is built by ModelRunner.init_graph_runners, as in the server."""
    cfg = RunnerConfig(model_path=str(shape_path("smollm2-135m")), device="cuda", attention_backend="triton",
                       max_running_requests=32, max_total_tokens=16384, context_length=2048,
                       random_weights=True, disable_cuda_graph=True, piecewise_cuda_graph_tokens=LEVELS)
    runner = ModelRunner(cfg)
    pw = runner.extend_graph_runner
    assert pw is not None
    for piece in pw.pieces:  # on GPU too: every replay must read the addresses its graphs were captured with
        piece.check_addresses = True
    print(f"\nsmollm2-135m shape, {len(pw.levels)} levels {pw.levels}: {pw.info()}")
    return runner


def _make_batch(runner, ext, pre, seed):
    from tests.runners.test_piecewise_runner import make_extend_batch

    return make_extend_batch(runner, ext, pre, seed)


def _release(runner, rows, fb):
    from tests.runners.test_piecewise_runner import release

    release(runner, rows, fb)


def assert_greedy_equal(graphed: torch.Tensor, eager: torch.Tensor, tol: float) -> None:
    """Same argmax, except where eager's top two are within tol (a bf16 near-tie may flip)."""
    g, e = graphed.argmax(-1), eager.argmax(-1)
    for row in torch.nonzero(g != e).flatten().tolist():
        gap = (eager[row, e[row]] - eager[row, g[row]]).item()
        assert gap <= tol, f"row {row}: piecewise picked {g[row].item()}, eager {e[row].item()} (gap {gap:.4f})"


CASES = {
    "one_on_level": ([32], [0]),
    "one_between": ([5], [0]),
    "one_padded_far": ([129], [0]),
    "one_at_max": ([512], [0]),
    "several": ([3, 17, 40], [0, 0, 0]),
    "several_with_prefixes": ([7, 64, 100, 1], [100, 0, 300, 33]),
    "many_short_on_prefixes": ([1] * 20 + [6] * 4, [50] * 24),
}


@pytest.mark.parametrize("case", list(CASES))
def test_piecewise_equals_eager(runner, case):
    ext, pre = CASES[case]
    fb, rows = _make_batch(runner, ext, pre, seed=len(case) + sum(ext))
    pw = runner.extend_graph_runner
    assert pw.can_run(fb)
    real = fb.out_cache_loc
    with torch.inference_mode():
        before = runner.path_counts["extend_graph"]
        graphed = runner.forward(fb).clone()
        assert runner.path_counts["extend_graph"] == before + 1
        kv_graphed = [b[real].clone() for b in runner.kv_cache.k_buffers + runner.kv_cache.v_buffers]
        eager = runner.forward_eager(fb).clone()
        kv_eager = [b[real] for b in runner.kv_cache.k_buffers + runner.kv_cache.v_buffers]
    diff = (graphed - eager).abs().max().item()
    print(f"{case}: {sum(ext)} tokens, max|logits diff| {diff:.3e}")
    assert torch.isfinite(graphed).all()
    torch.testing.assert_close(graphed, eager, rtol=3e-2, atol=3e-2)
    assert_greedy_equal(graphed, eager, tol=3e-2)
    for g, e in zip(kv_graphed, kv_eager):
        torch.testing.assert_close(g, e, rtol=2e-2, atol=2e-2)
    _release(runner, rows, fb)


def test_traced_once_and_fallback(runner):
    pw = runner.extend_graph_runner
    for n in (1, 2, 9, 31, 33, 100, 511, 512):
        fb, rows = _make_batch(runner, [n], [0], seed=n)
        with torch.inference_mode():
            runner.forward(fb)
        _release(runner, rows, fb)
    assert pw.num_traces == 1
    fb, rows = _make_batch(runner, [300, 213], [0, 0], seed=1)
    assert not pw.can_run(fb)
    before = runner.path_counts["extend_eager"]
    with torch.inference_mode():
        runner.forward(fb)
    assert runner.path_counts["extend_eager"] == before + 1
    _release(runner, rows, fb)


def test_default_levels_memory_1b():
    """The 42 default levels up to 2048 tokens on the Llama-3.2-1B shape: time and memory of the capture."""
    levels = tuple(get_token_levels(2048))
    cfg = RunnerConfig(model_path=str(shape_path("llama-3.2-1b")), device="cuda", attention_backend="triton",
                       max_running_requests=16, max_total_tokens=32768, context_length=4096,
                       random_weights=True, disable_cuda_graph=True, piecewise_cuda_graph_tokens=levels)
    runner = ModelRunner(cfg)
    info = runner.extend_graph_runner.info()
    print(f"\nllama-3.2-1b shape, {len(levels)} levels up to 2048: {info}")
    fb, rows = _make_batch(runner, [2000, 40], [0, 100], seed=0)
    with torch.inference_mode():
        graphed = runner.extend_graph_runner.replay(fb).clone()
        eager = runner.forward_eager(fb)
    torch.testing.assert_close(graphed, eager, rtol=3e-2, atol=3e-2)
    _release(runner, rows, fb)
    assert runner.extend_graph_runner.num_traces == 1
    assert info["extend_capture_gib"] <= 1.0, f"extend capture took {info['extend_capture_gib']} GiB (aim: <= 1)"

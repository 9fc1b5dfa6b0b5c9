"""The CPU decode runner (inductor-compiled decode) equals eager at every compiled and padded batch size:
greedy tokens, float32 logits, and the K/V the step writes (padding rows write none)."""

from __future__ import annotations

import pytest
import torch

from runners.cpu_graph_runner import CpuGraphRunner
from runners.model_runner import ModelRunner, RunnerConfig
from tests.runners.test_cuda_graph_runner import make_decode_batch, release

SIZES = (1, 2, 4)


@pytest.fixture(scope="module")
def runner(tiny_llama, tmp_path_factory, monkeypatch_module):
    """The default (dynamic batch) compile only: a compile costs tens of seconds of CI on two cores, and the
    static mode (one compile per size) differs only in dynamo's dynamic flag."""
    monkeypatch_module.setenv("DUET_CACHE_DIR", str(tmp_path_factory.mktemp("duet_cache")))
    monkeypatch_module.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    return ModelRunner(RunnerConfig(model_path=str(tiny_llama[0]), max_running_requests=8, max_total_tokens=512,
                                    cuda_graph_bs=SIZES))


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


def _kv(runner) -> list[torch.Tensor]:
    return [buf.clone() for buf in runner.kv_cache.k_buffers + runner.kv_cache.v_buffers]


def _restore(runner, kv: list[torch.Tensor]) -> None:
    for buf, saved in zip(runner.kv_cache.k_buffers + runner.kv_cache.v_buffers, kv):
        buf.copy_(saved)


def test_runner_is_built_and_cached_under_duet_dir(runner, tmp_path_factory):
    graphs = runner.decode_graph_runner
    assert isinstance(graphs, CpuGraphRunner) and graphs.dynamic
    assert graphs.cache_dir.startswith(str(tmp_path_factory.getbasetemp()))
    assert runner.graph_info()["cuda_graph_bs"] == list(graphs.batch_sizes)


@pytest.mark.parametrize("bs", [1, 2, 3, 4])
def test_compiled_decode_equals_eager(runner, bs):
    """Every compiled size (1 is a specialization of its own, 2 and 4 share the dynamic trace) and a padded
    one (3 -> 4)."""
    fb, rows, _ = make_decode_batch(runner, bs, seed=bs, max_prompt=12)
    try:
        graphs = runner.decode_graph_runner
        assert graphs.can_run(fb)
        before = _kv(runner)
        with torch.inference_mode():
            eager = runner.forward_eager(fb).clone()
            after_eager = _kv(runner)
            _restore(runner, before)
            counts = dict(runner.path_counts)
            compiled = runner.forward(fb).clone()
        assert runner.path_counts["decode_graph"] == counts.get("decode_graph", 0) + 1
        assert compiled.shape == eager.shape
        torch.testing.assert_close(compiled, eager, atol=1e-5, rtol=1e-5)
        assert torch.equal(compiled.argmax(-1), eager.argmax(-1))
        for got, want in zip(_kv(runner), after_eager):  # same K/V written, slot 0 (padding) untouched
            torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    finally:
        release(runner, rows, fb)


def test_disable_flag_runs_eager(tiny_llama):
    runner = ModelRunner(RunnerConfig(model_path=str(tiny_llama[0]), max_running_requests=2, max_total_tokens=64,
                                      cuda_graph_bs=SIZES, disable_cuda_graph=True))
    assert runner.decode_graph_runner is None and runner.graph_info()["cuda_graph_bs"] == []


def test_server_flags_choose_the_cpu_decode_path(tiny_llama):
    """Eager by default on CPU; --enable-torch-compile compiles the decode list; --disable-cuda-graph wins."""
    from server.args import parse_args
    from server.scheduler_entry import runner_config

    def config(*flags):
        return runner_config(parse_args(["--model-path", str(tiny_llama[0]), "--device", "cpu",
                                         "--max-running-requests", "16", *flags]))

    assert config().cuda_graph_bs == () and config().disable_cuda_graph
    compiled = config("--enable-torch-compile")
    assert compiled.cuda_graph_bs == (1, 2, 4, 8, 12, 16) and not compiled.disable_cuda_graph
    assert config("--enable-torch-compile", "--cuda-graph-bs", "1", "3").cuda_graph_bs == (1, 3)  # (as given)
    off = config("--enable-torch-compile", "--disable-cuda-graph")
    assert off.cuda_graph_bs == () and off.disable_cuda_graph

"""Whole-backbone extend graphs on the GPU (triton attention inside the graph, bf16, random weights of real
shapes): replay equals the same padded batch run eagerly, and eager on the real batch, at every captured level
and at padded sizes, with and without cached prefixes, up to the request rows; batches with more requests go
to the pieces. SmolLM2-135M (GQA 9/3, head_dim 64), Qwen3-8B (head_dim 128, per-head q/k norms) and
Qwen3-30B-A3B with 4 of its 48 layers (MoE: 128 experts, top 8; the fused-MoE kernels inside the graph).

MoE routing compares bf16 router logits: where a token's k-th and (k+1)-th experts are a near-tie, the graph
(whose GEMMs see the level's rows) and eager on the real rows may pick different experts. Against eager on
the real batch the MoE model is therefore held to most rows close and the greedy token (or a near-tie), as
tests/kernels/test_moe_gpu.py holds its piecewise extend, and its deeper layers' K/V are compared only against the
padded batch run eagerly (which must match the replay as for the dense models).

Against eager on the real (unpadded) batch the tolerance is the model's: the GEMMs run at the level's row
count in the graph and at the real one eagerly, and bf16 rounds them differently; through Qwen3-8B's 36 layers
of random weights a 1-token extend padded to 8 moved logits by up to 0.23 (the same padding run eagerly
moves them the same way: the first comparison).

Run: pytest -m gpu tests/runners/test_full_extend_graph_gpu.py -s
"""

from __future__ import annotations

import pytest
import torch

from model_executor.configs import shape_path
from model_executor.layers.logits import compute_logits
from runners.full_extend_graph_runner import DEFAULT_MAX_REQUESTS
from runners.model_runner import ModelRunner, RunnerConfig

pytestmark = pytest.mark.gpu

LEVELS = (8, 32, 128, 512)
# Graph (at the level's rows) against eager (at the real rows): logits and near-tie gaps.
REAL_EAGER_TOL = {"smollm2-135m": 3e-2, "qwen3-8b": 0.5, "qwen3-30b-a3b": 3e-2}


@pytest.fixture(scope="module", autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _model_path(name: str, tmp_path_factory) -> str:
    from tests.kernels.test_moe_gpu import qwen3_moe_path

    return str(qwen3_moe_path(tmp_path_factory) if name == "qwen3-30b-a3b" else shape_path(name))


@pytest.fixture(scope="module", params=["smollm2-135m", "qwen3-8b", "qwen3-30b-a3b"])
def runner(request, tmp_path_factory):
    """Built by ModelRunner.init_graph_runners, as in the server: pieces at every level, whole graphs up to 128."""
    cfg = RunnerConfig(model_path=_model_path(request.param, tmp_path_factory), device="cuda",
                       attention_backend="triton",
                       max_running_requests=32, max_total_tokens=16384, context_length=2048,
                       random_weights=True, disable_cuda_graph=True, piecewise_cuda_graph_tokens=LEVELS,
                       full_extend_graph_max_tokens=128)
    runner = ModelRunner(cfg)
    full = runner.full_extend_graph_runner
    assert full is not None and full.levels == [8, 32, 128]
    print(f"\n{request.param} shape: {full.info()}")
    runner.test_tol = REAL_EAGER_TOL[request.param]
    runner.test_moe = bool(runner.model_config.moe_layers)
    yield runner
    del runner
    torch.cuda.empty_cache()


def _make_batch(runner, ext, pre, seed):
    from tests.runners.test_piecewise_runner import make_extend_batch

    return make_extend_batch(runner, ext, pre, seed)


def _release(runner, rows, fb):
    from tests.runners.test_piecewise_runner import release

    release(runner, rows, fb)


CASES = {
    "on_level_8": ([8], [0]),
    "on_level_32": ([32], [0]),
    "on_level_128": ([128], [0]),
    "padded_1": ([1], [0]),
    "padded_5": ([5], [0]),
    "padded_33": ([33], [0]),
    "padded_100_on_a_prefix": ([100], [300]),
    "several_with_prefixes": ([7, 20, 1], [100, 0, 33]),
    "max_requests": ([3] * DEFAULT_MAX_REQUESTS, [50] * DEFAULT_MAX_REQUESTS),
}


def padded_eager(runner, fb) -> torch.Tensor:
    """What the graph of fb's level computes, run eagerly: the backbone over its static batch, loaded with fb."""
    full = runner.full_extend_graph_runner
    key = full.key(fb)
    static = full.static_batches[key]
    full.buffers.load(fb, static.batch_size)
    hidden = runner.model.model(static.input_ids, static.positions, static)
    return compute_logits(runner.model.lm_head, hidden[: fb.num_tokens], fb)


def assert_close_to_real_eager(runner, graphed, eager) -> None:
    """Dense models: every logit within the model's tolerance and the greedy tokens equal (near-ties aside);
    MoE: most rows within it and the greedy tokens equal (near-ties aside), see the module docstring."""
    from tests.kernels.test_moe_gpu import assert_close_rows
    from tests.runners.test_piecewise_gpu import assert_greedy_equal

    if runner.test_moe:
        assert_close_rows(graphed, eager, tol=runner.test_tol, min_fraction=0.75)
        return
    torch.testing.assert_close(graphed, eager, rtol=runner.test_tol, atol=runner.test_tol)
    assert_greedy_equal(graphed, eager, tol=runner.test_tol)


@pytest.mark.parametrize("case", list(CASES))
def test_full_graph_equals_eager(runner, case):
    ext, pre = CASES[case]
    fb, rows = _make_batch(runner, ext, pre, seed=len(case) + sum(ext))
    full = runner.full_extend_graph_runner
    assert full.can_run(fb)
    real = fb.out_cache_loc
    bufs = runner.kv_cache.k_buffers + runner.kv_cache.v_buffers
    with torch.inference_mode():
        replays = full.replays
        graphed = runner.forward(fb).clone()
        assert full.replays == replays + 1
        kv_graphed = [b[real].clone() for b in bufs]
        padded = padded_eager(runner, fb).clone()
        kv_padded = [b[real].clone() for b in bufs]
        eager = runner.forward_eager(fb).clone()
        kv_eager = [b[real] for b in bufs]
    diff, padding = (graphed - eager).abs().max().item(), (padded - eager).abs().max().item()
    print(f"{case}: {sum(ext)} tokens, max|logits diff| graph-padded eager {(graphed - padded).abs().max():.3e}, "
          f"graph-eager {diff:.3e}, padded eager-eager {padding:.3e}")
    assert torch.isfinite(graphed).all()
    torch.testing.assert_close(graphed, padded, rtol=1e-3, atol=1e-3)
    assert_close_to_real_eager(runner, graphed, eager)
    # Every layer's K/V as the padded batch run eagerly stores them; the first layer's (before any attention)
    # as eager on the real batch does, the deeper ones within the model's tolerance.
    num_layers = len(bufs) // 2
    for i, (g, p, e) in enumerate(zip(kv_graphed, kv_padded, kv_eager)):
        torch.testing.assert_close(g, p, rtol=2e-2, atol=2e-2)
        if i % num_layers == 0:
            torch.testing.assert_close(g, e, rtol=2e-2, atol=2e-2)
        elif not runner.test_moe:  # (MoE: a near-tie routed apart moves a token's deeper K/V by O(1))
            torch.testing.assert_close(g, e, rtol=runner.test_tol, atol=runner.test_tol)
    _release(runner, rows, fb)


def test_more_requests_or_tokens_go_to_the_pieces(runner):
    full, pw = runner.full_extend_graph_runner, runner.extend_graph_runner
    for ext in ([2] * (DEFAULT_MAX_REQUESTS + 1), [129]):
        fb, rows = _make_batch(runner, ext, [10] * len(ext), seed=len(ext))
        assert not full.can_run(fb) and pw.can_run(fb)
        with torch.inference_mode():
            replays, graph_before = full.replays, runner.path_counts["extend_graph"]
            graphed = runner.forward(fb).clone()
            assert full.replays == replays and runner.path_counts["extend_graph"] == graph_before + 1
            eager = runner.forward_eager(fb)
        assert_close_to_real_eager(runner, graphed, eager)
        _release(runner, rows, fb)

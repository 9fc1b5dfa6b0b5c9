"""Qwen3 decode on the triton backend: the per-head q/k norms, the rotary and the KV store run as one kernel
(`duet::rotary_store_kv` with the norm weights), and the model still matches HF transformers; the fused
decode step equals the unfused one (the norms and rotary as their own op, then the store: torch_native).

Without CUDA the kernels run in Triton's CPU interpreter (tests/triton_mode.py).
"""

from __future__ import annotations

import pytest
import torch

from model_executor.layers.attention import triton_backend
from model_executor.layers.attention.triton_backend import TritonAttnBackend
from runners.model_runner import ModelRunner, RunnerConfig
from tests import triton_mode
from tests.conftest import save_tiny_hf_model
from tests.models.test_model_vs_hf import run_prefill_and_decode
from tests.models.test_new_models_vs_hf import TINY_QWEN3
from tests.runners.test_cuda_graph_runner import (
    assert_fused_decode_equals_unfused,
    make_decode_batch,
    release,
)
from tests.triton_mode import DEVICE, in_process

test_in_subprocess = triton_mode.subprocess_test(__file__)


@pytest.fixture(scope="module")
def tiny_qwen3(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_qwen3_triton")
    return path, save_tiny_hf_model(path, TINY_QWEN3, seed=5)


def triton_runner(path) -> ModelRunner:
    """The tiny model with the triton backend swapped in (the product refuses triton without CUDA)."""
    runner = ModelRunner(RunnerConfig(model_path=str(path), device=DEVICE, dtype="float32",
                                      attention_backend="torch_native", max_running_requests=4,
                                      max_total_tokens=512, context_length=128, disable_cuda_graph=True,
                                      disable_piecewise_cuda_graph=True))
    runner.attn_backend = TritonAttnBackend(runner)
    return runner


@pytest.fixture
def fused_calls(monkeypatch):
    """The triton backend's calls of the fused op: whether each passed norm weights."""
    calls = []
    real = triton_backend.rotary_store_kv

    def counting(*args, **kwargs):
        calls.append(kwargs.get("q_norm_weight") is not None and kwargs.get("k_norm_weight") is not None)
        return real(*args, **kwargs)

    monkeypatch.setattr(triton_backend, "rotary_store_kv", counting)
    return calls


@in_process
def test_qwen3_triton_decode_matches_hf(tiny_qwen3, fused_calls):
    path, hf_model = tiny_qwen3
    runner = triton_runner(path)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 320, (n,), generator=gen).tolist() for n in (7, 1, 23)]
    errors = run_prefill_and_decode(runner, hf_model, prompts, decode_steps=4)
    assert max(errors) < 1e-4, errors
    # every decode step's every layer took the fused path, with the norms
    assert fused_calls == [True] * (4 * TINY_QWEN3["num_hidden_layers"])


@in_process
def test_qwen3_fused_decode_equals_unfused(tiny_qwen3, fused_calls):
    """Logits and the K/V stored by the fused decode step equal the unfused path's (qk norms and rotary,
    then KVCache.set_kv)."""
    runner = triton_runner(tiny_qwen3[0])
    fb, rows, loc = make_decode_batch(runner, 3, seed=21, max_prompt=12)
    try:
        assert_fused_decode_equals_unfused(runner, fb, loc, logits_tol=1e-5)
        assert fused_calls == [True] * TINY_QWEN3["num_hidden_layers"]
    finally:
        release(runner, rows, fb)

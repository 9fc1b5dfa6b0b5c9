"""Pooling models on the CPU against HF transformers: a backbone-only embedding checkpoint (Qwen3Model, as
sentence-transformers saves it), a causal LM served for embeddings, a sequence-classification reranker; and
what a model folder serves (model_executor/pooling.resolve_pooling)."""

from __future__ import annotations

import json

import pytest
import torch

from model_executor.pooling_config import PoolingConfig, PoolingConfigError, resolve_pooling
from model_executor.sampling_params import SamplingParams
from runners.model_runner import ModelRunner, RunnerConfig
from scheduler.io_struct import PoolingSpec
from scheduler.scheduler import Scheduler, SchedulerConfig
from tests.pooling_models import save_tiny, write_sentence_transformers_files

PROMPTS = [[5, 17, 42, 99, 123, 7, 250, 31], [64, 8, 200, 11, 3, 9, 77, 140, 199, 15, 33, 2 + 40]]


def pooled(path, spec: PoolingSpec, embedding_only: bool) -> list:
    runner = ModelRunner(RunnerConfig(model_path=str(path), max_running_requests=4, max_total_tokens=512,
                                      embedding_only=embedding_only))
    s = Scheduler(runner, SchedulerConfig(max_running_requests=4, chunked_prefill_size=5))
    for i, p in enumerate(PROMPTS):
        s.add_request(str(i), p, SamplingParams(), spec)
    out = {}
    while s.has_work():
        for o in s.step():
            out[o.rid] = o.embedding
    return [torch.as_tensor(out[str(i)]) for i in range(len(PROMPTS))]


@pytest.mark.parametrize("kind", ["backbone", "causal"])
def test_embedding_model_equals_hf_last_hidden_state(tmp_path, kind):
    hf = save_tiny(tmp_path, kind, seed=3)
    backbone = hf if kind == "backbone" else hf.model
    got = pooled(tmp_path, PoolingSpec("last"), embedding_only=True)
    for p, vec in zip(PROMPTS, got):
        with torch.no_grad():
            want = backbone(torch.tensor([p])).last_hidden_state[0, -1]
        torch.testing.assert_close(vec, want, rtol=1e-4, atol=1e-4)


def test_sequence_classification_head_equals_hf(tmp_path):
    hf = save_tiny(tmp_path, "classifier", seed=4)
    got = pooled(tmp_path, PoolingSpec("logits"), embedding_only=False)
    for p, vec in zip(PROMPTS, got):
        with torch.no_grad():
            want = hf(torch.tensor([p])).logits[0]
        assert vec.shape == (1,)
        torch.testing.assert_close(vec, want, rtol=1e-4, atol=1e-4)


def _config(path, arch: str, **extra) -> None:
    (path / "config.json").write_text(json.dumps({
        "architectures": [arch], "model_type": "qwen3", "vocab_size": 64, "hidden_size": 16,
        "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
        **extra}))


def test_what_a_folder_serves(tmp_path):
    _config(tmp_path, "Qwen3ForCausalLM")
    assert resolve_pooling(tmp_path, False, False) is None
    assert resolve_pooling(tmp_path, True, False) == PoolingConfig("embed", "last", True)
    assert resolve_pooling(tmp_path, False, True) == PoolingConfig("rerank", reranker="yes_no")
    write_sentence_transformers_files(tmp_path, "mean_tokens", normalize=False)
    assert resolve_pooling(tmp_path, False, False) == PoolingConfig("embed", "mean", False)
    write_sentence_transformers_files(tmp_path, "cls_token")
    assert resolve_pooling(tmp_path, False, False) == PoolingConfig("embed", "cls", True)
    write_sentence_transformers_files(tmp_path, "max_tokens")
    with pytest.raises(PoolingConfigError, match="pooling_mode_max_tokens"):
        resolve_pooling(tmp_path, False, False)
    modules = json.loads((tmp_path / "modules.json").read_text())
    modules.append({"idx": 3, "name": "3", "path": "3_Dense", "type": "sentence_transformers.models.Dense"})
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(PoolingConfigError, match="Dense"):
        resolve_pooling(tmp_path, True, False)


def test_architectures_decide_the_task(tmp_path):
    _config(tmp_path, "Qwen3Model")
    assert resolve_pooling(tmp_path, False, False).task == "embed"
    with pytest.raises(PoolingConfigError, match="no LM head"):
        resolve_pooling(tmp_path, False, True)
    _config(tmp_path, "Qwen3ForSequenceClassification", num_labels=1)
    assert resolve_pooling(tmp_path, True, False) == PoolingConfig("rerank", reranker="classifier")
    _config(tmp_path, "Qwen3ForSequenceClassification", num_labels=3)
    with pytest.raises(PoolingConfigError, match="3 labels"):
        resolve_pooling(tmp_path, False, False)

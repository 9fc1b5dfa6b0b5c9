"""bench_one_batch's prefill in groups of requests (a large batch of long prompts in one extend runs out of
GPU memory): the KV cache it leaves and the decode step after it equal those of one extend."""

from __future__ import annotations

import pytest
import torch

from benchmarks import bench_one_batch
from runners.model_runner import ModelRunner, RunnerConfig


def _prefilled(tiny_llama, prefill_tokens: int, monkeypatch):
    monkeypatch.setattr(bench_one_batch, "PREFILL_TOKENS", prefill_tokens)
    runner = ModelRunner(RunnerConfig(model_path=str(tiny_llama[0]), max_running_requests=8, max_total_tokens=256,
                                      disable_cuda_graph=True))
    batches, _, (_rows, loc) = bench_one_batch.prepare(runner, bs=5, input_len=8, steps=2)
    with torch.inference_mode():
        logits = runner.forward_eager(batches[0])
    k = torch.stack([buf[loc.long()] for buf in runner.kv_cache.k_buffers + runner.kv_cache.v_buffers])
    return k, logits


def test_prefill_in_groups_equals_one_extend(tiny_llama, monkeypatch):
    k_one, logits_one = _prefilled(tiny_llama, 1 << 20, monkeypatch)
    k_groups, logits_groups = _prefilled(tiny_llama, 16, monkeypatch)  # 2 requests per extend, 3 extends
    assert k_one.abs().sum() > 0
    torch.testing.assert_close(k_groups, k_one, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(logits_groups, logits_one, rtol=1e-5, atol=1e-6)


def test_floor_counts_the_embedding_rows_a_step_reads():
    """An untied embedding table counts only the rows of the step's tokens (bs at most); a table the head
    shares counts whole, once (the head reads all of it)."""
    from model_executor.model_config import ModelConfig
    from model_executor.weight_loader import build_model

    base = {"architectures": ["LlamaForCausalLM"], "vocab_size": 64, "hidden_size": 32, "intermediate_size": 48,
            "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1}
    untied = build_model(ModelConfig.from_dict({**base, "tie_word_embeddings": False}), torch.float32, "cpu")
    table = 64 * 32 * 4
    all_bytes = bench_one_batch.weight_bytes(untied)
    assert bench_one_batch.step_read_bytes(untied, 1) == all_bytes - table + 32 * 4
    assert bench_one_batch.step_read_bytes(untied, 5) == all_bytes - table + 5 * 32 * 4
    assert bench_one_batch.step_read_bytes(untied, 1000) == all_bytes  # every row
    tied = build_model(ModelConfig.from_dict({**base, "tie_word_embeddings": True}), torch.float32, "cpu")
    assert bench_one_batch.step_read_bytes(tied, 1) == bench_one_batch.weight_bytes(tied) == all_bytes - table


def test_back_to_back_timing_syncs_once_after_the_timed_steps(monkeypatch):
    """time_back_to_back launches every step without waiting for the one before (one sync after the last,
    as the overlap scheduler keeps the GPU busy); time_steps waits after each."""
    calls = []
    monkeypatch.setattr(bench_one_batch, "sync", lambda device: calls.append("sync"))
    batches = [f"step{i}" for i in range(6)]
    bench_one_batch.time_back_to_back(lambda fb: calls.append(fb), batches, torch.device("cpu"))
    assert calls == batches[:3] + ["sync"] + batches + ["sync"]
    calls.clear()
    bench_one_batch.time_steps(lambda fb: calls.append(fb), batches, torch.device("cpu"))
    assert calls == batches[:3] + ["sync"] + [c for fb in batches for c in (fb, "sync")]


def test_launch_time_is_taken_before_each_sync(monkeypatch):
    """time_steps_and_launch reads the clock when the step's call returns, before its sync: the sync's
    wait counts in the step time only (a fake clock that advances by 5 ms per sync and 1 ms per call)."""
    now = [0.0]

    def advance(ms):
        now[0] += ms / 1e3

    monkeypatch.setattr(bench_one_batch, "sync", lambda device: advance(5))
    monkeypatch.setattr(bench_one_batch.time, "perf_counter", lambda: now[0])
    step_ms, host_ms = bench_one_batch.time_steps_and_launch(lambda fb: advance(1), list(range(6)),
                                                             torch.device("cpu"))
    assert host_ms == pytest.approx(1.0) and step_ms == pytest.approx(6.0)


def test_random_weights_go_with_a_model_path(tmp_path, monkeypatch):
    """--random-weights: a folder's config.json (e.g. one declaring block FP8) with random weights; a folder
    alone loads its weights; the flag without a folder is refused."""
    with pytest.raises(SystemExit):
        bench_one_batch.parse_args(["--random-weights"])
    seen = []

    class Stop(Exception):
        pass

    def runner(cfg):
        seen.append(cfg)
        raise Stop

    monkeypatch.setattr(bench_one_batch, "ModelRunner", runner)
    for extra, random_weights in ((["--random-weights"], True), ([], False)):
        with pytest.raises(Stop):
            bench_one_batch.run(bench_one_batch.parse_args(["--model-path", str(tmp_path), "--device", "cpu", *extra]))
        assert seen[-1].model_path == str(tmp_path) and seen[-1].random_weights is random_weights
    with pytest.raises(Stop):
        bench_one_batch.run(bench_one_batch.parse_args(["--model", "llama-3.2-1b", "--device", "cpu"]))
    assert seen[-1].random_weights is True

"""The small-M GEMM tuner's CPU-side parts: the linear shapes it tunes, its table decisions, its refusal."""

from __future__ import annotations

import math

import pytest

from benchmarks import tune_small_m_gemm as tune
from model_executor.configs import shape_path
from model_executor.model_config import ModelConfig


@pytest.mark.parametrize("tp,expected", [
    (1, {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}),
    (2, {"qkv": (3072, 4096), "o": (4096, 2048), "gate_up": (14336, 4096), "down": (4096, 7168)}),
])
def test_linear_shapes_are_one_ranks_gemms(tp, expected):
    assert tune.linear_shapes(ModelConfig.from_pretrained(shape_path("llama-3.1-8b")), tp) == expected


def test_table_entry_keeps_the_other_path_only_where_it_measured_faster():
    best = object()
    # within the margin: cuBLAS stays
    assert tune.table_entry("bf16", {"best": best, "best_us": 9.9, "base_us": 10.0}) == "cublas"
    assert tune.table_entry("bf16", {"best": best, "best_us": 9.0, "base_us": 10.0}) is best
    assert tune.table_entry("fp8", {"best": best, "best_us": 10.1, "base_us": 10.0}) is best  # within margin
    assert tune.table_entry("fp8_block", {"best": best, "best_us": 11.0, "base_us": 10.0}) == "w8a8"


def test_refuses_without_cuda(monkeypatch, capsys):
    monkeypatch.setattr(tune.torch.cuda, "is_available", lambda: False)
    assert tune.main(["--quick"]) == 2
    assert "needs a CUDA device" in capsys.readouterr().err


def test_model_summary_counts_every_layer():
    cfg = ModelConfig.from_pretrained(shape_path("llama-3.2-1b"))
    shapes = tune.linear_shapes(cfg, 1).values()
    results = {("bf16", n, k, 1): {"base_us": 10.0, "best_us": 5.0, "best": object()} for n, k in shapes}
    (line,) = tune.model_summary(["llama-3.2-1b"], [1], ["bf16"], [1], results)
    today = 4 * 10.0 * cfg.num_hidden_layers / 1e3
    assert f"today {today:.3f} ms" in line and f"table {today / 2:.3f} ms" in line
    assert math.isclose(today, 0.64)
    assert tune.lm_head_shape(cfg, 2) == (64128, 2048)
    results[("bf16", 128256, 2048, 1)] = {"base_us": 100.0, "best_us": 200.0, "best": object()}  # cuBLAS wins
    (line,) = tune.model_summary(["llama-3.2-1b"], [1], ["bf16"], [1], results)
    assert "+ head" in line and f"today {today + 0.1:.3f} ms" in line
    assert f"table {today / 2 + 0.1:.3f} ms" in line


def test_moe_model_tunes_attention_and_router_not_a_dense_mlp_it_does_not_have():
    cfg = ModelConfig.from_pretrained(shape_path("qwen3-30b-a3b"))
    assert tune.linear_shapes(cfg, 1) == {"qkv": (5120, 2048), "o": (2048, 4096)}
    assert tune.router_shape(cfg) == (128, 2048)
    assert tune.router_shape(ModelConfig.from_pretrained(shape_path("llama-3.1-8b"))) is None
    shapes = [*tune.linear_shapes(cfg, 1).values(), tune.router_shape(cfg)]
    results = {("bf16", n, k, 1): {"base_us": 10.0, "best_us": 5.0, "best": object()} for n, k in shapes}
    (line,) = tune.model_summary(["qwen3-30b-a3b"], [1], ["bf16"], [1], results)
    today = 3 * 10.0 * cfg.num_hidden_layers / 1e3  # qkv, o and the router in each of the 48 layers
    assert f"today {today:.3f} ms" in line


def test_merge_keeps_other_shapes_and_replaces_retuned_ones():
    kept = {"_meta": {"quick": True}, "bf16": {"1,2": {"1": "cublas"}, "3,4": {"1": "cublas", "16": "cublas"}},
            "fp8": {"5,6": {"1": "w8a8"}}}
    tuned = {"bf16": {"3,4": {"1": {"BLOCK_N": 8}}, "7,8": {"1": "cublas"}}}
    assert tune.merge_tables(kept, tuned) == {  # (a run that tuned M=1 only keeps the shape's other buckets)
        "bf16": {"1,2": {"1": "cublas"}, "3,4": {"1": {"BLOCK_N": 8}, "16": "cublas"}, "7,8": {"1": "cublas"}},
        "fp8": {"5,6": {"1": "w8a8"}}}
    assert kept["bf16"]["3,4"] == {"1": "cublas", "16": "cublas"}  # the input is not modified

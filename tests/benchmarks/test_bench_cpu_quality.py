"""benchmarks/bench_cpu_quality.py's measures and choice (no model: made-up logprobs and results)."""

from __future__ import annotations

import torch

from benchmarks import bench_cpu_quality as q


def test_compare_logprobs_counts_agreement_and_errors():
    ref = torch.log_softmax(torch.tensor([[2.0, 1.0, 0.0], [0.0, 3.0, 1.0]]), -1)
    got = torch.log_softmax(torch.tensor([[2.0, 1.0, 0.0], [3.0, 0.0, 1.0]]), -1)  # row 1's argmax moved
    out = q.summarize([q.compare_logprobs(ref, got, [0, 1])])
    assert out["tokens"] == 2 and out["greedy_agreement"] == 0.5
    assert out["logprob_err_max"] > 1.0 and out["kl_mean"] > 0
    same = q.summarize([q.compare_logprobs(ref, ref, [0, 1])])
    assert same["greedy_agreement"] == 1.0 and same["logprob_err_max"] == 0.0 and abs(same["kl_mean"]) < 1e-6


def _result(passes: bool, bs1: float, prefill: float) -> dict:
    return {"gate": {"pass": passes}, "speed": {"decode_bs1_tok_s": bs1, "prefill_tok_s": prefill}}


def test_the_default_is_the_fastest_format_that_passes_the_gate():
    results = {"float32": _result(True, 10, 100), "bfloat16": _result(True, 20, 200),
               "int4": _result(False, 40, 300)}
    assert q.choose_default(results) == "bfloat16"  # int4 is faster but misses the gate


def test_a_slow_prefill_loses_the_default():
    results = {"float32": _result(True, 10, 100), "float16": _result(True, 30, 70)}  # prefill 30% slower
    assert q.choose_default(results) == "float32"


def test_readme_answers_are_scored_by_an_expected_word():
    assert q.is_correct("The capital of France is Paris.", ["Paris"])
    assert not q.is_correct("L'Étoile, la Marseillaise", ["Paris"])

"""probe_two_batch_extend's CPU-side parts: its micro-batches, its arguments, its refusal without CUDA."""

from __future__ import annotations

import pytest

from benchmarks import probe_two_batch_extend as probe


def test_micro_batches_split_one_requests_extend_over_growing_prefixes():
    assert probe.micro_batches(128, 2) == [(64, 0), (64, 64)]
    assert probe.micro_batches(128, 4) == [(32, 0), (32, 32), (32, 64), (32, 96)]


@pytest.mark.parametrize("splits", [["3"], ["1"], ["2", "5"]])
def test_splits_must_divide_the_tokens(splits, capsys):
    with pytest.raises(SystemExit):
        probe.parse_args(["--tokens", "128", "--splits", *splits])
    assert "--splits" in capsys.readouterr().err


def test_refuses_without_cuda(monkeypatch, capsys):
    monkeypatch.setattr(probe.torch.cuda, "is_available", lambda: False)
    assert probe.main([]) == 2
    assert "needs a CUDA device" in capsys.readouterr().err

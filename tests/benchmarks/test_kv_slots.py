"""benchmarks/kv_slots.py without a GPU: it refuses (exit 2, one line) instead of sizing a cache from CPU memory."""

from __future__ import annotations


def test_kv_slots_refuses_without_cuda(monkeypatch, capsys):
    from benchmarks import kv_slots

    monkeypatch.setattr(kv_slots.torch.cuda, "is_available", lambda: False)
    assert kv_slots.main([]) == 2
    assert "needs a CUDA device" in capsys.readouterr().err

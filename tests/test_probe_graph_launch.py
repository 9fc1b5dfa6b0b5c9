"""probe_graph_launch's CPU-side part: its refusal without a GPU (the probe itself runs on the device)."""

from __future__ import annotations

from benchmarks import probe_graph_launch as probe


def test_refuses_without_cuda(monkeypatch, capsys):
    monkeypatch.setattr(probe.torch.cuda, "is_available", lambda: False)
    assert probe.main(["--kernels", "4"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "needs a CUDA device" in err

"""The probes' CPU-side part: their refusal without a GPU (the probes themselves run on the device)."""

from __future__ import annotations

from benchmarks import probe_graph_launch as probe


def test_refuses_without_cuda(monkeypatch, capsys):
    monkeypatch.setattr(probe.torch.cuda, "is_available", lambda: False)
    assert probe.main(["--kernels", "4"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "needs a CUDA device" in err


def test_fp8_gemv_probe_refuses_without_cuda(monkeypatch, capsys):
    from benchmarks import probe_fp8_gemv_f16acc as fp8_probe

    monkeypatch.setattr(fp8_probe.torch.cuda, "is_available", lambda: False)
    assert fp8_probe.main([]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "needs a CUDA device" in err


def test_l2_prefetch_probe_refuses_without_cuda(monkeypatch, capsys):
    from benchmarks import probe_l2_prefetch as l2_probe

    monkeypatch.setattr(l2_probe.torch.cuda, "is_available", lambda: False)
    assert l2_probe.main([]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "needs a CUDA device" in err


def test_medium_m_gemm_probe_refuses_without_cuda(monkeypatch, capsys):
    from benchmarks import probe_medium_m_gemm as mm_probe

    monkeypatch.setattr(mm_probe.torch.cuda, "is_available", lambda: False)
    assert mm_probe.main([]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "needs a CUDA device" in err

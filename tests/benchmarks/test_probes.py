"""The probes' CPU-side part: their refusal without a GPU (the probes themselves run on the device)."""

from __future__ import annotations

import importlib

import pytest


@pytest.mark.parametrize("name,argv", [
    ("probe_graph_launch", ["--kernels", "4"]),
    ("probe_fp8_gemv_f16acc", []),
    ("probe_l2_prefetch", []),
    ("probe_medium_m_gemm", []),
    ("probe_fp8_mma_gemv", []),
    ("probe_persistent_layer", []),
    ("probe_tma_gemv", []),
    ("probe_fp8_kv_qk", []),
    ("probe_pdl_oproj", []),
    ("probe_pdl_step", []),
    ("probe_fused_mlp", []),
])
def test_refuses_without_cuda(monkeypatch, capsys, name, argv):
    probe = importlib.import_module(f"benchmarks.{name}")
    monkeypatch.setattr(probe.torch.cuda, "is_available", lambda: False)
    assert probe.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and f"{name} needs a CUDA device" in err

"""benchmarks/kernels/bench_fused_ops.py without a GPU: unknown shapes and token counts are refused in one line, and
it refuses to run without CUDA (exit 2) instead of timing anything on the CPU."""

from __future__ import annotations

import pytest

from benchmarks.kernels import bench_fused_ops as bf


def test_shapes_parse_or_are_refused(capsys):
    assert bf.parse_shape("8b") == "8b" and bf.parse_shape("qwen3-30b-a3b") == "qwen3-30b-a3b"
    with pytest.raises(SystemExit):
        bf.main(["--shapes", "70b"])
    assert "unknown shape '70b'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bf.main(["--tokens", "0"])
    assert "--tokens must be positive" in capsys.readouterr().err


def test_refuses_without_cuda(monkeypatch, capsys):
    monkeypatch.setattr(bf.torch.cuda, "is_available", lambda: False)
    assert bf.main([]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "needs a CUDA device" in err


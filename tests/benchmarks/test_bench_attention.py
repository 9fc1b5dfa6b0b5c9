"""benchmarks/kernels/bench_attention.py without a GPU: its arguments are checked in one line, and it refuses to run
without CUDA (exit 2, one line) instead of timing anything on the CPU."""

from __future__ import annotations

import argparse

import pytest

from benchmarks.kernels import bench_attention as ba


def test_points_and_heads_parse_or_are_refused():
    assert ba.parse_point("256x520") == (256, 520)
    assert ba.parse_heads("32,8,128") == (32, 8, 128)
    for bad in ("256", "0x5", "ax2"):
        with pytest.raises(argparse.ArgumentTypeError, match="BATCHxCONTEXT"):
            ba.parse_point(bad)
    with pytest.raises(argparse.ArgumentTypeError, match="not a multiple"):
        ba.parse_heads("32,6,128")
    with pytest.raises(argparse.ArgumentTypeError, match="NUM_HEADS"):
        ba.parse_heads("32,8")


def test_refuses_without_cuda(monkeypatch, capsys):
    monkeypatch.setattr(ba.torch.cuda, "is_available", lambda: False)
    assert ba.main([]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "needs a CUDA device" in err


def test_combine_and_plan_only_are_refused_together(capsys):
    with pytest.raises(SystemExit) as exc:
        ba.main(["--combine", "--plan-only"])
    assert exc.value.code == 2
    assert "--combine and --plan-only are separate runs" in capsys.readouterr().err


def test_kv_dtype_is_refused_outside_the_decode_rows(capsys):
    with pytest.raises(SystemExit) as exc:
        ba.main(["--kv-dtype", "fp8_e4m3"])
    assert exc.value.code == 2
    assert "--kv-dtype is for the decode rows" in capsys.readouterr().err

"""benchmarks/kernels/bench_all_reduce.py without GPUs: its arguments are checked in one line, and it refuses to run
without enough CUDA devices (exit 2, one line) instead of timing anything on the CPU."""

from __future__ import annotations

import pytest

from benchmarks.kernels import bench_all_reduce as bar


def test_tiles_parse():
    assert bar.parse_args(["--tiles", "512x4", "2048x8"]).tiles == [(512, 4), (2048, 8)]


@pytest.mark.parametrize("argv, message", [
    (["--tiles", "500x4"], "--tiles: BLOCK a power of two"),
    (["--tiles", "512"], "--tiles: BLOCK a power of two"),
    (["--tiles", "axb"], "--tiles: BLOCKxWARPS pairs"),
    (["--world-size", "1"], "--world-size must be at least 2"),
    (["--rows", "0"], "must be positive"),
])
def test_bad_arguments_name_the_flag(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        bar.parse_args(argv)
    assert exc.value.code == 2 and message in capsys.readouterr().err


def test_refuses_without_the_gpus(monkeypatch, capsys):
    monkeypatch.setattr(bar.torch.cuda, "device_count", lambda: 1)
    assert bar.main([]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "needs 2 CUDA devices, 1 visible" in err

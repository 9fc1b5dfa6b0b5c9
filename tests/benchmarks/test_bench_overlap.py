"""bench_overlap's repeated C=64 runs: the reported run is the median one; a repeat count below 1 is refused."""

from __future__ import annotations

import pytest

from benchmarks import bench_overlap


def test_median_run_is_the_middle_one():
    runs = [{"tok": 30, "id": "a"}, {"tok": 10, "id": "b"}, {"tok": 20, "id": "c"}]
    assert bench_overlap.median_run(runs, "tok")["id"] == "c"
    assert bench_overlap.median_run(runs[:2], "tok")["id"] == "b"  # even count: the lower middle
    assert bench_overlap.median_run(runs[:1], "tok")["id"] == "a"


def test_c64_repeats_below_one_is_refused(capsys, tmp_path):
    with pytest.raises(SystemExit) as exc:
        bench_overlap.main(["--c64-repeats", "0", "--out", str(tmp_path)])
    assert exc.value.code == 2 and "--c64-repeats must be at least 1" in capsys.readouterr().err

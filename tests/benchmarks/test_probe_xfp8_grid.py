"""probe_xfp8_grid's choice of a bucket's table entry (CPU: the rule, not the timings)."""

from __future__ import annotations

import pytest

from benchmarks.probe_xfp8_grid import bucket_choice


def test_a_bucket_takes_the_config_best_across_its_row_counts_not_at_one():
    # "a" is fastest at 64 rows, "b" at 40; over both, b is within 2% and a 25% off: b serves the bucket better
    by_m = {40: ({"a": 10.0, "b": 8.0}, 12.0), 64: ({"a": 10.0, "b": 10.4}, 12.0)}
    best, score, table = bucket_choice(by_m)
    assert best == "b"
    assert score == pytest.approx((1.0 + 1.04) / 2)
    assert table == pytest.approx((12.0 / 8.0 + 12.0 / 10.0) / 2)  # the table entry, scored the same way

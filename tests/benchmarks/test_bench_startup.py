"""bench_startup's summary: per phase the median of all starts, the first (cold) start's and the warm
starts' median, with the unaccounted rest and the client's ready time; its table."""

from __future__ import annotations

from benchmarks.bench_startup import format_table, summarize


def run(total: float, ready: float, **phases: float) -> dict:
    return {"startup": {**phases, "total": total}, "ready (client)": ready}


RUNS = [run(10.0, 11.0, imports=3.0, weights=2.0, compile=4.0),  # cold: the compile fills the caches
        run(5.0, 6.0, imports=2.0, weights=1.5, compile=0.5),
        run(6.0, 6.5, imports=2.5, weights=1.0, compile=1.0)]


def test_median_cold_and_warm_per_phase():
    rows = {r["phase"]: r for r in summarize(RUNS)}
    assert list(rows) == ["imports", "weights", "compile", "unaccounted", "total", "ready (client)"]
    assert rows["compile"] == {"phase": "compile", "median_s": 1.0, "cold_s": 4.0, "warm_s": 0.75}
    assert rows["imports"] == {"phase": "imports", "median_s": 2.5, "cold_s": 3.0, "warm_s": 2.25}
    assert rows["unaccounted"] == {"phase": "unaccounted", "median_s": 1.0, "cold_s": 1.0, "warm_s": 1.25}
    assert rows["ready (client)"]["median_s"] == 6.5 and rows["total"]["warm_s"] == 5.5


def test_a_phase_missing_from_a_run_and_a_single_run():
    rows = {r["phase"]: r for r in summarize([RUNS[0], run(4.0, 4.5, imports=2.0, weights=1.0)])}
    assert rows["compile"] == {"phase": "compile", "median_s": 4.0, "cold_s": 4.0, "warm_s": None}
    rows = summarize(RUNS[:1])
    assert [r["warm_s"] for r in rows] == [None] * len(rows)


def test_table():
    lines = format_table(summarize(RUNS), 3).splitlines()
    assert lines[0].split("  ")[0].strip() == "phase" and "median of 3 s" in lines[0]
    assert lines[3].split() == ["compile", "1.00", "4.00", "0.75"]
    assert lines[-1].split() == ["ready", "(client)", "6.50", "11.00", "6.25"]
    assert format_table(summarize(RUNS[:1]), 1).splitlines()[1].split() == ["imports", "3.00", "3.00", "-"]

"""The start-up timeline from the launcher's and the children's perf_counter readings, without processes."""

from __future__ import annotations

from server.startup_timeline import StartupClock, largest_phases, timeline_line


def test_phases_in_order_from_the_readings():
    clock = StartupClock(began=100.0, spawned=101.0, children_ready=109.5,
                         child_started={"at": 101.25, "imported_at": 103.0},
                         engine={"phases": {"weights": 2.5, "decode_graphs": 1.5, "tokenizer": 0.5},
                                 "ready_at": 109.0})
    t = clock.timeline(serving_at=110.0)
    assert t == {"launcher": 1.0, "spawn": 0.25, "imports": 1.75, "weights": 2.5, "decode_graphs": 1.5,
                 "tokenizer": 0.5, "engine_setup": 1.5, "http_start": 0.5, "total": 10.0}
    assert largest_phases(t) == "startup=10.0s (weights 2.5s, imports 1.8s, decode_graphs 1.5s)"
    assert timeline_line(t).startswith("start-up timeline: launcher 1.00s, spawn 0.25s, imports 1.75s, weights")


def test_rounding_keeps_the_phases_within_the_total():
    """Whole microseconds: phases rounded down, the total up, so spans that touch still add up to at most it."""
    clock = StartupClock(began=0.0, spawned=1 / 3, children_ready=2 / 3,
                         child_started={"at": 0.4000004, "imported_at": 0.5000004},
                         engine={"phases": {"weights": 0.1000004}, "ready_at": 0.6666669})
    t = clock.timeline(serving_at=1.0000004)
    total = t.pop("total")
    assert sum(t.values()) <= total == 1.000001


def test_a_fake_scheduler_gives_only_the_launcher_phases():
    clock = StartupClock(began=0.0, spawned=0.5, children_ready=1.5)
    assert clock.timeline(serving_at=2.0) == {"launcher": 0.5, "http_start": 0.5, "total": 2.0}
    assert largest_phases({"total": 2.0}) == "startup=2.0s"

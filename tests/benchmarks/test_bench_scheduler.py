"""bench_scheduler's json_schema mode: the constrained share of the running requests really decodes
under the grammar, with the full vocabulary, and the breakdown names the grammar's phases and the host time."""

from __future__ import annotations

import json

from benchmarks import bench_scheduler


def test_json_schema_mode_runs_constrained_rows(tmp_path):
    out = tmp_path / "r.json"
    assert bench_scheduler.main(["--running", "4", "--steps", "2", "--overlap", "--json-schema-ratio", "0.5",
                                 "--breakdown", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["vocab_size"] == 128256 and r["constrained_running"] == 2
    phases = r["phases_median_ms"]
    assert {"grammar accept", "grammar fill", "apply (device)", "host"} <= phases.keys()
    assert phases["grammar fill"] > 0 and phases["host"] < phases["total"]

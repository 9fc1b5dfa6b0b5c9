"""ab_tables' plumbing on the CPU: the loader pointed at each table in turn, every table timed at every batch
size in every round (alternating), the summary's medians and changes, and its refusals."""

from __future__ import annotations

import json

import pytest

from benchmarks.tuning import ab_tables


def test_table_in_use_points_the_loader_at_the_file(tmp_path):
    from model_executor.layers.triton_ops import small_m_gemm as sm

    table = tmp_path / "t.json"
    table.write_text(json.dumps({"bf16": {"32,64": {"1": {"BLOCK_N": 8, "BLOCK_K": 64, "GEMV": True}}}}))
    before = sm.choose_config(1, 32, 64, "bf16", "cpu")
    with ab_tables.table_in_use(table):
        assert sm.choose_config(1, 32, 64, "bf16", "cpu") == sm.GemmConfig(8, 64, GEMV=True)
    assert sm.choose_config(1, 32, 64, "bf16", "cpu") == before is None  # (no table for "cpu" in the repo)


def test_summary_gives_each_tables_median_and_its_change_against_the_first():
    rows = [{"table": t, "batch_size": bs, "b2b_ms": ms} for t, bs, ms in
            [("a", 1, 1.0), ("b", 1, 0.9), ("a", 1, 1.2), ("b", 1, 0.96), ("a", 1, 1.1), ("b", 1, 0.93),
             ("a", 2, 2.0), ("b", 2, 2.2)]]
    summary = ab_tables.summarize(rows, ["a", "b"])
    assert [(s["table"], s["batch_size"], s["median_ms"], s["change"]) for s in summary] == [
        ("a", 1, 1.1, 0.0), ("b", 1, 0.93, round(0.93 / 1.1 - 1, 4)), ("a", 2, 2.0, 0.0), ("b", 2, 2.2, 0.1)]
    assert summary[1]["b2b_ms"] == [0.9, 0.96, 0.93]


def test_every_table_is_timed_at_every_batch_size_in_every_round(tiny_llama, tmp_path, monkeypatch):
    tables = []
    for name in ("a", "b"):
        (tmp_path / f"{name}.json").write_text("{}")
        tables.append(str(tmp_path / f"{name}.json"))
    entered = []
    real = ab_tables.table_in_use
    monkeypatch.setattr(ab_tables, "table_in_use", lambda path: entered.append(path) or real(path))
    out = tmp_path / "out.json"
    assert ab_tables.main(["--model-path", str(tiny_llama[0]), "--tables", *tables, "--batch-size", "2", "1",
                           "--input-len", "8", "--output-len", "4", "--rounds", "2", "--device", "cpu",
                           "--json", str(out)]) == 0
    assert entered == tables * 2
    report = json.loads(out.read_text())
    assert [(r["round"], r["table"], r["batch_size"]) for r in report["runs"]] == [
        (rnd, t, bs) for rnd in range(2) for t in tables for bs in (1, 2)]
    assert all(r["b2b_ms"] > 0 and r["graph_vs_eager_max_abs_diff"] == 0 for r in report["runs"])
    assert [(s["table"], s["batch_size"], len(s["b2b_ms"])) for s in report["summary"]] == [
        (tables[0], 1, 2), (tables[1], 1, 2), (tables[0], 2, 2), (tables[1], 2, 2)]
    assert report["graphs"] is False and report["summary"][0]["change"] == 0.0


@pytest.mark.parametrize("tables,message", [
    (["one.json"], "two or more files"),
    (["missing.json", "a.json"], "missing.json is not a readable JSON table"),
    (["list.json", "a.json"], "list.json is not a small-M config table"),
])
def test_refuses_bad_tables(tmp_path, monkeypatch, capsys, tables, message):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a.json").write_text("{}")
    (tmp_path / "one.json").write_text("{}")
    (tmp_path / "list.json").write_text("[]")
    with pytest.raises(SystemExit) as e:
        ab_tables.parse_args(["--tables", *tables])
    assert e.value.code == 2 and message in capsys.readouterr().err

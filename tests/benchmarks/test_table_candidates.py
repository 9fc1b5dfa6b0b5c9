"""table_candidates: the tuner's runners-up ranked by what they cost the step, one changed entry per candidate
table, and its refusals."""

from __future__ import annotations

import json

import pytest

from benchmarks.tuning import table_candidates as tc
from model_executor.layers.triton_ops import small_m_gemm_config as smc

FUSED_GEMV = {"BLOCK_N": 8, "BLOCK_K": 256, "SPLIT_K": 1, "num_warps": 4, "num_stages": 4, "GEMV": True,
              "X_FP8": False, "FUSE": True}
PLAIN_GEMV = {**FUSED_GEMV, "FUSE": False}
SPLIT_DOT = {"BLOCK_N": 64, "BLOCK_K": 128, "SPLIT_K": 4, "num_warps": 4, "num_stages": 4, "GEMV": False,
             "X_FP8": False, "FUSE": None}
PAIRED_DOT = {**SPLIT_DOT, "BLOCK_N": 128, "SPLIT_K": 1, "FUSE": True}
# A fused layer's case as the tuner's --json writes it: the plain forms pay the neighbours' 5 us.
CASE = {"base_us": 11.5, "best_us": 10.0, "default_us": 14.0, "neighbour_us": 5.0,
        "all": [[10.0, FUSED_GEMV], [6.0, PLAIN_GEMV], [6.4, SPLIT_DOT], [6.6, SPLIT_DOT], [10.8, PAIRED_DOT]]}
TIMINGS = {"bf16,28672,4096,2": CASE}


def test_choices_are_ranked_by_what_they_cost_the_step():
    # fused: its own time; plain and split: + the neighbours; a config timed twice: its faster time; cuBLAS: base_us
    assert tc.ranked(CASE, "bf16") == [(10.0, FUSED_GEMV), (10.8, PAIRED_DOT), (11.0, PLAIN_GEMV),
                                       (11.4, SPLIT_DOT), (11.5, "cublas")]


def test_a_fused_layers_default_config_timed_fused_is_proposed_as_fused():
    default = {**PAIRED_DOT, "BLOCK_N": 32, "FUSE": None}  # (the tuner times its default as it runs: fused)
    case = {**CASE, "fusion": "gate_up", "all": [[9.0, default]]}
    assert tc.ranked(case, "bf16")[0] == (9.0, {**default, "FUSE": True})
    plain_layer = {**case, "fusion": None, "neighbour_us": 0.0}  # a layer that fuses nothing: as timed
    assert tc.ranked(plain_layer, "bf16")[0] == (9.0, default)


def test_candidates_skip_the_tables_own_entry_and_stop_at_top():
    defaults_absent = {k: v for k, v in FUSED_GEMV.items() if k != "X_FP8"}  # (the same config, written shorter)
    table = {"bf16": {"28672,4096": {"2": defaults_absent}}}
    assert tc.candidates(table, TIMINGS, ("bf16", 28672, 4096, 2), top=2) == [
        ("bf16_28672x4096_m2_1", PAIRED_DOT, 10.8), ("bf16_28672x4096_m2_2", PLAIN_GEMV, 11.0)]
    table["bf16"]["28672,4096"]["2"] = "cublas"
    assert [e for _, e, _ in tc.candidates(table, TIMINGS, ("bf16", 28672, 4096, 2), top=9)] == [
        FUSED_GEMV, PAIRED_DOT, PLAIN_GEMV, SPLIT_DOT]


def test_main_writes_one_table_per_candidate_each_changing_one_entry(tmp_path):
    base = {"_meta": {"gpu": "x"}, "bf16": {"28672,4096": {"1": FUSED_GEMV, "2": FUSED_GEMV},
                                            "6144,4096": {"2": "cublas"}}}
    (tmp_path / "base.json").write_text(json.dumps(base))
    (tmp_path / "tune.json").write_text(json.dumps({"timings": TIMINGS}))
    out = tmp_path / "cands"
    assert tc.main(["--timings", str(tmp_path / "tune.json"), "--table", str(tmp_path / "base.json"),
                    "--case", "bf16,28672,4096,2", "--top", "2", "--out-dir", str(out)]) == 0
    files = sorted(out.iterdir())
    assert [f.name for f in files] == ["bf16_28672x4096_m2_1.json", "bf16_28672x4096_m2_2.json"]
    for f, entry in zip(files, (PAIRED_DOT, PLAIN_GEMV)):
        cand = json.loads(f.read_text())
        assert cand["bf16"]["28672,4096"]["2"] == entry
        cand["bf16"]["28672,4096"]["2"] = FUSED_GEMV
        assert {key: v for key, v in cand.items() if key != "_meta"} == {k: v for k, v in base.items() if k != "_meta"}
        assert cand["_meta"]["candidate"] == {"case": "bf16,28672,4096,2", "entry": entry}
        assert smc.parse_entry(entry) == smc.GemmConfig(**entry)  # (the loader takes it)


@pytest.mark.parametrize("case,message", [
    ("bf16,28672,4096", "a case is kind,N,K,M"),
    ("bf16,28672,x,2", "a case is kind,N,K,M"),
    ("bf16,28672,4096,2,1", "positive sizes"),
    ("bf16,6144,4096,2", "the timings have no case bf16,6144,4096,2 (they have bf16,28672,4096,2)"),
])
def test_bad_cases_are_refused_with_a_one_line_message(tmp_path, capsys, case, message):
    (tmp_path / "tune.json").write_text(json.dumps({"timings": TIMINGS}))
    with pytest.raises(SystemExit) as e:
        tc.main(["--timings", str(tmp_path / "tune.json"), "--case", case, "--out-dir", str(tmp_path / "o")])
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_a_file_that_is_not_a_tuner_json_is_refused(tmp_path, capsys):
    (tmp_path / "tune.json").write_text(json.dumps({"bf16": {}}))  # a table, not the tuner's --json
    with pytest.raises(SystemExit) as e:
        tc.main(["--timings", str(tmp_path / "tune.json"), "--case", "bf16,1,2,3", "--out-dir", str(tmp_path)])
    assert e.value.code == 2 and "not a table and a tuner --json file" in capsys.readouterr().err

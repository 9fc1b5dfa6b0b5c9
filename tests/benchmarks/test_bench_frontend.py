"""benchmarks/bench_frontend.py end to end on the smallest shape's dummy tokenizer: the real HTTP and detokenizer processes, the
stand-in scheduler and bench_serving deliver every token, and the accounting adds up."""

from __future__ import annotations

import json

from benchmarks import bench_frontend
from benchmarks.make_dummy_model import make_dummy_model
from tests.fake_scheduler import free_port


def test_bench_frontend_delivers_every_token_and_writes_the_table(tmp_path, capsys):
    model = make_dummy_model("smollm2-135m", tmp_path / "m")
    out = tmp_path / "fe.json"
    assert bench_frontend.main(["--model-path", str(model), "--streams", "4", "--num-prompts", "8", "--input-len", "16",
                                "--output-len", "8", "--step-ms", "2", "--repeat", "1", "--port", str(free_port()),
                                "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    (run,) = res["runs"]
    assert (run["failed"], run["tokens"]) == (0, 8 * 8)  # every request got all its output_len tokens
    assert 0 < run["events_per_token"] <= 1
    assert set(run["cpu_s_per_1k_tokens"]) == {"http", "detokenizer", "scheduler", "client"}
    # CPU times tick in 10 ms: the HTTP process and the client (the busiest) show some, the others may not.
    assert run["cpu_s_per_1k_tokens"]["http"] > 0 and run["cpu_s_per_1k_tokens"]["client"] > 0
    assert "CPU s / 1k tok" in capsys.readouterr().out

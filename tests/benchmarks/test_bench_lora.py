"""bench_lora on the CPU with a tiny model: its table's rows and JSON; the random adapters it writes load with the
model's shapes; its base (LoRA layers detached) runs the model without adapters."""

from __future__ import annotations

import json

import torch

from benchmarks import bench_lora
from model_executor.forward_batch import ForwardMode
from model_executor.lora.manager import LoraConfig
from model_executor.model_config import ModelConfig
from runners.model_runner import ModelRunner, RunnerConfig


def test_smoke_table_and_json(tiny_llama, tmp_path, capsys):
    out = tmp_path / "lora.json"
    assert bench_lora.main(["--model-path", str(tiny_llama[0]), "--batch-size", "1", "3", "--num-adapters", "2",
                            "--rank", "4", "--extend-len", "24", "--context-len", "8", "--repeats", "2",
                            "--steps", "1", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    got = {(r["kind"], r["size"], r["config"]) for r in data["rows"]}
    configs = ("base", "lora, no adapter", "1 adapter", "2 adapters")
    assert got == {("decode", bs, c) for bs in (1, 3) for c in configs} | {("extend", 24, "base"),
                                                                          ("extend", 24, "1 adapter")}
    for r in data["rows"]:
        assert len(r["runs_ms"]) == 2 and r["ms"] > 0
        assert r["path"] == f"{r['kind']}_eager"
        if r["config"] == "base":
            assert r["ratio"] == 1.0
    assert data["meta"]["lora_backend"] == "torch" and data["meta"]["rank"] == 4
    assert "x base" in capsys.readouterr().out


def test_adapters_fit_the_model_and_the_switch_detaches_them(tiny_llama, tmp_path):
    cfg = ModelConfig.from_pretrained(str(tiny_llama[0]))
    adapters = bench_lora.write_adapters(tmp_path, cfg, 2, rank=4)
    runner = ModelRunner(RunnerConfig(model_path=str(tiny_llama[0]), max_running_requests=4, max_total_tokens=256,
                                      disable_cuda_graph=True, lora=LoraConfig(paths=tuple(adapters),
                                                                               max_per_batch=2, max_rank=4)))
    assert runner.lora.max_rank == 4 and len(runner.lora.target_modules) == 7
    switch = bench_lora.LoraSwitch(runner)
    row = runner.req_to_token_pool.alloc()
    loc = runner.allocator.alloc(6)
    runner.req_to_token_pool.write(row, 0, loc)

    def logits(on: bool, name: str | None) -> torch.Tensor:
        switch.set(on)
        slots = runner.lora.prepare([runner.lora.uid(name) if name else None]) if on else None
        with torch.inference_mode():
            return runner.forward(runner.build_batch(ForwardMode.EXTEND, [5, 9, 33, 7, 2, 40], [row], [6], loc,
                                                     extend_seq_lens=[6], lora_slots=slots)).clone()

    base, off = logits(False, None), logits(True, None)
    torch.testing.assert_close(off, base)
    a0, a1 = logits(True, "adapter0"), logits(True, "adapter1")
    assert not torch.allclose(a0, base, atol=1e-4) and not torch.allclose(a0, a1, atol=1e-4)
    torch.testing.assert_close(logits(False, None), base)  # detached again: the adapters have no effect

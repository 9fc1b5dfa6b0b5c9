"""Our model on tiny random Llama/Qwen2 configs matches HF transformers on the same weights (float32)."""

from __future__ import annotations

import pytest
import torch

from model_executor.forward_batch import ForwardMode
from runners.model_runner import ModelRunner, RunnerConfig


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def hf_last_logits(hf_model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(torch.tensor([ids])).logits[0, -1].float()


def run_prefill_and_decode(runner: ModelRunner, hf_model, prompts: list[list[int]], decode_steps: int):
    """Prefill all prompts in one extend batch, then decode greedily; compare logits with HF each step."""
    rows = [runner.req_to_token_pool.alloc() for _ in prompts]
    seqs = [list(p) for p in prompts]
    out_loc = runner.allocator.alloc(sum(len(p) for p in prompts))
    start = 0
    for row, p in zip(rows, prompts):
        runner.req_to_token_pool.write(row, 0, out_loc[start : start + len(p)])
        start += len(p)
    fb = runner.build_batch(ForwardMode.EXTEND, [t for p in prompts for t in p], rows, [len(p) for p in prompts],
                            out_loc, extend_seq_lens=[len(p) for p in prompts])
    logits = runner.forward(fb)
    errors = [max(rel_err(logits[i], hf_last_logits(hf_model, s)) for i, s in enumerate(seqs))]
    for _ in range(decode_steps):
        next_ids = logits.argmax(-1).tolist()
        for s, t in zip(seqs, next_ids):
            s.append(t)
        loc = runner.allocator.alloc(len(seqs))
        for i, (row, s) in enumerate(zip(rows, seqs)):
            runner.req_to_token_pool.write(row, len(s) - 1, loc[i : i + 1])
        fb = runner.build_batch(ForwardMode.DECODE, next_ids, rows, [len(s) for s in seqs], loc)
        logits = runner.forward(fb)
        errors.append(max(rel_err(logits[i], hf_last_logits(hf_model, s)) for i, s in enumerate(seqs)))
    return errors


@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_qwen2", "tiny_llama3"])
def test_logits_match_hf(fixture, request):
    path, hf_model = request.getfixturevalue(fixture)
    runner = ModelRunner(RunnerConfig(model_path=str(path), max_running_requests=4, max_total_tokens=512))
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 320, (n,), generator=gen).tolist() for n in (7, 1, 23)]
    errors = run_prefill_and_decode(runner, hf_model, prompts, decode_steps=6)
    assert max(errors) < 1e-4, errors


def test_prefix_extend_matches_full_prefill(tiny_llama):
    """An extend on top of a cached prefix gives the same logits as prefilling everything at once."""
    path, hf_model = tiny_llama
    runner = ModelRunner(RunnerConfig(model_path=str(path), max_running_requests=2, max_total_tokens=128))
    ids = list(range(5, 40))
    row = runner.req_to_token_pool.alloc()
    loc = runner.allocator.alloc(len(ids))
    runner.req_to_token_pool.write(row, 0, loc)
    runner.forward(runner.build_batch(ForwardMode.EXTEND, ids[:20], [row], [20], loc[:20], extend_seq_lens=[20]))
    logits = runner.forward(runner.build_batch(ForwardMode.EXTEND, ids[20:], [row], [len(ids)], loc[20:],
                                               extend_seq_lens=[len(ids) - 20]))
    assert rel_err(logits[0], hf_last_logits(hf_model, ids)) < 1e-4


def test_unsupported_architecture_is_named(tmp_path):
    import json

    from model_executor.model_config import ModelConfig, ModelConfigError

    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPTNeoXForCausalLM"]}))
    with pytest.raises(ModelConfigError, match="GPTNeoXForCausalLM"):
        ModelConfig.from_pretrained(tmp_path)
    with pytest.raises(ModelConfigError, match="not a folder"):
        ModelConfig.from_pretrained(tmp_path / "nope")


def test_missing_weights_are_reported(tmp_path, tiny_llama):
    import shutil

    from safetensors.torch import load_file, save_file

    from model_executor.weight_loader import WeightLoadError

    path, _ = tiny_llama
    shutil.copy(path / "config.json", tmp_path / "config.json")
    tensors = load_file(path / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(WeightLoadError, match="up_proj|gate_up_proj"):
        ModelRunner(RunnerConfig(model_path=str(tmp_path), max_running_requests=1, max_total_tokens=16))
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(WeightLoadError, match="no \\*.safetensors"):
        ModelRunner(RunnerConfig(model_path=str(tmp_path), max_running_requests=1, max_total_tokens=16))

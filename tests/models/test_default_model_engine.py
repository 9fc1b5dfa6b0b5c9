"""The engine on the converted default model: greedy tokens equal HF transformers' generate; the CLI."""

from __future__ import annotations

import subprocess
import sys

import torch

from model_executor.sampling_params import SamplingParams
from runners.model_runner import ModelRunner, RunnerConfig
from scheduler.scheduler import Scheduler, SchedulerConfig
from server.generate import generate

PROMPTS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
    "The three primary colors are",
]


def hf_greedy(hf, prompts: list[list[int]], n: int) -> list[list[int]]:
    """HF greedy decoding of all prompts in one left-padded batch that, like ignore_eos, keeps going past
    EOS (generate's min_new_tokens would instead forbid EOS, a different sequence)."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    out = hf.generate(ids, attention_mask=mask, max_new_tokens=n, do_sample=False, eos_token_id=None,
                      pad_token_id=0)
    return out[:, width:].tolist()


def test_greedy_tokens_equal_hf_generate(model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    encoded = []
    for p in PROMPTS:
        if isinstance(p, list):
            ids = tok.apply_chat_template(p, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
        else:
            ids = tok.encode(p)
        encoded.append(list(ids))
    runner = ModelRunner(RunnerConfig(model_path=str(model_dir), max_running_requests=4, max_total_tokens=1024))
    sched = Scheduler(runner, SchedulerConfig(max_running_requests=4), tokenizer=tok)
    for i, ids in enumerate(encoded):
        sched.add_request(str(i), ids, SamplingParams(max_new_tokens=32, temperature=0.0, ignore_eos=True))
    ours = {str(i): [] for i in range(len(encoded))}
    while sched.has_work():
        for o in sched.step():
            ours[o.rid].extend(o.new_token_ids)
    refs = hf_greedy(hf, encoded, 32)
    for i, ref in enumerate(refs):
        assert ours[str(i)] == ref, (i, tok.decode(ours[str(i)]), tok.decode(ref))


def test_generate_answers_paris(model_dir):
    text = generate(str(model_dir), "What is the capital of France?", SamplingParams(max_new_tokens=24,
                    temperature=0.0), chat=True)
    assert "Paris" in text


def test_generate_cli_rejects_bad_temperature(model_dir):
    proc = subprocess.run([sys.executable, "-m", "server.generate", "--prompt", "x", "--temperature", "-1",
                           "--model-path", str(model_dir)], check=False, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2
    assert "temperature" in proc.stderr and "Traceback" not in proc.stderr

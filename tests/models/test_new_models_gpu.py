"""Qwen3, Qwen3-MoE and Mixtral on the GPU (float32, triton attention): the fused kernels inside the real
model (q/k norm + rotary, fused MoE) against HF transformers on the CPU, same tiny random weights.

The triton attention kernels' float32 tl.dot rounds its inputs to TF32 on the GPU, so the tolerance is 1e-2
relative (the CPU tests hold the torch paths to 1e-4). Run: pytest -m gpu tests/models/test_new_models_gpu.py
"""

from __future__ import annotations

import pytest
import torch

from model_executor.forward_batch import ForwardMode
from runners.model_runner import ModelRunner, RunnerConfig
from tests.conftest import save_tiny_hf_model
from tests.models.test_new_models_vs_hf import CONFIGS

pytestmark = pytest.mark.gpu


def hf_logits(hf_model, ids):
    with torch.no_grad():
        return hf_model(torch.tensor([ids])).logits[0, -1].float()


@pytest.mark.parametrize("name", ["qwen3", "qwen3_moe", "mixtral", "llama_rope_yarn"])
def test_gpu_model_matches_hf(name, tmp_path):
    hf_model = save_tiny_hf_model(tmp_path, CONFIGS[name], seed=3)
    runner = ModelRunner(RunnerConfig(model_path=str(tmp_path), device="cuda", dtype="float32",
                                      attention_backend="triton", max_running_requests=4, max_total_tokens=512,
                                      context_length=128, disable_cuda_graph=True, disable_piecewise_cuda_graph=True))
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 320, (n,), generator=gen).tolist() for n in (7, 1, 23)]
    rows = [runner.req_to_token_pool.alloc() for _ in prompts]
    loc = runner.allocator.alloc(sum(len(p) + 4 for p in prompts))
    start, seqs = 0, [list(p) for p in prompts]
    for row, p in zip(rows, prompts):
        runner.req_to_token_pool.write(row, 0, loc[start : start + len(p) + 4])
        start += len(p) + 4
    starts = [sum(len(q) + 4 for q in prompts[:i]) for i in range(len(prompts))]
    ext_loc = torch.cat([loc[b : b + len(p)] for b, p in zip(starts, prompts)])
    logits = runner.forward(runner.build_batch(ForwardMode.EXTEND, [t for p in prompts for t in p], rows,
                                               [len(p) for p in prompts], ext_loc,
                                               extend_seq_lens=[len(p) for p in prompts]))
    for step in range(4):
        for i, s in enumerate(seqs):
            ref = hf_logits(hf_model, s)
            err = ((logits[i].cpu() - ref).norm() / ref.norm()).item()
            assert err < 1e-2, f"{name} step {step} request {i}: relative error {err:.2e}"
        if step == 3:
            break
        next_ids = logits.argmax(-1).tolist()
        for s, t in zip(seqs, next_ids):
            s.append(t)
        dec_loc = torch.stack([loc[b + len(s) - 1] for b, s in zip(starts, seqs)])
        logits = runner.forward(runner.build_batch(ForwardMode.DECODE, next_ids, rows, [len(s) for s in seqs],
                                                   dec_loc))

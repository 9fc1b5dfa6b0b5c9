"""Qwen2.5-VL on the GPU (float32, triton attention): with images in the batch, decode replayed from CUDA graphs
(each request row's M-RoPE offset read inside the graph) gives the tokens the eager runner gives, and the first
step's logits match HF transformers on the CPU (1e-2 relative: the triton kernels' float32 dot rounds to TF32).
Extend batches with images run eagerly; a text-only request in the same server takes the extend graphs.
Run: pytest -m gpu tests/models/test_qwen2_5_vl_gpu.py"""

from __future__ import annotations

import pytest
import torch

from model_executor.sampling_params import SamplingParams
from runners.model_runner import ModelRunner, RunnerConfig
from scheduler.scheduler import Scheduler, SchedulerConfig
from tests.models.test_qwen2_5_vl import PROMPTS, _inputs
from tests.vlm_models import image_inputs, save_tiny_qwen2_5_vl

pytestmark = pytest.mark.gpu

NEW_TOKENS = 16


@pytest.fixture(scope="module")
def tiny_vl(tmp_path_factory, model_dir):
    path = tmp_path_factory.mktemp("tiny_qwen2_5_vl_gpu")
    return path, save_tiny_qwen2_5_vl(path, model_dir)


def _runner(path, graphs: bool) -> ModelRunner:
    return ModelRunner(RunnerConfig(model_path=str(path), device="cuda", dtype="float32", attention_backend="triton",
                                    max_running_requests=4, max_total_tokens=4096, context_length=1024,
                                    disable_cuda_graph=not graphs, cuda_graph_bs=(1, 2, 4) if graphs else (),
                                    disable_piecewise_cuda_graph=not graphs,
                                    piecewise_cuda_graph_tokens=(16, 64, 256) if graphs else ()))


def _run(runner, path, pad_id, logits_out: list | None = None) -> dict[str, list[int]]:
    sched = Scheduler(runner, SchedulerConfig(max_running_requests=4))
    params = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    if logits_out is not None:
        real = runner.forward
        runner.forward = lambda fb: logits_out.append(real(fb).float().cpu()) or logits_out[-1].to(runner.device)
    for name in PROMPTS:
        inputs = _inputs(path, name)
        sched.add_request(name, inputs["input_ids"][0].tolist(), params, images=image_inputs(inputs, pad_id))
    sched.add_request("text", list(range(100, 140)), params)  # a text-only request beside them
    out = {name: [] for name in [*PROMPTS, "text"]}
    while sched.has_work():
        for o in sched.step():
            out[o.rid] += o.new_token_ids
    return out


def test_decode_graphs_with_images_equal_eager_and_hf(tiny_vl):
    path, hf = tiny_vl
    pad_id = hf.config.image_token_id
    logits: list = []
    eager = _run(_runner(path, graphs=False), path, pad_id, logits)
    graph_runner = _runner(path, graphs=True)
    graphed = _run(graph_runner, path, pad_id)
    assert graph_runner.path_counts["decode_graph"] > 0 and graph_runner.path_counts["vision_encoder"] > 0
    assert graphed == eager
    first = logits[0]  # the first extend: the two image prompts and the text prompt, in that order
    for i, name in enumerate(PROMPTS):
        with torch.no_grad():
            ref = hf(**_inputs(path, name)).logits[0, -1].float()
        err = ((first[i] - ref).norm() / ref.norm()).item()
        assert err < 1e-2, f"{name}: relative error {err:.2e}"

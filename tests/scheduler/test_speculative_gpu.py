"""Speculative decoding on the GPU with every graph on: the target's decode and verify graphs (an EAGLE-3
target's giving its aux hidden states), a STANDALONE draft's decode graphs. Tiny random float32 models, triton
attention (TF32 dot products: the verify pass and the decode step round apart, so outputs are not compared with
plain decoding's token for token). Instead every output token must be the target's greedy choice given the
tokens before it, rescored by one eager extend, wherever that choice leads its runner-up by a clear margin; the
verify graphs, the draft's decode graphs and the drafts' acceptance are checked by the counts.

Run: pytest -m gpu tests/scheduler/test_speculative_gpu.py
"""

from __future__ import annotations

import pytest

from model_executor.forward_batch import ForwardMode
from model_executor.sampling_params import SamplingParams
from runners.model_runner import ModelRunner, RunnerConfig
from scheduler.scheduler import Scheduler, SchedulerConfig
from scheduler.speculative import SpeculativeConfig
from tests.conftest import TINY_LLAMA, save_tiny_hf_model
from tests.models.test_eagle3 import eagle3_config, eagle3_tensors, save_eagle3
from tests.scheduler.test_speculative import run_all, workload

pytestmark = pytest.mark.gpu

K = 5  # verified tokens per request and step
SIZES = (1, 2, 4, 8, 16)
MARGIN = 0.05  # logit gap under which TF32 rounding may pick either token


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("spec_gpu")
    save_tiny_hf_model(root / "target", dict(TINY_LLAMA, num_hidden_layers=4), seed=3)
    save_tiny_hf_model(root / "small", dict(TINY_LLAMA, num_hidden_layers=1), seed=5)
    cfg = eagle3_config(eagle_config={"eagle_aux_hidden_state_layer_ids": [0, 1, 2]})
    save_eagle3(root / "head", cfg, eagle3_tensors(cfg, seed=1))
    return root


def gpu_scheduler(path, spec: SpeculativeConfig | None) -> Scheduler:
    runner = ModelRunner(RunnerConfig(
        model_path=str(path), device="cuda", dtype="float32", attention_backend="triton", max_running_requests=16,
        max_total_tokens=8192, context_length=256, cuda_graph_bs=SIZES, disable_piecewise_cuda_graph=True,
        speculative_tokens=K if spec else 0, speculative_max_bs=SIZES[-1] if spec else 0))
    return Scheduler(runner, SchedulerConfig(max_running_requests=16, speculative=spec))


def requests(n: int):
    return [(f"r{i}", p, SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True))
            for i, p in enumerate(workload(n, seed=11))]


def assert_greedy(runner: ModelRunner, reqs, out) -> int:
    """Each output token is the argmax of the target's logits after the tokens before it (one eager extend per
    request over prompt + output), where the argmax leads by MARGIN. Returns how many tokens were checked."""
    checked = 0
    for rid, prompt, _ in reqs:
        tokens = out[rid][0]
        seq = prompt + tokens[:-1]
        row = runner.req_to_token_pool.alloc()
        loc = runner.allocator.alloc(len(seq))
        try:
            runner.req_to_token_pool.write(row, 0, loc)
            fb = runner.build_batch(ForwardMode.EXTEND, seq, [row], [len(seq)], loc, extend_seq_lens=[len(seq)])
            fb.all_token_logits = True
            logits = runner.forward_eager(fb)[len(prompt) - 1:].float().cpu()
        finally:
            runner.allocator.free(loc)
            runner.req_to_token_pool.free(row)
        top = logits.topk(2, dim=-1)
        for i, t in enumerate(tokens):
            if top.values[i, 0] - top.values[i, 1] > MARGIN:
                assert t == top.indices[i, 0].item(), f"{rid} token {i}: {t} is not the target's greedy choice"
                checked += 1
    return checked


@pytest.mark.parametrize("algorithm,draft", [("NGRAM", None), ("STANDALONE", "small"),
                                             ("STANDALONE", "target"), ("EAGLE3", "head")])
def test_speculative_outputs_are_the_targets_greedy_tokens(models, algorithm, draft):
    reqs = requests(24)
    spec = SpeculativeConfig(algorithm, K, draft_model_path=str(models / draft) if draft else None,
                             adaptive=False, max_batch_size=SIZES[-1])
    s = gpu_scheduler(models / "target", spec)
    out = run_all(s, reqs)
    runner = s.runner
    assert runner.verify_graph_runner is not None and runner.path_counts["verify_graph"] >= 5
    assert runner.path_counts["decode_graph"] + runner.path_counts["verify_graph"] > 20
    stats = s.stats()
    assert stats["spec_verify_steps"] > 20
    if algorithm != "NGRAM":
        draft_runner = s.speculator.proposer.runner
        if algorithm == "STANDALONE":
            assert draft_runner.path_counts["decode_graph"] > 10  # the draft steps replay its decode graphs
        else:  # the target's graphs give the head its hidden states
            assert runner.aux_hidden_state_layers == (0, 1, 2)
            assert runner.verify_graph_runner.aux.buffer is not None
    if draft == "target":  # the target drafting for itself: (nearly) every draft is accepted
        assert stats["spec_accepted_tokens"] >= 0.9 * stats["spec_draft_tokens"]
    assert assert_greedy(runner, reqs, out) > 24 * 24 // 2

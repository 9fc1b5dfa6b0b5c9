"""Prompt logprobs on the GPU (Llama-3.2-1B shape, random bf16 weights, triton attention): extend batches
replayed through the piecewise graphs score the prompt rows like the eager path, with chunked prefill,
overlap scheduling and a batch mixed with requests that want none; and line up with a one-pass forward.

Run: pytest -m gpu tests/scheduler/test_prompt_logprobs_gpu.py -s
"""

from __future__ import annotations

import pytest
import torch

from model_executor.configs import shape_path
from model_executor.forward_batch import ForwardMode
from model_executor.sampling_params import SamplingParams
from runners.model_runner import ModelRunner, RunnerConfig
from scheduler.scheduler import Scheduler, SchedulerConfig

pytestmark = pytest.mark.gpu

LEVELS = (16, 32, 64, 128, 256)


@pytest.fixture(scope="module", autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture(scope="module")
def runner():
    cfg = RunnerConfig(model_path=str(shape_path("llama-3.2-1b")), device="cuda", attention_backend="triton",
                       max_running_requests=16, max_total_tokens=8192, context_length=1024, random_weights=True,
                       cuda_graph_bs=(1, 2, 4, 8), piecewise_cuda_graph_tokens=LEVELS, full_extend_graph_max_tokens=64)
    runner = ModelRunner(cfg)
    assert runner.extend_graph_runner is not None and runner.full_extend_graph_runner is not None
    return runner


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(100, 120000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


REQS = {"a": (prompt(300, 1), 0, 5), "b": (prompt(90, 2), 37, 0), "x": (prompt(50, 3), None, 0)}


def run(runner: ModelRunner, graphs: str) -> dict:
    """The requests through the scheduler (64-token chunks, overlap on); graphs: "pieces" (the piecewise runner
    only), "whole" (whole graphs up to 64 tokens and 8 requests, pieces above), "none" (eager)."""
    saved = runner.extend_graph_runner, runner.full_extend_graph_runner
    runner.extend_graph_runner = None if graphs == "none" else saved[0]
    runner.full_extend_graph_runner = saved[1] if graphs == "whole" else None
    before, whole_before = dict(runner.path_counts), saved[1].replays
    try:
        s = Scheduler(runner, SchedulerConfig(max_running_requests=16, chunked_prefill_size=64, enable_overlap=True,
                                              disable_radix_cache=True))
        for rid, (ids, start, top) in REQS.items():
            s.add_request(rid, ids, SamplingParams(max_new_tokens=2, temperature=0.0, ignore_eos=True,
                                                   prompt_logprob_start=start, prompt_top_logprobs=top))
        out = {}
        while s.has_work():
            for o in s.step():
                if o.prompt_logprobs is not None:
                    assert o.rid not in out
                    out[o.rid] = o.prompt_logprobs
    finally:
        runner.extend_graph_runner, runner.full_extend_graph_runner = saved
    counts = {k: runner.path_counts[k] - before.get(k, 0) for k in ("extend_graph", "extend_eager")}
    counts["whole"] = saved[1].replays - whole_before
    return {"lps": out, "counts": counts}


@pytest.mark.parametrize("graphs", ["pieces", "whole"])
def test_graphs_score_like_eager(runner, graphs):
    graphed, eager = run(runner, graphs), run(runner, "none")
    print("\npaths:", graphed["counts"], eager["counts"])
    assert graphed["counts"]["extend_graph"] > 0 and graphed["counts"]["extend_eager"] == 0
    assert (graphed["counts"]["whole"] > 0) == (graphs == "whole")
    assert eager["counts"]["extend_graph"] == 0
    assert set(graphed["lps"]) == {"a", "b"} == set(eager["lps"])
    for rid, (ids, start, top) in REQS.items():
        if start is None:
            continue
        g, e = graphed["lps"][rid], eager["lps"][rid]
        assert g.first == e.first == start + 1 and g.token_ids == e.token_ids == ids[start + 1:]
        gv, ev = torch.tensor(g.logprobs), torch.tensor(e.logprobs)
        diff, shifted = (gv - ev).abs(), (gv[1:] - ev[:-1]).abs()
        print(f"{rid}: {len(gv)} positions, |piecewise - eager| max {diff.max().item():.4f} mean "
              f"{diff.mean().item():.5f}; against eager shifted by one: mean {shifted.mean().item():.4f}")
        # bf16: a level's padded GEMM shapes may round differently; a misplaced row would be far off.
        assert diff.max().item() < 0.1 and diff.mean().item() < 0.25 * shifted.mean().item()
        assert all(len(t) == top for t in g.top_ids)


def test_scores_line_up_with_a_one_pass_forward(runner):
    """The scheduler's prompt logprobs (64-token chunks through the piecewise graphs) against the backbone run
    over the whole prompt in one eager pass with a float32 head: equal up to bf16 rounding, and far closer
    than the same reference shifted by one position (random weights make every logprob look alike, so the
    shift shows how much closer)."""
    ids, _, _ = REQS["a"]
    lps = run(runner, "pieces")["lps"]["a"]
    row = runner.req_to_token_pool.alloc()
    slots = runner.allocator.alloc(len(ids))
    try:
        runner.req_to_token_pool.write(row, 0, slots)
        fb = runner.build_batch(ForwardMode.EXTEND, ids, [row], [len(ids)], slots, extend_seq_lens=[len(ids)])
        runner.attn_backend.init_forward_metadata(fb)
        with torch.no_grad():
            hidden = runner.model.model(fb.input_ids, fb.positions, fb)
            logits = torch.nn.functional.linear(hidden.float(), runner.model.lm_head.weight.float())
        table = torch.log_softmax(logits, -1).cpu()
    finally:
        runner.allocator.free(slots)
        runner.req_to_token_pool.free(row)
    got = torch.tensor(lps.logprobs)
    targets = torch.tensor(ids[1:])
    ref = table[torch.arange(len(ids) - 1), targets]
    shifted = table[torch.arange(1, len(ids) - 1), targets[:-1]]
    err, err_shifted = (got - ref).abs(), (got[:-1] - shifted).abs()
    print(f"\n|scheduler - one pass|: max {err.max().item():.4f} mean {err.mean().item():.5f}; "
          f"shifted by one: mean {err_shifted.mean().item():.4f}")
    assert err.mean().item() < 0.25 * err_shifted.mean().item()
    assert err.max().item() < 0.1

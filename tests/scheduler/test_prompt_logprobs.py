"""Prompt logprobs through the real scheduler and model on a tiny random Llama (CPU), against HF transformers'
log-softmax at every prompt position: whole prompts, chunked prefill, radix cache hits, batches mixed with
requests that want none, overlap on and off, the piecewise extend runner, and the block-wise scoring."""

from __future__ import annotations

import pytest
import torch

from model_executor.prompt_logprobs import PromptLogprobPlan, score_prompt_rows
from model_executor.sampling_params import SamplingParams
from runners.graph_seam import StandInCapturer
from runners.model_runner import ModelRunner, RunnerConfig
from runners.piecewise_cuda_graph_runner import PiecewiseCudaGraphRunner
from scheduler.scheduler import Scheduler, SchedulerConfig

TOP = 3


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(3, 320, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def params(start: int | None, top: int = TOP, **kw) -> SamplingParams:
    return SamplingParams(max_new_tokens=kw.pop("max_new_tokens", 3), temperature=0.0, ignore_eos=True,
                          prompt_logprob_start=start, prompt_top_logprobs=top, **kw)


def make_scheduler(path, *, overlap: bool = False, slots: int = 2048, **cfg) -> Scheduler:
    runner = ModelRunner(RunnerConfig(model_path=str(path), max_running_requests=16, max_total_tokens=slots))
    return Scheduler(runner, SchedulerConfig(max_running_requests=16, enable_overlap=overlap, **cfg))


def drive(s: Scheduler, reqs: dict[str, tuple[list[int], SamplingParams]]) -> dict[str, dict]:
    """Run the requests to the end; per request: its prompt logprobs (merged), tokens and cached tokens."""
    for rid, (ids, p) in reqs.items():
        s.add_request(rid, ids, p)
    out = {rid: {"prompt": None, "tokens": [], "cached": 0, "reports": 0} for rid in reqs}
    steps = 0
    while s.has_work():
        for o in s.step():
            r = out.setdefault(o.rid, {"prompt": None, "tokens": [], "cached": 0, "reports": 0})
            r["tokens"] += o.new_token_ids
            r["cached"] = o.cached_tokens
            if o.prompt_logprobs is not None:
                r["reports"] += 1
                if r["prompt"] is None:
                    r["prompt"] = o.prompt_logprobs
                else:
                    r["prompt"].extend(o.prompt_logprobs)
            assert o.finish_reason is None or o.finish_reason.kind == "length", o.finish_reason
        steps += 1
        assert steps < 500, "the scheduler did not drain"
    s.check_invariant()
    return out


@pytest.fixture(scope="module")
def hf(tiny_llama):
    return tiny_llama[1]


def reference(hf_model, ids: list[int]) -> torch.Tensor:
    """log_softmax of HF's logits at every prompt position: row p scores the token at p + 1."""
    with torch.no_grad():
        logits = hf_model(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def check(result: dict, hf_model, ids: list[int], start: int, top: int = TOP) -> None:
    """Every prompt token after `start` has its reference logprob, rank and top alternatives; none before."""
    ref = reference(hf_model, ids)
    lp = result["prompt"]
    assert result["reports"] == 1, "prompt logprobs come in one report, with the first output token"
    assert lp.first == start + 1
    assert lp.token_ids == ids[start + 1:]
    rows = torch.arange(start, len(ids) - 1)
    expected = ref[rows, torch.tensor(ids[start + 1:])]
    torch.testing.assert_close(torch.tensor(lp.logprobs), expected, atol=1e-4, rtol=1e-4)
    ranks = (ref[rows] >= expected.unsqueeze(1)).sum(-1)
    assert lp.ranks == ranks.tolist()
    values, best = torch.topk(ref[rows], top, dim=-1)
    assert lp.top_ids == best.tolist()
    torch.testing.assert_close(torch.tensor(lp.top_logprobs), values, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_whole_prompt_equals_hf_log_softmax(tiny_llama, hf, overlap):
    s = make_scheduler(tiny_llama[0], overlap=overlap)
    ids = prompt(23, seed=1)
    out = drive(s, {"a": (ids, params(0)), "b": (prompt(9, 2), params(4, top=0))})
    check(out["a"], hf, ids, 0)
    b = out["b"]["prompt"]
    assert b.first == 5 and b.top_ids == [[] for _ in range(4)] and len(b.logprobs) == 4


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
@pytest.mark.parametrize("start", [0, 5, 8, 30])
def test_chunked_prefill_scores_every_chunk_and_its_boundary(tiny_llama, hf, overlap, start):
    """Chunks of 8 tokens: row 7 of a chunk predicts the first token of the next one; a start on a chunk
    boundary (8) and in the last chunk (30 of 37) are scored from there on."""
    s = make_scheduler(tiny_llama[0], overlap=overlap, chunked_prefill_size=8)
    ids = prompt(37, seed=3)
    out = drive(s, {"a": (ids, params(start))})
    check(out["a"], hf, ids, start)


def test_start_on_the_last_prompt_token_scores_nothing(tiny_llama):
    s = make_scheduler(tiny_llama[0])
    ids = prompt(6, seed=4)
    out = drive(s, {"a": (ids, params(5))})
    assert out["a"]["prompt"] is None and len(out["a"]["tokens"]) == 3


def test_radix_cache_hit_matches_only_up_to_the_start(tiny_llama, hf):
    """The same prompt again: a request that scores from 0 gets no cached tokens (and the same values); one
    that scores from 20 reuses the 20 cached positions before it; one without logprobs reuses all but one."""
    s = make_scheduler(tiny_llama[0])
    ids = prompt(30, seed=5)
    first = drive(s, {"a": (ids, params(0))})
    check(first["a"], hf, ids, 0)
    again = drive(s, {"b": (ids, params(0))})
    assert again["b"]["cached"] == 0
    check(again["b"], hf, ids, 0)
    late = drive(s, {"c": (ids, params(20))})
    assert late["c"]["cached"] == 20
    check(late["c"], hf, ids, 20)
    plain = drive(s, {"d": (ids, params(None))})
    assert plain["d"]["cached"] == len(ids) - 1 and plain["d"]["prompt"] is None
    assert first["a"]["tokens"] == again["b"]["tokens"] == late["c"]["tokens"] == plain["d"]["tokens"]


def test_mixed_batch_with_requests_that_want_none(tiny_llama, hf):
    """One extend batch of requests with and without prompt logprobs: each scores exactly its own rows, and
    the others' tokens equal the same requests run alone."""
    reqs = {"x": (prompt(11, 6), params(None)), "a": (prompt(17, 7), params(0)),
            "y": (prompt(5, 8), params(None)), "b": (prompt(13, 9), params(3, top=5))}
    s = make_scheduler(tiny_llama[0], disable_radix_cache=True)
    out = drive(s, reqs)
    assert s.runner.path_counts["extend_eager"] == 1  # really one batch
    check(out["a"], hf, reqs["a"][0], 0)
    check(out["b"], hf, reqs["b"][0], 3, top=5)
    for rid in ("x", "y"):
        alone = drive(make_scheduler(tiny_llama[0], disable_radix_cache=True), {rid: reqs[rid]})
        assert out[rid]["prompt"] is None
        assert out[rid]["tokens"] == alone[rid]["tokens"]


def test_mixed_chunk_decodes_ride_along(tiny_llama, hf):
    """With mixed chunks a running request decodes inside each prefill chunk of a prompt that is scored (its
    decode row comes last in the batch); both come out as they do alone."""
    ids = prompt(37, 13)
    other = (prompt(6, 14), params(None, max_new_tokens=12))
    s = make_scheduler(tiny_llama[0], overlap=True, chunked_prefill_size=8, enable_mixed_chunk=True)
    s.add_request("x", *other)
    s.step()
    out = drive(s, {"a": (ids, params(0))})
    assert s.runner.path_counts["decode_eager"] < 12  # x decoded inside extend batches
    check(out["a"], hf, ids, 0)
    alone = drive(make_scheduler(tiny_llama[0]), {"x": other})
    assert out["x"]["tokens"] == alone["x"]["tokens"]


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_retraction_mid_prompt_keeps_scored_positions(tiny_llama, hf, overlap, caplog):
    """A decoding request outgrows a small pool while a long prompt is prefilled in chunks: the partly
    prefilled request is retracted, comes back later (its cached chunks matched only up to its next scored
    position) and its prompt logprobs still come once, whole and right."""
    long_ids = prompt(90, 30)
    s = make_scheduler(tiny_llama[0], overlap=overlap, slots=120, chunked_prefill_size=16, new_token_ratio=0.0)
    s.add_request("a", prompt(20, 31), params(None, max_new_tokens=60))
    for _ in range(9):  # a holds 29 slots: b's 90 are admitted, but a outgrows the 1 left while b prefills
        s.step()
    with caplog.at_level("INFO", logger="duet.scheduler"):
        out = drive(s, {"b": (long_ids, params(0, max_new_tokens=2))})
    assert "retracting request b " in caplog.text
    check(out["b"], hf, long_ids, 0)


def test_block_wise_scoring_equals_one_block(tiny_llama):
    torch.manual_seed(0)
    runner = ModelRunner(RunnerConfig(model_path=str(tiny_llama[0]), max_running_requests=4, max_total_tokens=256))
    head = runner.model.lm_head
    hidden = torch.randn(13, 64)
    plan = PromptLogprobPlan.build([0, 2, 3, 5, 6, 7, 11, 12], [5, 9, 300, 4, 4, 17, 1, 0], 4, "cpu", False)
    one = score_prompt_rows(head, hidden, plan)
    blocks = score_prompt_rows(head, hidden, plan, rows_per_block=3)
    for a, b in zip((one.logprobs, one.ranks, one.top_ids, one.top_values),
                    (blocks.logprobs, blocks.ranks, blocks.top_ids, blocks.top_values)):
        torch.testing.assert_close(a, b)
    ref = torch.log_softmax(head(hidden[plan.rows]).float(), -1)
    torch.testing.assert_close(one.logprobs, ref[torch.arange(8), plan.targets])


@pytest.fixture
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_piecewise_extend_runner_scores_prompt_rows(tiny_llama, hf, fresh_dynamo):
    """Extend batches replayed through the piecewise runner (CPU stand-in graphs): the head runs outside
    the pieces on every token's hidden state, so prompt logprobs need no eager path."""
    s = make_scheduler(tiny_llama[0], chunked_prefill_size=16)
    s.runner.extend_graph_runner = PiecewiseCudaGraphRunner(s.runner, [4, 8, 16, 32], capturer=StandInCapturer())
    reqs = {"a": (prompt(29, 10), params(0)), "x": (prompt(7, 11), params(None)), "b": (prompt(12, 12), params(2))}
    out = drive(s, reqs)
    assert s.runner.path_counts["extend_graph"] >= 2 and s.runner.path_counts["extend_eager"] == 0
    check(out["a"], hf, reqs["a"][0], 0)
    check(out["b"], hf, reqs["b"][0], 2)
    assert out["x"]["prompt"] is None

"""Speculative acceptance (model_executor/speculative_sampling.py): greedy runs, and rejection sampling that
keeps the target's distribution exactly (chi-square over many requests verified in one call)."""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from model_executor.sampler import Sampler, SamplingBatchInfo
from model_executor.sampling_params import SamplingParams
from model_executor.speculative_sampling import verify_drafts


def rows_info(params: list[SamplingParams], steps: list[int] | None = None) -> SamplingBatchInfo:
    return SamplingBatchInfo.from_params(params, steps or [0] * len(params), "cpu")


def test_greedy_accepts_the_prefix_equal_to_the_argmax_then_the_targets_token():
    torch.manual_seed(0)
    vocab = 16
    # Two requests: 3 drafts (rows 0-3) and 1 draft (rows 4-5); argmax per row set by a large logit.
    argmax = [5, 7, 9, 11, 3, 4]
    logits = torch.randn(6, vocab)
    logits[torch.arange(6), torch.tensor(argmax)] += 20
    drafts = torch.tensor([5, 7, 2, -1, 8, -1])  # request 0: d1, d2 hit, d3 misses; request 1: d1 misses
    out = verify_drafts(Sampler(), logits, rows_info([SamplingParams(temperature=0.0)] * 6), drafts, [4, 2])
    assert out.accept_lens.tolist() == [2, 0]
    assert out.row_tokens.tolist()[:3] == [5, 7, 9]  # the run: d1, d2, then the target's token at row 2
    assert out.final_tokens.tolist() == [9, 3]
    full = verify_drafts(Sampler(), logits, rows_info([SamplingParams(temperature=0.0)] * 6),
                         torch.tensor([5, 7, 9, -1, 3, -1]), [4, 2])
    assert full.accept_lens.tolist() == [3, 1] and full.final_tokens.tolist() == [11, 4]  # + the bonus tokens


def test_logprobs_are_those_of_each_rows_emitted_token():
    torch.manual_seed(1)
    logits = torch.randn(3, 10)
    params = [SamplingParams(temperature=0.0, top_logprobs=2)] * 3
    drafts = torch.tensor([int(logits[0].argmax()), int(logits[1].argmax()), -1])
    out = verify_drafts(Sampler(), logits, rows_info(params), drafts, [3])
    ref = torch.log_softmax(logits, dim=-1)
    assert torch.allclose(out.logprobs, ref.gather(1, out.row_tokens.unsqueeze(1)).squeeze(1))
    assert torch.equal(out.top_logprob_ids, ref.topk(2, dim=-1).indices)


def _processed(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    return torch.softmax(Sampler().filtered_logits(logits.unsqueeze(0), rows_info([params])), dim=-1)[0]


def _chi2_pvalue(observed: torch.Tensor, probs: torch.Tensor) -> float:
    """Chi-square p-value of observed counts against probs, cells with expected count < 5 pooled."""
    n = int(observed.sum())
    expected = probs * n
    big = expected >= 5
    obs = torch.cat([observed[big].double(), observed[~big].double().sum().view(1)])
    exp = torch.cat([expected[big].double(), expected[~big].double().sum().view(1)])
    if exp[-1] < 5:  # nothing much pooled: drop the pool cell into the smallest kept one
        obs, exp = obs[:-1].clone(), exp[:-1].clone()
        obs[-1] += observed[~big].sum()
        exp[-1] += expected[~big].sum()
    exp *= obs.sum() / exp.sum()
    return float(chisquare(obs.numpy(), exp.numpy()).pvalue)


@pytest.mark.parametrize("draft_kind", ["likely", "unlikely"])
def test_rejection_sampling_keeps_each_emitted_tokens_distribution(draft_kind):
    """40k requests verify the same two drafts against the same three rows: the first token follows p_0; given
    it is d_1 the second follows p_1; given d_1 d_2 the bonus follows p_2 (temperature 0.7, top_p 0.9)."""
    torch.manual_seed(2)
    vocab, bs = 12, 40_000
    params = SamplingParams(temperature=0.7, top_p=0.9)
    base = torch.randn(3, vocab) * 1.5
    p = [_processed(base[i], params) for i in range(3)]
    pick = (lambda q: int(q.argmax())) if draft_kind == "likely" else (lambda q: int(q.argsort()[-3]))
    d1, d2 = pick(p[0]), pick(p[1])
    logits = base.repeat(bs, 1)
    drafts = torch.tensor([d1, d2, -1]).repeat(bs)
    out = verify_drafts(Sampler(), logits, rows_info([params] * (3 * bs)), drafts, [3] * bs)
    tokens = out.row_tokens.view(bs, 3)
    acc = out.accept_lens
    first = tokens[:, 0]
    assert _chi2_pvalue(torch.bincount(first, minlength=vocab), p[0]) > 0.01
    second = tokens[acc >= 1, 1]
    assert second.numel() > 1000
    assert _chi2_pvalue(torch.bincount(second, minlength=vocab), p[1]) > 0.01
    third = tokens[acc >= 2, 2]
    assert third.numel() > 100
    assert _chi2_pvalue(torch.bincount(third, minlength=vocab), p[2]) > 0.01
    # The run never emits a token outside the filtered support.
    assert bool((p[0][first] > 0).all())


def test_a_request_without_drafts_samples_as_the_sampler_does_seeded():
    """A seeded row that carries no draft draws the token the sampler itself draws (same (seed, step) noise)."""
    logits = torch.randn(4, 50)
    params = [SamplingParams(temperature=0.8, top_p=0.95, seed=s) for s in (1, 2, 3, 4)]
    info = rows_info(params, [0, 5, 9, 2])
    ref = Sampler()(logits.clone(), info).next_token_ids
    out = verify_drafts(Sampler(), logits.clone(), info, torch.full((4,), -1), [1, 1, 1, 1])
    assert torch.equal(out.row_tokens, ref) and out.accept_lens.tolist() == [0, 0, 0, 0]

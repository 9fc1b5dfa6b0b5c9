"""Logit bias and presence / frequency / repetition penalties (model_executor/penalties.py): the batched
device ops against a per-row reference, and through the scheduler on a tiny model (forcing, banning,
fewer repeats, a penalized request batched with plain ones)."""

from __future__ import annotations

import pytest
import torch

from model_executor.penalties import PenaltyState
from model_executor.sampling_params import SamplingParams, SamplingParamsError
from tests.scheduler.test_scheduler import greedy, make_scheduler, run_all

VOCAB = 50


def reference(logits: torch.Tensor, p: SamplingParams, prompt: list[int], output: list[int]) -> torch.Tensor:
    x = logits.clone()
    counts = torch.bincount(torch.tensor(output, dtype=torch.int64), minlength=VOCAB).float()
    for t in set(prompt) | set(output):
        x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    x -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).float()
    for t, b in p.logit_bias:
        x[t] += b
    return x


def test_batched_penalties_equal_the_per_row_reference():
    g = torch.Generator().manual_seed(0)
    state = PenaltyState(num_rows=8, vocab_size=VOCAB, device="cpu")
    params = [SamplingParams(presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.3),
              SamplingParams(logit_bias=((3, 5.0), (7, -100.0))),  # bias only: no counts kept
              SamplingParams(frequency_penalty=-1.0, repetition_penalty=0.8, logit_bias=((1, 2.0),)),
              SamplingParams()]
    rows = [5, 2, 7, 1]  # request-pool rows, not batch order
    prompts = [[1, 2, 3], [4], [9, 9, 10], [11]]
    outputs = [[2, 2, 6], [], [10, 12, 12, 12], [3]]
    for row, p, prompt, out in zip(rows, params, prompts, outputs):
        state.init_row(row, p, prompt, out[:1])
    for step in range(1, 4):  # later tokens arrive through the batched update
        toks = [out[step] if step < len(out) else 0 for out in outputs]
        live = [p if step < len(out) else SamplingParams() for p, out in zip(params, outputs)]
        state.count_sampled(torch.tensor(rows), torch.tensor(toks),
                            [i for i, p in enumerate(live) if p.has_penalties])
    logits = torch.randn(4, VOCAB, generator=g) * 3
    got = logits.clone()
    state.apply(got, rows, params)
    want = torch.stack([reference(logits[i], params[i], prompts[i], outputs[i]) for i in range(4)])
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("field,value", [("presence_penalty", 2.5), ("frequency_penalty", -3.0),
                                         ("repetition_penalty", 0.0), ("logit_bias", ((5, 101.0),)),
                                         ("logit_bias", ((-1, 1.0),))])
def test_out_of_range_values_name_the_field(field, value):
    with pytest.raises(SamplingParamsError) as e:
        SamplingParams(**{field: value}).validate()
    assert e.value.param == field


PROMPT = [5, 17, 42, 99, 123, 7, 250, 31, 64, 8, 200, 11]


def test_logit_bias_forces_and_bans_through_the_scheduler(tiny_llama):
    path, _ = tiny_llama
    s = make_scheduler(path)
    s.add_request("plain", PROMPT, greedy(8))
    s.add_request("forced", PROMPT, greedy(8, logit_bias=((77, 100.0),)))
    plain = run_all(s)["plain"][0]
    s.add_request("forced", PROMPT, greedy(8, logit_bias=((77, 100.0),)))
    s.add_request("banned", PROMPT, greedy(8, logit_bias=tuple((t, -100.0) for t in set(plain))))
    out = run_all(s)
    assert out["forced"][0] == [77] * 8
    assert not set(out["banned"][0]) & set(plain)


def test_penalties_change_repeats_in_the_expected_direction(tiny_llama):
    path, _ = tiny_llama
    s = make_scheduler(path)
    n = 40
    s.add_request("plain", PROMPT, greedy(n))
    s.add_request("freq", PROMPT, greedy(n, frequency_penalty=2.0))
    s.add_request("pres", PROMPT, greedy(n, presence_penalty=2.0))
    s.add_request("rep", PROMPT, greedy(n, repetition_penalty=2.0))
    s.add_request("more", PROMPT, greedy(n, frequency_penalty=-2.0))
    out = {k: v[0] for k, v in run_all(s).items()}

    def repeats(ids):
        return len(ids) - len(set(ids))

    assert repeats(out["plain"]) > 0  # the tiny model loops: there is something to penalize
    for k in ("freq", "pres", "rep"):
        assert repeats(out[k]) < repeats(out["plain"]), (k, out[k], out["plain"])
    assert repeats(out["more"]) > repeats(out["plain"])


def test_penalized_request_in_a_batch_equals_it_alone(tiny_llama):
    """The counts are per request row: neighbours neither see nor disturb them (greedy, no radix cache)."""
    path, _ = tiny_llama
    alone = make_scheduler(path, disable_radix_cache=True)
    alone.add_request("p", PROMPT, greedy(12, frequency_penalty=1.5, repetition_penalty=1.2))
    want = run_all(alone)["p"][0]
    s = make_scheduler(path, disable_radix_cache=True)
    s.add_request("a", PROMPT[:5], greedy(12))
    s.add_request("p", PROMPT, greedy(12, frequency_penalty=1.5, repetition_penalty=1.2))
    s.add_request("b", PROMPT[3:], greedy(9, presence_penalty=1.0))
    assert run_all(s)["p"][0] == want

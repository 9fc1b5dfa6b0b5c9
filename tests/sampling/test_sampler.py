"""CPU tests for model_executor.sampler: greedy, filters, seeds, distribution, logprobs."""

from __future__ import annotations

import pytest
import torch

from model_executor.sampler import GREEDY_TEMPERATURE_EPS, SampleOutput, Sampler, SamplingBatchInfo
from model_executor.sampling_params import SamplingParams

CPU = torch.device("cpu")


def run(logits: torch.Tensor, params: list[SamplingParams], steps: list[int] | None = None) -> SampleOutput:
    steps = steps if steps is not None else [0] * len(params)
    info = SamplingBatchInfo.from_params(params, steps, CPU, vocab_size=logits.shape[-1])
    return Sampler()(logits, info)


def logits_from_probs(probs: list[float], perm_seed: int | None = 0) -> tuple[torch.Tensor, list[int]]:
    """Logits whose softmax is `probs`, scattered to shuffled vocab ids; returns (logits, ids by rank)."""
    p = torch.tensor(probs, dtype=torch.float64)
    assert abs(p.sum().item() - 1) < 1e-9
    ids = list(range(len(probs)))
    if perm_seed is not None:
        g = torch.Generator().manual_seed(perm_seed)
        ids = torch.randperm(len(probs), generator=g).tolist()
    logits = torch.empty(len(probs), dtype=torch.float32)
    logits[ids] = p.log().float() + 3.0  # arbitrary shift: softmax is shift invariant
    return logits, ids


def draw_counts(logits: torch.Tensor, params: SamplingParams, n: int) -> torch.Tensor:
    """Counts per vocab id over n draws (one batched call of n identical rows)."""
    out = run(logits.unsqueeze(0).expand(n, -1).contiguous(), [params] * n)
    return torch.bincount(out.next_token_ids, minlength=logits.shape[-1])


def support(counts: torch.Tensor) -> set[int]:
    return set(torch.nonzero(counts).flatten().tolist())


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    n = counts.sum().item()
    expected = probs.double() * n
    keep = expected > 0
    assert counts[~keep].sum() == 0, "drew a token with zero probability"
    return (((counts.double() - expected) ** 2)[keep] / expected[keep]).sum().item()


# Generous upper critical values (p ~ 1e-4) so a correct sampler essentially never fails.
CHI2_CRIT = {1: 15.2, 2: 18.5, 3: 21.2, 4: 23.6, 7: 29.9, 9: 33.8}


@pytest.fixture(autouse=True)
def _seed_global_rng():
    torch.manual_seed(1234)


# --------------------------------------------------------------------------- SamplingBatchInfo


def test_batch_info_tensors_and_flags():
    params = [
        SamplingParams(temperature=0.0, top_k=5, top_p=0.5, min_p=0.3),  # greedy: filters don't count
        SamplingParams(temperature=0.7, top_k=-1),
        SamplingParams(temperature=1.3, top_k=0, top_logprobs=3),
        SamplingParams(temperature=1.0, top_k=1),  # greedy via top_k
        SamplingParams(temperature=1.0, top_k=500, seed=9),  # > vocab: clamped, not a real top-k
    ]
    info = SamplingBatchInfo.from_params(params, [0, 1, 2, 3, 4], CPU, vocab_size=100)
    assert info.temperatures.shape == (5, 1) and info.temperatures.dtype == torch.float32
    assert info.temperatures[1, 0].item() == pytest.approx(0.7)
    assert info.temperatures[0, 0].item() == 1.0  # greedy rows never divide by zero
    assert info.top_ks.tolist() == [5, 100, 100, 1, 100]
    assert info.top_ps.shape == (5,) and info.min_ps.shape == (5,)
    assert info.is_greedy.tolist() == [True, False, False, True, False]
    assert not info.is_all_greedy
    assert not info.need_top_k and not info.need_top_p and not info.need_min_p
    assert info.seeds == [None, None, None, None, 9]
    assert info.seeded_rows == (4,)
    assert info.max_top_logprobs == 3 and info.return_logprob


def test_batch_info_need_flags_follow_random_rows():
    info = SamplingBatchInfo.from_params(
        [SamplingParams(top_k=10), SamplingParams(top_p=0.9), SamplingParams(min_p=0.1)], [0, 0, 0], CPU, 50
    )
    assert info.need_top_k and info.need_top_p and info.need_min_p and not info.is_all_greedy
    assert info.max_top_logprobs == -1 and not info.return_logprob

    greedy = SamplingBatchInfo.from_params([SamplingParams(temperature=0.0)] * 3, [0, 1, 2], CPU)
    assert greedy.is_all_greedy
    assert greedy.top_ks.tolist() == [torch.iinfo(torch.int32).max] * 3  # vocab unknown: no-op k


def test_batch_info_rejects_length_mismatch():
    with pytest.raises(ValueError):
        SamplingBatchInfo.from_params([SamplingParams()], [0, 1], CPU)


# --------------------------------------------------------------------------- greedy


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_temperature_zero_is_argmax(dtype):
    logits = torch.randn(16, 300).to(dtype)
    for _ in range(3):
        out = run(logits, [SamplingParams(temperature=0.0)] * 16)
        assert out.next_token_ids.dtype == torch.int64
        assert torch.equal(out.next_token_ids, logits.float().argmax(-1))


def test_top_k_one_is_argmax_even_with_temperature():
    logits = torch.randn(16, 300)
    out = run(logits, [SamplingParams(temperature=5.0, top_k=1)] * 16)
    assert torch.equal(out.next_token_ids, logits.argmax(-1))


def test_tiny_temperature_is_greedy_and_finite():
    logits = torch.randn(8, 50) * 20
    out = run(logits, [SamplingParams(temperature=GREEDY_TEMPERATURE_EPS / 100)] * 8)
    assert torch.equal(out.next_token_ids, logits.argmax(-1))


def test_greedy_only_batch_does_not_touch_global_rng():
    logits = torch.randn(4, 64)
    state = torch.get_rng_state()
    run(logits, [SamplingParams(temperature=0.0, top_logprobs=2)] * 4)
    assert torch.equal(state, torch.get_rng_state())


def test_mixed_greedy_and_random_rows():
    bs, vocab = 8, 200
    logits = torch.randn(bs, vocab) * 0.1  # flat: random rows essentially never hit the argmax twice
    params = [SamplingParams(temperature=0.0) if i % 2 == 0 else SamplingParams(temperature=1.0) for i in range(bs)]
    params[3] = SamplingParams(temperature=1.0, top_k=1)  # greedy through top_k
    greedy_rows = [0, 2, 3, 4, 6]
    random_rows = [1, 5, 7]
    draws = torch.stack([run(logits, params).next_token_ids for _ in range(30)])  # [30, bs]
    argmax = logits.argmax(-1)
    for r in greedy_rows:
        assert (draws[:, r] == argmax[r]).all()
    for r in random_rows:
        assert len(set(draws[:, r].tolist())) > 10


def test_never_samples_minus_inf_tokens():
    vocab = 40
    logits = torch.randn(vocab)
    banned = torch.arange(0, vocab, 2)
    logits[banned] = float("-inf")
    for params in [SamplingParams(), SamplingParams(top_p=0.99), SamplingParams(top_k=30, min_p=0.001)]:
        counts = draw_counts(logits, params, 2000)
        assert counts[banned].sum() == 0


# --------------------------------------------------------------------------- filters


def test_top_k_restricts_support():
    vocab, k = 100, 5
    logits = torch.randn(vocab) * 0.3  # flat-ish: every top-k token gets drawn
    top = set(torch.topk(logits, k).indices.tolist())
    counts = draw_counts(logits, SamplingParams(top_k=k), 3000)
    assert support(counts) == top


def test_top_k_renormalises_to_softmax_of_kept():
    logits, ids = logits_from_probs([0.3, 0.25, 0.2, 0.15, 0.1])
    counts = draw_counts(logits, SamplingParams(top_k=3), 4000)
    expected = torch.zeros(5, dtype=torch.float64)
    expected[ids[:3]] = torch.tensor([0.3, 0.25, 0.2], dtype=torch.float64) / 0.75
    assert chi_square(counts, expected) < CHI2_CRIT[2]


@pytest.mark.parametrize(
    "top_p,nucleus_size",
    [(0.01, 1), (0.39, 1), (0.41, 2), (0.65, 2), (0.75, 3), (0.85, 3), (0.95, 4), (1.0, 5)],
)
def test_top_p_restricts_support_to_nucleus(top_p, nucleus_size):
    probs = [0.4, 0.3, 0.2, 0.06, 0.04]  # cumulative: 0.4, 0.7, 0.9, 0.96, 1.0
    logits, ids = logits_from_probs(probs)
    counts = draw_counts(logits, SamplingParams(top_p=top_p), 3000)
    assert support(counts) == set(ids[:nucleus_size])
    kept = torch.zeros(5, dtype=torch.float64)
    kept[ids[:nucleus_size]] = torch.tensor(probs[:nucleus_size], dtype=torch.float64)
    if nucleus_size > 1:
        assert chi_square(counts, kept / kept.sum()) < CHI2_CRIT[nucleus_size - 1]


@pytest.mark.parametrize("min_p,kept", [(0.0, 5), (0.25, 3), (0.35, 2), (0.5, 1), (1.0, 1)])
def test_min_p_restricts_support(min_p, kept):
    probs = [0.5, 0.2, 0.15, 0.1, 0.05]  # relative to max: 1, 0.4, 0.3, 0.2, 0.1
    logits, ids = logits_from_probs(probs)
    counts = draw_counts(logits, SamplingParams(min_p=min_p), 3000)
    assert support(counts) == set(ids[:kept])


def test_top_k_then_top_p_uses_renormalised_mass():
    # After top_k=3 the kept probs are [0.4, 0.333, 0.267]; top_p=0.6 then keeps 2 tokens.
    # (top-p on the raw distribution would keep 3: mass before the 3rd token is only 0.55.)
    probs = [0.3, 0.25, 0.2, 0.15, 0.1]
    logits, ids = logits_from_probs(probs)
    counts = draw_counts(logits, SamplingParams(top_k=3, top_p=0.6), 3000)
    assert support(counts) == set(ids[:2])
    counts = draw_counts(logits, SamplingParams(top_p=0.6), 3000)
    assert support(counts) == set(ids[:3])


def test_all_filters_combined():
    probs = [0.3, 0.25, 0.2, 0.1, 0.08, 0.07]
    logits, ids = logits_from_probs(probs)
    # top_k=5 -> 5 tokens; top_p=0.9 on renormalised [.323,.269,.215,.108,.086] keeps 4 (mass before
    # the 5th is 0.914); min_p=0.35 then drops p < 0.105 relative: keeps the first 3 of those 4.
    counts = draw_counts(logits, SamplingParams(top_k=5, top_p=0.9, min_p=0.35), 3000)
    assert support(counts) == set(ids[:3])
    # Looser min_p keeps all 4 that survive top-k + top-p.
    counts = draw_counts(logits, SamplingParams(top_k=5, top_p=0.9, min_p=0.2, temperature=1.0), 3000)
    assert support(counts) == set(ids[:4])


def test_per_row_filters_in_one_batch():
    probs = [0.3, 0.25, 0.2, 0.1, 0.08, 0.07]
    logits, ids = logits_from_probs(probs)
    row_params = [
        (SamplingParams(top_k=2), 2),
        (SamplingParams(top_p=0.5), 2),  # mass before 2nd = .3 < .5, before 3rd = .55
        (SamplingParams(min_p=0.5), 3),  # >= 0.15
        (SamplingParams(), 6),
        (SamplingParams(temperature=0.0), 1),
        (SamplingParams(top_k=4, seed=3), 4),
    ]
    n = 600
    params = [p for p, _ in row_params] * n
    logits_b = logits.unsqueeze(0).expand(len(params), -1).contiguous()
    steps = list(range(len(params)))  # distinct steps so the seeded rows vary too
    info = SamplingBatchInfo.from_params(params, steps, CPU, vocab_size=6)
    toks = Sampler()(logits_b, info).next_token_ids.view(n, len(row_params))
    for col, (_, kept) in enumerate(row_params):
        assert set(toks[:, col].tolist()) == set(ids[:kept]), col


# --------------------------------------------------------------------------- distribution / temperature


def test_temperature_one_matches_softmax():
    logits = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, 0.7, 1.2, -2.0])
    counts = draw_counts(logits, SamplingParams(temperature=1.0), 5000)
    assert chi_square(counts, torch.softmax(logits.double(), -1)) < CHI2_CRIT[9]


def test_temperature_two_matches_tempered_softmax():
    logits = torch.tensor([3.0, 1.0, 0.0, -1.0, 2.0, -3.0, 0.5, 1.5])
    counts = draw_counts(logits, SamplingParams(temperature=2.0), 5000)
    assert chi_square(counts, torch.softmax(logits.double() / 2.0, -1)) < CHI2_CRIT[7]
    # and it is distinguishable from the untempered distribution
    assert chi_square(counts, torch.softmax(logits.double(), -1)) > 100


def test_seeded_rows_follow_softmax_across_seeds():
    logits = torch.tensor([1.0, 0.0, -1.0, 0.5, 2.0, -0.3, 0.2, 0.8])
    n = 3000
    params = [SamplingParams(seed=s) for s in range(n)]
    out = run(logits.unsqueeze(0).expand(n, -1).contiguous(), params)
    counts = torch.bincount(out.next_token_ids, minlength=8)
    assert chi_square(counts, torch.softmax(logits.double(), -1)) < CHI2_CRIT[7]


def test_temperature_controls_sharpness():
    logits = torch.linspace(1.0, 0.0, 10)  # argmax is id 0, gap 0.11 between neighbours
    freq = {}
    for t in [0.02, 0.3, 1.0, 10.0]:
        counts = draw_counts(logits, SamplingParams(temperature=t), 3000)
        freq[t] = counts[0].item() / 3000
    assert freq[0.02] > 0.98
    assert freq[0.02] > freq[0.3] > freq[1.0] > freq[10.0]
    assert freq[10.0] < 0.15  # close to uniform (0.1)


# --------------------------------------------------------------------------- seeds


def _sequence(logits_row: torch.Tensor, target: SamplingParams, neighbours: list[SamplingParams],
              position: int, steps: int = 12) -> list[int]:
    """Sample `steps` tokens for `target` placed at `position` among `neighbours`."""
    toks = []
    for step in range(steps):
        params = list(neighbours)
        params.insert(position, target)
        logits = torch.randn(len(params), logits_row.shape[0])  # neighbours get unrelated logits
        logits[position] = logits_row
        torch.manual_seed(1000 + step * 7 + position)  # global RNG state must not matter
        steps_ = [step + 3 * i for i in range(len(params))]  # neighbour steps are arbitrary
        steps_[position] = step
        info = SamplingBatchInfo.from_params(params, steps_, CPU, 512)
        toks.append(Sampler()(logits, info).next_token_ids[position].item())
    return toks


@pytest.mark.parametrize(
    "target",
    [
        SamplingParams(seed=42),
        SamplingParams(seed=42, temperature=0.8, top_k=100, top_p=0.9),
        SamplingParams(seed=-7, min_p=0.05),
    ],
)
def test_seed_reproducible_across_batches_and_positions(target):
    logits_row = torch.randn(512, generator=torch.Generator().manual_seed(5)) * 0.5
    alone = _sequence(logits_row, target, [], 0)
    assert len(set(alone)) > 3  # it does vary with the step
    assert alone == _sequence(logits_row, target, [], 0)  # repeat call
    neighbours_a = [SamplingParams(), SamplingParams(temperature=0.0), SamplingParams(seed=42, top_k=3)]
    neighbours_b = [SamplingParams(top_p=0.3, min_p=0.2), SamplingParams(top_k=2, seed=1)] * 3
    assert alone == _sequence(logits_row, target, neighbours_a, 0)
    assert alone == _sequence(logits_row, target, neighbours_a, 2)
    assert alone == _sequence(logits_row, target, neighbours_a, 3)
    assert alone == _sequence(logits_row, target, neighbours_b, 4)


def test_different_seeds_give_different_sequences():
    logits_row = torch.zeros(512)  # uniform
    seqs = {tuple(_sequence(logits_row, SamplingParams(seed=s), [], 0, steps=8)) for s in [0, 1, 2, 3, 2**40, -1]}
    assert len(seqs) == 6


def test_same_seed_same_step_in_one_batch_gives_same_token():
    logits = torch.zeros(6, 1000)
    params = [SamplingParams(seed=123)] * 6
    info = SamplingBatchInfo.from_params(params, [4, 4, 4, 5, 5, 6], CPU, 1000)
    toks = Sampler()(logits, info).next_token_ids.tolist()
    assert toks[0] == toks[1] == toks[2] and toks[3] == toks[4]
    assert len({toks[0], toks[3], toks[5]}) == 3


def test_unseeded_rows_follow_global_rng():
    logits = torch.zeros(4, 1000)
    params = [SamplingParams()] * 4
    torch.manual_seed(77)
    a = run(logits, params).next_token_ids
    torch.manual_seed(77)
    b = run(logits, params).next_token_ids
    c = run(logits, params).next_token_ids
    assert torch.equal(a, b) and not torch.equal(a, c)


# --------------------------------------------------------------------------- logprobs


def test_logprobs_are_raw_log_softmax_of_chosen():
    # distinct values k/8 (exact in bfloat16) so the top-N order has no ties
    logits = (torch.stack([torch.randperm(80) for _ in range(6)]).float() / 8 - 5).to(torch.bfloat16)
    params = [
        SamplingParams(temperature=0.5, top_k=10, top_logprobs=0),
        SamplingParams(temperature=0.0, top_logprobs=5),
        SamplingParams(temperature=1.5, top_p=0.8, min_p=0.1, top_logprobs=3),
        SamplingParams(top_logprobs=None),  # does not ask: must not break anything
        SamplingParams(seed=3, top_logprobs=2),
        SamplingParams(temperature=0.0),
    ]
    out = run(logits, params)
    ref = torch.log_softmax(logits.float(), -1)
    assert out.logprobs is not None and out.logprobs.dtype == torch.float32 and out.logprobs.shape == (6,)
    expected = ref.gather(1, out.next_token_ids.unsqueeze(1)).squeeze(1)
    torch.testing.assert_close(out.logprobs, expected)
    # top-N: the N best of the raw distribution, sorted descending
    assert out.top_logprob_ids.shape == (6, 5) and out.top_logprob_values.shape == (6, 5)
    best_vals, best_ids = ref.sort(dim=-1, descending=True)
    torch.testing.assert_close(out.top_logprob_values, best_vals[:, :5])
    assert torch.equal(out.top_logprob_ids, best_ids[:, :5])
    assert (out.top_logprob_values[:, :-1] >= out.top_logprob_values[:, 1:]).all()
    torch.testing.assert_close(out.top_logprob_values, ref.gather(1, out.top_logprob_ids))
    # greedy rows: chosen token is the top-1 alternative
    assert out.next_token_ids[1] == out.top_logprob_ids[1, 0]


def test_no_logprobs_requested():
    out = run(torch.randn(3, 20), [SamplingParams(), SamplingParams(temperature=0.0), SamplingParams(seed=1)])
    assert out.logprobs is None and out.top_logprob_ids is None and out.top_logprob_values is None


def test_zero_top_logprobs_gives_chosen_only():
    logits = torch.randn(2, 20)
    out = run(logits, [SamplingParams(top_logprobs=0), SamplingParams()])
    assert out.logprobs is not None and out.top_logprob_ids is None
    torch.testing.assert_close(
        out.logprobs, torch.log_softmax(logits, -1).gather(1, out.next_token_ids[:, None]).squeeze(1)
    )


def test_top_logprobs_larger_than_vocab_is_clamped():
    logits = torch.randn(2, 4)
    out = run(logits, [SamplingParams(top_logprobs=20), SamplingParams(temperature=0.0)])
    assert out.top_logprob_ids.shape == (2, 4)
    assert sorted(out.top_logprob_ids[0].tolist()) == [0, 1, 2, 3]


def test_shape_mismatch_raises():
    info = SamplingBatchInfo.from_params([SamplingParams()] * 2, [0, 0], CPU)
    with pytest.raises(ValueError):
        Sampler()(torch.randn(3, 10), info)


def test_empty_batch():
    out = run(torch.randn(0, 10), [])
    assert out.next_token_ids.shape == (0,)


def test_top_k_first_path_equals_full_sort(monkeypatch):
    """Batches whose random rows all use a small top-k race among the k best only (no vocabulary sort):
    the tokens equal the full-sort path's for top-k with top-p and min-p, seeded and greedy rows mixed."""
    import model_executor.sampler as sampler_mod

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 3000, generator=g) * 3
    params = [SamplingParams(temperature=0.8, top_k=40, seed=1),
              SamplingParams(temperature=1.2, top_k=7, top_p=0.8, seed=2),
              SamplingParams(temperature=0.0, top_k=5),
              SamplingParams(temperature=1.0, top_k=300, min_p=0.05, seed=3),
              SamplingParams(temperature=0.7, top_k=1000, top_p=0.95, seed=4),
              SamplingParams(top_k=2, seed=5)]
    steps = [[s] * 6 for s in range(20)]
    fast = [run(logits, params, st).next_token_ids.tolist() for st in steps]
    real_sort = torch.sort

    monkeypatch.setattr(sampler_mod, "TOP_K_FIRST_MAX", 0)  # force the full sort
    full = [run(logits, params, st).next_token_ids.tolist() for st in steps]
    assert fast == full
    assert len({tuple(t) for t in fast}) > 1  # the seeded rows really vary with the step
    monkeypatch.setattr(sampler_mod, "TOP_K_FIRST_MAX", 1024)
    monkeypatch.setattr(torch, "sort", lambda *a, **k: pytest.fail("the top-k-first path sorted the vocabulary"))
    run(logits, params, steps[0])
    monkeypatch.setattr(torch, "sort", real_sort)

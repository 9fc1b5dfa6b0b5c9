"""flashinfer's sampling kernels on the GPU against the torch filter: support, distribution, masks, seeds, RNG.

The first use builds flashinfer's sampling kernels (nvcc, a minute or two) into its cache; later runs load it.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu
flashinfer = pytest.importorskip("flashinfer")

from model_executor.sampler import Sampler, SamplingBatchInfo
from model_executor.sampling_flashinfer import create_flashinfer_sampler
from model_executor.sampling_params import SamplingParams

CUDA = torch.device("cuda")
VOCAB = 128256
# Upper chi-square critical values at p = 1e-4 by degrees of freedom: a correct sampler essentially never fails.
CHI2_CRIT = {1: 15.1, 2: 18.4, 3: 21.1, 4: 23.5, 5: 25.7, 6: 27.9, 7: 29.9, 8: 31.8, 9: 33.7, 10: 35.6,
             11: 37.4, 12: 39.1, 13: 40.9, 14: 42.6, 15: 44.3}


@pytest.fixture(scope="module")
def fi() -> Sampler:
    return Sampler(create_flashinfer_sampler("flashinfer", CUDA), flashinfer_always=True)  # builds or loads once


def info_for(params: list[SamplingParams], steps: list[int] | None = None) -> SamplingBatchInfo:
    return SamplingBatchInfo.from_params(params, steps or [0] * len(params), CUDA)


def kept_by_torch(logits: torch.Tensor, params: list[SamplingParams], slack: float = 0.0) -> torch.Tensor:
    """[bs, vocab] bool: the tokens the torch filter keeps; slack widens top-p and min-p by that much, for
    tokens that sit on a boundary within the two implementations' float rounding."""
    loose = [SamplingParams(temperature=p.temperature, top_k=p.top_k, top_p=min(1.0, p.top_p + slack),
                            min_p=p.min_p * (1 - slack), seed=p.seed) for p in params]
    info = info_for(loose)
    return torch.isfinite(Sampler()._filter(logits.float() / info.temperatures, info))


def test_auto_picks_flashinfer_on_the_gpu():
    pending = create_flashinfer_sampler("auto", CUDA)  # built in the background
    assert pending.wait(600) and Sampler(pending).backend == "flashinfer"


MIXED = [SamplingParams(temperature=0.7, top_k=50), SamplingParams(top_p=0.9),
         SamplingParams(temperature=1.3, top_k=200, top_p=0.8), SamplingParams(temperature=0.9),
         SamplingParams(top_k=5, top_p=0.5), SamplingParams(temperature=0.5, top_p=0.95)]
MIN_P = [SamplingParams(min_p=0.05), SamplingParams(temperature=1.5, min_p=0.2, top_k=100),
         SamplingParams(top_p=0.9, min_p=0.1), SamplingParams(temperature=0.8),  # min_p 0 in a min-p batch
         SamplingParams(top_k=30, top_p=0.7, min_p=0.02)]


BATCHES = pytest.mark.parametrize(
    "row_params", [MIXED, MIN_P, [SamplingParams(top_p=0.9), SamplingParams(top_p=0.6)],
                   [SamplingParams(top_k=50), SamplingParams(top_k=3, temperature=2.0)], [SamplingParams()]],
    ids=["top_k_top_p", "min_p", "top_p", "top_k", "plain"])  # one kernel (chain) per batch


@BATCHES
def test_tokens_stay_inside_the_torch_filter(fi, row_params):
    bs = 64
    params = [row_params[i % len(row_params)] for i in range(bs)]
    g = torch.Generator(device=CUDA).manual_seed(0)
    logits = torch.randn(bs, VOCAB, device=CUDA, generator=g) * torch.linspace(1.0, 4.0, bs, device=CUDA)[:, None]
    keep = kept_by_torch(logits, params, slack=1e-3)
    info = info_for(params)
    rows = torch.arange(bs, device=CUDA)
    for _ in range(30):
        tokens = fi(logits, info).next_token_ids
        outside = ~keep[rows, tokens]
        assert not outside.any(), f"rows {outside.nonzero().flatten().tolist()} drew a filtered token"


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    n = counts.sum().item()
    expected = probs.double() * n
    kept = expected > 0
    assert counts[~kept].sum() == 0, "drew a token the filters remove"
    return (((counts.double() - expected) ** 2)[kept] / expected[kept]).sum().item()


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.7), SamplingParams(top_k=5),
                                    SamplingParams(top_p=0.8), SamplingParams(top_k=8, top_p=0.7),
                                    SamplingParams(top_k=10, top_p=0.95, min_p=0.2),
                                    SamplingParams(temperature=1.5, min_p=0.1)],
                         ids=["plain", "top_k", "top_p", "top_k_top_p", "all", "min_p"])
def test_distribution_matches_the_filtered_softmax(fi, params):
    vocab, n = 16, 20000
    g = torch.Generator().manual_seed(1)
    row = (torch.linspace(2.0, -2.0, vocab)[torch.randperm(vocab, generator=g)]).to(CUDA)
    logits = row.expand(n, vocab).contiguous()
    info = info_for([params] * n)
    tokens = fi(logits, info).next_token_ids
    counts = torch.bincount(tokens, minlength=vocab).cpu()
    ref_info = info_for([params])
    filtered = Sampler()._filter(row[None] / ref_info.temperatures, ref_info)[0]
    expected = torch.softmax(filtered.double(), -1).cpu()
    kept = int((expected > 0).sum())
    stat = chi_square(counts, expected)
    print(f"\n{params}: {kept} tokens kept, chi-square {stat:.1f} (critical {CHI2_CRIT[kept - 1]})")
    assert kept > 1 and stat < CHI2_CRIT[kept - 1]


@BATCHES
def test_grammar_masked_rows_draw_only_allowed_tokens(fi, row_params):
    bs = 64
    params = [row_params[i % len(row_params)] for i in range(bs)]
    logits = torch.randn(bs, VOCAB, device=CUDA) * 3
    masked = torch.zeros(bs, dtype=torch.bool, device=CUDA)
    masked[::2] = True  # every other row: 5 allowed tokens (fewer than most top-k), the rest -inf
    allowed = torch.zeros(bs, VOCAB, dtype=torch.bool, device=CUDA)
    allowed[:, [3, 1000, 64000, 128000, VOCAB - 1]] = True
    logits = logits.masked_fill(masked[:, None] & ~allowed, float("-inf"))
    logits[1] = float("-inf")  # nothing allowed at all: the argmax, token 0, as on the pytorch path
    info = info_for(params)
    rows = torch.arange(bs, device=CUDA)
    for _ in range(200):
        tokens = fi(logits, info).next_token_ids
        assert allowed[rows, tokens][masked].all()
        assert tokens[1].item() == 0


def test_seeded_and_greedy_rows_are_unchanged(fi):
    bs = 32
    params = [SamplingParams(top_p=0.9, seed=i) if i % 3 == 0 else
              SamplingParams(temperature=0.0) if i % 3 == 1 else SamplingParams(top_p=0.9) for i in range(bs)]
    logits = torch.randn(bs, VOCAB, device=CUDA) * 2
    steps = list(range(bs))
    info = info_for(params, steps)
    ours = fi(logits, info).next_token_ids
    reference = Sampler()(logits, info).next_token_ids
    seeded, greedy = list(range(0, bs, 3)), list(range(1, bs, 3))
    assert torch.equal(ours[seeded], reference[seeded])
    assert torch.equal(ours[greedy], logits[greedy].argmax(-1))


def test_draws_follow_the_global_seed_and_advance(fi):
    """torch.manual_seed (--random-seed) fixes the draws; consecutive steps draw afresh (flashinfer's default,
    a new generator per call, would repeat them)."""
    logits = torch.zeros(64, 1000, device=CUDA)
    info = info_for([SamplingParams(top_p=0.95)] * 64)
    torch.manual_seed(3)
    a = fi(logits, info).next_token_ids
    b = fi(logits, info).next_token_ids
    torch.manual_seed(3)
    assert torch.equal(a, fi(logits, info).next_token_ids)
    assert not torch.equal(a, b)

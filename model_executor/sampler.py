"""Batched token sampling: temperature, top-k, top-p, min-p, per-request seeds, logprobs.

One `SamplingBatchInfo` is built per step from the batch's `SamplingParams`; `Sampler` turns a
[bs, vocab] logits tensor into the next token of every row.

Sampling uses the exponential race (equivalently the Gumbel-max trick): with E_i ~ Exp(1) i.i.d.,
argmax_i p_i / E_i is distributed as p. It is computed in log space,
argmax_i (log p_i - log E_i), where unnormalised filtered logits can stand in for log p_i because
the normaliser is shared by the whole row and filtered tokens are -inf. The noise of a seeded row is
drawn in vocabulary order from a generator seeded by (seed, step) alone, and every filter is a
row-wise no-op for rows that do not use it, so a seeded request gets the same tokens whatever else
shares its batch and wherever it sits in it.

With flashinfer (`--sampling-backend`, model_executor/sampling_flashinfer.py), the random rows without a
seed are drawn by its rejection-sampling kernels instead, which never sort the vocabulary; seeded rows still
race, among themselves.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch

from model_executor.sampling_params import SamplingParams

if TYPE_CHECKING:
    from model_executor.sampling_flashinfer import BackgroundFlashInfer, FlashInferSampler

# Temperatures below this are treated as greedy: dividing by them overflows float32, and the
# tempered distribution is indistinguishable from argmax anyway.
GREEDY_TEMPERATURE_EPS = 1e-5
# Temperatures above this are clamped to it: the tempered distribution is already uniform over the allowed
# tokens, and beyond float32's range the temperature became inf, which turns every banned (-inf) logit into
# NaN, which argmax prefers: a grammar's or min_tokens' banned token (token 0) would come out.
MAX_TEMPERATURE = 1e30

# Batches whose random rows all use top-k with k at most this sample among their k best tokens (no sort).
TOP_K_FIRST_MAX = 1024

_MASK64 = (1 << 64) - 1
_GOLDEN64 = 0x9E3779B97F4A7C15  # large odd constant


def _splitmix64(x: int) -> int:
    x &= _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def generator_seed(seed: int, step: int) -> int:
    """Seed for the noise of output token `step` of a request with `seed`, in [0, 2**63).

    Mixed with splitmix64 so all 64 bits matter (torch's CPU generator keeps only the low 32).
    """
    return _splitmix64(seed * _GOLDEN64 + step) & ((1 << 63) - 1)


@dataclass
class SamplingBatchInfo:
    """Per-step sampling tensors for a batch; build with `from_params`.

    Rows that sample greedily (temperature ~0 or top_k == 1) hold 1.0 in `temperatures` (never
    used) and are excluded from the `need_*` flags.
    """

    temperatures: torch.Tensor  # [bs, 1] float32
    top_ps: torch.Tensor  # [bs] float32
    top_ks: torch.Tensor  # [bs] int64; disabled (-1/0) -> vocab_size (or int32 max if unknown)
    min_ps: torch.Tensor  # [bs] float32
    is_greedy: torch.Tensor  # [bs] bool
    is_all_greedy: bool
    need_top_p: bool
    need_top_k: bool
    need_min_p: bool
    seeds: list[int | None]  # per-row request seed
    steps: list[int]  # per-row index of the token being sampled
    max_top_logprobs: int  # max over rows of top_logprobs; -1 if no row wants logprobs
    # Derived host-side bookkeeping (no device syncs needed in the sampler):
    seeded_rows: tuple[int, ...] = ()  # non-greedy rows with a seed
    row_generator_seeds: tuple[int, ...] = ()  # generator_seed(seed, step) for each seeded row
    has_unseeded_random: bool = False  # some non-greedy row draws from the global RNG
    max_random_top_k: int = 0  # the largest k of the non-greedy rows (disabled top-k counts as the vocab)

    @property
    def batch_size(self) -> int:
        return len(self.seeds)

    @property
    def return_logprob(self) -> bool:
        return self.max_top_logprobs >= 0

    @classmethod
    def from_params(
        cls,
        params: Sequence[SamplingParams],
        steps: Sequence[int],
        device: torch.device | str,
        vocab_size: int | None = None,
    ) -> SamplingBatchInfo:
        if len(params) != len(steps):
            raise ValueError(f"got {len(params)} params but {len(steps)} steps")
        disabled_k = vocab_size if vocab_size is not None else torch.iinfo(torch.int32).max

        temps: list[float] = []
        top_ps: list[float] = []
        top_ks: list[int] = []
        min_ps: list[float] = []
        greedy: list[bool] = []
        need_top_p = need_top_k = need_min_p = False
        seeded_rows: list[int] = []
        row_seeds: list[int] = []
        has_unseeded_random = False
        max_top_logprobs = -1

        for i, (p, step) in enumerate(zip(params, steps)):
            g = p.is_greedy or p.temperature < GREEDY_TEMPERATURE_EPS
            k = p.top_k if p.top_k > 0 else disabled_k
            if vocab_size is not None:
                k = min(k, vocab_size)
            greedy.append(g)
            temps.append(1.0 if g else min(float(p.temperature), MAX_TEMPERATURE))
            top_ps.append(float(p.top_p))
            top_ks.append(k)
            min_ps.append(float(p.min_p))
            if not g:
                need_top_p |= p.top_p < 1.0
                need_top_k |= k < disabled_k
                need_min_p |= p.min_p > 0.0
                if p.seed is not None:
                    seeded_rows.append(i)
                    row_seeds.append(generator_seed(p.seed, step))
                else:
                    has_unseeded_random = True
            if p.top_logprobs is not None:
                max_top_logprobs = max(max_top_logprobs, p.top_logprobs)

        # One host-to-device copy for the per-row values (float64 holds every k exactly), split on the device.
        packed = torch.tensor([temps, top_ps, top_ks, min_ps, greedy], dtype=torch.float64)
        packed = packed.to(device, non_blocking=True)
        random_ks = [k for k, g in zip(top_ks, greedy) if not g]
        return cls(
            temperatures=packed[0].float().view(-1, 1),
            top_ps=packed[1].float(),
            top_ks=packed[2].long(),
            min_ps=packed[3].float(),
            is_greedy=packed[4].bool(),
            is_all_greedy=all(greedy),
            need_top_p=need_top_p,
            need_top_k=need_top_k,
            need_min_p=need_min_p,
            seeds=[p.seed for p in params],
            steps=list(steps),
            max_top_logprobs=max_top_logprobs,
            seeded_rows=tuple(seeded_rows),
            row_generator_seeds=tuple(row_seeds),
            has_unseeded_random=has_unseeded_random,
            max_random_top_k=max(random_ks, default=0),
        )

    def seeded_subset(self, index: torch.Tensor) -> SamplingBatchInfo:
        """The seeded rows alone (`index`: `seeded_rows` on the device), for the exponential race; the need_*
        flags and max_random_top_k stay those of the whole batch (an upper bound: row-wise no-ops)."""
        rows = self.seeded_rows
        return replace(
            self, temperatures=self.temperatures[index], top_ps=self.top_ps[index], top_ks=self.top_ks[index],
            min_ps=self.min_ps[index], is_greedy=self.is_greedy[index], seeds=[self.seeds[r] for r in rows],
            steps=[self.steps[r] for r in rows], max_top_logprobs=-1, seeded_rows=tuple(range(len(rows))),
            has_unseeded_random=False)


def start_host_copy(tensors: tuple) -> tuple[tuple, torch.cuda.Event | None]:
    """Device tensors (or None) copied to pinned host buffers without waiting, and the event that marks the
    copies done (None: CPU tensors, returned as they are)."""
    first = next(t for t in tensors if t is not None)
    if not first.is_cuda:
        return tensors, None
    host = tuple(None if t is None else
                 torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True) for t in tensors)
    event = torch.cuda.Event()
    event.record()
    return host, event


@dataclass
class SampleOutput:
    next_token_ids: torch.Tensor  # [bs] int64
    # log_softmax of the raw (untempered, unfiltered) logits at the chosen token; None when no row
    # asked for logprobs. Computed for every row when present: rows that did not ask ignore it.
    logprobs: torch.Tensor | None = None  # [bs] float32
    # The max_top_logprobs best tokens of every row under the same distribution, best first; None
    # when max_top_logprobs < 1. Row i uses the first params[i].top_logprobs columns.
    top_logprob_ids: torch.Tensor | None = None  # [bs, max_top_logprobs] int64
    top_logprob_values: torch.Tensor | None = None  # [bs, max_top_logprobs] float32

    def to_host(self) -> HostSample:
        """Start copying the results to the host without waiting for them (pinned buffers + an event on a
        GPU), so the scheduler can launch the next step before it reads this one's tokens."""
        host, event = start_host_copy(
            (self.next_token_ids, self.logprobs, self.top_logprob_ids, self.top_logprob_values))
        return HostSample(*host, event=event)


@dataclass
class HostSample:
    """A SampleOutput on its way to the host; `lists()` waits for the copy (a no-op on the CPU)."""

    next_token_ids: torch.Tensor
    logprobs: torch.Tensor | None
    top_logprob_ids: torch.Tensor | None
    top_logprob_values: torch.Tensor | None
    event: torch.cuda.Event | None

    def lists(self) -> tuple[list[int], list[float] | None, list[list[int]] | None, list[list[float]] | None]:
        if self.event is not None:
            self.event.synchronize()

        def as_list(t):
            return None if t is None else t.tolist()

        return (self.next_token_ids.tolist(), as_list(self.logprobs), as_list(self.top_logprob_ids),
                as_list(self.top_logprob_values))


class Sampler:
    """`Sampler(flashinfer)(logits, info)` -> SampleOutput; no state between calls.

    flashinfer (model_executor/sampling_flashinfer.py): its kernels draw random rows without a seed (see
    __init__); None: every random row takes the exponential race. Seeded rows always take the race (their
    tokens must not depend on the batch), greedy rows the argmax, and logprobs come from the raw logits.
    """

    def __init__(self, flashinfer: FlashInferSampler | BackgroundFlashInfer | None = None,
                 flashinfer_always: bool = False):
        """flashinfer: its kernels draw the unseeded random rows of the batches where the race would sort the
        vocabulary (top-p, or top-k above TOP_K_FIRST_MAX); elsewhere the race is as fast or faster
        (docs/benchmarks.md, bench_sampler on the H200). flashinfer_always: for every batch (tests)."""
        self.flashinfer = flashinfer
        self.flashinfer_always = flashinfer_always

    @property
    def backend(self) -> str:
        if self.flashinfer is None:
            return "pytorch"
        return "flashinfer" if self.flashinfer.get() is not None else "pytorch (flashinfer not ready)"

    def __call__(self, logits: torch.Tensor, info: SamplingBatchInfo) -> SampleOutput:
        if logits.dim() != 2 or logits.shape[0] != info.batch_size:
            raise ValueError(f"logits shape {tuple(logits.shape)} does not match batch {info.batch_size}")
        logits = logits.float()

        argmax_ids = torch.argmax(logits, dim=-1)
        if info.is_all_greedy:
            next_ids = argmax_ids
        else:
            sampled = self._sample(logits, info, argmax_ids)
            next_ids = torch.where(info.is_greedy, argmax_ids, sampled)

        out = SampleOutput(next_token_ids=next_ids)
        if info.return_logprob:
            logprobs = torch.log_softmax(logits, dim=-1)
            out.logprobs = logprobs.gather(1, next_ids.unsqueeze(1)).squeeze(1)
            if info.max_top_logprobs > 0:
                n = min(info.max_top_logprobs, logits.shape[1])
                values, ids = torch.topk(logprobs, n, dim=-1, sorted=True)
                out.top_logprob_values, out.top_logprob_ids = values, ids
        return out

    @staticmethod
    def _remove_sorted(sorted_logits: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
        """Which of each row's candidates (sorted best first) top-k, then top-p, remove (no-op rows: none)."""
        positions = torch.arange(sorted_logits.shape[1], device=sorted_logits.device).unsqueeze(0)
        remove = positions >= info.top_ks.unsqueeze(1)  # keeps position 0 as top_k >= 1
        if info.need_top_p:
            probs = torch.softmax(sorted_logits.masked_fill(remove, float("-inf")), dim=-1)
            mass_before = torch.cumsum(probs, dim=-1) - probs
            top_p = info.top_ps.unsqueeze(1)
            # Keep the smallest prefix whose mass reaches top_p; position 0 has mass_before 0
            # < top_p. Rows with top_p == 1 are untouched (rounding could push mass_before to 1).
            remove |= (mass_before >= top_p) & (top_p < 1.0)
        return remove

    @staticmethod
    def _min_p(scaled: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
        if not info.need_min_p:
            return scaled
        # p_i < min_p * p_max  <=>  logit_i < logit_max + log(min_p); invariant to renormalising
        # after top-k/top-p, and min_p == 0 gives -inf (no-op). The max token always survives.
        max_logit = scaled.max(dim=-1, keepdim=True).values
        threshold = max_logit + torch.log(info.min_ps).unsqueeze(1)
        return scaled.masked_fill(scaled < threshold, float("-inf"))

    def _filter(self, scaled: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
        """Set tokens removed by top-k, then top-p, then min-p to -inf (row-wise no-ops when off)."""
        if info.need_top_k or info.need_top_p:
            sorted_logits, sorted_idx = torch.sort(scaled, dim=-1, descending=True, stable=True)
            remove = self._remove_sorted(sorted_logits, info)
            mask = torch.zeros_like(remove).scatter_(1, sorted_idx, remove)
            scaled = scaled.masked_fill(mask, float("-inf"))
        return self._min_p(scaled, info)

    def _sample(self, logits: torch.Tensor, info: SamplingBatchInfo, argmax_ids: torch.Tensor) -> torch.Tensor:
        scaled = logits / info.temperatures
        flashinfer = None if self.flashinfer is None else self.flashinfer.get()  # (None while it builds)
        if flashinfer is None or not info.has_unseeded_random or not (
                self.flashinfer_always or self._race_sorts(info)):
            return self._race(scaled, info)
        if info.seeded_rows:  # the race among the seeded rows alone, first: flashinfer overwrites `scaled`
            index = torch.tensor(info.seeded_rows, pin_memory=logits.is_cuda).to(logits.device, non_blocking=True)
            seeded = self._race(scaled[index], info.seeded_subset(index))
        tokens = flashinfer.sample(scaled, argmax_ids, top_ks=info.top_ks if info.need_top_k else None,
                                        top_ps=info.top_ps if info.need_top_p else None,
                                        min_ps=info.min_ps if info.need_min_p else None)
        if info.seeded_rows:
            tokens[index] = seeded
        return tokens

    @staticmethod
    def _top_k_first(info: SamplingBatchInfo) -> bool:
        """Every random row keeps at most TOP_K_FIRST_MAX tokens: the race needs only the k best."""
        return info.need_top_k and info.max_random_top_k <= TOP_K_FIRST_MAX

    @classmethod
    def _race_sorts(cls, info: SamplingBatchInfo) -> bool:
        """Whether the race filters this batch by sorting the whole vocabulary (see _race and _filter)."""
        return (info.need_top_k or info.need_top_p) and not cls._top_k_first(info)

    def _race(self, scaled: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
        """Exponential race of every row (seeded rows with their own noise), filters applied first."""
        noise = self._exponential_noise(scaled, info)
        if self._top_k_first(info):
            # Every random row keeps at most k tokens: filter and race among the k best only instead of
            # sorting the vocabulary. The same noise values (drawn in vocabulary order) enter the race, so
            # the token equals the full path's (up to the order of exactly tied logits at the k-th place).
            cand, cand_ids = torch.topk(scaled, info.max_random_top_k, dim=-1)
            cand = self._min_p(cand.masked_fill(self._remove_sorted(cand, info), float("-inf")), info)
            best = torch.argmax(cand - noise.gather(1, cand_ids).log(), dim=-1, keepdim=True)
            return cand_ids.gather(1, best).squeeze(1)
        # Exponential race in log space: argmax(log p - log E); -inf (filtered) never wins.
        return torch.argmax(self._filter(scaled, info) - noise.log(), dim=-1)

    def filtered_logits(self, logits: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
        """Each random row's sampling distribution as float32 logits: tempered, then top-k, top-p and min-p
        (removed tokens -inf), exactly as this sampler draws from it; its softmax is the distribution. Greedy
        rows come out unscaled (their temperature slot holds 1.0) and filtered by their unused settings."""
        return self._filter(logits.float() / info.temperatures, info)

    def race(self, filtered: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
        """One token of each row of filtered logits (filtered_logits, perhaps with more tokens removed) by the
        exponential race, with each row's noise (a seeded row: its (seed, step) stream, as __call__ uses)."""
        return torch.argmax(filtered - self._exponential_noise(filtered, info).log(), dim=-1)

    @staticmethod
    def _exponential_noise(like: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
        """Exp(1) noise [bs, vocab]: global RNG for unseeded rows, (seed, step) streams for seeded."""
        bs, vocab = like.shape
        noise = torch.empty((bs, vocab), dtype=torch.float32, device=like.device)
        if info.has_unseeded_random:
            noise.exponential_()
        else:
            noise.fill_(1.0)  # only greedy / seeded rows: their values are unused or overwritten
        if info.seeded_rows:
            gen = torch.Generator(device=like.device)
            for row, seed in zip(info.seeded_rows, info.row_generator_seeds):
                gen.manual_seed(seed)
                # Fresh [vocab] draw, independent of the row's position and the batch shape.
                noise[row] = torch.empty(vocab, dtype=torch.float32, device=like.device).exponential_(
                    generator=gen
                )
        # Exp(1) draws of exactly 0 would make log(E) = -inf; clamp to the smallest normal float.
        return noise.clamp_(min=torch.finfo(torch.float32).tiny)

"""Speculative decoding's policy: which running requests draft how many tokens this step, and the counts.

The scheduler asks `Speculator.drafts(reqs, room)` before each decode step; a step where nobody drafts stays a
plain decode step (its CUDA graph included), else the step becomes a verify batch (Scheduler._verify_forward).
After the step, `record` gets each request's drafted and accepted counts.

Where drafts come from is a `DraftProposer`: given the requests that draft this step and how many tokens each may
draft, it returns each one's greedy drafts (NGRAM here: `NgramProposer`; STANDALONE and EAGLE3 run a draft model,
scheduler/draft_model.py). The acceptance treats drafts as point masses, so the target's distribution is kept
whatever proposes them.

Who drafts: every running request except those with a grammar (their matcher would have to follow the drafts;
they verify their one token), those that sample randomly with a seed (they keep their (seed, step) tokens,
identical to plain decoding's), and those one token from their length limit. Drafts never pass a request's
max_tokens (a run is at most the tokens it may still produce).

Adaptivity, so a request whose drafts keep missing is not slower than plain decoding: a request drafts at most
one token more than its last verify step accepted (a run accepted whole grows it by one, up to the maximum);
after `miss_limit` verify steps in a row that accepted none of its drafts, it stops proposing for a backoff of
steps that doubles with every further miss (up to `max_backoff_steps`); an accepted draft resets it. A batch drafts
at most `max_batch_drafts` tokens in all (split evenly when more are proposed), never more than the KV slots free
after each request's own next slot, and nothing when more than `max_batch_size` requests decode (where a verify
pass costs more than its accepted tokens save: on the CPU past 4 requests, docs/benchmarks.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from model_executor.sampler import GREEDY_TEMPERATURE_EPS
from scheduler.ngram import NgramIndex
from scheduler.req import Req

SPECULATIVE_ALGORITHMS = ("NGRAM", "STANDALONE", "EAGLE3")


@dataclass(frozen=True)
class SpeculativeConfig:
    algorithm: str  # NGRAM, STANDALONE or EAGLE3
    num_draft_tokens: int  # tokens verified per request and step: the last sampled token + up to this - 1 drafts
    draft_model_path: str | None = None  # STANDALONE: a smaller model with the target's vocabulary; EAGLE3: a head
    ngram_min_window: int = 1
    ngram_max_window: int = 12
    miss_limit: int = 1
    # False: every request drafts all it can every step, however its drafts fare (benchmarks measuring the cost
    # of missing drafts, tests that need drafts verified).
    adaptive: bool = True
    max_backoff_steps: int = 32
    max_batch_drafts: int = 64
    max_batch_size: int = 64

    def __post_init__(self):
        if self.algorithm not in SPECULATIVE_ALGORITHMS:
            raise ValueError(f"speculative algorithm {self.algorithm!r} is not one of {SPECULATIVE_ALGORITHMS}")
        if (self.algorithm != "NGRAM") != (self.draft_model_path is not None):
            raise ValueError(f"{self.algorithm} needs a draft model path" if self.algorithm != "NGRAM"
                             else "NGRAM takes no draft model")
        if self.num_draft_tokens < 2:
            raise ValueError("num_draft_tokens must be at least 2 (the last token and one draft)")

    @property
    def max_drafts(self) -> int:
        return self.num_draft_tokens - 1

    def info(self) -> dict:
        return {"algorithm": self.algorithm, "num_draft_tokens": self.num_draft_tokens,
                "draft_model_path": self.draft_model_path,
                "ngram_min_match_window_size": self.ngram_min_window,
                "ngram_max_match_window_size": self.ngram_max_window,
                "max_batch_drafts": self.max_batch_drafts, "max_batch_size": self.max_batch_size}


class DraftProposer(Protocol):
    """Where drafts come from. `propose` gets the requests that draft this step (each may draft ks[i] >= 1 tokens)
    and returns each one's greedy drafts (at most ks[i]; fewer or none where it has nothing to offer)."""

    wants_hidden: bool  # True: it drafts from the target's aux hidden states, which `observe` hands over

    def propose(self, reqs: list[Req], ks: list[int]) -> list[list[int]]: ...

    def release(self, req: Req) -> None:
        """req gave its KV back (finished, retracted, aborted): drop what the proposer keeps for it."""

    def observe(self, req: Req, start: int, hidden: torch.Tensor | None) -> None:
        """The target computed KV for req's tokens at positions start.. (hidden: their rows of the target's
        aux hidden states, None where the target was not asked for them)."""


class NgramProposer:
    """NGRAM: prompt lookup over each request's own tokens (scheduler/ngram.py); the index lives in Req.spec."""

    wants_hidden = False

    def __init__(self, config: SpeculativeConfig):
        self.config = config

    def propose(self, reqs: list[Req], ks: list[int]) -> list[list[int]]:
        return [self.propose_one(r, k) for r, k in zip(reqs, ks)]

    def propose_one(self, req: Req, k: int) -> list[int]:
        idx = req.spec.index
        n_in = len(req.input_ids)
        if len(idx) < n_in:
            idx.extend(req.input_ids[len(idx):])
        idx.extend(req.output_ids[len(idx) - n_in:])
        return idx.propose(k)

    def release(self, req: Req) -> None:
        pass

    def observe(self, req: Req, start: int, hidden: torch.Tensor | None) -> None:
        pass


@dataclass
class SpecState:
    """One request's drafting state and counts (Req.spec)."""

    index: NgramIndex
    misses: int = 0  # verify steps in a row with none of its drafts accepted
    backoff: int = 0  # the current pause length (0: none yet)
    skip: int = 0  # steps left without proposing
    cap: int | None = None  # the most drafts it proposes next (None: the maximum)
    verify_ct: int = 0  # steps that verified drafts of it
    drafted: int = 0
    accepted: int = 0


@dataclass
class SpecTotals:
    verify_steps: int = 0  # request-steps that verified at least one draft
    drafted: int = 0
    accepted: int = 0
    verify_batches: int = 0  # forward passes that verified drafts

    def mean_accept_length(self) -> float:
        """Tokens a request emits per verify step (accepted drafts + the token after them)."""
        return (self.accepted + self.verify_steps) / self.verify_steps if self.verify_steps else 0.0


class Speculator:
    def __init__(self, config: SpeculativeConfig, proposer: DraftProposer | None = None):
        self.config = config
        self.counts = SpecTotals()
        self.proposer = proposer if proposer is not None else NgramProposer(config)

    def state(self, req: Req) -> SpecState:
        if req.spec is None:
            req.spec = SpecState(NgramIndex(self.config.ngram_min_window, self.config.ngram_max_window))
        return req.spec

    @staticmethod
    def may_ever_draft(req: Req) -> bool:
        p = req.params
        seeded_random = p.seed is not None and not (p.is_greedy or p.temperature < GREEDY_TEMPERATURE_EPS)
        return req.grammar is None and req.pooling is None and not seeded_random

    @classmethod
    def may_draft(cls, req: Req) -> bool:
        return cls.may_ever_draft(req) and req.max_output - req.num_sampled > 1

    def drafts(self, reqs: list[Req], room: int) -> list[list[int]]:
        """Each request's drafts for this step ([]: it decodes its one token); room: KV slots the drafts may
        take in all."""
        if len(reqs) > self.config.max_batch_size:
            return [[] for _ in reqs]
        out: list[list[int]] = [[] for _ in reqs]
        drafting, ks = [], []
        for i, req in enumerate(reqs):
            if not self.may_draft(req):
                continue
            st = self.state(req)
            if st.skip > 0:
                st.skip -= 1
                continue
            k = min(st.cap or self.config.max_drafts if self.config.adaptive else self.config.max_drafts,
                    req.max_output - req.num_sampled - 1)
            drafting.append(i)
            ks.append(k)
        if drafting:
            proposed = self.proposer.propose([reqs[i] for i in drafting], ks)
            for i, k, draft in zip(drafting, ks, proposed):
                out[i] = draft[:k]
        total = sum(len(d) for d in out)
        budget = min(room, self.config.max_batch_drafts)
        if total > budget:
            out = self._trim(out, max(budget, 0))
        return out

    def release(self, req: Req) -> None:
        self.proposer.release(req)

    @property
    def wants_hidden(self) -> bool:
        """The proposer drafts from the target's aux hidden states (EAGLE3): the scheduler hands them over."""
        return self.proposer.wants_hidden

    def observe(self, req: Req, start: int, hidden: torch.Tensor | None) -> None:
        if self.may_ever_draft(req):  # (requests that never draft keep nothing)
            self.proposer.observe(req, start, hidden)

    @staticmethod
    def _trim(drafts: list[list[int]], budget: int) -> list[list[int]]:
        """At most budget drafts in all: an even share each (one more for the first ones while some are left)."""
        proposing = sum(1 for d in drafts if d)
        share = budget // proposing
        extra = budget - share * proposing
        trimmed = []
        for d in drafts:
            n = min(len(d), share)
            if n < len(d) and extra:
                n, extra = n + 1, extra - 1
            trimmed.append(d[:n])
        return trimmed

    def record(self, req: Req, drafted: int, accepted: int) -> None:
        """A verify step's outcome for req (drafted > 0)."""
        st = self.state(req)
        st.verify_ct += 1
        st.drafted += drafted
        st.accepted += accepted
        c = self.counts
        c.verify_steps += 1
        c.drafted += drafted
        c.accepted += accepted
        if not self.config.adaptive:
            return
        st.cap = min(self.config.max_drafts, accepted + 1)
        if accepted:
            st.misses, st.backoff = 0, 0
            return
        st.misses += 1
        if st.misses >= self.config.miss_limit:
            st.backoff = min(max(1, 2 * st.backoff), self.config.max_backoff_steps)
            st.skip = st.backoff

    def stats(self) -> dict:
        c = self.counts
        return {"spec_verify_steps": c.verify_steps, "spec_verify_batches": c.verify_batches,
                "spec_draft_tokens": c.drafted, "spec_accepted_tokens": c.accepted,
                "spec_accept_length": round(c.mean_accept_length(), 4)}

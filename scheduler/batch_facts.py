"""BatchFacts: what a batch's sampling needs from its requests that stays the same from step to step.

A decode batch usually holds the same requests step after step (until one finishes, is retracted or a new one
joins). Their request rows and sampling parameters do not change meanwhile, nor do the sampling tensors built
from the parameters (unless a row is seeded: its noise depends on the step). Gathering them once per batch
instead of once per step takes several passes over every running request out of the step; the features
no request uses (penalties, logit bias, grammars, min_tokens) then cost nothing per step.
"""

from __future__ import annotations

from dataclasses import dataclass

from model_executor.sampler import SamplingBatchInfo
from model_executor.sampling_params import SamplingParams
from scheduler.req import Req


@dataclass
class BatchFacts:
    reqs: list[Req]
    generation: int  # the scheduler's admission generation they were gathered at (see Scheduler._generation)
    rows: list[int]  # request rows
    params: list[SamplingParams]
    epochs: list[int]  # retraction counts: constant while the batch holds the same admitted requests
    penalized: list[int]  # batch positions with presence / frequency / repetition penalties
    has_logit_bias: bool
    has_grammar: bool
    min_tokens: list[int]  # batch positions with min_new_tokens > 0
    # Built on the first sample and reused while no row is seeded (a seeded row's noise depends on its step).
    sampling_info: SamplingBatchInfo | None = None

    @classmethod
    def gather(cls, reqs: list[Req], generation: int) -> BatchFacts:
        params = [r.params for r in reqs]
        return cls(
            reqs=reqs, generation=generation, rows=[r.req_pool_idx for r in reqs], params=params,
            epochs=[r.num_retractions for r in reqs],
            penalized=[i for i, p in enumerate(params) if p.has_penalties],
            has_logit_bias=any(p.logit_bias for p in params),
            has_grammar=any(r.grammar is not None for r in reqs),
            min_tokens=[i for i, p in enumerate(params) if p.min_new_tokens > 0])

    def matches(self, reqs: list[Req], generation: int) -> bool:
        """Still true of `reqs`: the same requests in the same order (compared by identity, in C) and no
        admission, retraction or release since (which may change a request's row or retraction count)."""
        return generation == self.generation and reqs == self.reqs

    def sampling_info_for(self, steps: list[int], device) -> SamplingBatchInfo:
        info = self.sampling_info
        if info is None:
            info = SamplingBatchInfo.from_params(self.params, steps, device)
            if not info.seeded_rows:
                self.sampling_info = info
        else:
            # Without seeded rows the info depends on the params alone; the steps are kept current anyway.
            info.steps = steps
        return info

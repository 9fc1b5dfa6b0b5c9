"""The scheduler's side of prompt logprobs: which rows of an extend batch to score, and reading the scores back.

A request that wants them from prompt position s has the hidden rows of positions s..L-2 scored (row p gives
the logprob of prompt token p + 1). Under chunked prefill each chunk scores its own positions; the last row
of a chunk predicts the first token of the next chunk, which is known (it is in the prompt). Positions served
from the radix cache have no hidden states, so such a request matches the cache only up to its next scored
position (Scheduler._match). The scores come back like sampled tokens: copied to pinned memory behind an event
at launch, read when the scheduler reads that batch (after launching the next one, with overlap).
"""

from __future__ import annotations

from dataclasses import dataclass

from model_executor.prompt_logprobs import HostPromptLogprobs, PromptLogprobPlan, PromptLogprobsOutput
from scheduler.io_struct import PromptLogprobs
from scheduler.req import Req


@dataclass
class ScoredSpan:
    """Rows first..first+count-1 of req's prompt, scored in one batch (targets: the tokens after them)."""

    req: Req
    first: int
    count: int


@dataclass
class PromptLogprobLaunch:
    """The plan of one extend batch and the spans it scores, in row order."""

    plan: PromptLogprobPlan
    spans: list[ScoredSpan]

    def launched(self, scores: PromptLogprobsOutput) -> LaunchedPromptLogprobs:
        return LaunchedPromptLogprobs(self.spans, scores.to_host())

    def advance(self) -> None:
        """The batch ran: each request's next scored position moves past its span (None: all scored). Called
        only once the launch succeeded, so a batch rolled back and rerun scores the same rows again."""
        for span in self.spans:
            end = span.first + span.count
            span.req.prompt_logprob_next = end if end < len(span.req.input_ids) - 1 else None


def plan_prompt_logprobs(reqs: list[Req], lens: list[int], starts: list[int], device,
                         pin_memory: bool) -> PromptLogprobLaunch | None:
    """The rows to score in an extend batch of `lens[i]` tokens of reqs[i] from position starts[i]; None when
    no request in it wants any (the head then runs on the last tokens only)."""
    rows: list[int] = []
    targets: list[int] = []
    spans: list[ScoredSpan] = []
    top_n = 0
    offset = 0
    for req, n, start in zip(reqs, lens, starts):
        nxt = req.prompt_logprob_next
        if nxt is not None:
            assert start <= nxt, "positions before the next scored one were skipped (prefix matched past it)"
            end = min(start + n, len(req.input_ids) - 1)
            if end > nxt:
                rows.extend(range(offset + nxt - start, offset + end - start))
                targets.extend(req.input_ids[nxt + 1 : end + 1])
                spans.append(ScoredSpan(req, nxt, end - nxt))
                top_n = max(top_n, req.params.prompt_top_logprobs)
        offset += n
    if not spans:
        return None
    return PromptLogprobLaunch(PromptLogprobPlan.build(rows, targets, top_n, device, pin_memory), spans)


@dataclass
class LaunchedPromptLogprobs:
    spans: list[ScoredSpan]
    result: HostPromptLogprobs

    def apply(self) -> None:
        """Wait for the scores and add them to each request's unreported prompt logprobs (a request retracted
        since keeps them: it will not score these positions again; a finished one drops them)."""
        logprobs, ranks, top_ids, top_values = self.result.lists()
        row = 0
        for span in self.spans:
            req, rows = span.req, slice(row, row + span.count)
            row += span.count
            if req.is_finished:
                continue
            k = req.params.prompt_top_logprobs
            part = PromptLogprobs(
                first=span.first + 1, token_ids=req.input_ids[span.first + 1 : span.first + 1 + span.count],
                logprobs=logprobs[rows], ranks=ranks[rows],
                top_ids=[t[:k] for t in top_ids[rows]] if top_ids is not None else [[] for _ in range(span.count)],
                top_logprobs=([v[:k] for v in top_values[rows]] if top_values is not None
                              else [[] for _ in range(span.count)]))
            if req.pending_prompt_logprobs is None:
                req.pending_prompt_logprobs = part
            else:
                req.pending_prompt_logprobs.extend(part)

"""Speculative decoding's acceptance: which drafted tokens the target keeps, and the token after them.

A verify batch gives, per request, the target's logits at its rows [last token, d_1, ..., d_k]: row i holds
the distribution p_i of the token after d_1..d_i (row 0: after the last sampled token). The logits come
processed as for plain sampling (penalties, bans, grammar masks; the scheduler applies them per row), and
p_i is the sampler's own distribution of them (temperature, top-k, top-p, min-p: Sampler.filtered_logits).

- Greedy rows: d_{i+1} is accepted while it equals argmax p_i; the first mismatch emits argmax p_i instead,
  and a run accepted to its end emits the bonus argmax p_k. The output equals plain greedy decoding's.
- Random rows (the draft is a point mass, as NGRAM's is): d_{i+1} is accepted with probability p_i(d_{i+1});
  on rejection the token is drawn from p_i with d_{i+1} removed and renormalised; a run accepted to its end
  draws the bonus from p_k. Each emitted token is then distributed exactly as p_i: P(d) = p_i(d), and for
  t != d, P(t) = (1 - p_i(d)) * p_i(t) / (1 - p_i(d)) = p_i(t).

Everything runs on the logits' device with no host sync; `VerifyOutput.to_host` starts the copy back.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from model_executor.sampler import Sampler, SamplingBatchInfo, start_host_copy


@dataclass
class VerifyOutput:
    # The token each row emits if the run reaches it: its draft when accepted, else the row's own token (the
    # correction after a rejection; the bonus at a request's last row).
    row_tokens: torch.Tensor  # [rows] int64
    accept_lens: torch.Tensor  # [bs] int64: drafts accepted per request (its run emits accept_len + 1 tokens)
    final_tokens: torch.Tensor  # [bs] int64: each run's last token (the next step's input)
    # Like SampleOutput's, per row, for row_tokens (None when no request asked for logprobs).
    logprobs: torch.Tensor | None = None
    top_logprob_ids: torch.Tensor | None = None
    top_logprob_values: torch.Tensor | None = None

    def to_host(self) -> HostVerify:
        host, event = start_host_copy((self.row_tokens, self.accept_lens, self.logprobs, self.top_logprob_ids,
                                       self.top_logprob_values))
        return HostVerify(*host, event=event)


@dataclass
class HostVerify:
    """A VerifyOutput on its way to the host; `lists()` waits for the copy."""

    row_tokens: torch.Tensor
    accept_lens: torch.Tensor
    logprobs: torch.Tensor | None
    top_logprob_ids: torch.Tensor | None
    top_logprob_values: torch.Tensor | None
    event: torch.cuda.Event | None

    def lists(self):
        if self.event is not None:
            self.event.synchronize()

        def as_list(t):
            return None if t is None else t.tolist()

        return (self.row_tokens.tolist(), self.accept_lens.tolist(), as_list(self.logprobs),
                as_list(self.top_logprob_ids), as_list(self.top_logprob_values))


def run_index(num_rows: list[int], device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(starts [bs], index [bs, max_rows] of each request's rows (padded with its last row), valid mask)."""
    starts, acc = [], 0
    for n in num_rows:
        starts.append(acc)
        acc += n
    width = max(num_rows)
    start_t = torch.tensor(starts, dtype=torch.int64)
    offs = torch.arange(width, dtype=torch.int64).unsqueeze(0)
    count = torch.tensor(num_rows, dtype=torch.int64).unsqueeze(1)
    valid = offs < count
    index = start_t.unsqueeze(1) + torch.minimum(offs, count - 1)
    return start_t.to(device), index.to(device), valid.to(device)


def verify_drafts(sampler: Sampler, logits: torch.Tensor, info: SamplingBatchInfo, drafts: torch.Tensor,
                  num_rows: list[int]) -> VerifyOutput:
    """logits [rows, vocab] (processed), info: the rows' sampling settings (one row per logits row; a row's
    step is the index of the output token it gives), drafts [rows] int64: the token after each row's input
    that the row verifies (-1 at each request's last row), num_rows: rows per request (drafts + 1), in order."""
    logits = logits.float()
    device = logits.device
    has_draft = drafts >= 0
    safe = drafts.clamp(min=0)
    argmax_ids = torch.argmax(logits, dim=-1)
    if info.is_all_greedy:
        accept = has_draft & (safe == argmax_ids)
        own = argmax_ids
    else:
        filtered = sampler.filtered_logits(logits, info)
        probs = torch.softmax(filtered, dim=-1)
        p_draft = probs.gather(1, safe.unsqueeze(1)).squeeze(1)
        uniform = torch.rand(p_draft.shape, device=device)  # (seeded rows carry no drafts)
        accept = has_draft & torch.where(info.is_greedy, safe == argmax_ids, uniform < p_draft)
        # The draft removed (a row without one keeps its whole distribution), then one draw per row.
        keep = filtered.gather(1, safe.unsqueeze(1))
        residual = filtered.scatter(1, safe.unsqueeze(1), torch.where(has_draft.unsqueeze(1), float("-inf"), keep))
        sampled = sampler.race(residual, info)
        # All the mass on the draft: a rejection has probability 0 (only rounding gets here); keep the draft.
        nothing_left = ~(residual > float("-inf")).any(dim=-1)
        sampled = torch.where(nothing_left, safe, sampled)
        own = torch.where(info.is_greedy, argmax_ids, sampled)
    row_tokens = torch.where(accept, safe, own)
    starts, index, valid = run_index(num_rows, device)
    accepted_prefix = (accept[index] & valid).to(torch.int64).cumprod(dim=1)
    accept_lens = accepted_prefix.sum(dim=1)
    out = VerifyOutput(row_tokens=row_tokens, accept_lens=accept_lens, final_tokens=row_tokens[starts + accept_lens])
    if info.return_logprob:
        logprobs = torch.log_softmax(logits, dim=-1)
        out.logprobs = logprobs.gather(1, row_tokens.unsqueeze(1)).squeeze(1)
        if info.max_top_logprobs > 0:
            n = min(info.max_top_logprobs, logits.shape[1])
            out.top_logprob_values, out.top_logprob_ids = torch.topk(logprobs, n, dim=-1, sorted=True)
    return out

"""Logit bias and the presence / frequency / repetition penalties, batched on the device.

`PenaltyState` holds, per request-pool row (a request's `req_pool_idx`), how often each vocabulary token
occurred in the request's output (int32 counts) and which tokens its prompt holds (a bool mask), both
[rows, vocab] on the model's device, allocated the first time a request asks for a penalty. A step updates
the counts of all its penalized rows with one scatter-add and applies the penalties with a handful of
whole-batch tensor ops: no per-request Python work touches the device in the step.

Definitions (OpenAI and vLLM): logit -= frequency_penalty * count + presence_penalty * (count > 0), counts
over output tokens only; repetition_penalty (HF/vLLM, over prompt and output tokens) divides a positive
logit and multiplies a negative one; logit_bias adds its value to the token's logit.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from model_executor.sampling_params import SamplingParams


class PenaltyState:
    def __init__(self, num_rows: int, vocab_size: int, device: torch.device | str):
        self.num_rows = num_rows
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self.output_counts: torch.Tensor | None = None  # [rows, vocab] int32
        self.prompt_mask: torch.Tensor | None = None  # [rows, vocab] bool

    def _ensure(self) -> None:
        if self.output_counts is None:
            shape = (self.num_rows, self.vocab_size)
            self.output_counts = torch.zeros(shape, dtype=torch.int32, device=self.device)
            self.prompt_mask = torch.zeros(shape, dtype=torch.bool, device=self.device)

    def init_row(self, row: int, params: SamplingParams, prompt_ids: Sequence[int],
                 output_ids: Sequence[int]) -> None:
        """At admission (again after a retraction): the row's counts from the tokens the request holds."""
        if not params.has_penalties:
            return
        self._ensure()
        self.output_counts[row].zero_()
        self.prompt_mask[row].zero_()
        if prompt_ids:
            self.prompt_mask[row, torch.tensor(list(prompt_ids), device=self.device)] = True
        if output_ids:
            out = torch.tensor(list(output_ids), device=self.device)
            self.output_counts[row].index_add_(0, out, torch.ones_like(out, dtype=torch.int32))

    def count_sampled(self, rows: torch.Tensor, tokens: torch.Tensor, penalized: list[int]) -> None:
        """Count the tokens just sampled (device tensors: rows[i] sampled tokens[i]) at the batch positions
        `penalized`, with one scatter-add and no host sync: the next step's penalties include them even when
        it is launched before the host reads them (overlap scheduling)."""
        if self.output_counts is None or not penalized:
            return
        if len(penalized) < len(rows):
            idx = torch.tensor(penalized, dtype=torch.int64).to(rows.device, non_blocking=True)
            rows, tokens = rows[idx], tokens[idx]
        self.output_counts.index_put_((rows.to(self.device), tokens.to(self.device)),
                                      torch.ones(tokens.shape, dtype=torch.int32, device=self.device),
                                      accumulate=True)

    def count_tokens(self, row: int, tokens: Sequence[int]) -> None:
        """Count tokens (host ids) as output of the request in `row` (a verify step's accepted run)."""
        if self.output_counts is None or not tokens:
            return
        out = torch.tensor(list(tokens), dtype=torch.int64, device=self.device)
        self.output_counts[row].index_add_(0, out, torch.ones_like(out, dtype=torch.int32))

    def apply(self, logits: torch.Tensor, rows: Sequence[int], params: Sequence[SamplingParams],
              drafted: Sequence[Sequence[int]] | None = None) -> None:
        """Penalties and logit bias on logits [bs, vocab] in place; rows[i] is batch row i's request row.
        drafted[i]: tokens batch row i counts as output on top of its row's counts (a speculative verify row:
        the drafts before it), or None."""
        batch = [i for i, p in enumerate(params) if p.has_penalties]
        if batch and self.output_counts is not None:
            self._apply_penalties(logits, [rows[i] for i in batch], [params[i] for i in batch], batch,
                                  [drafted[i] for i in batch] if drafted is not None else None)
        bias = [(i, t, b) for i, p in enumerate(params) for t, b in p.logit_bias]
        if bias:
            idx = torch.tensor([(i, t) for i, t, _ in bias], dtype=torch.int64).to(logits.device, non_blocking=True)
            values = torch.tensor([b for _, _, b in bias], dtype=logits.dtype).to(logits.device, non_blocking=True)
            logits.index_put_((idx[:, 0], idx[:, 1]), values, accumulate=True)

    def _apply_penalties(self, logits: torch.Tensor, rows: list[int], params: list[SamplingParams],
                         batch: list[int], drafted: list[Sequence[int]] | None) -> None:
        dev = logits.device
        values = torch.tensor([(p.presence_penalty, p.frequency_penalty, p.repetition_penalty) for p in params],
                              dtype=torch.float32).to(dev, non_blocking=True)
        row_idx = torch.tensor(rows, dtype=torch.int64).to(self.device, non_blocking=True)
        batch_idx = torch.tensor(batch, dtype=torch.int64).to(dev, non_blocking=True)
        counts = self.output_counts[row_idx].to(dev)  # (a copy: drafted tokens go into it alone)
        extra = [(j, t) for j, tokens in enumerate(drafted or ()) for t in tokens]
        if extra:
            at = torch.tensor(extra, dtype=torch.int64).to(dev, non_blocking=True)
            counts.index_put_((at[:, 0], at[:, 1]), torch.ones(len(extra), dtype=counts.dtype, device=dev),
                              accumulate=True)
        seen = counts > 0
        x = logits[batch_idx].float()
        rep = values[:, 2:3]
        repeated = seen | self.prompt_mask[row_idx].to(dev)
        x = torch.where(repeated, torch.where(x > 0, x / rep, x * rep), x)
        x = x - values[:, 1:2] * counts.float() - values[:, 0:1] * seen.float()
        logits[batch_idx] = x.to(logits.dtype)

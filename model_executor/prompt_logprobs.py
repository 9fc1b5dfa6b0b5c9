"""Prompt logprobs: the logprob of a prompt token given the tokens before it, scored from the hidden states of
the extend batch that prefills it (SGLang's input_token_logprobs, vLLM's prompt_logprobs, OpenAI's echo).

The hidden state of position p predicts the token at p + 1, so a request that wants the logprobs of prompt
tokens s+1..L-1 needs the hidden rows of positions s..L-2 (position L-1 is the sampling row every request
has). The scheduler names those rows in a `PromptLogprobPlan` on the ForwardBatch; the logits head scores
them next to the usual last-token logits (`layers/logits.py`), block by block, and leaves the result on the
batch for the scheduler to copy to the host the same way as sampled tokens (pinned memory and an event).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from model_executor.sampler import start_host_copy

# Rows are scored in blocks of at most this many bytes of float32 logits: a long prompt never makes a
# [prompt, vocab] tensor. A block's logits, their log-softmax and the rank comparison take about three times
# this; the head runs after the backbone has freed its activations, whose profiled peak over
# --max-prefill-tokens tokens (the memory plan's activation reserve) is larger for any real model shape.
BLOCK_BYTES = 64 * 2**20


def block_rows(vocab_size: int, block_bytes: int = BLOCK_BYTES) -> int:
    return max(1, block_bytes // (4 * vocab_size))


@dataclass
class PromptLogprobPlan:
    """The rows of an extend batch to score: `rows` index the batch's token dimension, `targets` are the
    tokens they predict (the next prompt token); `top_n` alternatives per row (the most any request asked)."""

    rows: torch.Tensor  # [R] int64
    targets: torch.Tensor  # [R] int64
    top_n: int

    @classmethod
    def build(cls, rows: list[int], targets: list[int], top_n: int, device, pin_memory: bool) -> PromptLogprobPlan:
        host = torch.tensor([rows, targets], dtype=torch.int64, pin_memory=pin_memory)
        dev = host.to(device, non_blocking=True)
        return cls(rows=dev[0], targets=dev[1], top_n=top_n)

    @property
    def num_rows(self) -> int:
        return self.rows.shape[0]


@dataclass
class PromptLogprobsOutput:
    """Per scored row: the target's logprob, its rank (1 = the most likely token; ties count as above it) and
    the `top_n` best tokens with their logprobs, best first (None when top_n is 0)."""

    logprobs: torch.Tensor  # [R] float32
    ranks: torch.Tensor  # [R] int64
    top_ids: torch.Tensor | None  # [R, top_n] int64
    top_values: torch.Tensor | None  # [R, top_n] float32

    def to_host(self) -> HostPromptLogprobs:
        """Start the copy to the host without waiting (pinned buffers and an event on a GPU), like
        SampleOutput.to_host: the scheduler reads it after launching the next step."""
        host, event = start_host_copy((self.logprobs, self.ranks, self.top_ids, self.top_values))
        return HostPromptLogprobs(*host, event=event)


@dataclass
class HostPromptLogprobs:
    logprobs: torch.Tensor
    ranks: torch.Tensor
    top_ids: torch.Tensor | None
    top_values: torch.Tensor | None
    event: torch.cuda.Event | None

    def lists(self) -> tuple[list[float], list[int], list[list[int]] | None, list[list[float]] | None]:
        if self.event is not None:
            self.event.synchronize()
        return (self.logprobs.tolist(), self.ranks.tolist(),
                None if self.top_ids is None else self.top_ids.tolist(),
                None if self.top_values is None else self.top_values.tolist())


def score_prompt_rows(lm_head, hidden: torch.Tensor, plan: PromptLogprobPlan,
                      rows_per_block: int | None = None) -> PromptLogprobsOutput:
    """Project the plan's hidden rows onto the vocabulary and score their targets, one block at a time."""
    num = plan.num_rows
    device = hidden.device
    step = rows_per_block or block_rows(lm_head.vocab_size)
    logprobs = torch.empty(num, dtype=torch.float32, device=device)
    ranks = torch.empty(num, dtype=torch.int64, device=device)
    top_n = min(plan.top_n, lm_head.vocab_size)
    top_ids = torch.empty((num, top_n), dtype=torch.int64, device=device) if top_n else None
    top_values = torch.empty((num, top_n), dtype=torch.float32, device=device) if top_n else None
    for a in range(0, num, step):
        b = min(num, a + step)
        lp = torch.log_softmax(lm_head(hidden.index_select(0, plan.rows[a:b])).float(), dim=-1)
        chosen = lp.gather(1, plan.targets[a:b].unsqueeze(1))
        logprobs[a:b] = chosen.squeeze(1)
        ranks[a:b] = (lp >= chosen).sum(dim=-1)
        if top_n:
            values, ids = torch.topk(lp, top_n, dim=-1, sorted=True)
            top_values[a:b] = values
            top_ids[a:b] = ids
    return PromptLogprobsOutput(logprobs, ranks, top_ids, top_values)

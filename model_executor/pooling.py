"""The pooling of an extend batch's final hidden states (what a pooling model serves:
model_executor/pooling_config.py).

A pooling request is prefilled like any prompt (chunked when long, batched with other requests) and returns,
instead of a sampled token, either its pooled final hidden state (last token, mean, or first token) or its
last position's logits at a few ids (a Qwen3-Reranker's "no"/"yes", a classification head's labels).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PoolingPlan:
    """What an extend batch with pooling requests needs from its final hidden states besides each request's
    last row (always taken): per-request row sums (mean pooling) and first rows (cls pooling)."""

    sums: bool = False
    firsts: bool = False


@dataclass
class PooledHidden:
    """float32 [bs, H] each: every request's last row, and its rows' sum / first row when the plan asks."""

    last: torch.Tensor
    sums: torch.Tensor | None = None
    firsts: torch.Tensor | None = None


def pool_hidden(hidden: torch.Tensor, extend_start_loc: torch.Tensor, extend_seq_lens: torch.Tensor,
                plan: PoolingPlan) -> PooledHidden:
    """hidden: [tokens, H], the final norm's output of an extend batch whose requests' rows start at
    extend_start_loc and number extend_seq_lens."""
    starts, lens = extend_start_loc.long(), extend_seq_lens.long()
    out = PooledHidden(hidden.index_select(0, starts + lens - 1).float())
    if plan.sums:
        seg = torch.repeat_interleave(torch.arange(len(lens), device=hidden.device), lens,
                                      output_size=hidden.shape[0])
        out.sums = torch.zeros(len(lens), hidden.shape[1], dtype=torch.float32,
                               device=hidden.device).index_add_(0, seg, hidden.float())
    if plan.firsts:
        out.firsts = hidden.index_select(0, starts).float()
    return out

"""Logits head: picks each request's last hidden state and projects it onto the vocabulary."""

from __future__ import annotations

import torch

from model_executor.forward_batch import ForwardBatch
from model_executor.layers.embedding import ParallelLMHead


def last_token_hidden(hidden: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
    """[num_tokens, H] -> [bs, H]: decode keeps every row, extend keeps the last token of each request."""
    if fb.mode.is_decode():
        return hidden
    last = (fb.extend_start_loc + fb.extend_seq_lens - 1).long()
    return hidden.index_select(0, last)


def compute_logits(lm_head: ParallelLMHead, hidden: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
    return lm_head(last_token_hidden(hidden, fb)).float()

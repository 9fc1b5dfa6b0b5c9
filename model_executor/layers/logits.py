"""Logits head: picks each request's last hidden state and projects it onto the vocabulary; scores the prompt
rows an extend batch's PromptLogprobPlan names (model_executor/prompt_logprobs.py) and pools the hidden states
of its pooling requests (model_executor/pooling.py) on the way."""

from __future__ import annotations

import torch

from model_executor.forward_batch import ForwardBatch
from model_executor.layers.embedding import ParallelLMHead
from model_executor.pooling import pool_hidden
from model_executor.prompt_logprobs import score_prompt_rows


def last_token_hidden(hidden: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
    """[num_tokens, H] -> [bs, H]: decode keeps every row, extend keeps the last token of each request (every
    token of a verify batch: fb.all_token_logits)."""
    if fb.mode.is_decode() or fb.all_token_logits:
        return hidden
    last = (fb.extend_start_loc + fb.extend_seq_lens - 1).long()
    return hidden.index_select(0, last)


def compute_logits(lm_head: ParallelLMHead, hidden: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
    """float32 logits [bs, vocab] of each request's last token ([num_tokens, vocab]: every token's, with
    fb.all_token_logits), in fb.logits_out if the batch gives one. With a
    prompt-logprob plan, also scores the plan's rows into fb.prompt_logprobs (here, outside any graph: the
    graph runners hand over the hidden states). With a pooling plan, also pools the final hidden states into
    fb.pooled."""
    if fb.pooling_plan is not None:
        fb.pooled = pool_hidden(hidden, fb.extend_start_loc, fb.extend_seq_lens, fb.pooling_plan)
    if fb.prompt_logprob_plan is not None:
        fb.prompt_logprobs = score_prompt_rows(lm_head, hidden, fb.prompt_logprob_plan)
    return lm_head(last_token_hidden(hidden, fb), out=fb.logits_out).float()

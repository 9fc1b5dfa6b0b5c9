"""Vocabulary-parallel embedding and LM head: each rank holds a contiguous block of vocabulary rows.

The vocabulary is padded to a multiple of tp_size; rank r holds rows [r * per_rank, (r + 1) * per_rank)
(padding rows zero). The embedding looks up the ids in its block (others read as zero) and all-reduces;
the LM head computes its block of logits and all-gathers them, dropping the padding columns.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from model_executor.distributed import parallel_state as ps
from model_executor.layers.linear import _copy_into, _tp
from model_executor.layers.quantization.base import small_m_kernel


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, tp_rank: int | None = None, tp_size: int | None = None):
        super().__init__()
        self.tp_rank, self.tp_size = _tp(tp_rank, tp_size)
        self.vocab_size = vocab_size
        self.per_rank = -(-vocab_size // self.tp_size)
        self.vocab_start = self.tp_rank * self.per_rank
        self.vocab_end = min(self.vocab_start + self.per_rank, vocab_size)  # real rows of this rank end here
        self.weight = nn.Parameter(torch.empty(self.per_rank, hidden_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if self.tp_size == 1:
            _copy_into(param, loaded)
            return
        if loaded.shape[0] != self.vocab_size:
            raise ValueError(f"shape mismatch: vocabulary {self.vocab_size} vs checkpoint {tuple(loaded.shape)}")
        real = max(0, self.vocab_end - self.vocab_start)
        param.data[real:].zero_()
        _copy_into(param.data[:real], loaded.narrow(0, self.vocab_start, real))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        mine = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
        out = F.embedding((input_ids - self.vocab_start) * mine, self.weight)
        return ps.tensor_model_parallel_all_reduce(out * mine.unsqueeze(-1).to(out.dtype))


class ParallelLMHead(VocabParallelEmbedding):
    """The output projection; shares the embedding's weight when the model ties them."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        kernel = small_m_kernel(hidden, self.weight)  # decode-sized CUDA batches, where the table says so
        logits = kernel.small_m_linear(hidden, self.weight) if kernel else F.linear(hidden, self.weight)
        if self.tp_size == 1:
            return logits
        return ps.tensor_model_parallel_all_gather(logits)[:, : self.vocab_size]

"""Vocabulary-parallel embedding and LM head (tp_size 1 for now)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from model_executor.layers.linear import default_weight_loader


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, tp_rank: int = 0, tp_size: int = 1):
        super().__init__()
        if tp_size != 1:
            raise NotImplementedError("tensor parallelism > 1 is not built yet")
        self.vocab_size = vocab_size
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        default_weight_loader(param, loaded)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)


class ParallelLMHead(VocabParallelEmbedding):
    """The output projection; shares the embedding's weight when the model ties them."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.weight)

"""Linear layers written as tensor-parallel classes; duet runs them with tp_size 1 for now.

Each parameter carries a `weight_loader(param, loaded, shard_id)` so HF checkpoints (separate q/k/v and
gate/up tensors) load into the fused layers, and so sharding later changes no model code.
"""

from __future__ import annotations

import torch
from torch import nn

from model_executor.layers.quantization import current_linear_method
from model_executor.layers.quantization.base import copy_into as _copy_into


def _shard(loaded: torch.Tensor, dim: int, tp_rank: int, tp_size: int) -> torch.Tensor:
    if tp_size == 1:
        return loaded
    size = loaded.shape[dim] // tp_size
    return loaded.narrow(dim, tp_rank * size, size)


def default_weight_loader(param: torch.Tensor, loaded: torch.Tensor, shard_id=None) -> None:
    """For parameters with no sharding (norms): a checked copy."""
    _copy_into(param, loaded)


class LinearBase(nn.Module):
    def __init__(self, input_size: int, output_size: int, bias: bool, tp_rank: int = 0, tp_size: int = 1):
        super().__init__()
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.output_size = output_size  # this rank's
        # The quantization method (layers/quantization) creates the parameters, stores each loaded shard
        # (quantizing it, for online quantization) and runs the GEMM; unquantized: weight, bias, F.linear.
        self.quant_method = current_linear_method()
        self.quant_method.create_weights(self, input_size, output_size, bias)

    def _load(self, param: nn.Parameter, loaded: torch.Tensor, offset: int = 0, size: int | None = None) -> None:
        """Store `loaded` (this rank's shard) as output rows offset .. offset + size (default: all of them)
        of the layer; the method maps rows to its tensor's layout (a block scale's rows are blocks)."""
        self.quant_method.load(self, param, loaded, offset, self.output_size if size is None else size)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        self._load(param, loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.quant_method.apply(self, x)


class ColumnParallelLinear(LinearBase):
    """Output features split across ranks; no communication."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False, tp_rank: int = 0, tp_size: int = 1):
        assert output_size % tp_size == 0
        super().__init__(input_size, output_size // tp_size, bias, tp_rank, tp_size)

    def weight_loader(self, param, loaded, shard_id=None):
        self._load(param, _shard(loaded, 0, self.tp_rank, self.tp_size))


class RowParallelLinear(LinearBase):
    """Input features split across ranks; an all-reduce would follow when tp_size > 1."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False, tp_rank: int = 0, tp_size: int = 1):
        assert input_size % tp_size == 0
        if tp_size != 1:
            raise NotImplementedError("tensor parallelism > 1 is not built yet")
        super().__init__(input_size // tp_size, output_size, bias, tp_rank, tp_size)

    def weight_loader(self, param, loaded, shard_id=None):
        dim = 1 if param.dim() == 2 else None
        self._load(param, loaded if dim is None else _shard(loaded, dim, self.tp_rank, self.tp_size))


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs fused into one matmul (gate_up_proj); shard_id is the index."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False, tp_rank=0, tp_size=1):
        self.output_sizes = [s // tp_size for s in output_sizes]
        super().__init__(input_size, sum(output_sizes), bias, tp_rank, tp_size)

    def weight_loader(self, param, loaded, shard_id=None):
        offset = sum(self.output_sizes[:shard_id])
        size = self.output_sizes[shard_id]
        self._load(param, _shard(loaded, 0, self.tp_rank, self.tp_size), offset, size)


class QKVParallelLinear(ColumnParallelLinear):
    """Fused q/k/v projection; shard_id is "q", "k" or "v"."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False,
                 tp_rank: int = 0, tp_size: int = 1):
        self.num_heads = num_heads // tp_size
        self.num_kv_heads = max(1, num_kv_heads // tp_size)
        self.head_dim = head_dim
        self.q_size = self.num_heads * head_dim
        self.kv_size = self.num_kv_heads * head_dim
        total = (num_heads + 2 * max(num_kv_heads, tp_size)) * head_dim
        super().__init__(hidden_size, total, bias, tp_rank, tp_size)

    def weight_loader(self, param, loaded, shard_id=None):
        offset, size = {"q": (0, self.q_size), "k": (self.q_size, self.kv_size),
                        "v": (self.q_size + self.kv_size, self.kv_size)}[shard_id]
        self._load(param, _shard(loaded, 0, self.tp_rank, self.tp_size), offset, size)

    def split(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)

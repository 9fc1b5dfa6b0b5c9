"""SiLU-and-mul: the gated activation of Llama-style MLPs on a fused gate_up output."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from model_executor.layers import triton_ops


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for x = [gate, up] in its last dim."""
    if x.is_cuda:  # one fused Triton kernel
        return triton_ops.silu_and_mul(x)
    return silu_and_mul_native(x)


def silu_and_mul_native(x: torch.Tensor) -> torch.Tensor:
    """The plain PyTorch path (CPU; the reference of the fused kernel)."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


class SiluAndMul(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return silu_and_mul(x)

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        return silu_and_mul_native(x)

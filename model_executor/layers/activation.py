"""SiLU-and-mul: the gated activation of Llama-style MLPs on a fused gate_up output."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from model_executor.layers import triton_ops


class SiluAndMul(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:  # one fused Triton kernel
            return triton_ops.silu_and_mul(x)
        return self.forward_native(x)

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        """The plain PyTorch path (CPU; the reference of the fused kernel)."""
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up

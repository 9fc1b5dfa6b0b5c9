"""RMSNorm with an optional fused residual add."""

from __future__ import annotations

import torch
from torch import nn

from model_executor.layers import triton_ops


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """Returns norm(x) or, with a residual, (norm(x + residual), x + residual)."""
        if x.is_cuda:  # one fused Triton kernel
            return triton_ops.rmsnorm(x, self.weight, self.eps, residual)
        return self.forward_native(x, residual)

    def forward_native(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """The plain PyTorch path (CPU; the reference of the fused kernel)."""
        if residual is not None:
            x = x + residual
            residual = x
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        out = self.weight * xf.to(dtype)
        return out if residual is None else (out, residual)

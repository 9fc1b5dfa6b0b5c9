"""RMSNorm with an optional fused residual add, and PrenormedRow: a decode row on its way into a norm that the
small-M GEMVs run in pieces (the kernel before sums h^2, the GEMV after scales by 1 / rms)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from model_executor.layers import triton_ops


@dataclass(frozen=True)
class PrenormedRow:
    """A GEMM input row given before its RMSNorm's last step: `weighted` = norm weight * h (rounded to h's
    dtype) and `partials`, sums of h^2 over blocks of h's columns. The GEMM it feeds scales its sums by
    1 / rms(h): the GEMM of RMSNorm(h) within one rounding, with no normed row in memory and no pass over h
    before the weights stream. small_m_gemm.small_m_linear_add_rmsnorm makes one, with h beside it; a
    consumer that cannot take the row runs RMSNorm on h."""
    weighted: torch.Tensor  # [M, K]: M rows (up to small_m_gemm.MAX_GEMV_ROWS)
    partials: torch.Tensor  # [M * P] float32: each row's P sums, row by row
    eps: float


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

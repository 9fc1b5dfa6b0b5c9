"""Rotary position embedding (NeoX / HF-Llama half-rotation layout) with Llama-3 frequency scaling."""

from __future__ import annotations

import math

import torch
from torch import nn

from model_executor.layers import triton_ops


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    factor = scaling["factor"]
    low_freq_factor = scaling.get("low_freq_factor", 1.0)
    high_freq_factor = scaling.get("high_freq_factor", 4.0)
    old_len = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_len / low_freq_factor
    high_freq_wavelen = old_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_position: int, base: float, rope_scaling: dict | None = None):
        super().__init__()
        self.head_dim = head_dim
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
        if rope_scaling is not None:
            kind = rope_scaling.get("rope_type", rope_scaling.get("type"))
            if kind == "llama3":
                inv_freq = _llama3_inv_freq(inv_freq, rope_scaling)
            elif kind == "linear":
                inv_freq = inv_freq / rope_scaling["factor"]
            else:
                raise NotImplementedError(f"rope scaling type {kind!r} is not supported")
        t = torch.arange(max_position, dtype=torch.float64)
        freqs = torch.outer(t, inv_freq)
        # [max_position, head_dim]: cos and sin halves side by side; built in float32, then cast with the
        # model (like HF, which casts cos/sin to the activation dtype).
        self.register_buffer("cos_sin_cache", torch.cat([freqs.cos(), freqs.sin()], dim=-1).float(), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """q: [T, Hq, D], k: [T, Hk, D]; returns (q, k) rotated, in the input dtype.

        On CUDA, one fused Triton kernel rotates q and k in place and returns them; on CPU, rotated copies.
        """
        if q.is_cuda:
            return triton_ops.apply_rotary(positions, q, k, self.cos_sin_cache)
        return self.forward_native(positions, q, k)

    def forward_native(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """The plain PyTorch path (CPU; the reference of the fused kernel): rotated copies of q and k."""
        cos, sin = self.cos_sin_cache.index_select(0, positions).unsqueeze(1).chunk(2, dim=-1)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.float().chunk(2, dim=-1)
    out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    return out.to(x.dtype)

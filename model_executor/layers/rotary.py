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
    """One instance serves every layer of a model (the table depends only on the config), so the model
    keeps a single cos/sin table instead of one per layer."""

    def __init__(self, head_dim: int, max_position: int, base: float, rope_scaling: dict | None = None):
        super().__init__()
        self.head_dim = head_dim
        self.max_position = max_position
        self.base = base
        self.rope_scaling = rope_scaling
        # Under a meta-device build this computes nothing; init_cache() fills the real table once the model
        # has been materialized on its device.
        self.register_buffer("cos_sin_cache", self._compute_cache(None), persistent=False)

    def _compute_cache(self, device) -> torch.Tensor:
        hd = self.head_dim
        inv_freq = 1.0 / (self.base ** (torch.arange(0, hd, 2, dtype=torch.float64, device=device) / hd))
        if self.rope_scaling is not None:
            kind = self.rope_scaling.get("rope_type", self.rope_scaling.get("type"))
            if kind == "llama3":
                inv_freq = _llama3_inv_freq(inv_freq, self.rope_scaling)
            elif kind == "linear":
                inv_freq = inv_freq / self.rope_scaling["factor"]
            else:
                raise NotImplementedError(f"rope scaling type {kind!r} is not supported")
        t = torch.arange(self.max_position, dtype=torch.float64, device=device)
        freqs = torch.outer(t, inv_freq)
        # [max_position, head_dim]: cos and sin halves side by side; built in float32, then cast with the
        # model (like HF, which casts cos/sin to the activation dtype).
        return torch.cat([freqs.cos(), freqs.sin()], dim=-1).float()

    @torch.no_grad()
    def init_cache(self) -> None:
        """Recompute the table on the buffer's device, in float32 then cast to the buffer's dtype: the same
        values an eager float32 build followed by `.to(dtype)` gives."""
        buf = self.cos_sin_cache
        self.cos_sin_cache = self._compute_cache(buf.device).to(buf.dtype)

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

"""Rotary position embedding (NeoX / HF-Llama half-rotation layout); scaled variants through transformers.

The inverse frequencies (and the attention scaling that yarn and longrope apply to cos/sin) come from
transformers' ROPE_INIT_FUNCTIONS, so every scaling type is HF's own arithmetic, not a copy of it. Two of
them depend on the sequence length in HF, which recomputes the table as a sequence grows; a KV cache keeps
keys rotated with the table they were written with, so duet computes one table for the served context
length instead (vLLM and SGLang do the same):
- dynamic: HF's table at that length (the plain table when the context fits max_position_embeddings, which
  is exactly HF's result for every sequence; beyond it, the NTK-scaled table of the full context).
- longrope: the short factors when the context fits original_max_position_embeddings (HF's result for every
  sequence), else the long factors for all positions (HF switches per sequence length).
"""

from __future__ import annotations

import types

import torch
from torch import nn

from model_executor.layers import triton_ops

SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3", "longrope")


def rope_type(rope_scaling: dict | None) -> str:
    if not rope_scaling:
        return "default"
    return rope_scaling.get("rope_type", rope_scaling.get("type")) or "default"


def rope_inv_freq(head_dim: int, base: float, rope_scaling: dict | None, max_position_embeddings: int,
                  seq_len: int) -> tuple[torch.Tensor, float]:
    """(inv_freq [head_dim / 2] float64, attention scaling of cos/sin) for the served length seq_len."""
    kind = rope_type(rope_scaling)
    if kind == "default":
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
        return inv_freq, 1.0
    if kind not in SUPPORTED_ROPE_TYPES:  # ModelConfig refuses these at load; this guards direct use
        raise ValueError(f"rope_type {kind!r} is not supported; duet supports {', '.join(SUPPORTED_ROPE_TYPES)}")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    # The functions read a config object; this one has only the attributes they read (the parameters are
    # already standardized: rope_type and rope_theta inside rope_parameters).
    params = {k: v for k, v in rope_scaling.items() if k != "type"}
    params.update(rope_type=kind, rope_theta=base)
    cfg = types.SimpleNamespace(
        rope_parameters=params, head_dim=head_dim, hidden_size=head_dim, num_attention_heads=1,
        max_position_embeddings=max_position_embeddings, standardize_rope_params=lambda: None)
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[kind](cfg, torch.device("cpu"), seq_len=seq_len)
    return inv_freq.double(), float(scaling)


class RotaryEmbedding(nn.Module):
    """One instance serves every layer of a model (the table depends only on the config), so the model
    keeps a single cos/sin table instead of one per layer.

    max_position: the table's length; original_max_position: config.json's max_position_embeddings, which
    dynamic / yarn / longrope read; seq_len: the served context length the dynamic and longrope tables are
    computed for (both default to max_position). rotary_dim: the leading dims of each head that turn (partial
    rotary, Phi-4-mini: 0.75 of the head), the rest pass unchanged; default the whole head. The fused kernels
    turn whole heads: a partial table runs the plain path (`partial`)."""

    def __init__(self, head_dim: int, max_position: int, base: float, rope_scaling: dict | None = None,
                 original_max_position: int | None = None, seq_len: int | None = None,
                 rotary_dim: int | None = None):
        super().__init__()
        self.full_head_dim = head_dim
        head_dim = rotary_dim or head_dim
        self.head_dim = head_dim  # the table's width: the dims that turn
        self.max_position = max_position
        self.original_max_position = original_max_position or max_position
        self.seq_len = seq_len or max_position
        self.base = base
        self.rope_scaling = rope_scaling
        # Under a meta-device build this computes nothing; init_cache() fills the real table once the model
        # has been materialized on its device.
        self.register_buffer("cos_sin_cache", self._compute_cache(None), persistent=False)

    def _compute_cache(self, device) -> torch.Tensor:
        device = torch.device(device) if device is not None else torch.get_default_device()
        if device.type == "meta":
            return torch.empty(self.max_position, self.head_dim, device=device)
        inv_freq, scaling = rope_inv_freq(self.head_dim, self.base, self.rope_scaling, self.original_max_position,
                                          self.seq_len)
        t = torch.arange(self.max_position, dtype=torch.float64, device=device)
        freqs = torch.outer(t, inv_freq.to(device))
        # [max_position, head_dim]: cos and sin halves side by side, times the attention scaling (yarn and
        # longrope: HF multiplies cos and sin by it); built in float32, then cast with the model (like HF,
        # which casts cos/sin to the activation dtype).
        return (torch.cat([freqs.cos(), freqs.sin()], dim=-1) * scaling).float()

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
        if q.is_cuda and not self.partial:
            return triton_ops.apply_rotary(positions, q, k, self.cos_sin_cache)
        return self.forward_native(positions, q, k)

    @property
    def partial(self) -> bool:
        """Whether only the leading dims of a head turn (the fused kernels cannot take the table then)."""
        return self.head_dim != self.full_head_dim

    def forward_native(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """The plain PyTorch path (CPU; the reference of the fused kernel): rotated copies of q and k."""
        cos, sin = self.cos_sin_cache.index_select(0, positions).unsqueeze(1).chunk(2, dim=-1)
        if self.partial:
            d = self.head_dim
            return (torch.cat([_rotate(q[..., :d], cos, sin), q[..., d:]], dim=-1),
                    torch.cat([_rotate(k[..., :d], cos, sin), k[..., d:]], dim=-1))
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.float().chunk(2, dim=-1)
    out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    return out.to(x.dtype)

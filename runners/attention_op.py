"""`duet::attention`: attention as a registered custom op, the seam where the piecewise runner splits.

The op writes into an `out` tensor it is given (mutates_args=["out"]) and returns nothing, so tracing
sees an opaque call whose output lives at an address the surrounding graph pieces chose: the piece before
allocates `out`, attention fills it eagerly, the piece after reads it. Lengths, KV slots and the backend
come from the forward context (the real, unpadded batch); the op attends and writes K/V for the real
tokens only and zeroes the padded rows of `out`, so padding never reaches the KV pool and stays finite.
"""

from __future__ import annotations

import torch

from runners.forward_context import get_forward_context


@torch.library.custom_op("duet::attention", mutates_args=("out",))
def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, layer_id: int) -> None:
    ctx = get_forward_context()
    fb = ctx.forward_batch
    n = fb.num_tokens
    result = fb.attn_backend.forward(q[:n], k[:n], v[:n], ctx.attention_layers[layer_id], fb)
    # One small copy per layer (T x Hq*D); the backends allocate their own output.
    out[:n].copy_(result)
    if out.shape[0] > n:
        out[n:].zero_()


@attention.register_fake
def _(q, k, v, out, layer_id):
    return None


def unified_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int) -> torch.Tensor:
    """q: [T, Hq*D], k/v: [T, Hk*D] -> [T, Hq*D] through the op (the output is allocated here, in the piece)."""
    out = torch.empty_like(q)
    torch.ops.duet.attention(q, k, v, out, layer_id)
    return out


ATTENTION_OPS = (torch.ops.duet.attention, torch.ops.duet.attention.default)

"""`duet::attention`: attention as a registered custom op, the seam where the piecewise runner splits.

The op writes into an `out` tensor it is given (mutates_args=["out"]) and returns nothing, so tracing
sees an opaque call whose output lives at an address the surrounding graph pieces chose: the piece before
allocates `out`, attention fills it eagerly, the piece after reads it. Lengths, KV slots and the backend
come from the forward context (the real, unpadded batch); the op attends and writes K/V for the real
tokens only and zeroes the padded rows of `out`, so padding never reaches the KV pool and stays finite.

The op exists for tracing. At replay the split graph calls `attention_impl` directly (runners/fx_split.py):
the dispatcher round trip of a Python custom op is pure host time, paid once per layer per extend batch.
"""

from __future__ import annotations

import torch

from model_executor.layers.attention.forward_context import get_forward_context


def attention_impl(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, layer_id: int) -> None:
    ctx = get_forward_context()
    fb = ctx.forward_batch
    n = fb.num_tokens
    if out.shape[0] > n:  # a padded level: real rows only; padded rows of `out` are zeroed
        out[n:].zero_()
        q, k, v, out = q[:n], k[:n], v[:n], out[:n]
    # The backend writes straight into the buffer the next piece reads (rows are contiguous, so out[:n] is too).
    fb.attn_backend.forward(q, k, v, ctx.attention_layers[layer_id], fb, out=out)


attention = torch.library.custom_op("duet::attention", attention_impl, mutates_args=("out",))


@attention.register_fake
def _(q, k, v, out, layer_id):
    return None


def unified_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int) -> torch.Tensor:
    """q: [T, Hq*D], k/v: [T, Hk*D] -> [T, Hq*D] through the op (the output is allocated here, in the piece)."""
    out = torch.empty_like(q)
    torch.ops.duet.attention(q, k, v, out, layer_id)
    return out


ATTENTION_OPS = (torch.ops.duet.attention, torch.ops.duet.attention.default)

"""The fused q/k head norm + rotary kernel (Qwen3) against RMSNorm per head then the torch rotary.

Without CUDA the kernel runs in Triton's CPU interpreter (tests/triton_mode.py)."""

from __future__ import annotations

import pytest
import torch

from model_executor.layers.norm import RMSNorm
from model_executor.layers.rotary import RotaryEmbedding
from tests import triton_mode
from tests.triton_mode import DEVICE, in_process

if not triton_mode.RERUN_IN_SUBPROCESS:
    from model_executor.layers.qk_norm_rope import qk_norm_rope

test_in_subprocess = triton_mode.subprocess_test(__file__)

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}


@in_process
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,scaling", [(4, 2, 64, None), (6, 1, 128, YARN),
                                                                     (5, 5, 32, None)])
def test_matches_norm_then_rotary(dtype, num_heads, num_kv_heads, head_dim, scaling):
    gen = torch.Generator().manual_seed(num_heads * head_dim)
    num_tokens = 9
    rope = RotaryEmbedding(head_dim, 256, 1e6, scaling).to(DEVICE, dtype)
    q_norm, k_norm = RMSNorm(head_dim, 1e-6), RMSNorm(head_dim, 1e-6)
    with torch.no_grad():
        for norm in (q_norm, k_norm):
            norm.weight.copy_(torch.rand(head_dim, generator=gen) + 0.5)
    q_norm, k_norm = q_norm.to(DEVICE, dtype), k_norm.to(DEVICE, dtype)
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    qkv = (torch.randn(num_tokens, q_size + 2 * kv_size, generator=gen) * 3).to(DEVICE, dtype)
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)  # strided views, as in the model
    q, k = q.view(num_tokens, num_heads, head_dim), k.view(num_tokens, num_kv_heads, head_dim)
    positions = torch.randint(0, 256, (num_tokens,), generator=gen).to(DEVICE)
    ref_q, ref_k = rope.forward_native(positions, q_norm.forward_native(q), k_norm.forward_native(k))
    v_before = v.clone()
    out_q, out_k = qk_norm_rope(positions, q, k, q_norm.weight, k_norm.weight, 1e-6, rope.cos_sin_cache)
    assert out_q is q and out_k is k
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 1.6e-2, "atol": 2e-2}
    torch.testing.assert_close(q, ref_q, **tol)  # in place, through the views into qkv
    torch.testing.assert_close(k, ref_k, **tol)
    assert torch.equal(v, v_before)

"""gpt-oss's expert layer (GptOssExperts) on the GPU at gpt-oss-20b's expert shape (E=32, H=2880, I=2880, top 4),
bf16, random weights and biases:

- the fused Triton path (the small-batch GEMVs at 1 and 8 tokens, the grouped GEMMs at 64 and a 300-token
  extend) equals the torch path (fused_experts_torch with the torch router) on the same tensors; at these
  scales the clamps and the biases move the output far more than the tolerance (checked);
- a CUDA graph of the layer replays with new tokens and new routing and equals eager.

Run: pytest -m gpu tests/kernels/test_gpt_oss_moe_gpu.py -s
"""

from __future__ import annotations

import pytest
import torch

from model_executor.layers.moe import tuning
from model_executor.layers.moe.fused_moe import fused_experts_torch
from model_executor.layers.moe.router import select_experts_torch
from model_executor.model_config import ModelConfig
from model_executor.models.gpt_oss import GptOssExperts

pytestmark = pytest.mark.gpu

E, H, I, TOP_K = 32, 2880, 2880, 4
ALPHA, LIMIT = 1.702, 7.0
CONFIG = {
    "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "vocab_size": 1024, "hidden_size": H,
    "intermediate_size": I, "num_hidden_layers": 2, "num_attention_heads": 64, "num_key_value_heads": 8,
    "head_dim": 64, "num_local_experts": E, "num_experts_per_tok": TOP_K, "sliding_window": 128,
    "layer_types": ["sliding_attention", "full_attention"], "max_position_embeddings": 4096,
    "swiglu_limit": LIMIT, "rms_norm_eps": 1e-5, "tie_word_embeddings": False}


@pytest.fixture(scope="module")
def layer():
    cfg = ModelConfig.from_dict(CONFIG)
    assert (cfg.num_experts, cfg.moe_intermediate_size, cfg.swiglu_alpha, cfg.swiglu_limit) == (E, I, ALPHA, LIMIT)
    experts = GptOssExperts(cfg)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in experts.named_parameters():
            # the gate / up sums have a std of ~3: the +-7 clamps bite on a few percent of them
            std = 1.0 if name.endswith("bias") else 0.03
            p.copy_(torch.randn(p.shape, generator=g) * std)
    return experts.to("cuda", torch.bfloat16)


def routed(num_tokens, seed):
    """x [T, H] bf16 and float32 router logits (no exact ties at the k-th place: both routers pick the same)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = (torch.randn(num_tokens, H, device="cuda", generator=g) * 2).bfloat16()
    return x, torch.randn(num_tokens, E, device="cuda", generator=g)


def reference(layer, x, logits, bias=True, limit=LIMIT):
    weights, ids = select_experts_torch(logits, TOP_K, renormalize=True)
    return fused_experts_torch(x, layer.w13_weight, layer.w2_weight, weights, ids, round_weights=True,
                               w13_bias=layer.w13_bias if bias else None, w2_bias=layer.w2_bias if bias else None,
                               swiglu=(ALPHA, limit))


@pytest.mark.parametrize("num_tokens", [1, 8, 64, 300])
def test_expert_layer_matches_torch(layer, num_tokens):
    path = tuning.select_path(E, 2 * I, H, num_tokens, "cuda")[0]
    assert path == ("small_batch" if num_tokens <= 8 else "grouped")
    x, logits = routed(num_tokens, seed=num_tokens)
    with torch.no_grad():
        out = layer(x, logits)
        ref = reference(layer, x, logits)
    scale = ref.float().abs().max().item()
    err = (out.float() - ref.float()).abs().max().item()
    print(f"T {num_tokens} ({path}): max|ref| {scale:.3f}, max|out - ref| {err:.3e}")
    tol = {"rtol": 2e-2, "atol": 1e-2 * scale}  # bf16: a few ulps of the largest output
    torch.testing.assert_close(out, ref, **tol)
    with torch.no_grad():  # the check sees a missing clamp or a missing bias: each moves the output past tol
        for other in (reference(layer, x, logits, limit=1e9), reference(layer, x, logits, bias=False)):
            with pytest.raises(AssertionError):
                torch.testing.assert_close(other, ref, **tol)


@pytest.mark.parametrize("num_tokens", [1, 8, 64, 300])
def test_expert_layer_graph_replays_new_routing(layer, num_tokens):
    """Captured once, replayed with other tokens and other routing: equals eager on the new inputs."""
    x, logits = routed(num_tokens, seed=100 + num_tokens)
    with torch.no_grad():
        layer(x, logits)  # compile outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = layer(x, logits)
        x2, logits2 = routed(num_tokens, seed=200 + num_tokens)
        x.copy_(x2)
        logits.copy_(logits2)
        graph.replay()
        torch.testing.assert_close(out, layer(x2, logits2), rtol=0, atol=0)

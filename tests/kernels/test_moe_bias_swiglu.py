"""gpt-oss's experts on the fused MoE kernels: per-expert biases on the gate_up and down GEMMs and the clamped
SwiGLU, on the small-batch (decode) and grouped (extend) paths, against the torch reference
(fused_moe.fused_experts_torch); the reference itself against gpt-oss's per-expert formula.

Without CUDA the kernels run in Triton's CPU interpreter (tests/triton_mode.py), so shapes stay small: H and
I are not multiples of the tiles (masked edges) and span several K tiles. The swiglu limit is small enough
that the clamps bite at these scales (checked), and the biases are of the order of the GEMM outputs."""

from __future__ import annotations

import pytest
import torch

from model_executor.layers.moe.fused_moe import fused_experts, fused_experts_torch
from model_executor.layers.moe.router import select_experts
from tests import triton_mode
from tests.kernels.test_fused_moe import SMALL, make_moe
from tests.kernels.test_moe_small_batch import TINY
from tests.triton_mode import DEVICE, in_process

if not triton_mode.RERUN_IN_SUBPROCESS:
    from model_executor.layers.moe import kernels

test_in_subprocess = triton_mode.subprocess_test(__file__)

F32, BF16 = torch.float32, torch.bfloat16
E, H, I, TOP_K = 8, 80, 40, 3
SWIGLU = (1.702, 0.8)  # (alpha, limit); gpt-oss's limit is 7.0 at its scales


def gpt_oss_moe(num_tokens: int, dtype: torch.dtype, seed: int):
    """x, w13, w2, weights, ids (make_moe's) and the biases b13 [E, 2I], b2 [E, H]."""
    x, w13, w2, weights, ids = make_moe(num_tokens, E, H, I, TOP_K, dtype, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1000)
    b13 = (torch.randn(E, 2 * I, generator=gen) * 0.5).to(DEVICE, dtype)
    b2 = (torch.randn(E, H, generator=gen) * 0.5).to(DEVICE, dtype)
    return x, w13, w2, weights, ids, b13, b2


def per_expert_reference(x, w13, w2, weights, ids, b13, b2, alpha, limit):
    """gpt-oss's expert as its model card writes it, token by token, in float32."""
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            h = w13[e].float() @ x[t].float() + b13[e].float()
            gate, up = h[:I].clamp(max=limit), h[I:].clamp(-limit, limit)
            act = (up + 1) * gate * torch.sigmoid(alpha * gate)
            out[t] += weights[t, j] * (w2[e].float() @ act + b2[e].float())
    return out


def test_reference_is_gpt_oss_expert_formula():
    """The torch path with biases and the clamped SwiGLU is the per-token formula (renormalized weights);
    the clamps and the biases change the result at these scales (else the kernel tests could not see them)."""
    x, w13, w2, weights, ids, b13, b2 = (t.cpu() for t in gpt_oss_moe(6, F32, seed=1))
    norm = weights / weights.sum(-1, keepdim=True)
    ref = fused_experts_torch(x, w13, w2, weights, ids, True, w13_bias=b13, w2_bias=b2, swiglu=SWIGLU)
    torch.testing.assert_close(ref, per_expert_reference(x, w13, w2, norm, ids, b13, b2, *SWIGLU),
                               rtol=1e-5, atol=1e-5)
    unclamped = fused_experts_torch(x, w13, w2, weights, ids, True, w13_bias=b13, w2_bias=b2, swiglu=(1.702, 1e9))
    unbiased = fused_experts_torch(x, w13, w2, weights, ids, True, swiglu=SWIGLU)
    assert (ref - unclamped).abs().max() > 0.1 and (ref - unbiased).abs().max() > 0.1


def test_gpt_oss_routing_is_the_renormalized_softmax():
    """select_experts(renormalize=True) gives gpt-oss's weights: a softmax over the k largest logits."""
    logits = torch.randn(7, E, generator=torch.Generator().manual_seed(3))
    weights, ids = select_experts(logits, TOP_K, renormalize=True)
    top, top_ids = torch.topk(logits, TOP_K, dim=-1)
    assert torch.equal(ids, top_ids)
    torch.testing.assert_close(weights, torch.softmax(top, dim=-1))


# (path, token counts): the small-batch GEMV kernels up to a few tokens, the grouped GEMMs at every size
CASES = [("small_batch", 1), ("small_batch", 3), ("small_batch", 16), ("grouped", 1), ("grouped", 3),
         ("grouped", 17), ("grouped", 64)]


@in_process
@pytest.mark.parametrize("dtype", [F32, BF16], ids=["f32", "bf16"])
@pytest.mark.parametrize("path,num_tokens", CASES, ids=[f"{p}-{t}" for p, t in CASES])
def test_kernels_with_bias_and_clamped_swiglu_match_torch(path, num_tokens, dtype):
    x, w13, w2, weights, ids, b13, b2 = gpt_oss_moe(num_tokens, dtype, seed=num_tokens)
    ref = fused_experts_torch(x, w13, w2, weights, ids, True, True, w13_bias=b13, w2_bias=b2, swiglu=SWIGLU)
    out = kernels.fused_experts_triton(x, w13, w2, weights, ids, True, True, path=path,
                                       config=TINY if path == "small_batch" else SMALL,
                                       w13_bias=b13, w2_bias=b2, swiglu=SWIGLU)
    assert out.dtype == dtype
    # float32: summation noise; bf16: a few ulps (the interpreter rounds float32 to bfloat16 toward zero)
    tol = 1e-4 if dtype == F32 else 4e-2
    torch.testing.assert_close(out, ref, rtol=tol, atol=tol)


@in_process
def test_default_path_and_strided_bias():
    """fused_experts_triton picking its own path and config; a bias that is a column slice of a wider tensor
    (its rows not contiguous) is made contiguous, and a bias of the wrong shape is refused."""
    x, w13, w2, weights, ids, b13, b2 = gpt_oss_moe(5, F32, seed=7)
    ref = fused_experts_torch(x, w13, w2, weights, ids, True, w13_bias=b13, w2_bias=b2, swiglu=SWIGLU)
    strided = torch.stack([b2, b2], dim=-1)[..., 0]
    assert strided.stride(-1) != 1
    out = kernels.fused_experts_triton(x, w13, w2, weights, ids, True, w13_bias=b13, w2_bias=strided, swiglu=SWIGLU)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match=r"expert bias of shape \(8, 40\), expected \(8, 80\)"):
        kernels.fused_experts_triton(x, w13, w2, weights, ids, True, w13_bias=b13[:, :I], w2_bias=b2)


def test_gpt_oss_moe_traces_as_one_graph():
    """With the biases and the clamped SwiGLU the experts are still one opaque op to dynamo (the CPU graph
    runner and the piecewise runner trace the backbone fullgraph)."""
    x, w13, w2, _, _, b13, b2 = (t.cpu() for t in gpt_oss_moe(5, F32, seed=2))

    def moe(x, logits):
        w, i = select_experts(logits, TOP_K, renormalize=True)
        return fused_experts(x, w13, w2, w, i, round_weights=True, w13_bias=b13, w2_bias=b2, swiglu=SWIGLU)

    logits = torch.randn(5, E, generator=torch.Generator().manual_seed(0))
    torch._dynamo.reset()
    compiled = torch.compile(moe, backend="eager", fullgraph=True, dynamic=True)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x, logits), moe(x, logits))
    torch._dynamo.reset()


def test_bench_floor_counts_the_gpt_oss_experts_a_step_reads():
    """bench_one_batch's floor counts gpt-oss's routed experts only (weights and biases), as Qwen3-MoE's."""
    from benchmarks.bench_one_batch import step_read_bytes, weight_bytes
    from model_executor.model_config import ModelConfig
    from model_executor.weight_loader import build_model
    from tests.models.test_gpt_oss import TINY_GPT_OSS

    cfg = ModelConfig.from_dict(TINY_GPT_OSS)
    model = build_model(cfg, torch.float32, "cpu")
    h, i, experts, top_k, layers, vocab = 64, 32, 4, 2, 3, 320
    per_expert = (2 * i * h + 2 * i + h * i + h) * 4
    embedding_unread = (vocab - 1) * h * 4  # (untied: the step's token's row)
    unread = layers * (experts - top_k) * per_expert
    assert step_read_bytes(model, 1) == weight_bytes(model) - unread - embedding_unread

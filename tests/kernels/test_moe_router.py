"""The fused router kernel (softmax, top k, renormalisation in one Triton kernel) against the torch path.

Without CUDA the kernel runs in Triton's CPU interpreter (tests/triton_mode.py)."""

from __future__ import annotations

import pytest
import torch

from model_executor.layers.moe.router import select_experts, select_experts_torch
from tests import triton_mode
from tests.triton_mode import DEVICE, in_process

if not triton_mode.RERUN_IN_SUBPROCESS:
    from model_executor.layers.moe import router_kernel

test_in_subprocess = triton_mode.subprocess_test(__file__)


def stable_topk(logits: torch.Tensor, top_k: int) -> torch.Tensor:
    """The expected choice: the k largest probabilities, an exact tie going to the lower expert index."""
    probs = torch.softmax(logits.float(), dim=-1)
    return torch.sort(probs, dim=-1, descending=True, stable=True).indices[:, :top_k]


@in_process
@pytest.mark.parametrize("num_experts,top_k", [(8, 2), (8, 8), (128, 2), (128, 8)])
@pytest.mark.parametrize("renormalize", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens", [1, 3, 37])  # decode-sized (one program, fewer warps); 37: a partial program
def test_fused_router_matches_torch(num_experts, top_k, renormalize, dtype, num_tokens):
    """Random logits: the experts of a stable sort of the probabilities (float32 logits have no ties: exactly
    torch.topk's experts in its order; bfloat16 ones tie often, and wherever the k-th place is not a tie the
    same set as torch.topk), and torch.topk's weights."""
    gen = torch.Generator().manual_seed(num_experts + top_k)
    logits = (torch.randn(num_tokens, num_experts, generator=gen) * 3).to(dtype)
    ref_w, ref_ids = select_experts_torch(logits, top_k, renormalize)
    w, ids = router_kernel.topk_softmax(logits.to(DEVICE), top_k, renormalize)
    assert ids.dtype == torch.int32 and w.dtype == torch.float32 and ids.shape == (num_tokens, top_k)
    ids = ids.cpu().long()
    assert torch.equal(ids, stable_topk(logits, top_k))
    if dtype == torch.float32:
        assert torch.equal(ids, ref_ids)
    ranked = torch.sort(logits.float(), dim=-1, descending=True).values
    clear = (ranked[:, top_k - 1] > ranked[:, top_k] if top_k < num_experts
             else torch.ones(num_tokens, dtype=torch.bool))
    assert clear.sum() >= 0.8 * num_tokens
    assert torch.equal(ids[clear].sort(-1).values, ref_ids[clear].sort(-1).values)
    torch.testing.assert_close(w.cpu(), ref_w, rtol=2e-6, atol=1e-7)


@in_process
@pytest.mark.parametrize("num_experts,top_k", [(8, 2), (128, 8)])
@pytest.mark.parametrize("renormalize", [False, True])
def test_fused_router_ties_go_to_the_lower_index(num_experts, top_k, renormalize):
    """Integer logits (many exact ties, also on the k-th place): the lower expert index of a tie, as a stable
    sort of the probabilities; the weights are torch.topk's (equal whichever tied expert is taken)."""
    gen = torch.Generator().manual_seed(7)
    logits = torch.randint(-2, 3, (24, num_experts), generator=gen).float()
    logits[0] = 0.0  # all tied: experts 0 .. k-1
    logits[1, : min(6, num_experts)] = torch.tensor([0.0, 1, 1, 1, 0.5, 1])[: num_experts]
    w, ids = router_kernel.topk_softmax(logits.to(DEVICE), top_k, renormalize, block_t=4)
    ids = ids.cpu().long()
    assert torch.equal(ids, stable_topk(logits, top_k))
    assert ids[0].tolist() == list(range(top_k))
    ref_w, _ = select_experts_torch(logits, top_k, renormalize)
    torch.testing.assert_close(w.cpu(), ref_w, rtol=2e-6, atol=1e-7)


def test_torch_topk_breaks_ties_its_own_way():
    """Why the kernel's rule is stated, not torch.topk's: on the CPU torch.topk does not keep the lower index
    of a tie, so the kernel (lower index) and the torch path can differ at an exact tie on the k-th place.
    Should torch ever keep the lower index here, the router's docstring and this test go."""
    logits = torch.tensor([[0.0, 1.0, 1.0, 1.0, 0.5, 1.0, 0.0, 0.0]])
    _, ids = select_experts_torch(logits, 2, False)
    assert ids.tolist() != stable_topk(logits, 2).tolist()


@in_process
def test_fused_router_masked_experts():
    """-inf logits (experts a model masks out) are never chosen while finite ones are left."""
    logits = torch.randn(3, 8, generator=torch.Generator().manual_seed(1))
    logits[:, :5] = float("-inf")
    logits[2, 6] = float("-inf")
    w, ids = router_kernel.topk_softmax(logits.to(DEVICE), 2, True)
    ids = ids.cpu()
    assert set(ids[0].tolist()) <= {5, 6, 7} and set(ids[2].tolist()) == {5, 7}
    torch.testing.assert_close(w.cpu().sum(-1), torch.ones(3))


@in_process
@pytest.mark.parametrize("num_experts", [8, 128])
def test_fused_router_nan_row_names_experts(num_experts):
    """A row of NaN logits (a garbage padded row in a whole extend graph) still names k distinct experts in
    0..E-1 (it named expert BLOCK_E: no logit equals a NaN maximum), and the other rows' picks are unchanged."""
    logits = torch.randn(3, num_experts, generator=torch.Generator().manual_seed(2))
    logits[1] = float("nan")
    logits[2, 3] = float("nan")
    w, ids = router_kernel.topk_softmax(logits.to(DEVICE), 4, True)
    ids = ids.cpu()
    assert ((ids >= 0) & (ids < num_experts)).all()
    assert all(len(set(row.tolist())) == 4 for row in ids)
    assert ids[0].tolist() == stable_topk(logits[:1], 4)[0].tolist()
    assert 3 not in ids[2].tolist()
    torch.testing.assert_close(w[0].cpu().sum(), torch.tensor(1.0))


def test_router_fake_op_shapes():
    """The registered op's fake impl (what dynamo and the piecewise runner see): float32 weights, int32 ids."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    import model_executor.layers.moe.router  # noqa: F401 (registers duet::topk_softmax)

    with FakeTensorMode():
        w, ids = torch.ops.duet.topk_softmax(torch.empty(5, 128), 8, True)
    assert w.shape == ids.shape == (5, 8) and w.dtype == torch.float32 and ids.dtype == torch.int32


def test_select_experts_cpu_is_the_torch_path():
    logits = torch.randn(4, 16, generator=torch.Generator().manual_seed(0))
    w, ids = select_experts(logits, 4, True)
    ref_w, ref_ids = select_experts_torch(logits, 4, True)
    assert ids.dtype == torch.int64 and torch.equal(ids, ref_ids) and torch.equal(w, ref_w)

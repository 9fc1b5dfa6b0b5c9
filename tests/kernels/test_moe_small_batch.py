"""The small-batch (decode) MoE path (moe/small_batch.py: gate-up GEMV, down GEMV + combine) against the torch
reference, bf16/float32 and FP8 experts, and which path fused_experts_triton takes at which token count.

Without CUDA the kernels run in Triton's CPU interpreter (tests/triton_mode.py), so shapes stay small: H and
I are not multiples of the tiles (masked edges) and span several K tiles."""

from __future__ import annotations

import json

import pytest
import torch

from model_executor.layers.moe import tuning
from model_executor.layers.moe.fused_moe import fused_experts_torch, routing_weights
from model_executor.layers.moe.router import select_experts
from tests import triton_mode
from tests.kernels.test_fused_moe import make_moe
from tests.kernels.test_moe_fp8 import fp8_experts
from tests.triton_mode import DEVICE, in_process

if not triton_mode.RERUN_IN_SUBPROCESS:
    from model_executor.layers.moe import kernels

test_in_subprocess = triton_mode.subprocess_test(__file__)

F32, BF16 = torch.float32, torch.bfloat16
TINY = {"BLOCK_N": 32, "BLOCK_K": 32, "num_warps": 4, "num_stages": 2, "DOWN_BLOCK_N": 32, "DOWN_BLOCK_K": 32,
        "down_num_warps": 4, "down_num_stages": 2}
E, H, I = 16, 80, 40  # 3 K tiles of the gate-up GEMV, 2 of the down one (the last ones partial), partial N tiles


def small_batch(x, w13, w2, weights, ids, renormalize, round_weights, **kw):
    return kernels.fused_experts_triton(x, w13, w2, weights, ids, renormalize, round_weights, config=TINY,
                                        path="small_batch", **kw)


def shared_expert(ids: torch.Tensor) -> bool:
    """Some expert is picked by two different tokens."""
    per_token = [set(row) for row in ids.tolist()]
    return any(a & b for i, a in enumerate(per_token) for b in per_token[i + 1:])


# every token count 1..SMALL_BATCH_MAX_TOKENS once; top 1, 2, 8 and 3 (padded to 4 in the down kernel);
# renormalize on and off; round on and off
F32_CASES = [(t, (1, 2, 8, 3)[t % 4], bool(t % 2), bool(t // 4 % 2))
             for t in range(1, tuning.SMALL_BATCH_MAX_TOKENS + 1)]


@in_process
@pytest.mark.parametrize("num_tokens,top_k,renormalize,round_weights", F32_CASES)
def test_small_batch_matches_torch_float32(num_tokens, top_k, renormalize, round_weights):
    """float32: equal to the reference within float32 summation noise. round_weights rounds the routing
    weights to float16 here (to x's dtype, float32, it would change nothing), against a reference given the
    weights rounded the same way (tests/kernels/test_fused_moe.py's test_weights_rounded_in_the_gemm)."""
    x, w13, w2, weights, ids = make_moe(num_tokens, E, H, I, top_k, F32, seed=num_tokens)
    if top_k == 8 and num_tokens > 2:
        assert shared_expert(ids)
    ref_weights = routing_weights(weights, renormalize, round_weights, torch.float16)
    ref = fused_experts_torch(x, w13, w2, ref_weights.float(), ids)
    out = small_batch(x, w13, w2, weights, ids, renormalize, round_weights, weight_dtype=torch.float16)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)


@in_process
@pytest.mark.parametrize("num_tokens,top_k,renormalize,round_weights,dtype", [
    (1, 8, True, True, BF16), (2, 1, False, False, BF16), (7, 2, True, False, BF16), (12, 8, False, True, BF16),
    (4, 8, True, True, torch.float16)], ids=["bf16-1", "bf16-2", "bf16-7", "bf16-12", "fp16-4"])
def test_small_batch_matches_torch_half(num_tokens, top_k, renormalize, round_weights, dtype):
    x, w13, w2, weights, ids = make_moe(num_tokens, E, H, I, top_k, dtype, seed=50 + num_tokens)
    ref = fused_experts_torch(x, w13, w2, weights, ids, renormalize, round_weights)
    out = small_batch(x, w13, w2, weights, ids, renormalize, round_weights)
    assert out.dtype == dtype
    # a few bf16 ulps (and the interpreter rounds float32 to bfloat16 toward zero); float16 is 8x finer
    tol = 4e-2 if dtype == BF16 else 5e-3
    torch.testing.assert_close(out, ref, rtol=tol, atol=tol)


@in_process
@pytest.mark.parametrize("block,block_k", [(None, 32), ((16, 32), 32), ((16, 32), 64)])
@pytest.mark.parametrize("num_tokens,dtype", [(1, F32), (5, F32), (3, BF16)])
def test_small_batch_fp8_matches_dequantized_reference(block, block_k, num_tokens, dtype):
    """FP8 experts (E=8, H=64, I=48, top 3), per output row or per 16x32 tile (a BLOCK_K of 64 is cut to the
    scales' 32), against the torch path on the dequantized weights (tests/kernels/test_moe_fp8.py's tolerance)."""
    w13, s13, w2, s2 = fp8_experts(8, 64, 48, block, seed=num_tokens)
    gen = torch.Generator().manual_seed(100 + num_tokens)
    x = torch.randn(num_tokens, 64, generator=gen).to(dtype)
    weights, ids = select_experts(torch.randn(num_tokens, 8, generator=gen), 3, False)
    ref = fused_experts_torch(x, w13, w2, weights, ids, True, False, s13, s2, block)
    config = dict(TINY, BLOCK_K=block_k, DOWN_BLOCK_K=block_k)
    out = kernels.fused_experts_triton(x.to(DEVICE), w13.to(DEVICE), w2.to(DEVICE), weights.to(DEVICE),
                                       ids.to(DEVICE), True, False, config=config, path="small_batch",
                                       w13_scale=s13.to(DEVICE), w2_scale=s2.to(DEVICE), block=block)
    tol = {"rtol": 1e-4, "atol": 1e-5} if dtype == F32 else {"rtol": 3e-2, "atol": 3e-2}
    torch.testing.assert_close(out.cpu(), ref, **tol)


@in_process
def test_out_of_range_expert_id_reads_the_last_expert():
    """The router kernel names expert E for a row of NaN logits (a garbage padded row in a graph): the
    kernels clamp it to E - 1 instead of reading past the weights (an illegal address would end the CUDA
    context)."""
    x, w13, w2, weights, ids = make_moe(2, 8, 32, 24, 2, F32, seed=7)
    ids[1, 0] = 8
    out = small_batch(x, w13, w2, weights, ids, True, False)
    ids[1, 0] = 7
    torch.testing.assert_close(out, small_batch(x, w13, w2, weights, ids, True, False), rtol=0, atol=0)


@in_process
def test_auto_path_skips_the_align_kernel_up_to_the_threshold(monkeypatch):
    """No config, no path: up to SMALL_BATCH_MAX_TOKENS tokens the small-batch kernels (nothing aligned; the
    default tiles), past it the grouped path (align); both equal the reference."""
    aligned = []
    align = kernels.moe_align_block_size
    monkeypatch.setattr(kernels, "moe_align_block_size", lambda *a: aligned.append(a[0].shape[0]) or align(*a))
    for num_tokens in (2, tuning.SMALL_BATCH_MAX_TOKENS + 1):
        x, w13, w2, weights, ids = make_moe(num_tokens, 8, 32, 24, 2, F32, seed=num_tokens)
        out = kernels.fused_experts_triton(x, w13, w2, weights, ids, True, False)
        torch.testing.assert_close(out, fused_experts_torch(x, w13, w2, weights, ids, True), rtol=1e-5, atol=1e-6)
    assert aligned == [tuning.SMALL_BATCH_MAX_TOKENS + 1]
    with pytest.raises(ValueError, match="path 'gemv' is none of"):
        kernels.fused_experts_triton(x, w13, w2, weights, ids, path="gemv")


# ---- the path per token count: moe/tuning.py ----------------------------------------------------------------


@pytest.fixture
def config_dir(tmp_path, monkeypatch):
    monkeypatch.setattr(tuning, "CONFIG_DIR", tmp_path)
    tuning.load_table.cache_clear()
    yield tmp_path
    tuning.load_table.cache_clear()


def test_untuned_path_is_small_batch_up_to_the_threshold(config_dir):
    limit = tuning.SMALL_BATCH_MAX_TOKENS
    assert tuning.select_path(8, 96, 64, 1, "cpu") == ("small_batch", tuning.default_small_config(1))
    assert tuning.select_path(8, 96, 64, limit, "cpu") == ("small_batch", tuning.default_small_config(limit))
    assert tuning.select_path(8, 96, 64, limit + 1, "cpu") == ("grouped", tuning.default_config(limit + 1))


def test_tuned_table_picks_the_path_per_token_count(config_dir):
    """The tuner's entries: "path" and the small kernels' config where it timed them; an entry without them
    (a table tuned before the small path) leaves the small path and its default tiles."""
    grouped = {k: 1 for k in tuning.KEYS}
    small = {k: 8 for k in tuning.SMALL_KEYS}
    table = {"1": dict(grouped, path="small_batch", small_batch=small), "4": dict(grouped, path="grouped",
             small_batch=small), "8": grouped, "64": grouped}
    (config_dir / tuning.table_path(8, 96, 64, "cpu").name).write_text(json.dumps(table))
    assert tuning.select_path(8, 96, 64, 1, "cpu") == ("small_batch", small)
    assert tuning.select_path(8, 96, 64, 4, "cpu") == ("grouped", grouped)
    assert tuning.select_path(8, 96, 64, 2, "cpu") == ("grouped", grouped)  # rounded up to 4 (1 is as near)
    assert tuning.select_path(8, 96, 64, 3, "cpu") == ("grouped", grouped)
    assert tuning.select_path(8, 96, 64, 9, "cpu") == ("small_batch", tuning.default_small_config(9))
    assert tuning.select_path(8, 96, 64, 40, "cpu") == ("grouped", grouped)
    assert tuning.get_small_config(8, 96, 64, 4, "cpu") == small  # a forced small path: the tuned tiles
    assert tuning.get_config(8, 96, 64, 1, "cpu") == grouped  # the grouped config stays KEYS only


def test_bad_path_in_a_table_is_named(config_dir):
    entry = dict({k: 1 for k in tuning.KEYS}, path="gemv")
    (config_dir / tuning.table_path(8, 96, 64, "cpu").name).write_text(json.dumps({"1": entry}))
    with pytest.raises(ValueError, match=r"E=8,N=96,K=64,device=cpu.json: path 'gemv' is none of"):
        tuning.select_path(8, 96, 64, 1, "cpu")

"""The fused decode rotary + KV store (model_executor/layers/rotary_store_kv.py) against the two ops it
replaces (the rotary, then the KV store) and against the PyTorch path (RotaryEmbedding.forward_native,
then KVCache.set_kv), including an FP8 pool with per-layer scales; with Qwen3's q/k norm weights, against
qk_norm_rope's op then the store, and RMSNorm.forward_native per head then the rotary.

Without CUDA the kernels run in Triton's CPU interpreter (tests/triton_mode.py); on a CUDA machine the
same tests run compiled on the GPU.
"""

from __future__ import annotations

import pytest
import torch

from model_executor.layers import triton_ops
from model_executor.layers.norm import RMSNorm
from model_executor.layers.qk_norm_rope import qk_norm_rope
from model_executor.layers.rotary import RotaryEmbedding
from model_executor.layers.rotary_store_kv import rotary_store_kv
from model_executor.memory_pool import KVCache
from tests import triton_mode
from tests.triton_mode import DEVICE, HAS_CUDA, in_process

test_in_subprocess = triton_mode.subprocess_test(__file__)

FP8 = torch.float8_e4m3fn
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}
# The same Triton arithmetic in both paths: equal bit for bit in the interpreter; a compiled kernel may
# contract the rotation's multiply-add differently (one rounding of the dtype apart).
SAME_MATH = ({"atol": 0, "rtol": 0} if not HAS_CUDA else
             {torch.float32: {"atol": 1e-6, "rtol": 1e-6}, torch.bfloat16: {"atol": 1e-2, "rtol": 2**-7}})
TOL = {torch.float32: {"atol": 1e-5, "rtol": 1e-5}, torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2}}


def same_math(dtype):
    return SAME_MATH if not HAS_CUDA else SAME_MATH[dtype]


def make_case(num_tokens, num_heads, num_kv_heads, head_dim, dtype, seed, num_slots=64, pos_dtype=torch.int64):
    """q, k, v as views into one fused qkv output (row-strided, like the model's), a pool, slots, positions."""
    gen = torch.Generator().manual_seed(seed)
    widths = [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim]
    qkv = (torch.randn(num_tokens, sum(widths), generator=gen) * 2).to(DEVICE, dtype)
    q, k, v = (x.view(num_tokens, -1, head_dim) for x in qkv.split(widths, dim=-1))
    rope = RotaryEmbedding(head_dim, 512, 500000.0, LLAMA3).to(DEVICE, dtype)  # cast as the model casts it
    positions = torch.randint(0, 512, (num_tokens,), generator=gen).to(DEVICE, pos_dtype)
    loc = (torch.randperm(num_slots, generator=gen)[:num_tokens] + 1).to(DEVICE)  # scattered, distinct
    pool = KVCache(num_slots, 1, num_kv_heads, head_dim, dtype, DEVICE)
    for buf in pool.k_buffers + pool.v_buffers:
        buf.copy_(torch.randn(buf.shape, generator=gen))
    return qkv, q, k, v, rope, positions, loc, pool


def clone_pool(pool: KVCache) -> KVCache:
    copy = KVCache(pool.num_slots, 1, pool.k_buffers[0].shape[1], pool.k_buffers[0].shape[2], pool.dtype, DEVICE,
                   pool.k_scales, pool.v_scales)
    copy.k_buffers[0].copy_(pool.k_buffers[0])
    copy.v_buffers[0].copy_(pool.v_buffers[0])
    return copy


@in_process
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(8, 2, 64), (4, 1, 128), (9, 3, 64), (6, 2, 80)])
def test_matches_rotary_then_store_kv(dtype, num_heads, num_kv_heads, head_dim):
    qkv, q, k, v, rope, positions, loc, pool = make_case(5, num_heads, num_kv_heads, head_dim, dtype, seed=head_dim)
    q_in, k_in = q.clone(), k.clone()
    split = [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim]
    q_ref, k_ref, v_ref = (x.view(5, -1, head_dim) for x in qkv.clone().split(split, dim=-1))
    ref_pool = clone_pool(pool)
    untouched = pool.k_buffers[0].clone()

    # the two ops the fused one replaces, on a copy
    triton_ops.apply_rotary(positions, q_ref, k_ref, rope.cos_sin_cache)
    triton_ops.store_kv(ref_pool.k_buffers[0], ref_pool.v_buffers[0], loc, k_ref, v_ref)
    rotary_store_kv(positions, q, k, v, rope.cos_sin_cache, pool.k_buffers[0], pool.v_buffers[0], loc)

    torch.testing.assert_close(q, q_ref, **same_math(dtype))
    torch.testing.assert_close(pool.k_buffers[0], ref_pool.k_buffers[0], **same_math(dtype))
    assert torch.equal(pool.v_buffers[0], ref_pool.v_buffers[0])
    assert torch.equal(k, k_in)  # k itself stays unrotated: attention reads the pool
    others = torch.ones(untouched.shape[0], dtype=torch.bool, device=DEVICE)
    others[loc] = False
    assert torch.equal(pool.k_buffers[0][others], untouched[others])

    # the PyTorch path: forward_native, then KVCache.set_kv's PyTorch store
    q_nat, k_nat = rope.forward_native(positions, q_in, k_in)
    torch.testing.assert_close(q, q_nat, **TOL[dtype])
    torch.testing.assert_close(pool.k_buffers[0][loc], k_nat, **TOL[dtype])
    assert torch.equal(pool.v_buffers[0][loc], v)


@in_process
def test_int32_positions_and_slots_and_one_token():
    _, q, k, v, rope, positions, loc, pool = make_case(1, 4, 2, 64, torch.float32, seed=3, pos_dtype=torch.int32)
    q_nat, k_nat = rope.forward_native(positions.long(), q.clone(), k.clone())
    rotary_store_kv(positions, q, k, v, rope.cos_sin_cache, pool.k_buffers[0], pool.v_buffers[0], loc.int())
    torch.testing.assert_close(q, q_nat, **TOL[torch.float32])
    torch.testing.assert_close(pool.k_buffers[0][loc], k_nat, **TOL[torch.float32])


@in_process
def test_fp8_pool_with_scales():
    """An FP8 pool holds K / k_scale and V / v_scale (KVCache.set_kv's division, here in the kernel)."""
    from tests.kernels.test_fp8_kernels import fp8_codes_match

    _, q, k, v, rope, positions, loc, _ = make_case(6, 8, 2, 64, torch.float32, seed=4)
    k_scale, v_scale = 0.5, 4.0
    k_buf = torch.zeros(65, 2, 64, dtype=FP8, device=DEVICE)
    v_buf = torch.zeros_like(k_buf)
    _, k_rot = rope.forward_native(positions, q.clone(), k.clone())
    rotary_store_kv(positions, q, k, v, rope.cos_sin_cache, k_buf, v_buf, loc, k_scale, v_scale)
    fp8_codes_match(k_buf[loc], (k_rot / k_scale).to(FP8), k_rot / k_scale)
    fp8_codes_match(v_buf[loc], (v / v_scale).to(FP8), v / v_scale)


@in_process
def test_bad_shapes_are_refused():
    _, q, k, v, rope, positions, loc, pool = make_case(2, 4, 2, 64, torch.float32, seed=5)
    with pytest.raises(ValueError, match="whole heads"):
        rotary_store_kv(positions, q, k, v, rope.cos_sin_cache[:, :32], pool.k_buffers[0], pool.v_buffers[0], loc)
    with pytest.raises(ValueError, match="do not fit the pool"):
        rotary_store_kv(positions, q, k[:, :1], v[:, :1], rope.cos_sin_cache, pool.k_buffers[0], pool.v_buffers[0],
                        loc)


@in_process
def test_opcheck_and_dynamo_sees_one_opaque_call():
    _, q, k, v, rope, positions, loc, pool = make_case(3, 4, 2, 64, torch.float32, seed=6)
    args = (positions, q, k, v, rope.cos_sin_cache, pool.k_buffers[0], pool.v_buffers[0], loc, 1.0, 1.0)
    q_norm, k_norm = make_norms(64, torch.float32, seed=6)
    for norms in ((None, None, 1e-6), (q_norm.weight, k_norm.weight, 1e-6)):
        torch.library.opcheck(torch.ops.duet.rotary_store_kv.default, args + norms,
                              test_utils=("test_schema", "test_faketensor"))
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def fn(positions, q, k, v, cache, k_buf, v_buf, loc):
        rotary_store_kv(positions, q, k, v, cache, k_buf, v_buf, loc)
        return q * 2

    eager = [a.clone() for a in args[:8]]
    compiled_out = torch.compile(fn, backend=backend, fullgraph=True)(*args[:8])
    torch.testing.assert_close(compiled_out, fn(*eager))
    torch.testing.assert_close(args[5], eager[5])  # the mutated pool
    targets = [n.target for n in graphs[0].graph.nodes if n.op == "call_function"]
    op = torch.ops.duet.rotary_store_kv
    assert sum(t in (op, op.default) for t in targets) == 1, targets


# ---------------------------------------------------------------- with Qwen3's per-head q/k norms


def make_norms(head_dim, dtype, seed, eps=1e-6) -> tuple[RMSNorm, RMSNorm]:
    gen = torch.Generator().manual_seed(seed)
    norms = RMSNorm(head_dim, eps), RMSNorm(head_dim, eps)
    with torch.no_grad():
        for norm in norms:
            norm.weight.copy_(torch.rand(head_dim, generator=gen) + 0.5)
    return tuple(norm.to(DEVICE, dtype) for norm in norms)


def norm_then_rotary_native(rope, q_norm, k_norm, positions, q, k):
    """The PyTorch path: RMSNorm per head, then the rotary (RadixAttention's unfused path on the CPU)."""
    return rope.forward_native(positions, q_norm.forward_native(q), k_norm.forward_native(k))


@in_process
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(8, 2, 64), (4, 1, 128), (9, 3, 64), (6, 2, 80),
                                                             (16, 2, 128)])
def test_qk_norm_matches_qk_norm_rope_then_store_kv(dtype, num_heads, num_kv_heads, head_dim):
    """The decode path Qwen3 takes on the triton backend against the one it replaces: qk_norm_rope's kernel
    (normalised and rotated in place), then the store."""
    qkv, q, k, v, rope, positions, loc, pool = make_case(5, num_heads, num_kv_heads, head_dim, dtype,
                                                         seed=head_dim + num_heads)
    q_norm, k_norm = make_norms(head_dim, dtype, seed=num_heads)
    q_in, k_in = q.clone(), k.clone()
    split = [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim]
    q_ref, k_ref, v_ref = (x.view(5, -1, head_dim) for x in qkv.clone().split(split, dim=-1))
    ref_pool = clone_pool(pool)
    untouched = pool.k_buffers[0].clone()

    qk_norm_rope(positions, q_ref, k_ref, q_norm.weight, k_norm.weight, 1e-6, rope.cos_sin_cache)
    triton_ops.store_kv(ref_pool.k_buffers[0], ref_pool.v_buffers[0], loc, k_ref, v_ref)
    rotary_store_kv(positions, q, k, v, rope.cos_sin_cache, pool.k_buffers[0], pool.v_buffers[0], loc,
                    q_norm_weight=q_norm.weight, k_norm_weight=k_norm.weight, norm_eps=1e-6)

    torch.testing.assert_close(q, q_ref, **same_math(dtype))
    torch.testing.assert_close(pool.k_buffers[0], ref_pool.k_buffers[0], **same_math(dtype))
    assert torch.equal(pool.v_buffers[0], ref_pool.v_buffers[0])
    assert torch.equal(k, k_in)
    others = torch.ones(untouched.shape[0], dtype=torch.bool, device=DEVICE)
    others[loc] = False
    assert torch.equal(pool.k_buffers[0][others], untouched[others])

    # the PyTorch path in float32 on the same (dtype-rounded) inputs: the kernel's own roundings only
    q_nat, k_nat = norm_then_rotary_native(rope.float(), q_norm.float(), k_norm.float(), positions, q_in.float(),
                                           k_in.float())
    torch.testing.assert_close(q.float(), q_nat, **TOL[dtype])
    torch.testing.assert_close(pool.k_buffers[0][loc].float(), k_nat, **TOL[dtype])


@in_process
def test_qk_norm_eps_reaches_the_kernel():
    """A large eps changes the norm of small heads: the kernel must use the eps given, not a constant."""
    _, q, k, v, rope, positions, loc, pool = make_case(3, 4, 2, 64, torch.float32, seed=9)
    q_norm, k_norm = make_norms(64, torch.float32, seed=9, eps=0.5)
    q_nat, k_nat = norm_then_rotary_native(rope, q_norm, k_norm, positions, q.clone(), k.clone())
    rotary_store_kv(positions, q, k, v, rope.cos_sin_cache, pool.k_buffers[0], pool.v_buffers[0], loc,
                    q_norm_weight=q_norm.weight, k_norm_weight=k_norm.weight, norm_eps=0.5)
    torch.testing.assert_close(q, q_nat, **TOL[torch.float32])
    torch.testing.assert_close(pool.k_buffers[0][loc], k_nat, **TOL[torch.float32])


@in_process
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_qk_norm_fp8_pool_with_scales(dtype):
    """An FP8 pool holds the normalised, rotated K / k_scale and V / v_scale."""
    from tests.kernels.test_fp8_kernels import fp8_codes_match

    _, q, k, v, rope, positions, loc, _ = make_case(6, 8, 2, 128, dtype, seed=10)
    q_norm, k_norm = make_norms(128, dtype, seed=10)
    k_scale, v_scale = 0.5, 4.0
    k_buf = torch.zeros(65, 2, 128, dtype=FP8, device=DEVICE)
    v_buf = torch.zeros_like(k_buf)
    q_ref, k_ref = q.clone(), k.clone()
    qk_norm_rope(positions, q_ref, k_ref, q_norm.weight, k_norm.weight, 1e-6, rope.cos_sin_cache)
    rotary_store_kv(positions, q, k, v, rope.cos_sin_cache, k_buf, v_buf, loc, k_scale, v_scale,
                    q_norm_weight=q_norm.weight, k_norm_weight=k_norm.weight, norm_eps=1e-6)
    torch.testing.assert_close(q, q_ref, **same_math(dtype))
    k_exact, v_exact = k_ref.float() / k_scale, v.float() / v_scale
    fp8_codes_match(k_buf[loc], k_exact.to(FP8), k_exact)
    fp8_codes_match(v_buf[loc], v_exact.to(FP8), v_exact)


@in_process
def test_qk_norm_bad_weights_are_refused():
    _, q, k, v, rope, positions, loc, pool = make_case(2, 4, 2, 64, torch.float32, seed=11)
    q_norm, k_norm = make_norms(64, torch.float32, seed=11)
    bufs = (pool.k_buffers[0], pool.v_buffers[0])
    with pytest.raises(ValueError, match="both norm weights or neither"):
        rotary_store_kv(positions, q, k, v, rope.cos_sin_cache, *bufs, loc, q_norm_weight=q_norm.weight)
    with pytest.raises(ValueError, match="not one weight per element of a head of 64"):
        rotary_store_kv(positions, q, k, v, rope.cos_sin_cache, *bufs, loc, q_norm_weight=q_norm.weight,
                        k_norm_weight=k_norm.weight[:32])

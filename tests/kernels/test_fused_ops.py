"""The fused Triton ops (model_executor/layers/triton_ops) against the plain PyTorch layer code.

Without CUDA the kernels run in Triton's CPU interpreter on CPU tensors (tests/triton_mode.py); on a CUDA
machine the same tests run compiled on the GPU.
"""

from __future__ import annotations

import pytest
import torch

from model_executor.layers import triton_ops
from model_executor.layers.activation import SiluAndMul
from model_executor.layers.norm import RMSNorm
from model_executor.layers.rotary import RotaryEmbedding
from tests import triton_mode
from tests.triton_mode import DEVICE, HAS_CUDA, in_process

# float32: the kernels differ from PyTorch only in float32 rounding order; bfloat16: a rounding step apart
TOL = {torch.float32: {"atol": 1e-5, "rtol": 1e-5}, torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2}}
DTYPES = [torch.float32, torch.bfloat16]
# Where the reference rounds a float32 value to bfloat16 once, a compiled kernel agrees bit for bit (both
# round to nearest even); Triton's interpreter truncates instead, so on CPU allow one bfloat16 ulp.
ONE_ROUNDING = {"atol": 0, "rtol": 0} if HAS_CUDA else {"atol": 1e-6, "rtol": 2**-7}


test_in_subprocess = triton_mode.subprocess_test(__file__)


def randn(*shape, gen, dtype=torch.float32, scale=1.0):
    return (torch.randn(*shape, generator=gen) * scale).to(DEVICE, dtype)


# ---------------------------------------------------------------- RMSNorm


def make_norm(hidden, dtype, gen, eps=1e-5):
    norm = RMSNorm(hidden, eps)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(hidden, generator=gen) * 0.4 + 0.8)
    return norm.to(DEVICE, dtype)


@in_process
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [64, 200, 2048])
def test_rmsnorm_matches_torch(dtype, hidden):
    gen = torch.Generator().manual_seed(hidden)
    norm = make_norm(hidden, dtype, gen)
    x = randn(7, hidden, gen=gen, dtype=dtype, scale=3.0)
    out = triton_ops.rmsnorm(x, norm.weight, norm.eps)
    ref = norm.forward_native(x)
    assert out.dtype == dtype and out.shape == x.shape
    torch.testing.assert_close(out, ref, **TOL[dtype])


@in_process
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [64, 200])
def test_fused_add_rmsnorm_matches_torch(dtype, hidden):
    gen = torch.Generator().manual_seed(100 + hidden)
    norm = make_norm(hidden, dtype, gen)
    # x as a row-strided view (a slice of a wider tensor), residual contiguous
    x = randn(5, 2 * hidden, gen=gen, dtype=dtype)[:, hidden:]
    residual = randn(5, hidden, gen=gen, dtype=dtype, scale=2.0)
    x_before, res_before = x.clone(), residual.clone()
    out, res_out = triton_ops.rmsnorm(x, norm.weight, norm.eps, residual)
    ref_out, ref_res = norm.forward_native(x, residual)
    assert out.dtype == dtype and res_out.dtype == dtype
    # the residual sum is rounded to the dtype like PyTorch's add
    torch.testing.assert_close(res_out, ref_res, **ONE_ROUNDING)
    torch.testing.assert_close(out, ref_out, **TOL[dtype])
    assert torch.equal(x, x_before) and torch.equal(residual, res_before)  # functional: inputs untouched


@in_process
def test_rmsnorm_3d_input_and_zero_rows():
    gen = torch.Generator().manual_seed(3)
    norm = make_norm(96, torch.float32, gen)
    x = randn(2, 3, 96, gen=gen)
    torch.testing.assert_close(triton_ops.rmsnorm(x, norm.weight, norm.eps), norm.forward_native(x),
                               **TOL[torch.float32])
    empty = torch.empty(0, 96, device=DEVICE)
    assert triton_ops.rmsnorm(empty, norm.weight, norm.eps).shape == (0, 96)


# ---------------------------------------------------------------- rotary


def make_qkv(num_tokens, num_heads, num_kv_heads, head_dim, dtype, gen):
    """q, k, v as views into one fused qkv output, like LlamaAttention's split (non-contiguous rows)."""
    qkv = randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, gen=gen, dtype=dtype)
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    return qkv, q, k, v


@in_process
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(8, 2, 64), (4, 1, 128), (9, 3, 64), (6, 2, 80)])
@pytest.mark.parametrize("as_3d", [True, False])
def test_rotary_matches_torch(dtype, num_heads, num_kv_heads, head_dim, as_3d):
    gen = torch.Generator().manual_seed(num_heads * head_dim)
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 64}
    rope = RotaryEmbedding(head_dim, 512, 500000.0, scaling).to(DEVICE)
    num_tokens = 11
    _qkv, q, k, v = make_qkv(num_tokens, num_heads, num_kv_heads, head_dim, dtype, gen)
    positions = torch.randint(0, 512, (num_tokens,), generator=gen).to(DEVICE)
    q3, k3 = q.view(num_tokens, num_heads, head_dim), k.view(num_tokens, num_kv_heads, head_dim)
    ref_q, ref_k = rope.forward_native(positions, q3, k3)  # copies, computed before the in-place op
    v_before = v.clone()
    if as_3d:
        out_q, out_k = triton_ops.apply_rotary(positions, q3, k3, rope.cos_sin_cache)
        assert out_q is q3 and out_k is k3
    else:
        out_q, out_k = triton_ops.apply_rotary(positions, q, k, rope.cos_sin_cache)
        assert out_q is q and out_k is k
    torch.testing.assert_close(q3, ref_q, **TOL[dtype])  # rotated in place, through the views
    torch.testing.assert_close(k3, ref_k, **TOL[dtype])
    assert torch.equal(v, v_before)


@in_process
def test_rotary_int32_positions_and_contiguous_heads():
    gen = torch.Generator().manual_seed(5)
    rope = RotaryEmbedding(64, 128, 10000.0).to(DEVICE)
    q = randn(4, 4, 64, gen=gen)
    k = randn(4, 2, 64, gen=gen)
    positions = torch.tensor([0, 1, 127, 5], dtype=torch.int32, device=DEVICE)
    ref_q, ref_k = rope.forward_native(positions.long(), q, k)
    triton_ops.apply_rotary(positions, q, k, rope.cos_sin_cache)
    torch.testing.assert_close(q, ref_q, **TOL[torch.float32])
    torch.testing.assert_close(k, ref_k, **TOL[torch.float32])


# ---------------------------------------------------------------- SiLU-and-mul


@in_process
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens,inter", [(1, 1), (3, 37), (5, 1500), (2, 2048)])
def test_silu_and_mul_matches_torch(dtype, num_tokens, inter):
    gen = torch.Generator().manual_seed(inter)
    x = randn(num_tokens, 2 * inter, gen=gen, dtype=dtype, scale=4.0)
    out = triton_ops.silu_and_mul(x)
    assert out.shape == (num_tokens, inter) and out.dtype == dtype
    torch.testing.assert_close(out, SiluAndMul().forward_native(x), **TOL[dtype])


@in_process
def test_silu_and_mul_strided_and_3d():
    gen = torch.Generator().manual_seed(9)
    x = randn(3, 2 * 50 + 7, gen=gen)[:, 7:]  # row stride 107, not 2*I
    x3 = randn(2, 3, 2 * 33, gen=gen)
    for inp in (x, x3):
        torch.testing.assert_close(triton_ops.silu_and_mul(inp), SiluAndMul().forward_native(inp),
                                   **TOL[torch.float32])


# ---------------------------------------------------------------- KV store


@in_process
@pytest.mark.parametrize("buf_dtype,src_dtype", [(torch.float32, torch.float32),
                                                 (torch.bfloat16, torch.bfloat16),
                                                 (torch.bfloat16, torch.float32)])
@pytest.mark.parametrize("num_kv_heads,head_dim", [(2, 64), (3, 80), (1, 128)])
def test_store_kv_matches_torch(buf_dtype, src_dtype, num_kv_heads, head_dim):
    from model_executor.memory_pool import KVCache

    gen = torch.Generator().manual_seed(num_kv_heads * head_dim)
    num_slots, num_tokens = 64, 9
    pool = KVCache(num_slots, 2, num_kv_heads, head_dim, buf_dtype, "cpu")
    for buf in pool.k_buffers + pool.v_buffers:
        buf.copy_(torch.randn(buf.shape, generator=gen))
    pool.k_buffers = [b.to(DEVICE) for b in pool.k_buffers]
    pool.v_buffers = [b.to(DEVICE) for b in pool.v_buffers]
    k_ref, v_ref = pool.k_buffers[1].clone(), pool.v_buffers[1].clone()

    loc = (torch.randperm(num_slots, generator=gen)[:num_tokens] + 1).to(DEVICE)  # scattered, distinct
    _, _, k, v = make_qkv(num_tokens, 4, num_kv_heads, head_dim, src_dtype, gen)
    k, v = k.view(num_tokens, num_kv_heads, head_dim), v.view(num_tokens, num_kv_heads, head_dim)
    k_ref[loc] = k.to(buf_dtype)  # the PyTorch path of KVCache.set_kv
    v_ref[loc] = v.to(buf_dtype)

    triton_ops.store_kv(pool.k_buffers[1], pool.v_buffers[1], loc, k, v)
    tol = ONE_ROUNDING if src_dtype != buf_dtype else {"atol": 0, "rtol": 0}  # a pure copy is exact anyway
    torch.testing.assert_close(pool.k_buffers[1], k_ref, **tol)
    torch.testing.assert_close(pool.v_buffers[1], v_ref, **tol)


@in_process
def test_store_kv_2d_rows_and_int32_slots():
    gen = torch.Generator().manual_seed(11)
    k_buf = torch.zeros(20, 2, 64, device=DEVICE)
    v_buf = torch.zeros(20, 2, 64, device=DEVICE)
    k, v = randn(3, 128, gen=gen), randn(3, 128, gen=gen)
    loc = torch.tensor([17, 0, 4], dtype=torch.int32, device=DEVICE)
    triton_ops.store_kv(k_buf, v_buf, loc, k, v)
    assert torch.equal(k_buf[loc.long()], k.view(3, 2, 64))
    assert torch.equal(v_buf[loc.long()], v.view(3, 2, 64))
    untouched = torch.ones(20, dtype=torch.bool)
    untouched[loc.long()] = False
    assert not k_buf[untouched].any() and not v_buf[untouched].any()


# ---------------------------------------------------------------- registration and tracing


def _op_samples():
    gen = torch.Generator().manual_seed(21)
    x, res, w = randn(3, 64, gen=gen), randn(3, 64, gen=gen), randn(64, gen=gen)
    _, q, k, _ = make_qkv(3, 4, 2, 64, torch.float32, gen)
    cache = RotaryEmbedding(64, 32, 10000.0).cos_sin_cache.to(DEVICE)
    positions = torch.tensor([0, 7, 31], device=DEVICE)
    k_buf, v_buf = torch.zeros(8, 2, 64, device=DEVICE), torch.zeros(8, 2, 64, device=DEVICE)
    kv = randn(3, 2, 64, gen=gen)
    loc = torch.tensor([5, 1, 2], device=DEVICE)
    return [
        (torch.ops.duet.rmsnorm.default, (x, w, 1e-5)),
        (torch.ops.duet.fused_add_rmsnorm.default, (x, res, w, 1e-5)),
        (torch.ops.duet.apply_rotary.default, (positions, q, k, cache)),
        (torch.ops.duet.silu_and_mul.default, (randn(3, 2 * 40, gen=gen),)),
        (torch.ops.duet.store_kv.default, (k_buf, v_buf, loc, kv, kv.clone())),
    ]


@in_process
@pytest.mark.parametrize("index", range(5))
def test_opcheck(index):
    """Schema (declared mutations, no aliasing outputs) and the fake implementations agree with the ops."""
    op, args = _op_samples()[index]
    torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor"))


@in_process
def test_dynamo_traces_ops_as_opaque_calls():
    gen = torch.Generator().manual_seed(22)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def block(x, residual, w, positions, q, k, cache, k_buf, v_buf, loc):
        h, residual = triton_ops.rmsnorm(x, w, 1e-5, residual)
        h = triton_ops.rmsnorm(h, w, 1e-5)
        q, k = triton_ops.apply_rotary(positions, q, k, cache)
        triton_ops.store_kv(k_buf, v_buf, loc, k, k)
        return triton_ops.silu_and_mul(torch.cat([h, h], dim=-1)) + q.sum(), residual

    w = randn(128, gen=gen)
    cache = RotaryEmbedding(64, 32, 10000.0).cos_sin_cache.to(DEVICE)

    def inputs(n):
        _, q, k, _ = make_qkv(n, 2, 2, 64, torch.float32, gen)
        x, residual, positions = randn(n, 128, gen=gen), randn(n, 128, gen=gen), torch.arange(n, device=DEVICE)
        k_buf, v_buf = torch.zeros(16, 2, 64, device=DEVICE), torch.zeros(16, 2, 64, device=DEVICE)
        return x, residual, w, positions, q, k, cache, k_buf, v_buf, positions + 1

    compiled = torch.compile(block, backend=backend, fullgraph=True, dynamic=True)
    for n in (3, 5):
        args = inputs(n)
        eager_args = [a.clone() for a in args]
        got = compiled(*args)
        ref = block(*eager_args)
        for g, r in zip(got, ref):
            torch.testing.assert_close(g, r)
        torch.testing.assert_close(args[7], eager_args[7])  # the mutated KV buffer
    assert len(graphs) == 1  # one graph, dynamic in the token count
    targets = [node.target for node in graphs[0].graph.nodes if node.op == "call_function"]
    for name in ("rmsnorm", "fused_add_rmsnorm", "apply_rotary", "store_kv", "silu_and_mul"):
        packet = getattr(torch.ops.duet, name)
        assert sum(t in (packet, packet.default) for t in targets) == 1, (name, targets)


@in_process
def test_wrappers_go_through_the_ops_under_a_dispatch_mode():
    """Under FakeTensorMode (as in tracing) the wrappers call the registered ops, which run the fakes."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.empty(4, 64, device=DEVICE, dtype=torch.bfloat16)
        w = torch.empty(64, device=DEVICE, dtype=torch.bfloat16)
        out, res = triton_ops.rmsnorm(x, w, 1e-5, x)
        assert out.shape == res.shape == (4, 64) and out.dtype == res.dtype == torch.bfloat16
        assert triton_ops.rmsnorm(x, w.float(), 1e-5).dtype == torch.float32  # weight * x promotes
        assert triton_ops.silu_and_mul(x).shape == (4, 32)
        q, k = torch.empty(4, 2, 32, device=DEVICE), torch.empty(4, 1, 32, device=DEVICE)
        positions = torch.zeros(4, dtype=torch.int64, device=DEVICE)
        rq, rk = triton_ops.apply_rotary(positions, q, k, torch.empty(8, 32, device=DEVICE))
        assert rq is q and rk is k
        triton_ops.store_kv(torch.empty(8, 1, 32, device=DEVICE), torch.empty(8, 1, 32, device=DEVICE),
                            positions, k, k)

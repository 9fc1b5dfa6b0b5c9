"""The fused Triton ops on a CUDA device, in bfloat16 at serving shapes: against the plain PyTorch path (the
layers' forward_native), one kernel per layer call, CUDA-graph capture and replay. Their timings are
benchmarks/kernels/bench_fused_ops.py's (which also builds the inputs used here).

Run: pytest -m gpu tests/kernels/test_fused_ops_gpu.py
"""

from __future__ import annotations

import copy

import pytest
import torch

if not torch.cuda.is_available():
    # Skip before importing triton: on a CPU machine, importing triton here in compiled mode would stop
    # tests/kernels/test_fused_ops.py from switching on the interpreter in the same process.
    pytest.skip("needs a CUDA device", allow_module_level=True)

from benchmarks.kernels.bench_fused_ops import (
    BF16,
    DEV,
    QWEN3_SHAPES,
    SHAPES,
    make_norm,
    make_qkv,
    make_rope,
    randn,
)
from model_executor.layers.activation import SiluAndMul
from model_executor.layers.qk_norm_rope import qk_norm_rope
from model_executor.layers.rotary_store_kv import rotary_store_kv
from model_executor.memory_pool import KVCache

pytestmark = pytest.mark.gpu

TOKENS = [1, 7, 300]
FP8 = torch.float8_e4m3fn
# a rounding step of bfloat16 apart at most (float32 rounding order, exp): a tolerance of a few ulps
LOOSE = {"atol": 2e-2, "rtol": 2e-2}
# bf16 results against a float32 reference of q/k norms + rotary: three bf16 roundings (normalised, weighted,
# rotated) of values up to ~6, where a bf16 step is 2**-5
NATIVE_F32 = {"atol": 2**-4, "rtol": 2e-2}


def mismatch_fraction(a, b):
    return (a != b).float().mean().item()


# ---------------------------------------------------------------- accuracy against the PyTorch path


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("num_tokens", TOKENS)
def test_rmsnorm_bf16(shape, num_tokens):
    hidden = SHAPES[shape][0]
    gen = torch.Generator(device=DEV).manual_seed(num_tokens)
    norm = make_norm(hidden, gen)
    x, residual = randn(num_tokens, hidden, gen=gen, scale=3.0), randn(num_tokens, hidden, gen=gen)
    out = norm(x)  # the layer takes the fused path on CUDA
    ref = norm.forward_native(x)
    assert out.dtype == BF16
    torch.testing.assert_close(out, ref, **LOOSE)
    assert mismatch_fraction(out, ref) < 0.02  # nearly all bit-identical: only float32 rounding order differs

    out, res_out = norm(x, residual)
    ref_out, ref_res = norm.forward_native(x, residual)
    assert torch.equal(res_out, ref_res)  # x + residual rounds to bfloat16 exactly as PyTorch's add
    torch.testing.assert_close(out, ref_out, **LOOSE)
    assert mismatch_fraction(out, ref_out) < 0.02


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("num_tokens", TOKENS)
def test_rotary_bf16(shape, num_tokens):
    _, _, num_heads, num_kv_heads, head_dim = SHAPES[shape]
    gen = torch.Generator(device=DEV).manual_seed(num_tokens)
    rope = make_rope(head_dim)
    q, k, v = make_qkv(num_tokens, num_heads, num_kv_heads, head_dim, gen)
    positions = torch.randint(0, 131072, (num_tokens,), generator=gen, device=DEV)
    ref_q, ref_k = rope.forward_native(positions, q, k)
    v_before = v.clone()
    out_q, out_k = rope(positions, q, k)  # fused, in place
    assert out_q is q and out_k is k
    torch.testing.assert_close(q, ref_q, **LOOSE)
    torch.testing.assert_close(k, ref_k, **LOOSE)
    assert torch.equal(v, v_before)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("num_tokens", TOKENS)
def test_silu_and_mul_bf16(shape, num_tokens):
    inter = SHAPES[shape][1]
    gen = torch.Generator(device=DEV).manual_seed(num_tokens)
    x = randn(num_tokens, 2 * inter, gen=gen, scale=3.0)
    out = SiluAndMul()(x)
    ref = SiluAndMul().forward_native(x)
    assert out.shape == (num_tokens, inter) and out.dtype == BF16
    torch.testing.assert_close(out, ref, **LOOSE)
    assert mismatch_fraction(out, ref) < 0.02


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("num_tokens", TOKENS)
def test_store_kv_bf16(shape, num_tokens):
    _, _, num_heads, num_kv_heads, head_dim = SHAPES[shape]
    gen = torch.Generator(device=DEV).manual_seed(num_tokens)
    pool = KVCache(4096, 2, num_kv_heads, head_dim, BF16, DEV)
    for buf in pool.k_buffers + pool.v_buffers:
        buf.normal_(generator=gen)
    k_ref, v_ref = pool.k_buffers[1].clone(), pool.v_buffers[1].clone()
    loc = torch.randperm(4096, generator=gen, device=DEV)[:num_tokens] + 1  # scattered, distinct, int64
    _, k, v = make_qkv(num_tokens, num_heads, num_kv_heads, head_dim, gen)  # row-strided views
    k_ref[loc], v_ref[loc] = k, v
    pool.set_kv(1, loc, k, v)  # fused on CUDA
    assert torch.equal(pool.k_buffers[1], k_ref) and torch.equal(pool.v_buffers[1], v_ref)
    # float32 rows into bfloat16 buffers: cast like .to(), round to nearest even
    k32, v32 = k.float() * 1.001, v.float() * 0.999
    k_ref[loc], v_ref[loc] = k32.to(BF16), v32.to(BF16)
    pool.set_kv(1, loc, k32, v32)
    assert torch.equal(pool.k_buffers[1], k_ref) and torch.equal(pool.v_buffers[1], v_ref)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("num_tokens", TOKENS)
def test_rotary_store_kv_bf16(shape, num_tokens):
    """The decode rotary + KV store kernel against the rotary then the store (both fused ops), and against
    the PyTorch path."""
    _, _, num_heads, num_kv_heads, head_dim = SHAPES[shape]
    gen = torch.Generator(device=DEV).manual_seed(num_tokens)
    rope = make_rope(head_dim)
    pool, ref_pool = (KVCache(4096, 1, num_kv_heads, head_dim, BF16, DEV) for _ in range(2))
    pool.k_buffers[0].normal_(generator=gen)
    ref_pool.k_buffers[0].copy_(pool.k_buffers[0])
    q, k, v = make_qkv(num_tokens, num_heads, num_kv_heads, head_dim, gen)
    q_ref, k_ref = q.clone(), k.clone()
    positions = torch.randint(0, 131072, (num_tokens,), generator=gen, device=DEV)
    loc = torch.randperm(4096, generator=gen, device=DEV)[:num_tokens] + 1
    nat_q, nat_k = rope.forward_native(positions, q, k)
    q_ref, k_ref = rope(positions, q_ref, k_ref)
    ref_pool.set_kv(0, loc, k_ref, v)
    rotary_store_kv(positions, q, k, v, rope.cos_sin_cache, pool.k_buffers[0], pool.v_buffers[0], loc)
    # the same float32 arithmetic as the two kernels: equal up to how each compiles the multiply-adds
    assert mismatch_fraction(q, q_ref) < 0.01 and mismatch_fraction(pool.k_buffers[0], ref_pool.k_buffers[0]) < 0.01
    torch.testing.assert_close(q, q_ref, **LOOSE)
    torch.testing.assert_close(pool.k_buffers[0], ref_pool.k_buffers[0], **LOOSE)
    assert torch.equal(pool.v_buffers[0], ref_pool.v_buffers[0])
    torch.testing.assert_close(q, nat_q, **LOOSE)
    torch.testing.assert_close(pool.k_buffers[0][loc], nat_k, **LOOSE)


@pytest.mark.parametrize("shape", QWEN3_SHAPES)
@pytest.mark.parametrize("num_tokens", TOKENS)
@pytest.mark.parametrize("pool_dtype", [BF16, FP8], ids=["bf16_pool", "fp8_pool"])
def test_qk_norm_rotary_store_kv_bf16(shape, num_tokens, pool_dtype):
    """Qwen3's decode kernel (per-head q/k norms, rotary, KV store) against what it replaces on CUDA:
    qk_norm_rope's kernel, then KVCache.set_kv (an FP8 pool with scales other than 1); and the PyTorch path."""
    num_heads, num_kv_heads, head_dim = QWEN3_SHAPES[shape]
    gen = torch.Generator(device=DEV).manual_seed(num_tokens)
    rope = make_rope(head_dim)
    q_norm, k_norm = make_norm(head_dim, gen), make_norm(head_dim, gen)
    scales = ([0.5], [2.0]) if pool_dtype == FP8 else ([1.0], [1.0])
    pool, ref_pool = (KVCache(4096, 1, num_kv_heads, head_dim, pool_dtype, DEV, *scales) for _ in range(2))
    pool.k_buffers[0].copy_(torch.randn(pool.k_buffers[0].shape, generator=gen, device=DEV))
    ref_pool.k_buffers[0].copy_(pool.k_buffers[0])
    q, k, v = make_qkv(num_tokens, num_heads, num_kv_heads, head_dim, gen)
    q_ref, k_ref = q.clone(), k.clone()
    positions = torch.randint(0, 131072, (num_tokens,), generator=gen, device=DEV)
    loc = torch.randperm(4096, generator=gen, device=DEV)[:num_tokens] + 1
    # the PyTorch path in float32 on the same bf16 inputs (a bf16 one rounds in other places: a few ulps off)
    rope32, q_norm32, k_norm32 = (copy.deepcopy(m).float() for m in (rope, q_norm, k_norm))
    nat_q, nat_k = rope32.forward_native(positions, q_norm32.forward_native(q.float()),
                                         k_norm32.forward_native(k.float()))
    qk_norm_rope(positions, q_ref, k_ref, q_norm.weight, k_norm.weight, q_norm.eps, rope.cos_sin_cache)
    ref_pool.set_kv(0, loc, k_ref, v)
    rotary_store_kv(positions, q, k, v, rope.cos_sin_cache, *pool.get_kv(0), loc, *pool.get_scales(0),
                    q_norm_weight=q_norm.weight, k_norm_weight=k_norm.weight, norm_eps=q_norm.eps)
    # the same float32 arithmetic as qk_norm_rope's kernel: equal up to how each compiles the multiply-adds
    assert mismatch_fraction(q, q_ref) < 0.01
    torch.testing.assert_close(q, q_ref, **LOOSE)
    torch.testing.assert_close(q.float(), nat_q, **NATIVE_F32)
    k_buf, ref_k_buf = pool.k_buffers[0].float(), ref_pool.k_buffers[0].float()
    v_buf, ref_v_buf = pool.v_buffers[0].float(), ref_pool.v_buffers[0].float()
    # FP8: the reference divides in bf16 (exact here: powers of two) and casts from bf16, the kernel from
    # float32: one FP8 step apart at most
    tol = {"atol": 2**-6, "rtol": 0.13} if pool_dtype == FP8 else LOOSE
    if pool_dtype == BF16:
        assert mismatch_fraction(k_buf[loc], ref_k_buf[loc]) < 0.01 and torch.equal(v_buf, ref_v_buf)
    torch.testing.assert_close(k_buf, ref_k_buf, **tol)  # (the whole pool: other slots untouched)
    torch.testing.assert_close(v_buf, ref_v_buf, **tol)
    k_scale = pool.get_scales(0)[0]
    torch.testing.assert_close(k_buf[loc] * k_scale, nat_k, **(dict(NATIVE_F32, rtol=0.13) if pool_dtype == FP8
                                                               else NATIVE_F32))


def test_opcheck_cuda():
    gen = torch.Generator(device=DEV).manual_seed(0)
    x, res, w = randn(5, 576, gen=gen), randn(5, 576, gen=gen), randn(576, gen=gen)
    q, k, _ = make_qkv(5, 9, 3, 64, gen)
    rope = make_rope(64)
    positions = torch.arange(5, device=DEV)
    k_buf = torch.zeros(16, 3, 64, device=DEV, dtype=BF16)
    v_buf = torch.zeros(16, 3, 64, device=DEV, dtype=BF16)
    utils = ("test_schema", "test_faketensor")
    torch.library.opcheck(torch.ops.duet.rmsnorm.default, (x, w, 1e-5), test_utils=utils)
    torch.library.opcheck(torch.ops.duet.fused_add_rmsnorm.default, (x, res, w, 1e-5), test_utils=utils)
    torch.library.opcheck(torch.ops.duet.apply_rotary.default, (positions, q, k, rope.cos_sin_cache),
                          test_utils=utils)
    torch.library.opcheck(torch.ops.duet.silu_and_mul.default, (randn(5, 3072, gen=gen),), test_utils=utils)
    torch.library.opcheck(torch.ops.duet.store_kv.default, (k_buf, v_buf, positions + 1, k, k.clone()),
                          test_utils=utils)


# ---------------------------------------------------------------- one kernel each


def _kernels_launched(fn) -> list[str]:
    fn()  # compile outside the profile
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


def test_one_kernel_per_layer_call():
    hidden, inter, num_heads, num_kv_heads, head_dim = SHAPES["1b"]
    gen = torch.Generator(device=DEV).manual_seed(0)
    norm, rope, act = make_norm(hidden, gen), make_rope(head_dim), SiluAndMul()
    pool = KVCache(64, 1, num_kv_heads, head_dim, BF16, DEV)
    x, residual = randn(4, hidden, gen=gen), randn(4, hidden, gen=gen)
    q, k, v = make_qkv(4, num_heads, num_kv_heads, head_dim, gen)
    positions, loc = torch.arange(4, device=DEV), torch.arange(4, device=DEV) + 1
    gate_up = randn(4, 2 * inter, gen=gen)
    qk_w = make_norm(head_dim, gen).weight
    calls = {
        "rmsnorm": lambda: norm(x),
        "fused_add_rmsnorm": lambda: norm(x, residual),
        "rotary": lambda: rope(positions, q, k),
        "silu_and_mul": lambda: act(gate_up),
        "set_kv": lambda: pool.set_kv(0, loc, k, v),
        "rotary_store_kv": lambda: rotary_store_kv(positions, q, k, v, rope.cos_sin_cache, *pool.get_kv(0), loc),
        "rotary_store_kv+qk_norm": lambda: rotary_store_kv(positions, q, k, v, rope.cos_sin_cache, *pool.get_kv(0),
                                                           loc, q_norm_weight=qk_w, k_norm_weight=qk_w),
    }
    if not _kernels_launched(lambda: x.add(1)):
        pytest.skip("the profiler sees no CUDA kernels here (no CUPTI?)")
    for name, fn in calls.items():
        kernels = _kernels_launched(fn)
        assert len(kernels) == 1, (name, kernels)


# ---------------------------------------------------------------- CUDA graphs


def _capture(fn):
    """Warm up (Triton compiles) on a side stream, then capture fn in a graph; returns (graph, outputs)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = fn()
    return graph, outputs


@pytest.mark.parametrize("shape", ["1b", "8b"])
@pytest.mark.parametrize("num_tokens", [1, 8])
def test_cuda_graph_replay(shape, num_tokens):
    hidden, inter, num_heads, num_kv_heads, head_dim = SHAPES[shape]
    gen = torch.Generator(device=DEV).manual_seed(7)
    norm, rope, act = make_norm(hidden, gen), make_rope(head_dim), SiluAndMul()
    pool = KVCache(1024, 1, num_kv_heads, head_dim, BF16, DEV)
    # static inputs
    x, residual = randn(num_tokens, hidden, gen=gen), randn(num_tokens, hidden, gen=gen)
    q, k, v = make_qkv(num_tokens, num_heads, num_kv_heads, head_dim, gen)
    positions = torch.zeros(num_tokens, dtype=torch.int64, device=DEV)
    loc = torch.zeros(num_tokens, dtype=torch.int64, device=DEV)
    gate_up = randn(num_tokens, 2 * inter, gen=gen)

    fused_pool = KVCache(1024, 1, num_kv_heads, head_dim, BF16, DEV)
    q_fused = torch.empty_like(q)

    def step():
        out_plain = norm(x)
        out, res_out = norm(x, residual)
        q_fused.copy_(q)  # (the unrotated q, before the rotary below rotates q in place)
        rotary_store_kv(positions, q_fused, k, v, rope.cos_sin_cache, *fused_pool.get_kv(0), loc)
        rope(positions, q, k)
        pool.set_kv(0, loc, k, v)
        return out_plain, out, res_out, act(gate_up)

    graph, (g_plain, g_out, g_res, g_act) = _capture(step)
    for replay in range(3):
        new = {"x": randn(num_tokens, hidden, gen=gen), "residual": randn(num_tokens, hidden, gen=gen),
                   "gate_up": randn(num_tokens, 2 * inter, gen=gen)}
        q_new, k_new, v_new = make_qkv(num_tokens, num_heads, num_kv_heads, head_dim, gen)
        q_new, k_new, v_new = q_new.clone(), k_new.clone(), v_new.clone()
        pos_new = torch.randint(0, 131072, (num_tokens,), generator=gen, device=DEV)
        loc_new = torch.randperm(1024, generator=gen, device=DEV)[:num_tokens] + 1
        for static, value in ((x, new["x"]), (residual, new["residual"]), (gate_up, new["gate_up"]),
                              (q, q_new), (k, k_new), (v, v_new), (positions, pos_new), (loc, loc_new)):
            static.copy_(value)
        kv_before = pool.k_buffers[0].clone()
        graph.replay()
        torch.cuda.synchronize()

        torch.testing.assert_close(g_plain, norm.forward_native(new["x"]), **LOOSE)
        ref_out, ref_res = norm.forward_native(new["x"], new["residual"])
        torch.testing.assert_close(g_out, ref_out, **LOOSE)
        assert torch.equal(g_res, ref_res)
        torch.testing.assert_close(g_act, act.forward_native(new["gate_up"]), **LOOSE)
        ref_q, ref_k = rope.forward_native(pos_new, q_new, k_new)
        torch.testing.assert_close(q, ref_q, **LOOSE)
        torch.testing.assert_close(k, ref_k, **LOOSE)
        kv_before[loc_new] = k  # the rotated k, written at the new slots
        assert torch.equal(pool.k_buffers[0], kv_before), replay
        assert torch.equal(pool.v_buffers[0][loc_new], v)
        torch.testing.assert_close(q_fused, q, **LOOSE)  # the fused decode rotary + store, in the same graph
        torch.testing.assert_close(fused_pool.k_buffers[0][loc_new], k, **LOOSE)
        assert torch.equal(fused_pool.v_buffers[0][loc_new], v)

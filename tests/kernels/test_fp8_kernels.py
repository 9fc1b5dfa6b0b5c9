"""FP8 Triton kernels against the torch reference (fp8_math.py): per-token-group activation quantization,
the W8A8 block-scaled GEMM, and the attention kernels over an FP8 KV pool with per-layer scales.

Without CUDA they run in Triton's CPU interpreter (tests/triton_mode.py). The interpreter's float32 ->
float8e4nv cast (triton 3.9) is not the hardware's round-to-nearest-even: it rounds ties away from zero
and drops the carry when rounding up crosses a power of two (124.3 becomes 64, not 128). So where a check
compares FP8 codes, the interpreter's may be the other neighbour of the exact value or exactly half the
reference (`fp8_codes_match`); on a GPU every code must equal PyTorch's cast.
"""

from __future__ import annotations

import math

import pytest
import torch

from tests import triton_mode
from tests.triton_mode import DEVICE, in_process

if not triton_mode.RERUN_IN_SUBPROCESS:
    from model_executor.layers.attention.triton_ops import decode_attention as decode_mod
    from model_executor.layers.attention.triton_ops import extend_attention as extend_mod
    from model_executor.layers.quantization import fp8_math as fm
    from model_executor.layers.quantization import fp8_ops

test_in_subprocess = triton_mode.subprocess_test(__file__)
FP8 = torch.float8_e4m3fn


def fp8_codes_match(got: torch.Tensor, ref: torch.Tensor, exact: torch.Tensor) -> None:
    """got: the kernel's FP8 values; ref: PyTorch's cast of `exact` (the unrounded float32 values)."""
    got, ref, exact = got.float().cpu(), ref.float().cpu(), exact.float().cpu()
    differ = got != ref
    if triton_mode.interpreting():  # the interpreter's rounding (module docstring)
        half = got * 2 == ref
        neighbour = (got - exact).abs() <= exact.abs() / 8 + 2**-9  # within one e4m3 step of the exact value
        assert (half | neighbour)[differ].all(), "FP8 codes differ beyond the interpreter's rounding"
        assert differ.float().mean() < 0.1
    else:
        assert not differ.any(), f"{int(differ.sum())} FP8 codes differ from the reference"


@in_process
@pytest.mark.parametrize("group_size,max_one_pass", [
    (128, 16384),  # the block-wise checkpoints' groups
    (768, 16384),  # per token, the row in registers (masked: not a power of two)
    (384, 128),  # groups read twice in chunks (the path of rows wider than MAX_ONE_PASS_BLOCK)
])
def test_per_token_group_quant_matches_reference(group_size, max_one_pass):
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(5, 768, generator=gen) * torch.logspace(-2, 2, 768)).to(DEVICE, torch.bfloat16)
    x[3] = 0  # an all-zero row gets a tiny scale, not NaN
    q, s = fp8_ops._per_token_group_quant_impl(x, group_size, max_one_pass)
    q_ref, s_ref = fm.quantize_fp8_per_token_group(x.float(), group_size)
    assert q.dtype == FP8 and s.shape == (5, 768 // group_size)
    torch.testing.assert_close(s.cpu(), s_ref, rtol=0, atol=0)
    exact = (x.float().cpu().reshape(5, -1, group_size) / s_ref[..., None]).reshape(5, 768)
    fp8_codes_match(q, q_ref, exact)
    assert torch.isfinite(q.float()).all()


@in_process
@pytest.mark.parametrize("m,n,k,block", [(3, 200, 256, (128, 128)), (40, 96, 192, (64, 64)), (70, 64, 64, (32, 32)),
                                         (20, 300, 128, (256, 128))])  # a weight block spans two N tiles
def test_block_fp8_matmul_matches_reference(m, n, k, block):
    """Same quantized inputs: the kernel's float32 output equals the reference's dequantized product
    (N not a multiple of the block: the last weight tile is partial)."""
    gen = torch.Generator().manual_seed(1)
    w_q, w_s = fm.quantize_fp8_block(torch.randn(n, k, generator=gen), block)
    x_q, x_s = fm.quantize_fp8_per_token_group(torch.randn(m, k, generator=gen), block[1])
    out = fp8_ops.w8a8_block_fp8_matmul(x_q.to(DEVICE), w_q.to(DEVICE), x_s.to(DEVICE), w_s.to(DEVICE), block,
                                        torch.float32)
    ref = fm.dequantize_fp8_per_group(x_q, x_s) @ fm.dequantize_fp8_block(w_q, w_s, block).t()
    torch.testing.assert_close(out.cpu(), ref, rtol=1e-5, atol=1e-4)


def _pool(num_slots, hk, d, gen):
    k = torch.randn(num_slots + 1, hk, d, generator=gen) * 3
    v = torch.randn(num_slots + 1, hk, d, generator=gen) * 3
    return k, v


def _ref_attention(q, k, v, sm_scale, q_pos):
    """q [n, H, D], k/v [L, Hk, D] float32, causal by q_pos."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = torch.einsum("nhd,lhd->hnl", q, k) * sm_scale
    visible = torch.arange(k.shape[0])[None, :] <= q_pos[:, None]
    scores = scores.masked_fill(~visible[None], float("-inf"))
    return torch.einsum("hnl,lhd->nhd", torch.softmax(scores, -1), v)


def _fp8_pool_and_slots(gen, num_slots, hk, d, k_scale, v_scale, lengths, width):
    """A pool holding K / k_scale and V / v_scale in FP8, and a req_to_token [len(lengths) + 2, width] whose
    rows 1.. hold each request's scattered slots (lengths[i] of them)."""
    k, v = _pool(num_slots, hk, d, gen)
    req_to_token = torch.zeros(len(lengths) + 2, width, dtype=torch.int32)
    perm = torch.randperm(num_slots, generator=gen) + 1
    start = 0
    for row, n in enumerate(lengths, 1):
        req_to_token[row, :n] = perm[start : start + n].int()
        start += n
    return (k / k_scale).to(FP8), (v / v_scale).to(FP8), req_to_token


def _decode(q, k8, v8, req_to_token, seq_lens, splits, k_scale, v_scale, v_words=None):
    """decode_attention_fwd of request b (row b + 1) over the FP8 pool; the float32 output on the CPU."""
    bs, hq, d = q.shape
    logits, lse, counters = decode_mod.alloc_decode_workspace(bs, hq, d, splits, DEVICE)
    o = torch.empty(bs, hq, d, device=DEVICE)
    decode_mod.decode_attention_fwd(q.to(DEVICE), k8.to(DEVICE), v8.to(DEVICE), o, req_to_token.to(DEVICE),
                                    torch.arange(1, bs + 1, device=DEVICE), torch.tensor(seq_lens, device=DEVICE),
                                    logits, lse, splits, 1 / math.sqrt(d), k_scale=k_scale, v_scale=v_scale,
                                    counters=counters, v_words=v_words)
    return o.cpu()


def _decode_refs(q, k8, v8, req_to_token, seq_lens, k_scale, v_scale):
    """Per request, the reference over the dequantized pool, in q's dtype."""
    refs = []
    for b, n in enumerate(seq_lens):
        slots = req_to_token[b + 1, :n].long()
        refs.append(_ref_attention(q[b : b + 1], k8[slots].to(q.dtype) * k_scale, v8[slots].to(q.dtype) * v_scale,
                                   1 / math.sqrt(q.shape[-1]), torch.tensor([n - 1])))
    return refs


def _extend(q, k_new, v_new, k8, v8, req_to_token, prefix, k_scale, v_scale):
    """extend_attention_fwd of one request (row 1: prefix cached tokens, then q's) over the FP8 pool (on the
    device; the new tokens' K / V are stored into it); the float32 output on the CPU."""
    new, hq, d = q.shape
    o = torch.empty(new, hq, d, device=DEVICE)
    loc = req_to_token[1, prefix : prefix + new].long()
    t = lambda *xs: torch.tensor(xs, device=DEVICE)
    extend_mod.extend_attention_fwd(q.to(DEVICE), k_new.to(DEVICE), v_new.to(DEVICE), o, k8, v8, loc.to(DEVICE),
                                    req_to_token.to(DEVICE), t(1), t(prefix + new), t(new), t(0), new,
                                    1 / math.sqrt(d), config=extend_mod.ExtendConfig(16, 16, 4, 1),
                                    k_scale=k_scale, v_scale=v_scale)
    return o.cpu()


def _extend_ref(q, k_new, v_new, k8, v8, req_to_token, prefix, k_scale, v_scale):
    """The reference over the dequantized prefix and the new tokens as given, in q's dtype."""
    new = q.shape[0]
    pre = req_to_token[1, :prefix].long()
    keys = torch.cat([k8[pre].cpu().to(q.dtype) * k_scale, k_new.to(q.dtype)])
    values = torch.cat([v8[pre].cpu().to(q.dtype) * v_scale, v_new.to(q.dtype)])
    return _ref_attention(q, keys, values, 1 / math.sqrt(q.shape[-1]), torch.arange(prefix, prefix + new))


@in_process
def test_decode_over_fp8_pool_with_scales():
    """The pool holds K / k_scale and V / v_scale in FP8; attention equals the reference over the
    dequantized pool (the scales must be applied exactly once, K's inside the softmax, V's outside)."""
    gen = torch.Generator().manual_seed(2)
    hq, hk, d, num_slots, k_scale, v_scale, seq_lens = 4, 2, 64, 80, 0.5, 2.0, [30, 45]
    k8, v8, req_to_token = _fp8_pool_and_slots(gen, num_slots, hk, d, k_scale, v_scale, seq_lens, 64)
    q = torch.randn(2, hq, d, generator=gen)
    o = _decode(q, k8, v8, req_to_token, seq_lens, 2, k_scale, v_scale)
    for b, ref in enumerate(_decode_refs(q, k8, v8, req_to_token, seq_lens, k_scale, v_scale)):
        torch.testing.assert_close(o[b : b + 1], ref, rtol=1e-4, atol=1e-4)


@in_process
@pytest.mark.parametrize("q_scale", [1.0, 300.0])
def test_decode_over_fp8_pool_with_bf16_queries_runs_fp16_dots(q_scale):
    """bf16 queries over an FP8 pool: stage 1's dots run in fp16 (q scaled by Q_PRESCALE, taken back out in
    the softmax scale), one and two stages, large q included, V loaded as bytes and as 32-bit words: a float32
    output within fp16's rounding of the probabilities of a float64 reference (measured 2.8e-4 in the
    interpreter, whose bf16 dots are wrong), the same values from both loads."""
    assert decode_mod.kv_dots_in_fp16(torch.bfloat16, FP8) and not decode_mod.kv_dots_in_fp16(torch.float32, FP8)
    assert not decode_mod.kv_dots_in_fp16(torch.bfloat16, torch.bfloat16)
    gen = torch.Generator().manual_seed(4)
    hq, hk, d, num_slots, k_scale, v_scale, seq_lens = 8, 2, 64, 160, 0.5, 2.0, [40, 90]
    k8, v8, req_to_token = _fp8_pool_and_slots(gen, num_slots, hk, d, k_scale, v_scale, seq_lens, 96)
    q = (torch.randn(2, hq, d, generator=gen) * q_scale / math.sqrt(d)).bfloat16()
    refs = _decode_refs(q.double(), k8, v8, req_to_token, seq_lens, k_scale, v_scale)
    for splits in (1, 2):
        o = _decode(q, k8, v8, req_to_token, seq_lens, splits, k_scale, v_scale, v_words=True)
        for b, ref in enumerate(refs):
            torch.testing.assert_close(o[b : b + 1].double(), ref, rtol=1e-3, atol=1e-3)
        torch.testing.assert_close(_decode(q, k8, v8, req_to_token, seq_lens, splits, k_scale, v_scale, v_words=False),
                                   o, rtol=0, atol=0)


@in_process
def test_extend_over_fp8_pool_with_scales():
    """Extend reads the cached prefix from the FP8 pool (scaled back), attends the new tokens unquantized,
    and stores them as K / k_scale, V / v_scale in FP8."""
    gen = torch.Generator().manual_seed(3)
    hq, hk, d, num_slots, k_scale, v_scale, prefix, new = 4, 2, 64, 64, 0.25, 4.0, 20, 12
    k8, v8, req_to_token = _fp8_pool_and_slots(gen, num_slots, hk, d, k_scale, v_scale, [prefix + new], 64)
    k8, v8 = k8.to(DEVICE), v8.to(DEVICE)
    loc = req_to_token[1, prefix : prefix + new].long()
    k_new, v_new = torch.randn(new, hk, d, generator=gen), torch.randn(new, hk, d, generator=gen)
    q = torch.randn(new, hq, d, generator=gen)
    o = _extend(q, k_new, v_new, k8, v8, req_to_token, prefix, k_scale, v_scale)
    fp8_codes_match(k8[loc], (k_new / k_scale).to(FP8), k_new / k_scale)
    fp8_codes_match(v8[loc], (v_new / v_scale).to(FP8), v_new / v_scale)
    ref = _extend_ref(q, k_new, v_new, k8, v8, req_to_token, prefix, k_scale, v_scale)
    torch.testing.assert_close(o, ref, rtol=1e-4, atol=1e-4)


@in_process
def test_extend_over_fp8_pool_with_fp16_queries_runs_fp16_dots_on_the_prefix():
    """fp16 queries (the interpreter's bf16 dots are wrong; bf16 takes the same path on the GPU): the FP8
    prefix's dots run in fp16 with q scaled by Q_PRESCALE (taken back out in the scale), the new tokens' in
    q's dtype; a float32 output within fp16's rounding of a float64 reference."""
    gen = torch.Generator().manual_seed(5)
    hq, hk, d, num_slots, k_scale, v_scale, prefix, new = 4, 2, 64, 96, 0.25, 4.0, 60, 12
    k8, v8, req_to_token = _fp8_pool_and_slots(gen, num_slots, hk, d, k_scale, v_scale, [prefix + new], 96)
    k8, v8 = k8.to(DEVICE), v8.to(DEVICE)
    k_new, v_new = (torch.randn(new, hk, d, generator=gen).half() for _ in range(2))
    q = (torch.randn(new, hq, d, generator=gen) / math.sqrt(d)).half()
    o = _extend(q, k_new, v_new, k8, v8, req_to_token, prefix, k_scale, v_scale)
    ref = _extend_ref(q.double(), k_new, v_new, k8, v8, req_to_token, prefix, k_scale, v_scale)
    torch.testing.assert_close(o.double(), ref, rtol=1e-3, atol=1e-3)

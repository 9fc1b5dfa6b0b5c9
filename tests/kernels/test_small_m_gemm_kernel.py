"""The small-M GEMM kernel (triton_ops/small_m_gemm.py) at explicit configs: against a float32 reference of the
dequantized weight, its split-K determinism, its refusals, and each fusion (SiLU-and-mul, RMSNorm, rotary + KV
store, residual add + RMSNorm epilogue, pre-normed rows, preloaded tiles) against the unfused kernels.

Without CUDA the kernel runs in Triton's CPU interpreter (tests/triton_mode.py); shapes are tiny and not
multiples of the blocks (masked K tails, partial column tiles, padding rows).
"""

from __future__ import annotations

import pytest
import torch

from tests import triton_mode
from tests.small_m_helpers import (
    FP8,
    GEMV,
    GEMV_SPLIT,
    NO_SPLIT,
    SPLIT,
    assert_matches_reference,
    make_weight,
    reference,
    rmsnorm_reference,
    run,
)
from tests.triton_mode import DEVICE, in_process, interpreter_only

if not triton_mode.RERUN_IN_SUBPROCESS:
    from model_executor.layers.quantization import fp8_math as fm
    from model_executor.layers.triton_ops import small_m_gemm as sm
test_in_subprocess = triton_mode.subprocess_test(__file__)


@in_process
@pytest.mark.parametrize("kind", ["bf16", "fp8", "fp8_block"])
@pytest.mark.parametrize("m,n,k,bias,cfg", [
    (1, 40, 160, False, NO_SPLIT),  # K tail inside the one split, a partial column tile
    (7, 72, 200, True, SPLIT),  # odd M; K not a multiple of BLOCK_K: the last split is short
    (16, 33, 96, False, SPLIT),  # the full row limit; N not a multiple of the scale block
    (3, 64, 128, True, NO_SPLIT),  # even shapes: the unmasked K loop
    (1, 40, 160, True, GEMV),  # one row without tl.dot
    (1, 70, 200, False, GEMV_SPLIT),
    (2, 40, 160, True, GEMV),  # several rows without tl.dot: the weight tile shared, a sum per row
    (3, 70, 200, False, GEMV_SPLIT),  # (3 rows of a 4-row tile: the fourth never stored)
    (4, 33, 128, True, GEMV),  # the GEMV's row limit; the unmasked K loop
])
def test_kernel_matches_float32_reference(kind, m, n, k, bias, cfg):
    w, s, block, w_deq = make_weight(kind, n, k, seed=m + n)
    gen = torch.Generator().manual_seed(k)
    x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
    b = torch.randn(n, generator=gen).to(torch.bfloat16) if bias else None
    # x as the first K columns of wider rows of NaN: a read past K (or a wrong row stride) poisons the output
    wide = torch.full((m, k + 40), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    wide[:, :k] = x.to(DEVICE)
    dev = lambda t: None if t is None else t.to(DEVICE)
    out = sm.small_m_linear(wide[:, :k], dev(w), dev(s), dev(b), block, config=sm.GemmConfig(**cfg)).cpu()
    assert out.shape == (m, n)
    assert_matches_reference(out, reference(x, w_deq, b), torch.bfloat16)


@in_process
@pytest.mark.parametrize("kind", ["fp16", "fp8"])
def test_fp16_activations(kind):
    w, s, block, w_deq = make_weight("fp8" if kind == "fp8" else "bf16", 48, 96, seed=3, dtype=torch.float16)
    x = torch.randn(5, 96, generator=torch.Generator().manual_seed(4)).to(torch.float16)
    assert_matches_reference(run(x, w, s, None, block, SPLIT), reference(x, w_deq, None), torch.float16)


@in_process
@pytest.mark.parametrize("kind", ["fp8", "fp8_block"])
def test_fp8_weights_keep_bf16_range_of_x(kind):
    """FP8 weights run the dot in fp16: bf16 activations far outside fp16's range (large and tiny) still
    give the float32 reference's result (x is rescaled by a power of two, not clipped or flushed)."""
    w, s, block, w_deq = make_weight(kind, 40, 128, seed=11)
    x = torch.randn(4, 128, generator=torch.Generator().manual_seed(12))
    x[:, ::9] *= 3e5  # past fp16's max
    x[:, 1::9] *= 1e-6  # fp16 subnormals
    x = x.to(torch.bfloat16)
    out = run(x, w, s, None, block, SPLIT)
    assert torch.isfinite(out).all()
    assert_matches_reference(out, reference(x, w_deq, None), torch.bfloat16)


@in_process
@pytest.mark.parametrize("kind", ["fp8", "fp8_block"])
@pytest.mark.parametrize("m", [24, 64])
def test_fp8_weights_above_16_rows(kind, m):
    """FP8 weights take up to 64 rows (the dot padded to 32 or 64): the float32 reference's result, and rows
    padded within their bucket (as a decode graph pads a batch) compute the same bits as the batch alone."""
    w, s, block, w_deq = make_weight(kind, 72, 192, seed=m)
    x = torch.randn(m, 192, generator=torch.Generator().manual_seed(m + 1)).to(torch.bfloat16)
    b = torch.randn(72, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    out = run(x, w, s, b, block, SPLIT)
    assert_matches_reference(out, reference(x, w_deq, b), torch.bfloat16)
    fewer = m // 2 + 1  # the same bucket (17 of 32, 33 of 64): the same padded dot
    assert torch.equal(run(x[:fewer], w, s, b, block, SPLIT), out[:fewer])


@in_process
@pytest.mark.parametrize("m,cfg", [(3, SPLIT), (24, NO_SPLIT), (64, SPLIT)])
def test_fp8_activations_on_fp8_tensor_cores(m, cfg):
    """X_FP8: x quantized per token, the dot on FP8 operands, y = (xq * xs) @ (wq * ws)^T + bias: the W8A8
    GEMM's math (its float32 reference of the same codes)."""
    from model_executor.layers.quantization import fp8_ops

    w, s, _, w_deq = make_weight("fp8", 72, 192, seed=m)
    x = torch.randn(m, 192, generator=torch.Generator().manual_seed(m)).to(DEVICE, torch.bfloat16)
    xq, xs = fp8_ops.per_token_group_quant_fp8(x, 192)
    b = torch.randn(72, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    dev = lambda t: t.to(DEVICE)
    out = sm.small_m_linear_fp8_act(xq, xs, dev(w), dev(s), dev(b), torch.bfloat16,
                                    sm.GemmConfig(**cfg, X_FP8=True)).cpu()
    assert out.shape == (m, 72) and out.dtype == torch.bfloat16
    assert_matches_reference(out, reference(xq.float().cpu() * xs.cpu(), w_deq, b), torch.bfloat16)
    with pytest.raises(ValueError, match="X_FP8 config"):  # a weight-only config with FP8 rows
        sm.small_m_linear_fp8_act(xq, xs, dev(w), dev(s), None, torch.bfloat16, sm.GemmConfig(**cfg))


@in_process
@pytest.mark.parametrize("m,cfg", [(3, SPLIT), (24, NO_SPLIT), (64, SPLIT)])
def test_fp8_activations_with_block_scales(m, cfg):
    """X_FP8 with block-scaled weights (32 x 32 blocks here): x quantized per 1 x 32 group, each K step's dot
    scaled by its weight-scale column and its x-scale column: the float32 reference of the same codes, both
    scaled per block. A K step wider than the scale block is narrowed to it (BLOCK_K 64 -> 32)."""
    from model_executor.layers.quantization import fp8_ops

    w, s, block, w_deq = make_weight("fp8_block", 72, 192, seed=m)
    x = torch.randn(m, 192, generator=torch.Generator().manual_seed(m)).to(DEVICE, torch.bfloat16)
    xq, xs = fp8_ops.per_token_group_quant_fp8(x, block[1])
    assert xs.shape == (m, 192 // block[1])
    x_deq = xq.float().cpu() * xs.cpu().repeat_interleave(block[1], dim=1)
    b = torch.randn(72, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    dev = lambda t: t.to(DEVICE)
    out = sm.small_m_linear_fp8_act(xq, xs, dev(w), dev(s), dev(b), torch.bfloat16,
                                    sm.GemmConfig(**cfg, X_FP8=True), block).cpu()
    assert out.shape == (m, 72) and out.dtype == torch.bfloat16
    assert_matches_reference(out, reference(x_deq, w_deq, b), torch.bfloat16)
    with pytest.raises(ValueError, match="FP8 activations need float32 scales"):  # per-row scales with blocks
        sm.small_m_linear_fp8_act(xq, xs[:, :1].contiguous(), dev(w), dev(s), None, torch.bfloat16,
                                  sm.GemmConfig(**cfg, X_FP8=True), block)


@in_process
def test_split_k_is_deterministic_and_each_split_count_is_right():
    """Two runs give the same bits; split counts 1 and 4 both match the reference (their bits may differ:
    fp32 sums in another order)."""
    w, s, block, w_deq = make_weight("fp8_block", 64, 256, seed=5)
    x = torch.randn(9, 256, generator=torch.Generator().manual_seed(6)).to(torch.bfloat16)
    b = torch.randn(64, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16)
    ref = reference(x, w_deq, b)
    for split in (1, 4):
        cfg = {"BLOCK_N": 16, "BLOCK_K": 32, "SPLIT_K": split, "num_stages": 2}
        first, second = run(x, w, s, b, block, cfg), run(x, w, s, b, block, cfg)
        assert torch.equal(first, second)
        assert_matches_reference(first, ref, torch.bfloat16)


@in_process
@pytest.mark.parametrize("m,kind,cfg", [(5, "bf16", {"BLOCK_N": 16, "BLOCK_K": 32, "SPLIT_K": 4, "num_stages": 2}),
                                         (3, "fp8", {"BLOCK_N": 8, "BLOCK_K": 32, "SPLIT_K": 4, "GEMV": True}),
                                         (16, "fp8", {"BLOCK_N": 16, "BLOCK_K": 32, "SPLIT_K": 4, "X_FP8": True}),
                                         (20, "fp8", {"BLOCK_N": 16, "BLOCK_K": 32, "SPLIT_K": 4, "X_FP8": True})])
def test_split_k_adds_the_partials_in_split_order_and_leaves_its_counters_zero(m, kind, cfg):
    """Split K's reduce (up to 16 rows in the GEMM: the last split of a column tile to arrive adds them; above,
    a second kernel) gives exactly the fp32 partials of each K range, as the kernel computes them in one
    split, added in split order 0, 1, .. and then the bias (float32 out, so that no rounding hides the
    order); the arrival counters are zeros after each call, so a second call gives the same bits."""
    assert (m <= sm.IN_KERNEL_REDUCE_MAX_ROWS) == (m < 20)  # both reduces
    n, k, k_per_split = 48, 256, 64
    w, s, _, _ = make_weight(kind, n, k, seed=11)
    gen = torch.Generator().manual_seed(12)
    x, bias = torch.randn(m, k, generator=gen).to(torch.bfloat16), torch.randn(n, generator=gen).to(torch.bfloat16)
    x_scale = None
    if cfg.get("X_FP8"):
        x, x_scale = fm.quantize_fp8_per_token(x.float())
        x_scale = x_scale.reshape(-1).to(DEVICE)
    dev = lambda t: None if t is None else t.to(DEVICE)
    split = sm._launch(dev(x), dev(w), dev(s), dev(bias), None, sm.GemmConfig(**cfg), x_scale=x_scale,
                       out_dtype=torch.float32)
    assert not sm.split_counters(split.device).any()
    one = sm.GemmConfig(**{**cfg, "SPLIT_K": 1})
    total = torch.zeros(m, n)
    for lo in range(0, k, k_per_split):
        total += sm._launch(dev(x[:, lo:lo + k_per_split]), dev(w[:, lo:lo + k_per_split]), dev(s), None, None, one,
                            x_scale=x_scale, out_dtype=torch.float32).cpu()
    assert torch.equal(split.cpu(), total + bias.float())
    again = sm._launch(dev(x), dev(w), dev(s), dev(bias), None, sm.GemmConfig(**cfg), x_scale=x_scale,
                       out_dtype=torch.float32)
    assert torch.equal(again, split)


@in_process
def test_split_k_with_more_tiles_than_counters_reduces_in_the_second_kernel(monkeypatch):
    """A split-K launch with more column tiles than the device has arrival counters leaves its reduce to the
    second kernel (the same bits); within the counters, up to 16 rows, there is no second launch."""
    w, s, block, _ = make_weight("bf16", 48, 256, seed=13)
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(14)).to(torch.bfloat16)
    cfg = {"BLOCK_N": 16, "BLOCK_K": 32, "SPLIT_K": 4, "num_stages": 2}  # 3 column tiles
    launches, reduce_kernel = [], sm._split_k_reduce_kernel

    class Spy:
        def __getitem__(self, grid):
            launches.append(grid)
            return reduce_kernel[grid]

    monkeypatch.setattr(sm, "_split_k_reduce_kernel", Spy())
    in_kernel = run(x, w, s, None, block, cfg)
    assert not launches
    monkeypatch.setattr(sm, "MAX_SPLIT_TILES", 2)
    assert torch.equal(run(x, w, s, None, block, cfg), in_kernel)
    assert len(launches) == 1


@in_process
def test_refuses_bad_inputs():
    x = torch.zeros(17, 64, dtype=torch.bfloat16, device=DEVICE)
    w = torch.zeros(32, 64, dtype=torch.bfloat16, device=DEVICE)
    with pytest.raises(ValueError, match="at most 16 rows"):
        sm.small_m_linear(x, w, config=sm.GemmConfig(**NO_SPLIT))
    with pytest.raises(ValueError, match="at most 64 rows"):
        sm.small_m_linear(torch.zeros(65, 64, dtype=torch.bfloat16, device=DEVICE), w.to(FP8),
                          torch.ones(32, device=DEVICE), config=sm.GemmConfig(**NO_SPLIT))
    with pytest.raises(ValueError, match="does not match"):
        sm.small_m_linear(x[:4, :48], w, config=sm.GemmConfig(**NO_SPLIT))
    q = w.to(FP8)
    with pytest.raises(ValueError, match="float32 scales"):
        sm.small_m_linear(x[:4], q, config=sm.GemmConfig(**NO_SPLIT))
    with pytest.raises(ValueError, match="block scales must be"):
        sm.small_m_linear(x[:4], q, torch.ones(1, 1, device=DEVICE), block=(32, 32), config=sm.GemmConfig(**NO_SPLIT))
    with pytest.raises(ValueError, match="power of two"):
        sm.GemmConfig(BLOCK_N=24, BLOCK_K=64)
    with pytest.raises(ValueError, match="power of two >= 16"):
        sm.GemmConfig(BLOCK_N=8, BLOCK_K=64)  # tl.dot's minimum, unless GEMV
    with pytest.raises(ValueError, match="GEMV config runs at most 4 rows"):
        sm.small_m_linear(x[:5], w, config=sm.GemmConfig(**GEMV))


@in_process
def test_custom_op_traces_under_torch_compile():
    """The registered op: dynamo traces through it (fullgraph); the compiled call returns the eager bits."""
    w, s, block, _ = make_weight("fp8_block", 40, 64, seed=8)
    w, s = w.to(DEVICE), s.to(DEVICE)
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(9)).to(DEVICE, torch.bfloat16)
    offset = torch.arange(40, dtype=torch.bfloat16, device=DEVICE)  # broadcasts only over a [M, N] output
    fn = torch.compile(lambda x: sm.small_m_linear(x, w, s, None, block) + offset, fullgraph=True,
                       backend="eager")
    torch._dynamo.reset()
    try:
        assert torch.equal(fn(x), sm.small_m_linear(x, w, s, None, block) + offset)
    finally:
        torch._dynamo.reset()


# One-row GEMVs with something fused in: a K tail (144 = 2 x 64 + 16: a masked last step; block FP8 steps
# by its 32-wide scale blocks, so 4 1/2 steps) and an even K.
FUSED_GEMV_CASES = [(144, {"BLOCK_N": 4, "BLOCK_K": 64, "GEMV": True}),
                    (128, {"BLOCK_N": 8, "BLOCK_K": 32, "GEMV": True})]


# ... and a single-split tl.dot tile (16 gate and 16 up rows a program), which runs the epilogue fusions and
# takes pre-normed rows too (the RMSNorm inside the K loop is the GEMV's alone)
FUSED_CASES = [*FUSED_GEMV_CASES, (144, {"BLOCK_N": 16, "BLOCK_K": 32}),
               (144, {"BLOCK_N": 16, "BLOCK_K": 32, "PAIR_DOT": True})]  # (paired: one dot over both blocks)


# (k, cfg, m): each at one and three rows, the tl.dot tile also at 13 (a batch of the 16-row bucket: the fusions
# take a tl.dot tile up to its 16 padded rows, a GEMV up to 4)
FUSED_ROW_CASES = [(k, cfg, m) for k, cfg in FUSED_CASES for m in (1, 3) + (() if cfg.get("GEMV") else (13,))]


@in_process
@pytest.mark.parametrize("kind", ["bf16", "fp8", "fp8_block"])
@pytest.mark.parametrize("k,cfg,m", FUSED_ROW_CASES)
def test_fused_silu_and_mul_equals_linear_then_silu_and_mul(kind, k, cfg, m):
    """m rows through a [gate; up] weight: the fused GEMV's silu(gate) * up has the bits of the GEMV with
    half the column tile (the rows each program sums) followed by the SiLU-and-mul kernel. I = 40 is not a
    multiple of the tile, and the up block starts mid scale block for fp8_block (32-row blocks, I = 40)."""
    from model_executor.layers.triton_ops import ops as triton_ops

    inter = 40
    w, s, block, _ = make_weight(kind, 2 * inter, k, seed=k)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    dev = lambda t: None if t is None else t.to(DEVICE)
    # (a fused program sums BLOCK_N gate rows and BLOCK_N up rows, each as the plain GEMV's program does)
    fused = sm.small_m_silu_and_mul(dev(x), dev(w), dev(s), block, config=sm.GemmConfig(**cfg))
    gate_up = sm.small_m_linear(dev(x), dev(w), dev(s), None, block, config=sm.GemmConfig(**cfg))
    assert fused.shape == (m, inter)
    want = triton_ops.silu_and_mul(gate_up).cpu()
    if cfg.get("PAIR_DOT") and not triton_mode.interpreting():  # (compiled, its one dot may be another MMA)
        torch.testing.assert_close(fused.float().cpu(), want.float(), rtol=2.0**-7, atol=0)
        assert (fused.cpu() != want).float().mean().item() < 0.02
    else:
        assert torch.equal(fused.cpu(), want)


@in_process
@pytest.mark.parametrize("kind", ["bf16", "fp8", "fp8_block"])
@pytest.mark.parametrize("k,cfg", FUSED_GEMV_CASES)
@pytest.mark.parametrize("with_residual", [True, False])
@pytest.mark.parametrize("m", [1, 3])
def test_fused_rmsnorm_linear_matches_reference(kind, k, cfg, with_residual, m):
    """One or three rows: RMSNorm(x + residual) folded into the GEMV gives the float32 reference of the
    dequantized weight from the kernel's h within one rounding, and h = x + residual with torch's bits. x is
    scaled so 1 / rms is far from 1 (and differs per row), the norm weight is not all ones, and N = 40 is not
    a multiple of the tile."""
    n = 40
    w, s, block, w_deq = make_weight(kind, n, k, seed=k + n)
    gen = torch.Generator().manual_seed(7)
    x = (torch.randn(m, k, generator=gen) * torch.tensor([5.0, 0.3, 40.0][:m])[:, None]).to(torch.bfloat16)
    residual = (torch.randn(m, k, generator=gen) * 3).to(torch.bfloat16) if with_residual else None
    g = (torch.rand(k, generator=gen) + 0.5).to(torch.bfloat16)
    bias = torch.randn(n, generator=gen).to(torch.bfloat16)
    eps = 1e-5
    dev = lambda t: None if t is None else t.to(DEVICE)
    y, h = sm.small_m_rmsnorm_linear(dev(x), dev(g), eps, dev(residual), dev(w), dev(s), dev(bias), block,
                                     config=sm.GemmConfig(**cfg))
    h_ref = x if residual is None else x + residual
    if triton_mode.interpreting():  # (the interpreter truncates float32 -> bfloat16: within an ulp)
        torch.testing.assert_close(h.float().cpu(), h_ref.float(), rtol=2.0**-7, atol=0)
    else:
        assert torch.equal(h.cpu(), h_ref)
    # (from the kernel's h: the GEMV's input)
    assert_matches_reference(y.cpu(), reference(rmsnorm_reference(h.cpu(), g, eps), w_deq, bias), torch.bfloat16)


@in_process
@pytest.mark.parametrize("kind", ["bf16", "fp8", "fp8_block"])
@pytest.mark.parametrize("head_dim,cfg", [(16, {"BLOCK_N": 4, "BLOCK_K": 64, "GEMV": True}),  # a K tail
                                          (24, {"BLOCK_N": 8, "BLOCK_K": 32, "GEMV": True})])  # straddling
@pytest.mark.parametrize("pool", ["bf16", "fp8"])
@pytest.mark.parametrize("m", [1, 3])
def test_fused_qkv_rope_store_equals_gemv_then_rotary_store_kv(kind, head_dim, cfg, pool, m):
    """One or three decode tokens: the input norm, the qkv GEMV, the rotary and the KV store in one kernel
    have the bits of the norm + GEMV kernel with the same per-program rows followed by the rotary_store_kv
    kernel: y with its q heads rotated, and the k (rotated) and v written into the pool at each token's slot
    (an FP8 pool divided by its scales). Heads of 24 rows put programs of 8 half rows across two heads; the
    last program runs past the 8 heads; K = 144 ends mid-step; there is a bias (Qwen2's qkv has one)."""
    from model_executor.layers.rotary import RotaryEmbedding
    from model_executor.layers.rotary_store_kv import rotary_store_kv

    hq, hkv, k = 4, 2, 144 if head_dim == 16 else 96
    n = (hq + 2 * hkv) * head_dim
    w, s, block, _ = make_weight(kind, n, k, seed=head_dim)
    gen = torch.Generator().manual_seed(11)
    x, residual = (torch.randn(2 * m, k, generator=gen) * 2).to(torch.bfloat16).chunk(2)
    g = (torch.rand(k, generator=gen) + 0.5).to(torch.bfloat16)
    bias = torch.randn(n, generator=gen).to(torch.bfloat16)
    cache = RotaryEmbedding(head_dim, 64, 10000.0).cos_sin_cache
    positions, loc = torch.tensor([37, 2, 60][:m]), torch.tensor([5, 1, 6][:m])
    pool_dtype, (k_scale, v_scale) = (torch.bfloat16, (1.0, 1.0)) if pool == "bf16" else (FP8, (2.0, 0.5))
    pools = [torch.zeros(8, hkv, head_dim, dtype=pool_dtype, device=DEVICE) for _ in range(4)]
    dev = lambda t: None if t is None else t.to(DEVICE)
    rope = sm.RopeStore(dev(positions), dev(cache), dev(loc), pools[0], pools[1], hq, hkv, k_scale, v_scale)
    cfg = sm.GemmConfig(**cfg)
    y, h = sm.small_m_rmsnorm_linear(dev(x), dev(g), 1e-5, dev(residual), dev(w), dev(s), dev(bias), block,
                                     rope=rope, config=cfg)
    ref, h_ref = sm.small_m_rmsnorm_linear(dev(x), dev(g), 1e-5, dev(residual), dev(w), dev(s), dev(bias), block,
                                           config=cfg)
    q_ref, k_ref, v_ref = ref.view(m, -1, head_dim).split([hq, hkv, hkv], dim=1)
    rotary_store_kv(dev(positions), q_ref, k_ref, v_ref, dev(cache), pools[2], pools[3], dev(loc), k_scale, v_scale)
    assert y.shape == (m, n) and torch.equal(h, h_ref)
    assert torch.equal(y.cpu(), ref.cpu())  # q rotated; k and v as the linear gives them
    assert torch.equal(pools[0].float().cpu(), pools[2].float().cpu())
    assert torch.equal(pools[1].float().cpu(), pools[3].float().cpu())
    written = torch.zeros(8, dtype=torch.bool)
    written[loc] = True
    for buf in pools[:2]:  # the tokens' slots written, and only they
        per_slot = buf.float().abs().sum((1, 2)).cpu()
        assert (per_slot[written] > 0).all() and (per_slot[~written] == 0).all()


@interpreter_only
def test_fused_qkv_rope_store_refusals():
    x = torch.zeros(1, 64, dtype=torch.bfloat16)
    g = torch.ones(64, dtype=torch.bfloat16)
    w = torch.zeros(8 * 16, 64, dtype=torch.bfloat16)  # 4 + 2 x 2 heads of 16
    cache = torch.zeros(32, 16)
    pool = torch.zeros(4, 2, 16, dtype=torch.bfloat16)
    rope = sm.RopeStore(torch.tensor([1]), cache, torch.tensor([0]), pool, pool.clone(), 4, 2)
    gemv = sm.GemmConfig(4, 64, GEMV=True)
    assert sm.small_m_rmsnorm_linear(x, g, 1e-6, None, w, rope=rope, config=gemv) is not None
    with pytest.raises(ValueError, match="single-split"):
        sm.small_m_rmsnorm_linear(x, g, 1e-6, None, w, rope=rope, config=sm.GemmConfig(4, 32, SPLIT_K=2, GEMV=True))
    with pytest.raises(ValueError, match="a qkv weight of 8 heads of 16 rows"):
        sm.small_m_rmsnorm_linear(x, g, 1e-6, None, w[:112], rope=rope, config=gemv)
    with pytest.raises(ValueError, match="pool buffers must be"):
        sm.small_m_rmsnorm_linear(x, g, 1e-6, None, w, rope=sm.RopeStore(
            torch.tensor([1]), cache, torch.tensor([0]), pool[:, :1], pool, 4, 2), config=gemv)
    with pytest.raises(ValueError, match="a position and a slot for each of the 2 tokens"):
        sm.small_m_rmsnorm_linear(torch.zeros(2, 64, dtype=torch.bfloat16), g, 1e-6, None, w, rope=rope, config=gemv)
    with pytest.raises(ValueError, match="at most 4 rows"):
        sm._launch(torch.zeros(5, 64, dtype=torch.bfloat16), w, None, None, None, gemv, silu_mul=True)


O_PROJ_GEMV = {"BLOCK_N": 32, "BLOCK_K": 32, "GEMV": True}  # (N = 144: a partial last column tile)


O_PROJ_DOT = {"BLOCK_N": 32, "BLOCK_K": 32}  # (the epilogue after a single-split tl.dot tile)


def _add_norm_case(kind, k, cfg, seed=0, m=1, o_cfg=O_PROJ_GEMV):
    """m decode rows x [m, 80] through o_proj [k, 80] (+ bias) + residual, RMSNorm (weight g) over its k
    columns, and a [gate; up] weight [80, k]: operands on the device, the fused pair's outputs, and the
    dequantized gate/up weight. Row r's residual is scaled by 1 + 2r: each row has its own 1 / rms."""
    dev = lambda t: None if t is None else t.to(DEVICE)
    w_o, s_o, block, _ = make_weight(kind, k, 80, seed=seed + 1)
    w_gu, s_gu, _, w_gu_deq = make_weight(kind, 80, k, seed=seed + 2)
    gen = torch.Generator().manual_seed(seed + 3)
    x = (torch.randn(m, 80, generator=gen) * 2).to(torch.bfloat16)
    row_scale = 1 + 2 * torch.arange(m, dtype=torch.float32)[:, None]
    residual = (torch.randn(m, k, generator=gen) * 4 * row_scale).to(torch.bfloat16)
    g = (torch.rand(k, generator=gen) + 0.5).to(torch.bfloat16)
    bias = torch.randn(k, generator=gen).to(torch.bfloat16)
    ops = {"x": dev(x), "w_o": dev(w_o), "s_o": dev(s_o), "bias": dev(bias), "block": block,
           "residual": dev(residual), "g": dev(g), "w_gu": dev(w_gu), "s_gu": dev(s_gu)}
    row, h = sm.small_m_linear_add_rmsnorm(ops["x"], ops["w_o"], ops["s_o"], ops["bias"], block, ops["residual"],
                                           ops["g"], 1e-5, config=sm.GemmConfig(**o_cfg))
    act = sm.small_m_silu_and_mul(row, ops["w_gu"], ops["s_gu"], block, config=sm.GemmConfig(**cfg))
    return ops, row, h, act, w_gu_deq


@in_process
@pytest.mark.parametrize("kind", ["bf16", "fp8", "fp8_block"])
@pytest.mark.parametrize("k,cfg,m,o_cfg", [(k, cfg, m, o_cfg) for k, cfg, m in FUSED_ROW_CASES
                                           for o_cfg in (O_PROJ_GEMV, O_PROJ_DOT) if m <= 4 or "GEMV" not in o_cfg])
def test_linear_add_rmsnorm_then_prenormed_silu_and_mul(kind, k, cfg, m, o_cfg):
    """m decode rows: o_proj's GEMV with the residual add and the norm's sums in its epilogue, then the
    [gate; up] GEMV + SiLU-and-mul on those pre-normed rows. h is the plain GEMV's output (same config) plus
    the residual as torch adds them; the weighted rows are g * h; each row's partial sums (one per program,
    the last column tile partial) add up to its sum(h^2); the activation is silu(gate) * up of the float32
    reference of RMSNorm(h) within the roundings of the unfused path (1 / rms is far from 1 and differs by
    row: h's values are ~4, ~12, ~20)."""
    ops, row, h, act, w_gu_deq = _add_norm_case(kind, k, cfg, m=m, o_cfg=o_cfg)
    o = sm.small_m_linear(ops["x"], ops["w_o"], ops["s_o"], ops["bias"], ops["block"],
                          config=sm.GemmConfig(**o_cfg))
    h_ref = (o + ops["residual"]).cpu()
    weighted_ref = (h.float() * ops["g"].float()).to(torch.bfloat16).cpu()
    if triton_mode.interpreting():  # (the interpreter truncates float32 -> bfloat16: within an ulp)
        torch.testing.assert_close(h.float().cpu(), h_ref.float(), rtol=2.0**-7, atol=0)
        torch.testing.assert_close(row.weighted.float().cpu(), weighted_ref.float(), rtol=2.0**-7, atol=0)
    else:
        assert torch.equal(h.cpu(), h_ref) and torch.equal(row.weighted.cpu(), weighted_ref)
    programs = -(-k // o_cfg["BLOCK_N"])
    assert row.partials.shape == (m * programs,) and row.eps == 1e-5
    torch.testing.assert_close(row.partials.view(m, programs).sum(1).cpu(), h.float().pow(2).sum(1).cpu(),
                               rtol=1e-5, atol=0)
    ref = rmsnorm_reference(h.cpu(), ops["g"].cpu(), 1e-5) @ w_gu_deq.t()
    ref = torch.nn.functional.silu(ref[:, :40]) * ref[:, 40:]
    assert act.shape == (m, 40)
    torch.testing.assert_close(act.float().cpu(), ref, rtol=2.0**-5, atol=2.0**-6 * ref.abs().max().item())


PRELOAD_CASES = [({"BLOCK_N": 8, "BLOCK_K": 128, "GEMV": True}, 96),  # all of K in the preloaded step
                 ({"BLOCK_N": 8, "BLOCK_K": 128, "GEMV": True}, 80),  # ... with a K tail (masked)
                 ({"BLOCK_N": 8, "BLOCK_K": 32, "GEMV": True, "num_stages": 2}, 80)]  # the first of three steps


@in_process
@pytest.mark.parametrize("kind", ["bf16", "fp8", "fp8_block"])
@pytest.mark.parametrize("cfg,k", PRELOAD_CASES)
def test_preloaded_first_tile_gives_the_loops_bits(kind, cfg, k):
    """A one-row GEMV whose first weight tile is loaded before anything else (PRELOAD; with PDL on an sm_90 GPU
    the wait for the kernel before comes after that load) takes its first step outside the loop: the same sums
    in the same order, so the same bits as the loop, plain and with the add + RMSNorm epilogue (o_proj's)."""
    dev = lambda t: None if t is None else t.to(DEVICE)
    w, s, block, _ = make_weight(kind, 40, k, seed=11)
    gen = torch.Generator().manual_seed(12)
    x = dev(torch.randn(1, k, generator=gen).to(torch.bfloat16))
    bias = dev(torch.randn(40, generator=gen).to(torch.bfloat16))
    w, s, cfg = dev(w), dev(s), sm.GemmConfig(**cfg)
    plain = sm._launch(x, w, s, bias, block, cfg)
    assert torch.equal(sm._launch(x, w, s, bias, block, cfg, preload=True), plain)
    residual = dev(torch.randn(1, 40, generator=gen).to(torch.bfloat16))
    g = dev((torch.rand(40, generator=gen) + 0.5).to(torch.bfloat16))
    row, h = sm.small_m_linear_add_rmsnorm(x, w, s, bias, block, residual, g, 1e-5, config=cfg)
    row_pdl, h_pdl = sm.small_m_linear_add_rmsnorm(x, w, s, bias, block, residual, g, 1e-5, config=cfg,
                                                   after_attention=True)
    assert torch.equal(h_pdl, h) and torch.equal(row_pdl.weighted, row.weighted)
    assert torch.equal(row_pdl.partials, row.partials)


@interpreter_only
def test_preload_config_loads_all_of_k_where_it_fits():
    """After attention a GEMV is launched with PDL only where all of K fits one preloaded tile (at most 256 bytes
    of weight a thread): Llama-3.1-8B FP8's o_proj (its table config 8 columns x 1024, 4 warps) takes all 4096
    in one step; bf16 at that tile would hold 512 bytes a thread, and block scales keep their steps: None."""
    table_cfg = sm.GemmConfig(8, 1024, num_warps=4, num_stages=3, GEMV=True)
    fp8_w = torch.empty(4096, 4096, dtype=FP8)
    assert sm.preload_config(table_cfg, fp8_w, None) == sm.GemmConfig(8, 4096, num_warps=4, num_stages=1, GEMV=True)
    assert sm.preload_config(table_cfg, torch.empty(4096, 4096, dtype=torch.bfloat16), None) is None
    assert sm.preload_config(table_cfg, fp8_w, (128, 128)) is None
    assert sm.preload_config(sm.GemmConfig(4, 1024, GEMV=True), torch.empty(2048, 2000, dtype=torch.bfloat16),
                             None).BLOCK_K == 2048  # (K rounded up to a power of two: the step masks the tail)


@interpreter_only
def test_preload_refusals():
    """The preloaded first tile (and PDL) goes with a one-row, single-split plain GEMV only."""
    x = torch.randn(1, 64).to(torch.bfloat16)
    w = torch.randn(48, 64).to(torch.bfloat16)
    gemv = sm.GemmConfig(8, 32, GEMV=True)
    for bad in ({"x": torch.randn(2, 64).to(torch.bfloat16)}, {"cfg": sm.GemmConfig(8, 32, SPLIT_K=2, GEMV=True)},
                {"cfg": sm.GemmConfig(16, 32)}, {"silu_mul": True},
                {"norm": sm.RmsNormInput(torch.ones(64, dtype=torch.bfloat16), 1e-6)}):
        args = {"x": x, "cfg": gemv, **bad}
        with pytest.raises(ValueError, match="one-row, single-split plain GEMV"):
            sm._launch(args.pop("x"), w, None, None, None, args.pop("cfg"), pdl=True, **args)


@in_process
@pytest.mark.parametrize("kind", ["bf16", "fp8", "fp8_block"])
@pytest.mark.parametrize("head_dim,cfg,m", [
    (head_dim, cfg, m) for head_dim, cfg in [(16, {"BLOCK_N": 4, "BLOCK_K": 64, "GEMV": True}),
                                             (24, {"BLOCK_N": 8, "BLOCK_K": 32, "GEMV": True}),
                                             (16, {"BLOCK_N": 16, "BLOCK_K": 32}),  # (a tl.dot tile)
                                             (16, {"BLOCK_N": 16, "BLOCK_K": 32, "PAIR_DOT": True})]
    for m in (1, 3) + (() if cfg.get("GEMV") else (13,))])  # (13: the 16-row bucket)
def test_prenormed_qkv_matches_reference_and_its_rope_epilogue(kind, head_dim, cfg, m):
    """The next layer's qkv GEMV on a PrenormedRow of m rows (a down projection's epilogue made it, a GEMV up to
    4 rows and a tl.dot tile above, each row with its own scale): y is the float32 reference of RMSNorm(h) @ W
    within the unfused roundings, and with the rotary epilogue it has the bits of the same GEMV followed by
    rotary_store_kv (as the normed qkv kernel's test checks)."""
    from model_executor.layers.rotary import RotaryEmbedding
    from model_executor.layers.rotary_store_kv import rotary_store_kv

    hq, hkv, k = 4, 2, 144
    n = (hq + 2 * hkv) * head_dim
    dev = lambda t: None if t is None else t.to(DEVICE)
    w_d, s_d, block, _ = make_weight(kind, k, 80, seed=head_dim)  # the down projection: K 80 -> 144
    w, s, _, w_deq = make_weight(kind, n, k, seed=head_dim + 1)
    gen = torch.Generator().manual_seed(13)
    x = torch.randn(m, 80, generator=gen).to(torch.bfloat16)
    residual = (torch.randn(m, k, generator=gen) * 3 * (1 + 2 * torch.arange(m)[:, None])).to(torch.bfloat16)
    g = (torch.rand(k, generator=gen) + 0.5).to(torch.bfloat16)
    row, h = sm.small_m_linear_add_rmsnorm(dev(x), dev(w_d), dev(s_d), None, block, dev(residual), dev(g), 1e-5,
                                           config=sm.GemmConfig(**(O_PROJ_GEMV if m <= 4 else O_PROJ_DOT)))
    cfg = sm.GemmConfig(**cfg)
    y = sm.small_m_prenormed_linear(row, dev(w), dev(s), None, block, config=cfg)
    ref = rmsnorm_reference(h.cpu(), g, 1e-5) @ w_deq.t()
    torch.testing.assert_close(y.float().cpu(), ref, rtol=2.0**-5, atol=2.0**-6 * ref.abs().max().item())
    cache = RotaryEmbedding(head_dim, 64, 10000.0).cos_sin_cache
    positions = torch.tensor([21, 5, 40, 63, 0, 17, 9, 33, 50, 2, 28, 44, 11][:m])
    loc = torch.tensor([3, 7, 0, 12, 15, 1, 9, 4, 14, 6, 10, 2, 13][:m])  # (slots 5, 8 and 11 stay empty)
    pools = [torch.zeros(16, hkv, head_dim, dtype=torch.bfloat16, device=DEVICE) for _ in range(4)]
    rope = sm.RopeStore(dev(positions), dev(cache), dev(loc), pools[0], pools[1], hq, hkv)
    y_rope = sm.small_m_prenormed_linear(row, dev(w), dev(s), None, block, rope=rope, config=cfg)
    q_ref, k_ref, v_ref = y.view(m, -1, head_dim).split([hq, hkv, hkv], dim=1)
    rotary_store_kv(dev(positions), q_ref, k_ref, v_ref, dev(cache), pools[2], pools[3], dev(loc), 1.0, 1.0)
    # (y's q heads rotated in place by rotary_store_kv; compiled, the two kernels' rotations may round one value
    # of ~800 to the other bf16 neighbour: measured at 13 FP8 rows on the H200)
    if triton_mode.interpreting():
        assert torch.equal(y_rope.cpu(), y.cpu())
    else:
        torch.testing.assert_close(y_rope.float(), y.float(), rtol=2.0**-7, atol=0)
        assert (y_rope != y).float().mean().item() < 0.02
    assert torch.equal(pools[0].cpu(), pools[2].cpu()) and torch.equal(pools[1].cpu(), pools[3].cpu())
    assert all(pools[0][slot].float().abs().sum() > 0 for slot in loc.tolist())


@in_process
@pytest.mark.parametrize("kind", ["bf16", "fp8_block"])
@pytest.mark.parametrize("m", [3, 13])
@pytest.mark.parametrize("pair_dot", [False, True])
def test_rope_linear_of_normed_rows_equals_the_linear_then_rotary_store_kv(kind, m, pair_dot):
    """Rows normed by their own kernel (a tl.dot tile cannot run the norm in its K loop) through the qkv GEMM with
    the rotary + KV store epilogue: y with its q heads rotated and the pool's k and v have the bits of the same
    tile's plain GEMM followed by rotary_store_kv (compiled: within a bf16 ulp, the rotation rounded by two
    kernels), with a bias. (A config given explicitly is the paired tile itself: 16 + 16 half rows a program, as
    two dots or, pair_dot, one.)"""
    from model_executor.layers.rotary import RotaryEmbedding
    from model_executor.layers.rotary_store_kv import rotary_store_kv

    hq, hkv, d, k = 4, 2, 16, 96
    n = (hq + 2 * hkv) * d
    w, s, block, _ = make_weight(kind, n, k, seed=m)
    gen = torch.Generator().manual_seed(m)
    dev = lambda t: None if t is None else t.to(DEVICE)
    x = dev(torch.randn(m, k, generator=gen).to(torch.bfloat16))
    bias = dev(torch.randn(n, generator=gen).to(torch.bfloat16))
    cache = dev(RotaryEmbedding(d, 64, 10000.0).cos_sin_cache)
    positions, loc = dev(torch.randperm(64, generator=gen)[:m]), dev(torch.randperm(16, generator=gen)[:m])
    pools = [torch.zeros(16, hkv, d, dtype=torch.bfloat16, device=DEVICE) for _ in range(4)]
    rope = sm.RopeStore(positions, cache, loc, pools[0], pools[1], hq, hkv)
    cfg = sm.GemmConfig(BLOCK_N=16, BLOCK_K=32, PAIR_DOT=pair_dot)
    y = sm.small_m_rope_linear(x, dev(w), rope, dev(s), bias, block, config=cfg)
    ref = sm.small_m_linear(x, dev(w), dev(s), bias, block, config=cfg)
    q, k_, v = ref.view(m, -1, d).split([hq, hkv, hkv], dim=1)
    rotary_store_kv(positions, q, k_, v, cache, pools[2], pools[3], loc)  # (q rotated in place)
    for got, want in ((y, ref), (pools[0], pools[2]), (pools[1], pools[3])):
        if triton_mode.interpreting():
            assert torch.equal(got.cpu(), want.cpu())
        else:
            torch.testing.assert_close(got.float(), want.float(), rtol=2.0**-7, atol=0)
            assert (got != want).float().mean().item() < 0.02
    assert (pools[0][loc].float().abs().sum((1, 2)) > 0).all()


@in_process
@pytest.mark.parametrize("layer", ["o", "down", "gate_up", "qkv"])
def test_the_tuners_fused_calls_run_the_fusion_they_time(layer, monkeypatch):
    """benchmarks/tuning/tune_small_m_gemm's fused_calls at three rows, in the kernel as the layer runs it: o and down
    give (PrenormedRow, h), the row norm weight * h with each row's sums of h^2 in its partials; gate_up its
    SiLU-and-mul's [M, N / 2]; qkv its rotated [M, N]. neighbour_calls run the kernels each replaces."""
    from benchmarks.tuning import tune_small_m_gemm as tune

    monkeypatch.setattr(tune, "DEVICE", DEVICE)
    monkeypatch.setattr(tune, "ROTATE_BYTES", 1)
    torch.manual_seed(0)  # (the tuner's residual and norm weight)
    m, k, n = 3, 64, 128  # (qkv: 2 q heads and a k and a v head of 32 rows)
    fusion = tune.Fusion(layer, (2, 1, 32) if layer == "qkv" else (0, 0, 0))
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(1)).bfloat16().to(DEVICE)
    wts = tune.Weights("bf16", n, k, torch.Generator(device=DEVICE).manual_seed(0))
    cfg = sm.GemmConfig(16 if fusion.paired else 8, 32, GEMV=True)
    calls = tune.fused_calls(sm, fusion, x, wts, cfg)
    assert len(calls) == len(wts.w) >= 2
    out = calls[1]()
    if fusion.paired:
        assert out.shape == (m, n // 2 if layer == "gate_up" else n)
    else:
        row, h = out
        assert h.shape == (m, n) and row.weighted.shape == (m, n)
        torch.testing.assert_close(row.partials.view(m, -1).sum(1), h.float().pow(2).sum(1), rtol=1e-5, atol=1e-5)
        keep = h.float().abs().amin(0) > 1e-2  # (columns where no row's h is near 0: a ratio there is meaningful)
        assert keep.sum() > n // 2
        ratio = row.weighted.float()[:, keep] / h.float()[:, keep]  # the norm weight, a column's, in bf16 roundings
        torch.testing.assert_close(ratio[1:], ratio[:1].expand_as(ratio[1:]), rtol=2.0**-6, atol=0)
    for call in tune.neighbour_calls(fusion, x, n)[:1]:
        call()

"""The small-M GEMM kernel (triton_ops/small_m_gemm.py) against a float32 reference of the dequantized weight,
its split-K determinism, its refusals, the config table lookup, and the linear methods' use of it.

Without CUDA the kernel runs in Triton's CPU interpreter (tests/triton_mode.py); shapes are tiny and not
multiples of the blocks (masked K tails, partial column tiles, padding rows).
"""

from __future__ import annotations

import json

import pytest
import torch

from tests import triton_mode
from tests.triton_mode import DEVICE, in_process, interpreter_only

if not triton_mode.RERUN_IN_SUBPROCESS:
    from model_executor.layers.quantization import base as qbase
    from model_executor.layers.quantization import fp8_math as fm
    from model_executor.layers.triton_ops import small_m_gemm as sm

test_in_subprocess = triton_mode.subprocess_test(__file__)
FP8 = torch.float8_e4m3fn


def make_weight(kind: str, n: int, k: int, seed: int, dtype=torch.bfloat16):
    """(weight as the kernel takes it, scale or None, block or None, the dequantized weight in float32)."""
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.1
    if kind == "fp8":
        q, s = fm.quantize_fp8_per_channel(w)
        return q, s, None, q.float() * s[:, None]
    if kind == "fp8_block":
        block = (32, 32)
        q, s = fm.quantize_fp8_block(w, block)
        return q, s, block, fm.dequantize_fp8_block(q, s, block)
    w = w.to(dtype)
    return w, None, None, w.float()


def reference(x: torch.Tensor, w_deq: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    out = x.float() @ w_deq.t()
    return out + bias.float() if bias is not None else out


def run(x, w, s, bias, block, cfg):
    dev = lambda t: None if t is None else t.to(DEVICE)
    return sm.small_m_linear(dev(x), dev(w), dev(s), dev(bias), block, config=sm.GemmConfig(**cfg)).cpu()


def assert_matches_reference(out, ref, dtype):
    # One rounding to the output dtype: up to an ulp (the interpreter truncates float32 -> bfloat16 where a
    # GPU rounds to nearest), 2^-7 relative for bf16, 2^-10 for fp16; plus float32 summation order.
    rtol = 2.0**-7 if dtype == torch.bfloat16 else 2.0**-10
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), ref, rtol=rtol, atol=1e-4)


# Configs as dicts (GemmConfig(**c)): the module must collect without importing the kernel (triton_mode).
SPLIT = {"BLOCK_N": 16, "BLOCK_K": 32, "SPLIT_K": 3, "num_warps": 4, "num_stages": 2}
NO_SPLIT = {"BLOCK_N": 32, "BLOCK_K": 64, "SPLIT_K": 1, "num_warps": 4, "num_stages": 2}
GEMV = {"BLOCK_N": 8, "BLOCK_K": 32, "SPLIT_K": 1, "GEMV": True}
GEMV_SPLIT = {"BLOCK_N": 4, "BLOCK_K": 32, "SPLIT_K": 3, "GEMV": True}


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


@pytest.fixture
def table(tmp_path, monkeypatch):
    """write(dict) puts a config table for this device ("cpu" here) where the loader looks."""
    from model_executor.layers.triton_ops import small_m_gemm_config as smc

    monkeypatch.setattr(smc, "CONFIG_DIR", tmp_path)
    clear = sm.forget_tables

    def write(content: dict):
        (tmp_path / f"small_m_gemm_{sm.device_name('cpu')}.json").write_text(json.dumps(content))
        clear()

    clear()
    yield write
    clear()


TUNED = {"BLOCK_N": 64, "BLOCK_K": 128, "SPLIT_K": 2, "num_warps": 8, "num_stages": 3}


@in_process
def test_table_lookup_selects_tuned_config_and_falls_back(table):
    gemv = {"BLOCK_N": 8, "BLOCK_K": 64, "GEMV": True}
    table({"bf16": {"32,64": {"1": "cublas", "4": TUNED}}, "fp8": {"32,64": {"16": TUNED, "8": "w8a8"}},
           "fp8_block": {"32,64": {"1": gemv, "2": gemv}}})
    assert sm.choose_config(3, 32, 64, "bf16", "cpu") == sm.GemmConfig(**TUNED)  # M 3 -> bucket 4
    assert sm.choose_config(1, 32, 64, "bf16", "cpu") is None  # "cublas"
    assert sm.choose_config(9, 32, 64, "bf16", "cpu") is None  # bucket 16 not in the table
    assert sm.choose_config(4, 48, 64, "bf16", "cpu") is None  # shape not in the table: F.linear
    assert sm.choose_config(16, 32, 64, "fp8", "cpu") == sm.GemmConfig(**TUNED)
    assert sm.choose_config(2, 32, 64, "fp8", "cpu") == sm.default_config(2, 32, 64, "fp8")  # FP8: default
    assert sm.choose_config(5, 32, 64, "fp8", "cpu") is None  # "w8a8": the method's other path
    assert sm.choose_config(17, 32, 64, "fp8", "cpu") is None  # above 16 rows: only a tuned bucket
    assert sm.choose_config(1, 32, 64, "fp8_block", "cpu") == sm.GemmConfig(8, 64, GEMV=True)
    assert sm.choose_config(2, 32, 64, "fp8_block", "cpu") == sm.GemmConfig(8, 64, GEMV=True)  # (<= 4 rows)
    table({"fp8_block": {"32,64": {"4": gemv, "8": gemv}}})
    assert sm.choose_config(3, 32, 64, "fp8_block", "cpu") == sm.GemmConfig(8, 64, GEMV=True)
    assert not sm.choose_config(5, 32, 64, "fp8_block", "cpu").GEMV  # a GEMV entry above 4 rows is ignored


@in_process
def test_fp8_rows_above_16_take_the_kernel_only_where_the_table_says(table):
    table({"fp8": {"32,64": {"32": TUNED, "64": "w8a8"}}, "bf16": {"32,64": {"16": TUNED}}})
    fp8_w, bf16_w = torch.zeros(32, 64, dtype=FP8), torch.zeros(32, 64, dtype=torch.bfloat16)
    rows = lambda m: torch.zeros(m, 64, dtype=torch.bfloat16)
    assert sm.choose_config(17, 32, 64, "fp8", "cpu") == sm.GemmConfig(**TUNED)  # bucket 32
    assert sm.use_small_m(rows(32), fp8_w) and sm.use_small_m(rows(20), fp8_w)
    assert not sm.use_small_m(rows(33), fp8_w)  # bucket 64 says "w8a8"
    assert not sm.use_small_m(rows(65), fp8_w)  # above MAX_M_FP8
    assert not sm.use_small_m(rows(20), torch.zeros(48, 64, dtype=FP8))  # untuned shape: W8A8 above 16
    assert not sm.use_small_m(rows(17), bf16_w)  # bf16 stops at 16 rows


@in_process
def test_x_fp8_entries_belong_to_the_w8a8_path(table, monkeypatch):
    """An X_FP8 entry is not a weight-only config: the layer takes the W8A8 path at those rows (its input
    quantized, by the norm's kernel where one feeds it), whose GEMM is then this kernel on FP8 operands."""
    from model_executor.layers.quantization import fp8_linear as fl

    monkeypatch.setattr(qbase, "SMALL_M_DEVICES", ("cuda", "cpu"))
    act = {**TUNED, "X_FP8": True}
    table({"fp8": {"32,64": {"32": act, "16": TUNED}}})
    w = torch.zeros(32, 64, dtype=FP8)
    rows = lambda m: torch.zeros(m, 64, dtype=torch.bfloat16)
    assert sm.choose_config(20, 32, 64, "fp8", "cpu") is None and not sm.use_small_m(rows(20), w)
    assert sm.act_quant_config(rows(20).to(FP8), w) == sm.GemmConfig(**act)
    assert sm.act_quant_config(rows(16).to(FP8), w) is None  # bucket 16: a weight-only config
    assert sm.act_quant_config(rows(20).to(FP8), torch.zeros(48, 64, dtype=FP8)) is None  # untuned shape
    calls = []
    monkeypatch.setattr(sm, "small_m_linear_fp8_act", lambda *a, **kw: calls.append((a[0].shape, a[-1])) or "kernel")
    xq, xs = rows(20).to(FP8), torch.ones(20, 1)
    assert fl._w8a8(xq, xs, w, torch.ones(32), None, None, torch.bfloat16) == "kernel"
    assert calls == [((20, 64), None)]
    # Block scales: their own table kind; the K steps must tile the scale block (32 does, 48 does not)
    table({"fp8_block": {"32,64": {"32": act}}})
    assert sm.act_quant_config(rows(20).to(FP8), w) is None  # no per-channel entry now
    assert sm.act_quant_config(rows(20).to(FP8), w, (32, 32)) == sm.GemmConfig(**act)
    assert sm.act_quant_config(rows(20).to(FP8), w, (32, 48)) is None
    assert fl._w8a8(xq, torch.ones(20, 2), w, torch.ones(1, 2), None, (32, 32), torch.bfloat16) == "kernel"
    assert calls[-1] == ((20, 64), (32, 32))


@in_process
def test_no_table_keeps_cublas_for_bf16_and_uses_kernel_for_fp8(table):
    assert qbase.SMALL_M_MAX == max(sm.MAX_M, sm.MAX_M_FP8)  # the methods' pre-check before importing it
    with pytest.raises(ValueError, match="unknown entry"):
        sm.parse_entry("cuBLAS")
    x = torch.zeros(4, 64, dtype=torch.bfloat16)
    assert not sm.use_small_m(x, torch.zeros(32, 64, dtype=torch.bfloat16))
    assert sm.use_small_m(x, torch.zeros(32, 64, dtype=FP8))
    assert not sm.use_small_m(torch.zeros(17, 64, dtype=torch.bfloat16), torch.zeros(32, 64, dtype=FP8))
    assert sm.use_small_m(x, torch.zeros(32, 64, dtype=FP8), block=(128, 32))
    assert not sm.use_small_m(x, torch.zeros(32, 64, dtype=FP8), block=(128, 96))  # K steps cannot tile it


def _linear(quant, n: int, k: int, bias: bool):
    from model_executor.layers.linear import ColumnParallelLinear
    from model_executor.layers.quantization import QuantConfig, quantization_context, restore_kept_dtypes

    with quantization_context(None if quant is None else QuantConfig(quant, block=(32, 32)
                                                                      if quant == "fp8_block" else None)):
        layer = ColumnParallelLinear(k, n, bias=bias, tp_rank=0, tp_size=1).to(torch.bfloat16)
    restore_kept_dtypes(layer)
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(n)) * 0.1
    if quant == "fp8_block":
        q, s = fm.quantize_fp8_block(w, (32, 32))
        layer.weight.data.copy_(q)
        layer.weight_scale_inv.data.copy_(s)
        w_deq = fm.dequantize_fp8_block(q, s, (32, 32))
    elif quant == "fp8":
        layer.weight_loader(layer.weight, w.to(torch.bfloat16))
        w_deq = layer.weight.float() * layer.weight_scale[:, None]
    else:
        layer.weight.data.copy_(w)
        w_deq = layer.weight.float()
    if bias:
        layer.bias.data.copy_(torch.randn(n))
    return layer, w_deq


@interpreter_only
@pytest.mark.parametrize("quant", [None, "fp8", "fp8_block"])
def test_linear_methods_take_the_kernel_at_small_m(quant, table, monkeypatch):
    """With the kernel allowed on this device (the interpreter's CPU tensors stand in for CUDA): M <= 16 runs
    it (FP8 weight-only: x is not quantized, so the result matches x @ dequantized W, not the W8A8 reference);
    M = 17 keeps the method's other path. bf16 takes it only where the table says so."""
    monkeypatch.setattr(qbase, "SMALL_M_DEVICES", ("cuda", "cpu"))
    n, k = 48, 96
    table({"bf16": {f"{n},{k}": {"4": {"BLOCK_N": 16, "BLOCK_K": 32, "SPLIT_K": 2, "num_stages": 2}}}})
    layer, w_deq = _linear(quant, n, k, bias=True)
    calls = []
    real = sm.small_m_linear
    monkeypatch.setattr(sm, "small_m_linear", lambda *a, **kw: calls.append(a[0].shape[0]) or real(*a, **kw))
    x = torch.randn(2, 2, k, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)  # 4 rows
    with torch.no_grad():
        out = layer(x)
        assert calls == [4] and out.shape == (2, 2, n)
        ref = reference(x.reshape(4, k), w_deq, layer.bias).reshape(2, 2, n)
        assert_matches_reference(out, ref, torch.bfloat16)
        layer(torch.randn(17, k).to(torch.bfloat16))
        assert calls == [4]
        if quant is None:  # no table entry for 8 rows (bucket 8): F.linear
            layer(torch.randn(8, k).to(torch.bfloat16))
            assert calls == [4]


def _small_lm_head(monkeypatch):
    """A bf16 LM head of 50 x 64 that may take the small-M kernel on CPU tensors, and 3 hidden rows for it."""
    from model_executor.layers.embedding import ParallelLMHead

    monkeypatch.setattr(qbase, "SMALL_M_DEVICES", ("cuda", "cpu"))
    head = ParallelLMHead(50, 64, tp_rank=0, tp_size=1).to(torch.bfloat16)
    head.weight.data.normal_(0, 0.1, generator=torch.Generator().manual_seed(0))
    return head, torch.randn(3, 64, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)


@interpreter_only
def test_lm_head_takes_the_kernel_where_the_table_says(table, monkeypatch):
    head, hidden = _small_lm_head(monkeypatch)
    ref = reference(hidden, head.weight.float(), None)
    cfg = {"BLOCK_N": 16, "BLOCK_K": 32, "SPLIT_K": 2, "num_stages": 2}
    table({"bf16": {"50,64": {"4": cfg}}})
    with torch.no_grad():
        out = head(hidden)
        # float32 logits straight from the kernel's float32 sums (no bf16 rounding: within float32's error)
        assert out.dtype == torch.float32
        assert torch.equal(out, sm.small_m_linear(hidden, head.weight, config=sm.GemmConfig(**cfg),
                                                  out_dtype=torch.float32))
        assert float((out - ref).abs().max()) <= 1e-5 * float(ref.abs().max())
        table({})
        assert torch.equal(head(hidden), torch.nn.functional.linear(hidden, head.weight))


@interpreter_only
def test_lm_head_writes_its_logits_into_a_given_buffer(table, monkeypatch):
    """A decode graph's static logits (fb.logits_out): the kernel stores into the buffer itself (the
    runner's copy after the head goes), and F.linear's logits are converted into it; the values are those
    the head returns without a buffer."""
    head, hidden = _small_lm_head(monkeypatch)
    buf = torch.full((8, 50), float("nan"))
    copies = []
    real_copy = torch.Tensor.copy_
    monkeypatch.setattr(torch.Tensor, "copy_", lambda t, src, *a, **kw: copies.append(1) or real_copy(t, src, *a, **kw))
    with torch.no_grad():
        for entry, n_copies in (
                ({"bf16": {"50,64": {"4": {"BLOCK_N": 16, "BLOCK_K": 32, "SPLIT_K": 2, "num_stages": 2}}}}, 0),
                ({}, 1)):  # the kernel (split K: its reduce writes the buffer), then F.linear and one copy
            table(entry)
            expected = head(hidden).float()
            copies.clear()
            got = head(hidden, out=buf[:3])
            assert len(copies) == n_copies
            assert got.data_ptr() == buf.data_ptr() and torch.equal(buf[:3], expected)
            assert buf[3:].isnan().all()  # (rows past the batch's untouched)
            buf.fill_(float("nan"))
        with pytest.raises(ValueError, match="y_out must be a contiguous"):
            sm.small_m_linear(hidden, head.weight, config=sm.GemmConfig(BLOCK_N=16, BLOCK_K=32),
                              out_dtype=torch.float32, y_out=buf[:, :25][:3])


@in_process
def test_cpu_path_does_not_take_the_kernel(table):
    """Without the opt-in, CPU tensors keep F.linear / the FP8 reference (the server's CPU path)."""
    layer, _ = _linear("fp8", 48, 96, bias=False)
    x = torch.randn(3, 96).to(torch.bfloat16)
    assert qbase.small_m_kernel(x, layer.weight) is None
    with torch.no_grad():
        ref = fm.fp8_linear_reference(x, layer.weight, layer.weight_scale, None)
        assert torch.equal(layer(x), ref)


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


@interpreter_only
@pytest.mark.parametrize("quant", ["fp8", "fp8_block"])
def test_fp8_linear_traced_once_picks_its_path_per_row_count(quant, table, monkeypatch):
    """The piecewise runner traces its pieces once for a symbolic token count and captures them at several
    sizes: an FP8 linear inside must still run the kernel eager would run at each size (weight-only small-M
    up to 16 rows, W8A8 above), so a padded small batch in a graph computes what it computes eagerly."""
    monkeypatch.setattr(qbase, "SMALL_M_DEVICES", ("cuda", "cpu"))
    layer, _ = _linear(quant, 48, 96, bias=True)
    fn = torch.compile(layer, dynamic=True, fullgraph=True, backend="eager")
    torch._dynamo.reset()
    try:
        with torch.no_grad():
            for m in (17, 4, 16, 20):
                x = torch.randn(m, 96, generator=torch.Generator().manual_seed(m)).to(torch.bfloat16)
                assert torch.equal(fn(x), layer(x)), m
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


@interpreter_only
def test_fused_silu_and_mul_config_and_refusals(table):
    gemv = {"BLOCK_N": 8, "BLOCK_K": 64, "GEMV": True}
    table({"bf16": {"32,64": {"1": gemv}, "48,64": {"1": {**gemv, "SPLIT_K": 2}}, "64,64": {"1": TUNED},
                    "80,64": {"1": "cublas"}}})
    assert sm.silu_and_mul_config(32, 64, "bf16", "cpu") == sm.GemmConfig(4, 64, GEMV=True)  # half the rows
    assert sm.silu_and_mul_config(48, 64, "bf16", "cpu") is None  # split K: the partial sums need a reduce
    assert sm.silu_and_mul_config(64, 64, "bf16", "cpu") is None  # split K (a tl.dot tile)
    assert sm.silu_and_mul_config(80, 64, "bf16", "cpu") is None  # cuBLAS
    assert sm.silu_and_mul_config(31, 64, "bf16", "cpu") is None  # no [gate; up] halves
    w = torch.zeros(32, 64, dtype=torch.bfloat16)
    assert sm.small_m_silu_and_mul(torch.zeros(2, 64, dtype=torch.bfloat16), w) is None  # no two-row entry
    assert sm.small_m_silu_and_mul(torch.zeros(1, 64, dtype=torch.bfloat16), w).shape == (1, 16)
    table({"bf16": {"32,64": {"1": gemv, "2": gemv, "8": gemv}}})
    assert sm.small_m_silu_and_mul(torch.zeros(2, 64, dtype=torch.bfloat16), w).shape == (2, 16)
    assert sm.small_m_silu_and_mul(torch.zeros(5, 64, dtype=torch.bfloat16), w) is None  # above the GEMV's rows
    dot = {"BLOCK_N": 32, "BLOCK_K": 64, "FUSE": True}  # a single-split tl.dot tile: 16 gate + 16 up rows a program
    table({"bf16": {"32,64": {"1": dot}, "64,64": {"1": {**dot, "BLOCK_N": 16}}}})
    assert sm.silu_and_mul_config(32, 64, "bf16", "cpu") == sm.GemmConfig(16, 64, FUSE=True)
    assert sm.silu_and_mul_config(64, 64, "bf16", "cpu") is None  # 8 rows a block: below tl.dot's 16
    table({"bf16": {"32,64": {"1": {**dot, "FUSE": False}}}})  # the tuner measured it faster unfused
    assert sm.silu_and_mul_config(32, 64, "bf16", "cpu") is None
    table({"bf16": {"32,64": {"1": {"BLOCK_N": 32, "BLOCK_K": 64}}}})  # FUSE not given (a table from before)
    assert sm.silu_and_mul_config(32, 64, "bf16", "cpu") is None  # a dot tile does not fuse; a GEMV does (above)
    with pytest.raises(ValueError, match="single-split config"):
        sm.small_m_silu_and_mul(torch.zeros(1, 64, dtype=torch.bfloat16), w,
                                config=sm.GemmConfig(8, 64, SPLIT_K=2, GEMV=True))
    with pytest.raises(ValueError, match="bad small-M GEMM config"):  # (one dot: a tl.dot tile's)
        sm.GemmConfig(8, 64, GEMV=True, PAIR_DOT=True)


def rmsnorm_reference(h, g, eps):
    """weight * rmsnorm(h) in float32, with no rounding of the normed row."""
    hf = h.float()
    return hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps) * g.float()


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


@interpreter_only
def test_fused_rmsnorm_refusals(table):
    """The fused norm needs a single-split GEMV (each program sums h^2 over all of K) and well-formed norm
    operands; the table's choice decides, as for the SiLU-and-mul."""
    gemv = {"BLOCK_N": 8, "BLOCK_K": 64, "GEMV": True}
    table({"bf16": {"32,64": {"1": gemv}, "48,64": {"1": {**gemv, "SPLIT_K": 2}}, "64,64": {"1": TUNED},
                    "80,64": {"1": "cublas"}}})
    assert sm.fused_config(32, 64, "bf16", "cpu", gemv=True) == sm.GemmConfig(8, 64, GEMV=True)  # every row
    assert sm.fused_config(48, 64, "bf16", "cpu", gemv=True) is None  # split K
    assert sm.fused_config(64, 64, "bf16", "cpu", gemv=True) is None  # split K (a tl.dot tile)
    assert sm.fused_config(80, 64, "bf16", "cpu", gemv=True) is None  # cuBLAS
    table({"bf16": {"32,64": {"1": {**TUNED, "SPLIT_K": 1, "FUSE": True}}}})  # a single-split tl.dot: no norm in it
    assert sm.fused_config(32, 64, "bf16", "cpu", gemv=True) is None
    assert sm.fused_config(32, 64, "bf16", "cpu") == sm.GemmConfig(**{**TUNED, "SPLIT_K": 1, "FUSE": True})
    table({"bf16": {"32,64": {"1": gemv}, "48,64": {"1": {**gemv, "SPLIT_K": 2}}, "64,64": {"1": TUNED},
                    "80,64": {"1": "cublas"}}})
    x = torch.zeros(1, 64, dtype=torch.bfloat16)
    g = torch.ones(64, dtype=torch.bfloat16)
    w = torch.zeros(32, 64, dtype=torch.bfloat16)
    assert sm.small_m_rmsnorm_linear(torch.zeros(2, 64, dtype=torch.bfloat16), g, 1e-6, None, w) is None  # bucket 2
    table({"bf16": {"32,64": {"1": gemv, "2": gemv, "8": gemv}}})
    assert sm.small_m_rmsnorm_linear(torch.zeros(2, 64, dtype=torch.bfloat16), g, 1e-6, None, w)[0].shape == (2, 32)
    assert sm.small_m_rmsnorm_linear(torch.zeros(5, 64, dtype=torch.bfloat16), g, 1e-6, None, w) is None  # > 4 rows
    assert sm.small_m_rmsnorm_linear(x, g, 1e-6, None, torch.zeros(48, 64, dtype=torch.bfloat16)) is None
    y, h = sm.small_m_rmsnorm_linear(x, g, 1e-6, x.clone(), w)
    assert y.shape == (1, 32) and h.shape == (1, 64)
    with pytest.raises(ValueError, match="single-split GEMV"):
        sm.small_m_rmsnorm_linear(x, g, 1e-6, None, w, config=sm.GemmConfig(8, 64, SPLIT_K=2, GEMV=True))
    with pytest.raises(ValueError, match="single-split GEMV"):
        sm.small_m_rmsnorm_linear(x, g, 1e-6, None, w, config=sm.GemmConfig(16, 64))
    with pytest.raises(ValueError, match="RMSNorm weight"):
        sm.small_m_rmsnorm_linear(x, g[:32], 1e-6, None, w)
    with pytest.raises(ValueError, match="RMSNorm residual"):
        sm.small_m_rmsnorm_linear(x, g, 1e-6, x.float(), w)
    with pytest.raises(ValueError, match="does not go with the fused SiLU"):
        sm._launch(x, w, None, None, None, sm.GemmConfig(8, 64, GEMV=True), silu_mul=True,
                   norm=sm.RmsNormInput(g, 1e-6))


def _tiny_mlp(quant, table, rows=("1",)):
    """A LlamaMLP (hidden 64, intermediate 64) in bf16 or FP8 with random weights, and the table giving its
    [gate; up] weight a GEMV at `rows`' buckets; (mlp, the generator that filled it)."""
    from types import SimpleNamespace

    from model_executor.layers.quantization import QuantConfig, quantization_context, restore_kept_dtypes
    from model_executor.models.llama import LlamaMLP

    hidden, inter = 64, 64  # (block FP8: the down projection's input is a whole number of 32-wide blocks)
    gemv = {"BLOCK_N": 8, "BLOCK_K": 32, "GEMV": True}
    kind = {None: "bf16", "fp8": "fp8", "fp8_block": "fp8_block"}[quant]
    table({kind: {f"{2 * inter},{hidden}": dict.fromkeys(rows, gemv)}})
    cfg = SimpleNamespace(hidden_size=hidden, intermediate_size=inter)  # what LlamaMLP reads
    with quantization_context(None if quant is None else QuantConfig(quant, block=(32, 32)
                                                                      if quant == "fp8_block" else None)):
        mlp = LlamaMLP(cfg).to(torch.bfloat16)
    restore_kept_dtypes(mlp)
    gen = torch.Generator().manual_seed(3)
    for layer in (mlp.gate_up_proj, mlp.down_proj):
        w = torch.randn(layer.weight.shape, generator=gen) * 0.1
        if quant == "fp8_block":
            q, s = fm.quantize_fp8_block(w, (32, 32))
            layer.weight.data.copy_(q)
            layer.weight_scale_inv.data.copy_(s)
        elif quant == "fp8":
            layer._load(layer.weight, w.to(torch.bfloat16))  # quantized as it loads
        else:
            layer.weight.data.copy_(w)
    return mlp, gen


@interpreter_only
@pytest.mark.parametrize("quant", [None, "fp8", "fp8_block"])
@pytest.mark.parametrize("with_residual", [True, False])
def test_forward_normed_folds_the_norm_in_where_the_table_has_a_gemv(quant, with_residual, table, monkeypatch):
    """LinearBase.forward_normed at 1 and 2 decode rows (GEMV entries in the table) runs the RMSNorm (and
    residual add) inside the layer's GEMV: the RMSNorm module then the layer, within the one rounding of the
    normed row the fused kernel skips, and the same sum; at three rows (no GEMV entry for bucket 4) it is
    exactly RMSNorm then the layer."""
    from model_executor.layers.norm import RMSNorm

    monkeypatch.setattr(qbase, "SMALL_M_DEVICES", ("cuda", "cpu"))
    n, k = 48, 64
    kind = {None: "bf16", "fp8": "fp8", "fp8_block": "fp8_block"}[quant]
    gemv = {"BLOCK_N": 8, "BLOCK_K": 32, "GEMV": True}
    table({kind: {f"{n},{k}": {"1": gemv, "2": gemv}}})
    layer, _ = _linear(quant, n, k, bias=True)
    gen = torch.Generator().manual_seed(3)
    norm = RMSNorm(k, eps=1e-5).to(torch.bfloat16)
    norm.weight.data.copy_(torch.rand(k, generator=gen) + 0.5)
    fused = []
    real = sm.small_m_rmsnorm_linear

    def spy(*a, **kw):
        out = real(*a, **kw)
        fused.append(out is not None)
        return out

    monkeypatch.setattr(sm, "small_m_rmsnorm_linear", spy)
    x = (torch.randn(3, k, generator=gen) * 4).to(torch.bfloat16)
    r = (torch.randn(3, k, generator=gen) * 4).to(torch.bfloat16) if with_residual else None
    with torch.no_grad():
        for rows in (1, 2, 3):
            xr, rr = x[:rows], None if r is None else r[:rows]
            fused.clear()
            out, h = layer.forward_normed(norm, xr, rr)
            normed, h_ref = (norm(xr), xr) if rr is None else norm(xr, rr)
            assert any(fused) == (rows <= 2)
            if triton_mode.interpreting() and rr is not None and rows <= 2:  # (truncating bf16 casts)
                torch.testing.assert_close(h, h_ref, rtol=2.0**-7, atol=0)
            else:
                assert torch.equal(h, h_ref)
            unfused = layer(normed)
            if rows <= 2:
                torch.testing.assert_close(out.float(), unfused.float(), rtol=2.0**-5,
                                           atol=2.0**-6 * unfused.abs().max().item())
            else:
                assert torch.equal(out, unfused)


@interpreter_only
@pytest.mark.parametrize("quant", [None, "fp8", "fp8_block"])
def test_llama_mlp_fuses_the_activation_where_the_table_has_a_gemv(quant, table, monkeypatch):
    """LlamaMLP at a decode row runs gate/up + SiLU-and-mul as one kernel (the table's GEMV for the [2I, K]
    weight) with the unfused path's bits; at two rows the linear and SiluAndMul run apart until the table
    gives two rows a GEMV too, and then two rows fuse with the unfused bits."""
    from model_executor.layers.triton_ops import ops as triton_ops

    monkeypatch.setattr(qbase, "SMALL_M_DEVICES", ("cuda", "cpu"))
    mlp, gen = _tiny_mlp(quant, table)
    hidden = mlp.gate_up_proj.weight.shape[1]
    fused = []
    real = sm.small_m_silu_and_mul

    def counted(*a, **kw):
        out = real(*a, **kw)
        if out is not None:
            fused.append(out.shape[0])
        return out

    monkeypatch.setattr(sm, "small_m_silu_and_mul", counted)
    x = torch.randn(2, hidden, generator=gen).to(torch.bfloat16)
    # (on a GPU SiluAndMul runs this Triton kernel; on a CPU tensor it would take torch's silu)
    unfused = lambda mlp, rows: mlp.down_proj(triton_ops.silu_and_mul(mlp.gate_up_proj(rows)))
    with torch.no_grad():
        assert torch.equal(mlp(x[:1]), unfused(mlp, x[:1])) and fused == [1]
        mlp(x)
        assert fused == [1]  # two rows: the linear and SiluAndMul
        mlp, _ = _tiny_mlp(quant, table, rows=("1", "2"))  # (the same weights; the table has a two-row GEMV)
        assert torch.equal(mlp(x), unfused(mlp, x)) and fused == [1, 2]


@interpreter_only
def test_llama_decode_row_folds_the_input_norm_into_qkv(tiny_llama, table, monkeypatch):
    """A bf16 Llama decode step of one request: every layer's input norm runs inside its qkv GEMV (none
    falling back), and the logits stay within bf16 rounding of the same step with the norms run apart."""
    from runners.model_runner import ModelRunner, RunnerConfig
    from tests.runners.test_cuda_graph_runner import make_decode_batch, release

    monkeypatch.setattr(qbase, "SMALL_M_DEVICES", ("cuda", "cpu"))
    gemv = {"BLOCK_N": 8, "BLOCK_K": 32, "GEMV": True}
    table({"bf16": {"128,64": {"1": gemv}}})  # qkv: 4 + 2 x 2 heads of 16
    runner = ModelRunner(RunnerConfig(model_path=str(tiny_llama[0]), device=DEVICE, dtype="bfloat16",
                                      max_running_requests=2, max_total_tokens=256, disable_cuda_graph=True,
                                      disable_piecewise_cuda_graph=True))
    fused = []
    real = sm.small_m_rmsnorm_linear
    def counting(*args, **kwargs):
        out = real(*args, **kwargs)
        fused.append(out is not None)
        return out

    monkeypatch.setattr(sm, "small_m_rmsnorm_linear", counting)
    fb, rows, _ = make_decode_batch(runner, 1, seed=4, max_prompt=12)
    try:
        with torch.no_grad():
            fused.clear()  # (the prefill's rows are many: it fused nothing)
            out = runner.forward_eager(fb).float()
            assert fused == [True] * runner.model_config.num_hidden_layers
            monkeypatch.setattr(qbase.LinearMethod, "apply_rmsnorm", lambda *a: None)
            unfused = runner.forward_eager(fb).float()
    finally:
        release(runner, rows, fb)
    # (measured: max |diff| 1% of max |logit|, from the normed row's rounding through two layers)
    torch.testing.assert_close(out, unfused, rtol=0.02, atol=0.02 * unfused.abs().max().item())
    assert out.argmax(-1).tolist() == unfused.argmax(-1).tolist()


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


@interpreter_only
@pytest.mark.parametrize("bs", [1, 2])
def test_llama_triton_decode_token_runs_norm_qkv_rope_and_store_in_one_kernel(tiny_llama, table, monkeypatch, bs):
    """A bf16 Llama decode step of one or two requests on the triton backend: every layer's input norm, qkv
    GEMV, rotary and KV store run as one kernel, and the logits and the K/V it stores have the bits of the
    same step with the rotary and store run by the backend (the qkv GEMV with the norm, then rotary_store_kv).
    Attention after the one kernel is told so (after_qkv: it preloads, and on sm_90 is launched with PDL);
    after rotary_store_kv it is not."""
    from model_executor.layers.attention import triton_backend as tb
    from model_executor.layers.attention.radix_attention import RadixAttention
    from model_executor.layers.attention.triton_backend import TritonAttnBackend
    from runners.model_runner import ModelRunner, RunnerConfig
    from tests.runners.test_cuda_graph_runner import make_decode_batch, release

    monkeypatch.setattr(qbase, "SMALL_M_DEVICES", ("cuda", "cpu"))
    gemv = {"BLOCK_N": 8, "BLOCK_K": 32, "GEMV": True}
    table({"bf16": {"128,64": {"1": gemv, "2": gemv}}})  # qkv: 4 + 2 x 2 heads of 16
    runner = ModelRunner(RunnerConfig(model_path=str(tiny_llama[0]), device=DEVICE, dtype="bfloat16",
                                      attention_backend="torch_native", max_running_requests=2, max_total_tokens=256,
                                      disable_cuda_graph=True, disable_piecewise_cuda_graph=True))
    runner.attn_backend = TritonAttnBackend(runner)  # (the product refuses triton without CUDA)
    calls = []
    real = sm.small_m_rmsnorm_linear
    monkeypatch.setattr(sm, "small_m_rmsnorm_linear", lambda *a, **kw: calls.append(kw.get("rope")) or real(*a, **kw))
    after_qkv = []
    attend = tb.decode_attention_fwd
    monkeypatch.setattr(tb, "decode_attention_fwd", lambda *a, **kw: after_qkv.append(kw["after_qkv"]) or attend(*a, **kw))
    layers = runner.model_config.num_hidden_layers
    fb, rows, loc = make_decode_batch(runner, bs, seed=6, max_prompt=12)
    assert loc.numel() == bs
    bufs = runner.kv_cache.k_buffers + runner.kv_cache.v_buffers
    try:
        with torch.no_grad():
            calls.clear()
            fused = runner.forward_eager(fb).clone()
            assert len(calls) == layers and all(c is not None for c in calls)
            assert after_qkv == [True] * layers
            kv_fused = [buf[loc].clone() for buf in bufs]
            for buf in bufs:
                buf[loc] = float("nan")  # the unfused step must write them again
            monkeypatch.setattr(RadixAttention, "rope_store", lambda *a: None)
            calls.clear()
            after_qkv.clear()
            unfused = runner.forward_eager(fb)
            assert calls == [None] * layers  # the norm still in the GEMV
            assert after_qkv == [False] * layers
    finally:
        release(runner, rows, fb)
    assert torch.equal(fused, unfused)
    for ref, buf in zip(kv_fused, bufs):
        assert torch.equal(buf[loc], ref)


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


@interpreter_only
def test_add_rmsnorm_refusals(table, monkeypatch):
    """The epilogue and the pre-normed input need a single-split GEMV of one row and well-formed operands;
    the pair runs only when the table gives both weights a single-split GEMV (nothing launched otherwise)."""
    x = torch.randn(1, 64).to(torch.bfloat16)
    w = torch.randn(48, 64).to(torch.bfloat16)
    r = torch.randn(1, 48).to(torch.bfloat16)
    g = torch.ones(48, dtype=torch.bfloat16)
    gemv = sm.GemmConfig(8, 32, GEMV=True)
    with pytest.raises(ValueError, match="single-split config"):
        sm.small_m_linear_add_rmsnorm(x, w, None, None, None, r, g, 1e-6, config=sm.GemmConfig(8, 32, SPLIT_K=2,
                                                                                                GEMV=True))
    with pytest.raises(ValueError, match="RMSNorm residual"):
        sm.small_m_linear_add_rmsnorm(x, w, None, None, None, r[:, :40], g, 1e-6, config=gemv)
    with pytest.raises(ValueError, match="RMSNorm weight"):
        sm.small_m_linear_add_rmsnorm(x, w, None, None, None, r, g[:40], 1e-6, config=gemv)
    row, _ = sm.small_m_linear_add_rmsnorm(x, w, None, None, None, r, g, 1e-6, config=gemv)
    gu = torch.randn(32, 48).to(torch.bfloat16)
    with pytest.raises(ValueError, match="single-split config"):
        sm.small_m_silu_and_mul(row, gu, config=sm.GemmConfig(8, 32, SPLIT_K=2, GEMV=True))
    with pytest.raises(ValueError, match="either pre-normed or normed"):
        sm._launch(row.weighted, gu, None, None, None, gemv, norm=sm.RmsNormInput(g, 1e-6), prenormed=row)
    with pytest.raises(ValueError, match="partial sums must be"):
        bad = sm.PrenormedRow(row.weighted, row.partials.double(), 1e-6)
        sm.small_m_silu_and_mul(bad, gu, config=gemv)
    # the layer-level entry: both weights need a single-split GEMV in the table (the producer's, and the
    # consumer's, which takes the row); one row only
    monkeypatch.setattr(qbase, "SMALL_M_DEVICES", ("cuda", "cpu"))
    gemv_entry = {"1": {"BLOCK_N": 8, "BLOCK_K": 32, "GEMV": True}}

    def pair(rows=x, residual=r):
        return qbase.small_m_linear_add_rmsnorm(rows, w, None, None, None, residual, g, 1e-6, gu, None)

    table({"bf16": {"48,64": gemv_entry, "32,48": {"1": "cublas"}}})
    assert pair() is None
    table({"bf16": {"48,64": {"1": {"BLOCK_N": 8, "BLOCK_K": 32, "SPLIT_K": 2, "GEMV": True}}, "32,48": gemv_entry}})
    assert pair() is None
    table({"bf16": {"48,64": gemv_entry, "32,48": gemv_entry}})
    assert pair(torch.randn(2, 64).to(torch.bfloat16), r.expand(2, -1).contiguous()) is None
    assert pair(x, r.float()) is None
    row, h = pair()
    assert isinstance(row, sm.PrenormedRow) and h.shape == (1, 48)
    assert qbase.small_m_silu_and_mul(row, gu, None, None, None).shape == (1, 16)


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


@interpreter_only
@pytest.mark.parametrize("lm_head_gemv", [False, True])
@pytest.mark.parametrize("bs", [1, 2, 6])
def test_llama_decode_row_runs_its_norms_in_the_gemvs_around_them(tiny_llama, table, monkeypatch, lm_head_gemv,
                                                                   bs):
    """A bf16 Llama decode step of bs requests on the triton backend: o_proj's and down's GEMVs add the
    residual and sum h^2 in their epilogues, gate/up + SiLU and the next layer's qkv (+ rotary + KV store)
    take the PrenormedRow. The last layer's down does so for the final norm where the LM head runs as a
    single-split GEMV (lm_head_gemv: the table says so), the LM head taking the row (float32 logits); else
    the final RMSNorm runs as a norm. At 6 requests the table's 8-row entries are fusing single-split tl.dot
    tiles, which take every fusion but the RMSNorm inside the K loop: layer 0's input norm runs as a norm. The
    logits and the K/V stored stay within bf16 rounding of the same step with o_proj, down and the norms run
    apart (and the greedy token is the same)."""
    from model_executor.layers.attention.triton_backend import TritonAttnBackend
    from model_executor.models import llama
    from runners.model_runner import ModelRunner, RunnerConfig
    from tests.runners.test_cuda_graph_runner import make_decode_batch, release

    monkeypatch.setattr(qbase, "SMALL_M_DEVICES", ("cuda", "cpu"))
    gemv = {key: {"BLOCK_N": 8, "BLOCK_K": 32, "GEMV": True} for key in ("1", "2")}
    gemv["8"] = {"BLOCK_N": 32, "BLOCK_K": 32, "FUSE": True}  # (3-8 rows: a tl.dot tile)
    entries = {"128,64": gemv, "64,64": gemv, "256,64": gemv, "64,128": gemv}  # qkv, o, gate/up, down
    table({"bf16": entries | ({"320,64": gemv} if lm_head_gemv else {})})  # (the LM head)
    runner = ModelRunner(RunnerConfig(model_path=str(tiny_llama[0]), device=DEVICE, dtype="bfloat16",
                                      attention_backend="torch_native", max_running_requests=6, max_total_tokens=256,
                                      disable_cuda_graph=True, disable_piecewise_cuda_graph=True))
    runner.attn_backend = TritonAttnBackend(runner)  # (the product refuses triton without CUDA)
    calls = {"add_norm": [], "prenormed": [], "norm": [], "rope": []}
    for name, key, arg in (("small_m_linear_add_rmsnorm", "add_norm", "after_attention"),
                           ("small_m_prenormed_linear", "prenormed", "rope"), ("small_m_rope_linear", "rope", "")):
        real = getattr(sm, name)
        monkeypatch.setattr(sm, name, lambda *a, real=real, key=key, arg=arg, **kw: calls[key].append(kw.get(arg))
                            or real(*a, **kw))
    real_norm = llama.RMSNorm.forward
    monkeypatch.setattr(llama.RMSNorm, "forward", lambda self, *a: calls["norm"].append(1) or real_norm(self, *a))
    linear_add_rmsnorm = llama.linear_add_rmsnorm
    fb, rows, loc = make_decode_batch(runner, bs, seed=5, max_prompt=12)
    bufs = runner.kv_cache.k_buffers + runner.kv_cache.v_buffers
    layers = runner.model_config.num_hidden_layers
    try:
        with torch.no_grad():
            for v in calls.values():
                v.clear()  # (the prefill's rows are many: it fused nothing)
            out = runner.forward_eager(fb).float()
            kv_fused = [buf[loc].clone() for buf in bufs]
            # o_proj in each layer (after attention: it loads its first weight tile while attention runs),
            # down in all but the last, and in the last too where the LM head takes its row
            assert calls["add_norm"] == [True, False] * (layers - 1) + [True] + [False] * lm_head_gemv
            # the next layers' qkv (with the rotary), then the LM head (without)
            assert len(calls["prenormed"]) == layers - 1 + lm_head_gemv
            assert all(r is not None for r in calls["prenormed"][: layers - 1])
            assert calls["prenormed"][layers - 1:] == [None] * lm_head_gemv
            # the final norm unless the LM head took it; layer 0's input norm runs in its qkv GEMV (a tl.dot tile
            # cannot run it: at 6 rows it runs as a norm)
            dot = bs > 4
            assert len(calls["norm"]) == 1 - lm_head_gemv + dot
            assert len(calls["rope"]) == dot  # (there its qkv tile runs the rotary + KV store after the norm)
            monkeypatch.setattr(llama, "linear_add_rmsnorm", lambda *a, **kw: None)
            calls["norm"].clear()
            calls["rope"].clear()
            unfused = runner.forward_eager(fb).float()
            # the post-attention norms and the final one (and, in tl.dot tiles, every input norm)
            assert len(calls["norm"]) == 1 + layers + layers * dot
            assert len(calls["rope"]) == layers * dot
    finally:
        release(runner, rows, fb)
    torch.testing.assert_close(out, unfused, rtol=0.02, atol=0.02 * unfused.abs().max().item())
    assert out.argmax(-1).tolist() == unfused.argmax(-1).tolist()
    for fused_kv, buf in zip(kv_fused, bufs):
        torch.testing.assert_close(buf[loc].float(), fused_kv.float(), rtol=2.0**-5, atol=2.0**-5)
    # A one-token prompt is an extend batch of one row: its final norm runs as a norm (its hidden states may
    # go to more than the LM head), where the row fusions around it still run.
    monkeypatch.setattr(llama, "linear_add_rmsnorm", linear_add_rmsnorm)
    for v in calls.values():
        v.clear()
    with torch.no_grad():
        fb, rows, _ = make_decode_batch(runner, 1, seed=7, max_prompt=2, min_prompt=1)
    release(runner, rows, fb)
    assert calls["add_norm"] == [True, False] * (layers - 1) + [True] and len(calls["norm"]) == 1


@in_process
@pytest.mark.parametrize("layer", ["o", "down", "gate_up", "qkv"])
def test_the_tuners_fused_calls_run_the_fusion_they_time(layer, monkeypatch):
    """benchmarks/tune_small_m_gemm's fused_calls at three rows, in the kernel as the layer runs it: o and down
    give (PrenormedRow, h), the row norm weight * h with each row's sums of h^2 in its partials; gate_up its
    SiLU-and-mul's [M, N / 2]; qkv its rotated [M, N]. neighbour_calls run the kernels each replaces."""
    from benchmarks import tune_small_m_gemm as tune

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

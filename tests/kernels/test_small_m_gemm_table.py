"""The small-M GEMM's config table and dispatch (triton_ops/small_m_gemm_config.py, small_m_gemm_dispatch.py):
which config, or which other path, a weight takes at a row count; the fused paths' configs and refusals; the
start-up line naming the table in use; the switch that turns the path off.
"""

from __future__ import annotations

import pytest
import torch

from tests import triton_mode
from tests.small_m_helpers import FP8, TUNED, install_table, kernel_on_cpu
from tests.triton_mode import in_process, interpreter_only

if not triton_mode.RERUN_IN_SUBPROCESS:
    from model_executor.layers.quantization import base as qbase
    from model_executor.layers.triton_ops import small_m_gemm as sm
test_in_subprocess = triton_mode.subprocess_test(__file__)


@pytest.fixture
def table(tmp_path, monkeypatch):
    """write(dict) puts a config table for this device ("cpu" here) where the loader looks."""
    yield from install_table(tmp_path, monkeypatch)


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

    kernel_on_cpu(monkeypatch)
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
    assert sm.MAX_M_FP8 == max(map(sm.max_rows, sm.OTHER_PATHS))  # (the layers' pre-check: takes_kernel)
    with pytest.raises(ValueError, match="unknown entry"):
        sm.parse_entry("cuBLAS")
    x = torch.zeros(4, 64, dtype=torch.bfloat16)
    assert not sm.use_small_m(x, torch.zeros(32, 64, dtype=torch.bfloat16))
    assert sm.use_small_m(x, torch.zeros(32, 64, dtype=FP8))
    assert not sm.use_small_m(torch.zeros(17, 64, dtype=torch.bfloat16), torch.zeros(32, 64, dtype=FP8))
    assert sm.use_small_m(x, torch.zeros(32, 64, dtype=FP8), block=(128, 32))
    assert not sm.use_small_m(x, torch.zeros(32, 64, dtype=FP8), block=(128, 96))  # K steps cannot tile it


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
    kernel_on_cpu(monkeypatch)
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
def test_start_up_line_names_the_table_in_use_or_warns_that_none_fits(table, monkeypatch, caplog):
    """configure (the runner at start-up) logs the table file a device's layers use, warns when no table fits
    the GPU (bf16 then runs cuBLAS), and says when --disable-small-m-gemm turned the path off; a device the
    path does not serve (the server's CPU) gets no line."""
    from model_executor.layers.triton_ops import small_m_gemm_dispatch as dispatch

    monkeypatch.setattr(dispatch, "_switch", dispatch._Switch())
    caplog.set_level("INFO", logger="duet.small_m_gemm")
    dispatch.configure(True, "cpu")
    assert caplog.records == []
    kernel_on_cpu(monkeypatch)
    dispatch.configure(True, "cpu")
    (warning,) = caplog.records
    assert warning.levelname == "WARNING" and "no small-M GEMM table small_m_gemm_cpu.json" in warning.getMessage()
    assert "bf16 linears run cuBLAS" in warning.getMessage()
    caplog.clear()
    table({"bf16": {"32,64": {"1": TUNED}}})
    dispatch.configure(True, "cpu")
    (info,) = caplog.records
    assert info.levelname == "INFO" and info.getMessage() == "small-M GEMM configs for cpu: small_m_gemm_cpu.json"
    caplog.clear()
    dispatch.configure(False, "cpu")
    (off,) = caplog.records
    assert "small-M GEMM off (--disable-small-m-gemm)" in off.getMessage() and not dispatch.enabled()


@in_process
def test_the_switch_sends_every_gemm_to_its_plain_path(table, monkeypatch):
    """With the path off, no linear takes the kernel (weight-only, fused, or as the W8A8 GEMM), whatever the
    table says; on again, the table's choices are back."""
    from model_executor.layers.triton_ops import small_m_gemm_dispatch as dispatch

    monkeypatch.setattr(dispatch, "_switch", dispatch._Switch())
    kernel_on_cpu(monkeypatch)
    gemv = {"BLOCK_N": 8, "BLOCK_K": 32, "GEMV": True}
    table({"bf16": {"32,64": {"1": gemv}}, "fp8": {"32,64": {"32": {**TUNED, "X_FP8": True}}}})
    x, w = torch.zeros(1, 64, dtype=torch.bfloat16), torch.zeros(32, 64, dtype=torch.bfloat16)
    fp8_w, xq = torch.zeros(32, 64, dtype=FP8), torch.zeros(20, 64, dtype=FP8)
    on = (dispatch.takes_kernel(x, w), dispatch.takes_fused_rows(x, w, None), dispatch.takes_kernel(x, fp8_w),
          dispatch.act_quant_kernel_config(xq, fp8_w) is not None)
    assert on == (True, True, True, True)
    dispatch.configure(False, "cpu")
    assert (dispatch.takes_kernel(x, w), dispatch.takes_fused_rows(x, w, None), dispatch.takes_kernel(x, fp8_w),
            dispatch.act_quant_kernel_config(xq, fp8_w)) == (False, False, False, None)
    assert qbase.small_m_kernel(x, w) is None and qbase.small_m_act_quant(xq, fp8_w) is None
    dispatch.configure(True, "cpu")
    assert dispatch.takes_kernel(x, w) and dispatch.act_quant_kernel_config(xq, fp8_w) is not None

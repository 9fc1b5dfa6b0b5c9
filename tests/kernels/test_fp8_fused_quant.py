"""FP8 activation quantization fused into the RMSNorm and SiLU-and-mul kernels (fp8_ops.rmsnorm_quant_fp8,
silu_and_mul_quant_fp8) and the linears that use them (fp8_linear.fp8_rmsnorm_linear, fp8_silu_and_mul_linear).

The fused kernels must give the bits of the two kernels they replace (triton_ops' RMSNorm or SiLU-and-mul,
then fp8_ops.per_token_group_quant_fp8), so the W8A8 GEMM after them computes exactly what it computed before.
Without CUDA the kernels run in Triton's CPU interpreter (tests/triton_mode.py), the per-token GEMM in torch's
CPU _scaled_mm; the layers are allowed the fused path on the CPU by adding it to FUSED_QUANT_DEVICES.
"""

from __future__ import annotations

import pytest
import torch

from tests import triton_mode
from tests.triton_mode import DEVICE, in_process

if not triton_mode.RERUN_IN_SUBPROCESS:
    from model_executor.layers import triton_ops
    from model_executor.layers.quantization import fp8_linear as fl
    from model_executor.layers.quantization import fp8_math as fm
    from model_executor.layers.quantization import fp8_ops
    from model_executor.layers.triton_ops import small_m_gemm_dispatch as dispatch

test_in_subprocess = triton_mode.subprocess_test(__file__)


def _rows(m: int, n: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(m, n, generator=gen) * torch.logspace(-1, 1, n)).to(DEVICE, torch.bfloat16)


def _same_codes(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == b.dtype == fm.FP8_DTYPE and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@in_process
@pytest.mark.parametrize("m,n,group,residual", [
    (5, 320, 320, True),  # per token, a row not a power of two (masked columns)
    (3, 256, 256, False),  # per token, no residual
    (4, 384, 128, True),  # the block-wise checkpoints' groups of 128, three of them in a block of 512
    (2, 256, 64, False),
])
def test_rmsnorm_quant_has_the_bits_of_rmsnorm_then_quant(m, n, group, residual):
    x, res = _rows(m, n, 0), _rows(m, n, 1) if residual else None
    x[1] = 0  # (with the residual a row of its sum is not zero; without, an all-zero row gets the tiny scale)
    weight = (torch.rand(n, generator=torch.Generator().manual_seed(2)) + 0.5).to(DEVICE, torch.bfloat16)
    q, s, h = fp8_ops.rmsnorm_quant_fp8(x, res, weight, 1e-5, group)
    normed = triton_ops.rmsnorm(x, weight, 1e-5, res)
    normed, h_ref = normed if residual else (normed, None)
    q_ref, s_ref = fp8_ops.per_token_group_quant_fp8(normed, group)
    _same_codes(q, q_ref)
    assert s.shape == (m, n // group) and torch.equal(s, s_ref)
    assert (h is None) == (not residual)
    if residual:
        assert torch.equal(h, h_ref)
    assert torch.isfinite(s).all() and (s > 0).all()


@in_process
@pytest.mark.parametrize("m,inter,group", [(3, 320, 320), (4, 384, 128), (2, 256, 64)])
def test_silu_and_mul_quant_has_the_bits_of_silu_and_mul_then_quant(m, inter, group):
    x = _rows(m, 2 * inter, 3)
    q, s = fp8_ops.silu_and_mul_quant_fp8(x, group)
    q_ref, s_ref = fp8_ops.per_token_group_quant_fp8(triton_ops.silu_and_mul(x), group)
    _same_codes(q, q_ref)
    assert s.shape == (m, inter // group) and torch.equal(s, s_ref)


@in_process
def test_fused_quant_fits_refuses_what_the_kernels_cannot_take():
    assert fp8_ops.fused_quant_fits(4096, 4096) and fp8_ops.fused_quant_fits(14336, 14336)
    assert fp8_ops.fused_quant_fits(5120, 128)
    assert not fp8_ops.fused_quant_fits(5120, 96)  # a group not a power of two inside a row
    assert not fp8_ops.fused_quant_fits(384, 256)  # groups that do not tile the row
    assert not fp8_ops.fused_quant_fits(32768, 32768)  # wider than one pass in registers


def _layer(quant: str, cls_name: str, k: int, n: int, bias: bool):
    from model_executor.layers import linear
    from model_executor.layers.quantization import QuantConfig, quantization_context, restore_kept_dtypes

    block = (32, 32) if quant == "fp8_block" else None
    with quantization_context(QuantConfig(quant, block=block)):
        layer = getattr(linear, cls_name)(k, n, bias=bias, tp_rank=0, tp_size=1).to(torch.bfloat16)
    restore_kept_dtypes(layer)
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(n)) * 0.1
    if quant == "fp8_block":
        q, s = fm.quantize_fp8_block(w, block)
        layer.weight.data.copy_(q)
        layer.weight_scale_inv.data.copy_(s)
    else:
        layer.weight_loader(layer.weight, w.to(torch.bfloat16))
    if bias:
        layer.bias.data.copy_(torch.randn(n, generator=torch.Generator().manual_seed(7)))
    return layer.to(DEVICE), block


class _Calls:
    """Counts calls of module attributes, still calling them."""

    def __init__(self, monkeypatch, module, *names):
        self.n = dict.fromkeys(names, 0)
        for name in names:
            real = getattr(module, name)

            def counted(*a, _name=name, _real=real, **kw):
                self.n[_name] += 1
                return _real(*a, **kw)

            monkeypatch.setattr(module, name, counted)


@pytest.fixture
def fused_on_cpu(monkeypatch):
    monkeypatch.setattr(dispatch, "DEVICES", ("cuda", "cpu"))
    monkeypatch.setattr(fl, "FUSED_QUANT_DEVICES", ("cuda", "cpu"))


@in_process
@pytest.mark.parametrize("quant", ["fp8", "fp8_block"])
@pytest.mark.parametrize("residual", [True, False])
def test_qkv_layer_quantizes_in_the_norm_kernel_above_16_rows(quant, residual, fused_on_cpu, monkeypatch):
    """forward_normed at 20 rows: one RMSNorm-and-quantize kernel, no quantization kernel of its own, and the
    bits of RMSNorm, then quantization, then the same GEMM. At 4 rows it keeps the small-M path (None)."""
    from model_executor.layers.norm import RMSNorm

    k, n = 96, 80
    layer, block = _layer(quant, "ColumnParallelLinear", k, n, bias=True)
    norm = RMSNorm(k, eps=1e-5).to(DEVICE, torch.bfloat16)
    norm.weight.data.copy_(torch.rand(k, generator=torch.Generator().manual_seed(4)) + 0.5)
    x, res = _rows(20, k, 5), _rows(20, k, 6) if residual else None
    scale = layer.weight_scale_inv if block else layer.weight_scale
    with torch.no_grad():
        normed = triton_ops.rmsnorm(x, norm.weight, norm.eps, res)
        normed, h_ref = normed if residual else (normed, x)
        xq, xs = fp8_ops.per_token_group_quant_fp8(normed, block[1] if block else k)
        y_ref = fl._w8a8(xq, xs, layer.weight, scale, layer.bias, block, torch.bfloat16)
        calls = _Calls(monkeypatch, fp8_ops, "_rmsnorm_quant_impl", "_per_token_group_quant_impl")
        y, h = layer.forward_normed(norm, x, res)
        assert calls.n == {"_rmsnorm_quant_impl": 1, "_per_token_group_quant_impl": 0}
        assert torch.equal(y, y_ref) and torch.equal(h, h_ref)
        assert layer.forward_normed_quantized(norm, x[:4], None if res is None else res[:4]) is None


@in_process
@pytest.mark.parametrize("quant", ["fp8", "fp8_block"])
def test_qkv_layer_runs_the_x_fp8_kernel_on_the_norm_kernels_codes(quant, fused_on_cpu, monkeypatch, tmp_path):
    """With an X_FP8 table entry for the weight (per-channel or block scales), the W8A8 GEMM after the
    RMSNorm-and-quantize kernel is the small-M kernel on FP8 operands: its output is the float32 math of the
    norm kernel's codes and scales (block: x's scales per 1 x 32 group) within a bf16 rounding."""
    import json

    from model_executor.layers.norm import RMSNorm
    from model_executor.layers.triton_ops import small_m_gemm as sm
    from model_executor.layers.triton_ops import small_m_gemm_config as smc

    k, n = 96, 80
    layer, block = _layer(quant, "ColumnParallelLinear", k, n, bias=True)
    monkeypatch.setattr(smc, "CONFIG_DIR", tmp_path)
    entry = {"BLOCK_N": 32, "BLOCK_K": 32, "SPLIT_K": 1, "num_warps": 4, "num_stages": 2, "X_FP8": True}
    (tmp_path / f"small_m_gemm_{sm.device_name('cpu')}.json").write_text(json.dumps({quant: {f"{n},{k}": {"32": entry}}}))
    sm.forget_tables()
    monkeypatch.setattr(dispatch, "device_key", lambda x: sm.device_name("cpu"))  # (a CUDA host's name for its table)
    norm = RMSNorm(k, eps=1e-5).to(DEVICE, torch.bfloat16)
    x, res = _rows(20, k, 5), _rows(20, k, 6)
    scale = layer.weight_scale_inv if block else layer.weight_scale
    calls = _Calls(monkeypatch, sm, "small_m_linear_fp8_act")
    try:
        with torch.no_grad():
            y, _ = layer.forward_normed(norm, x, res)
            xq, xs, _ = fp8_ops.rmsnorm_quant_fp8(x, res, norm.weight, norm.eps, block[1] if block else k)
    finally:
        sm.forget_tables()
    assert calls.n == {"small_m_linear_fp8_act": 1}
    w_deq = fm.dequantize_fp8_block(layer.weight.cpu(), scale.cpu(), block) if block else \
        layer.weight.float().cpu() * scale.cpu()[:, None]
    x_deq = xq.float().cpu() * (xs.cpu().repeat_interleave(block[1], dim=1) if block else xs.cpu())
    ref = x_deq @ w_deq.t() + layer.bias.float().cpu()
    torch.testing.assert_close(y.float().cpu(), ref, rtol=2.0**-7, atol=1e-4)


@in_process
@pytest.mark.parametrize("quant", ["fp8", "fp8_block"])
def test_down_layer_quantizes_in_the_silu_kernel_above_16_rows(quant, fused_on_cpu, monkeypatch):
    k, n = 64, 48
    layer, block = _layer(quant, "RowParallelLinear", k, n, bias=False)
    gate_up = _rows(20, 2 * k, 8)
    scale = layer.weight_scale_inv if block else layer.weight_scale
    with torch.no_grad():
        xq, xs = fp8_ops.per_token_group_quant_fp8(triton_ops.silu_and_mul(gate_up), block[1] if block else k)
        y_ref = fl._w8a8(xq, xs, layer.weight, scale, None, block, torch.bfloat16)
        calls = _Calls(monkeypatch, fp8_ops, "_silu_and_mul_quant_impl", "_per_token_group_quant_impl")
        y = layer.forward_gated(gate_up)
        assert calls.n == {"_silu_and_mul_quant_impl": 1, "_per_token_group_quant_impl": 0}
        assert torch.equal(y, y_ref)
        assert layer.forward_gated(gate_up[:16]) is None  # decode-sized: the caller's small-M path


@in_process
def test_static_input_scales_and_unquantized_layers_keep_their_path(monkeypatch):
    """A static per-tensor input scale is not the fused kernels' dynamic scale: that method, like an
    unquantized layer, has no fused input (None, the caller's path), even where the fused kernels would run."""
    from model_executor.layers.linear import RowParallelLinear
    from model_executor.layers.quantization import QuantConfig, quantization_context

    monkeypatch.setattr(fl, "FUSED_QUANT_DEVICES", ("cuda", "cpu"))
    for quant in (QuantConfig("fp8_channel", static_input_scale=True), None):
        with quantization_context(quant):
            layer = RowParallelLinear(64, 48, tp_rank=0, tp_size=1)
        assert layer.quant_method.apply_gated(layer, torch.zeros(20, 128, dtype=torch.bfloat16)) is None


@in_process
def test_traced_pieces_pick_the_path_on_the_real_row_count(fused_on_cpu):
    """Under dynamo (the piecewise runner) the fused linear is one opaque op traced once for a symbolic row
    count; each call must still compute what eager computes at its size (small-M up to 16, fused above)."""
    from model_executor.layers.norm import RMSNorm

    layer, _ = _layer("fp8", "ColumnParallelLinear", 96, 64, bias=True)  # (CUDA's _scaled_mm: K % 16 == 0)
    norm = RMSNorm(96, eps=1e-5).to(DEVICE, torch.bfloat16)
    down, _ = _layer("fp8", "RowParallelLinear", 32, 96, bias=False)

    def piece(x, res):
        y, h = layer.forward_normed(norm, x, res)
        return down.forward_gated(y), h

    def eager(x, res):  # outside the trace: the fused ops above 16 rows; below, the kernels' norm and SiLU
        out = layer.forward_normed_quantized(norm, x, res)  # (the CPU's RMSNorm module is not the kernel)
        if out is None:
            normed, h = triton_ops.rmsnorm(x, norm.weight, norm.eps, res)
            out = layer(normed), h
        y, h = out
        gated = down.forward_gated(y)
        return (gated if gated is not None else down(triton_ops.silu_and_mul(y))), h

    fn = torch.compile(piece, dynamic=True, fullgraph=True, backend="eager")
    torch._dynamo.reset()
    try:
        with torch.no_grad():
            for m in (17, 4, 16, 20):
                x, res = _rows(m, 96, m), _rows(m, 96, m + 50)
                got, want = fn(x, res), eager(x, res)
                assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), m
    finally:
        torch._dynamo.reset()


def _w8a8_per_token(layer, x):
    """The layer's W8A8 GEMM after the per-token quantization kernel (what a CUDA tensor's fp8_linear runs)."""
    xq, xs = fp8_ops.per_token_group_quant_fp8(x, x.shape[-1])
    return fl._w8a8(xq, xs, layer.weight, layer.weight_scale, layer.bias, None, x.dtype)


@in_process
def test_llama_mlp_after_attention_quantizes_in_the_norm_and_silu_kernels(tiny_llama, fused_on_cpu, monkeypatch):
    """The decoder layer's path at 20 rows: o_proj (its own quantization kernel), then the post-attention
    RMSNorm quantizing for gate/up and SiLU-and-mul quantizing for down; the bits of the unfused kernels."""
    from model_executor.layers.linear import RowParallelLinear
    from model_executor.layers.norm import RMSNorm
    from model_executor.layers.quantization import QuantConfig, quantization_context, restore_kept_dtypes
    from model_executor.model_config import ModelConfig
    from model_executor.models.llama import LlamaMLP

    cfg = ModelConfig.from_pretrained(tiny_llama[0])
    h_size = cfg.hidden_size
    with quantization_context(QuantConfig("fp8")):
        mlp, o_proj = LlamaMLP(cfg), RowParallelLinear(h_size, h_size, tp_rank=0, tp_size=1)
    gen = torch.Generator().manual_seed(9)
    for module in (mlp, o_proj):
        module.to(torch.bfloat16)
        restore_kept_dtypes(module)
        for layer in (m for m in module.modules() if hasattr(m, "quant_method")):
            layer.quant_method.init_random(layer, gen, 0.1)
    mlp, o_proj = mlp.to(DEVICE), o_proj.to(DEVICE)
    norm = RMSNorm(h_size, eps=1e-5).to(DEVICE, torch.bfloat16)
    x, res = _rows(20, h_size, 10), _rows(20, h_size, 11)
    with torch.no_grad():
        normed, h_ref = triton_ops.rmsnorm(o_proj(x), norm.weight, norm.eps, res)
        gate_up = _w8a8_per_token(mlp.gate_up_proj, normed)
        want = _w8a8_per_token(mlp.down_proj, triton_ops.silu_and_mul(gate_up))
        calls = _Calls(monkeypatch, fp8_ops, "_rmsnorm_quant_impl", "_silu_and_mul_quant_impl",
                       "_per_token_group_quant_impl")
        hidden, residual = o_proj.forward_residual(x, res, (norm, mlp.gate_up_proj), after_attention=True)
        got, h = mlp(hidden, residual, norm)
    o_proj_quant = int(DEVICE == "cuda")  # o_proj's input (on a CPU, _fp8_linear_impl's float32 reference)
    assert calls.n == {"_rmsnorm_quant_impl": 1, "_silu_and_mul_quant_impl": 1,
                       "_per_token_group_quant_impl": o_proj_quant}
    assert torch.equal(got, want) and torch.equal(h, h_ref)

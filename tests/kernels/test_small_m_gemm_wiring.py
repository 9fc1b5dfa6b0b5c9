"""The layers' use of the small-M GEMM: the linear methods, the LM head, the FP8 linear under tracing, the norm,
activation and rotary fusions of the Llama block, and a decode step of a tiny Llama with each fusion on; with
--disable-small-m-gemm every linear keeps its plain path.

The kernel runs in Triton's CPU interpreter, CPU tensors standing in for CUDA ones (the `_gpu` tests run it on the
device).
"""

from __future__ import annotations

import pytest
import torch

from tests import triton_mode
from tests.small_m_helpers import assert_matches_reference, install_table, kernel_on_cpu, reference
from tests.triton_mode import DEVICE, in_process, interpreter_only

if not triton_mode.RERUN_IN_SUBPROCESS:
    from model_executor.layers.quantization import base as qbase
    from model_executor.layers.quantization import fp8_math as fm
    from model_executor.layers.triton_ops import small_m_gemm as sm
test_in_subprocess = triton_mode.subprocess_test(__file__)


@pytest.fixture
def table(tmp_path, monkeypatch):
    """write(dict) puts a config table for this device ("cpu" here) where the loader looks."""
    yield from install_table(tmp_path, monkeypatch)


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
    kernel_on_cpu(monkeypatch)
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

    kernel_on_cpu(monkeypatch)
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


@interpreter_only
@pytest.mark.parametrize("quant", ["fp8", "fp8_block"])
def test_fp8_linear_traced_once_picks_its_path_per_row_count(quant, table, monkeypatch):
    """The piecewise runner traces its pieces once for a symbolic token count and captures them at several
    sizes: an FP8 linear inside must still run the kernel eager would run at each size (weight-only small-M
    up to 16 rows, W8A8 above), so a padded small batch in a graph computes what it computes eagerly."""
    kernel_on_cpu(monkeypatch)
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

    kernel_on_cpu(monkeypatch)
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
    """LlamaMLP (norm -> gate_up -> SiLU-and-mul -> down) at a decode row runs gate/up + SiLU-and-mul as one
    kernel (the table's GEMV for the [2I, K] weight) with the unfused path's bits; at two rows the linear and
    SiluAndMul run apart until the table gives two rows a GEMV too, and then two rows fuse with the unfused
    bits."""
    from model_executor.layers.norm import RMSNorm
    from model_executor.layers.triton_ops import ops as triton_ops

    kernel_on_cpu(monkeypatch)
    mlp, gen = _tiny_mlp(quant, table)
    hidden = mlp.gate_up_proj.weight.shape[1]
    norm = RMSNorm(hidden, eps=1e-5).to(torch.bfloat16)
    norm.weight.data.copy_(torch.rand(hidden, generator=gen) + 0.5)
    fused = []
    real = sm.small_m_silu_and_mul

    def counted(*a, **kw):
        out = real(*a, **kw)
        if out is not None:
            fused.append(out.shape[0])
        return out

    monkeypatch.setattr(sm, "small_m_silu_and_mul", counted)
    x, res = torch.randn(2, 2, hidden, generator=gen).to(torch.bfloat16)

    def unfused(mlp, rows, residual):
        normed, h = norm(rows, residual)
        # (on a GPU SiluAndMul runs this Triton kernel; on a CPU tensor it would take torch's silu)
        return mlp.down_proj(triton_ops.silu_and_mul(mlp.gate_up_proj(normed))), h

    def same(got, want):
        return all(torch.equal(a, b) for a, b in zip(got, want, strict=True))

    with torch.no_grad():
        assert same(mlp(x[:1], res[:1], norm), unfused(mlp, x[:1], res[:1])) and fused == [1]
        mlp(x, res, norm)
        assert fused == [1]  # two rows: the linear and SiluAndMul
        mlp, _ = _tiny_mlp(quant, table, rows=("1", "2"))  # (the same weights; the table has a two-row GEMV)
        assert same(mlp(x, res, norm), unfused(mlp, x, res)) and fused == [1, 2]


@interpreter_only
def test_llama_decode_row_folds_the_input_norm_into_qkv(tiny_llama, table, monkeypatch):
    """A bf16 Llama decode step of one request: every layer's input norm runs inside its qkv GEMV (none
    falling back), and the logits stay within bf16 rounding of the same step with the norms run apart."""
    from runners.model_runner import ModelRunner, RunnerConfig
    from tests.runners.test_cuda_graph_runner import make_decode_batch, release

    kernel_on_cpu(monkeypatch)
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

    kernel_on_cpu(monkeypatch)
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
    from model_executor.layers import linear as linear_layers
    from model_executor.layers.attention.triton_backend import TritonAttnBackend
    from model_executor.layers.norm import RMSNorm
    from runners.model_runner import ModelRunner, RunnerConfig
    from tests.runners.test_cuda_graph_runner import make_decode_batch, release

    kernel_on_cpu(monkeypatch)
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
    real_norm = RMSNorm.forward
    monkeypatch.setattr(RMSNorm, "forward", lambda self, *a: calls["norm"].append(1) or real_norm(self, *a))
    linear_add_rmsnorm = linear_layers.linear_add_rmsnorm
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
            monkeypatch.setattr(linear_layers, "linear_add_rmsnorm", lambda *a, **kw: None)
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
    monkeypatch.setattr(linear_layers, "linear_add_rmsnorm", linear_add_rmsnorm)
    for v in calls.values():
        v.clear()
    with torch.no_grad():
        fb, rows, _ = make_decode_batch(runner, 1, seed=7, max_prompt=2, min_prompt=1)
    release(runner, rows, fb)
    assert calls["add_norm"] == [True, False] * (layers - 1) + [True] and len(calls["norm"]) == 1


@interpreter_only
def test_disable_small_m_gemm_runs_every_linear_on_its_plain_path(tiny_llama, table, monkeypatch):
    """RunnerConfig(disable_small_m_gemm=True) (the server's --disable-small-m-gemm): a decode step whose every
    linear the table gives a fusing GEMV launches no small-M kernel, and its logits are the plain path's bits
    (the kernel not allowed on this device); with the path on, the same step runs the kernel."""
    from model_executor.layers.triton_ops import small_m_gemm_dispatch as dispatch
    from runners.model_runner import ModelRunner, RunnerConfig
    from tests.runners.test_cuda_graph_runner import make_decode_batch, release

    monkeypatch.setattr(dispatch, "_switch", dispatch._Switch())  # (the runner sets it for the process)
    kernel_on_cpu(monkeypatch)
    gemv = {"1": {"BLOCK_N": 8, "BLOCK_K": 32, "GEMV": True}}
    table({"bf16": dict.fromkeys(("128,64", "64,64", "256,64", "64,128", "320,64"), gemv)})  # every linear, LM head
    runner = ModelRunner(RunnerConfig(model_path=str(tiny_llama[0]), device=DEVICE, dtype="bfloat16",
                                      max_running_requests=2, max_total_tokens=256, disable_cuda_graph=True,
                                      disable_piecewise_cuda_graph=True, disable_small_m_gemm=True))
    assert not dispatch.enabled()
    launches = []
    real = sm._launch
    monkeypatch.setattr(sm, "_launch", lambda *a, **kw: launches.append(a[0].shape[0]) or real(*a, **kw))
    fb, rows, _ = make_decode_batch(runner, 1, seed=4, max_prompt=12)
    try:
        with torch.no_grad():
            launches.clear()
            off = runner.forward_eager(fb).float()
            assert launches == []
            dispatch.configure(True, DEVICE)
            on = runner.forward_eager(fb).float()
            assert len(launches) >= runner.model_config.num_hidden_layers
            monkeypatch.setattr(dispatch, "DEVICES", ("cuda",))
            plain = runner.forward_eager(fb).float()
    finally:
        release(runner, rows, fb)
    assert torch.equal(off, plain) and on.argmax(-1).tolist() == plain.argmax(-1).tolist()

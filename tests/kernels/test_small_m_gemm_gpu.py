"""The small-M GEMM kernel on the GPU: real layer shapes at M 1..16 (GEMVs at 1..4) against a float32 reference of the
dequantized weight, bitwise determinism and graph replay of the kernel itself, and a decode graph replay
against eager with the kernel in every linear (bf16 through a table that selects it; FP8 by default)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from model_executor.configs import shape_path
from model_executor.layers.quantization import fp8_math as fm
from model_executor.layers.triton_ops import small_m_gemm as sm
from model_executor.layers.triton_ops import small_m_gemm_config as smc

pytestmark = pytest.mark.gpu

# 1B qkv and down, 8B gate_up and down, 1B qkv at tp 2
SHAPES = [(3072, 2048), (2048, 8192), (28672, 4096), (4096, 14336), (1536, 2048)]
SPLIT_CFG = sm.GemmConfig(BLOCK_N=32, BLOCK_K=128, SPLIT_K=8, num_warps=4, num_stages=4)


def weight(kind: str, n: int, k: int, seed: int):
    """(weight, scale, block, dequantized float32 weight) on the GPU."""
    w = torch.randn(n, k, device="cuda", generator=torch.Generator("cuda").manual_seed(seed)) * 0.02
    if kind == "bf16":
        w = w.bfloat16()
        return w, None, None, w.float()
    if kind == "fp8":
        q, s = fm.quantize_fp8_per_channel(w)
        return q, s, None, q.float() * s[:, None]
    q, s = fm.quantize_fp8_block(w, (128, 128))
    return q, s, (128, 128), fm.dequantize_fp8_block(q, s, (128, 128))


def check(out: torch.Tensor, ref: torch.Tensor) -> None:
    """One bf16 rounding on top of float32 sums in another order than the reference's: at most one ulp (2^-7
    relative: near a rounding midpoint the other order may round to the other neighbour), plus an absolute
    thousandth of the largest output for values near zero."""
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref, rtol=2.0**-7, atol=1e-3 * ref.abs().max().item())


@pytest.mark.parametrize("kind", ["bf16", "fp8", "fp8_block"])
@pytest.mark.parametrize("n,k", SHAPES)
def test_kernel_matches_float32_reference(kind, n, k):
    w, s, block, w_deq = weight(kind, n, k, seed=n + k)
    bias = torch.randn(n, device="cuda").bfloat16()
    # GEMVs of 1-4 rows, split and not (block FP8: K steps within a scale block)
    gemvs = [sm.GemmConfig(BLOCK_N=8, BLOCK_K=128 if block else 512, SPLIT_K=split, num_stages=3, GEMV=True)
             for split in (1, 4)]
    for m in (1, 2, 3, 4, 8, 13, 16):
        x = torch.randn(m, k, device="cuda").bfloat16()
        ref = x.float() @ w_deq.t() + bias.float()
        more = gemvs if m <= sm.MAX_GEMV_ROWS else []
        for cfg in (None, SPLIT_CFG, sm.default_config(m, n, k, kind), *more):  # None: the table's / the default
            out = sm.small_m_linear(x, w, s, bias, block, config=cfg)
            check(out, ref)


@pytest.mark.parametrize("kind", ["bf16", "fp8_block"])
def test_deterministic_and_graph_replay_is_bitwise_eager(kind):
    n, k = 2048, 8192
    w, s, block, _ = weight(kind, n, k, seed=1)
    x = torch.randn(5, k, device="cuda").bfloat16()
    eager = sm.small_m_linear(x, w, s, None, block, config=SPLIT_CFG)
    for _ in range(20):  # whichever split of a tile arrives last adds the tile's partials, in split order
        assert torch.equal(eager, sm.small_m_linear(x, w, s, None, block, config=SPLIT_CFG))
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = sm.small_m_linear(x, w, s, None, block, config=SPLIT_CFG)
    x.copy_(torch.randn_like(x))  # the replay reads new inputs from the same buffer
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, sm.small_m_linear(x, w, s, None, block, config=SPLIT_CFG))


def install_table(tmp_path, monkeypatch, text: str) -> None:
    """Make `text` the small-M table the loader reads for this GPU (until monkeypatch undoes it)."""
    (tmp_path / smc.table_path(sm.device_name("cuda")).name).write_text(text)
    monkeypatch.setattr(smc, "CONFIG_DIR", tmp_path)
    sm.forget_tables()


@pytest.fixture
def kernel_table(tmp_path, monkeypatch):
    """A table that puts every bf16 GEMM of llama-3.2-1b (the LM head too) on the kernel at every M bucket,
    with split-K, so the decode graphs run it (no tuned table needed): GEMVs up to 4 rows (split: nothing
    fused into them), tl.dot tiles above."""
    from benchmarks.tuning.tune_small_m_gemm import linear_shapes, lm_head_shape
    from model_executor.model_config import ModelConfig

    cfg = {"BLOCK_N": 32, "BLOCK_K": 128, "SPLIT_K": 2, "num_warps": 4, "num_stages": 4}
    gemv = {"BLOCK_N": 8, "BLOCK_K": 256, "SPLIT_K": 2, "num_warps": 4, "num_stages": 3, "GEMV": True}
    model = ModelConfig.from_pretrained(shape_path("llama-3.2-1b"))
    shapes = {*linear_shapes(model, 1).values(), lm_head_shape(model, 1)}
    table = {"bf16": {f"{n},{k}": {str(m): gemv if m <= sm.MAX_GEMV_ROWS else cfg for m in sm.M_BUCKETS}
                      for n, k in shapes}}
    install_table(tmp_path, monkeypatch, json.dumps(table))
    yield
    sm.forget_tables()


@pytest.fixture
def h200_table(tmp_path, monkeypatch):
    """The server's H200 table under this GPU's name (a no-op on an H200): for the tests that take the table's
    configs at shapes where it gives single-split GEMVs (another card's table may not, or have no FP8 entries)."""
    install_table(tmp_path, monkeypatch, smc.table_path("NVIDIA_H200").read_text())
    yield
    sm.forget_tables()


@pytest.mark.parametrize("quantization", [None, "fp8"])
def test_decode_graph_replay_equals_eager_with_the_kernel(kernel_table, quantization, monkeypatch):
    from runners.cuda_graph_runner import CudaGraphRunner
    from runners.model_runner import ModelRunner, RunnerConfig
    from tests.runners.test_cuda_graph_runner import make_decode_batch, release

    runner = ModelRunner(RunnerConfig(
        model_path=str(shape_path("llama-3.2-1b")), device="cuda", attention_backend="triton",
        max_running_requests=24, max_total_tokens=24 * 64, context_length=128, random_weights=True,
        disable_cuda_graph=True, disable_piecewise_cuda_graph=True, quantization=quantization))
    graphs = CudaGraphRunner(runner, [1, 2, 4, 8, 16])
    calls = []
    real = sm.small_m_linear
    monkeypatch.setattr(sm, "small_m_linear", lambda *a, **kw: calls.append(a[0].shape[0]) or real(*a, **kw))
    for bs in (1, 3, 8, 13, 16):
        fb, rows, _ = make_decode_batch(runner, bs, seed=bs)
        calls.clear()
        with torch.inference_mode():
            eager = runner.forward_eager(fb).clone()
            graphed = graphs.replay(fb).clone()
        release(runner, rows, fb)
        layers = runner.model_config.num_hidden_layers
        assert calls == [bs] * (4 * layers + 1), f"the kernel ran {len(calls)} times, not in every GEMM"
        diff = (graphed - eager).abs().max().item()
        print(f"\n{quantization or 'bf16'} bs={bs}: graph vs eager max |diff| {diff:.2e}")
        # Every GEMM is the same kernel and config in both (padded rows do not change real ones); the rest
        # of the step is what test_cuda_graph_gpu checks with this tolerance.
        torch.testing.assert_close(graphed, eager, rtol=2e-2, atol=2e-2)
    del graphs, runner


@pytest.mark.parametrize("quantization", [None, "fp8"])
def test_disable_small_m_gemm_keeps_every_linear_off_the_kernel(kernel_table, quantization, monkeypatch):
    """--disable-small-m-gemm (RunnerConfig.disable_small_m_gemm) on the GPU: with a table that puts every bf16
    GEMM on the kernel (FP8 takes it untuned up to 16 rows), decode steps of 1 and 8 rows launch no small-M
    kernel: bf16 runs cuBLAS, FP8 the W8A8 GEMM."""
    from model_executor.layers.triton_ops import small_m_gemm_dispatch as dispatch
    from runners.model_runner import ModelRunner, RunnerConfig
    from tests.runners.test_cuda_graph_runner import make_decode_batch, release

    monkeypatch.setattr(dispatch, "_switch", dispatch._Switch())  # (the runner sets it for the process)
    runner = ModelRunner(RunnerConfig(
        model_path=str(shape_path("llama-3.2-1b")), device="cuda", attention_backend="triton",
        max_running_requests=8, max_total_tokens=8 * 64, context_length=128, random_weights=True,
        disable_cuda_graph=True, disable_piecewise_cuda_graph=True, quantization=quantization,
        disable_small_m_gemm=True))
    launches = []
    real = sm._launch
    monkeypatch.setattr(sm, "_launch", lambda *a, **kw: launches.append(a[0].shape[0]) or real(*a, **kw))
    for bs in (1, 8):
        fb, rows, _ = make_decode_batch(runner, bs, seed=bs)
        launches.clear()
        with torch.inference_mode():
            logits = runner.forward_eager(fb)
        release(runner, rows, fb)
        assert launches == [] and torch.isfinite(logits).all()
    del runner


@pytest.mark.parametrize("kind", ["bf16", "fp8", "fp8_block"])
@pytest.mark.parametrize("n2,k", [(16384, 2048), (28672, 4096)])  # 1B and 8B gate_up
def test_fused_silu_and_mul_equals_the_gemv_then_silu_and_mul(kind, n2, k):
    """One decode row: the fused gate/up GEMV + SiLU-and-mul against the same GEMV (the same rows per program)
    followed by the SiLU-and-mul kernel, and against a float32 reference."""
    from model_executor.layers.triton_ops import ops as triton_ops

    w, s, block, w_deq = weight(kind, n2, k, seed=n2)
    x = torch.randn(1, k, device="cuda").bfloat16()
    for bn, bk in ((4, 1024), (8, 512)):
        bk = min(bk, block[1]) if block else bk
        cfg = sm.GemmConfig(BLOCK_N=bn, BLOCK_K=bk, GEMV=True, num_stages=3)
        fused = sm.small_m_silu_and_mul(x, w, s, block, config=cfg)
        gate_up = sm.small_m_linear(x, w, s, None, block, config=cfg)
        unfused = triton_ops.silu_and_mul(gate_up)
        # Not bitwise on the GPU (two compiled kernels; a last-bit difference in a few gate or up sums):
        # within one bf16 rounding, and nearly every value equal. (Graph replay equals eager regardless: both
        # run the fused kernel at one row.)
        # (a one-ulp gate or up difference can move silu(gate) * up by two roundings near zero)
        torch.testing.assert_close(fused.float(), unfused.float(), rtol=2.0**-6,
                                   atol=1e-4 * unfused.float().abs().max().item())
        assert (fused != unfused).float().mean().item() < 0.01
    ref = x.float() @ w_deq.t()
    inter = n2 // 2
    act = torch.nn.functional.silu(ref[:, :inter]) * ref[:, inter:]
    torch.testing.assert_close(fused.float(), act, rtol=2.0**-6, atol=1e-3 * act.abs().max().item())


@pytest.mark.parametrize("kind", ["bf16", "fp8", "fp8_block"])
@pytest.mark.parametrize("n,k", [(3072, 2048), (6144, 4096), (5120, 2048)])  # 1B, 8B, Qwen3-30B qkv
@pytest.mark.parametrize("m", [1, 2, 4])
def test_fused_rmsnorm_matches_float32_reference_and_replays(kind, n, k, m):
    """1, 2 or 4 decode rows: the residual add and RMSNorm folded into the GEMV against a float32 reference
    of the dequantized weight from the kernel's sum h, h with torch's bits, and a graph replay of the fused
    kernel with eager's bits."""
    w, s, block, w_deq = weight(kind, n, k, seed=n + k)
    x = (torch.randn(m, k, device="cuda") * torch.tensor([3.0, 0.2, 30.0, 1.0], device="cuda")[:m, None]).bfloat16()
    residual = (torch.randn(m, k, device="cuda") * 5).bfloat16()
    g = (torch.rand(k, device="cuda") + 0.5).bfloat16()
    for bn, bk in ((8, 1024), (16, 512)):
        bk = min(bk, block[1]) if block else bk
        cfg = sm.GemmConfig(BLOCK_N=bn, BLOCK_K=bk, GEMV=True, num_stages=3)
        y, h = sm.small_m_rmsnorm_linear(x, g, 1e-5, residual, w, s, None, block, config=cfg)
        assert torch.equal(h, x + residual)
        hf = h.float()
        check(y, (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + 1e-5) * g.float()) @ w_deq.t())
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured, captured_h = sm.small_m_rmsnorm_linear(x, g, 1e-5, residual, w, s, None, block, config=cfg)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    y, h = sm.small_m_rmsnorm_linear(x, g, 1e-5, residual, w, s, None, block, config=cfg)
    assert torch.equal(captured, y) and torch.equal(captured_h, h)


# 1B and 8B (o_proj square: q heads x head_dim = hidden); the shapes whose table configs are single-split
# GEMVs for both weights (1B FP8's gate/up is a tl.dot tile, fp8_block has no entries: they keep three kernels)
@pytest.mark.parametrize("kind,hidden,inter", [("bf16", 2048, 8192), ("bf16", 4096, 14336), ("fp8", 4096, 14336)])
def test_o_proj_add_rmsnorm_then_gate_up_silu_matches_reference_and_replays(h200_table, kind, hidden, inter):
    """One decode row: o_proj with the residual add and the norm's sums in its epilogue, then the gate/up
    + SiLU GEMV on the pre-normed row (the table's configs). h is the plain GEMV plus the residual (torch's
    bits); the activation is silu(gate) * up of a float32 reference of RMSNorm(h) from the kernel's h within
    the unfused path's roundings; the three-kernel path agrees as closely; a graph replay has eager's bits."""
    from model_executor.layers.triton_ops import ops as triton_ops

    w, s, block, _ = weight(kind, hidden, hidden, seed=hidden)
    gw, gs, gblock, g_deq = weight(kind, 2 * inter, hidden, seed=inter)
    x = torch.randn(1, hidden, device="cuda").bfloat16()
    residual = (torch.randn(1, hidden, device="cuda") * 5).bfloat16()
    g = (torch.rand(hidden, device="cuda") + 0.5).bfloat16()

    def fused():  # (None, failing below, if the H200 table lost these shapes' single-split GEMVs)
        row, h = sm.small_m_linear_add_rmsnorm(x, w, s, None, block, residual, g, 1e-5)
        return sm.small_m_silu_and_mul(row, gw, gs, gblock), h

    act, h = fused()
    assert torch.equal(h, sm.small_m_linear(x, w, s, None, block) + residual)
    hf = h.float()
    normed = hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + 1e-5) * g.float()
    ref = normed @ g_deq.t()
    ref = torch.nn.functional.silu(ref[:, :inter]) * ref[:, inter:]
    tol = {"rtol": 2.0**-5, "atol": 2.0**-6 * ref.abs().max().item()}  # (the weighted row's rounding, then two)
    torch.testing.assert_close(act.float(), ref, **tol)
    normed_bf16 = triton_ops.rmsnorm(h, g, 1e-5)
    unfused = sm.small_m_silu_and_mul(normed_bf16, gw, gs, gblock)
    torch.testing.assert_close(act.float(), unfused.float(), **tol)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured, captured_h = fused()
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    act, h = fused()
    assert torch.equal(captured, act) and torch.equal(captured_h, h)


@pytest.mark.parametrize("kind", ["bf16", "fp8", "fp8_block"])
@pytest.mark.parametrize("m,tiles", [(m, tiles) for tiles in ("gemv", "dot") for m in (2, 3, 4)]
                         + [(m, tiles) for tiles in ("dot", "pair_dot") for m in (8, 13)])
def test_rows_add_rmsnorm_then_prenormed_silu_and_qkv_match_reference_and_replay(kind, m, tiles):
    """2-4 decode rows (tl.dot tiles: up to 13), each with its own scale, at the 8B's shapes and single-split
    configs given here (GEMVs, or tl.dot tiles; the table's may be others at these rows): o_proj with the
    residual add and each row's sums of h^2 in its epilogue, then the gate/up + SiLU GEMV and the qkv GEMV on
    those pre-normed rows, against a float32 reference of RMSNorm(h) from the kernel's h (h itself: the plain
    GEMV plus the residual, torch's bits); the qkv GEMV with the rotary + KV store epilogue against it followed
    by rotary_store_kv; a graph replay has eager's bits."""
    hidden, inter = 4096, 14336
    w, s, block, _ = weight(kind, hidden, hidden, seed=hidden)
    gw, gs, gblock, g_deq = weight(kind, 2 * inter, hidden, seed=inter)
    qw, qs, qblock, q_deq = weight(kind, 6144, hidden, seed=6144)
    scales = torch.tensor([3.0, 0.2, 30.0, 1.0] * 4, device="cuda")[:m, None]
    x = torch.randn(m, hidden, device="cuda").bfloat16()
    residual = (torch.randn(m, hidden, device="cuda") * 5 * scales).bfloat16()
    g = (torch.rand(hidden, device="cuda") + 0.5).bfloat16()
    bk = 128 if block else 256
    if tiles == "gemv":
        o_cfg = sm.GemmConfig(BLOCK_N=8, BLOCK_K=2 * bk, GEMV=True, num_stages=3)
        paired_cfg = sm.GemmConfig(BLOCK_N=4, BLOCK_K=bk, GEMV=True, num_stages=4)
    else:  # (pair_dot: the paired kernels' 32 + 32 rows as one 64-row dot)
        o_cfg = sm.GemmConfig(BLOCK_N=32, BLOCK_K=128, num_stages=4)
        paired_cfg = dataclasses.replace(o_cfg, PAIR_DOT=tiles == "pair_dot")

    def fused():
        row, h = sm.small_m_linear_add_rmsnorm(x, w, s, None, block, residual, g, 1e-5, config=o_cfg)
        return (sm.small_m_silu_and_mul(row, gw, gs, gblock, config=paired_cfg),
                sm.small_m_prenormed_linear(row, qw, qs, None, qblock, config=o_cfg), h)

    act, qkv, h = fused()
    assert torch.equal(h, sm.small_m_linear(x, w, s, None, block, config=o_cfg) + residual)
    hf = h.float()
    normed = hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + 1e-5) * g.float()
    ref = normed @ g_deq.t()
    ref = torch.nn.functional.silu(ref[:, :inter]) * ref[:, inter:]
    torch.testing.assert_close(act.float(), ref, rtol=2.0**-5, atol=2.0**-6 * ref.abs().max().item())
    ref_qkv = normed @ q_deq.t()
    torch.testing.assert_close(qkv.float(), ref_qkv, rtol=2.0**-5, atol=2.0**-6 * ref_qkv.abs().max().item())
    # the qkv kernel with the rotary + KV store epilogue (32 q, 8 kv heads of 128) against the same kernel without
    # it, then rotary_store_kv: within one bf16 rounding, nearly all equal (as the normed qkv kernel's test checks)
    from model_executor.layers.rotary import RotaryEmbedding
    from model_executor.layers.rotary_store_kv import RopeStore, rotary_store_kv

    cache = RotaryEmbedding(128, 4096, 500000.0).cos_sin_cache.cuda()
    positions = torch.randperm(4096, device="cuda")[:m]
    loc = torch.randperm(64, device="cuda")[:m]
    pools = [torch.zeros(64, 8, 128, dtype=torch.bfloat16, device="cuda") for _ in range(4)]
    row, _ = sm.small_m_linear_add_rmsnorm(x, w, s, None, block, residual, g, 1e-5, config=o_cfg)
    plain = sm.small_m_prenormed_linear(row, qw, qs, None, qblock, config=o_cfg)
    roped = sm.small_m_prenormed_linear(row, qw, qs, None, qblock, config=o_cfg if tiles == "gemv" else paired_cfg,
                                        rope=RopeStore(positions, cache, loc, pools[0], pools[1], 32, 8))
    q_ref, k_ref, v_ref = plain.view(m, -1, 128).split([32, 8, 8], dim=1)
    rotary_store_kv(positions, q_ref, k_ref, v_ref, cache, pools[2], pools[3], loc)  # (q rotated in place)
    for got, want in ((roped, plain), (pools[0][loc], pools[2][loc]), (pools[1][loc], pools[3][loc])):
        got, want = got.float(), want.float()
        torch.testing.assert_close(got, want, rtol=2.0**-7, atol=1e-3 * want.abs().max().item())
        assert (got != want).float().mean().item() < 0.02
    assert (pools[0][loc].float().abs().sum((1, 2)) > 0).all()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = fused()
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(captured, fused()))


def assert_pdl_step_gives_the_same_bits(step) -> None:
    """step(pdl) returns tensors: launched with PDL, eagerly (twice) and over 20 replays of a graph of it, they
    have the bits of step(False), which holds no NaN."""
    ref = step(False)
    assert not any(t.isnan().any() for t in ref)
    for got in (step(True), step(True)):
        assert all(torch.equal(a, b) for a, b in zip(got, ref))
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step(True)
    for _ in range(20):
        graph.replay()
        torch.cuda.synchronize()
        assert all(torch.equal(a, b) for a, b in zip(captured, ref))


@pytest.mark.parametrize("kind", ["bf16", "fp8", "fp8_block"])
@pytest.mark.parametrize("cfg", [None, sm.GemmConfig(BLOCK_N=8, BLOCK_K=4096, num_warps=4, num_stages=1, GEMV=True),
                                 sm.GemmConfig(BLOCK_N=4, BLOCK_K=2048, num_warps=4, num_stages=2, GEMV=True)])
def test_o_proj_launched_with_pdl_after_decode_attention_waits_for_its_output(h200_table, kind, cfg):
    """Decode attention (one request, 512 tokens, Llama-3.1-8B heads) then o_proj's GEMV launched with PDL
    (after_attention: its first weight tile loaded before gdc_wait; None: preload_config's choice from the table,
    all of K for FP8 and none for bf16 at this size, which then runs without PDL; all of K; half of it),
    eagerly and in a CUDA graph whose replay first fills attention's output with NaN: the same bits as the same
    config without PDL. An o_proj that read x before attention wrote it would see NaN or stale values."""
    from model_executor.layers.attention.triton_ops import decode_attention as dec

    if kind == "fp8_block":  # (its table entry at one row is a split tl.dot tile; steps within a scale block)
        cfg = sm.GemmConfig(BLOCK_N=cfg.BLOCK_N if cfg else 8, BLOCK_K=128, num_warps=4, num_stages=3, GEMV=True)
    heads, kv_heads, d, hidden, context = 32, 8, 128, 4096, 512
    gen = torch.Generator("cuda").manual_seed(3)
    w, s, block, _ = weight(kind, hidden, hidden, seed=5)
    k_buf = torch.randn(context + 1, kv_heads, d, device="cuda", generator=gen).bfloat16()
    v_buf = torch.randn(context + 1, kv_heads, d, device="cuda", generator=gen).bfloat16()
    q = torch.randn(1, heads, d, device="cuda", generator=gen).bfloat16()
    residual = torch.randn(1, hidden, device="cuda", generator=gen).bfloat16()
    g = (torch.rand(hidden, device="cuda", generator=gen) + 0.5).bfloat16()
    req_to_token = torch.arange(context + 1, dtype=torch.int32, device="cuda")[None, :].contiguous()
    rows, lens = torch.zeros(1, dtype=torch.int64, device="cuda"), torch.tensor([context], device="cuda")
    ws = dec.alloc_decode_workspace(1, heads, d, 16, "cuda")
    o = torch.empty(1, heads, d, dtype=torch.bfloat16, device="cuda")

    def step(pdl):
        o.fill_(float("nan"))
        dec.decode_attention_fwd(q, k_buf, v_buf, o, req_to_token, rows, lens, ws.attn_logits, ws.attn_lse, 16,
                                 d**-0.5, counters=ws.counters)
        out = sm.small_m_linear_add_rmsnorm(o.view(1, hidden), w, s, None, block, residual, g, 1e-5, config=cfg,
                                            after_attention=pdl)
        assert out is not None, "no single-split GEMV config for o_proj"
        row, h = out
        return row.weighted, row.partials, h

    assert_pdl_step_gives_the_same_bits(step)


@pytest.mark.parametrize("kind,pool", [("bf16", "bf16"), ("fp8", "bf16"), ("fp8", "fp8")])
@pytest.mark.parametrize("context", [100, 512, 4096])
@pytest.mark.parametrize("bs", [1, 2])
def test_decode_attention_launched_with_pdl_after_the_qkv_kernel_waits_for_its_kv(h200_table, kind, pool, context,
                                                                                   bs):
    """The qkv GEMV with the rotary and KV store (Llama-3.1-8B shapes, one token a request) then decode attention
    launched with PDL (after_qkv: the first step's older K/V loaded before gdc_wait), eagerly and in a CUDA graph
    whose replay first fills the newest slots' K and V with NaN: the same bits as attention launched without PDL.
    An attention that read q or the newest K/V before the qkv kernel wrote them would see NaN or stale values.
    The newest position falls in a program's preloaded first step (100 and 512 tokens) or in a later one (4096);
    the second request is one token shorter."""
    from model_executor.layers.attention.triton_ops import decode_attention as dec
    from model_executor.layers.rotary import RotaryEmbedding
    from model_executor.layers.rotary_store_kv import RopeStore

    hq, hkv, d, hidden = 32, 8, 128, 4096
    gen = torch.Generator("cuda").manual_seed(context)
    w, s, block, _ = weight(kind, (hq + 2 * hkv) * d, hidden, seed=7)
    dtype, (k_scale, v_scale) = (torch.bfloat16, (1.0, 1.0)) if pool == "bf16" else (torch.float8_e4m3fn, (0.5, 2.0))
    k_pool = torch.randn(bs * context + 1, hkv, d, device="cuda", generator=gen).to(dtype)
    v_pool = torch.randn(bs * context + 1, hkv, d, device="cuda", generator=gen).to(dtype)
    x = torch.randn(bs, hidden, device="cuda", generator=gen).bfloat16()
    residual = torch.randn(bs, hidden, device="cuda", generator=gen).bfloat16()
    g = (torch.rand(hidden, device="cuda", generator=gen) + 0.5).bfloat16()
    cache = RotaryEmbedding(d, 8192, 500000.0).cos_sin_cache.cuda()
    lens = torch.tensor([context - r for r in range(bs)], device="cuda")
    req_to_token = (torch.arange(context, dtype=torch.int32, device="cuda")[None, :]
                    + context * torch.arange(bs, dtype=torch.int32, device="cuda")[:, None]).contiguous()
    rows = torch.arange(bs, device="cuda")
    newest = req_to_token[rows, lens - 1].long()
    rope = RopeStore(lens - 1, cache, newest, k_pool, v_pool, hq, hkv, k_scale, v_scale)
    splits = dec.decode_split_plan(dec.decode_split_cap(bs, hq, hkv, 132, 16), context)
    ws = dec.alloc_decode_workspace(bs, hq, d, splits, "cuda")
    o = torch.empty(bs, hq, d, dtype=torch.bfloat16, device="cuda")

    nan_bits, as_bits = (0x7F, torch.uint8) if pool == "fp8" else (0x7FC0, torch.int16)

    def step(after_qkv):
        k_pool.view(as_bits).index_fill_(0, newest, nan_bits)
        v_pool.view(as_bits).index_fill_(0, newest, nan_bits)
        out = sm.small_m_rmsnorm_linear(x, g, 1e-5, residual, w, s, None, block, rope=rope)
        assert out is not None, "no single-split GEMV config for the qkv projection"
        q = out[0][:, : hq * d].view(bs, hq, d)
        dec.decode_attention_fwd(q, k_pool, v_pool, o, req_to_token, rows, lens, ws.attn_logits, ws.attn_lse, splits,
                                 d**-0.5, k_scale=k_scale, v_scale=v_scale, counters=ws.counters, after_qkv=after_qkv)
        return (o.clone(),)

    tile = dec.stage1_tile(bs, d, hkv, pool == "fp8")
    v_words = pool == "fp8" and dec.v_words_default(bs, tile)  # (as decode_attention_fwd decides it)
    assert dec.preload_after_qkv(bs, tile, v_words) == (pool == "bf16" or bs == 1)
    assert_pdl_step_gives_the_same_bits(step)


@pytest.mark.parametrize("kind", ["bf16", "fp8", "fp8_block"])
@pytest.mark.parametrize("heads,head_dim,k", [((32, 8), 64, 2048), ((32, 8), 128, 4096)])  # 1B, 8B qkv
@pytest.mark.parametrize("pool", ["bf16", "fp8"])
@pytest.mark.parametrize("m", [1, 2, 4])
def test_fused_qkv_rope_store_matches_the_two_kernels_and_replays(kind, heads, head_dim, k, pool, m):
    """1, 2 or 4 decode tokens: input norm + qkv GEMV + rotary + KV store in one kernel against the norm +
    GEMV kernel with the same rows per program, then rotary_store_kv: the same values within one bf16
    rounding (two compiled kernels; nearly all equal), and a graph replay with eager's bits."""
    from model_executor.layers.rotary import RotaryEmbedding
    from model_executor.layers.rotary_store_kv import RopeStore, rotary_store_kv

    hq, hkv = heads
    n = (hq + 2 * hkv) * head_dim
    w, s, block, _ = weight(kind, n, k, seed=n + k)
    x = (torch.randn(m, k, device="cuda") * 3).bfloat16()
    residual = (torch.randn(m, k, device="cuda") * 5).bfloat16()
    g = (torch.rand(k, device="cuda") + 0.5).bfloat16()
    cache = RotaryEmbedding(head_dim, 4096, 500000.0).cos_sin_cache.cuda()
    positions = torch.tensor([3001, 5, 4000, 64][:m], device="cuda")
    loc = torch.tensor([17, 40, 2, 63][:m], device="cuda")
    dtype, (k_scale, v_scale) = (torch.bfloat16, (1.0, 1.0)) if pool == "bf16" else (torch.float8_e4m3fn, (0.5, 2.0))
    pools = [torch.zeros(64, hkv, head_dim, dtype=dtype, device="cuda") for _ in range(4)]
    rope = RopeStore(positions, cache, loc, pools[0], pools[1], hq, hkv, k_scale, v_scale)
    cfg = sm.GemmConfig(BLOCK_N=8, BLOCK_K=min(512, block[1]) if block else 512, GEMV=True, num_stages=3)
    y, h = sm.small_m_rmsnorm_linear(x, g, 1e-5, residual, w, s, None, block, rope=rope, config=cfg)
    ref, h_ref = sm.small_m_rmsnorm_linear(x, g, 1e-5, residual, w, s, None, block, config=cfg)
    q_ref, k_ref, v_ref = ref.view(m, -1, head_dim).split([hq, hkv, hkv], dim=1)
    rotary_store_kv(positions, q_ref, k_ref, v_ref, cache, pools[2], pools[3], loc, k_scale, v_scale)
    assert torch.equal(h, h_ref)
    for in_pool, got, want in ((False, y, ref), (True, pools[0][loc], pools[2][loc]), (True, pools[1][loc], pools[3][loc])):
        got, want = got.float(), want.float()
        rtol = 2.0**-3 if pool == "fp8" and in_pool else 2.0**-7  # (FP8: one e4m3 step)
        torch.testing.assert_close(got, want, rtol=rtol, atol=1e-3 * want.abs().max().item())
        assert (got != want).float().mean().item() < 0.02
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured, _ = sm.small_m_rmsnorm_linear(x, g, 1e-5, residual, w, s, None, block, rope=rope, config=cfg)
    x.copy_(torch.randn_like(x))
    positions.copy_(torch.arange(77, 77 + m, device="cuda"))
    loc.copy_(torch.arange(3, 3 + m, device="cuda"))
    graph.replay()
    torch.cuda.synchronize()
    replayed_k, replayed_v = pools[0][loc].clone(), pools[1][loc].clone()
    y, _ = sm.small_m_rmsnorm_linear(x, g, 1e-5, residual, w, s, None, block, rope=rope, config=cfg)
    assert torch.equal(captured, y)
    assert torch.equal(replayed_k.float(), pools[0][loc].float()) and torch.equal(replayed_v.float(), pools[1][loc].float())
    assert (replayed_k.float().abs().sum((1, 2)) > 0).all()


def table_x_fp8_cases(kind: str, shapes: list, ms: list) -> list:
    """(n, k, m) for each shape and row count whose M bucket the server's H200 table gives an X_FP8 config."""
    table = json.loads(smc.table_path("NVIDIA_H200").read_text())[kind]
    return [(n, k, m) for n, k in shapes for m in ms
            if isinstance(e := table[f"{n},{k}"].get(str(sm.m_bucket(m))), dict) and e.get("X_FP8")]


X_FP8_SHAPES = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336),  # 8B
                (3072, 2048), (2048, 2048), (16384, 2048), (2048, 8192),  # 1B
                (24576, 4096), (4096, 12288),  # Qwen3-8B gate_up, down
                (5120, 2048), (2048, 4096)]  # Qwen3-30B-A3B qkv, o
X_FP8_CASES = table_x_fp8_cases("fp8", X_FP8_SHAPES, [2, 3, 4, 5, 8, 12, 16, 17, 24, 32, 33, 48, 64])


def test_the_x_fp8_cases_cover_every_shape_from_5_rows():
    assert {(n, k) for n, k, m in X_FP8_CASES if m == 5} == set(X_FP8_SHAPES)
    assert len([c for c in X_FP8_CASES if c[2] >= 5]) == 10 * len(X_FP8_SHAPES)


@pytest.mark.parametrize("n,k,m", X_FP8_CASES)
def test_fp8_activations_on_fp8_tensor_cores_match_the_w8a8_reference(n, k, m):
    """The X_FP8 kernel (x quantized per token, the dot on FP8 operands) at the server table's configs (every
    shape and row count whose bucket has one: all of them from 5 rows, some at 2-4) against float32 math on the
    same codes (fp8_linear_reference's W8A8 product), and against torch._scaled_mm (its default, float32
    promotion: the kernel adds each K step's FP8 products into float32, or the sums drift past a bf16 ulp); rows
    padded within a bucket (3 of 4, 5 of 8, 12 of 16, 17 and 24 of 32, 33 and 48 of 64: the padding rows load
    zeros) give the bits of the full bucket's rows."""
    from model_executor.layers.quantization import fp8_ops

    table = json.loads(smc.table_path("NVIDIA_H200").read_text())["fp8"][f"{n},{k}"]
    cfg = sm.GemmConfig(**table[str(sm.m_bucket(m))])
    assert cfg.X_FP8
    w, s, _, w_deq = weight("fp8", n, k, seed=n + m)
    x = torch.randn(64, k, device="cuda", generator=torch.Generator("cuda").manual_seed(m)).bfloat16()
    xq, xs = fp8_ops.per_token_group_quant_fp8(x, k)
    out = sm.small_m_linear_fp8_act(xq[:m], xs[:m], w, s, None, torch.bfloat16, cfg)
    check(out, (xq[:m].float() * xs[:m]) @ w_deq.t())
    cublas = torch._scaled_mm(xq[:m], w.t(), scale_a=xs[:m], scale_b=s.view(1, -1), out_dtype=torch.bfloat16)
    check(out, cublas.float())
    bucket = sm.m_bucket(m)
    full = sm.small_m_linear_fp8_act(xq[:bucket], xs[:bucket], w, s, None, torch.bfloat16, cfg)
    assert torch.equal(out, full[:m])


@pytest.mark.parametrize("m", [17, 32, 48, 64])
@pytest.mark.parametrize("cfg", [sm.GemmConfig(BLOCK_N=64, BLOCK_K=128, SPLIT_K=4, X_FP8=True),
                                 sm.GemmConfig(BLOCK_N=32, BLOCK_K=128, SPLIT_K=1, num_warps=8, X_FP8=True),
                                 sm.GemmConfig(BLOCK_N=128, BLOCK_K=128, SPLIT_K=4, num_warps=8, X_FP8=True)])
@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 12288)])
def test_fp8_activations_with_block_scales_match_the_block_w8a8_reference(n, k, m, cfg):
    """The X_FP8 kernel with 128 x 128 block scales (x per 1 x 128 group: Qwen3's FP8 checkpoints) against
    float32 math on the same codes and against the block-scaled Triton GEMM it would replace; rows padded within a
    bucket give the bits of the full bucket's rows. (Explicit configs, split K and one split: the table's
    fp8_block entries cover only Qwen3-8B's shapes and may change with a tune: the next test takes those.)"""
    check_block_x_fp8(n, k, m, cfg)


@pytest.mark.parametrize("n,k,m", table_x_fp8_cases("fp8_block", [(6144, 4096), (4096, 4096), (24576, 4096),
                                                                  (4096, 12288)], [2, 3, 4, 5, 8, 12, 16, 24, 64]))
def test_the_tables_block_scale_configs_match_the_block_w8a8_reference(n, k, m):
    """As above at the server table's fp8_block configs (Qwen3-8B's shapes) from 2 rows."""
    table = json.loads(smc.table_path("NVIDIA_H200").read_text())["fp8_block"][f"{n},{k}"]
    check_block_x_fp8(n, k, m, sm.GemmConfig(**table[str(sm.m_bucket(m))]))


def check_block_x_fp8(n: int, k: int, m: int, cfg: sm.GemmConfig) -> None:
    from model_executor.layers.quantization import fp8_ops

    w, s, block, w_deq = weight("fp8_block", n, k, seed=n + m)
    x = torch.randn(64, k, device="cuda", generator=torch.Generator("cuda").manual_seed(m)).bfloat16()
    xq, xs = fp8_ops.per_token_group_quant_fp8(x, block[1])
    out = sm.small_m_linear_fp8_act(xq[:m], xs[:m], w, s, None, torch.bfloat16, cfg, block)
    check(out, (xq[:m].float() * xs[:m].repeat_interleave(block[1], dim=1)) @ w_deq.t())
    check(out, fp8_ops.w8a8_block_fp8_matmul(xq[:m], w, xs[:m], s, block, torch.bfloat16).float())
    bucket = sm.m_bucket(m)
    full = sm.small_m_linear_fp8_act(xq[:bucket], xs[:bucket], w, s, None, torch.bfloat16, cfg, block)
    assert torch.equal(out, full[:m])


TABLE_GPUS = ["NVIDIA_H200", "NVIDIA_H100_80GB_HBM3"]


def table_bf16_cases(models: list[str]) -> list:
    """(gpu, layer, n, k, bucket) for each Triton entry (not cuBLAS) of the server's H200 and H100 tables at the
    models' bf16 linears and LM heads (tp 1)."""
    from benchmarks.tuning.tune_small_m_gemm import linear_shapes, lm_head_shape
    from model_executor.model_config import ModelConfig

    cases = set()
    for gpu in TABLE_GPUS:
        table = json.loads(smc.table_path(gpu).read_text())["bf16"]
        for name in models:
            model = ModelConfig.from_pretrained(shape_path(name))
            for layer, (n, k) in {**linear_shapes(model, 1), "head": lm_head_shape(model, 1)}.items():
                cases |= {(gpu, layer, n, k, int(m)) for m, e in table.get(f"{n},{k}", {}).items()
                          if isinstance(e, dict)}
    return sorted(cases)


@pytest.mark.parametrize("gpu,layer,n,k,bucket", table_bf16_cases(["llama-3.1-8b", "llama-3.2-1b"]))
def test_the_shipped_tables_bf16_configs_match_the_reference(gpu, layer, n, k, bucket):
    """Each Triton entry of the server's H200 and H100 tables at the Llama models' bf16 shapes (read by name: either
    card runs both), at its bucket's rows and one fewer (a padded batch), against a float32 reference; where an
    o_proj or down entry fuses (fuses), its residual add epilogue gives the plain kernel's rows plus the residual,
    with torch's bits. (The paired layers' fused forms at half the tile: the fixed-tile tests above.)"""
    cfg = sm.GemmConfig(**json.loads(smc.table_path(gpu).read_text())["bf16"][f"{n},{k}"][str(bucket)])
    w, _, _, w_deq = weight("bf16", n, k, seed=n + bucket)
    for m in sorted({max(bucket - 1, 1), bucket}):
        x = torch.randn(m, k, device="cuda", generator=torch.Generator("cuda").manual_seed(m)).bfloat16()
        out = sm.small_m_linear(x, w, None, None, None, config=cfg)
        check(out, x.float() @ w_deq.t())
        if layer in ("o", "down") and smc.fuses(cfg):
            residual = (torch.randn(m, n, device="cuda") * 5).bfloat16()
            g = (torch.rand(n, device="cuda") + 0.5).bfloat16()
            _, h = sm.small_m_linear_add_rmsnorm(x, w, None, None, None, residual, g, 1e-5, config=cfg)
            assert torch.equal(h, out + residual)


def test_the_shipped_table_cases_cover_both_models_linears_on_both_gpus():
    cases = table_bf16_cases(["llama-3.1-8b", "llama-3.2-1b"])
    for gpu in TABLE_GPUS:
        layers = {layer for g, layer, *_ in cases if g == gpu}
        assert layers == {"qkv", "o", "gate_up", "down", "head"} and sum(c[0] == gpu for c in cases) >= 40

"""FP8 on the GPU (sm89+): the GEMMs against a float32 reference of the dequantized operands, a random-weight
Llama-3.2-1B in FP8 against the same weights in bf16, decode graph replay against FP8 eager, and the FP8 KV
cache against a bf16 one. Results are printed (run with -s to see them)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from benchmarks.kernels.bench_quant import checkpoint_tensors, compare
from model_executor.configs import shape_path
from model_executor.layers.quantization import QuantConfig
from model_executor.layers.quantization import fp8_math as fm
from model_executor.weight_loader import build_model
from runners.model_runner import ModelRunner, RunnerConfig

pytestmark = pytest.mark.gpu

BLOCK_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}


def rel_err(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _one_linear(quant: QuantConfig, n: int, k: int, seed: int):
    from model_executor.layers.linear import ColumnParallelLinear
    from model_executor.layers.quantization import quantization_context, restore_kept_dtypes

    with torch.device("meta"), quantization_context(quant):
        layer = ColumnParallelLinear(k, n)
    layer = layer.to(torch.bfloat16)
    restore_kept_dtypes(layer)
    layer = layer.to_empty(device="cuda")
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)).mul_(0.05).to("cuda", torch.bfloat16)
    if quant.method == "fp8":  # online: the loader quantizes
        layer.weight_loader(layer.weight, w)
    else:
        q, s = fm.quantize_fp8_block(w)
        layer.weight.data.copy_(q)
        layer.weight_scale_inv.data.copy_(s)
    return layer, w


@pytest.mark.parametrize("method", ["fp8", "fp8_block"])
@pytest.mark.parametrize("m", [1, 7, 64, 300])
def test_fp8_gemm_against_float32_reference(method, m):
    """Bound: relative (Frobenius) error <= 1e-2 against float32 math on the same quantized operands (the
    bf16 output's rounding, 2^-8, dominates; at M <= 16 the operands are x unquantized and the FP8 weight),
    and <= 6e-2 against the unquantized bf16 weights."""
    n, k = 4096, 2048
    quant = QuantConfig(method, block=(128, 128) if method == "fp8_block" else None)
    layer, w = _one_linear(quant, n, k, seed=m)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    out = layer(x)
    if m <= 16:  # decode-sized: the weight-only small-M kernel (x is not quantized)
        w_deq = (layer.weight.float() * layer.weight_scale[:, None] if method == "fp8"
                 else fm.dequantize_fp8_block(layer.weight, layer.weight_scale_inv, (128, 128)))
        ref = x.float() @ w_deq.t()
    elif method == "fp8":
        ref = fm.fp8_linear_reference(x.float(), layer.weight, layer.weight_scale, None)
    else:
        ref = fm.fp8_linear_reference(x.float(), layer.weight, layer.weight_scale_inv, None, block=(128, 128))
    err, err_bf16 = rel_err(out, ref), rel_err(out, x.float() @ w.float().t())
    print(f"\n{method} M={m} N={n} K={k}: rel err vs fp32 reference {err:.2e}, vs unquantized {err_bf16:.2e}")
    assert out.dtype == torch.bfloat16 and err <= 1e-2 and err_bf16 <= 6e-2


def _runner(model_path, **kw) -> ModelRunner:
    base = {"model_path": str(model_path), "device": "cuda", "attention_backend": "triton", "max_running_requests": 16,
                "max_total_tokens": 16 * 200, "context_length": 256, "random_weights": True, "disable_cuda_graph": True,
                "disable_piecewise_cuda_graph": True}
    return ModelRunner(RunnerConfig(**{**base, **kw}))


@pytest.fixture(scope="module")
def bf16_1b():
    return _runner(shape_path("llama-3.2-1b"))


def test_llama_1b_fp8_vs_bf16(bf16_1b):
    """The same random weights, online FP8 vs bf16: logits error along the bf16 greedy sequence and greedy
    agreement over 64 steps (printed; random weights give flat logits, so near-ties flip greedy from the first
    token, and the error compounds over 16 random layers). The bound is relative to an unrelated model (the
    same shape, another seed) measured the same way: FP8 must stay far closer to its source than that."""
    fp8 = _runner(shape_path("llama-3.2-1b"), quantization="fp8")
    with torch.no_grad():
        fp8.model.load_weights(checkpoint_tensors(bf16_1b.model))
    prompt = torch.randint(10, 128000, (32,), generator=torch.Generator().manual_seed(0)).tolist()
    result = compare(bf16_1b, fp8, prompt, 64)
    del fp8
    unrelated = _runner(shape_path("llama-3.2-1b"), seed=1)
    baseline = compare(bf16_1b, unrelated, prompt, 8)
    del unrelated
    print(f"\nLlama-3.2-1B random weights, fp8 vs bf16: {json.dumps(result)}\n"
          f"unrelated bf16 model (seed 1) vs bf16: {json.dumps(baseline)}")
    assert result["logits_rel_err_max"] < baseline["logits_rel_err_mean"] / 3, (result, baseline)


@pytest.fixture(scope="module")
def block_fp8_shape(tmp_path_factory):
    """The Llama-3.2-1B shape declared as a block-wise FP8 checkpoint (random weights)."""
    folder = tmp_path_factory.mktemp("llama1b_fp8_block")
    shutil.copy(shape_path("llama-3.2-1b") / "config.json", folder / "config.json")
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "quantization_config": BLOCK_CONFIG}))
    return folder


@pytest.mark.parametrize("variant", ["fp8", "fp8_block", "fp8_kv"])
def test_decode_graph_replay_equals_fp8_eager(variant, block_fp8_shape):
    from runners.cuda_graph_runner import CudaGraphRunner
    from tests.runners.test_cuda_graph_runner import make_decode_batch, release

    path = block_fp8_shape if variant == "fp8_block" else shape_path("llama-3.2-1b")
    kw = {"quantization": "fp8"} if variant == "fp8" else {}
    if variant == "fp8_kv":
        kw = {"quantization": "fp8", "kv_cache_dtype": "fp8_e4m3"}
    runner = _runner(path, **kw)
    graphs = CudaGraphRunner(runner, [1, 2, 4, 8, 16])
    for bs in (1, 3, 8, 13):
        fb, rows, _ = make_decode_batch(runner, bs, seed=bs)
        with torch.inference_mode():
            eager = runner.forward_eager(fb).clone()
            graphed = graphs.replay(fb).clone()
        release(runner, rows, fb)
        diff = (graphed - eager).abs().max().item()
        print(f"\n{variant} bs={bs}: graph vs eager max |diff| {diff:.2e}, greedy equal "
              f"{torch.equal(graphed.argmax(-1), eager.argmax(-1))}")
        # padded sizes (3, 13) run other GEMM shapes in the graph: rounding may differ slightly
        torch.testing.assert_close(graphed, eager, rtol=2e-2, atol=2e-2)
    del graphs


def test_fp8_kv_cache_vs_bf16_kv(bf16_1b):
    """bf16 weights both; the FP8 KV cache's logits against the bf16 cache's over 64 greedy steps."""
    fp8_kv = _runner(shape_path("llama-3.2-1b"), kv_cache_dtype="fp8_e4m3")
    assert fp8_kv.kv_cache.k_buffers[0].dtype == torch.float8_e4m3fn
    assert fp8_kv.kv_cache.k_buffers[0].element_size() * 2 == bf16_1b.kv_cache.k_buffers[0].element_size()
    prompt = torch.randint(10, 128000, (100,), generator=torch.Generator().manual_seed(1)).tolist()
    result = compare(bf16_1b, fp8_kv, prompt, 64)
    print(f"\nLlama-3.2-1B random weights, fp8 KV vs bf16 KV: {json.dumps(result)}")
    assert result["logits_rel_err_max"] < 0.2, result


def test_online_fp8_load_peak_stays_near_fp8_size(tmp_path):
    """Online FP8 quantizes each tensor as it loads: the load peak is the FP8 weights plus about one bf16
    tensor, far below the bf16 model."""
    from safetensors.torch import save_file

    from model_executor.model_config import ModelConfig
    from model_executor.weight_loader import init_random_weights, load_model, weight_bytes

    cfg = ModelConfig.from_pretrained(shape_path("llama-3.2-1b"))
    shutil.copy(shape_path("llama-3.2-1b") / "config.json", tmp_path / "config.json")
    ref = init_random_weights(build_model(cfg, torch.bfloat16, "cpu"))
    save_file({n: t.contiguous() for n, t in checkpoint_tensors(ref)}, str(tmp_path / "model.safetensors"))
    bf16_bytes = weight_bytes(ref)
    del ref
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    model = load_model(tmp_path, cfg, torch.bfloat16, "cuda", quant=QuantConfig("fp8"))
    peak = torch.cuda.max_memory_allocated() - base
    fp8_bytes = weight_bytes(model)
    print(f"\nonline fp8 load: bf16 weights {bf16_bytes / 2**30:.2f} GiB, fp8 model {fp8_bytes / 2**30:.2f} GiB, "
          f"load peak {peak / 2**30:.2f} GiB")
    largest = cfg.vocab_size * cfg.hidden_size * 2  # the (unquantized) embedding is the largest tensor
    assert peak <= fp8_bytes + 3 * largest


@pytest.mark.parametrize("variant", ["fp8", "fp8_block", "fp8_kv"])
def test_piecewise_extend_graph_equals_fp8_eager(variant, block_fp8_shape):
    """The extend pieces traced by dynamo (the FP8 linears inside them) replay as eager runs at 5, 20 and 47
    tokens (eager and the graph of its level take the same small-M config: the traced `duet::fp8_linear` op
    picks its path on the real row count, as eager does, and no level pads across a GEMM row bucket); the
    5-token extend replays a whole graph of the 8-token level (the same kernels, attention inside)."""
    from tests.runners.test_piecewise_runner import make_extend_batch, release

    torch._dynamo.reset()
    path = block_fp8_shape if variant == "fp8_block" else shape_path("llama-3.2-1b")
    kw = {} if variant == "fp8_block" else {"quantization": "fp8"}
    if variant == "fp8_kv":
        kw["kv_cache_dtype"] = "fp8_e4m3"
    # (levels at the small-M GEMM's M buckets: a graph pads a batch within its GEMM config's rows, so it computes
    # what eager computes)
    runner = _runner(path, **kw, disable_piecewise_cuda_graph=False,
                     piecewise_cuda_graph_tokens=(1, 2, 4, 8, 16, 32, 64, 128), full_extend_graph_max_tokens=16)
    assert runner.extend_graph_runner is not None and runner.full_extend_graph_runner is not None
    # A whole graph (5 tokens), pieces (20 tokens, and 47 in two requests).
    for ext, pre in (([5], [0]), ([20], [0]), ([7, 40], [30, 0])):
        fb, rows = make_extend_batch(runner, ext, pre, seed=sum(ext))
        with torch.inference_mode():
            graphed = runner.forward(fb).clone()
            eager = runner.forward_eager(fb).clone()
        assert runner.path_counts["extend_graph"] >= 1
        release(runner, rows, fb)
        print(f"\n{variant} extend {ext} on prefixes {pre}: max|diff| {(graphed - eager).abs().max().item():.2e}")
        torch.testing.assert_close(graphed, eager, rtol=3e-2, atol=3e-2)
    del runner
    torch._dynamo.reset()


@pytest.mark.parametrize("variant", ["fp8", "fp8_block"])
def test_activation_quantization_in_the_norm_and_silu_kernels_keeps_the_bits(variant, block_fp8_shape,
                                                                             monkeypatch):
    """Above 16 rows the RMSNorm and SiLU-and-mul kernels quantize the W8A8 GEMMs' inputs themselves: the
    model's logits must be those of the separate quantization kernels, bit for bit (a decode batch of 24,
    an extend of 40 + 7 tokens), and the decode graph at 24 (padded to 32) must replay as eager."""
    from model_executor.layers.quantization import fp8_linear
    from runners.cuda_graph_runner import CudaGraphRunner
    from tests.runners.test_cuda_graph_runner import make_decode_batch
    from tests.runners.test_cuda_graph_runner import release as release_decode
    from tests.runners.test_piecewise_runner import make_extend_batch
    from tests.runners.test_piecewise_runner import release as release_extend

    path = block_fp8_shape if variant == "fp8_block" else shape_path("llama-3.2-1b")
    kw = {} if variant == "fp8_block" else {"quantization": "fp8"}
    runner = _runner(path, **kw, max_running_requests=32, max_total_tokens=32 * 200)
    graphs = CudaGraphRunner(runner, [8, 16, 32])

    def both(fb):
        with torch.inference_mode():
            fused = runner.forward_eager(fb).clone()
            monkeypatch.setattr(fp8_linear, "FUSED_QUANT_DEVICES", ())
            unfused = runner.forward_eager(fb).clone()
            monkeypatch.setattr(fp8_linear, "FUSED_QUANT_DEVICES", ("cuda",))
        return fused, unfused

    fb, rows, _ = make_decode_batch(runner, 24, seed=24)
    fused, unfused = both(fb)
    with torch.inference_mode():
        graphed = graphs.replay(fb).clone()
    release_decode(runner, rows, fb)
    print(f"\n{variant} decode bs=24: fused vs unfused max |diff| {(fused - unfused).abs().max().item():.2e}, "
          f"graph vs eager {(graphed - fused).abs().max().item():.2e}")
    assert torch.equal(fused, unfused)
    torch.testing.assert_close(graphed, fused, rtol=2e-2, atol=2e-2)
    fb, rows = make_extend_batch(runner, [40, 7], [0, 12], seed=47)
    fused, unfused = both(fb)
    release_extend(runner, rows, fb)
    print(f"{variant} extend [40, 7]: fused vs unfused max |diff| {(fused - unfused).abs().max().item():.2e}")
    assert torch.equal(fused, unfused)
    del graphs

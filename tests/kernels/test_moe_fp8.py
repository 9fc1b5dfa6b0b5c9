"""FP8 MoE experts on CPU: the fused GEMM with FP8 weights (Triton interpreter) against the dequantized torch
reference; online quantization of the experts at load; a block-quantized MoE checkpoint; a tiny Qwen3-MoE
in FP8 against bf16 and HF through the torch reference path; what stays unquantized, and the refusals."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from model_executor.layers.moe.fused_moe import fused_experts_torch
from model_executor.layers.moe.router import select_experts
from model_executor.layers.quantization import QuantConfig, QuantizationError, checkpoint_quant_config
from model_executor.layers.quantization import fp8_math as fm
from model_executor.model_config import ModelConfig, WeightLoadError
from model_executor.weight_loader import build_model, check_checkpoint, init_random_weights, load_model
from tests import triton_mode
from tests.triton_mode import DEVICE, in_process

if not triton_mode.RERUN_IN_SUBPROCESS:
    from model_executor.layers.moe import kernels

test_in_subprocess = triton_mode.subprocess_test(__file__)

FP8 = torch.float8_e4m3fn
SMALL = {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 32, "GROUP_M": 2, "num_warps": 4, "num_stages": 1}


def codes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def fp8_experts(num_experts, hidden, inter, block, seed):
    """Random experts quantized per output row (block None) or per block tile: (w13, w2, s13, s2)."""
    gen = torch.Generator().manual_seed(seed)
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=gen) / hidden**0.5
    w2 = torch.randn(num_experts, hidden, inter, generator=gen) / inter**0.5
    w13 = w13 * torch.linspace(0.2, 3, 2 * inter)[:, None]  # rows of different ranges: distinct scales

    def quantize(w):
        pairs = [fm.quantize_fp8_block(e, block) if block else fm.quantize_fp8_per_channel(e) for e in w]
        return torch.stack([q for q, _ in pairs]), torch.stack([s for _, s in pairs])

    return (*quantize(w13), *quantize(w2))


@in_process
@pytest.mark.parametrize("block", [None, (16, 32)])
@pytest.mark.parametrize("num_tokens,dtype", [(1, torch.float32), (33, torch.float32), (17, torch.bfloat16)])
def test_fp8_expert_gemm_matches_dequantized_reference(block, num_tokens, dtype):
    """Weight-only FP8 experts (E=8, H=64, I=48, top 3): the Triton GEMMs (FP8 tiles converted in registers;
    per-row scales in the epilogue, tile scales on each tile) equal the torch path on the dequantized weights."""
    w13, s13, w2, s2 = fp8_experts(8, 64, 48, block, seed=num_tokens)
    gen = torch.Generator().manual_seed(100 + num_tokens)
    x = torch.randn(num_tokens, 64, generator=gen).to(dtype)
    weights, ids = select_experts(torch.randn(num_tokens, 8, generator=gen), 3, True)
    ref = fused_experts_torch(x, w13, w2, weights, ids, False, False, s13, s2, block)
    out = kernels.fused_experts_triton(x.to(DEVICE), w13.to(DEVICE), w2.to(DEVICE), weights.to(DEVICE),
                                       ids.to(DEVICE), config=SMALL, w13_scale=s13.to(DEVICE),
                                       w2_scale=s2.to(DEVICE), block=block)
    # float32: the same products summed in another order; bf16: a few ulps (products rounded elsewhere)
    tol = {"rtol": 1e-4, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 3e-2, "atol": 3e-2}
    torch.testing.assert_close(out.cpu(), ref, **tol)
    # and the reference itself is the unquantized math on the dequantized weights
    if block is None:
        deq13, deq2 = w13.float() * s13[..., None], w2.float() * s2[..., None]
    else:
        deq13 = torch.stack([fm.dequantize_fp8_block(q, s, block) for q, s in zip(w13, s13)])
        deq2 = torch.stack([fm.dequantize_fp8_block(q, s, block) for q, s in zip(w2, s2)])
    plain = fused_experts_torch(x.float(), deq13, deq2, weights, ids)
    assert rel_err(ref, plain) < (1e-6 if dtype == torch.float32 else 2e-2)


# ---- loading: online quantization of the experts, block-quantized MoE checkpoints ---------------------------


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory):
    """A tiny Qwen3-MoE saved by HF: layer 0 dense, layers 1-2 MoE (8 experts, top 3, I=48, H=64)."""
    from tests.conftest import save_tiny_hf_model
    from tests.models.test_new_models_vs_hf import TINY_QWEN3_MOE

    path = tmp_path_factory.mktemp("tiny_qwen3_moe_fp8")
    return path, save_tiny_hf_model(path, TINY_QWEN3_MOE, seed=5)


def _hf_tensors(path: Path) -> dict[str, torch.Tensor]:
    return load_file(str(next(path.glob("*.safetensors"))))


def test_online_fp8_quantizes_experts_per_shard(tiny_moe):
    """--quantization fp8: each expert's gate/up/down tensor quantized per output row as it loads into w13 /
    w2 (codes and scales equal to quantizing the checkpoint tensor alone); scales [E, 2I] and [E, H] float32;
    the router gate unquantized; the MoE block within weight-only FP8 error of the bf16 block."""
    path, _ = tiny_moe
    cfg = ModelConfig.from_pretrained(path)
    model = load_model(path, cfg, torch.bfloat16, "cpu", quant=QuantConfig("fp8"))
    experts = model.model.layers[1].mlp.experts
    assert experts.w13_weight.dtype == FP8 and experts.w2_weight.dtype == FP8
    assert experts.w13_weight_scale.shape == (8, 96) and experts.w2_weight_scale.shape == (8, 64)
    assert experts.w13_weight_scale.dtype == experts.w2_weight_scale.dtype == torch.float32
    hf = _hf_tensors(path)
    for e in (0, 5):
        prefix = f"model.layers.1.mlp.experts.{e}"
        for rows, (name, param, scale) in zip(
            (slice(0, 48), slice(48, 96), slice(None)),
            [("gate_proj", experts.w13_weight, experts.w13_weight_scale),
             ("up_proj", experts.w13_weight, experts.w13_weight_scale),
             ("down_proj", experts.w2_weight, experts.w2_weight_scale)]):
            q, s = fm.quantize_fp8_per_channel(hf[f"{prefix}.{name}.weight"].to(torch.bfloat16))
            assert torch.equal(codes(param[e][rows]), codes(q)), name
            torch.testing.assert_close(scale[e][rows], s)
    gate = model.model.layers[1].mlp.gate
    assert gate.weight.dtype == torch.bfloat16 and not hasattr(gate, "weight_scale")
    assert model.model.layers[1].self_attn.qkv_proj.weight.dtype == FP8
    ref = load_model(path, cfg, torch.bfloat16, "cpu")
    x = torch.randn(6, cfg.hidden_size, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    err = rel_err(model.model.layers[2].mlp(x), ref.model.layers[2].mlp(x))
    assert 0 < err < 0.05, err  # e4m3 weights: a few percent


def _runner(path, monkeypatch, quant: QuantConfig | None):
    """A CPU runner in bf16 whose model is loaded with `quant` (the CPU runner refuses FP8, as the server
    must; the FP8 layers' torch reference path is what runs here)."""
    import runners.model_runner as mr

    monkeypatch.setattr(mr, "resolve_quant_config", lambda *a, **k: quant)
    return mr.ModelRunner(mr.RunnerConfig(model_path=str(path), dtype="bfloat16", max_running_requests=2,
                                          max_total_tokens=256, context_length=128))


def test_fp8_moe_model_logits_close_to_bf16(tiny_moe, monkeypatch):
    """The tiny Qwen3-MoE under --quantization fp8 (reference path: W8A8 linears, weight-only FP8 experts)
    against HF float32: the logits of a prefill and a few decode steps within FP8 error of HF, where wrong
    scales or rows are off by the logits' own size or more."""
    from tests.models.test_model_vs_hf import run_prefill_and_decode

    path, hf_model = tiny_moe
    prompts = [[5, 9, 200, 31, 7, 64, 12], [40, 41]]
    bf16 = run_prefill_and_decode(_runner(path, monkeypatch, None), hf_model, prompts, decode_steps=2)
    runner = _runner(path, monkeypatch, QuantConfig("fp8"))
    assert runner.model.model.layers[2].mlp.experts.w2_weight.dtype == FP8
    fp8 = run_prefill_and_decode(runner, hf_model, prompts, decode_steps=2)
    print(f"rel err vs HF float32: bf16 {max(bf16):.4f}, fp8 {max(fp8):.4f}")
    # Measured (relative): bf16 0.016; fp8 0.156, of which the linears alone 0.154 (their per-token FP8
    # activations dominate) and the weight-only FP8 experts alone 0.023.
    assert max(bf16) < 0.02, bf16
    assert max(fp8) < 0.2, fp8


def _save_block_checkpoint(src: Path, dst: Path, block=(16, 16)) -> Path:
    """The tiny checkpoint as a Qwen3 -FP8 checkpoint stores one: every linear's and expert's weight FP8 with
    `weight_scale_inv` [N / bn, K / bk]; the router gates, norms, embeddings and head in bf16."""
    shutil.copytree(src, dst)
    out = {}
    for name, t in _hf_tensors(src).items():
        base = name.rsplit(".", 1)[0]
        if name.endswith(".weight") and base.rsplit(".", 1)[-1].endswith("_proj"):
            q, s = fm.quantize_fp8_block(t, block)
            out[f"{base}.weight"], out[f"{base}.weight_scale_inv"] = q, s
        else:
            out[name] = t.to(torch.bfloat16).contiguous()
    for f in dst.glob("*.safetensors"):
        f.unlink()
    save_file(out, str(dst / "model.safetensors"))
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": list(block)}
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_block_fp8_moe_checkpoint_loads(tiny_moe, tmp_path, monkeypatch):
    """A block-quantized Qwen3-MoE checkpoint: the header check passes, each expert's codes and block scales
    land in their rows of w13 / w2 and their scales (gate tiles, then up tiles), and the model's logits stay
    within FP8 error of HF (test_fp8_moe_model_logits_close_to_bf16's bound)."""
    from tests.models.test_model_vs_hf import run_prefill_and_decode

    src, hf_model = tiny_moe
    path = _save_block_checkpoint(src, tmp_path / "block")
    cfg = ModelConfig.from_pretrained(path)
    quant = checkpoint_quant_config(cfg.hf_config)
    check_checkpoint(path, cfg)
    runner = _runner(path, monkeypatch, quant)
    experts = runner.model.model.layers[2].mlp.experts
    assert experts.w13_weight_scale_inv.shape == (8, 96 // 16, 64 // 16)
    assert experts.w2_weight_scale_inv.shape == (8, 64 // 16, 48 // 16)
    saved = _hf_tensors(path)
    prefix = "model.layers.2.mlp.experts.3"
    assert torch.equal(codes(experts.w13_weight[3][48:]), codes(saved[f"{prefix}.up_proj.weight"]))
    torch.testing.assert_close(experts.w13_weight_scale_inv[3][3:], saved[f"{prefix}.up_proj.weight_scale_inv"])
    torch.testing.assert_close(experts.w2_weight_scale_inv[3], saved[f"{prefix}.down_proj.weight_scale_inv"])
    errors = run_prefill_and_decode(runner, hf_model, [[5, 9, 200, 31, 7, 64, 12]], decode_steps=2)
    assert max(errors) < 0.2, errors  # measured 0.097 (the W8A8 block linears' error, as for --quantization fp8)


def test_block_fp8_moe_checkpoint_missing_expert_scale_is_named(tiny_moe, tmp_path):
    src, _ = tiny_moe
    path = _save_block_checkpoint(src, tmp_path / "block")
    tensors = _hf_tensors(path)
    del tensors["model.layers.1.mlp.experts.6.down_proj.weight_scale_inv"]
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(Exception, match=r"model\.layers\.1\.mlp\.experts\.6\.down_proj\.weight_scale_inv"):
        check_checkpoint(path, ModelConfig.from_pretrained(path))


def test_channel_fp8_moe_checkpoint_is_refused_in_one_line(tiny_moe, tmp_path):
    """A compressed-tensors (per-channel) MoE checkpoint: refused by name, not loaded with bf16 experts."""
    src, _ = tiny_moe
    dst = tmp_path / "ct"
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic"}
    (dst / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(WeightLoadError, match=r"^MoE experts of a fp8_channel checkpoint are not supported") as e:
        check_checkpoint(dst, ModelConfig.from_pretrained(dst))
    assert "\n" not in str(e.value)


def test_random_fp8_experts_and_the_start_up_line(tiny_moe, caplog):
    """Random init (benchmarks) quantizes the experts too (no bf16 noise in FP8 storage), and the build says
    once what the experts and the gate are."""
    from model_executor.layers.moe import quant as moe_quant

    path, _ = tiny_moe
    moe_quant._say.cache_clear()
    cfg = ModelConfig.from_pretrained(path)
    with caplog.at_level("INFO", logger="duet.moe"):
        model = init_random_weights(build_model(cfg, torch.bfloat16, "cpu", quant=QuantConfig("fp8")))
    lines = [r.getMessage() for r in caplog.records if r.name == "duet.moe"]
    assert lines == [("MoE under fp8: experts FP8 weight-only, per-output-channel scales quantized at load; the "
                      "router's gate unquantized (model dtype)")]
    experts = model.model.layers[1].mlp.experts
    deq = experts.w13_weight[2].float() * experts.w13_weight_scale[2][:, None]
    assert 0.015 < deq.std().item() < 0.025  # std 0.02, as the bf16 draw
    assert (experts.w13_weight_scale > 0).all() and (experts.w2_weight_scale > 0).all()


def test_int8_leaves_experts_in_the_model_dtype_and_says_so(tiny_moe, caplog):
    from model_executor.layers.moe import quant as moe_quant

    path, _ = tiny_moe
    moe_quant._say.cache_clear()
    with caplog.at_level("INFO", logger="duet.moe"):
        model = build_model(ModelConfig.from_pretrained(path), torch.float32, "cpu", quant=QuantConfig("int8"))
    assert model.model.layers[1].mlp.experts.w13_weight.dtype == torch.float32
    assert any("MoE under int8: experts the model dtype" in r.getMessage() for r in caplog.records)


def test_block_moe_intermediate_not_a_block_multiple_is_refused(tiny_moe):
    path, _ = tiny_moe
    with pytest.raises(QuantizationError, match="intermediate size 48 is not a multiple of the block 32"):
        build_model(ModelConfig.from_pretrained(path), torch.bfloat16, "meta",
                    quant=QuantConfig("fp8_block", block=(32, 32)))


def test_fp8_moe_block_and_router_op_trace_as_one_graph():
    """The FP8 experts' scales pass through the opaque duet::fused_experts op under dynamo (the piecewise
    runner traces the backbone fullgraph), and so does the router op (what CUDA calls while tracing)."""
    from model_executor.layers.moe.layer import SparseMoeBlock
    from model_executor.layers.quantization import quantization_context

    with quantization_context(QuantConfig("fp8")):
        block = SparseMoeBlock(4, 2, 32, 32, renormalize=True)
    init_random_weights(block, std=0.2)
    x = torch.randn(5, 32)
    torch._dynamo.reset()
    try:
        compiled = torch.compile(block, backend="eager", fullgraph=True, dynamic=True)
        with torch.no_grad():
            torch.testing.assert_close(compiled(x), block(x))
        router = torch.compile(lambda t: torch.ops.duet.topk_softmax(t, 2, True), backend="eager", fullgraph=True)
        _, ids = router(x[:, :4])
        assert ids.tolist() == select_experts(x[:, :4], 2, True)[1].tolist()
    finally:
        torch._dynamo.reset()


def test_bench_floor_counts_fp8_experts_and_their_scales(tiny_moe):
    """bench_one_batch's MoE floor with FP8 experts: one byte per expert weight, the scales of the experts a
    step reads (not all of them)."""
    from benchmarks.bench_one_batch import step_read_bytes, weight_bytes

    path, _ = tiny_moe
    model = build_model(ModelConfig.from_pretrained(path), torch.bfloat16, "cpu", quant=QuantConfig("fp8"))
    per_expert = (2 * 48 * 64 + 64 * 48) * 1 + (2 * 48 + 64) * 4  # FP8 codes, float32 per-row scales
    table = model.model.embed_tokens.weight
    embedding_unread = (table.shape[0] - 1) * table.shape[1] * table.element_size()  # (untied: one row read)
    # two MoE layers, top 3
    assert step_read_bytes(model, 1) == weight_bytes(model) - 2 * (8 - 3) * per_expert - embedding_unread

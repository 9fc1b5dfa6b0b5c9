"""gpt-oss on a tiny random checkpoint saved by HF transformers (float32): sliding (window 8) and full layers,
attention sinks, YaRN RoPE, biased router and experts with the clamped SwiGLU. duet's logits and greedy tokens
equal HF's for prompts shorter and longer than the window, through decode, chunked prefill across the window
and a radix-cache hit; what duet does not read is refused in one line."""

from __future__ import annotations

import json

import pytest
import torch

from model_executor.forward_batch import ForwardMode
from model_executor.layers.attention.triton_backend import TritonAttnBackend
from model_executor.model_config import ModelConfig
from runners.model_runner import ModelRunner, RunnerConfig
from tests import triton_mode
from tests.models.test_model_vs_hf import hf_last_logits, rel_err, run_prefill_and_decode
from tests.models.test_new_models_vs_hf import greedy
from tests.triton_mode import DEVICE, in_process

# (the Triton tests, re-run with the interpreter on where triton came up compiled)
test_in_subprocess = triton_mode.subprocess_test(__file__, "-k", "triton_backend or triton_experts")

WINDOW = 8
VOCAB = 320
# sliding, full, sliding; 4 experts, 2 a token; a small swiglu_limit so that the clamps bite at these scales
TINY_GPT_OSS = {
    "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "vocab_size": VOCAB, "hidden_size": 64,
    "intermediate_size": 32, "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 16, "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": WINDOW,
    "layer_types": ["sliding_attention", "full_attention", "sliding_attention"], "max_position_embeddings": 256,
    "rope_parameters": {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0,
                        "original_max_position_embeddings": 64, "beta_fast": 32.0, "beta_slow": 1.0,
                        "truncate": False},
    "swiglu_limit": 0.5, "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
    "pad_token_id": 0}


def save_tiny_gpt_oss(path, cfg: dict = TINY_GPT_OSS, seed: int = 0):
    """An HF GptOssForCausalLM with random weights (sinks of order 1, so that they weigh in every softmax),
    saved as float32 safetensors."""
    import transformers

    torch.manual_seed(seed)
    hf_cfg = transformers.GptOssConfig.from_dict({k: v for k, v in cfg.items() if k != "model_type"})
    model = transformers.GptOssForCausalLM(hf_cfg).to(torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.8, 1.2)
            elif name.endswith("sinks"):
                p.normal_(0, 1.0)
            else:
                p.normal_(0, 0.1)
    model.save_pretrained(path, safe_serialization=True)
    return model.eval()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("gpt_oss")
    return path, save_tiny_gpt_oss(path)


def runner_for(path, **kwargs) -> ModelRunner:
    return ModelRunner(RunnerConfig(model_path=str(path), max_running_requests=4, max_total_tokens=512,
                                    context_length=128, **kwargs))


def _prompts(n):
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(3, VOCAB, (k,), generator=gen).tolist() for k in n]


def test_config_reads_layers_sinks_and_experts(tiny):
    mc = ModelConfig.from_dict(json.loads((tiny[0] / "config.json").read_text()))
    assert [mc.layer_sliding_window(i) for i in range(3)] == [WINDOW, None, WINDOW]
    assert mc.attention_sinks and mc.attention_bias and mc.norm_topk_prob
    assert (mc.num_experts, mc.num_experts_per_tok, mc.moe_intermediate_size) == (4, 2, 32)
    assert (mc.swiglu_alpha, mc.swiglu_limit) == (1.702, 0.5)
    assert mc.rope_scaling["rope_type"] == "yarn"


def test_logits_match_hf_shorter_and_longer_than_the_window(tiny):
    path, hf_model = tiny
    # 5 and 1 tokens fit the window until decode passes it; 19 exceed it from the prefill on
    errors = run_prefill_and_decode(runner_for(path), hf_model, _prompts((5, 1, 19)), decode_steps=12)
    assert max(errors) < 1e-4, errors


def test_compiled_decode_matches_hf(tiny):
    """Decode through the CPU graph runner (inductor, one dynamic trace; the experts one opaque op in it) gives
    HF's logits too."""
    path, hf_model = tiny
    runner = runner_for(path, cuda_graph_bs=(1, 2, 4))
    assert runner.decode_graph_runner is not None
    errors = run_prefill_and_decode(runner, hf_model, _prompts((5, 1, 19)), decode_steps=3)
    assert max(errors) < 1e-4, errors
    assert runner.path_counts["decode_graph"] == 3, runner.path_counts


def test_greedy_tokens_equal_hf_generate(tiny):
    path, hf_model = tiny
    prompt = _prompts((10,))[0]
    with torch.no_grad():
        ref = hf_model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, min_new_tokens=12,
                                eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    assert greedy(runner_for(path), prompt, 12) == ref


def test_chunked_prefill_and_radix_hit_match_hf(tiny):
    """A 23-token prompt prefilled in chunks of 6, 5 and 12 tokens (the window's edge inside chunks, its keys
    in earlier ones), then a second request on the first 13 tokens' KV slots (a radix-cache hit) that
    prefills 9 of its own: each last-token logits equal HF's over the whole sequence."""
    path, hf_model = tiny
    runner = runner_for(path)
    ids, tail = _prompts((23, 9))
    row = runner.req_to_token_pool.alloc()
    loc = runner.allocator.alloc(len(ids))
    runner.req_to_token_pool.write(row, 0, loc)
    done = 0
    for chunk in (6, 5, 12):
        logits = runner.forward(runner.build_batch(ForwardMode.EXTEND, ids[done : done + chunk], [row],
                                                   [done + chunk], loc[done : done + chunk],
                                                   extend_seq_lens=[chunk]))
        done += chunk
    assert rel_err(logits[0], hf_last_logits(hf_model, ids)) < 1e-4
    hit = 13
    row2 = runner.req_to_token_pool.alloc()
    loc2 = runner.allocator.alloc(len(tail))
    runner.req_to_token_pool.write(row2, 0, loc[:hit])
    runner.req_to_token_pool.write(row2, hit, loc2)
    logits = runner.forward(runner.build_batch(ForwardMode.EXTEND, tail, [row2], [hit + len(tail)], loc2,
                                               extend_seq_lens=[len(tail)]))
    assert rel_err(logits[0], hf_last_logits(hf_model, ids[:hit] + tail)) < 1e-4


@in_process
def test_triton_backend_matches_hf(tiny):
    """The Triton decode and extend kernels with sinks and the window (the interpreter without CUDA), the
    rotary fused into the KV store in decode: HF's logits through prefill and 12 decode steps."""
    path, hf_model = tiny
    runner = ModelRunner(RunnerConfig(model_path=str(path), device=DEVICE, dtype="float32",
                                      attention_backend="torch_native", max_running_requests=4,
                                      max_total_tokens=512, context_length=128, disable_cuda_graph=True,
                                      disable_piecewise_cuda_graph=True))
    runner.attn_backend = TritonAttnBackend(runner)  # (the product refuses triton without CUDA)
    errors = run_prefill_and_decode(runner, hf_model, _prompts((5, 1, 19)), decode_steps=12)
    assert max(errors) < 1e-4, errors


@triton_mode.interpreter_only
def test_triton_experts_match_hf(tiny, monkeypatch):
    """The experts on the fused MoE kernels (the interpreter on CPU tensors) with their biases and the clamped
    SwiGLU: the prefill's 25 tokens on the grouped GEMMs, the decode steps' 3 on the small-batch GEMVs; HF's
    logits throughout."""
    from model_executor.layers.moe import fused_moe, kernels

    calls = []

    def triton_path(x, w13, w2, weights, ids, renormalize, round_weights, w13_scale, w2_scale, block_n, block_k,
                    w13_bias, w2_bias, swiglu_alpha, swiglu_limit):
        assert w13_bias is not None and w2_bias is not None and (swiglu_alpha, swiglu_limit) == (1.702, 0.5)
        calls.append(x.shape[0])
        return kernels.fused_experts_triton(x, w13, w2, weights, ids, renormalize, round_weights, w13_bias=w13_bias,
                                            w2_bias=w2_bias, swiglu=(swiglu_alpha, swiglu_limit))

    monkeypatch.setattr(fused_moe, "_fused_experts_impl", triton_path)
    path, hf_model = tiny
    errors = run_prefill_and_decode(runner_for(path), hf_model, _prompts((5, 1, 19)), decode_steps=2)
    assert max(errors) < 1e-4, errors
    assert 25 in calls and 3 in calls, calls


def test_flashinfer_is_refused_for_sinks(tiny):
    from model_executor.layers.attention import AttentionBackendError

    with pytest.raises(AttentionBackendError, match="flashinfer .* does not take attention sinks"):
        runner_for(tiny[0], attention_backend="flashinfer")


def _mxfp4(shape, gen):
    """Random MXFP4 tensors of a [E, R, C] weight: blocks [E, R, C / 32, 16] and scales [E, R, C / 32] (values
    up to 6 * 2 ** -3, the scale of the other weights)."""
    e, r, c = shape
    blocks = torch.randint(0, 256, (e, r, c // 32, 16), generator=gen, dtype=torch.uint8)
    scales = torch.randint(121, 125, (e, r, c // 32), generator=gen, dtype=torch.uint8)
    return blocks, scales


def save_tiny_mxfp4_gpt_oss(path, seed: int = 4):
    """A tiny gpt-oss in the released MXFP4 layout (expert tensors as *_blocks / *_scales, quantization_config
    mxfp4); returns HF's model holding transformers' own dequantization of the same bytes."""
    from safetensors.torch import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    cfg = dict(TINY_GPT_OSS, hidden_size=64, intermediate_size=64)  # (32-value blocks along both inputs)
    hf_model = save_tiny_gpt_oss(path, cfg, seed=seed)
    tensors = load_file(path / "model.safetensors")
    gen = torch.Generator().manual_seed(0)
    e, h, i = cfg["num_local_experts"], cfg["hidden_size"], cfg["intermediate_size"]
    for layer in range(cfg["num_hidden_layers"]):
        experts = hf_model.model.layers[layer].mlp.experts
        for proj, shape in (("gate_up_proj", (e, 2 * i, h)), ("down_proj", (e, h, i))):
            name = f"model.layers.{layer}.mlp.experts.{proj}"
            del tensors[name]
            blocks, scales = _mxfp4(shape, gen)
            tensors[name + "_blocks"], tensors[name + "_scales"] = blocks, scales
            with torch.no_grad():
                getattr(experts, proj).copy_(convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))
    save_file(tensors, path / "model.safetensors")
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4",
                                     "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                                "model.embed_tokens", "lm_head"]}
    (path / "config.json").write_text(json.dumps(config))
    return hf_model.eval()


def test_mxfp4_checkpoint_matches_hf_on_the_dequantized_weights(tmp_path):
    """The released MXFP4 layout loads dequantized: duet's logits equal HF's model holding transformers' own
    dequantization of the same bytes."""
    hf_model = save_tiny_mxfp4_gpt_oss(tmp_path)
    errors = run_prefill_and_decode(runner_for(tmp_path), hf_model, _prompts((5, 19)), decode_steps=3)
    assert max(errors) < 1e-4, errors


def test_mxfp4_is_refused_for_other_architectures():
    from model_executor.layers.quantization import QuantizationError, checkpoint_quant_config

    with pytest.raises(QuantizationError, match="mxfp4.*GptOssForCausalLM only"):
        checkpoint_quant_config({"architectures": ["LlamaForCausalLM"], "quantization_config": {"quant_method": "mxfp4"}})


def test_server_greedy_tokens_equal_hf(tmp_path, model_dir):
    from tests.models.test_sliding_window_models import assert_server_gives_hf_tokens

    hf_model = save_tiny_gpt_oss(tmp_path, dict(TINY_GPT_OSS, vocab_size=49152), seed=3)
    assert_server_gives_hf_tokens(tmp_path, hf_model, model_dir)

"""Qwen3, Qwen3-MoE and Mixtral on tiny random configs match HF transformers on the same weights (float32):
logits of a prefill and 6 decode steps within 1e-4 relative, and 32 greedy tokens equal to HF generate.
Also: the RoPE scaling types against HF's rotary, and the MoE weight-name mapping's errors."""

from __future__ import annotations

import pytest
import torch

from model_executor.forward_batch import ForwardMode
from runners.model_runner import ModelRunner, RunnerConfig
from tests.conftest import save_tiny_hf_model
from tests.models.test_model_vs_hf import run_prefill_and_decode

BASE = {"vocab_size": 320, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "max_position_embeddings": 512, "rms_norm_eps": 1e-6, "bos_token_id": 1, "eos_token_id": 2}
TINY_QWEN3 = dict(BASE, architectures=["Qwen3ForCausalLM"], model_type="qwen3", head_dim=32, rope_theta=1e6,
                  tie_word_embeddings=True)
TINY_QWEN3_UNTIED = dict(TINY_QWEN3, tie_word_embeddings=False)
# Layer 0 dense (mlp_only_layers), layers 1 and 2 MoE; 8 experts, top 3, renormalised.
TINY_QWEN3_MOE = dict(BASE, architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", head_dim=16,
                      num_hidden_layers=3, num_experts=8, num_experts_per_tok=3, moe_intermediate_size=48,
                      norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[0], rope_theta=1e6,
                      tie_word_embeddings=False)
TINY_QWEN3_MOE_NO_NORM = dict(TINY_QWEN3_MOE, norm_topk_prob=False, mlp_only_layers=[])
TINY_MIXTRAL = dict(BASE, architectures=["MixtralForCausalLM"], model_type="mixtral", num_local_experts=4,
                    num_experts_per_tok=2, rope_theta=1e6, tie_word_embeddings=False, sliding_window=None)
TINY_LLAMA_BASE = dict(BASE, architectures=["LlamaForCausalLM"], model_type="llama", rope_theta=10000.0,
                       tie_word_embeddings=False, max_position_embeddings=128)
ROPE_CASES = {
    "linear": {"rope_type": "linear", "factor": 4.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 32},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    # served at 32 tokens (the original length): the short factors, as HF for every sequence that fits
    "longrope": {"rope_type": "longrope", "original_max_position_embeddings": 32, "factor": 4.0,
                     "short_factor": [1.0 + 0.1 * i for i in range(8)], "long_factor": [2.0 + i for i in range(8)]},
}
CONTEXT = {"llama_rope_longrope": 32}
CONFIGS = {
    "qwen3": TINY_QWEN3, "qwen3_untied": TINY_QWEN3_UNTIED, "qwen3_moe": TINY_QWEN3_MOE,
    "qwen3_moe_no_norm": TINY_QWEN3_MOE_NO_NORM, "mixtral": TINY_MIXTRAL,
    **{f"llama_rope_{k}": dict(TINY_LLAMA_BASE, rope_scaling=v) for k, v in ROPE_CASES.items()},
}


def tiny_models(tmp_path_factory, configs: dict):
    """get(name) -> (folder, HF model) of configs[name], saved once per module on first use."""
    made = {}

    def get(name):
        if name not in made:
            path = tmp_path_factory.mktemp(name)
            made[name] = path, save_tiny_hf_model(path, configs[name], seed=len(name))
        return made[name]

    return get


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_models(tmp_path_factory, CONFIGS)


def _prompts(n=(7, 1, 23)):
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(3, 320, (k,), generator=gen).tolist() for k in n]


@pytest.mark.parametrize("name", list(CONFIGS))
def test_logits_match_hf(name, tiny):
    path, hf_model = tiny(name)
    runner = ModelRunner(RunnerConfig(model_path=str(path), max_running_requests=4, max_total_tokens=512,
                                      context_length=CONTEXT.get(name, 128)))
    errors = run_prefill_and_decode(runner, hf_model, _prompts(), decode_steps=6)
    assert max(errors) < 1e-4, errors


def greedy(runner: ModelRunner, prompt: list[int], n: int) -> list[int]:
    row = runner.req_to_token_pool.alloc()
    loc = runner.allocator.alloc(len(prompt) + n)
    runner.req_to_token_pool.write(row, 0, loc)
    logits = runner.forward(runner.build_batch(ForwardMode.EXTEND, prompt, [row], [len(prompt)],
                                               loc[: len(prompt)], extend_seq_lens=[len(prompt)]))
    out = [int(logits[0].argmax())]
    for i in range(n - 1):
        seq_len = len(prompt) + len(out)
        logits = runner.forward(runner.build_batch(ForwardMode.DECODE, out[-1:], [row], [seq_len],
                                                   loc[seq_len - 1 : seq_len]))
        out.append(int(logits[0].argmax()))
    return out


@pytest.mark.parametrize("name", ["qwen3", "qwen3_moe", "mixtral"])
def test_greedy_tokens_equal_hf_generate(name, tiny):
    path, hf_model = tiny(name)
    runner = ModelRunner(RunnerConfig(model_path=str(path), max_running_requests=2, max_total_tokens=256,
                                      context_length=128))
    prompt = _prompts((11,))[0]
    with torch.no_grad():
        ref = hf_model.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False, min_new_tokens=32,
                                eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    assert greedy(runner, prompt, 32) == ref


def test_sliding_window_layers_from_config():
    """The window and the layers it applies to, as HF's attention reads each config; the context is not cut."""
    from model_executor.model_config import ModelConfig

    mistral = ModelConfig.from_dict(dict(TINY_LLAMA_BASE, architectures=["MistralForCausalLM"], sliding_window=64,
                                         max_position_embeddings=512))
    assert mistral.check_context_length(None) == 512 and mistral.check_context_length(512) == 512
    assert [mistral.layer_sliding_window(i) for i in range(2)] == [64, 64]
    # Qwen configs carry a sliding_window that HF applies only with use_sliding_window, from max_window_layers on.
    qwen = ModelConfig.from_dict(dict(TINY_QWEN3, sliding_window=64, use_sliding_window=False))
    assert qwen.check_context_length(None) == 512 and qwen.sliding_window_layers == ()
    qwen_sliding = ModelConfig.from_dict(dict(TINY_QWEN3, sliding_window=64, use_sliding_window=True,
                                              max_window_layers=1))
    assert qwen_sliding.check_context_length(None) == 512
    assert [qwen_sliding.layer_sliding_window(i) for i in range(2)] == [None, 64]
    typed = ModelConfig.from_dict(dict(TINY_QWEN3, sliding_window=64, use_sliding_window=True,
                                       layer_types=["sliding_attention", "full_attention"]))
    assert typed.sliding_window_layers == (0,)
    llama = ModelConfig.from_dict(dict(TINY_LLAMA_BASE, sliding_window=64))
    assert llama.sliding_window is None and llama.sliding_window_layers == ()


@pytest.mark.parametrize("rope", [{"rope_type": "mrope", "factor": 2.0}, {"type": "su", "factor": 2.0}])
def test_unsupported_rope_type_is_named(rope):
    from model_executor.model_config import ModelConfig, ModelConfigError

    kind = rope.get("rope_type", rope.get("type"))
    with pytest.raises(ModelConfigError, match=f"rope_type '{kind}' is not supported; duet supports default"):
        ModelConfig.from_dict(dict(TINY_LLAMA_BASE, rope_scaling=rope))


@pytest.mark.parametrize("name,dropped", [
    ("qwen3_moe", "model.layers.2.mlp.experts.5.up_proj.weight"),
    ("mixtral", "model.layers.1.block_sparse_moe.experts.3.w2.weight"),
])
def test_missing_expert_tensor_is_named(name, dropped, tiny, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    from model_executor.weight_loader import WeightLoadError

    path, _ = tiny(name)
    shutil.copy(path / "config.json", tmp_path / "config.json")
    tensors = load_file(path / "model.safetensors")
    del tensors[dropped]
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(WeightLoadError, match=f"has no tensor '{dropped}'"):
        ModelRunner(RunnerConfig(model_path=str(tmp_path), max_running_requests=1, max_total_tokens=16))


@pytest.mark.parametrize("name", ["qwen3_moe"])  # q/k norms and experts; the others add nothing to trace
def test_piecewise_stand_in_equals_eager(name, tiny):
    """Traced once for the piecewise runner (the experts an opaque op: one piece per gap between attention
    calls), and replays through the CPU stand-in graphs equal the eager forward. (The decode graphs need
    the triton attention backend: tests/kernels/test_moe_gpu.py.)"""
    from runners.graph_seam import StandInCapturer
    from runners.piecewise_cuda_graph_runner import PiecewiseCudaGraphRunner
    from tests.runners.test_piecewise_runner import make_extend_batch, release

    path, _ = tiny(name)
    runner = ModelRunner(RunnerConfig(model_path=str(path), max_running_requests=8, max_total_tokens=1024,
                                      context_length=128))
    torch._dynamo.reset()
    try:
        pw = PiecewiseCudaGraphRunner(runner, [4, 16, 64], capturer=StandInCapturer())
        assert len(pw.pieces) == runner.model_config.num_hidden_layers + 1
        for ext, pre in (([5], [0]), ([3, 20, 1], [0, 7, 30])):
            fb, rows = make_extend_batch(runner, ext, pre, seed=sum(ext))
            assert pw.can_run(fb)
            graphed = pw.replay(fb).clone()
            torch.testing.assert_close(graphed, runner.forward_eager(fb), rtol=1e-5, atol=1e-5)
            release(runner, rows, fb)
        assert pw.num_traces == 1
    finally:
        torch._dynamo.reset()

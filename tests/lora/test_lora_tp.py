"""Multi-LoRA under tensor parallelism on CPU (gloo): tp 2 against tp 1 on a tiny random Llama (two KV heads,
and one KV head: replicated over the ranks) and Qwen3, each with three PEFT adapters of different ranks and
targets, the base model and every adapter in one batch (extend, then decode). Each rank holds its shards of the
adapters (column-parallel qkv and gate_up: B by output rows; row-parallel o and down: A by input columns, the
update added before the all-reduce); an adapter loaded at run time reaches both ranks through rank 0's relay of
the load message and runs on both."""

from __future__ import annotations

import pytest
import torch

from model_executor.lora.manager import LoraConfig
from tests.conftest import TINY_LLAMA, save_tiny_hf_model
from tests.lora_models import ADAPTERS, TINY_QWEN3, save_adapter
from tests.tp_utils import run_model, run_tp

P0, P1 = [5, 17, 42, 99, 123, 7, 250, 31, 64, 8], [200, 11, 3, 77, 150, 9]
PROMPTS = [P0, P0, P0, P0, P1]
NAMES = [None, "a1", "a2", "a3", "a2"]  # the base and three adapters in each batch; a3 is loaded at run time
BASES = {"llama": TINY_LLAMA, "llama_one_kv_head": dict(TINY_LLAMA, num_key_value_heads=1), "qwen3": TINY_QWEN3}


def make_cases(root, bases: dict[str, dict] = BASES) -> dict[str, tuple[str, dict]]:
    """name -> (base folder, run_model's LoRA arguments): a1 and a2 loaded at start-up, a3 at run time."""
    out = {}
    for base, config in bases.items():
        hf = save_tiny_hf_model(root / base, config, seed=3)
        folders = {}
        for i, (name, kw) in enumerate(ADAPTERS.items()):
            folders[name] = str(root / f"{base}-{name}")
            save_adapter(hf, folders[name], seed=10 + i, **kw)
        lora = LoraConfig(paths=(("a1", folders["a1"]), ("a2", folders["a2"])), max_per_batch=4)
        out[base] = (str(root / base), {"lora": lora, "lora_names": NAMES, "late_loras": (("a3", folders["a3"]),),
                                        "prompts": PROMPTS, "max_running_requests": 16})
    return out


@pytest.fixture(scope="module")
def cases(tmp_path_factory) -> dict[str, tuple[str, dict]]:
    return make_cases(tmp_path_factory.mktemp("lora-tp"))


@pytest.fixture(scope="module")
def tp2_results(cases):
    return dict(zip(cases, run_tp([path for path, _ in cases.values()], size=2,
                                  per_path=[kw for _, kw in cases.values()])))


@pytest.mark.parametrize("name", list(BASES))
def test_tp2_with_adapters_equals_tp1(name, cases, tp2_results):
    path, kw = cases[name]
    one = run_model(path, **kw)
    ranks = tp2_results[name]
    assert len(one["logits"]) > 1  # the extend batch and the decode steps
    for step, (a, b) in enumerate(zip(one["logits"], ranks[0]["logits"])):
        assert a.shape == b.shape == (len(PROMPTS), a.shape[1])
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5, msg=lambda m, step=step: f"step {step}: {m}")
    assert ranks[0]["tokens"] == ranks[1]["tokens"] == one["tokens"]
    assert all(len(t) == 8 for t in one["tokens"])
    assert ranks[0]["sampled"] == ranks[1]["sampled"]
    # The adapters are not no-ops: the same prompt under the base and each adapter gives four distinct logits.
    first = one["logits"][0][:4]
    for i in range(4):
        for j in range(i):
            assert (first[i] - first[j]).abs().max() > 1e-2, (NAMES[i], NAMES[j])
    # The adapter loaded at run time is on both ranks (and was used above).
    assert ranks[0]["loras_after_loads"] == ranks[1]["loras_after_loads"] == [["a1", "a2", "a3"]]
    # Each rank's pool holds its shards: the same size on both, less than the whole adapters' pool.
    assert ranks[0]["lora_pool_bytes"] == ranks[1]["lora_pool_bytes"] < one["lora_pool_bytes"]

"""GPU: loading the Llama-3.1-8B shape from bf16 safetensors on disk stays within weights + 1 GiB of device
memory, and the KV cache is sized from what is free after the weights, the activation profile and the graph
reserve (prints the split; the computed graph reserve must cover what capture really took)."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks.load_and_size import measure, write_random_checkpoint

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def llama8b_folder(tmp_path_factory):
    return write_random_checkpoint("llama-3.1-8b", tmp_path_factory.mktemp("llama8b"))


def test_8b_shape_load_peak_and_memory_split(llama8b_folder):
    result = measure(llama8b_folder, max_running_requests=256, max_prefill_tokens=16384, mem_fraction_static=0.85,
                     graphs=True, context_length=None)
    print(json.dumps(result, indent=2))
    mem = result["memory"]
    assert mem["load_peak_gib"] <= mem["weights_gib"] + 1.0
    assert 14.0 < mem["weights_gib"] < 16.5  # 8.03e9 bf16 parameters, no float32 copy, one RoPE table
    assert mem["num_slots"] > 0 and mem["kv_gib"] > 0
    assert mem["graphs_measured_gib"] <= mem["graphs_gib"], "the computed graph reserve is too small"
    used = mem["weights_gib"] + mem["kv_gib"] + mem["graphs_gib"] + mem["activations_gib"] + mem["other_gib"]
    assert used <= mem["budget_gib"] + 0.01
    assert torch.cuda.memory_allocated() < mem["budget_gib"] * 2**30

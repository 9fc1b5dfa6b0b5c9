"""Multi-LoRA at tp 2 on two GPUs (NCCL): the tiny Llama with three adapters (two at start-up, one loaded at run
time), the base model and every adapter in each batch, through the decode graphs and the piecewise extend
graphs with the Triton LoRA kernels: the same greedy tokens as tp 1, logits close to tp 1's.

Needs two GPUs: skipped (mark gpu) when fewer than two are visible.
Run: pytest -m gpu tests/lora/test_lora_tp_gpu.py -s
"""

from __future__ import annotations

import pytest
import torch

from tests.conftest import TINY_LLAMA
from tests.lora.test_lora_tp import make_cases
from tests.tp_utils import run_model, run_tp

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2,
                       reason=f"needs 2 GPUs for tensor parallelism, {torch.cuda.device_count()} visible"),
]

GRAPHS = {"device": "cuda", "dtype": "float32", "attention_backend": "triton", "max_total_tokens": 4096,
          "context_length": 512, "cuda_graph_bs": (1, 2, 4, 8), "piecewise_cuda_graph_tokens": (8, 16, 32, 64)}


def test_tp2_with_adapters_equals_tp1_through_graphs(tmp_path):
    path, kw = make_cases(tmp_path, {"llama": TINY_LLAMA})["llama"]
    kw = {**kw, **GRAPHS}
    one = run_model(path, **kw)
    torch.cuda.empty_cache()
    ranks = run_tp([path], size=2, per_path=[kw])[0]
    for r in (one, *ranks):  # the extend pieces, then the decode graphs, with the adapters in them
        assert r["path_counts"].get("extend_graph", 0) > 0 and r["path_counts"].get("decode_graph", 0) > 0, r
        assert r["path_counts"].get("decode_eager", 0) == 0
    assert ranks[0]["loras_after_loads"] == ranks[1]["loras_after_loads"] == [["a1", "a2", "a3"]]
    assert ranks[0]["tokens"] == ranks[1]["tokens"] == one["tokens"]
    worst = max((a - b).abs().max().item() for a, b in zip(one["logits"], ranks[0]["logits"]))
    print(f"\ntp2 with adapters: max |logits - tp1 logits| = {worst:.2e}")
    assert worst < 5e-2  # (the Triton extend kernels dot in bfloat16)

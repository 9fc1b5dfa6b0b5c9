"""Tensor parallelism on two GPUs (NCCL): tp 2 equals tp 1 on Llama-3.2-1B's shape with random weights.

Both runs load the same random checkpoint (written once from the same seed) in float32, capture decode
graphs (the all-reduce and the logits all-gather are captured in them) and piecewise extend graphs (the
all-reduce lies inside the pieces; only attention splits them), and must give the same greedy tokens,
through the graphs (the path counts prove the graphs ran), with logits close to tp 1's. The sums go
through the one-shot kernel (and through NCCL alone with custom_all_reduce off); in bf16 at one request, on
a two-layer model of Llama-3.1-8B's width, the o_proj sum's kernel also takes the residual add and the
norm's sums, checked against the NCCL path.

Needs two GPUs: skipped (mark gpu) when fewer than two are visible.
Run: pytest -m gpu tests/parallel/test_tp_gpu.py -s
"""

from __future__ import annotations

import pytest
import torch

from model_executor.configs import shape_path
from tests.tp_utils import run_model, run_tp, save_random_checkpoint

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2,
                       reason=f"needs 2 GPUs for tensor parallelism, {torch.cuda.device_count()} visible"),
]

GRAPHS = {"device": "cuda", "dtype": "float32", "attention_backend": "triton", "max_running_requests": 8,
              "max_total_tokens": 4096, "context_length": 1024, "cuda_graph_bs": (1, 2, 4, 8),
              "piecewise_cuda_graph_tokens": (8, 16, 32, 64)}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return str(save_random_checkpoint(shape_path("llama-3.2-1b"), tmp_path_factory.mktemp("llama-1b-random"),
                                      seed=0, dtype=torch.float32, device="cuda"))


@pytest.fixture(scope="module")
def tp1(checkpoint):
    out = run_model(checkpoint, **GRAPHS)
    torch.cuda.empty_cache()
    return out


def test_tp2_greedy_tokens_equal_tp1_through_graphs(checkpoint, tp1):
    ranks = run_tp([checkpoint], size=2, **GRAPHS)[0]
    for r in (tp1, *ranks):  # every step went through a graph: the extend piece, then the decode graphs
        assert r["path_counts"].get("extend_graph", 0) > 0 and r["path_counts"].get("decode_graph", 0) > 0, r
        assert r["path_counts"].get("decode_eager", 0) == 0
    # the layers' sums went one-shot (a [tokens, 2048] float32 sum is 8 KiB a row), at capture and eagerly
    assert ranks[0]["one_shot_calls"] > 0 and ranks[1]["one_shot_calls"] == ranks[0]["one_shot_calls"]
    assert tp1["one_shot_calls"] is None
    assert ranks[0]["tokens"] == ranks[1]["tokens"] == tp1["tokens"]
    assert ranks[0]["sampled"] == ranks[1]["sampled"]
    worst = max((a - b).abs().max().item() for a, b in zip(tp1["logits"], ranks[0]["logits"]))
    print(f"\ntp1 tokens {tp1['tokens']}\ntp2 max |logits - tp1 logits| = {worst:.2e}")
    assert worst < 1e-2
    assert ranks[0]["kv_heads"] == 4 and tp1["kv_heads"] == 8  # Llama-3.2-1B: 8 KV heads, 4 per rank


@pytest.fixture(scope="module")
def wide_checkpoint(tmp_path_factory):
    """Llama-3.1-8B's layer shapes (so tp 2's GEMVs are in the H200's small-M table), two layers and a
    32k vocabulary."""
    import json

    cfg = json.loads((shape_path("llama-3.1-8b") / "config.json").read_text())
    shape = tmp_path_factory.mktemp("wide-shape")
    (shape / "config.json").write_text(json.dumps(dict(cfg, num_hidden_layers=2, vocab_size=32000)))
    return str(save_random_checkpoint(shape, tmp_path_factory.mktemp("wide-random"), seed=0,
                                      dtype=torch.bfloat16, device="cuda"))


def test_tp2_one_row_sums_take_the_norm_and_match_nccl(wide_checkpoint):
    """bf16, one request (decode rows of one): the o_proj sum's kernel also adds the residual and makes the
    gate/up GEMV's prenormed row (the post-attention norm's launch goes). Its logits must match the NCCL
    path's (separate sum and RMSNorm) within bf16's rounding; a wrong add or norm would be off by O(1)."""
    one = [[5, 17, 42, 99, 123, 7, 250, 31, 64, 8]]
    bf16 = dict(GRAPHS, dtype="bfloat16")
    fused = run_tp([wide_checkpoint], size=2, prompts=one, **bf16)[0]
    nccl = run_tp([wide_checkpoint], size=2, prompts=one, custom_all_reduce=False, **bf16)[0]
    assert fused[0]["add_norm_calls"] > 0 and fused[0]["add_norm_calls"] == fused[1]["add_norm_calls"]
    assert nccl[0]["add_norm_calls"] is None
    for r in (*fused, *nccl):
        assert r["path_counts"].get("decode_graph", 0) > 0 and r["path_counts"].get("decode_eager", 0) == 0, r
    scale = max(t.abs().max().item() for t in nccl[0]["logits"])
    worst = max((a.float() - b.float()).abs().max().item() for a, b in zip(fused[0]["logits"], nccl[0]["logits"]))
    print(f"\none row, bf16: max |fused - nccl logits| = {worst:.3e} (largest logit {scale:.3e}); tokens "
          f"{fused[0]['tokens']} / {nccl[0]['tokens']}")
    assert worst <= 0.03 * scale


def test_tp2_with_nccl_only_gives_the_same_tokens(checkpoint, tp1):
    """--disable-custom-all-reduce: every sum through NCCL, the same greedy tokens."""
    ranks = run_tp([checkpoint], size=2, custom_all_reduce=False, **GRAPHS)[0]
    assert ranks[0]["one_shot_calls"] is None and ranks[1]["one_shot_calls"] is None
    assert ranks[0]["tokens"] == ranks[1]["tokens"] == tp1["tokens"]

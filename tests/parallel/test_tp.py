"""Tensor parallelism on CPU (gloo): tp 2 against tp 1 on tiny random models, and the weight sharding.

The tp 2 runs are two spawned processes (tests/tp_utils.py), each loading its shards from the same
safetensors folder; rank 0's logits and greedy tokens must equal the single-process run's.
"""

from __future__ import annotations

import pytest
import torch

from model_executor.distributed import parallel_state as ps
from model_executor.lazy_slice import LazySlice
from model_executor.model_config import ModelConfig
from model_executor.weight_loader import load_model
from tests.conftest import TINY_LLAMA, TINY_QWEN2, save_tiny_hf_model
from tests.models.test_gpt_oss import TINY_GPT_OSS, save_tiny_gpt_oss, save_tiny_mxfp4_gpt_oss
from tests.models.test_sliding_window_models import TINY_GEMMA3, TINY_PHI3
from tests.tp_utils import PROMPTS, run_model, run_tp

TINY_LLAMA_ONE_KV = dict(TINY_LLAMA, num_key_value_heads=1)  # fewer KV heads than ranks: replicated
TP_MODELS = ["llama", "qwen2_bias_tied", "llama_one_kv_head", "gemma3", "phi3", "gpt_oss"]
# (the sliding-window models' window is 8 tokens: the first prompt exceeds it, and every sequence does once decoded)
assert max(map(len, PROMPTS)) > TINY_GEMMA3["sliding_window"] == TINY_PHI3["sliding_window"] \
    == TINY_GPT_OSS["sliding_window"]


@pytest.fixture(scope="module")
def tp_models(tmp_path_factory, tiny_llama, tiny_qwen2):
    paths = {"llama": str(tiny_llama[0]), "qwen2_bias_tied": str(tiny_qwen2[0])}
    for name, config in (("llama_one_kv_head", TINY_LLAMA_ONE_KV), ("gemma3", TINY_GEMMA3), ("phi3", TINY_PHI3)):
        paths[name] = str(tmp_path_factory.mktemp(name))
        save_tiny_hf_model(paths[name], config, seed=3)
    paths["gpt_oss"] = str(tmp_path_factory.mktemp("gpt_oss"))
    save_tiny_gpt_oss(paths["gpt_oss"], seed=3)
    return paths


@pytest.fixture(scope="module")
def tp2_results(tp_models):
    # Rank 1 can hold fewer KV slots than rank 0 (the default 256): both must size their pools to the minimum.
    return dict(zip(tp_models, run_tp(list(tp_models.values()), size=2, per_rank={1: {"max_total_tokens": 200}})))


@pytest.mark.parametrize("name", TP_MODELS)
def test_tp2_logits_and_greedy_tokens_equal_tp1(name, tp_models, tp2_results):
    one = run_model(tp_models[name])
    ranks = tp2_results[name]
    for a, b in zip(one["logits"], ranks[0]["logits"]):
        assert a.shape == b.shape
        torch.testing.assert_close(b, a, rtol=0, atol=1e-5)
    assert ranks[0]["tokens"] == ranks[1]["tokens"] == one["tokens"]
    assert ranks[0]["sampled"] == ranks[1]["sampled"]  # rank 0's sampled ids are broadcast
    assert all(len(t) == 8 for t in one["tokens"])
    # Each rank's KV pool holds its own heads: half of them, or one replicated head.
    full_kv = ModelConfig.from_pretrained(tp_models[name]).num_key_value_heads
    assert ranks[0]["kv_heads"] == max(1, full_kv // 2) and one["kv_heads"] == full_kv
    assert ranks[0]["num_slots"] == ranks[1]["num_slots"] == 200 and one["num_slots"] == 256


def _shards(path: str, size: int) -> list[dict[str, torch.Tensor]]:
    cfg = ModelConfig.from_pretrained(path)
    out = []
    for rank in range(size):
        with ps.shard_as(rank, size):
            model = load_model(path, cfg, torch.float32, "cpu")
        out.append(dict(model.named_parameters(remove_duplicate=False)))
    return out


def _qkv_parts(w: torch.Tensor, cfg: ModelConfig, size: int) -> tuple[torch.Tensor, ...]:
    q = cfg.num_attention_heads // size * cfg.head_dim
    kv = max(1, cfg.num_key_value_heads // size) * cfg.head_dim
    return w.split([q, kv, kv], dim=0)


@pytest.mark.parametrize("config", [TINY_LLAMA, TINY_LLAMA_ONE_KV, TINY_QWEN2])
def test_weight_shards_gather_to_the_full_tensors(tmp_path, config):
    hf = save_tiny_hf_model(tmp_path, config)
    full = dict(hf.named_parameters(remove_duplicate=False))
    cfg = ModelConfig.from_pretrained(tmp_path)
    r0, r1 = _shards(str(tmp_path), 2)
    layer = "model.layers.1"
    # Column-parallel: q, k, v, gate, up split by output rows (k/v replicated when there is one KV head).
    for ours, bias_or_weight in ((f"{layer}.self_attn.qkv_proj.weight", "weight"),
                                 (f"{layer}.self_attn.qkv_proj.bias", "bias")):
        if ours not in r0:
            continue
        (q0, k0, v0), (q1, k1, v1) = _qkv_parts(r0[ours], cfg, 2), _qkv_parts(r1[ours], cfg, 2)
        hf_name = f"{layer}.self_attn.{{}}_proj.{bias_or_weight}"
        torch.testing.assert_close(torch.cat([q0, q1]), full[hf_name.format("q")], rtol=0, atol=0)
        for part0, part1, n in ((k0, k1, "k"), (v0, v1, "v")):
            want = full[hf_name.format(n)]
            got = part0 if cfg.num_key_value_heads == 1 else torch.cat([part0, part1])
            torch.testing.assert_close(got, want, rtol=0, atol=0)
            if cfg.num_key_value_heads == 1:
                torch.testing.assert_close(part1, want, rtol=0, atol=0)
    inter = cfg.intermediate_size // 2
    g0, u0 = r0[f"{layer}.mlp.gate_up_proj.weight"].split(inter)
    g1, u1 = r1[f"{layer}.mlp.gate_up_proj.weight"].split(inter)
    torch.testing.assert_close(torch.cat([g0, g1]), full[f"{layer}.mlp.gate_proj.weight"], rtol=0, atol=0)
    torch.testing.assert_close(torch.cat([u0, u1]), full[f"{layer}.mlp.up_proj.weight"], rtol=0, atol=0)
    # Row-parallel: o and down split by input columns.
    for ours in (f"{layer}.self_attn.o_proj.weight", f"{layer}.mlp.down_proj.weight"):
        torch.testing.assert_close(torch.cat([r0[ours], r1[ours]], dim=1), full[ours], rtol=0, atol=0)
    # Vocabulary-parallel: embedding and LM head split by vocabulary rows; norms whole on both ranks.
    for ours in ("model.embed_tokens.weight", "lm_head.weight"):
        torch.testing.assert_close(torch.cat([r0[ours], r1[ours]]), full[ours], rtol=0, atol=0)
    for ours in (f"{layer}.input_layernorm.weight", "model.norm.weight"):
        torch.testing.assert_close(r0[ours], full[ours], rtol=0, atol=0)
        torch.testing.assert_close(r1[ours], full[ours], rtol=0, atol=0)


def _gathered(name: str, parts: list[torch.Tensor], cfg: ModelConfig) -> torch.Tensor:
    """The tp 1 tensor the ranks' shards of parameter `name` make up (rank 0's where each rank holds it whole)."""
    if ".qkv_proj." in name:
        q, k, v = zip(*(_qkv_parts(p, cfg, len(parts)) for p in parts))
        return torch.cat([*q, *k, *v])
    if ".gate_up_proj." in name or ".w13_" in name:  # [gate; up] per rank, along dim 0 or (experts) dim 1
        dim = 1 if ".w13_" in name else 0
        gate, up = zip(*(p.chunk(2, dim=dim) for p in parts))
        return torch.cat([*gate, *up], dim=dim)
    if name.endswith(("o_proj.weight", "down_proj.weight", ".w2_weight")):  # split along their input
        return torch.cat(parts, dim=-1)
    if name.endswith(("embed_tokens.weight", "lm_head.weight", ".sinks")):
        return torch.cat(parts)
    return parts[0]


@pytest.mark.parametrize("name", ["gemma3", "phi3", "gpt_oss", "gpt_oss_mxfp4"])
def test_fused_expert_and_sink_shards_gather_to_the_tp1_parameters(name, tp_models, tmp_path):
    """Phi-3's fused checkpoint tensors cut into per-rank q/k/v and gate/up; gpt-oss's sinks with their heads,
    its experts along the intermediate dimension (w2's bias on rank 0 only, so the all-reduce adds it once),
    also from an MXFP4 checkpoint (dequantized, then sliced)."""
    if name == "gpt_oss_mxfp4":
        save_tiny_mxfp4_gpt_oss(tmp_path)
        path = str(tmp_path)
    else:
        path = tp_models[name]
    cfg = ModelConfig.from_pretrained(path)
    (full,), ranks = _shards(path, 1), _shards(path, 2)
    assert ranks[0].keys() == full.keys()
    for param, want in full.items():
        parts = [r[param] for r in ranks]
        if param.endswith((".w2_bias", "o_proj.bias")):  # row-parallel biases: rank 0's, zeros elsewhere
            torch.testing.assert_close(parts[1], torch.zeros_like(want), rtol=0, atol=0)
        elif _gathered(param, parts, cfg) is parts[0]:  # whole on every rank
            torch.testing.assert_close(parts[1], want, rtol=0, atol=0)
        torch.testing.assert_close(_gathered(param, parts, cfg), want, rtol=0, atol=0,
                                   msg=lambda m, param=param: f"{param}: {m}")


def test_an_intermediate_size_that_does_not_split_is_refused_in_one_line():
    from model_executor.weight_loader import check_tensor_parallel

    cfg = ModelConfig.from_dict(dict(TINY_GPT_OSS, intermediate_size=30))
    check_tensor_parallel(cfg, 2)
    with pytest.raises(ValueError, match="^intermediate size 30 cannot be split over 4 tensor-parallel ranks$"):
        check_tensor_parallel(cfg, 4)


def test_vocab_padding_rows_are_zero(tmp_path):
    """A vocabulary that does not split evenly: rank 1's block is padded, its padding row is zero."""
    from model_executor.layers.embedding import VocabParallelEmbedding

    full = torch.randn(7, 4)
    with ps.shard_as(1, 2):
        emb = VocabParallelEmbedding(7, 4)
        emb.weight_loader(emb.weight, full)
    assert emb.weight.shape == (4, 4)
    torch.testing.assert_close(emb.weight[:3], full[4:], rtol=0, atol=0)
    assert emb.weight[3].abs().sum() == 0


def test_each_rank_reads_only_its_shard(tmp_path, monkeypatch):
    save_tiny_hf_model(tmp_path, TINY_LLAMA)
    cfg = ModelConfig.from_pretrained(tmp_path)
    read = []
    original = LazySlice.materialize

    def counting(self):
        t = original(self)
        read.append(t.numel())
        return t

    monkeypatch.setattr(LazySlice, "materialize", counting)
    with ps.shard_as(0, 2):
        model = load_model(str(tmp_path), cfg, torch.float32, "cpu")
    held = sum(p.numel() for p in model.parameters())
    assert read and sum(read) == held  # not one element more than this rank's parameters


def test_offline_engine_tp2_gives_the_tp1_text(tmp_path, capsys):
    from server import generate
    from tests.fake_scheduler import build_tiny_model_folder

    folder = str(build_tiny_model_folder(tmp_path / "tiny", with_weights=True))
    argv = ["--model-path", folder, "--prompt", "the quick brown fox", "--max-new-tokens", "8", "--device", "cpu"]
    assert generate.main(argv) == 0
    one = capsys.readouterr().out
    assert generate.main([*argv, "--tp-size", "2"]) == 0
    assert capsys.readouterr().out == one and one.strip()
    assert generate.main([*argv, "--tp-size", "3"]) == 2  # 4 heads do not split over 3 ranks
    assert "--tp-size 3: 4 attention heads cannot be split over 3" in capsys.readouterr().err


def test_random_checkpoint_round_trips_through_the_loader(tmp_path):
    """The GPU tests' random real-shaped checkpoints: saved under HF names, loaded back unchanged."""
    from tests.tp_utils import save_random_checkpoint

    src = tmp_path / "shape"
    save_tiny_hf_model(src, TINY_LLAMA)
    folder = save_random_checkpoint(src, tmp_path / "random", seed=5)
    cfg = ModelConfig.from_pretrained(folder)
    loaded = dict(load_model(folder, cfg, torch.float32, "cpu").named_parameters())
    from model_executor.weight_loader import build_model, init_random_weights

    want = dict(init_random_weights(build_model(cfg, torch.float32, "cpu"), 5).named_parameters())
    assert loaded.keys() == want.keys()
    for name, tensor in want.items():
        torch.testing.assert_close(loaded[name], tensor, rtol=0, atol=0)


def test_a_collective_with_a_silent_peer_fails_after_the_timeout(tmp_path):
    """A rank that stops answering fails its peers' collectives after --dist-timeout, never a silent hang."""
    import time

    import torch.multiprocessing as mp

    from tests.tp_utils import _silent_peer_rank

    ctx = mp.spawn(_silent_peer_rank, args=(f"file://{tmp_path}/init", str(tmp_path)), nprocs=2, join=False)
    result = tmp_path / "rank0.txt"
    deadline = time.monotonic() + 60  # the broadcast's timeout is 2 s: far less than this, unless it hangs
    while not result.exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    if not result.exists():
        for p in ctx.processes:
            p.kill()
        pytest.fail("rank 0's broadcast to a silent peer still waits after 60 s")
    try:
        ctx.join(30)
    except mp.ProcessExitedException:
        pass  # gloo may abort a process whose collective timed out when it exits: the outcome file says what happened
    outcome = result.read_text()
    assert "timed out" in outcome.lower() or "timeout" in outcome.lower(), outcome


@pytest.mark.parametrize("peer_leaves", [False, True])
def test_a_gloo_group_is_left_once_every_rank_reaches_the_teardown(tmp_path, peer_leaves):
    """destroy_tensor_parallel on CPU waits for the other ranks (no rank closes its connections while a peer is
    still in a collective), and a peer that never comes bounds that wait: rank 0 leaves with a warning."""
    import json
    import time

    import torch.multiprocessing as mp

    from tests.tp_utils import _teardown_rank

    ctx = mp.spawn(_teardown_rank, args=(f"file://{tmp_path}/init", str(tmp_path), peer_leaves), nprocs=2,
                   join=False)
    result = tmp_path / "rank0.json"
    deadline = time.monotonic() + 60  # (the teardown waits 5 s at most: far less than this, unless it hangs)
    try:
        while not ctx.join(1) and time.monotonic() < deadline:
            pass
    except mp.ProcessExitedException:
        pass  # (a rank whose group went away under it may exit non-zero: the outcome file says what happened)
    if any(p.is_alive() for p in ctx.processes):
        for p in ctx.processes:
            p.kill()
        pytest.fail("the ranks still run after 60 s: the teardown hangs")
    outcome = json.loads(result.read_text())
    assert outcome["initialized"] is False
    if peer_leaves:
        assert not outcome["peer_arrived"] and any("not every rank reached it" in w for w in outcome["warnings"])
    else:
        assert outcome["peer_arrived"] and outcome["warnings"] == []


def test_gathered_logit_blocks_land_in_their_vocabulary_columns():
    """The NCCL path of the LM head's all-gather (gloo has no all_gather_into_tensor): rank-major rows
    become column blocks, as torch.cat(dim=-1) of the ranks' logits."""
    parts = [torch.randn(3, 5) for _ in range(4)]
    torch.testing.assert_close(ps.rank_major_to_columns(torch.cat(parts), 4), torch.cat(parts, dim=-1),
                               rtol=0, atol=0)

"""The fused MoE Triton path (align + grouped GEMMs + combine) against the torch path; the router.

Without CUDA the kernels run in Triton's CPU interpreter (tests/triton_mode.py), so shapes stay small."""

from __future__ import annotations

import pytest
import torch

from model_executor.layers.moe.fused_moe import fused_experts_torch
from model_executor.layers.moe.layer import select_experts
from tests import triton_mode
from tests.triton_mode import DEVICE, in_process

if not triton_mode.RERUN_IN_SUBPROCESS:
    from model_executor.layers.moe import kernels

test_in_subprocess = triton_mode.subprocess_test(__file__)

SMALL = {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 32, "GROUP_M": 2, "num_warps": 4, "num_stages": 1}


def make_moe(num_tokens, num_experts, hidden, inter, top_k, dtype, seed, skew=False):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=gen).to(DEVICE, dtype)
    w13 = (torch.randn(num_experts, 2 * inter, hidden, generator=gen) / hidden**0.5).to(DEVICE, dtype)
    w2 = (torch.randn(num_experts, hidden, inter, generator=gen) / inter**0.5).to(DEVICE, dtype)
    logits = torch.randn(num_tokens, num_experts, generator=gen)
    if skew:  # most tokens pick expert 0: one expert with many blocks, others empty
        logits[:, 0] += 5.0
    weights, ids = select_experts(logits.to(DEVICE), top_k, renormalize=False)  # fused_experts renormalises
    return x, w13, w2, weights, ids


def check_align(ids, block_m, num_experts, sorted_ids, expert_ids, total):
    flat = ids.flatten().cpu()
    numel = flat.numel()
    sorted_ids, expert_ids, total = sorted_ids.cpu(), expert_ids.cpu(), int(total.item())
    counts = torch.bincount(flat, minlength=num_experts)
    assert total == int(((counts + block_m - 1) // block_m * block_m).sum())
    assert sorted_ids.numel() == min(numel + num_experts * (block_m - 1), numel * block_m)
    real = sorted_ids[:total]
    assert (sorted_ids[total:] == numel).all()
    assert sorted(real[real < numel].tolist()) == list(range(numel))  # every assignment exactly once
    for b in range(total // block_m):
        block = real[b * block_m : (b + 1) * block_m]
        picked = block[block < numel].long()
        assert (flat[picked] == expert_ids[b]).all()  # a block holds its expert's assignments only
        assert torch.equal(picked, picked.sort().values)  # in token order


@in_process
@pytest.mark.parametrize("num_tokens,top_k,num_experts", [(1, 2, 4), (5, 3, 8), (40, 2, 8), (33, 4, 16)])
@pytest.mark.parametrize("block_m", [16, 32])
def test_align_one_program_and_torch_agree(num_tokens, top_k, num_experts, block_m):
    _, _, _, _, ids = make_moe(num_tokens, num_experts, 8, 8, top_k, torch.float32, seed=num_tokens)
    one = kernels.moe_align_block_size(ids, block_m, num_experts)
    check_align(ids, block_m, num_experts, *one)
    numel = ids.numel()
    max_padded = kernels.max_padded_slots(numel, num_experts, block_m)
    big = kernels._align_torch(ids.flatten(), block_m, num_experts, max_padded, -(-max_padded // block_m))
    check_align(ids, block_m, num_experts, *big)
    total = int(one[2].item())
    assert torch.equal(one[0][:total].cpu(), big[0][:total].cpu())
    assert torch.equal(one[1][: total // block_m].cpu(), big[1][: total // block_m].cpu())


F32, BF16 = torch.float32, torch.bfloat16


@in_process
@pytest.mark.parametrize("num_tokens,dtype,renormalize,round_weights", [
    (1, F32, False, False), (3, BF16, True, True), (17, F32, True, False), (17, BF16, True, True),
    (64, BF16, False, False), (64, F32, True, True)])
def test_fused_experts_matches_torch(num_tokens, dtype, renormalize, round_weights):
    x, w13, w2, weights, ids = make_moe(num_tokens, 8, 64, 48, 3, dtype, seed=num_tokens)
    ref = fused_experts_torch(x, w13, w2, weights, ids, renormalize, round_weights)
    out = kernels.fused_experts_triton(x, w13, w2, weights, ids, renormalize, round_weights, config=SMALL)
    tol = {"rtol": 1e-4, "atol": 1e-4} if dtype == torch.float32 else {"rtol": 4e-2, "atol": 4e-2}  # bf16: a few ulps apart
    torch.testing.assert_close(out, ref, **tol)


@in_process
def test_weights_rounded_in_the_gemm():
    """round_weights: the routing weights rounded after the renormalisation; here to float16 with float32
    activations, so the rounding stands far above the noise (and Triton's interpreter rounds float32 to
    bfloat16 toward zero, where the GPU and torch round to nearest: float16 it rounds to nearest)."""
    from model_executor.layers.moe.fused_moe import routing_weights

    x, w13, w2, weights, ids = make_moe(9, 8, 32, 32, 3, torch.float32, seed=11)
    rounded = routing_weights(weights, True, True, torch.float16).float()
    ref = fused_experts_torch(x, w13, w2, rounded, ids)
    out = kernels.fused_experts_triton(x, w13, w2, weights, ids, True, True, config=SMALL,
                                       weight_dtype=torch.float16)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@in_process
def test_fused_experts_skewed_routing_and_model_dtype_weights():
    """One expert takes nearly every token (many blocks; others empty); weights renormalised and rounded."""
    x, w13, w2, weights, ids = make_moe(48, 6, 32, 40, 3, torch.float32, seed=3, skew=True)
    assert (ids == 0).sum() > 40
    ref = fused_experts_torch(x, w13, w2, weights, ids, renormalize=True, round_weights=True)
    out = kernels.fused_experts_triton(x, w13, w2, weights, ids, True, True, config=dict(SMALL, BLOCK_M=32))
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)


@in_process
@pytest.mark.parametrize("align", ["one_program", "torch"])
def test_out_of_range_expert_id_goes_to_the_last_expert(align, monkeypatch):
    """An id past the experts (what a router gave a NaN row: a garbage padded row in a whole extend graph) is
    aligned as expert E - 1, as the small-batch kernels clamp it. Unclamped, the one-program align counted it
    in no group yet scattered it over expert 0's first slots, so another token's assignment was never
    computed and its output read whatever memory held (graph and eager then differed)."""
    if align == "torch":
        monkeypatch.setattr(kernels, "ALIGN_ONE_PROGRAM_MAX", 0)
    x, w13, w2, weights, ids = make_moe(12, 8, 32, 24, 3, torch.float32, seed=5)
    assert (ids == 0).any()  # expert 0 has real assignments the stray id could overwrite
    ids[4] = torch.tensor([8, 9, 8], dtype=ids.dtype)
    out = kernels.fused_experts_triton(x, w13, w2, weights, ids, True, False, config=SMALL)
    ids[4] = 7
    torch.testing.assert_close(out, kernels.fused_experts_triton(x, w13, w2, weights, ids, True, False, config=SMALL),
                               rtol=0, atol=0)


def test_select_experts_topk_and_renormalise():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0], [0.0, 0.0, 0.0, 5.0]])
    weights, ids = select_experts(logits, 2, renormalize=False)
    probs = torch.softmax(logits, -1)
    assert ids.tolist() == [[1, 2], [3, 0]] or ids[1, 0] == 3
    torch.testing.assert_close(weights, probs.gather(1, ids))
    weights, _ = select_experts(logits, 2, renormalize=True)
    torch.testing.assert_close(weights.sum(-1), torch.ones(2))


def test_moe_block_traces_as_one_graph():
    """The experts are one opaque op to dynamo (the piecewise runner traces the backbone fullgraph)."""
    from model_executor.layers.moe.layer import SparseMoeBlock

    block = SparseMoeBlock(4, 2, 16, 24, renormalize=True)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.2, generator=torch.Generator().manual_seed(0))
    x = torch.randn(5, 16)
    torch._dynamo.reset()
    compiled = torch.compile(block, backend="eager", fullgraph=True, dynamic=True)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), block(x))
    torch._dynamo.reset()


def test_bench_floor_counts_the_experts_a_step_reads():
    from benchmarks.bench_one_batch import step_read_bytes, weight_bytes
    from model_executor.model_config import ModelConfig
    from model_executor.weight_loader import build_model

    cfg = ModelConfig.from_dict({
        "architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 64, "hidden_size": 32, "intermediate_size": 48,
        "moe_intermediate_size": 16, "num_hidden_layers": 3, "num_attention_heads": 2, "num_key_value_heads": 1,
        "head_dim": 16, "num_experts": 8, "num_experts_per_tok": 2, "mlp_only_layers": [1]})
    model = build_model(cfg, torch.float32, "cpu")
    per_expert = (2 * 16 * 32 + 32 * 16) * 4
    all_bytes = weight_bytes(model)
    embedding_unread = (64 - 1) * 32 * 4  # (untied: the step's token's row of the table, not the other 63)
    assert step_read_bytes(model, 1) == all_bytes - 2 * (8 - 2) * per_expert - embedding_unread  # 2 of 8 read
    assert step_read_bytes(model, 1000) == all_bytes  # every expert, every row


@in_process
@pytest.mark.skipif(triton_mode.HAS_CUDA, reason="the CPU model's tensors need the interpreter "
                                                 "(tests/models/test_new_models_gpu.py runs the model on CUDA)")
def test_model_on_the_triton_path_matches_hf(tmp_path, monkeypatch):
    """A tiny Qwen3-MoE whose experts run the Triton kernels (interpreter on CPU) still matches HF: the
    prefill on the grouped path, the decode steps on the path fused_experts_triton picks (small-batch)."""
    from model_executor.layers.moe import fused_moe
    from runners.model_runner import ModelRunner, RunnerConfig
    from tests.conftest import save_tiny_hf_model
    from tests.models.test_model_vs_hf import run_prefill_and_decode
    from tests.models.test_new_models_vs_hf import TINY_QWEN3_MOE

    calls = []

    def triton_path(x, w13, w2, weights, ids, renormalize, round_weights, w13_scale, w2_scale, block_n, block_k,
                    *gpt_oss_args):
        assert w13_scale is None and not block_n and gpt_oss_args == (None,) * 4
        calls.append(x.shape[0])
        if x.shape[0] < 8:
            assert kernels.select_path(8, 2 * w2.shape[2], x.shape[1], x.shape[0], "cpu")[0] == "small_batch"
            return kernels.fused_experts_triton(x, w13, w2, weights, ids, renormalize, round_weights)
        return kernels.fused_experts_triton(x, w13, w2, weights, ids, renormalize, round_weights,
                                            config=dict(SMALL, BLOCK_N=64, BLOCK_K=64))

    monkeypatch.setattr(fused_moe, "_fused_experts_impl", triton_path)
    hf_model = save_tiny_hf_model(tmp_path, TINY_QWEN3_MOE, seed=4)
    runner = ModelRunner(RunnerConfig(model_path=str(tmp_path), max_running_requests=2, max_total_tokens=128,
                                      context_length=64))
    errors = run_prefill_and_decode(runner, hf_model, [[5, 9, 200, 31, 7, 64, 12], [40]], decode_steps=1)
    assert max(errors) < 1e-4, errors
    assert calls[0] == 8 and 2 in calls  # the prefill's 8 tokens went through the kernels, and a decode step


def test_tuned_table_lookup(tmp_path, monkeypatch):
    import json

    from model_executor.layers.moe import tuning

    small = {k: 1 for k in tuning.KEYS}
    large = {k: 2 for k in tuning.KEYS}
    (tmp_path / "E=8,N=96,K=64,device=cpu.json").write_text(json.dumps({"1": small, "64": large}))
    monkeypatch.setattr(tuning, "CONFIG_DIR", tmp_path)
    tuning.load_table.cache_clear()
    try:
        assert tuning.get_config(8, 96, 64, 1, "cpu") == small
        assert tuning.get_config(8, 96, 64, 2, "cpu") == large  # rounded up, as a graph pads: not the nearer 1
        assert tuning.get_config(8, 96, 64, 64, "cpu") == large
        assert tuning.get_config(8, 96, 64, 500, "cpu") == large  # past the table: its largest entry
        assert tuning.get_config(8, 96, 128, 40, "cpu") == tuning.default_config(40)  # no table for this shape
    finally:
        tuning.load_table.cache_clear()


def test_tuned_fp8_table_and_fallback(tmp_path, monkeypatch, caplog):
    """FP8 experts read their own table (`,dtype=fp8_w8`), else the shape's bf16 table; with neither, the
    default configs, said once per shape on a GPU. The names are the tuner's (tuning.table_path)."""
    import json

    from model_executor.layers.moe import tuning

    bf16 = {k: 1 for k in tuning.KEYS}
    fp8 = {k: 3 for k in tuning.KEYS}
    name = tuning.table_path(8, 96, 64, "NVIDIA_H200", "fp8_w8").name
    assert name == "E=8,N=96,K=64,device=NVIDIA_H200,dtype=fp8_w8.json"
    (tmp_path / tuning.table_path(8, 96, 64, "cpu").name).write_text(json.dumps({"1": bf16}))
    monkeypatch.setattr(tuning, "CONFIG_DIR", tmp_path)
    tuning.load_table.cache_clear()
    tuning._no_table.cache_clear()
    try:
        assert tuning.get_config(8, 96, 64, 1, "cpu", "fp8_w8") == bf16  # no FP8 table: the bf16 one
        (tmp_path / tuning.table_path(8, 96, 64, "cpu", "fp8_w8").name).write_text(json.dumps({"1": fp8}))
        tuning.load_table.cache_clear()
        assert tuning.get_config(8, 96, 64, 1, "cpu", "fp8_w8") == fp8
        assert tuning.get_config(8, 96, 64, 1, "cpu") == bf16
        monkeypatch.setattr(tuning, "device_name", lambda device: "NVIDIA_H200")
        with caplog.at_level("WARNING", logger="duet.moe"):
            assert tuning.get_config(8, 96, 64, 1, "cuda") == tuning.default_config(1)
            tuning.get_config(8, 96, 64, 2, "cuda")
        said = [r.getMessage() for r in caplog.records if r.name == "duet.moe"]
        assert len(said) == 1 and "E=8,N=96,K=64,device=NVIDIA_H200.json" in said[0]
    finally:
        tuning.load_table.cache_clear()
        tuning._no_table.cache_clear()


def _tiny_moe_for_the_tuner(tuner, monkeypatch) -> None:
    """The tuner on the CPU: a one-layer tiny Qwen3-MoE for any --model, "CUDA" available."""
    from model_executor.model_config import ModelConfig

    tiny = ModelConfig.from_dict({
        "architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 64, "hidden_size": 32, "intermediate_size": 48,
        "moe_intermediate_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
        "head_dim": 16, "num_experts": 8, "num_experts_per_tok": 2, "norm_topk_prob": True})
    monkeypatch.setattr(tuner, "DEVICE", "cpu")
    monkeypatch.setattr(tuner.ModelConfig, "from_pretrained", staticmethod(lambda path: tiny))
    monkeypatch.setattr(tuner.torch.cuda, "is_available", lambda: True)


def test_tuner_writes_the_tables_tuning_reads(tmp_path, monkeypatch):
    """tune_fused_moe's tables land in --out under the names moe/tuning.py looks up (bf16 and FP8), each token
    count mapped to its fastest config (the default when nothing beats it). Timing is stubbed: no GPU here."""
    import json

    from benchmarks.tuning import tune_fused_moe as tuner
    from model_executor.layers.moe import tuning

    _tiny_moe_for_the_tuner(tuner, monkeypatch)
    seen = []

    def fake_time(x, layers, weights, ids, config, flags, path="grouped"):
        seen.append((layers[0].w13.dtype, layers[0].w13_scale is not None, flags, path, x.shape[0]))
        if path == "small_batch":  # fastest with the narrowest tiles; faster than grouped at 1 token only
            return (4.0 if x.shape[0] == 1 else 40.0) - (config["BLOCK_N"] == 8) - (config["DOWN_BLOCK_N"] == 4)
        return 10.0 if config == tuning.default_config(x.shape[0]) else 5.0 + config["BLOCK_N"] / config["BLOCK_K"]

    monkeypatch.setattr(tuner, "time_config", fake_time)
    assert tuner.main(["--model", "qwen3-30b-a3b", "--dtype", "bf16", "fp8", "--quick", "--batch-size", "1", "2",
                       "64", "--out", str(tmp_path / "out"), "--json", str(tmp_path / "tune.json")]) == 0
    # --install: the same tables from the --json file (what comes back from the GPU host)
    assert tuner.main(["--install", str(tmp_path / "tune.json"), "--out", str(tmp_path / "installed")]) == 0
    for folder in ("out", "installed"):
        for dtype in (None, "fp8_w8"):
            table = json.loads((tmp_path / folder / tuning.table_path(8, 32, 32, "cpu", dtype).name).read_text())
            assert list(table) == ["1", "2", "64"]
            assert table["1"]["BLOCK_N"] == 32 and table["1"]["BLOCK_K"] == 256  # the stub's fastest
            # the small-batch path: its fastest tiles (each kernel's), and the faster path per token count
            assert table["1"]["path"] == "small_batch" and table["2"]["path"] == "grouped"
            assert table["1"]["small_batch"]["BLOCK_N"] == 8 and table["1"]["small_batch"]["DOWN_BLOCK_N"] == 4
            assert "path" not in table["64"]  # past SMALL_BATCH_MAX_TOKENS: not timed
    assert {s[:2] for s in seen} == {(torch.bfloat16, False), (torch.float8_e4m3fn, True)}
    assert {s[2] for s in seen} == {(False, True)}  # the router renormalises; Qwen3-MoE rounds in the GEMM
    assert {s[4] for s in seen if s[3] == "small_batch"} == {1, 2}


def test_compare_paths_times_both_paths_per_token_count(tmp_path, monkeypatch):
    """--compare-paths: one MoE layer per path at each --batch-size with the configs the tables give, into
    --json. Timing is stubbed (no GPU here): the stub runs the layer once, with the experts' kernels
    replaced by a recorder of the path and config they were given."""
    import json

    from benchmarks import bench_one_batch
    from benchmarks.tuning import tune_fused_moe as tuner
    from model_executor.layers.moe import tuning

    _tiny_moe_for_the_tuner(tuner, monkeypatch)
    monkeypatch.setattr(bench_one_batch, "measure_copy_bandwidth", lambda device: 1e12)
    paths = []

    def fake_experts(x, w13, w2, weights, ids, renormalize, round_weights, config, w13_scale, w2_scale, path):
        assert ids.shape == (x.shape[0], 2) and round_weights  # routed by the layer's gate; Qwen3 rounds
        assert config == (tuning.default_small_config(x.shape[0]) if path == "small_batch"
                          else tuning.default_config(x.shape[0]))
        paths.append(path)

    def fake_graph(call, layers):
        assert len(layers) == tuner.LAYERS and all(layer.gate.shape == (8, 32) for layer in layers)
        call(layers[0])
        return 2.0 if paths[-1] == "small_batch" else 6.0

    monkeypatch.setattr(tuner.kernels, "fused_experts_triton", fake_experts)
    monkeypatch.setattr(tuner, "time_graph", fake_graph)
    out = tmp_path / "paths.json"
    assert tuner.main(["--compare-paths", "--batch-size", "1", "3", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["compare_paths"]["qwen3-30b-a3b/bf16"]["rows"]
    assert list(rows) == ["1", "3"] and paths == ["grouped", "small_batch"] * 2
    assert rows["3"]["grouped_us"] == 6.0 and rows["3"]["small_batch_us"] == 2.0
    assert rows["3"]["configs"]["small_batch"] == tuning.default_small_config(3)
    assert rows["1"]["expert_bytes"] == 2 * 3 * 16 * 32 * 2  # one token: its 2 experts' bf16 bytes
    assert rows["1"]["floor_us"] == round(rows["1"]["expert_bytes"] / 1e12 * 1e6, 4)

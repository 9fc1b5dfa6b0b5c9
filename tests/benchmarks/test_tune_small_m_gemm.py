"""The small-M GEMM tuner's CPU-side parts: the linear shapes it tunes, its table decisions, its refusal."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest

from benchmarks.tuning import tune_small_m_gemm as tune
from model_executor.configs import shape_path
from model_executor.model_config import ModelConfig


@pytest.mark.parametrize("tp,expected", [
    (1, {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}),
    (2, {"qkv": (3072, 4096), "o": (4096, 2048), "gate_up": (14336, 4096), "down": (4096, 7168)}),
])
def test_linear_shapes_are_one_ranks_gemms(tp, expected):
    assert tune.linear_shapes(ModelConfig.from_pretrained(shape_path("llama-3.1-8b")), tp) == expected


GEMV = SimpleNamespace(GEMV=True, SPLIT_K=1, X_FP8=False, BLOCK_N=8, FUSE=True)  # fusable: a single-split GEMV
SPLIT_DOT = SimpleNamespace(GEMV=False, SPLIT_K=2, X_FP8=False, BLOCK_N=32, FUSE=True)


def test_fusable_configs_run_one_split_weight_only_and_paired():
    assert tune.fusable(GEMV) and not tune.fusable(SPLIT_DOT)
    dot = SimpleNamespace(GEMV=False, SPLIT_K=1, X_FP8=False, BLOCK_N=32, FUSE=True)
    assert tune.fusable(dot)  # 16 gate (or first-half) rows and 16 paired ones a program
    assert tune.fusable(SimpleNamespace(**{**vars(dot), "FUSE": None}))  # (not yet timed: both forms will be)
    assert not tune.fusable(SimpleNamespace(**{**vars(dot), "FUSE": False}))  # the tuner measured it faster plain
    assert not tune.fusable(SimpleNamespace(**{**vars(dot), "BLOCK_N": 16}))  # 8 a block: below tl.dot's 16
    assert not tune.fusable(SimpleNamespace(**{**vars(dot), "X_FP8": True}))  # the W8A8 path's
    # o and down pair nothing: a 16-row dot tile and a one-column GEMV fuse their add + RMSNorm epilogue
    narrow = SimpleNamespace(**{**vars(dot), "BLOCK_N": 16})
    assert tune.fusable(narrow, paired=False) and not tune.fusable(narrow, paired=True)
    assert tune.fusable(SimpleNamespace(**{**vars(GEMV), "BLOCK_N": 1}), paired=False)
    assert not tune.fusable(SimpleNamespace(**{**vars(SPLIT_DOT), "BLOCK_N": 16}), paired=False)
    assert not tune.fusable(SimpleNamespace(**{**vars(narrow), "FUSE": False}), paired=False)
    assert not tune.Fusion("o").paired and not tune.Fusion("down").paired
    assert tune.Fusion("qkv", (32, 8, 128)).paired and tune.Fusion("gate_up").paired


def test_table_entry_keeps_the_other_path_only_where_it_measured_faster():
    best = GEMV
    # within the margin: cuBLAS stays
    assert tune.table_entry("bf16", {"best": best, "best_us": 9.9, "base_us": 10.0}) == "cublas"
    assert tune.table_entry("bf16", {"best": best, "best_us": 9.0, "base_us": 10.0}) is best
    assert tune.table_entry("fp8", {"best": best, "best_us": 10.1, "base_us": 10.0}) is best  # within margin
    assert tune.table_entry("fp8_block", {"best": best, "best_us": 11.0, "base_us": 10.0}) == "w8a8"


def test_fused_shapes_are_the_norm_fed_layers_of_each_tp_with_their_heads():
    cfg = ModelConfig.from_pretrained(shape_path("llama-3.1-8b"))
    # o and down only at tp 1: at tp 2 their all-reduce comes before the residual add; so the LM head takes the
    # final norm from the last down only at tp 1
    assert tune.fused_shapes([cfg], [1, 2]) == {
        (6144, 4096): tune.Fusion("qkv", (32, 8, 128)), (28672, 4096): tune.Fusion("gate_up"),
        (4096, 4096): tune.Fusion("o"), (4096, 14336): tune.Fusion("down"), (128256, 4096): tune.Fusion("head"),
        (3072, 4096): tune.Fusion("qkv", (16, 4, 128)), (14336, 4096): tune.Fusion("gate_up")}
    assert not tune.Fusion("head").paired and tune.Fusion("head").needs_pairs
    assert tune.Fusion("gate_up").needs_pairs and not tune.Fusion("down").needs_pairs


def test_a_fused_layers_other_configs_pay_for_the_kernels_its_fusion_saves():
    gemv_2 = SimpleNamespace(GEMV=True, SPLIT_K=2, X_FP8=False, BLOCK_N=8, FUSE=True)  # a GEMV, but split
    results = [(18.2, GEMV), (17.6, SPLIT_DOT), (17.0, gemv_2)]
    assert tune.best_of(results) == (17.0, gemv_2)  # a layer that fuses nothing
    assert tune.best_of(results, neighbour_us=1.0) == (18.0, gemv_2)  # 17.0 + 1.0 < 18.2
    assert tune.best_of(results, neighbour_us=1.5) == (18.2, GEMV)  # the fused GEMV saves more than it loses
    assert tune.best_of([(17.7, SPLIT_DOT)], neighbour_us=4.0) == (21.7, SPLIT_DOT)  # nothing fusable measured
    narrow_dot = SimpleNamespace(GEMV=False, SPLIT_K=1, X_FP8=False, BLOCK_N=16, FUSE=True)
    assert tune.best_of([(17.0, narrow_dot), (16.5, SPLIT_DOT)], 1.0) == (17.5, SPLIT_DOT)  # paired: 16 rows don't pair
    assert tune.best_of([(17.0, narrow_dot), (16.5, SPLIT_DOT)], 1.0, paired=False) == (17.0, narrow_dot)


def test_refuses_without_cuda(monkeypatch, capsys):
    monkeypatch.setattr(tune.torch.cuda, "is_available", lambda: False)
    assert tune.main(["--quick"]) == 2
    assert "needs a CUDA device" in capsys.readouterr().err


def test_model_summary_counts_every_layer():
    cfg = ModelConfig.from_pretrained(shape_path("llama-3.2-1b"))
    shapes = tune.linear_shapes(cfg, 1).values()
    results = {("bf16", n, k, 1): {"base_us": 10.0, "best_us": 5.0, "best": object()} for n, k in shapes}
    (line,) = tune.model_summary(["llama-3.2-1b"], [1], ["bf16"], [1], results)
    today = 4 * 10.0 * cfg.num_hidden_layers / 1e3
    assert f"today {today:.3f} ms" in line and f"table {today / 2:.3f} ms" in line
    assert math.isclose(today, 0.64)
    assert tune.lm_head_shape(cfg, 2) == (64128, 2048)
    results[("bf16", 128256, 2048, 1)] = {"base_us": 100.0, "best_us": 200.0, "best": object()}  # cuBLAS wins
    (line,) = tune.model_summary(["llama-3.2-1b"], [1], ["bf16"], [1], results)
    assert "+ head" in line and f"today {today + 0.1:.3f} ms" in line
    assert f"table {today / 2 + 0.1:.3f} ms" in line


def test_moe_model_tunes_attention_and_router_not_a_dense_mlp_it_does_not_have():
    cfg = ModelConfig.from_pretrained(shape_path("qwen3-30b-a3b"))
    assert tune.linear_shapes(cfg, 1) == {"qkv": (5120, 2048), "o": (2048, 4096)}
    assert tune.router_shape(cfg) == (128, 2048)
    assert tune.router_shape(ModelConfig.from_pretrained(shape_path("llama-3.1-8b"))) is None
    shapes = [*tune.linear_shapes(cfg, 1).values(), tune.router_shape(cfg)]
    results = {("bf16", n, k, 1): {"base_us": 10.0, "best_us": 5.0, "best": object()} for n, k in shapes}
    (line,) = tune.model_summary(["qwen3-30b-a3b"], [1], ["bf16"], [1], results)
    today = 3 * 10.0 * cfg.num_hidden_layers / 1e3  # qkv, o and the router in each of the 48 layers
    assert f"today {today:.3f} ms" in line


def test_merge_keeps_other_shapes_and_replaces_retuned_ones():
    kept = {"_meta": {"quick": True}, "bf16": {"1,2": {"1": "cublas"}, "3,4": {"1": "cublas", "16": "cublas"}},
            "fp8": {"5,6": {"1": "w8a8"}}}
    tuned = {"bf16": {"3,4": {"1": {"BLOCK_N": 8}}, "7,8": {"1": "cublas"}}}
    assert tune.merge_tables(kept, tuned) == {  # (a run that tuned M=1 only keeps the shape's other buckets)
        "bf16": {"1,2": {"1": "cublas"}, "3,4": {"1": {"BLOCK_N": 8}, "16": "cublas"}, "7,8": {"1": "cublas"}},
        "fp8": {"5,6": {"1": "w8a8"}}}
    assert kept["bf16"]["3,4"] == {"1": "cublas", "16": "cublas"}  # the input is not modified


def test_a_merge_into_a_new_file_starts_from_the_servers_table(tmp_path):
    out, server = tmp_path / "tuned.json", tmp_path / "server.json"
    assert tune.merge_base(out, server) is None  # neither exists: the run's entries alone
    server.write_text("{}")
    assert tune.merge_base(out, server) == server  # a new --out: the server's table, so the copy is whole
    out.write_text("{}")
    assert tune.merge_base(out, server) == out  # an existing --out keeps its own entries


def test_only_shapes_keeps_the_named_linears_and_refuses_others():
    shapes, heads = [(6144, 4096), (4096, 4096), (24576, 4096)], [(151936, 4096)]
    assert tune.only_shapes(["24576,4096", "151936,4096"], shapes, heads) == ([(24576, 4096)], [(151936, 4096)])
    with pytest.raises(ValueError, match=r"\(5, 6\)"):
        tune.only_shapes(["5,6", "6144,4096"], shapes, heads)
    with pytest.raises(ValueError, match="N,K pairs"):
        tune.only_shapes(["6144x4096"], shapes, heads)


def test_xfp8_joint_grid_pairs_every_tile_with_every_split_that_fits():
    grid = tune.xfp8_joint_grid(4096)
    assert len(grid) == len(set(grid)) == len(tune.XFP8_JOINT_TILES) * len(tune.XFP8_SPLITS)
    assert all(c.X_FP8 and not c.GEMV for c in grid)
    tiles = {(c.BLOCK_N, c.BLOCK_K, c.num_warps, c.num_stages) for c in grid}
    assert tiles == set(tune.XFP8_JOINT_TILES)
    # the shipped H200 table's picks are in it (Llama-3.1-8B: o_proj, down, gate/up at 64 rows)
    for bn, bk, split, warps, stages in [(64, 256, 2, 4, 4), (64, 128, 1, 4, 3), (128, 128, 4, 8, 4)]:
        assert tune.xfp8_config(bn, bk, split, warps, stages) in grid
    # a short K keeps only the splits with a whole K step each; block scales only steps within a scale block
    assert all(512 // c.SPLIT_K >= c.BLOCK_K for c in tune.xfp8_joint_grid(512))
    assert {c.BLOCK_K for c in tune.xfp8_joint_grid(4096, "fp8_block")} == {128}


@pytest.mark.parametrize("m,quick", [(64, False), (8, False), (8, True)])
def test_x_fp8_is_searched_over_the_joint_grid(monkeypatch, m, quick):
    """tune_one with the timing faked (the search logic on the CPU): every joint-grid config is timed and the
    fastest of them wins, with no split or warps pass after it; with --quick the greedy tiles instead."""
    from types import SimpleNamespace

    import torch

    from model_executor.layers.quantization import fp8_ops
    from model_executor.layers.triton_ops import small_m_gemm as sm

    monkeypatch.setattr(tune, "DEVICE", "cpu")
    monkeypatch.setattr(tune, "ROTATE_BYTES", 1)
    monkeypatch.setattr(tune.torch.cuda, "get_device_properties", lambda i: SimpleNamespace(multi_processor_count=132))
    monkeypatch.setattr(fp8_ops, "per_token_group_quant_fp8", lambda x, g: (x, x[:, :1]))
    called = []
    monkeypatch.setattr(sm, "small_m_linear_fp8_act", lambda *a, config, block: called.append(config))
    monkeypatch.setattr(tune, "kernel_calls", lambda sm_, x, wts, cfg: [lambda: called.append(cfg)])
    monkeypatch.setattr(tune, "baseline_calls", lambda kind, x, wts: [lambda: called.append("base")])
    fastest = tune.xfp8_config(256, 128, 4, 8, 2)  # only in the joint grid

    def fake_time(calls):
        calls[0]()
        cfg = called[-1]
        return 100.0 if cfg == "base" else 1.0 if cfg == fastest else 50.0 if cfg.X_FP8 else 60.0

    monkeypatch.setattr(tune, "time_calls", fake_time)
    n, k = 512, 4096
    result = tune.tune_one(sm, "fp8", n, k, m, tune.Weights("fp8", n, k, torch.Generator()), torch.Generator(),
                           quick=quick, log=[])
    x_fp8 = [c for c in called if c != "base" and c.X_FP8]
    if not quick:
        assert result["best"] == fastest and result["best_us"] == 1.0
        assert x_fp8 == tune.xfp8_joint_grid(k)  # each once, nothing after (no split or warps pass)
    else:
        assert fastest not in x_fp8 and result["best"].X_FP8 and result["best_us"] == 50.0
        assert {c.BLOCK_N for c in x_fp8} <= {16, 32, 64, 128}  # tile_grid's tiles at 4 warps
        assert all(c.num_warps == 4 for c in x_fp8)  # (no warps pass with --quick)


@pytest.fixture
def faked_tuner(monkeypatch):
    """tune_one's calls faked on the CPU: each records what it stands for in the returned list (a config; a fused
    one as ("fused", config); "neighbours"; "base"), for a fake time_calls to price."""
    monkeypatch.setattr(tune, "DEVICE", "cpu")
    monkeypatch.setattr(tune, "ROTATE_BYTES", 1)
    monkeypatch.setattr(tune.torch.cuda, "get_device_properties", lambda i: SimpleNamespace(multi_processor_count=132))
    called = []
    monkeypatch.setattr(tune, "kernel_calls", lambda sm_, x, wts, cfg: [lambda: called.append(cfg)])
    monkeypatch.setattr(tune, "fused_calls", lambda sm_, fusion, x, wts, cfg: [lambda: called.append(("fused", cfg))])
    monkeypatch.setattr(tune, "neighbour_calls", lambda fusion, x, n: [lambda: called.append("neighbours")])
    monkeypatch.setattr(tune, "baseline_calls", lambda kind, x, wts: [lambda: called.append("base")])
    return called


def tune_fake(kind: str, n: int, k: int, m: int, fusion):
    import torch

    from model_executor.layers.triton_ops import small_m_gemm as sm

    return tune.tune_one(sm, kind, n, k, m, tune.Weights(kind, n, k, torch.Generator()), torch.Generator(),
                         quick=False, log=[], fusion=fusion)


def priced(called: list, fused_us, plain_us, neighbour_us: float, base_us: float = 30.0):
    """A fake time_calls for faked_tuner: the last recorded call's price (cuBLAS base_us, the neighbours'
    kernels neighbour_us, a fused config fused_us(cfg), any other plain_us(cfg))."""
    def fake_time(calls):
        calls[0]()
        cfg = called[-1]
        if cfg in ("base", "neighbours"):
            return base_us if cfg == "base" else neighbour_us
        return fused_us(cfg[1]) if isinstance(cfg, tuple) else plain_us(cfg)
    return fake_time


@pytest.mark.parametrize("neighbour_us,plain_gemv_us", [(None, 18.5), (0.5, 18.5), (3.0, 18.5), (3.0, 14.0)])
def test_tune_one_times_a_fused_layers_configs_fused_and_plain_with_its_neighbours(faked_tuner, monkeypatch,
                                                                                   neighbour_us, plain_gemv_us):
    """tune_one with the timing faked, bf16 at two rows: tl.dot tiles take 17 us plain and 25 fused, single-split
    GEMVs 18 us fused (8 warps; 18.5 at 4) and plain_gemv_us plain, cuBLAS 30. A layer that fuses nothing
    (neighbour_us None) gets a dot; a fused layer whose neighbours' kernels take 0.5 us a plain dot (17.5: a
    single-split one with FUSE off); at 3 us the fastest fused GEMV (its warps / stages pass run fused), unless
    the plain GEMV with the neighbours is faster (14 + 3): then that GEMV with FUSE off. The baseline pays the
    neighbours too."""
    called = faked_tuner
    def fake_time(calls):
        calls[0]()
        cfg = called[-1]
        if cfg in ("base", "neighbours"):
            return 30.0 if cfg == "base" else neighbour_us
        if isinstance(cfg, tuple):  # fused (only a fused layer's fusable configs)
            assert neighbour_us is not None and tune.fusable(cfg[1])
            return (18.0 if cfg[1].num_warps == 8 else 18.5) if cfg[1].GEMV else 25.0
        return plain_gemv_us if cfg.GEMV and cfg.SPLIT_K == 1 else 17.0

    monkeypatch.setattr(tune, "time_calls", fake_time)
    fusion = None if neighbour_us is None else tune.Fusion("qkv", (32, 8, 128))
    result = tune_fake("bf16", 6144, 4096, 2, fusion)
    best = result["best"]
    fused = [c[1] for c in called if isinstance(c, tuple)]
    # a fused layer times every weight-only tile at one split too, fused and plain (the paired 128-wide tile too)
    assert (neighbour_us is None) == (not fused)
    if fused:
        assert {(c.BLOCK_N, c.BLOCK_K) for c in fused if not c.GEMV} >= {(32, 128), (64, 256), (128, 128)}
        assert all(c.SPLIT_K == 1 and c.FUSE is not False for c in fused)
        # and each single-split dot's halves as one dot too (qkv pairs its rows); a GEMV has no dot to join
        assert {(c.BLOCK_N, c.BLOCK_K) for c in fused if c.PAIR_DOT} == {(c.BLOCK_N, c.BLOCK_K) for c in fused
                                                                            if not c.GEMV}
        assert not any(c.PAIR_DOT for c in fused if c.GEMV)
    if neighbour_us == 3.0:
        assert best.GEMV and best.SPLIT_K == 1 and result["base_us"] == 33.0
        if plain_gemv_us == 14.0:
            assert not best.FUSE and result["best_us"] == 17.0
        else:
            assert best.FUSE and best.num_warps == 8 and result["best_us"] == 18.0
    else:
        assert not best.GEMV and result["best_us"] == 17.0 + (neighbour_us or 0.0)
        assert neighbour_us is None or not tune.fusable(best)  # (a single-split dot: FUSE off)


def test_tune_one_fuses_o_and_downs_epilogue_in_any_single_split_tile(faked_tuner, monkeypatch):
    """o_proj at four rows, the timing faked: split dots 17 us, single-split plain tiles 18, fused ones 16.5 (a
    16-row dot: 15.5), the add + RMSNorm kernel 2, cuBLAS 30. An epilogue pairs nothing: every single-split tile
    is timed fused, 16-row dots too, and no 64 + 64 paired tile is added; the fused 16-row dot wins (15.5 against
    17 + 2)."""
    called = faked_tuner

    def fused_us(cfg):
        assert tune.fusable(cfg, paired=False)
        return 15.5 if cfg.BLOCK_N == 16 and not cfg.GEMV else 16.5

    monkeypatch.setattr(tune, "time_calls", priced(called, fused_us, lambda c: 18.0 if c.SPLIT_K == 1 else 17.0, 2.0))
    result = tune_fake("bf16", 4096, 4096, 4, tune.Fusion("o"))
    fused = [c[1] for c in called if isinstance(c, tuple)]
    assert {c.BLOCK_N for c in fused if not c.GEMV} == {16, 32, 64}  # tile_grid's, no 128-row paired tile
    assert all(c.SPLIT_K == 1 for c in fused) and any(c.GEMV for c in fused)
    assert not any(c.PAIR_DOT for c in fused)  # (an epilogue has no paired halves)
    best = result["best"]
    assert (best.BLOCK_N, best.SPLIT_K, best.GEMV, best.FUSE) == (16, 1, False, True)
    assert result["best_us"] == 15.5 and result["base_us"] == 32.0 and result["neighbour_us"] == 2.0


def test_tune_one_times_the_lm_heads_configs_on_prenormed_rows_with_the_final_norm_as_its_neighbour(faked_tuner,
                                                                                                 monkeypatch):
    """The LM head at eight rows, the timing faked: single-split tiles 20 us plain and 20.5 fused (on the last down's
    PrenormedRow: no rotary, no pairs), split tiles 19.8, the final norm's kernel 2, cuBLAS 30. Only tiles that
    pair are timed fused (the down before the head hands it a PrenormedRow only for those:
    small_m_gemm.takes_prenormed), without PAIR_DOT; a fused tile wins (20.5 against 19.8 + 2)."""
    called = faked_tuner
    monkeypatch.setattr(tune, "time_calls", priced(called, lambda c: 20.5, lambda c: 20.0 if c.SPLIT_K == 1 else 19.8,
                                                   2.0))
    result = tune_fake("bf16", 128256, 2048, 8, tune.Fusion("head"))
    fused = [c[1] for c in called if isinstance(c, tuple)]
    assert {c.BLOCK_N for c in fused} == {32, 64}  # tile_grid's that pair; not 16, no 128-wide paired tile
    assert all(c.SPLIT_K == 1 and not c.PAIR_DOT and not c.GEMV for c in fused)
    best = result["best"]
    assert best.FUSE and best.SPLIT_K == 1 and best.BLOCK_N in (32, 64)
    assert result["best_us"] == 20.5 and result["base_us"] == 32.0 and result["neighbour_us"] == 2.0


def test_the_lm_heads_timed_calls_are_its_gemm_of_the_normed_rows_and_its_plain_forms_neighbour_the_norm(monkeypatch):
    """What the tuner times for the head (Triton's interpreter): its fused calls are the GEMM of a PrenormedRow of
    its rows with each weight copy (x @ W^T, each row scaled by 1 / rms), and its neighbour is the final RMSNorm of
    its input (with the residual add)."""
    import torch

    from model_executor.layers.triton_ops import small_m_gemm as sm

    monkeypatch.setattr(tune, "DEVICE", "cpu")
    monkeypatch.setattr(tune, "ROTATE_BYTES", 1)
    gen = torch.Generator().manual_seed(0)
    n, k, m = 64, 32, 3
    wts = tune.Weights("bf16", n, k, gen)
    x = torch.randn(m, k, generator=gen).bfloat16()
    cfg = sm.GemmConfig(BLOCK_N=32, BLOCK_K=32, FUSE=True)
    calls = tune.fused_calls(sm, tune.Fusion("head"), x, wts, cfg)
    assert len(calls) == len(wts.w)
    for call, w in zip(calls, wts.w):  # x @ W^T scaled per row by 1 / rms (of the faked row's random sums)
        out, ref = call().float(), x.float() @ w.float().t()
        scale = (out * ref).sum(-1, keepdim=True) / ref.pow(2).sum(-1, keepdim=True)
        assert bool((scale > 0.5).all())
        torch.testing.assert_close(out, scale * ref, rtol=2e-2, atol=2e-3)
    neighbours = tune.neighbour_calls(tune.Fusion("head"), x, n)
    assert len(neighbours) == tune.NEIGHBOUR_CALLS
    out, _ = neighbours[0]()
    assert out.shape == (m, k)  # the norm of the head's input, not of its output

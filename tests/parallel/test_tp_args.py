"""The parallelism flags (no processes): multi-host arguments, where each rank runs, the start-up checks
against the host and the model, and the data-parallel router."""

from __future__ import annotations

import pytest

from server.args import ArgsError, ServerArgs, build_parser, parse_args
from server.dp_router import PREFIX_BLOCK, DpRouter, merge_stats
from server.launch_server import UsageError, check_parallel_fits
from server.parallel import plan_ranks
from tests.conftest import TINY_LLAMA, save_tiny_hf_model


def test_multi_host_flags_place_this_nodes_ranks():
    args = parse_args(["--tp-size", "4", "--nnodes", "2", "--node-rank", "1", "--dist-init-addr", "10.0.0.1:5000",
                       "--device", "cuda"])
    ranks = plan_ranks(args)
    assert [(r.tp_rank, r.device, r.dist_init_method) for r in ranks] == [
        (2, "cuda:0", "tcp://10.0.0.1:5000"), (3, "cuda:1", "tcp://10.0.0.1:5000")]
    assert not any(r.talks_to_clients for r in ranks)  # node 0 holds rank 0 and the HTTP server
    node0 = plan_ranks(args.replace(node_rank=0))
    assert [r.tp_rank for r in node0] == [0, 1] and node0[0].talks_to_clients


def test_data_parallel_replicas_get_their_own_gpus_and_groups():
    args = parse_args(["--tp-size", "2", "--dp-size", "2", "--device", "cuda", "--dist-init-addr", "[::1]:7000"])
    ranks = plan_ranks(args)
    assert [(r.dp_rank, r.tp_rank, r.device) for r in ranks] == [
        (0, 0, "cuda:0"), (0, 1, "cuda:1"), (1, 0, "cuda:2"), (1, 1, "cuda:3")]
    assert [r.dist_init_method for r in ranks] == ["tcp://[::1]:7000"] * 2 + ["tcp://[::1]:7001"] * 2
    assert [r.name for r in ranks] == ["scheduler", "scheduler (dp replica 0, tp rank 1)",
                                       "scheduler (dp replica 1, tp rank 0)", "scheduler (dp replica 1, tp rank 1)"]


@pytest.mark.parametrize("argv, message", [
    (["--nnodes", "2", "--node-rank", "2", "--tp-size", "2", "--dist-init-addr", "h:1"], "--node-rank must be in"),
    (["--nnodes", "2", "--tp-size", "3", "--dist-init-addr", "h:1"], "must be a multiple of --nnodes"),
    (["--nnodes", "2", "--tp-size", "2"], "needs --dist-init-addr"),
    (["--dist-init-addr", "host:99999"], "--dist-init-addr: expected HOST:PORT"),
    (["--nnodes", "2", "--tp-size", "2", "--dp-size", "2", "--dist-init-addr", "h:1"], "--dp-size > 1 with"),
    (["--dp-size", "0"], "--dp-size must be a positive integer"),
    (["--dist-timeout", "0"], "--dist-timeout must be > 0"),
])
def test_bad_parallel_flags_name_the_flag(argv, message):
    with pytest.raises(ArgsError, match=message.replace("[", r"\[")):
        ServerArgs(**vars(build_parser().parse_args(argv))).validate()  # parse_args would exit instead


def test_tp_size_that_does_not_split_the_heads_is_refused(tmp_path):
    save_tiny_hf_model(tmp_path, dict(TINY_LLAMA, num_attention_heads=4, num_key_value_heads=2))
    args = ServerArgs(model_path=str(tmp_path), device="cpu", tp_size=3)
    with pytest.raises(UsageError, match="--tp-size 3: 4 attention heads cannot be split over 3"):
        check_parallel_fits(args)
    check_parallel_fits(args.replace(tp_size=4))  # one KV head per rank, replicated: fine


def test_more_ranks_than_gpus_is_refused(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 3)
    args = ServerArgs(model_path="unused", device="cuda", tp_size=1, dp_size=4)
    with pytest.raises(UsageError, match="needs 4 GPUs on this host .* but 3 are visible"):
        check_parallel_fits(args)


def test_least_load_routing_alternates_and_prefers_the_idle_replica():
    router = DpRouter(2)
    assert [router.choose([1]) for _ in range(4)] == [0, 1, 0, 1]
    router.release(0)
    router.release(0)
    assert router.choose([1]) == 0  # replica 0 has none in flight, replica 1 has two


def test_prefix_routing_keeps_a_conversation_on_its_replica():
    router = DpRouter(2, "prefix")
    system = list(range(100, 100 + PREFIX_BLOCK))  # one shared block: not enough to pin a conversation
    turn1_a = system + list(range(1, 3 * PREFIX_BLOCK))
    turn1_b = system + list(range(500, 500 + 3 * PREFIX_BLOCK))
    a, b = router.choose(turn1_a), router.choose(turn1_b)
    assert a != b  # the shared system prompt alone does not decide: least loaded
    for _ in range(3):  # the next turns of each conversation follow their first turn, however busy it is
        router.inflight[a] += 10
        turn1_a = turn1_a + [7] * PREFIX_BLOCK
        assert router.choose(turn1_a) == a
        router.inflight[b] += 10
        turn1_b = turn1_b + [9] * PREFIX_BLOCK
        assert router.choose(turn1_b) == b


def test_merged_stats_sum_counts_and_average_rates():
    merged = merge_stats([{"num_running": 2, "cache_hit_rate": 0.5, "path_counts": {"decode_eager": 3}},
                          {"num_running": 1, "cache_hit_rate": 0.25, "path_counts": {"decode_eager": 1,
                                                                                     "extend_eager": 2}}])
    assert merged["num_running"] == 3 and merged["cache_hit_rate"] == 0.375
    assert merged["path_counts"] == {"decode_eager": 4, "extend_eager": 2}


def test_an_architecture_without_tensor_parallel_support_is_refused(tmp_path, monkeypatch):
    from model_executor.models.llama import LlamaForCausalLM

    save_tiny_hf_model(tmp_path, TINY_LLAMA)
    args = ServerArgs(model_path=str(tmp_path), device="cpu", tp_size=2)
    check_parallel_fits(args)
    monkeypatch.setattr(LlamaForCausalLM, "supports_tensor_parallel", False)  # as a layer-less MoE would be
    with pytest.raises(UsageError, match="--tp-size 2: LlamaForCausalLM does not support tensor parallelism"):
        check_parallel_fits(args)
    check_parallel_fits(args.replace(tp_size=1))

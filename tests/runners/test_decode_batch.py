"""The decode batch ModelRunner.build_batch makes from host lists (one host tensor, one upload): its rows,
positions, lengths, slots and input ids, and the slots it records in the request table and its host mirror.
tests/runners/test_decode_batch_gpu.py runs the same check on CUDA (pinned host tensor, device table)."""

from __future__ import annotations

import torch

from model_executor.forward_batch import ForwardMode
from runners.model_runner import ModelRunner, RunnerConfig, int64_tensor


def check_decode_batch(runner: ModelRunner, with_input_ids: bool) -> None:
    pool = runner.req_to_token_pool
    rows = [pool.alloc() for _ in range(5)]
    seq_lens = [7, 3, 12, 1, 9]
    loc = runner.allocator.alloc(len(rows))
    try:
        runner.last_token_ids[torch.tensor(rows, device=runner.device)] = torch.tensor(
            [40, 41, 42, 43, 44], device=runner.device)
        ids = [11, 12, 13, 14, 15] if with_input_ids else None
        fb = runner.build_batch(ForwardMode.DECODE, ids, rows, seq_lens, loc)
        assert fb.batch_size == 5 and fb.seq_lens_cpu == seq_lens
        assert fb.req_pool_indices.tolist() == rows
        assert fb.positions.tolist() == [n - 1 for n in seq_lens]
        assert fb.seq_lens.tolist() == seq_lens and fb.seq_lens.dtype == torch.int64
        assert fb.out_cache_loc.tolist() == loc.tolist()
        assert fb.input_ids.tolist() == (ids if with_input_ids else [40, 41, 42, 43, 44])
        for table in (pool.req_to_token, pool.req_to_token_cpu):  # the same tensor on CPU
            assert [int(table[r, n - 1]) for r, n in zip(rows, seq_lens)] == loc.tolist()
    finally:
        for r in rows:
            pool.req_to_token[r].zero_()
            pool.req_to_token_cpu[r].zero_()
            pool.free(r)
        runner.allocator.free(loc)


def test_decode_batch_from_host_lists(tiny_llama):
    runner = ModelRunner(RunnerConfig(model_path=str(tiny_llama[0]), max_running_requests=8, max_total_tokens=256))
    check_decode_batch(runner, with_input_ids=False)
    check_decode_batch(runner, with_input_ids=True)


def test_int64_tensor():
    assert int64_tensor([3, -1, 2**40]).tolist() == [3, -1, 2**40]
    assert int64_tensor([3]).dtype == torch.int64
    assert int64_tensor([]).shape == (0,)

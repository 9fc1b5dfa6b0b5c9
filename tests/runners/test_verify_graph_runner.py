"""Speculative verify graphs (runners/verify_graph_runner.py) on the CPU: the triton backend's extend kernel in
Triton's interpreter, inside the stand-in graph (host state frozen at capture, as a CUDA graph's). A verify
batch's replay equals its eager forward (logits at every token, the K/V it stores, no other slot written) at
captured and padded batch sizes, with requests verifying fewer tokens than the graph's bound; an EAGLE-3 target's
aux hidden states come out of the verify and decode graphs as they do eagerly; ModelRunner.forward_verify takes
the graph where one fits. On a CUDA machine the same tests run the compiled kernels."""

from __future__ import annotations

import pytest
import torch

from model_executor.forward_batch import ForwardMode
from runners.cuda_graph_runner import CudaGraphRunner
from runners.graph_seam import StandInCapturer
from runners.verify_graph_runner import VerifyGraphRunner
from tests import triton_mode
from tests.runners.test_cuda_graph_runner import make_triton_runner
from tests.runners.test_full_extend_graph_runner import assert_replay_equals_eager
from tests.runners.test_piecewise_runner import make_extend_batch, release
from tests.triton_mode import in_process

SIZES = [1, 2, 4]
TOKENS = 4  # a request's last token and up to 3 drafts

test_in_subprocess = triton_mode.subprocess_test(__file__)


@pytest.fixture(scope="module")
def runner(tiny_llama):
    return make_triton_runner(tiny_llama[0], max_total_tokens=1024)


@pytest.fixture(scope="module")
def graphs(runner):
    return VerifyGraphRunner(runner, SIZES, TOKENS, capturer=StandInCapturer())


@pytest.fixture
def verify_batch(runner):
    """make(ext_lens, prefix_lens, seed) -> a verify batch (every token's logits) over cached prefixes."""
    made = []

    def make(ext_lens, prefix_lens, seed):
        fb, rows = make_extend_batch(runner, ext_lens, prefix_lens, seed)
        fb.all_token_logits = True
        made.append((rows, fb))
        return fb

    yield make
    for rows, fb in made:
        release(runner, rows, fb)


CASES = {  # (tokens each request verifies, its KV prefix)
    "one_request_full": ([4], [9]),
    "one_request_short": ([2], [5]),
    "two_on_size": ([4, 3], [7, 20]),
    "three_padded_to_four": ([4, 1, 2], [3, 11, 30]),
    "four_full": ([4, 4, 4, 4], [1, 2, 3, 40]),
}


@in_process
@pytest.mark.parametrize("case", CASES)
def test_verify_replay_equals_eager(runner, graphs, verify_batch, case):
    ext_lens, prefix_lens = CASES[case]
    fb = verify_batch(ext_lens, prefix_lens, seed=len(case))
    assert graphs.can_run(fb)
    assert graphs.key(fb) == (TOKENS * graphs.key(fb)[1], min(s for s in SIZES if s >= len(ext_lens)))
    assert_replay_equals_eager(runner, graphs, fb, fb.out_cache_loc)


@in_process
def test_fewer_requests_after_a_larger_replay(runner, graphs, verify_batch):
    """Rows and tokens a larger replay left in the buffers belong to no request of the next one."""
    big = verify_batch([4, 4, 4, 4], [5, 6, 7, 8], seed=1)
    graphs.replay(big)
    for buf in runner.kv_cache.k_buffers + runner.kv_cache.v_buffers:
        buf[big.out_cache_loc] = 123.0  # a stale row that ran again would write its K/V here
    small = verify_batch([3, 1, 2], [4, 9, 2], seed=2)  # padded to 4: the fourth row must take no tokens
    assert_replay_equals_eager(runner, graphs, small, small.out_cache_loc)


@in_process
def test_what_the_verify_graphs_do_not_take(runner, graphs, verify_batch):
    assert not graphs.can_run(verify_batch([5], [3], seed=3))  # more tokens than the bound
    assert not graphs.can_run(verify_batch([1] * 5, [3] * 5, seed=4))  # more requests than the largest size
    plain = verify_batch([2], [3], seed=5)
    plain.all_token_logits = False  # an ordinary extend goes to the extend runners
    assert not graphs.can_run(plain)


@in_process
def test_forward_verify_replays_the_graph(runner, graphs, verify_batch):
    fb = verify_batch([3, 4], [6, 2], seed=6)
    eager = runner.forward_eager(fb).clone()
    runner.verify_graph_runner = graphs
    try:
        before = runner.path_counts["verify_graph"]
        torch.testing.assert_close(runner.forward_verify(fb), eager, rtol=1e-4, atol=1e-4)
        assert runner.path_counts["verify_graph"] == before + 1
    finally:
        runner.verify_graph_runner = None


@pytest.fixture(scope="module")
def aux_runner(tiny_llama):
    runner = make_triton_runner(tiny_llama[0], max_total_tokens=1024)
    runner.model.set_aux_hidden_state_layers((0, 1))
    return runner


@in_process
def test_aux_hidden_states_come_out_of_the_graphs(aux_runner, tiny_llama):
    """An EAGLE-3 target: the verify and decode graphs give the layers' outputs of the real rows, equal to eager's,
    as copies that a later replay does not overwrite."""
    runner = aux_runner
    verify = VerifyGraphRunner(runner, SIZES, TOKENS, capturer=StandInCapturer())
    decode = CudaGraphRunner(runner, SIZES, capturer=StandInCapturer())
    fb, rows = make_extend_batch(runner, [4, 2, 3], [5, 8, 2], seed=7)
    fb.all_token_logits = True
    try:
        runner.forward_eager(fb)
        eager = fb.aux_hidden_states.clone()
        assert eager.shape == (9, 2 * runner.model_config.hidden_size)
        fb.aux_hidden_states = None
        verify.replay(fb)
        torch.testing.assert_close(fb.aux_hidden_states, eager, rtol=1e-4, atol=1e-4)
        kept = fb.aux_hidden_states
        other, other_rows = make_extend_batch(runner, [4], [3], seed=8)
        other.all_token_logits = True
        verify.replay(other)  # (its aux rows go where fb's were)
        release(runner, other_rows, other)
        # a decode step after the verified tokens: one new token each
        loc = runner.allocator.alloc(3)
        lens = [n + 1 for n in fb.seq_lens_cpu]
        for row, n, slot in zip(rows, lens, loc):
            runner.req_to_token_pool.write(row, n - 1, slot.view(1))
        step = runner.build_batch(ForwardMode.DECODE, [7, 8, 9], rows, lens, loc)
        runner.forward_eager(step)
        eager_step = step.aux_hidden_states.clone()
        step.aux_hidden_states = None
        with torch.inference_mode():  # (as ModelRunner.forward replays)
            decode.replay(step)
        torch.testing.assert_close(step.aux_hidden_states, eager_step, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(kept, eager, rtol=1e-4, atol=1e-4)  # (not overwritten by the later replays)
        runner.allocator.free(loc)
    finally:
        release(runner, rows, fb)

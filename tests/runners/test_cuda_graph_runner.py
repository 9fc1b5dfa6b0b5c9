"""Decode graph runner logic through the stand-in graph: capture order, bisect, padding, slicing, and replay
equal to eager with the triton backend (what a real graph runs).

The stand-in replays with the host-side state of the static batch and the backend frozen at capture, as a
CUDA graph would. The torch_native backend reads host lists at run time, so it is not graph-safe and is
used here only where values are not compared. The triton backend reads lengths and slots from device
buffers: without CUDA its kernels run in Triton's CPU interpreter (tests/triton_mode.py).
"""

from __future__ import annotations

import pytest
import torch

from model_executor.forward_batch import ForwardMode
from model_executor.layers.attention.torch_native import TorchNativeBackend
from model_executor.layers.attention.triton_backend import TritonAttnBackend
from runners.capture_lists import get_batch_sizes_to_capture, get_token_levels, pick_size
from runners.cuda_graph_runner import CudaGraphRunner
from runners.graph_seam import StandInCapturer
from runners.model_runner import ModelRunner, RunnerConfig
from tests import triton_mode
from tests.triton_mode import DEVICE, in_process

GiB = 1024**3


def test_default_capture_list():
    sizes = get_batch_sizes_to_capture(256)
    assert sizes[:8] == [1, 2, 4, 8, 12, 16, 24, 32]
    assert sizes[-1] == 256 and len(sizes) == 36
    big = get_batch_sizes_to_capture(512)
    assert big[36:44] == [272, 288, 304, 320, 336, 352, 368, 384] and big[-2:] == [480, 496, 512][-2:]
    assert 496 in big and 512 in big and 504 not in big
    assert get_batch_sizes_to_capture(10) == [1, 2, 4, 8]


def test_default_max_bs_from_memory():
    assert get_batch_sizes_to_capture(None, gpu_memory_bytes=16 * GiB)[-1] == 8
    assert get_batch_sizes_to_capture(None, gpu_memory_bytes=24 * GiB)[-1] == 24
    assert get_batch_sizes_to_capture(None, gpu_memory_bytes=40 * GiB)[-1] == 32
    assert get_batch_sizes_to_capture(None, gpu_memory_bytes=80 * GiB)[-1] == 256
    assert get_batch_sizes_to_capture(None, gpu_memory_bytes=141 * GiB)[-1] == 256
    assert get_batch_sizes_to_capture(None, gpu_memory_bytes=180 * GiB)[-1] == 512


def test_explicit_list_and_max_running_cut():
    assert get_batch_sizes_to_capture(256, (16, 1, 4, 2, 8)) == [1, 2, 4, 8, 16]
    # an explicit list is captured as given (sorted, each size once): no other size joins it
    assert get_batch_sizes_to_capture(64, [1, 2, 4, 16]) == [1, 2, 4, 16]
    assert get_batch_sizes_to_capture(None, (3, 1, 7, 3)) == [1, 3, 7]
    assert get_batch_sizes_to_capture(None, (20, 48)) == [20, 48]
    assert get_batch_sizes_to_capture(256, None, max_running_requests=20) == [1, 2, 4, 8, 12, 16]
    assert get_batch_sizes_to_capture(None, (1, 2, 64), max_running_requests=32) == [1, 2]


def test_explicit_token_levels_are_captured_as_given():
    assert get_token_levels(0, (16, 64, 128)) == [16, 64, 128]
    assert get_token_levels(2048, (128, 8, 16, 8)) == [8, 16, 128]
    assert get_token_levels(64)[:4] == [1, 2, 4, 8]  # (the default levels, without an explicit list)


def test_the_server_captures_the_explicit_lists_exactly():
    """--cuda-graph-bs and --piecewise-cuda-graph-tokens, through the runner config the server builds: the
    sizes and levels given, and no others."""
    from server.args import parse_args
    from server.scheduler_entry import runner_config

    args = parse_args(["--device", "cuda", "--cuda-graph-bs", "1", "2", "4", "16", "--piecewise-cuda-graph-tokens",
                       "24", "256", "--max-running-requests", "64"])
    config = runner_config(args)
    assert config.cuda_graph_bs == (1, 2, 4, 16)
    assert config.piecewise_cuda_graph_tokens == (24, 256)


def test_pick_size_bisects():
    sizes = [1, 2, 4, 8, 12, 16]
    assert [pick_size(sizes, n) for n in (1, 2, 3, 5, 8, 9, 13, 16, 17)] == [1, 2, 4, 8, 8, 12, 16, 16, None]


SIZES = [1, 2, 4, 8, 12, 16]


@pytest.fixture(scope="module")
def runner(tiny_llama):
    return ModelRunner(RunnerConfig(model_path=str(tiny_llama[0]), max_running_requests=20, max_total_tokens=2048))


def make_decode_batch(runner: ModelRunner, bs: int, seed: int, max_prompt: int = 30, min_prompt: int = 2):
    """bs requests with random prompts (min_prompt <= length < max_prompt) prefilled eagerly (one extend
    batch); returns the decode batch of their next token, the request rows and the KV slots the decode step
    writes."""
    g = torch.Generator().manual_seed(seed)
    rows, prompt_lens, prompt_ids, prompt_locs, last = [], [], [], [], []
    for _ in range(bs):
        n = int(torch.randint(min_prompt, max_prompt, (1,), generator=g))
        ids = torch.randint(3, 320, (n,), generator=g).tolist()
        row = runner.req_to_token_pool.alloc()
        loc = runner.allocator.alloc(n)
        runner.req_to_token_pool.write(row, 0, loc)
        rows.append(row)
        prompt_lens.append(n)
        prompt_ids += ids
        prompt_locs.append(loc)
        last.append(ids[-1])
    runner.forward_eager(runner.build_batch(ForwardMode.EXTEND, prompt_ids, rows, prompt_lens,
                                            torch.cat(prompt_locs), extend_seq_lens=prompt_lens))
    seq_lens = [n + 1 for n in prompt_lens]
    loc = runner.allocator.alloc(bs)
    for i, row in enumerate(rows):
        runner.req_to_token_pool.write(row, seq_lens[i] - 1, loc[i : i + 1])
    fb = runner.build_batch(ForwardMode.DECODE, last, rows, seq_lens, loc)
    return fb, rows, loc


def release(runner, rows, fb):
    for row, n in zip(rows, fb.seq_lens_cpu):
        runner.allocator.free(runner.req_to_token_pool.req_to_token[row, :n].long())
        runner.req_to_token_pool.free(row)


@pytest.fixture
def decode_batch():
    """make(runner, bs, seed) -> the decode batch; its rows and slots go back even when the test fails."""
    made = []

    def make(runner, bs, seed, **kw):
        fb, rows, loc = make_decode_batch(runner, bs, seed, **kw)
        made.append((runner, rows, fb))
        return fb, loc

    yield make
    for runner, rows, fb in made:
        release(runner, rows, fb)


def test_capture_largest_first(runner):
    """Records the batch the model really runs inside each capture, not the size the runner meant."""
    order = []

    class Recorder(StandInCapturer):
        def capture(self, fn, host_state=()):
            rows = []
            hook = runner.model.register_forward_pre_hook(lambda _m, args: rows.append(args[0].shape[0]))
            try:
                return super().capture(fn, host_state)
            finally:
                hook.remove()
                order.append(rows)

    CudaGraphRunner(runner, SIZES, capturer=Recorder())
    assert order == [[bs] for bs in sorted(SIZES, reverse=True)]


def test_stand_in_bakes_host_values_and_reads_live_tensors():
    """What a CUDA graph sees on replay: Python values and tensor identities as at capture, tensor contents live."""

    class State:
        pass

    s = State()
    s.lens, s.n, s.t = [1, 2], 3, torch.zeros(2)
    seen = []
    graph = StandInCapturer().capture(lambda: seen.append((list(s.lens), s.n, s.t.tolist())), host_state=(s,))
    s.lens.append(9)  # an in-place edit of a host list: baked, not seen
    s.n = 4  # a new Python value: baked, not seen
    s.t.fill_(7.0)  # new contents of the captured tensor: seen
    s.t = torch.full((2,), 5.0)  # another tensor bound to the name: the graph reads the captured one
    graph.replay()
    assert seen[-1] == ([1, 2], 3, [7.0, 7.0])
    assert s.lens == [1, 2, 9] and s.n == 4 and s.t[0].item() == 5.0  # the live values are back


def test_stand_in_catches_a_backend_that_reads_host_lists(runner, decode_batch):
    """torch_native sizes its gather from seq_lens_cpu on the host: a graph of it keeps the capture-time
    lengths, so its replay must differ from eager (the stand-in no longer re-runs eager)."""
    graph_runner = CudaGraphRunner(runner, [2], capturer=StandInCapturer())
    fb, _ = decode_batch(runner, 2, seed=5)
    assert min(fb.seq_lens_cpu) > runner.attn_backend.get_cuda_graph_seq_len_fill_value()
    eager = runner.forward_eager(fb).clone()
    graphed = graph_runner.replay(fb)
    assert not torch.allclose(graphed, eager, rtol=1e-3, atol=1e-3)


def test_eager_fallback_above_max_bs(runner, decode_batch):
    graph_runner = CudaGraphRunner(runner, [1, 2, 4], capturer=StandInCapturer())
    runner.decode_graph_runner = graph_runner
    try:
        fb, _ = decode_batch(runner, 5, seed=7)
        assert not graph_runner.can_run(fb)
        before = dict(runner.path_counts)
        runner.forward(fb)
        assert runner.path_counts["decode_eager"] == before.get("decode_eager", 0) + 1
        fb, _ = decode_batch(runner, 3, seed=8)
        runner.forward(fb)
        assert runner.path_counts["decode_graph"] == before.get("decode_graph", 0) + 1
        # Extend batches never take the decode graph.
        ext = runner.build_batch(ForwardMode.EXTEND, [5, 6], [1], [2], torch.tensor([1, 2]), extend_seq_lens=[2])
        assert not graph_runner.can_run(ext)
    finally:
        runner.decode_graph_runner = None


def test_padding_rows_point_at_slot_zero(runner, decode_batch):
    graph_runner = CudaGraphRunner(runner, [4], capturer=StandInCapturer())
    fb, loc = decode_batch(runner, 3, seed=11)
    graph_runner.replay(fb)
    b = graph_runner.buffers
    assert b.out_cache_loc[3].item() == 0 and b.req_pool_indices[3].item() == 0
    assert b.seq_lens[3].item() == runner.attn_backend.get_cuda_graph_seq_len_fill_value()
    assert torch.equal(b.out_cache_loc[:3], loc)
    assert torch.all(runner.req_to_token_pool.req_to_token[0] == 0)


# ---------------------------------------------------------------- replay equals eager (triton backend)



TRITON_SIZES = [1, 2, 4]  # few sizes, short prompts: the interpreter is slow


test_in_subprocess = triton_mode.subprocess_test(__file__, "-k", "triton")


def make_triton_runner(model_path, max_total_tokens: int = 512) -> ModelRunner:
    """The tiny model with the triton backend swapped in (the product refuses triton without CUDA)."""
    runner = ModelRunner(RunnerConfig(model_path=str(model_path), device=DEVICE, dtype="float32",
                                      attention_backend="torch_native", max_running_requests=8,
                                      max_total_tokens=max_total_tokens, disable_cuda_graph=True,
                                      disable_piecewise_cuda_graph=True))
    runner.attn_backend = TritonAttnBackend(runner)
    return runner


@pytest.fixture(scope="module")
def triton_runner(tiny_llama):
    return make_triton_runner(tiny_llama[0])


@pytest.fixture(scope="module")
def triton_graphs(triton_runner):
    return CudaGraphRunner(triton_runner, TRITON_SIZES, capturer=StandInCapturer())


def _kv(runner) -> list[torch.Tensor]:
    return [buf.clone() for buf in runner.kv_cache.k_buffers + runner.kv_cache.v_buffers]


@in_process
@pytest.mark.parametrize("bs", TRITON_SIZES + [3])
def test_triton_replay_equals_eager(triton_runner, triton_graphs, decode_batch, bs):
    """Every captured size and a padded one: a value baked in at capture (lengths, slots, ids) shows here."""
    runner = triton_runner
    fb, loc = decode_batch(runner, bs, seed=bs, max_prompt=12)
    assert triton_graphs.can_run(fb)
    kv_before = _kv(runner)
    eager = runner.forward_eager(fb).clone()
    kv_eager = _kv(runner)
    graphed = triton_graphs.replay(fb)
    assert graphed.shape == eager.shape
    # Eager runs at bs rows, the graph at the padded size: float32 GEMMs may round differently.
    torch.testing.assert_close(graphed, eager, rtol=1e-4, atol=1e-4)
    real = loc.to(DEVICE)
    untouched = torch.ones(runner.kv_cache.k_buffers[0].shape[0], dtype=torch.bool, device=DEVICE)
    untouched[real] = False
    untouched[0] = False  # padding rows write slot 0
    for after, ref, before in zip(_kv(runner), kv_eager, kv_before):
        torch.testing.assert_close(after[real], ref[real], rtol=1e-5, atol=1e-5)
        assert torch.equal(after[untouched], before[untouched])


@in_process
def test_triton_fused_rotary_decode_equals_unfused(triton_runner, decode_batch):
    """The triton backend gets decode q/k unrotated and rotates them in its KV store kernel: logits and the
    K/V it stores equal the unfused path's (the rotary as its own op, then the store: torch_native)."""
    fb, loc = decode_batch(triton_runner, 3, seed=21, max_prompt=12)
    assert_fused_decode_equals_unfused(triton_runner, fb, loc, logits_tol=1e-4)


def assert_fused_decode_equals_unfused(runner, fb, loc, logits_tol: float) -> None:
    """The decode batch fb through the runner's (triton) backend, which fuses the rotary into its KV store,
    against the unfused path on torch_native: logits within logits_tol, the K/V stored at loc within 1e-5."""
    assert runner.attn_backend.fuses_rotary(fb)
    real = loc.to(DEVICE)
    bufs = runner.kv_cache.k_buffers + runner.kv_cache.v_buffers
    fused = runner.forward_eager(fb).clone()
    kv_fused = [buf[real].clone() for buf in bufs]
    for buf in bufs:
        buf[real] = float("nan")  # the unfused run must write them again
    fb.attn_backend = TorchNativeBackend()
    unfused = runner.model(fb.input_ids, fb.positions, fb)
    torch.testing.assert_close(fused, unfused, rtol=logits_tol, atol=logits_tol)
    for ref, buf in zip(kv_fused, bufs):
        torch.testing.assert_close(buf[real], ref, rtol=1e-5, atol=1e-5)


@in_process
@pytest.mark.parametrize("bs,min_prompt,max_prompt,plan", [(1, 2, 7, 1), (1, 8, 14, 2), (3, 8, 14, 1)])
def test_triton_replay_takes_the_graph_of_the_batchs_split_plan(triton_runner, triton_graphs, decode_batch,
                                                               monkeypatch, bs, min_prompt, max_prompt, plan):
    """Batch size 1 may split (2 splits on the interpreter's stand-in SM count) and so has two graphs: the
    split one for a batch whose longest request is over single_stage_max_len, the single-stage one else;
    larger sizes have the single-stage graph only. The replay runs the graph of the plan eager would use."""
    backend = triton_runner.attn_backend
    monkeypatch.setattr(backend, "single_stage_max_len", 8)
    assert sorted(triton_graphs.graphs) == [(1, 1), (1, 2), (2, 1), (4, 1)]
    replayed = []
    for key, graph in triton_graphs.graphs.items():
        monkeypatch.setattr(graph, "replay", lambda key=key, replay=graph.replay: (replayed.append(key), replay()))
    fb, _ = decode_batch(triton_runner, bs, seed=30 + min_prompt, min_prompt=min_prompt, max_prompt=max_prompt)
    eager = triton_runner.forward_eager(fb).clone()
    assert backend._decode_splits[1] == plan
    graphed = triton_graphs.replay(fb)
    assert replayed == [(pick_size(TRITON_SIZES, bs), plan)]
    torch.testing.assert_close(graphed, eager, rtol=1e-4, atol=1e-4)

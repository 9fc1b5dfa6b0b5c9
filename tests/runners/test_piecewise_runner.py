"""Piecewise extend runner on the CPU through the stand-in graph: the FX split, one trace, capture order,
bisect + padding, slicing, and equality with the eager forward (logits and KV)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from model_executor.forward_batch import ForwardMode
from model_executor.layers.attention.attention_op import attention_impl
from model_executor.layers.attention.forward_context import forward_context, is_active
from runners import piecewise_cuda_graph_runner as piecewise_module
from runners.capture_lists import get_token_levels
from runners.fx_split import PiecewiseBackend, is_attention_node
from runners.graph_seam import StandInCapturer
from runners.model_runner import ModelRunner, RunnerConfig
from runners.piecewise_cuda_graph_runner import PiecewiseCudaGraphRunner, weak_ref_tensor

LEVELS = [4, 8, 16, 32, 48, 64, 128]


@pytest.fixture(scope="module", autouse=True)
def fresh_dynamo():
    # Every runner adds a cache entry on the same traced function; start and leave the cache empty.
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def make_runner(path, **kw) -> ModelRunner:
    return ModelRunner(RunnerConfig(model_path=str(path), max_running_requests=16, max_total_tokens=4096, **kw))


@pytest.fixture(scope="module")
def llama(tiny_llama):
    runner = make_runner(tiny_llama[0])
    return runner, PiecewiseCudaGraphRunner(runner, LEVELS, capturer=StandInCapturer())


@pytest.fixture(scope="module")
def qwen2(tiny_qwen2):
    runner = make_runner(tiny_qwen2[0])
    return runner, PiecewiseCudaGraphRunner(runner, LEVELS, capturer=StandInCapturer())


def make_extend_batch(runner: ModelRunner, ext_lens: list[int], prefix_lens: list[int], seed: int):
    """Requests with random prompts; each prefix is prefilled eagerly first, so the batch extends on top of
    KV already in the pool. Returns the extend batch of the remaining tokens and the request rows."""
    g = torch.Generator().manual_seed(seed)
    rows, seq_lens, ids, locs = [], [], [], []
    for ext, pre in zip(ext_lens, prefix_lens):
        prompt = torch.randint(3, 320, (pre + ext,), generator=g).tolist()
        row = runner.req_to_token_pool.alloc()
        loc = runner.allocator.alloc(pre + ext)
        runner.req_to_token_pool.write(row, 0, loc)
        if pre:
            runner.forward_eager(runner.build_batch(ForwardMode.EXTEND, prompt[:pre], [row], [pre], loc[:pre],
                                                    extend_seq_lens=[pre]))
        rows.append(row)
        seq_lens.append(pre + ext)
        ids += prompt[pre:]
        locs.append(loc[pre:])
    fb = runner.build_batch(ForwardMode.EXTEND, ids, rows, seq_lens, torch.cat(locs), extend_seq_lens=ext_lens)
    return fb, rows


def release(runner: ModelRunner, rows, fb) -> None:
    for row, n in zip(rows, fb.seq_lens_cpu):
        runner.allocator.free(runner.req_to_token_pool.req_to_token[row, :n].long())
        runner.req_to_token_pool.free(row)


def kv_snapshot(runner: ModelRunner) -> list[torch.Tensor]:
    return [b.clone() for b in runner.kv_cache.k_buffers + runner.kv_cache.v_buffers]


# ---------------------------------------------------------------- levels and the split


def test_default_token_levels():
    levels = get_token_levels(2048)
    assert levels[:11] == [1, 2, 4, 8, 12, 16, 20, 24, 28, 32, 48]  # (every small-M GEMM M bucket up to 64)
    assert levels[23:26] == [256, 288, 320] and levels[31:34] == [512, 576, 640]
    assert levels[-5:] == [1024, 1280, 1536, 1792, 2048] and len(levels) == 44
    big = get_token_levels(8192)
    assert big[:44] == levels and big[44:46] == [2304, 2560]
    assert big[-9:] == [4096, 4608, 5120, 5632, 6144, 6656, 7168, 7680, 8192] and len(big) == 60
    assert get_token_levels(100) == [1, 2, 4, 8, 12, 16, 20, 24, 28, 32, 48, 64, 80, 96]
    assert get_token_levels(2048, (64, 8, 512, 8)) == [8, 64, 512]  # (an explicit list: as given, sorted)


@pytest.mark.parametrize("model", ["llama", "qwen2"])
def test_split_gives_num_layers_plus_one_pieces(model, request):
    runner, pw = request.getfixturevalue(model)
    split = pw.backend.split
    num_layers = runner.model_config.num_hidden_layers
    assert len(split.piece_names) == num_layers + 1 == len(pw.pieces)
    assert len(split.attention_names) == num_layers
    for name in split.attention_names:
        nodes = getattr(split.module, name).graph.nodes
        assert sum(is_attention_node(n) for n in nodes) == 1
        assert sum(n.target is attention_impl for n in nodes) == 1  # no dispatcher round trip at replay
    for piece in pw.pieces:
        assert not any(is_attention_node(n) for n in piece.fn.graph.nodes)
    # Pieces and attention alternate, starting and ending with a piece.
    order = [n.target for n in split.module.graph.nodes if n.op == "call_module"]
    assert order[::2] == split.piece_names and order[1::2] == split.attention_names


# ---------------------------------------------------------------- replay vs eager

CASES = {  # (new tokens per request, cached prefix per request)
    "one_on_level": ([16], [0]),
    "one_between_levels": ([5], [0]),
    "one_odd": ([33], [0]),
    "one_near_max": ([127], [0]),
    "several": ([3, 7, 11], [0, 0, 0]),
    "several_with_prefixes": ([4, 9, 20], [12, 0, 30]),
    "prefix_single_token": ([1], [25]),
    "many_short": ([1] * 9 + [2] * 5, [3] * 14),
    "exactly_max": ([64, 64], [0, 10]),
}


@pytest.mark.parametrize("model", ["llama", "qwen2"])
@pytest.mark.parametrize("case", list(CASES))
def test_replay_equals_eager(model, case, request):
    runner, pw = request.getfixturevalue(model)
    ext, pre = CASES[case]
    fb, rows = make_extend_batch(runner, ext, pre, seed=sum(ext) + len(case))
    assert pw.can_run(fb)
    before = kv_snapshot(runner)
    graphed = pw.replay(fb).clone()
    kv_graphed = kv_snapshot(runner)
    eager = runner.forward_eager(fb)
    kv_eager = kv_snapshot(runner)
    assert graphed.shape == eager.shape == (len(ext), runner.model_config.vocab_size)
    assert graphed.dtype == torch.float32
    torch.testing.assert_close(graphed, eager, rtol=1e-5, atol=1e-5)
    assert torch.equal(graphed.argmax(-1), eager.argmax(-1))
    real = fb.out_cache_loc
    untouched = torch.ones(runner.num_kv_slots + 1, dtype=torch.bool)
    untouched[real] = False
    untouched[0] = False
    for b, g, e in zip(before, kv_graphed, kv_eager):
        torch.testing.assert_close(g[real], e[real], rtol=1e-5, atol=1e-6)  # the real tokens' KV
        assert torch.equal(g[untouched], b[untouched])  # padding wrote nothing outside slot 0
    release(runner, rows, fb)


def test_replay_bypasses_dynamo(llama, monkeypatch):
    """Replays call the split module with the arguments recorded at capture, never torch.compile's frame."""
    runner, pw = llama
    fb, rows = make_extend_batch(runner, [6, 3], [0, 4], seed=21)
    expected = runner.forward_eager(fb).clone()

    def no_dynamo(*args):
        raise AssertionError("replay went through the compiled (dynamo) entry")

    monkeypatch.setattr(pw, "compiled", no_dynamo)
    torch.testing.assert_close(pw.replay(fb), expected, rtol=1e-5, atol=1e-5)
    assert sorted(pw.level_args) == pw.levels
    release(runner, rows, fb)


def test_padding_is_zeroed_and_real_tokens_copied(llama):
    runner, pw = llama
    fb, rows = make_extend_batch(runner, [3, 2], [0, 0], seed=3)
    pw.buffers.input_ids.fill_(77)
    pw.buffers.positions.fill_(77)
    pw.replay(fb)
    assert torch.equal(pw.buffers.input_ids[:5], fb.input_ids)
    assert torch.equal(pw.buffers.positions[:5], fb.positions)
    assert torch.all(pw.buffers.input_ids[5:8] == 0) and torch.all(pw.buffers.positions[5:8] == 0)
    release(runner, rows, fb)


def test_attention_op_computes_real_rows_only(llama):
    runner, pw = llama
    fb, rows = make_extend_batch(runner, [5], [0], seed=4)
    runner.attn_backend.init_forward_metadata(fb)
    layer = pw.attention_layers[0]
    cfg = runner.model_config
    q = torch.randn(8, cfg.num_attention_heads * cfg.head_dim)
    k = torch.randn(8, cfg.num_key_value_heads * cfg.head_dim)
    v = torch.randn(8, cfg.num_key_value_heads * cfg.head_dim)
    out = torch.full_like(q, float("nan"))
    with torch.inference_mode():
        with forward_context(fb, pw.attention_layers):
            assert is_active()
            torch.ops.duet.attention(q, k, v, out, 0)
        assert not is_active()
        expected = runner.attn_backend.forward(q[:5], k[:5], v[:5], layer, fb)
    torch.testing.assert_close(out[:5], expected)
    assert torch.all(out[5:] == 0)
    release(runner, rows, fb)


# ---------------------------------------------------------------- dispatch and tracing


def test_fallback_above_largest_level_and_decode_not_taken(llama):
    runner, pw = llama
    runner.extend_graph_runner = pw
    try:
        before = dict(runner.path_counts)
        fb, rows = make_extend_batch(runner, [100, 29], [0, 0], seed=5)
        assert not pw.can_run(fb)
        runner.forward(fb)
        assert runner.path_counts["extend_eager"] == before.get("extend_eager", 0) + 1
        release(runner, rows, fb)
        fb, rows = make_extend_batch(runner, [100, 28], [0, 0], seed=6)
        runner.forward(fb)
        assert runner.path_counts["extend_graph"] == before.get("extend_graph", 0) + 1
        release(runner, rows, fb)
    finally:
        runner.extend_graph_runner = None
    dec = runner.build_batch(ForwardMode.DECODE, [5, 6], [1, 2], [3, 4], torch.tensor([1, 2]))
    assert not pw.can_run(dec)


def test_traced_once_across_sizes(llama):
    runner, pw = llama
    for n in [2, 1, 4, 7, 8, 9, 64, 3, 128, 100, 31, 47, 49, 1]:
        fb, rows = make_extend_batch(runner, [n], [0], seed=n)
        pw.replay(fb)
        release(runner, rows, fb)
    assert pw.num_traces == 1


def test_capture_largest_first_and_each_piece_once_per_level(tiny_llama):
    class Recorder(StandInCapturer):
        def __init__(self):
            super().__init__()
            self.graphs = []

        def capture(self, fn):
            graph = super().capture(fn)
            self.graphs.append(graph)
            return graph

    runner = make_runner(tiny_llama[0])
    capturer = Recorder()
    pw = PiecewiseCudaGraphRunner(runner, [16, 4, 8, 1], capturer=capturer)
    assert pw.levels == [2, 4, 8, 16]  # a level of 1 is served by 2 (dynamo specializes size 1)
    num_pieces = runner.model_config.num_hidden_layers + 1
    order = {id(g): i for i, g in enumerate(capturer.graphs)}
    captured = sorted((order[id(e.graph)], level, p.index) for p in pw.pieces for level, e in p.entries.items())
    assert len(captured) == len(capturer.graphs) == 4 * num_pieces
    assert [(level, i) for _, level, i in captured] == [(lv, i) for lv in (16, 8, 4, 2) for i in range(num_pieces)]
    info = pw.info()
    assert info["piecewise_cuda_graph_tokens"] == [2, 4, 8, 16]
    assert set(info) == {"piecewise_cuda_graph_tokens", "extend_capture_seconds", "extend_compile_seconds",
                         "extend_capture_gib"}
    assert pw.num_traces == 1


def test_compile_time_is_the_trace_not_the_capture(tiny_llama, monkeypatch):
    """On a clock that only the trace advances, the trace's time is all compile time and no capture time."""
    clock = [0.0]
    monkeypatch.setattr(piecewise_module, "time", SimpleNamespace(perf_counter=lambda: clock[0]))
    trace = PiecewiseBackend.__call__

    def slow_trace(self, gm, example_inputs):
        clock[0] += 1000.0
        return trace(self, gm, example_inputs)

    monkeypatch.setattr(PiecewiseBackend, "__call__", slow_trace)
    pw = PiecewiseCudaGraphRunner(make_runner(tiny_llama[0]), [4], capturer=StandInCapturer())
    assert pw.num_traces == 1
    assert pw.compile_seconds == 1000.0 and pw.capture_seconds == 0.0
    assert pw.info()["extend_compile_seconds"] == 1000.0 and pw.info()["extend_capture_seconds"] == 0.0


def test_retrace_after_capture_is_an_error(tiny_llama):
    """A recompile would trace into fresh, uncaptured pieces: it fails loudly instead."""
    runner = make_runner(tiny_llama[0])
    pw = PiecewiseCudaGraphRunner(runner, [4, 8], capturer=StandInCapturer())
    fb, rows = make_extend_batch(runner, [5], [0], seed=2)
    ids = pw.buffers.input_ids[:8].to(torch.int32)  # another dtype: a guard fails
    with (pytest.raises(Exception, match="traced again"), torch.inference_mode(),
          forward_context(fb, pw.attention_layers)):
        pw.compiled(ids, pw.buffers.positions[:8])
    release(runner, rows, fb)


def test_plain_attention_outside_the_context(llama):
    """Without a piecewise pass running, RadixAttention is the plain backend call (no op, no context)."""
    runner, _ = llama
    assert not is_active()
    calls = []
    original = runner.attn_backend.forward

    def spy(*args, **kw):
        calls.append(is_active())
        return original(*args, **kw)

    runner.attn_backend.forward = spy
    try:
        fb, rows = make_extend_batch(runner, [6], [0], seed=9)
        runner.forward_eager(fb)
    finally:
        del runner.attn_backend.forward
    assert calls == [False] * runner.model_config.num_hidden_layers
    release(runner, rows, fb)


def test_weak_ref_tensor_aliases_without_owning():
    base = torch.arange(12.0).view(3, 4)
    view = base[:, 1:3]
    weak = weak_ref_tensor(view)
    assert weak.data_ptr() == view.data_ptr() and weak.shape == view.shape and weak.stride() == view.stride()
    base += 1
    assert torch.equal(weak, view)


def test_inductor_pieces_match_eager(tiny_llama):
    # Inductor compiles each piece: about 30 s on a 2-core machine, worth it to keep the option honest.
    runner = make_runner(tiny_llama[0], enable_torch_compile=True)
    pw = PiecewiseCudaGraphRunner(runner, [4, 16], capturer=StandInCapturer())
    for ext, pre in (([3], [0]), ([5, 7], [0, 9])):
        fb, rows = make_extend_batch(runner, ext, pre, seed=len(ext))
        torch.testing.assert_close(pw.replay(fb), runner.forward_eager(fb), rtol=1e-4, atol=1e-4)
        release(runner, rows, fb)
    assert pw.num_traces == 1


def test_bench_prefill_runs_on_cpu(tiny_llama, tmp_path, capsys):
    import json

    from benchmarks import bench_prefill

    out = tmp_path / "prefill.json"
    assert bench_prefill.main(["--model-path", str(tiny_llama[0]), "--device", "cpu", "--sizes", "8", "20", "40",
                               "--batch", "2", "--prefix-len", "5", "--levels", "8", "16", "32", "--iters", "2",
                               "--warmup", "1", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["num_traces"] == 1 and report["num_pieces"] == 3
    rows = {r["tokens"]: r for r in report["results"]}
    assert rows[20]["level"] == 32 and rows[20]["greedy_tokens_equal"]
    assert rows[20]["piecewise_vs_eager_max_abs_diff"] < 1e-3
    # The reported speedup is the ratio of the reported timings (eager over piecewise), not its inverse.
    assert rows[20]["speedup"] == pytest.approx(rows[20]["eager_ms"] / rows[20]["piecewise_ms"], rel=1e-2)
    assert rows[40]["level"] is None and rows[40]["piecewise_ms"] is None  # above the largest level: eager
    assert "piecewise ms" in capsys.readouterr().out
    assert bench_prefill.default_levels(2048)[-1] == 2048 and len(bench_prefill.default_levels(2048)) == 44
    assert bench_prefill.default_levels(100)[-1] == 112

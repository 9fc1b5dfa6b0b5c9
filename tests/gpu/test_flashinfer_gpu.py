"""flashinfer backend on the GPU: decode and extend vs torch_native; decode graph replay vs eager."""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytestmark = pytest.mark.gpu
flashinfer = pytest.importorskip("flashinfer")

from model_executor.configs import shape_path
from model_executor.forward_batch import ForwardMode
from model_executor.layers.attention.torch_native import TorchNativeBackend
from runners.cuda_graph_runner import CudaGraphRunner
from runners.model_runner import ModelRunner, RunnerConfig


@pytest.fixture(scope="module", params=["smollm2-135m", "llama-3.2-1b"])
def runner(request):
    cfg = RunnerConfig(model_path=str(shape_path(request.param)), device="cuda", attention_backend="flashinfer",
                       max_running_requests=64, max_total_tokens=64 * 300, context_length=512,
                       random_weights=True, disable_cuda_graph=True, disable_piecewise_cuda_graph=True)
    return ModelRunner(cfg)


def _reference(runner, fb) -> torch.Tensor:
    """The same batch through torch_native: the batch itself names the backend the layers call."""
    native_fb = dataclasses.replace(fb, attn_backend=TorchNativeBackend())
    return runner.model(native_fb.input_ids, native_fb.positions, native_fb).clone()


def assert_logits_close(ours: torch.Tensor, ref: torch.Tensor) -> None:
    """bf16 through every layer: compare whole rows by relative error, and the greedy tokens."""
    rel = ((ours - ref).norm(dim=-1) / ref.norm(dim=-1)).max().item()
    agree = (ours.argmax(-1) == ref.argmax(-1)).float().mean().item()
    print(f"\nmax row relative error {rel:.4f}, greedy agreement {agree:.2f}")
    assert rel < 3e-2 and agree >= 2 / 3


def test_extend_and_decode_match_torch_native(runner):
    from tests.test_cuda_graph_runner import make_decode_batch, release

    g = torch.Generator().manual_seed(0)
    # Extend with a cached prefix: first 40 tokens, then 25 more on top, for 3 requests.
    rows, locs, seqs = [], [], []
    for n in (40, 7, 90):
        ids = torch.randint(0, 1000, (n + 25,), generator=g).tolist()
        row = runner.req_to_token_pool.alloc()
        loc = runner.allocator.alloc(n + 25)
        runner.req_to_token_pool.write(row, 0, loc)
        runner.forward_eager(runner.build_batch(ForwardMode.EXTEND, ids[:n], [row], [n], loc[:n],
                                                extend_seq_lens=[n]))
        rows.append(row), locs.append(loc), seqs.append((ids, n))
    ids = [t for s, n in seqs for t in s[n:]]
    out_loc = torch.cat([loc[n:] for loc, (_, n) in zip(locs, seqs)])
    fb = runner.build_batch(ForwardMode.EXTEND, ids, rows, [len(s) for s, _ in seqs], out_loc,
                            extend_seq_lens=[25] * 3)
    with torch.inference_mode():
        ours = runner.forward_eager(fb).clone()
        ref = _reference(runner, fb)
    assert_logits_close(ours, ref)
    for row, loc in zip(rows, locs):
        runner.allocator.free(loc)
        runner.req_to_token_pool.free(row)
    fb, rows, _ = make_decode_batch(runner, 9, seed=3)
    with torch.inference_mode():
        ours = runner.forward_eager(fb).clone()
        ref = _reference(runner, fb)
    assert_logits_close(ours, ref)
    release(runner, rows, fb)


@pytest.fixture(scope="module")
def graphs(runner):
    return CudaGraphRunner(runner, [1, 2, 4, 8, 16])


@pytest.mark.parametrize("bs", [1, 3, 8, 13, 16])
def test_decode_graph_replay_equals_eager(runner, graphs, bs):
    from tests.test_cuda_graph_runner import make_decode_batch, release

    fb, rows, _ = make_decode_batch(runner, bs, seed=50 + bs)
    with torch.inference_mode():
        eager = runner.forward_eager(fb).clone()
        graphed = graphs.replay(fb).clone()
    assert torch.equal(eager.argmax(-1), graphed.argmax(-1))
    torch.testing.assert_close(graphed, eager, rtol=1e-2, atol=1e-2)
    release(runner, rows, fb)


def test_decode_graph_with_a_shared_long_prefix():
    """64 requests sharing one 4096-token prefix in a pool of about 4.2k slots: the summed lengths (262k)
    far exceed the pool, so the graph's KV-index buffer must be sized by max_bs x context, not by the pool."""
    prefix_len, bs = 4096, 64
    cfg = RunnerConfig(model_path=str(shape_path("smollm2-135m")), device="cuda", attention_backend="flashinfer",
                       max_running_requests=bs, max_total_tokens=prefix_len + 2 * bs, context_length=prefix_len + 8,
                       random_weights=True, disable_cuda_graph=True, disable_piecewise_cuda_graph=True)
    runner = ModelRunner(cfg)
    graphs = CudaGraphRunner(runner, [bs])
    g = torch.Generator().manual_seed(1)
    prefix = torch.randint(0, 1000, (prefix_len,), generator=g).tolist()
    first = runner.req_to_token_pool.alloc()
    prefix_loc = runner.allocator.alloc(prefix_len)
    runner.req_to_token_pool.write(first, 0, prefix_loc)
    with torch.inference_mode():
        runner.forward_eager(runner.build_batch(ForwardMode.EXTEND, prefix, [first], [prefix_len], prefix_loc,
                                                extend_seq_lens=[prefix_len]))
    rows = [first] + [runner.req_to_token_pool.alloc() for _ in range(bs - 1)]
    new_loc = runner.allocator.alloc(bs)
    for i, row in enumerate(rows):
        runner.req_to_token_pool.write(row, 0, prefix_loc)
        runner.req_to_token_pool.write(row, prefix_len, new_loc[i : i + 1])
    last = torch.randint(0, 1000, (bs,), generator=g).tolist()
    fb = runner.build_batch(ForwardMode.DECODE, last, rows, [prefix_len + 1] * bs, new_loc)
    with torch.inference_mode():
        eager = runner.forward_eager(fb).clone()
        graphed = graphs.replay(fb).clone()
    print(f"\nflashinfer decode graph, {bs} requests x {prefix_len + 1} tokens on {runner.num_kv_slots} slots: "
          f"max |graph - eager| {(graphed - eager).abs().max().item():.4f}")
    assert torch.equal(eager.argmax(-1), graphed.argmax(-1))
    torch.testing.assert_close(graphed, eager, rtol=1e-2, atol=1e-2)

"""flashinfer backend on the GPU: decode and extend vs torch_native; decode graph replay vs eager; over a bf16
and an FP8 KV pool (whose per-layer scales the attention calls are checked against a float reference)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytestmark = pytest.mark.gpu
flashinfer = pytest.importorskip("flashinfer")

from model_executor.configs import shape_path
from model_executor.forward_batch import ForwardMode
from model_executor.layers.attention.radix_attention import RadixAttention
from model_executor.layers.attention.torch_native import TorchNativeBackend, _causal_attention
from runners.cuda_graph_runner import CudaGraphRunner
from runners.model_runner import ModelRunner, RunnerConfig


def make_runner(model: str, kv_cache_dtype: str = "auto") -> ModelRunner:
    cfg = RunnerConfig(model_path=str(shape_path(model)), device="cuda", attention_backend="flashinfer",
                       max_running_requests=64, max_total_tokens=64 * 300, context_length=512,
                       random_weights=True, disable_cuda_graph=True, disable_piecewise_cuda_graph=True,
                       kv_cache_dtype=kv_cache_dtype)
    return ModelRunner(cfg)


# The FP8 pools' scales stay 1.0 here: torch_native (the reference) reads a pool without its scales.
# smollm2-135m's 3 query heads a KV head take flashinfer's CUDA-core decode, llama-3.2-1b's 4 its tensor cores.
@pytest.fixture(scope="module", params=["smollm2-135m", "llama-3.2-1b", "smollm2-135m/fp8_e4m3",
                                        "llama-3.2-1b/fp8_e4m3"])
def runner(request):
    model, _, kv = request.param.partition("/")
    return make_runner(model, kv or "auto")


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
    from tests.runners.test_cuda_graph_runner import make_decode_batch, release

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
    from tests.runners.test_cuda_graph_runner import make_decode_batch, release

    fb, rows, _ = make_decode_batch(runner, bs, seed=50 + bs)
    with torch.inference_mode():
        eager = runner.forward_eager(fb).clone()
        graphed = graphs.replay(fb).clone()
    assert torch.equal(eager.argmax(-1), graphed.argmax(-1))
    torch.testing.assert_close(graphed, eager, rtol=1e-2, atol=1e-2)
    release(runner, rows, fb)


def test_planning_and_replay_do_not_wait_for_the_gpu(runner, graphs):
    """The plans are built from host lengths: an eager decode's and an extend's planning, and a whole graph
    replay (its plan included), run under torch's sync debug mode set to raise on any device sync."""
    from tests.runners.test_cuda_graph_runner import make_decode_batch, release

    fb, rows, _ = make_decode_batch(runner, 5, seed=77)
    # (an extend of 3 tokens over the first request's cache: planned only, so its slots are a placeholder)
    placeholder = fb.out_cache_loc[:1].cpu().repeat(3)
    extend = runner.build_batch(ForwardMode.EXTEND, [7, 8, 9], [rows[0]], [fb.seq_lens_cpu[0]], placeholder,
                                extend_seq_lens=[3])
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.inference_mode():
            runner.attn_backend.init_forward_metadata(extend)
            runner.attn_backend.init_forward_metadata(fb)
            graphs.replay(fb)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
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


@pytest.mark.parametrize("model", ["smollm2-135m", "llama-3.2-1b"])
def test_fp8_pool_attention_applies_each_layers_scales(model):
    """flashinfer's decode and extend over an FP8 pool whose layer 0 has k_scale 0.5 and v_scale 2.0 (the pool
    holds K / 0.5 and V / 2.0), against float attention over the pool's values times the scales: dropping
    either scale moves the output by about its own size (scores x2 or output x0.5)."""
    runner = make_runner(model, "fp8_e4m3")
    kv = runner.kv_cache
    kv.k_scales[0], kv.v_scales[0] = 0.5, 2.0
    layer = next(m for m in runner.model.modules() if isinstance(m, RadixAttention) and m.layer_id == 0)
    hq, hk, d = layer.num_heads, layer.num_kv_heads, layer.head_dim
    g = torch.Generator(device="cuda").manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=g, device="cuda", dtype=torch.bfloat16)

    def pool_kv(row: int, n: int):
        slots = runner.req_to_token_pool.req_to_token[row, :n].long()
        k_buf, v_buf = kv.get_kv(0)
        return k_buf[slots].float() * 0.5, v_buf[slots].float() * 2.0  # [n, Hk, D]

    prefixes, new = [37, 5, 120], 9
    rows = [runner.req_to_token_pool.alloc() for _ in prefixes]
    for row, n in zip(rows, prefixes):
        loc = runner.allocator.alloc(n + new + 1)
        runner.req_to_token_pool.write(row, 0, loc)
        kv.set_kv(0, loc[:n].cuda(), rand(n, hk, d), rand(n, hk, d))
    seq = [n + new for n in prefixes]
    out_loc = torch.cat([runner.req_to_token_pool.slots(row, s)[n:] for row, n, s in zip(rows, prefixes, seq)])
    fb = runner.build_batch(ForwardMode.EXTEND, [1] * new * len(rows), rows, seq, out_loc,
                            extend_seq_lens=[new] * len(rows))
    q, k, v = rand(new * len(rows), hq * d), rand(new * len(rows), hk * d), rand(new * len(rows), hk * d)
    with torch.inference_mode():
        runner.attn_backend.init_forward_metadata(fb)
        out = runner.attn_backend.forward(q, k, v, layer, fb).float()
        ref = []
        for i, (row, n) in enumerate(zip(rows, prefixes)):
            kr, vr = pool_kv(row, n + new)
            qi = q[i * new : (i + 1) * new].float().view(new, hq, d).transpose(0, 1)[None]
            o = _causal_attention(qi, kr.transpose(0, 1)[None], vr.transpose(0, 1)[None], n, layer.scaling)
            ref.append(o[0].transpose(0, 1).reshape(new, hq * d))
        ref = torch.cat(ref)
    extend_err = ((out - ref).norm() / ref.norm()).item()

    seq = [s + 1 for s in seq]
    loc = torch.stack([runner.req_to_token_pool.slots(row, s)[-1] for row, s in zip(rows, seq)])
    fb = runner.build_batch(ForwardMode.DECODE, [1] * len(rows), rows, seq, loc)
    q, k, v = rand(len(rows), hq * d), rand(len(rows), hk * d), rand(len(rows), hk * d)
    with torch.inference_mode():
        runner.attn_backend.init_forward_metadata(fb)
        out = runner.attn_backend.forward(q, k, v, layer, fb).float()
        ref = []
        for i, (row, s) in enumerate(zip(rows, seq)):
            kr, vr = pool_kv(row, s)
            qi = q[i].float().view(hq, 1, d)[None]
            o = torch.nn.functional.scaled_dot_product_attention(
                qi, kr.transpose(0, 1)[None], vr.transpose(0, 1)[None], scale=layer.scaling, enable_gqa=True)
            ref.append(o.reshape(hq * d))
        ref = torch.stack(ref)
    decode_err = ((out - ref).norm() / ref.norm()).item()
    print(f"\n{model} flashinfer FP8 pool (k_scale 0.5, v_scale 2.0) vs float attention: relative error "
          f"extend {extend_err:.2e}, decode {decode_err:.2e}")
    assert extend_err < 2e-2 and decode_err < 2e-2

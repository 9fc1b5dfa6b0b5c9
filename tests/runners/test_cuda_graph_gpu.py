"""Decode CUDA graphs on the GPU: replay equals eager at every size of the default capture list and at padded
sizes between them, with short prompts (the triton backend's single-stage decode graphs) and long ones (its
split graphs, at the sizes that split); the shared pool. Qwen3 (Qwen3-30B-A3B's layer shapes, bf16 and FP8
KV pools): the per-head q/k norms, rotary and KV store run as one kernel per layer in the decode graph, the
graph equals eager and the fused step equals the unfused one (qk_norm_rope's kernel, then the store)."""

from __future__ import annotations

import pytest
import torch

from model_executor.configs import shape_path
from runners.capture_lists import get_batch_sizes_to_capture, pick_size
from runners.cuda_graph_runner import CudaGraphRunner
from runners.graph_seam import CudaGraphCapturer
from runners.model_runner import ModelRunner, RunnerConfig

pytestmark = pytest.mark.gpu

SIZES = get_batch_sizes_to_capture(256)  # the default list on an 80+ GiB GPU
PADDED = [3, 5, 13, 31, 100, 255]  # between captured sizes: padding rows
# Prompt lengths: short batches take the single-stage decode graph; long ones (over the backend's
# single_stage_max_len) the split graph at the sizes where the split cap is above 1 (smaller batches).
PROMPTS = {"short": (2, 30), "long": (130, 300)}
LONG_SIZES = [s for s in SIZES if s <= 32] + [3, 5, 13, 31]
CASES = [(bs, "short") for bs in SIZES + PADDED] + [(bs, "long") for bs in LONG_SIZES]


@pytest.fixture(scope="module")
def runner():
    # Rows and slots for the largest batch (prompts under 30 tokens) with room to spare.
    cfg = RunnerConfig(model_path=str(shape_path("smollm2-135m")), device="cuda", attention_backend="triton",
                       max_running_requests=SIZES[-1] + 8, max_total_tokens=(SIZES[-1] + 8) * 64,
                       context_length=512, random_weights=True, disable_cuda_graph=True,
                       disable_piecewise_cuda_graph=True)
    return ModelRunner(cfg)


@pytest.fixture(scope="module")
def graph_runner(runner):
    return CudaGraphRunner(runner, SIZES)


@pytest.fixture
def decode_batch(runner):
    """make(bs, seed) -> (decode batch, its KV slots); rows and slots go back even when the test fails."""
    from tests.runners.test_cuda_graph_runner import make_decode_batch, release

    made = []

    def make(bs, seed, **kw):
        fb, rows, loc = make_decode_batch(runner, bs, seed, **kw)
        made.append((rows, fb))
        return fb, loc

    yield make
    for rows, fb in made:
        release(runner, rows, fb)


def _kv(runner) -> list[torch.Tensor]:
    return [buf.clone() for buf in runner.kv_cache.k_buffers + runner.kv_cache.v_buffers]


@pytest.mark.parametrize("bs,prompts", CASES)
def test_graph_replay_equals_eager(runner, graph_runner, decode_batch, bs, prompts):
    low, high = PROMPTS[prompts]
    fb, loc = decode_batch(bs, seed=100 + bs, min_prompt=low, max_prompt=high)
    with torch.inference_mode():
        kv_before = _kv(runner)
        eager = runner.forward_eager(fb).clone()
        kv_eager = _kv(runner)
        graphed = graph_runner.replay(fb).clone()
    # Eager runs bs rows, the graph the padded size: bfloat16 GEMMs may pick other kernels and round apart.
    torch.testing.assert_close(graphed, eager, rtol=2e-2, atol=2e-2)
    # The plan the replay picked its graph by: single stage for short batches, else the padded size's cap.
    backend = runner.attn_backend
    assert backend._decode_splits[1] == (1 if prompts == "short" else backend.split_cap(pick_size(SIZES, bs)))
    real = loc.to(runner.device)
    untouched = torch.ones(kv_before[0].shape[0], dtype=torch.bool, device=runner.device)
    untouched[real] = False
    untouched[0] = False  # padding rows write slot 0
    for after, ref, before in zip(_kv(runner), kv_eager, kv_before):
        torch.testing.assert_close(after[real], ref[real], rtol=2e-2, atol=2e-2)
        assert torch.equal(after[untouched], before[untouched])


def test_shared_pool_memory(runner):
    sizes = get_batch_sizes_to_capture(64)
    shared = CudaGraphRunner(runner, sizes)
    largest_alone = CudaGraphRunner(runner, [sizes[-1]])
    private_total = 0
    for bs in sizes[-4:]:  # a private pool each, a few sizes suffice to show the difference
        private_total += CudaGraphRunner(runner, [bs], capturer=CudaGraphCapturer(runner.device)).capture_bytes
    print(f"\nshared pool, {len(sizes)} graphs: {shared.capture_bytes / 2**20:.1f} MiB; largest alone: "
          f"{largest_alone.capture_bytes / 2**20:.1f} MiB; private pools for the 4 largest: "
          f"{private_total / 2**20:.1f} MiB")
    # One pool: all sizes cost about what the largest costs alone. Not exactly: since each size has two graphs
    # (a split-KV and a single-stage attention plan) the pool fragments a little (74.0 vs 56.0 MiB measured on
    # the H200, 2026-12-01); a private pool per graph costs the sum (218 MiB for just the 4 largest).
    assert shared.capture_bytes <= 1.5 * max(largest_alone.capture_bytes, 2 << 20)
    assert shared.capture_bytes < private_total / 2


# ---------------------------------------------------------------- Qwen3: q/k norms + rotary + KV store, one kernel

QWEN3_LAYERS = 4  # of Qwen3-30B-A3B's 48 identical layers: memory and capture time stay small
QWEN3_SIZES = [1, 2, 4, 8, 16]
# An FP8 pool stores K / 0.5 and V / 2 here (random weights give no checkpoint scales): the kernel's division.
QWEN3_FP8_SCALES = (0.5, 2.0)


@pytest.fixture(scope="module", params=["auto", "fp8_e4m3"], ids=["bf16_kv", "fp8_kv"])
def qwen3(tmp_path_factory, request):
    from tests.kernels.test_moe_gpu import qwen3_moe_path

    path = qwen3_moe_path(tmp_path_factory, QWEN3_LAYERS)
    runner = ModelRunner(RunnerConfig(model_path=str(path), device="cuda", attention_backend="triton",
                                      max_running_requests=24, max_total_tokens=24 * 64, context_length=512,
                                      random_weights=True, kv_cache_dtype=request.param, disable_cuda_graph=True,
                                      disable_piecewise_cuda_graph=True))
    if request.param == "fp8_e4m3":  # (set before the capture: a graph bakes the scales in)
        runner.kv_cache.k_scales = [QWEN3_FP8_SCALES[0]] * QWEN3_LAYERS
        runner.kv_cache.v_scales = [QWEN3_FP8_SCALES[1]] * QWEN3_LAYERS
    return runner, CudaGraphRunner(runner, QWEN3_SIZES)


def _stored_kv(runner, loc) -> list[torch.Tensor]:
    """Every layer's K and V at the slots loc, as float32 (FP8 rows gathered as bytes)."""
    bufs = runner.kv_cache.k_buffers + runner.kv_cache.v_buffers
    if runner.kv_cache.dtype == torch.float8_e4m3fn:
        return [buf.view(torch.uint8)[loc].view(buf.dtype).float() for buf in bufs]
    return [buf[loc].float() for buf in bufs]


def _kv_tol(runner) -> dict:
    # bf16: a rounding step or two; FP8: one e4m3 step (1/8 relative) where the inputs differ by a bf16 step
    return {"rtol": 0.13, "atol": 2**-6} if runner.kv_cache.dtype == torch.float8_e4m3fn else {"rtol": 2e-2,
                                                                                                 "atol": 2e-2}


@pytest.mark.parametrize("bs", QWEN3_SIZES + [3, 13])
def test_qwen3_graph_replay_equals_eager(qwen3, bs):
    from tests.kernels.test_moe_gpu import assert_close_rows
    from tests.runners.test_cuda_graph_runner import make_decode_batch, release

    runner, graph_runner = qwen3
    fb, rows, loc = make_decode_batch(runner, bs, seed=300 + bs)
    real = loc.to(runner.device)
    try:
        with torch.inference_mode():
            eager = runner.forward_eager(fb).clone()
            kv_eager = _stored_kv(runner, real)
            graphed = graph_runner.replay(fb).clone()
            kv_graph = _stored_kv(runner, real)
        assert torch.isfinite(graphed).all()
        assert_close_rows(graphed, eager)  # (MoE routing near-ties: see test_moe_gpu.py)
        # layer 0's K and V come from the embeddings through one GEMM: no routing in between
        for layer in (0, QWEN3_LAYERS):
            torch.testing.assert_close(kv_graph[layer], kv_eager[layer], **_kv_tol(runner))
    finally:
        release(runner, rows, fb)


def test_qwen3_fused_decode_equals_unfused(qwen3, monkeypatch):
    """The fused decode step against the path it replaces, on the same backend: qk_norm_rope's kernel, then
    KVCache.set_kv (scales included) and the same attention kernels."""
    from tests.kernels.test_moe_gpu import assert_close_rows
    from tests.runners.test_cuda_graph_runner import make_decode_batch, release

    runner, _ = qwen3
    fb, rows, loc = make_decode_batch(runner, 8, seed=400)
    real = loc.to(runner.device)
    try:
        with torch.inference_mode():
            fused = runner.forward_eager(fb).clone()
            kv_fused = _stored_kv(runner, real)
            monkeypatch.setattr(runner.attn_backend, "fuses_rotary", lambda fb: False)
            unfused = runner.forward_eager(fb).clone()
            kv_unfused = _stored_kv(runner, real)
        assert_close_rows(fused, unfused)
        for layer in (0, QWEN3_LAYERS):
            torch.testing.assert_close(kv_fused[layer], kv_unfused[layer], **_kv_tol(runner))
            # the same float32 arithmetic as qk_norm_rope's kernel: nearly bit-identical (a wrong weight, eps or
            # scale changes nearly every value)
            assert (kv_fused[layer] != kv_unfused[layer]).float().mean().item() < 0.1
    finally:
        release(runner, rows, fb)


def test_qwen3_decode_graph_runs_one_norm_rope_store_kernel_per_layer(qwen3):
    from tests.runners.test_cuda_graph_runner import make_decode_batch, release

    runner, graph_runner = qwen3
    fb, rows, _ = make_decode_batch(runner, 1, seed=500)
    try:
        with torch.inference_mode():
            graph_runner.replay(fb)
            torch.cuda.synchronize()
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                graph_runner.replay(fb)
                torch.cuda.synchronize()
    finally:
        release(runner, rows, fb)
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    if not names:
        pytest.skip("the profiler sees no CUDA kernels here (no CUPTI?)")
    assert names.count("_rotary_store_kv_kernel") == QWEN3_LAYERS, sorted(set(names))
    assert "_qk_norm_rope_kernel" not in names and "_store_kv_kernel" not in names, sorted(set(names))

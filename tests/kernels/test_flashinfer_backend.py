"""The flashinfer backend's plans and runs on the CPU, over an FP8 and a bf16 pool: which dtypes it plans,
which prefill kernels it asks for, and the per-layer KV scales each run gets. flashinfer is replaced by a
stand-in module that records its calls (the real kernels run in tests/kernels/test_flashinfer_gpu.py)."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from model_executor.forward_batch import ForwardBatch, ForwardMode
from model_executor.layers.attention.flashinfer_backend import FlashInferAttnBackend
from model_executor.layers.attention.radix_attention import RadixAttention
from model_executor.memory_pool import KVCache, ReqToTokenPool

FP8 = torch.float8_e4m3fn
HEADS, KV_HEADS, HEAD_DIM, LAYERS = 4, 2, 8, 2
K_SCALES, V_SCALES = [0.5, 2.0], [1.0, 4.0]


class FakeWrapper:
    """Records plan(...) and run(...) calls of one flashinfer wrapper."""

    def __init__(self, calls: list, kind: str, *args, **kwargs):
        self.calls, self.kind = calls, kind
        calls.append((kind, "init", args, kwargs))

    def plan(self, *args, **kwargs):
        self.calls.append((self.kind, "plan", args, kwargs))

    def run(self, q, paged, **kwargs):
        self.calls.append((self.kind, "run", (q, paged), kwargs))
        kwargs["out"].zero_()


def fake_flashinfer() -> tuple[types.ModuleType, list]:
    calls: list = []
    mod = types.ModuleType("flashinfer")
    mod.BatchDecodeWithPagedKVCacheWrapper = lambda *a, **k: FakeWrapper(calls, "decode", *a, **k)
    mod.BatchPrefillWithPagedKVCacheWrapper = lambda *a, **k: FakeWrapper(calls, "prefill", *a, **k)
    return mod, calls


def layers(windows=(None,) * LAYERS, scale: float = HEAD_DIM**-0.5) -> torch.nn.ModuleList:
    """A stand-in model: its attention layers, of these windows, at this softmax scale."""
    return torch.nn.ModuleList(RadixAttention(i, HEADS, KV_HEADS, HEAD_DIM, scale, sliding_window=w)
                               for i, w in enumerate(windows))


def make_backend(monkeypatch, kv_dtype: torch.dtype):
    mod, calls = fake_flashinfer()
    monkeypatch.setitem(sys.modules, "flashinfer", mod)
    pool = ReqToTokenPool(4, 32, "cpu")
    config = types.SimpleNamespace(num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM)
    runner = types.SimpleNamespace(model_config=config, dtype=torch.bfloat16, kv_dtype=kv_dtype,
                                   device=torch.device("cpu"), req_to_token_pool=pool, model=layers())
    backend = FlashInferAttnBackend(runner)
    fp8 = kv_dtype == FP8
    kv = KVCache(64, LAYERS, KV_HEADS, HEAD_DIM, kv_dtype, "cpu", K_SCALES if fp8 else None,
                 V_SCALES if fp8 else None)
    return backend, calls, pool, kv


SLOTS = {0: list(range(1, 11)), 1: list(range(30, 36))}  # request -> its KV slots (10 and 6 tokens)


def batch(mode: ForwardMode, backend, pool, kv) -> ForwardBatch:
    """Two requests, 10 and 6 tokens long, in rows allocated after a spare one (so rows are not 0, 1); an
    extend's last 4 and 2 of them new."""
    pool.alloc()
    rows = [pool.alloc() for _ in SLOTS]
    for row, slots in zip(rows, SLOTS.values()):
        pool.write(row, 0, torch.tensor(slots))
    ext = None if mode.is_decode() else [4, 2]
    new = [1, 1] if ext is None else ext
    loc = torch.tensor([t for n, slots in zip(new, SLOTS.values()) for t in slots[-n:]])
    return ForwardBatch.build(mode, list(range(len(loc))), rows, [10, 6], loc, extend_seq_lens=ext,
                              req_to_token_pool=pool, kv_cache=kv, attn_backend=backend, device="cpu")


def test_plans_list_each_requests_slots_from_host_lengths(monkeypatch):
    backend, calls, pool, kv = make_backend(monkeypatch, torch.bfloat16)
    for mode, kind in ((ForwardMode.DECODE, "decode"), (ForwardMode.EXTEND, "prefill")):
        backend.init_forward_metadata(batch(mode, backend, pool, kv))
        args = [c for c in calls if c[:2] == (kind, "plan")][-1][2]
        if kind == "prefill":
            assert args[0].tolist() == [0, 4, 6]  # qo_indptr
            args = args[1:]
        indptr, indices, last = args[:3]
        assert indptr.tolist() == [0, 10, 16] and last.tolist() == [1, 1]
        assert indices.tolist() == SLOTS[0] + SLOTS[1]
        for row in (1, 2, 3):  # the spare row and the batch's two
            pool.free(row)


def attend(backend, fb: ForwardBatch) -> None:
    n = fb.input_ids.shape[0]
    for layer in layers():
        q = torch.randn(n, HEADS * HEAD_DIM, dtype=torch.bfloat16)
        k = torch.randn(n, KV_HEADS * HEAD_DIM, dtype=torch.bfloat16)
        backend.forward(q, k, k.clone(), layer, fb)


@pytest.mark.parametrize("mode", [ForwardMode.DECODE, ForwardMode.EXTEND])
def test_fp8_pool_plans_fp8_and_runs_with_each_layers_scales(monkeypatch, mode):
    backend, calls, pool, kv = make_backend(monkeypatch, FP8)
    kind = "decode" if mode.is_decode() else "prefill"
    fb = batch(mode, backend, pool, kv)
    backend.init_forward_metadata(fb)
    attend(backend, fb)
    prefill_init = [c for c in calls if c[:2] == ("prefill", "init")]
    assert prefill_init[0][3]["backend"] == "fa2"  # FA3 (Hopper) needs Q and K of one type
    plans = [c for c in calls if c[:2] == (kind, "plan")]
    assert len(plans) == 1
    assert plans[0][3]["q_data_type"] == torch.bfloat16 and plans[0][3]["kv_data_type"] == FP8
    runs = [c for c in calls if c[:2] == (kind, "run")]
    assert [r[3]["k_scale"] for r in runs] == K_SCALES
    assert [r[3]["v_scale"] for r in runs] == [None, 4.0]  # 1.0 is not passed (flashinfer would multiply)
    assert all(r[2][1][0].dtype == FP8 for r in runs)  # the paged K it reads is the pool's


@pytest.mark.parametrize("mode", [ForwardMode.DECODE, ForwardMode.EXTEND])
def test_bf16_pool_plans_bf16_without_scales(monkeypatch, mode):
    backend, calls, pool, kv = make_backend(monkeypatch, torch.bfloat16)
    kind = "decode" if mode.is_decode() else "prefill"
    fb = batch(mode, backend, pool, kv)
    backend.init_forward_metadata(fb)
    attend(backend, fb)
    assert next(c for c in calls if c[:2] == ("prefill", "init"))[3]["backend"] == "auto"
    plan = next(c for c in calls if c[:2] == (kind, "plan"))
    assert plan[3]["kv_data_type"] == torch.bfloat16
    runs = [c for c in calls if c[:2] == (kind, "run")]
    assert len(runs) == LAYERS and all(set(r[3]) == {"out"} for r in runs)


@pytest.mark.parametrize("mode", [ForwardMode.DECODE, ForwardMode.EXTEND])
def test_sliding_window_layers_plan_and_run_their_own_wrapper(monkeypatch, mode):
    """A model with a window on layer 0 and full attention on layer 1, at a softmax scale other than
    1 / sqrt(head_dim) (Gemma 3's query_pre_attn_scalar): one wrapper per window, planned with window_left =
    W - 1 (none for the full one) and the layers' scale, and each layer runs the wrapper of its window."""
    mod, calls = fake_flashinfer()
    monkeypatch.setitem(sys.modules, "flashinfer", mod)
    pool = ReqToTokenPool(4, 32, "cpu")
    config = types.SimpleNamespace(num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM)
    scale = 24**-0.5
    model = layers(windows=(4, None), scale=scale)
    runner = types.SimpleNamespace(model_config=config, dtype=torch.bfloat16, kv_dtype=torch.bfloat16,
                                   device=torch.device("cpu"), req_to_token_pool=pool, model=model)
    backend = FlashInferAttnBackend(runner)
    kv = KVCache(64, LAYERS, KV_HEADS, HEAD_DIM, torch.bfloat16, "cpu", None, None)
    kind = "decode" if mode.is_decode() else "prefill"
    wrappers = backend.decode_wrappers if mode.is_decode() else backend.prefill_wrappers
    assert sorted(wrappers) == [(-1, scale), (3, scale)]
    fb = batch(mode, backend, pool, kv)
    backend.init_forward_metadata(fb)
    plans = [c for c in calls if c[:2] == (kind, "plan")]
    assert sorted(p[3].get("window_left", -1) for p in plans) == [-1, 3]
    assert [p[3]["sm_scale"] for p in plans] == [scale, scale]
    ran = []
    for w in wrappers.values():
        w.run = lambda q, paged, _w=w, **kw: (ran.append(_w), kw["out"].zero_())
    n = fb.input_ids.shape[0]
    for layer in model:
        q = torch.randn(n, HEADS * HEAD_DIM, dtype=torch.bfloat16)
        k = torch.randn(n, KV_HEADS * HEAD_DIM, dtype=torch.bfloat16)
        backend.forward(q, k, k.clone(), layer, fb)
    assert ran == [wrappers[3, scale], wrappers[-1, scale]]


def test_decode_graph_hooks_plan_every_windows_wrapper_at_replay(monkeypatch):
    """Decode graphs: a capture makes one CUDA-graph wrapper per window and scale over the shared index buffers,
    and each replay plans all of them again from the replayed batch (window_left, the scale and its lengths),
    so that the windowed and the global layers both read the batch's KV; each layer runs its own."""
    mod, calls = fake_flashinfer()
    monkeypatch.setitem(sys.modules, "flashinfer", mod)
    pool = ReqToTokenPool(4, 32, "cpu")
    config = types.SimpleNamespace(num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM)
    scale = 24**-0.5
    model = layers(windows=(4, None), scale=scale)
    runner = types.SimpleNamespace(model_config=config, dtype=torch.bfloat16, kv_dtype=torch.bfloat16,
                                   device=torch.device("cpu"), req_to_token_pool=pool, model=model)
    backend = FlashInferAttnBackend(runner)
    kv = KVCache(64, LAYERS, KV_HEADS, HEAD_DIM, torch.bfloat16, "cpu", None, None)
    backend.init_cuda_graph_state(2)
    fb = batch(ForwardMode.DECODE, backend, pool, kv)
    backend.init_forward_metadata_capture_cuda_graph(fb)
    graph_inits = [c for c in calls if c[:2] == ("decode", "init") and c[3].get("use_cuda_graph")]
    assert len(graph_inits) == 2
    assert all(c[3]["paged_kv_indices_buffer"] is backend.graph_indices for c in graph_inits)
    wrappers = backend.graph_wrappers[2]
    assert sorted(wrappers) == [(-1, scale), (3, scale)]
    del calls[:]
    backend.init_forward_metadata_replay_cuda_graph(fb)
    plans = [c for c in calls if c[:2] == ("decode", "plan")]
    assert sorted((p[3].get("window_left", -1), p[3]["sm_scale"]) for p in plans) == [(-1, scale), (3, scale)]
    assert all(p[2][0].tolist() == [0, 10, 16] for p in plans)  # the replayed batch's lengths
    ran = []
    for w in wrappers.values():
        w.run = lambda q, paged, _w=w, **kw: (ran.append(_w), kw["out"].zero_())
    for layer in model:
        q = torch.randn(2, HEADS * HEAD_DIM, dtype=torch.bfloat16)
        k = torch.randn(2, KV_HEADS * HEAD_DIM, dtype=torch.bfloat16)
        backend.forward(q, k, k.clone(), layer, fb)
    assert ran == [wrappers[3, scale], wrappers[-1, scale]]

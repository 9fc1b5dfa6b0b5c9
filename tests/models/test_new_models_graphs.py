"""Graph replay equals eager for the windowed and sink models: Gemma 3 (local, local, global, window 8), gpt-oss
(window 8 on alternate layers, sinks), Phi-3 (window 8, partial LongRoPE) and a Mistral with window 8, on the
tiny HF checkpoints their CPU tests save. Mixed batches whose requests are longer than the window, with cached
prefixes past it, run through the decode graph runner (at a captured and at a padded size, and on the split
decode kernel), the piecewise extend runner and the whole-backbone extend runner; each replay's logits and the
K/V it stores equal the eager forward's on the same batch, and no other slot is written. A window or a sink a
graph bakes in wrongly (a layer's window read from host state at capture, a length bound that cuts the window)
shows as a difference here.

Two modes. On the CPU (in CI): the stand-in capturer, which replays with the static batch's and the backend's
host state frozen at capture as a CUDA graph would, and the triton backend's kernels in Triton's interpreter
(tests/triton_mode.py). On CUDA (`-m gpu`): the real capturers, the triton backend (float32) and the flashinfer
backend (bfloat16; decode graphs and piecewise extends: it runs extend attention outside graphs, and refuses
sinks, so not gpt-oss). The eager forward of each backend is also held to the torch_native one (the reference
the HF comparisons use): a wrong window or rotary in eager would otherwise be replayed faithfully.

Run on a GPU: pytest -m gpu tests/models/test_new_models_graphs.py
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from model_executor.forward_batch import ForwardMode
from model_executor.layers.attention.torch_native import TorchNativeBackend
from model_executor.layers.attention.triton_backend import TritonAttnBackend
from runners import cuda_graph_runner, full_extend_graph_runner
from runners.cuda_graph_runner import CudaGraphRunner
from runners.full_extend_graph_runner import FullExtendGraphRunner
from runners.graph_seam import StandInCapturer
from runners.model_runner import ModelRunner, RunnerConfig
from runners.piecewise_cuda_graph_runner import PiecewiseCudaGraphRunner
from tests import triton_mode
from tests.conftest import save_tiny_hf_model
from tests.models.test_gpt_oss import save_tiny_gpt_oss
from tests.models.test_sliding_window_models import CONFIGS as WINDOWED_CONFIGS
from tests.runners.test_piecewise_runner import make_extend_batch, release
from tests.triton_mode import HAS_CUDA

test_in_subprocess = triton_mode.subprocess_test(__file__, "-k", "cpu")

MODELS = ["gemma3", "gpt_oss", "phi3", "mistral"]
WINDOW = 8
CONTEXT = 128  # (two decode splits at most: a request of over 64 tokens takes both)
DECODE_SIZES = [1, 4]
EXTEND_LEVELS = [8, 32]
FULL_MAX_REQUESTS = 3

# mode: (device, backend, dtype, logits tolerance of a replay against eager, and of eager against torch_native).
# The CPU mode runs only where the kernels run in the interpreter: on a CUDA host (compiled Triton takes no CPU
# tensors) the cuda modes run them on the device. On the GPU a replay runs the GEMMs at the padded size and the
# attention kernels' float32 dots in tf32x3; bfloat16 rounds both paths on their own.
MODES = {
    "cpu": ("cpu", "triton", "float32", 1e-4, 1e-4),
    "cuda_triton": ("cuda", "triton", "float32", 2e-3, 1e-2),
    "cuda_flashinfer": ("cuda", "flashinfer", "bfloat16", 3e-2, 5e-2),
}
# flashinfer does not take attention sinks (the backend refuses gpt-oss: tests/models/test_gpt_oss.py)
UNSUPPORTED = {("gpt_oss", "cuda_flashinfer")}
PAIRS = [(model, mode) for mode in MODES for model in MODELS if (model, mode) not in UNSUPPORTED]


def _marks(mode: str) -> list:
    return [pytest.mark.triton_mode] if mode == "cpu" else [pytest.mark.gpu]


CASES = [pytest.param(model, mode, id=f"{model}-{mode}", marks=_marks(mode)) for model, mode in PAIRS]
# flashinfer runs extend attention outside graphs: pieces only, no whole-backbone graphs
EXTEND_PARAMS = [pytest.param(model, mode, kind, id=f"{model}-{mode}-{kind}", marks=_marks(mode))
                 for model, mode in PAIRS for kind in ("piecewise", "full")
                 if not (kind == "full" and MODES[mode][1] == "flashinfer")]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    made = {}

    def get(name: str):
        if name not in made:
            path = tmp_path_factory.mktemp(name)
            if name == "gpt_oss":
                save_tiny_gpt_oss(path)
            else:
                save_tiny_hf_model(path, WINDOWED_CONFIGS[name], seed=len(name))
            made[name] = path
        return made[name]

    return get


def _check_mode(mode: str) -> None:
    if MODES[mode][1] == "flashinfer":
        pytest.importorskip("flashinfer")  # (an optional extra, as in tests/kernels/test_flashinfer_gpu.py)
    if mode != "cpu":
        return
    if HAS_CUDA:
        pytest.skip("CPU tensors through Triton's interpreter: interpreter only (the cuda modes run on the device)")
    if triton_mode.RERUN_IN_SUBPROCESS:
        pytest.skip("triton was imported compiled before TRITON_INTERPRET=1: re-run in a subprocess")


def make_runner(path, mode: str) -> ModelRunner:
    """The tiny model on the mode's device and backend, without graphs (the tests build the graph runners). The
    product refuses triton without CUDA, so on the CPU the triton backend is swapped in after loading."""
    device, backend, dtype, _, _ = MODES[mode]
    on_cpu = device == "cpu"
    runner = ModelRunner(RunnerConfig(model_path=str(path), device=device, dtype=dtype,
                                      attention_backend="torch_native" if on_cpu else backend,
                                      max_running_requests=8, max_total_tokens=1024, context_length=CONTEXT,
                                      disable_cuda_graph=True, disable_piecewise_cuda_graph=True))
    if on_cpu:
        runner.attn_backend = TritonAttnBackend(runner)
    backend = runner.attn_backend
    if isinstance(backend, TritonAttnBackend):
        # Batches with a request over 8 tokens take the split decode kernel (and its merge, where the sinks
        # join) at the sizes that can split, as requests over 128 tokens do with the default; in the interpreter
        # a GPU of 8 SMs, so that size 4 splits too (its merge is a second kernel, size 1's is fused).
        backend.single_stage_max_len = WINDOW
        if on_cpu:
            backend.num_sms = 8
    return runner


def capturer_for(mode: str):
    return StandInCapturer() if mode == "cpu" else None  # None: the device's (CUDA graphs)


@contextlib.contextmanager
def warm_up_for(mode: str):
    """The stand-in's capture runs the forward once as it is: the warm-up runs before it (for the allocator
    and kernel compiles of a real capture) only cost interpreter time there, so the CPU mode skips them."""
    with pytest.MonkeyPatch.context() as mp:
        if mode == "cpu":
            mp.setattr(cuda_graph_runner, "WARMUP_RUNS", 0)
            mp.setattr(full_extend_graph_runner, "WARMUP_RUNS", 0)
        yield


@pytest.fixture(scope="module")
def runners(checkpoint):
    """(model, mode) -> (runner, its decode graph runner), built once per module."""
    made = {}

    def get(name: str, mode: str):
        if (name, mode) not in made:
            runner = make_runner(checkpoint(name), mode)
            with warm_up_for(mode):
                made[name, mode] = runner, CudaGraphRunner(runner, DECODE_SIZES, capturer=capturer_for(mode))
        return made[name, mode]

    yield get
    made.clear()
    if HAS_CUDA:
        torch.cuda.empty_cache()


@pytest.fixture(autouse=True, scope="module")
def fresh_dynamo():
    # Each piecewise runner adds a cache entry on its traced function; start and leave the cache empty.
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _kv(runner) -> list[torch.Tensor]:
    return [buf.clone() for buf in runner.kv_cache.k_buffers + runner.kv_cache.v_buffers]


def _close(actual: torch.Tensor, expected: torch.Tensor, tol: float, what: str) -> None:
    torch.testing.assert_close(actual.float(), expected.float(), rtol=tol, atol=tol, msg=lambda m: f"{what}: {m}")


def assert_replay_equals_eager(runner, replay, fb, slots, tol: float, padding_slot: bool) -> None:
    """replay(fb) against the eager forward of fb: logits within tol, the K/V stored at `slots` (the batch's
    new tokens) equal in every layer, no other slot written (slot 0 too where padding rows write it)."""
    kv_before = _kv(runner)
    eager = runner.forward_eager(fb).clone()
    kv_eager = _kv(runner)
    real = slots.to(runner.device)
    for buf in runner.kv_cache.k_buffers + runner.kv_cache.v_buffers:
        buf[real] = float("nan")  # the replay must write them again
    graphed = replay(fb).clone()
    assert graphed.shape == eager.shape
    _close(graphed, eager, tol, "logits")
    untouched = torch.ones(kv_before[0].shape[0], dtype=torch.bool, device=runner.device)
    untouched[real] = False
    if padding_slot:
        untouched[0] = False
    kv_tol = min(tol, 1e-5) if runner.device.type == "cpu" else tol
    for i, (after, ref, before) in enumerate(zip(_kv(runner), kv_eager, kv_before)):
        _close(after[real], ref[real], kv_tol, f"K/V buffer {i}")
        assert torch.equal(after[untouched], before[untouched]), f"K/V buffer {i}: a slot outside the batch written"


def assert_eager_equals_reference(runner, fb, tol: float) -> None:
    """The backend's eager forward of fb against torch_native's (unfused rotary, masks from host lengths) on the
    same KV: logits within tol. Leaves the batch's K/V as the backend stored them."""
    backend = runner.attn_backend
    fb.attn_backend = TorchNativeBackend()
    try:
        fb.attn_backend.init_forward_metadata(fb)
        reference = runner.model(fb.input_ids, fb.positions, fb).clone()
    finally:
        fb.attn_backend = backend
    _close(runner.forward_eager(fb), reference, tol, "eager against torch_native")


# ---------------------------------------------------------------- decode graphs

# batch size -> prompt lengths: each longer than the window but one (so that its decode steps pass it); the
# request of 70 tokens takes both splits in the global layers (the windowed ones keep 8 positions: one chunk)
DECODE_PROMPTS = {1: [70], 3: [19, 3, 12]}


def _prefill(runner, prompt_lens: list[int], seed: int, decode_steps: int):
    """Requests with random prompts prefilled eagerly in one extend batch, with slots reserved for
    decode_steps more tokens. Returns (rows, slots per request, last token ids)."""
    g = torch.Generator().manual_seed(seed)
    rows, slots, prompts = [], [], []
    for n in prompt_lens:
        prompts.append(torch.randint(3, 320, (n,), generator=g).tolist())
        rows.append(runner.req_to_token_pool.alloc())
        slots.append(runner.allocator.alloc(n + decode_steps))
        runner.req_to_token_pool.write(rows[-1], 0, slots[-1])
    runner.forward_eager(runner.build_batch(ForwardMode.EXTEND, [t for p in prompts for t in p], rows, prompt_lens,
                                            torch.cat([s[:n] for s, n in zip(slots, prompt_lens)]),
                                            extend_seq_lens=prompt_lens))
    return rows, slots, [p[-1] for p in prompts]


@pytest.mark.parametrize("bs", sorted(DECODE_PROMPTS))
@pytest.mark.parametrize("name,mode", CASES)
def test_decode_replay_equals_eager(runners, name, mode, bs):
    """Two decode steps of a batch at a captured size (1) or padded to one (3 -> 4), past the window, on the split
    kernel (two splits and their merge, where the sinks join: fused into stage 1 at size 1, stage 2 at 4)."""
    _check_mode(mode)
    runner, graphs = runners(name, mode)
    tol, ref_tol = MODES[mode][3:]
    prompt_lens = DECODE_PROMPTS[bs]
    steps = 2
    rows, slots, last = _prefill(runner, prompt_lens, seed=bs, decode_steps=steps)
    try:
        for step in range(steps):
            seq_lens = [n + step + 1 for n in prompt_lens]
            loc = torch.stack([s[n - 1] for s, n in zip(slots, seq_lens)])
            fb = runner.build_batch(ForwardMode.DECODE, last, rows, seq_lens, loc)
            assert graphs.can_run(fb)
            if step == 0:
                assert_eager_equals_reference(runner, fb, ref_tol)
                if isinstance(runner.attn_backend, TritonAttnBackend):
                    assert runner.attn_backend.decode_splits(fb) > 1  # the split kernel and its merge
            assert_replay_equals_eager(runner, graphs.replay, fb, loc, tol, padding_slot=True)
            last = runner.forward_eager(fb).argmax(-1).tolist()
    finally:
        for row, s in zip(rows, slots):
            runner.allocator.free(s)
            runner.req_to_token_pool.free(row)


# ---------------------------------------------------------------- extend graphs

EXTEND_CASES = {  # (new tokens per request, cached prefix per request)
    "one_past_the_window": ([19], [0]),
    "on_a_level_after_a_prefix": ([8], [12]),
    "mixed_with_prefixes": ([3, 13, 1], [0, 9, 20]),
}
def _make_extend_runner(runner, kind: str, mode: str):
    if kind == "piecewise":
        return PiecewiseCudaGraphRunner(runner, EXTEND_LEVELS, capturer=capturer_for(mode))
    with warm_up_for(mode):
        return FullExtendGraphRunner(runner, EXTEND_LEVELS, max_requests=FULL_MAX_REQUESTS,
                                     capturer=capturer_for(mode))


@pytest.mark.parametrize("name,mode,kind", EXTEND_PARAMS)
def test_extend_replay_equals_eager(checkpoint, name, mode, kind):
    """Extends past the window, on cached prefixes longer than it, at a level and padded to one."""
    _check_mode(mode)
    runner = make_runner(checkpoint(name), mode)
    tol, ref_tol = MODES[mode][3:]
    torch._dynamo.reset()
    graphs = _make_extend_runner(runner, kind, mode)
    for case, (ext, pre) in EXTEND_CASES.items():
        fb, rows = make_extend_batch(runner, ext, pre, seed=len(case))
        try:
            assert graphs.can_run(fb), case
            if case == "mixed_with_prefixes" and kind == "piecewise":  # (eager is the same for both kinds)
                assert_eager_equals_reference(runner, fb, ref_tol)
            assert_replay_equals_eager(runner, graphs.replay, fb, fb.out_cache_loc, tol, padding_slot=False)
        finally:
            release(runner, rows, fb)
    torch._dynamo.reset()

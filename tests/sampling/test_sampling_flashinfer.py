"""--sampling-backend on the CPU: which rows go to flashinfer's kernels, which kernel with which per-row
tensors, and the flag's validation. flashinfer itself is replaced by a stand-in module that records its calls
and answers one known token (the real kernels run in tests/sampling/test_sampling_flashinfer_gpu.py)."""

from __future__ import annotations

import importlib.machinery
import logging
import subprocess
import sys
import threading
import types

import pytest
import torch

from model_executor import sampling_flashinfer as sfi
from model_executor.sampler import Sampler, SamplingBatchInfo
from model_executor.sampling_params import SamplingParams
from server.args import SAMPLING_BACKENDS, ArgsError, ServerArgs

CPU = torch.device("cpu")
VOCAB = 200
KNOWN = VOCAB - 1  # the stand-in's answer; its logit is so low that no torch draw or argmax picks it


class FakeSampling(types.ModuleType):
    """A stand-in for flashinfer.sampling: records (kernel, args, kwargs), answers KNOWN for every row."""

    def __init__(self):
        super().__init__("flashinfer.sampling")
        self.calls: list[tuple[str, tuple, dict]] = []
        for name in ("sampling_from_probs", "top_k_sampling_from_probs", "top_p_sampling_from_probs",
                     "top_k_top_p_sampling_from_probs", "min_p_sampling_from_probs"):
            setattr(self, name, self._sampler(name))
        for name in ("top_k_renorm_probs", "top_p_renorm_probs"):
            setattr(self, name, self._renorm(name))

    def _sampler(self, name):
        def kernel(probs, *args, **kwargs):
            self.calls.append((name, (probs, *args), kwargs))
            return torch.full((probs.shape[0],), KNOWN, dtype=torch.int32, device=probs.device)
        return kernel

    def _renorm(self, name):
        def kernel(probs, *args, **kwargs):
            self.calls.append((name, (probs, *args), kwargs))
            return probs
        return kernel

    def kernels(self) -> list[str]:
        return [name for name, _, _ in self.calls]


@pytest.fixture
def fake(monkeypatch) -> FakeSampling:
    """The stand-in, importable as flashinfer.sampling."""
    sampling = FakeSampling()
    package = types.ModuleType("flashinfer")
    package.__spec__ = importlib.machinery.ModuleSpec("flashinfer", None)
    package.sampling = sampling
    monkeypatch.setitem(sys.modules, "flashinfer", package)
    monkeypatch.setitem(sys.modules, "flashinfer.sampling", sampling)
    return sampling


def make_logits(bs: int, seed: int = 0) -> torch.Tensor:
    logits = torch.randn(bs, VOCAB, generator=torch.Generator().manual_seed(seed))
    logits[:, KNOWN] = -1e4
    return logits


def sample(sampler: Sampler, logits: torch.Tensor, params: list[SamplingParams], steps: list[int] | None = None):
    info = SamplingBatchInfo.from_params(params, steps or [0] * len(params), CPU, vocab_size=VOCAB)
    return sampler(logits, info).next_token_ids


# --------------------------------------------------------------------------- which rows


def test_only_unseeded_random_rows_take_flashinfer(fake):
    params = [SamplingParams(temperature=0.0),  # greedy
              SamplingParams(top_p=0.9),  # unseeded random
              SamplingParams(seed=7, top_p=0.9),  # seeded
              SamplingParams(temperature=0.7, top_k=1),  # greedy through top_k
              SamplingParams(temperature=1.3, min_p=0.1),  # unseeded random
              SamplingParams(seed=-3, top_k=20, min_p=0.05),  # seeded
              SamplingParams(temperature=0.9)]  # unseeded random
    unseeded, seeded, greedy = [1, 4, 6], [2, 5], [0, 3]
    logits = make_logits(len(params))
    steps = list(range(3, 3 + len(params)))
    ours = sample(Sampler(sfi.FlashInferSampler(fake, CPU), flashinfer_always=True), logits, params, steps)
    torch.manual_seed(0)
    reference = sample(Sampler(), logits, params, steps)  # pytorch for every row
    assert fake.calls, "flashinfer was not called"
    assert ours[unseeded].tolist() == [KNOWN] * 3
    assert torch.equal(ours[greedy], logits[greedy].argmax(-1))
    assert torch.equal(ours[seeded], reference[seeded]) and KNOWN not in ours[seeded].tolist()
    # A seeded row's token is its own, whatever shares the batch: alone, it draws the same.
    for row in seeded:
        alone = sample(Sampler(sfi.FlashInferSampler(fake, CPU), flashinfer_always=True), logits[row : row + 1], [params[row]], [steps[row]])
        assert alone.item() == ours[row].item()


def test_batches_without_unseeded_random_rows_never_call_flashinfer(fake):
    sampler = Sampler(sfi.FlashInferSampler(fake, CPU), flashinfer_always=True)
    logits = make_logits(4)
    sample(sampler, logits, [SamplingParams(temperature=0.0)] * 4)
    sample(sampler, logits, [SamplingParams(seed=s, top_p=0.8) for s in range(3)] + [SamplingParams(temperature=0)])
    assert fake.calls == []


@pytest.mark.parametrize("params,flashinfer", [
    ([SamplingParams(top_p=0.9), SamplingParams()], True),  # the race would sort the vocabulary
    ([SamplingParams(top_k=2000), SamplingParams(top_k=2000, top_p=0.5)], True),  # k above TOP_K_FIRST_MAX
    ([SamplingParams(top_k=50, top_p=0.9)] * 2, False),  # top-k first: the race sorts only 50
    ([SamplingParams(top_k=50), SamplingParams(top_k=50, min_p=0.1)], False),
    ([SamplingParams(min_p=0.1), SamplingParams()], False),  # min-p: a threshold, no sort
    ([SamplingParams(top_k=50), SamplingParams(min_p=0.1)], True),  # a row without k: the race sorts
    ([SamplingParams(), SamplingParams(temperature=0.5)], False),  # no filter: no sort
])
def test_by_default_flashinfer_draws_only_where_the_race_would_sort(fake, params, flashinfer):
    """bench_sampler on the H200: flashinfer is 5.7-8x faster where the race sorts the vocabulary (top-p) and
    slower or equal elsewhere (top-k first, min-p, plain), so by default it takes only the sorting batches."""
    logits = make_logits(len(params))
    info = SamplingBatchInfo.from_params(params, [0] * len(params), CPU, vocab_size=4096)
    logits = torch.nn.functional.pad(logits, (0, 4096 - VOCAB), value=-1e4)
    Sampler(sfi.FlashInferSampler(fake, CPU))(logits, info)
    assert bool(fake.calls) == flashinfer


def test_draws_from_the_default_generator(fake):
    """flashinfer's own default (no generator) is a fresh generator per call: the same draws at every step."""
    sample(Sampler(sfi.FlashInferSampler(fake, CPU), flashinfer_always=True), make_logits(2), [SamplingParams()] * 2)
    (_, _, kwargs), = fake.calls
    assert kwargs["generator"] is torch.default_generator


# --------------------------------------------------------------------------- which kernel, which tensors


@pytest.mark.parametrize("params,kernels", [
    ([SamplingParams(), SamplingParams(temperature=0.5)], ["sampling_from_probs"]),
    ([SamplingParams(top_k=5), SamplingParams()], ["top_k_sampling_from_probs"]),
    ([SamplingParams(top_p=0.5), SamplingParams()], ["top_p_sampling_from_probs"]),
    ([SamplingParams(top_k=5), SamplingParams(top_p=0.5)], ["top_k_top_p_sampling_from_probs"]),
    ([SamplingParams(min_p=0.2), SamplingParams()], ["min_p_sampling_from_probs"]),
    ([SamplingParams(min_p=0.2, top_k=9), SamplingParams(top_p=0.3)],
     ["top_k_renorm_probs", "top_p_renorm_probs", "min_p_sampling_from_probs"]),
])
def test_kernel_and_per_row_tensors_follow_the_filters(fake, params, kernels):
    logits = make_logits(len(params))
    info = SamplingBatchInfo.from_params(params, [0] * len(params), CPU, vocab_size=VOCAB)
    Sampler(sfi.FlashInferSampler(fake, CPU), flashinfer_always=True)(logits, info)
    assert fake.kernels() == kernels
    probs = fake.calls[0][1][0]
    temps = torch.tensor([p.temperature for p in params]).unsqueeze(1)
    torch.testing.assert_close(probs, torch.softmax(logits / temps, dim=-1))  # tempered, unfiltered softmax
    for name, args, kwargs in fake.calls:
        values = [a for a in args[1:] if isinstance(a, torch.Tensor)]  # per-row values: tensors, never floats
        assert all(not isinstance(a, (int, float)) for a in args[1:])
        if "top_k" in name:
            assert any(torch.equal(v, info.top_ks) for v in values)
        if "top_p" in name:
            assert any(torch.equal(v, info.top_ps) for v in values)
        if name == "top_k_top_p_sampling_from_probs":
            assert kwargs["filter_apply_order"] == "top_k_first"  # top-p on the mass left after top-k
        if name == "min_p_sampling_from_probs":
            # min_p 0 rows are raised to the floor: the kernel's fallback never lands on a banned token
            assert torch.equal(values[0], info.min_ps.clamp(min=sfi.MIN_P_FLOOR)) and values[0].min() > 0


def test_disabled_top_k_is_clamped_to_the_vocabulary(fake):
    params = [SamplingParams(top_k=5), SamplingParams()]
    info = SamplingBatchInfo.from_params(params, [0, 0], CPU)  # vocab unknown: disabled k is int32 max
    Sampler(sfi.FlashInferSampler(fake, CPU), flashinfer_always=True)(make_logits(2), info)
    (_, args, _), = fake.calls
    assert args[1].tolist() == [5, VOCAB]


def test_rows_without_a_finite_logit_get_the_argmax_and_never_reach_the_kernel_as_nan(fake):
    logits = make_logits(4)
    logits[1] = logits[3] = float("-inf")  # e.g. every token banned
    params = [SamplingParams(top_p=0.9)] * 3 + [SamplingParams(top_p=0.9, seed=1)]
    out = sample(Sampler(sfi.FlashInferSampler(fake, CPU), flashinfer_always=True), logits, params)
    probs = fake.calls[0][1][0]
    assert torch.isfinite(probs).all()
    assert out.tolist() == [KNOWN, 0, KNOWN, 0]  # 0: the argmax of an all -inf row, as on the pytorch path
    assert sample(Sampler(), logits, params)[[1, 3]].tolist() == [0, 0]


# --------------------------------------------------------------------------- the masking contract (torch path)


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(top_k=50), SamplingParams(top_p=0.95),
                                    SamplingParams(min_p=0.01), SamplingParams(top_k=50, top_p=0.99, min_p=0.0),
                                    SamplingParams(temperature=2.0, seed=5)])
def test_grammar_masked_rows_draw_only_allowed_tokens(params):
    """A grammar mask leaves a few tokens (fewer than top_k); every filter combination keeps to them."""
    vocab, n = 3000, 400
    allowed = torch.tensor([7, 1500, 2999])
    logits = torch.full((n, vocab), float("-inf"))
    logits[:, allowed] = torch.tensor([0.5, -0.2, 0.1])
    info = SamplingBatchInfo.from_params([params] * n, list(range(n)), CPU, vocab_size=vocab)
    tokens = Sampler()(logits, info).next_token_ids
    assert set(tokens.tolist()) <= set(allowed.tolist()) and len(set(tokens.tolist())) > 1


# --------------------------------------------------------------------------- the flag


def test_backend_names_match_the_cli():
    assert SAMPLING_BACKENDS == sfi.SAMPLING_BACKENDS


def test_which_backend_each_name_picks(fake, monkeypatch):
    """pytorch never loads flashinfer, nor does auto on a CPU; auto on a GPU builds it in the background, the
    name loads it now."""
    loads, builds = [], []
    monkeypatch.setattr(sfi.FlashInferSampler, "load",
                        classmethod(lambda cls, device: loads.append(device) or cls(fake, CPU)))
    monkeypatch.setattr(sfi.BackgroundFlashInfer, "__init__", lambda self, device: builds.append(device))
    cuda = torch.device("cuda")
    assert sfi.create_flashinfer_sampler("pytorch", cuda) is None
    assert sfi.create_flashinfer_sampler("auto", CPU) is None
    assert loads == [] and builds == []
    assert isinstance(sfi.create_flashinfer_sampler("auto", cuda), sfi.BackgroundFlashInfer)
    assert isinstance(sfi.create_flashinfer_sampler("flashinfer", cuda), sfi.FlashInferSampler)
    assert loads == [cuda] and builds == [cuda]
    assert Sampler(None).backend == "pytorch" and Sampler(sfi.FlashInferSampler(fake, CPU), flashinfer_always=True).backend == "flashinfer"


def test_background_build_samples_with_pytorch_until_ready(fake):
    """auto: until the build ends, every row goes the pytorch way; then flashinfer draws the random rows (after
    one warm-up draw on the sampling thread)."""
    release = threading.Event()

    def build():
        release.wait(30)
        return fake

    pending = sfi.BackgroundFlashInfer(CPU, build=build)
    sampler = Sampler(pending, flashinfer_always=True)
    info = SamplingBatchInfo.from_params([SamplingParams(temperature=1.0)] * 4, [0] * 4, CPU, vocab_size=50)
    assert sampler.backend == "pytorch (flashinfer not ready)" and pending.get() is None
    tokens = sampler(torch.randn(4, 50), info).next_token_ids
    assert fake.kernels() == [] and not (tokens == KNOWN).all()  # the pytorch path drew them
    release.set()
    assert pending.wait(30)
    assert sampler.backend == "flashinfer"
    assert fake.kernels() == ["sampling_from_probs"]  # the warm-up draw
    assert (sampler(torch.randn(4, 50), info).next_token_ids == KNOWN).all()


@pytest.mark.parametrize("where", ["build", "first_draw"])
def test_background_build_that_fails_keeps_pytorch(fake, caplog, where):
    def build():
        if where == "build":
            raise RuntimeError("Ninja build failed.\nnvcc: not found")
        return fake

    pending = sfi.BackgroundFlashInfer(CPU, build=build)
    assert pending.wait(30)
    if where == "first_draw":
        fake.sampling_from_probs = lambda *a, **k: (_ for _ in ()).throw(RuntimeError("no kernel image"))
    with caplog.at_level(logging.WARNING, logger="duet.sampler"):
        assert pending.get() is None and pending.get() is None
    assert "sampling with pytorch" in caplog.text and caplog.text.count("WARNING") == 1
    assert Sampler(pending).backend == "pytorch (flashinfer not ready)"


def test_flashinfer_needs_cuda_and_the_package(monkeypatch):
    with pytest.raises(sfi.SamplingBackendError, match="needs a CUDA device"):
        sfi.create_flashinfer_sampler("flashinfer", CPU)
    monkeypatch.setattr(sfi, "flashinfer_installed", lambda: False)
    with pytest.raises(sfi.SamplingBackendError, match=r"not installed.*pip install 'duet\[flashinfer\]'"):
        sfi.create_flashinfer_sampler("flashinfer", torch.device("cuda"))
    assert sfi.create_flashinfer_sampler("auto", torch.device("cuda")) is None
    with pytest.raises(sfi.SamplingBackendError, match="unknown sampling backend"):
        sfi.create_flashinfer_sampler("triton", CPU)


def test_kernels_that_do_not_load(fake, caplog, monkeypatch):
    """The warm-up draw fails (a kernel build error): flashinfer asked for by name is a one-line error (auto:
    test_background_build_that_fails_keeps_pytorch)."""
    def load(cls, device):
        raise RuntimeError("Ninja build failed.\nnvcc: not found")

    monkeypatch.setattr(sfi.FlashInferSampler, "load", classmethod(load))
    with pytest.raises(sfi.SamplingBackendError, match="sampling kernels do not load.*Ninja build failed") as err:
        sfi.create_flashinfer_sampler("flashinfer", torch.device("cuda"))
    assert "\n" not in str(err.value)


def test_server_args_validate_the_flag(monkeypatch):
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
    with pytest.raises(ArgsError, match=r"--sampling-backend flashinfer: flashinfer is not installed"):
        ServerArgs(device="cuda", sampling_backend="flashinfer").validate()
    with pytest.raises(ArgsError, match="needs a CUDA device"):
        ServerArgs(device="cpu", sampling_backend="flashinfer").validate()
    ServerArgs(device="cuda", sampling_backend="pytorch").validate()
    ServerArgs(device="cuda", sampling_backend="auto").validate()


def test_cli_refuses_flashinfer_on_cpu_in_one_line():
    proc = subprocess.run([sys.executable, "-m", "server.launch_server", "--device", "cpu", "--sampling-backend",
                           "flashinfer", "--model-path", "."], check=False, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "--sampling-backend flashinfer needs a CUDA" in proc.stderr

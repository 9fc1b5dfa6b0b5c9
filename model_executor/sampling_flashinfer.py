"""flashinfer's sampling kernels for the random rows without a seed (`--sampling-backend`).

Top-k, top-p and min-p by rejection sampling over the probabilities: no sort of the vocabulary. The filters
keep the torch path's order and meaning (top-k, then top-p on the mass renormalised after top-k, then min-p
relative to the best token), with per-row values passed as device tensors (no host sync).

flashinfer is optional (CUDA only, `pip install 'duet[flashinfer]'`): it is imported here only when this
backend is chosen. Its kernels are compiled on first use (the wheel ships sources; nvcc builds them into
flashinfer's cache): by name (`flashinfer`) they are built and tried with one tiny draw at start-up; with `auto`
they are built in the background while the server starts and serves (BackgroundFlashInfer).

The draws come from the process's default CUDA generator (seeded by --random-seed, like the torch path's
unseeded rows): flashinfer reads its seed and offset on the host, so these calls must not be captured in a
CUDA graph (the sampler runs after the graph replay, outside it).
"""

from __future__ import annotations

import importlib.util
import logging
import threading
import time
from types import ModuleType

import torch

logger = logging.getLogger("duet.sampler")

SAMPLING_BACKENDS = ("auto", "flashinfer", "pytorch")

# min_p is raised to at least this inside the min-p kernel: it keeps tokens with p >= min_p * p_max, so a
# min_p of 0 would admit the zero-probability (banned, grammar-masked) tokens as candidates of its fallback
# when rounding leaves its uniform draw above the kept mass. Tokens this much less likely than the best one
# are never drawn anyway; the product stays a normal float32 for any vocabulary up to 10**6 tokens.
MIN_P_FLOOR = 1e-30


class SamplingBackendError(RuntimeError):
    """The sampling backend asked for cannot run here; the message is one line."""


def flashinfer_installed() -> bool:
    return importlib.util.find_spec("flashinfer") is not None


def default_generator(device: torch.device) -> torch.Generator:
    """The generator torch.manual_seed seeds for `device` (flashinfer's own default is a fresh generator per
    call, which would repeat the same draws at every step)."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return torch.cuda.default_generators[index]
    return torch.default_generator


class FlashInferSampler:
    """Draws one token per row from the filtered softmax of `scaled` (logits / temperature) with flashinfer."""

    def __init__(self, module: ModuleType, device: torch.device):
        self.fs = module  # flashinfer.sampling (a stand-in module in the CPU tests)
        self.generator = default_generator(device)

    @classmethod
    def load(cls, device: torch.device) -> FlashInferSampler:
        import flashinfer.sampling as fs

        sampler = cls(fs, device)
        sampler.warm_up()  # builds (first run on this machine) or loads the kernels now; a broken install fails
        return sampler

    def warm_up(self) -> None:
        """One tiny draw: the kernels' first launch."""
        self.fs.sampling_from_probs(torch.full((1, 8), 1 / 8, device=self.generator.device),
                                    generator=self.generator)

    def get(self) -> FlashInferSampler:
        return self

    def sample(self, scaled: torch.Tensor, fallback: torch.Tensor, top_ks: torch.Tensor | None = None,
               top_ps: torch.Tensor | None = None, min_ps: torch.Tensor | None = None) -> torch.Tensor:
        """Tokens [bs] int64 for every row (the caller keeps those of its unseeded random rows); `scaled` is
        overwritten. top_ks [bs] int, top_ps and min_ps [bs] float32: the per-row filters, each given only
        when some row uses it (the sampler's SamplingBatchInfo.need_*). Rows without a finite best logit (all -inf,
        or +inf/NaN) get `fallback` (the argmax, as on the torch path): their softmax is NaN, on which the
        kernels' answer is undefined (they may read out of the row), so they are sampled as zeros first."""
        rows = torch.arange(scaled.shape[0], device=scaled.device)
        bad = ~torch.isfinite(scaled[rows, fallback])  # the best logit of the row: -inf only if all are
        probs = torch.softmax(scaled.masked_fill_(bad.unsqueeze(1), 0.0), dim=-1)
        fs, gen = self.fs, self.generator
        if top_ks is not None:
            top_ks = top_ks.clamp(max=scaled.shape[1])  # disabled top-k may be int32 max: k >= vocab is off
        if min_ps is not None:
            if top_ks is not None:
                probs = fs.top_k_renorm_probs(probs, top_ks)
            if top_ps is not None:
                probs = fs.top_p_renorm_probs(probs, top_ps)
            tokens = fs.min_p_sampling_from_probs(probs, min_ps.clamp(min=MIN_P_FLOOR), generator=gen)
        elif top_ks is not None and top_ps is not None:
            tokens = fs.top_k_top_p_sampling_from_probs(probs, top_ks, top_ps,
                                                        filter_apply_order="top_k_first", generator=gen)
        elif top_ks is not None:
            tokens = fs.top_k_sampling_from_probs(probs, top_ks, generator=gen)
        elif top_ps is not None:
            tokens = fs.top_p_sampling_from_probs(probs, top_ps, generator=gen)
        else:
            tokens = fs.sampling_from_probs(probs, generator=gen)
        return torch.where(bad, fallback, tokens.long())


def _build_sampling_module() -> ModuleType:
    """flashinfer.sampling with its kernels built (nvcc, on a machine's first use) and loaded; nothing launched."""
    import flashinfer.sampling as fs

    fs.get_sampling_module()
    return fs


class BackgroundFlashInfer:
    """--sampling-backend auto on a GPU: flashinfer's sampling kernels built and loaded on a thread, so that a
    machine's first start (nvcc compiles them: about a minute) never waits for them. Until they are ready, and
    for good if they fail, `get()` gives None and the pytorch path samples every row. The thread launches
    nothing on the GPU (a launch there could break a graph capture in progress); the first `get()` after the
    build, on the sampling thread, makes the kernels' first launch (a tiny draw) and keeps flashinfer only if
    it works."""

    def __init__(self, device: torch.device, build=_build_sampling_module):
        self.device = device
        self._built: ModuleType | None = None
        self._sampler: FlashInferSampler | None = None
        self._done = threading.Event()
        self._start = time.perf_counter()
        self._thread = threading.Thread(target=self._build, args=(build,), name="flashinfer-sampling-build",
                                        daemon=True)
        self._thread.start()

    def _build(self, build) -> None:
        try:
            self._built = build()
            logger.info("flashinfer's sampling kernels built and loaded in %.1f s, in the background",
                        time.perf_counter() - self._start)
        except Exception as e:  # noqa: BLE001 - an import or build failure: one line, whatever its type
            logger.warning("flashinfer's sampling kernels do not load (%s): sampling with pytorch", _one_line(e))
        finally:
            self._done.set()

    def wait(self, timeout: float | None = None) -> bool:
        """True once the build has finished, whether or not it worked."""
        return self._done.wait(timeout)

    def get(self) -> FlashInferSampler | None:
        if self._built is not None:
            module, self._built = self._built, None
            sampler = FlashInferSampler(module, self.device)
            try:
                sampler.warm_up()
                self._sampler = sampler
                logger.info("sampling backend: flashinfer (rows with a seed: pytorch)")
            except Exception as e:  # noqa: BLE001 - a launch failure: pytorch samples instead
                logger.warning("flashinfer's sampling kernels do not run (%s): sampling with pytorch", _one_line(e))
        return self._sampler


def _one_line(e: Exception) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0] if text else ''}"


def create_flashinfer_sampler(name: str, device: torch.device) -> FlashInferSampler | BackgroundFlashInfer | None:
    """The flashinfer sampler for `--sampling-backend name`, or None to sample every row with pytorch.

    auto: flashinfer on a CUDA device when it is installed, its kernels built and loaded in the background
    (BackgroundFlashInfer: pytorch samples until then, and for good with a warning if they fail); flashinfer:
    loaded now, and anything missing or failing is a SamplingBackendError."""
    if name not in SAMPLING_BACKENDS:
        raise SamplingBackendError(f"unknown sampling backend {name!r}; choose from {', '.join(SAMPLING_BACKENDS)}")
    if name == "pytorch":
        return None
    if device.type != "cuda":
        if name == "auto":
            return None
        raise SamplingBackendError("--sampling-backend flashinfer needs a CUDA device; use pytorch on CPU")
    if not flashinfer_installed():
        if name == "auto":
            return None
        raise SamplingBackendError("--sampling-backend flashinfer: flashinfer is not installed; install it with "
                                   "`pip install 'duet[flashinfer]'`")
    if name == "auto":
        logger.info("building flashinfer's sampling kernels in the background (on a machine's first use nvcc "
                    "compiles them: about a minute; cached under ~/.cache/flashinfer); pytorch samples until then")
        return BackgroundFlashInfer(device)
    logger.info("loading flashinfer's sampling kernels (on a machine's first use nvcc compiles them: about a "
                "minute; cached under ~/.cache/flashinfer)")
    start = time.perf_counter()
    try:
        sampler = FlashInferSampler.load(device)
    except Exception as e:  # an import or kernel build failure: one line, whatever its type
        raise SamplingBackendError(f"--sampling-backend flashinfer: flashinfer's sampling kernels do not "
                                   f"load ({_one_line(e)})") from e
    logger.info("sampling backend: flashinfer (rows with a seed: pytorch), kernels ready in %.1f s",
                time.perf_counter() - start)
    return sampler

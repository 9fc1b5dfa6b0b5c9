"""Attention backends by name; `auto` picks torch_native on CPU and triton on GPU (measured fastest)."""

from __future__ import annotations

import importlib.util
import logging

from model_executor.layers.attention.base import AttentionBackend

logger = logging.getLogger("duet.attention")

BACKENDS = ("auto", "torch_native", "triton", "flashinfer")


class AttentionBackendError(RuntimeError):
    pass


def resolve_backend_name(name: str, device: str) -> str:
    if name != "auto":
        return name
    if device == "cpu":
        return "torch_native"
    # Our Triton decode beat flashinfer's decode wrapper at every size measured (docs/benchmarks.md).
    return "triton"


def create_attention_backend(name: str, runner) -> AttentionBackend:
    name = resolve_backend_name(name, runner.device.type)
    if name == "torch_native":
        from model_executor.layers.attention.torch_native import TorchNativeBackend

        backend = TorchNativeBackend()
    elif name == "triton":
        if runner.device.type != "cuda":
            raise AttentionBackendError("the triton attention backend needs a CUDA device")
        from model_executor.layers.attention.triton_backend import TritonAttnBackend

        backend = TritonAttnBackend(runner)
    elif name == "flashinfer":
        cfg = getattr(runner, "model_config", None)
        if getattr(cfg, "attention_sinks", False):
            raise AttentionBackendError(f"the flashinfer attention backend does not take attention sinks "
                                        f"({cfg.architecture}); use --attention-backend triton")
        if runner.device.type != "cuda":
            raise AttentionBackendError("the flashinfer attention backend needs a CUDA device")
        if importlib.util.find_spec("flashinfer") is None:
            raise AttentionBackendError(
                "flashinfer is not installed; install it with `pip install 'duet[flashinfer]'`")
        from model_executor.layers.attention.flashinfer_backend import FlashInferAttnBackend

        backend = FlashInferAttnBackend(runner)
    else:
        raise AttentionBackendError(f"unknown attention backend {name!r}; choose from {', '.join(BACKENDS)}")
    logger.info("attention backend: %s", name)
    return backend

"""Builds a model from a config and loads its weights from `*.safetensors` (or random, for benchmarks)."""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm

from model_executor.model_config import ModelConfig
from model_executor.models import MODEL_REGISTRY

logger = logging.getLogger("duet.weight_loader")


class WeightLoadError(RuntimeError):
    pass


def _iter_safetensors(files: list[Path], device: str):
    for file in tqdm(files, desc="loading weights", unit="file", disable=len(files) < 2):
        with safe_open(str(file), framework="pt", device=device) as f:
            for name in f.keys():  # safe_open handles are not mappings
                yield name, f.get_tensor(name)


def build_model(cfg: ModelConfig, dtype: torch.dtype, device: torch.device | str) -> torch.nn.Module:
    cls = MODEL_REGISTRY[cfg.architecture]
    with torch.device(device):
        model = cls(cfg)
    return model.to(dtype=dtype).eval()


def load_model(model_path: str | Path, cfg: ModelConfig, dtype: torch.dtype, device: torch.device | str):
    path = Path(model_path)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise WeightLoadError(f"no *.safetensors files in {str(path)!r}")
    model = build_model(cfg, dtype, device)
    loaded = model.load_weights(_iter_safetensors(files, "cpu"))
    missing = model.expected_weight_names() - loaded
    if missing:
        shown = ", ".join(sorted(missing)[:5])
        raise WeightLoadError(f"{len(missing)} weights missing from {str(path)!r}, e.g. {shown}")
    return model


def init_random_weights(model: torch.nn.Module, seed: int = 0, std: float = 0.02) -> torch.nn.Module:
    """Random weights with sane scales (norms at 1), for benchmarks and GPU tests of real shapes."""
    with torch.no_grad():
        for i, (name, p) in enumerate(model.named_parameters()):
            if name.endswith("norm.weight") or "layernorm" in name:
                p.fill_(1.0)
            else:
                gen = torch.Generator(device=p.device).manual_seed(seed + i)
                p.copy_(torch.randn(p.shape, generator=gen, device=p.device, dtype=torch.float32) * std)
    return model

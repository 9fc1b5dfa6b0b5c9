"""A PEFT LoRA adapter read from its folder (adapter_config.json + adapter_model.safetensors) into host memory.

Each target linear of layer i gets A [r, in] and B [out, r]; the adapter's update of that linear is
y += (x @ A.T) @ B.T * scaling, scaling = lora_alpha / r (lora_alpha / sqrt(r) with use_rslora).

What duet does not run is refused here, in one line (LoraError): DoRA, trained biases, modules_to_save,
per-module rank or alpha patterns, targets outside the seven projections of a decoder block.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

# The projections an adapter may target, and the fused layer each goes into (part index within it).
TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
FUSED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
         "o_proj": ("o_proj", 0), "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
         "down_proj": ("down_proj", 0)}

_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.\w+)?\.weight$")


class LoraError(ValueError):
    """An adapter that cannot be served (the message is one line naming the adapter and the problem)."""


@dataclass
class LoraAdapter:
    name: str
    path: str
    rank: int
    alpha: float
    scaling: float
    targets: frozenset[str]  # of TARGET_MODULES
    # (layer, module) -> (A [r, in], B [out, r]), float32 on the host
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(repr=False, default_factory=dict)

    def nbytes(self) -> int:
        return sum(a.numel() * a.element_size() + b.numel() * b.element_size() for a, b in self.weights.values())


def read_config(path: str | Path, name: str) -> dict:
    """adapter_config.json, checked (LoraError for what duet cannot serve)."""
    folder = Path(path).expanduser()
    cfg_file = folder / "adapter_config.json"
    if not cfg_file.is_file():
        raise LoraError(f"LoRA adapter {name!r}: no adapter_config.json in {str(folder)!r}")
    try:
        cfg = json.loads(cfg_file.read_text())
    except (OSError, ValueError) as e:
        raise LoraError(f"LoRA adapter {name!r}: cannot read adapter_config.json ({e})") from None
    if not isinstance(cfg, dict) or str(cfg.get("peft_type", "LORA")).upper() != "LORA":
        raise LoraError(f"LoRA adapter {name!r}: not a LoRA adapter (peft_type {cfg.get('peft_type')!r})")
    refused = [k for k in ("use_dora", "rank_pattern", "alpha_pattern", "modules_to_save") if cfg.get(k)]
    if cfg.get("bias", "none") != "none":
        refused.append(f"bias={cfg['bias']}")
    if refused:
        raise LoraError(f"LoRA adapter {name!r}: {', '.join(refused)} is not supported")
    r = cfg.get("r")
    if not isinstance(r, int) or r < 1:
        raise LoraError(f"LoRA adapter {name!r}: r must be a positive integer, got {r!r}")
    return cfg


def config_targets(cfg: dict, name: str) -> frozenset[str]:
    """The projections adapter_config.json's target_modules names ("all-linear": all of them)."""
    targets = cfg.get("target_modules")
    if targets == "all-linear":
        return frozenset(TARGET_MODULES)
    if isinstance(targets, str):
        raise LoraError(f"LoRA adapter {name!r}: target_modules as a pattern ({targets!r}) is not supported; "
                        "list the module names")
    targets = frozenset(t.rsplit(".", 1)[-1] for t in targets or ())
    unknown = sorted(targets - set(TARGET_MODULES))
    if unknown:
        raise LoraError(f"LoRA adapter {name!r}: target modules {unknown} are not supported (only "
                        f"{', '.join(TARGET_MODULES)})")
    return targets


def read_adapter(name: str, path: str | Path) -> LoraAdapter:
    """The adapter in host memory (LoraError, one line, for anything wrong with it)."""
    from safetensors import safe_open

    cfg = read_config(path, name)
    config_targets(cfg, name)  # (checked: a pattern or an unknown module is refused)
    r = cfg["r"]
    alpha = float(cfg.get("lora_alpha", r))
    scaling = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r
    file = Path(path).expanduser() / "adapter_model.safetensors"
    if not file.is_file():
        raise LoraError(f"LoRA adapter {name!r}: no adapter_model.safetensors in {str(path)!r}")
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    try:
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 - safe_open is not iterable
                m = _KEY.search(key)
                if m is None:
                    raise LoraError(f"LoRA adapter {name!r}: tensor {key!r} is not a LoRA weight of a decoder "
                                    "projection")
                layer, module, half = int(m.group(1)), m.group(2), m.group(3)
                if module not in FUSED:
                    raise LoraError(f"LoRA adapter {name!r}: target module {module!r} is not supported")
                halves.setdefault((layer, module), {})[half] = f.get_tensor(key).float()
    except LoraError:
        raise
    except Exception as e:  # noqa: BLE001 - a corrupt file: one line, not a traceback
        raise LoraError(f"LoRA adapter {name!r}: cannot read adapter_model.safetensors ({type(e).__name__}: "
                        f"{e})") from None
    weights = {}
    for (layer, module), pair in sorted(halves.items()):
        if set(pair) != {"A", "B"}:
            raise LoraError(f"LoRA adapter {name!r}: layer {layer} {module} has lora_{''.join(pair)} only")
        a, b = pair["A"], pair["B"]
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != r or b.shape[1] != r:
            raise LoraError(f"LoRA adapter {name!r}: layer {layer} {module} has A {tuple(a.shape)} and B "
                            f"{tuple(b.shape)}, not rank {r}")
        if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
            raise LoraError(f"LoRA adapter {name!r}: layer {layer} {module} has non-finite weights")
        weights[layer, module] = (a, b)
    if not weights:
        raise LoraError(f"LoRA adapter {name!r}: adapter_model.safetensors holds no LoRA weights")
    # What the file holds is what runs (target_modules may name modules of layers it leaves out).
    return LoraAdapter(name=name, path=str(path), rank=r, alpha=alpha, scaling=scaling,
                       targets=frozenset(m for _, m in weights), weights=weights)

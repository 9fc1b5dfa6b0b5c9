"""The model's own sampling defaults (generation_config.json), applied where a request leaves a value unset,
as vLLM does; `--sampling-defaults openai` uses the OpenAI API's neutral values instead."""

from __future__ import annotations

import json
import logging
from pathlib import Path

logger = logging.getLogger("duet.generation_defaults")

# The sampling fields duet implements, with the OpenAI API's values for "unset". generation_config.json
# keys duet has no sampler for (typical_p, ...) are ignored; its repetition_penalty is not applied as a
# default yet (requests set repetition_penalty themselves).
OPENAI_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0}
SAMPLING_DEFAULTS_MODES = ("model", "openai")


def _valid(name: str, value) -> bool:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    if name == "temperature":
        return value >= 0
    if name == "top_p":
        return 0 < value <= 1
    if name == "top_k":
        return float(value).is_integer() and value >= -1
    return 0 <= value <= 1  # min_p


def load_generation_defaults(model_path: str | Path) -> dict:
    """The supported sampling values generation_config.json sets ({} without the file); invalid ones are
    skipped with a warning rather than failing every request."""
    path = Path(model_path) / "generation_config.json"
    if not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        logger.warning("ignoring %s: %s", path, e)
        return {}
    out = {}
    for name in OPENAI_DEFAULTS:
        if name not in config or config[name] is None:
            continue
        if _valid(name, config[name]):
            out[name] = int(config[name]) if name == "top_k" else float(config[name])
        else:
            logger.warning("ignoring %s=%r in %s", name, config[name], path)
    return out


def sampling_defaults(model_path: str | Path, mode: str = "model") -> dict:
    """The defaults requests get: the model's (mode "model") over OpenAI's, or OpenAI's alone."""
    if mode not in SAMPLING_DEFAULTS_MODES:
        raise ValueError(f"--sampling-defaults must be one of {', '.join(SAMPLING_DEFAULTS_MODES)}, got {mode!r}")
    model = load_generation_defaults(model_path) if mode == "model" else {}
    return {**OPENAI_DEFAULTS, **model}


def fill_unset(requested: dict, defaults: dict) -> dict:
    """requested: field -> value, None where the request did not set it. Returns every sampling field."""
    return {name: requested[name] if requested.get(name) is not None else defaults.get(name, fallback)
            for name, fallback in OPENAI_DEFAULTS.items()}

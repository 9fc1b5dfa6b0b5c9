"""Model shapes kept in the repo (HF config.json folders) for random-weight benchmarks and GPU tests."""

from __future__ import annotations

from pathlib import Path

CONFIG_DIR = Path(__file__).parent
SHAPES = tuple(sorted(p.name for p in CONFIG_DIR.iterdir() if (p / "config.json").is_file()))


def shape_path(name: str) -> Path:
    if name not in SHAPES:
        raise ValueError(f"unknown model shape {name!r}; choose from {', '.join(SHAPES)}")
    return CONFIG_DIR / name

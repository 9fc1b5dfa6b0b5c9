"""The weight files of a model folder and their tensor tables, without torch (start-up checks stay fast)."""

from __future__ import annotations

import json
import struct
from pathlib import Path

from model_executor.model_config import WeightLoadError

INDEX_FILE = "model.safetensors.index.json"
BIN_INDEX_FILE = "pytorch_model.bin.index.json"


def checkpoint_files(path: str | Path, allow_bin: bool = False) -> list[Path]:
    """The shards to read. With an index file, every shard it lists must be there (a partial download).

    allow_bin: PyTorch `*.bin` shards are read where a folder has no safetensors (draft heads, which are often
    published so); otherwise only safetensors."""
    path = Path(path)
    if (path / INDEX_FILE).is_file():
        return _indexed_shards(path, INDEX_FILE)
    files = sorted(path.glob("*.safetensors"))
    if not files and allow_bin:
        if (path / BIN_INDEX_FILE).is_file():
            return _indexed_shards(path, BIN_INDEX_FILE)
        files = sorted(path.glob("*.bin"))
        if not files:
            raise WeightLoadError(f"model folder {str(path)!r} has no *.safetensors or *.bin weights")
    if not files:
        hint = " (it has PyTorch *.bin weights; duet reads only safetensors)" if any(path.glob("*.bin")) else ""
        raise WeightLoadError(f"model folder {str(path)!r} has no *.safetensors weights{hint}")
    return files


def _indexed_shards(path: Path, index_name: str) -> list[Path]:
    index = path / index_name
    try:
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    except (json.JSONDecodeError, KeyError, AttributeError, TypeError) as e:
        raise WeightLoadError(f"{index} is not a valid weight index ({e})") from None
    missing = [s for s in shards if not (path / s).is_file()]
    if missing:
        raise WeightLoadError(f"model folder {str(path)!r} lacks weight shard {missing[0]} "
                              f"({len(missing)} of {len(shards)} listed in {index_name} are missing)")
    return [path / s for s in shards]


def read_header(file: Path) -> dict[str, dict]:
    """A shard's tensor table (name -> dtype, shape, offsets) without reading any tensor data."""
    try:
        with open(file, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(size))
    except (OSError, struct.error, json.JSONDecodeError, UnicodeDecodeError, MemoryError, OverflowError):
        raise WeightLoadError(f"{file} is not a readable safetensors file") from None
    header.pop("__metadata__", None)
    return header

"""Small-M GEMM configs: what the kernel runs for a weight at a row count, from a table tuned per GPU.

Configs (BLOCK_N, BLOCK_K, SPLIT_K, num_warps, num_stages, GEMV) come from a table tuned per GPU by
benchmarks/tuning/tune_small_m_gemm.py (configs/small_m_gemm_<GPU>.json, read once, at the first decode-sized
GEMM: the warm-up before graph capture; never tuned while serving): per weight kind
("bf16", "fp16", "fp8", "fp8_block"), (N, K) and M bucket, a config, or the name of the path the layer
takes otherwise where that measured faster: "cublas" (F.linear) for bf16/fp16, "w8a8" (activation
quantization + the FP8 GEMM) for FP8. Without an entry, bf16/fp16 weights keep F.linear and FP8 weights
use `default_config`: weight-only FP8 reads half the bytes of bf16 and skips the activation-quantization
kernel, so it needs no table to win.

Pure Python (no Triton import): small_m_gemm.py launches the kernel at these configs, and the tuner and the
layers ask what a table holds.
"""

from __future__ import annotations

import functools
import json
import logging
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from model_executor.layers.quantization.base import SMALL_M_BUCKETS, SMALL_M_FUSED_ROWS, SMALL_M_GEMV_ROWS

logger = logging.getLogger("duet.small_m_gemm")

MAX_M = 16  # rows of x (bf16 / fp16 weights); the dot's padded row count (tl.dot's minimum) up to it
# FP8 weights up to this many rows, above MAX_M only where the table has a config for the row count's bucket:
# the weight-only read against activation quantization + the W8A8 GEMM, whose cuBLAS kernels at 17-64 rows
# are far from the weights' read (docs/benchmarks.md). Above MAX_M the dot pads the rows to a power of two.
MAX_M_FP8 = 64
# A GEMV config (CUDA-core products) runs up to this many rows: the weight tile is loaded and converted once
# and multiplied into each row's accumulator (a tile of float32 sums per row: registers bound the count).
# Defined beside SMALL_M_MAX, where the layers check it without importing Triton.
MAX_GEMV_ROWS = SMALL_M_GEMV_ROWS
# The fusions (fused_config) take up to this many rows: a GEMV config up to MAX_GEMV_ROWS, a single-split tl.dot
# tile up to its padded rows.
MAX_FUSED_ROWS = SMALL_M_FUSED_ROWS
assert MAX_GEMV_ROWS <= MAX_FUSED_ROWS <= MAX_M
CONFIG_DIR = Path(__file__).parent / "configs"
M_BUCKETS = SMALL_M_BUCKETS  # the row counts the tuner times; a batch uses the next bucket up
FP8 = torch.float8_e4m3fn


@dataclass(frozen=True)
class GemmConfig:
    BLOCK_N: int
    BLOCK_K: int
    SPLIT_K: int = 1
    num_warps: int = 4
    num_stages: int = 4
    GEMV: bool = False  # <= MAX_GEMV_ROWS rows: CUDA-core products instead of tl.dot (BLOCK_N may be below 16)
    # FP8 weights: x quantized per token (FP8 codes and a scale per row), the dot on FP8 tensor cores. A table
    # entry with it is a config of the W8A8 path (fp8_linear._w8a8), which quantizes x anyway, not of this
    # weight-only one.
    X_FP8: bool = False
    # Whether the layer's fused paths (fused_config) take this config where it is single_split: True / False as
    # the tuner measured the fused form against the plain kernel plus the neighbours' own kernels; None (entries
    # tuned before tl.dot tiles could fuse, layers not timed fused): a GEMV does, a tl.dot tile does not.
    FUSE: bool | None = None
    # A tl.dot tile's paired fusions (the SiLU-and-mul, the rotary: half the tile's rows from each of two blocks)
    # as one dot over the tile gathered from both blocks, split after the loop, instead of a dot per half: a
    # 64-row tile keeps sm_90's wgmma, where its 32-row halves run on mma.sync (docs/benchmarks.md, thirty-seventh
    # and fortieth sessions).
    PAIR_DOT: bool = False

    def __post_init__(self):
        for name in ("BLOCK_N", "BLOCK_K"):
            v = getattr(self, name)
            least = 1 if name == "BLOCK_N" and self.GEMV else 16
            if v < least or v & (v - 1):
                raise ValueError(f"{name} must be a power of two >= {least}, got {v}")
        if (self.SPLIT_K < 1 or self.num_warps < 1 or self.num_stages < 1 or (self.X_FP8 and self.GEMV)
                or (self.PAIR_DOT and (self.GEMV or self.X_FP8))):
            raise ValueError(f"bad small-M GEMM config {self}")


def weight_kind(weight: torch.Tensor, block: tuple[int, int] | None) -> str:
    """The table's key for a weight: "bf16", "fp16", "fp8" (per-channel scales) or "fp8_block"."""
    if weight.dtype == FP8:
        return "fp8_block" if block is not None else "fp8"
    return {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(weight.dtype, str(weight.dtype))


def tiles_scale_block(block_k: int) -> bool:
    """Whether K steps (powers of two >= 16, at most block_k) can tile a scale block of block_k columns."""
    return block_k >= 16 and not block_k & (block_k - 1)


def single_split(cfg: GemmConfig) -> bool:
    """Whether a config can run the epilogue fusions (the SiLU-and-mul, the rotary + KV store, the add +
    RMSNorm) and take pre-normed rows: one split (each program sees all of K), weight-only (no X_FP8)."""
    return cfg.SPLIT_K == 1 and not cfg.X_FP8


def pairs(cfg: GemmConfig) -> bool:
    """Whether a config's column tile can be split into paired halves (the SiLU's gate and up rows, a head's two
    halves): a GEMV's of 2 or more, a tl.dot tile's of 32 or more (16 rows a dot)."""
    return cfg.BLOCK_N >= (2 if cfg.GEMV else 32)


def fuses(cfg: GemmConfig) -> bool:
    """Whether the layers' fused paths take this table config: single_split, and FUSE (None: a GEMV)."""
    return single_split(cfg) and (cfg.FUSE if cfg.FUSE is not None else cfg.GEMV)


def m_bucket(m: int) -> int:
    return next(b for b in M_BUCKETS if b >= m)


@functools.cache
def device_name(device: str = "cuda") -> str:
    """The GPU's name as the config files spell it (the MoE tables' convention); "cpu" without CUDA."""
    if device.startswith("cuda") and torch.cuda.is_available():
        return torch.cuda.get_device_name(torch.device(device)).replace(" ", "_")
    return "cpu"


@functools.cache
def _sm_count(device: str) -> int:
    if device.startswith("cuda") and torch.cuda.is_available():
        return torch.cuda.get_device_properties(torch.device(device)).multi_processor_count
    return 4  # the interpreter: a few splits keep the split-K path exercised


def table_path(device: str) -> Path:
    return CONFIG_DIR / f"small_m_gemm_{device}.json"


@functools.cache
def _table(device: str) -> dict:
    path = table_path(device)
    if not path.is_file():
        return {}
    table = json.loads(path.read_text())
    logger.info("small-M GEMM configs for %s: %s", device, path.name)
    return table


def forget_tables() -> None:
    """Drop the tables read so far: the next lookup reads table_path's file again (tests and
    benchmarks/tuning/ab_tables.py point the loader at another file)."""
    _table.cache_clear()
    tuned_configs.cache_clear()


OTHER_PATHS = {"bf16": "cublas", "fp16": "cublas", "fp8": "w8a8", "fp8_block": "w8a8"}


def parse_entry(entry) -> GemmConfig | None:
    """A table value: the other path's name ("cublas", "w8a8") -> None, else a config."""
    if isinstance(entry, str):
        if entry not in OTHER_PATHS.values():
            raise ValueError(f"small-M GEMM table: unknown entry {entry!r}")
        return None
    return GemmConfig(**entry)


@functools.cache
def tuned_configs(device: str, kind: str, n: int, k: int) -> dict[int, GemmConfig | None] | None:
    """The table's entries for one weight shape: M bucket -> config (None: cuBLAS), or None if absent."""
    entries = _table(device).get(kind, {}).get(f"{n},{k}")
    if not entries:
        return None
    return {int(m): parse_entry(e) for m, e in entries.items()}


@functools.cache
def default_config(m: int, n: int, k: int, kind: str, device: str = "cuda") -> GemmConfig:
    """Untuned: narrow column tiles, split K until there are about two programs per SM (bounded so each
    split still streams several K steps)."""
    block_n = 32
    block_k = 256 if kind == "fp8" else 128  # rows of 256 bytes per step (block scales: one scale block)
    split = split_for(n, k, block_n, block_k, _sm_count(device))
    return GemmConfig(BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split, num_warps=4, num_stages=4)


def split_for(n: int, k: int, block_n: int, block_k: int, sms: int) -> int:
    """Split K (doubling) until there are about two programs per SM, each split keeping two K steps."""
    split, tiles = 1, -(-n // block_n)
    while tiles * split < 2 * sms and k // (2 * split) >= 2 * block_k:
        split *= 2
    return split


def max_rows(kind: str) -> int:
    """The most rows the kernel takes for a weight kind (module docstring)."""
    return MAX_M_FP8 if kind.startswith("fp8") else MAX_M


def choose_config(m: int, n: int, k: int, kind: str, device: str) -> GemmConfig | None:
    """The config for an (M, N, K) GEMM on `device` (a name as device_name gives it), or None: the layer's
    other path (cuBLAS, or W8A8 for FP8). Tuned entries first (the next M bucket up); otherwise the default
    for FP8 up to MAX_M rows (above it only a tuned entry) and the other path for the rest."""
    if m > max_rows(kind):
        return None
    tuned = tuned_configs(device, kind, n, k)
    if tuned is not None:
        bucket = m_bucket(m)
        if bucket in tuned and (tuned[bucket] is None or not tuned[bucket].GEMV or m <= MAX_GEMV_ROWS):
            return None if tuned[bucket] is not None and tuned[bucket].X_FP8 else tuned[bucket]
    return default_config(m, n, k, kind) if kind.startswith("fp8") and m <= MAX_M else None


def config_to_json(cfg: GemmConfig | None, kind: str = "bf16"):
    return OTHER_PATHS[kind] if cfg is None else asdict(cfg)


def fused_config(n: int, k: int, kind: str, device: str, paired: bool = False, m: int = 1,
                 gemv: bool = False) -> GemmConfig | None:
    """The config of an m-row GEMM with something fused into it (a SiLU-and-mul, the rotary and KV store, an
    add + RMSNorm epilogue, pre-normed rows; `gemv`: an RMSNorm inside its K loop, which only the GEMV runs):
    the table's choice for the weight at m rows where it fuses() (and is a GEMV with `gemv`), else None.
    paired (the SiLU-and-mul, the rotary): each program takes half its rows from one block (gate; a head's
    first half) and half from the other (up; the second half): the same bytes per program, the same grid (a
    tl.dot tile keeps at least 16 rows a block)."""
    if paired and n % 2:
        return None
    cfg = choose_config(m, n, k, kind, device)
    if cfg is None or not fuses(cfg) or (gemv and not cfg.GEMV):
        return None
    if paired and not pairs(cfg):
        return None
    return replace(cfg, BLOCK_N=cfg.BLOCK_N // 2) if paired else cfg


def silu_and_mul_config(n2: int, k: int, kind: str, device: str) -> GemmConfig | None:
    """The fused [gate; up] GEMM + SiLU-and-mul's config at one row (fused_config, paired)."""
    return fused_config(n2, k, kind, device, paired=True)

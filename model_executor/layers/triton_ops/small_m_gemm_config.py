"""Small-M GEMM config tables: the kernel's configs, and the table file tuned per GPU that holds them.

A table (configs/small_m_gemm_<GPU>.json, the GPU's name as torch.cuda.get_device_name gives it, spaces as
underscores; written by benchmarks/tuning/tune_small_m_gemm.py, read once, at the first decode-sized GEMM: the
warm-up before graph capture; never tuned while serving) maps, per weight kind ("bf16", "fp16", "fp8",
"fp8_block"), (N, K) and M bucket, to a config, or to the name of the path the layer takes otherwise where that
measured faster: "cublas" (F.linear) for bf16/fp16, "w8a8" (activation quantization + the FP8 GEMM) for FP8.
Its "_meta" entry records where and how it was tuned (GPU, torch and triton versions, models, date, command).
Which config a layer runs at M rows is small_m_gemm_dispatch.py's choice from these entries.

Pure Python (no Triton import): small_m_gemm.py launches the kernel at these configs, and the tuner and the
layers ask what a table holds.
"""

from __future__ import annotations

import functools
import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

CONFIG_DIR = Path(__file__).parent / "configs"
FP8 = torch.float8_e4m3fn


@dataclass(frozen=True)
class GemmConfig:
    BLOCK_N: int
    BLOCK_K: int
    SPLIT_K: int = 1
    num_warps: int = 4
    num_stages: int = 4
    # Up to small_m_gemm_dispatch.MAX_GEMV_ROWS rows: CUDA-core products instead of tl.dot (BLOCK_N may be
    # below 16).
    GEMV: bool = False
    # FP8 weights: x quantized per token (FP8 codes and a scale per row), the dot on FP8 tensor cores. A table
    # entry with it is a config of the W8A8 path (fp8_linear._w8a8), which quantizes x anyway, not of this
    # weight-only one.
    X_FP8: bool = False
    # Whether the layer's fused paths (small_m_gemm_dispatch.fused_config) take this config where it is
    # single_split: True / False as the tuner measured the fused form against the plain kernel plus the
    # neighbours' own kernels; None (an entry without the key): a GEMV does, a tl.dot tile does not.
    FUSE: bool | None = None
    # A tl.dot tile's paired fusions (the SiLU-and-mul, the rotary: half the tile's rows from each of two blocks)
    # as one dot over the tile gathered from both blocks, split after the loop, instead of a dot per half: a
    # 64-row tile keeps sm_90's wgmma, where its 32-row halves run on mma.sync (docs/kernels.md).
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
    return json.loads(path.read_text())


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


def config_to_json(cfg: GemmConfig | None, kind: str = "bf16"):
    return OTHER_PATHS[kind] if cfg is None else asdict(cfg)

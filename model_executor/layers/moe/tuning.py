"""Block-size configs of the fused MoE kernels: a tuned table per (E, N, K) and GPU, else a default.

Tables are JSON files in moe/configs/ named `E=<experts>,N=<2*I>,K=<H>,device=<GPU name>.json` (N, K: the
w13 GEMM's shape; the GPU name as torch.cuda.get_device_name gives it, spaces as underscores: `NVIDIA_H200`),
with `,dtype=fp8_w8` before `.json` for FP8 expert weights, mapping a token count to the kernel config
measured fastest at it (written by benchmarks/tuning/tune_fused_moe.py). A lookup takes the entry of the smallest
token count at or above its own (the largest past the table), as a CUDA graph pads a batch up to its size: a
batch run eagerly and the padded graph of it then take the same tiles, so their float32 sums (and the
routing near-ties that follow them in the next layer) agree. FP8 weights without a table of their own use the
shape's bf16 table. Read once per file.

The small-batch path (moe/small_batch.py: two GEMV kernels, no align or combine kernel) runs at up to
SMALL_BATCH_MAX_TOKENS tokens. A table entry of such a token count may say which path the tuner measured
faster ("path": "small_batch" or "grouped") and the small-batch kernels' fastest config ("small_batch",
SMALL_KEYS); without them (no table, or one tuned before the small path existed) the small path runs there
with default_small_config.
"""

from __future__ import annotations

import functools
import json
import logging
from pathlib import Path

import torch

logger = logging.getLogger("duet.moe")

CONFIG_DIR = Path(__file__).parent / "configs"
KEYS = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "num_warps", "num_stages")
SMALL_KEYS = ("BLOCK_N", "BLOCK_K", "num_warps", "num_stages", "DOWN_BLOCK_N", "DOWN_BLOCK_K", "down_num_warps",
              "down_num_stages")
PATHS = ("small_batch", "grouped")
# Up to this many tokens the small-batch path is allowed (and, untuned, chosen). At 16 tokens and top 8 of
# 128 experts the 128 assignments hit about 82 distinct experts: the GEMV programs of the tokens sharing one
# re-read its tiles (from L2: they run together), while the grouped path's fixed kernels (align, combine)
# and its BLOCK_M-row tiles for one or two real rows per expert still cost more than that at decode sizes.
# Past it experts are shared by several tokens each, which tl.dot tiles serve better. The tuner measures
# both paths up to here and its table says, per token count, which one runs.
SMALL_BATCH_MAX_TOKENS = 16


def default_config(num_tokens: int) -> dict:
    """Small blocks for decode-sized batches (few assignments per expert), larger ones for extends. Each fits
    the shared memory of an A100/H100-class GPU in float32 too (the gated GEMM holds two B tiles a stage)."""
    if num_tokens <= 32:
        return {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 64, "GROUP_M": 1, "num_warps": 4, "num_stages": 4}
    if num_tokens <= 256:
        return {"BLOCK_M": 32, "BLOCK_N": 64, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 4, "num_stages": 3}
    return {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 4, "num_stages": 3}


def default_small_config(num_tokens: int) -> dict:
    """The small-batch kernels' tiles when no table has them: enough programs to fill the GPU at one token,
    enough bytes in flight per SM to cover HBM latency, no register spills."""
    # At one token on an H200 (132 SMs): the gate-up kernel has k * I / BLOCK_N = 8 * 768 / 16 = 384
    # programs (all resident at once), reading 2 x 16 x 256 weights a K step; the down kernel T * H /
    # DOWN_BLOCK_N = 2048 / 4 = 512, reading k x 4 x 256 a K step. The bytes in flight per SM do not depend on
    # BLOCK_N (more programs, smaller tiles), only on BLOCK_K and the stages: about 3 programs x 3 stages x
    # 16 KB, above the ~55 KB per SM that covers HBM latency (Little's law: ~4.8 TB/s x ~1.5 us over 132
    # SMs). At most 64 float32 accumulators a thread: compiled for sm_90, 120-160 registers, no spills.
    return {"BLOCK_N": 16, "BLOCK_K": 256, "num_warps": 4, "num_stages": 3, "DOWN_BLOCK_N": 4, "DOWN_BLOCK_K": 256,
            "down_num_warps": 4, "down_num_stages": 3}


@functools.cache
def device_name(device: str) -> str:
    if device.startswith("cuda") and torch.cuda.is_available():
        return torch.cuda.get_device_name(torch.device(device)).replace(" ", "_")
    return "cpu"


def table_path(num_experts: int, n: int, k: int, device: str, dtype: str | None = None) -> Path:
    suffix = f",dtype={dtype}" if dtype else ""
    return CONFIG_DIR / f"E={num_experts},N={n},K={k},device={device}{suffix}.json"


@functools.cache
def load_table(num_experts: int, n: int, k: int, device: str, dtype: str | None = None) -> dict[int, dict] | None:
    path = table_path(num_experts, n, k, device, dtype)
    if not path.is_file():
        return None
    table = {int(m): _entry(cfg, path) for m, cfg in json.loads(path.read_text()).items()}
    logger.info("fused MoE configs for E=%d N=%d K=%d on %s: %s", num_experts, n, k, device, path.name)
    return table or None


def _entry(cfg: dict, path: Path) -> dict:
    """A table entry: the grouped config (KEYS), and where tuned, "path" and the "small_batch" config."""
    entry = {key: int(cfg[key]) for key in KEYS}
    if "path" in cfg:
        if cfg["path"] not in PATHS:
            raise ValueError(f"{path.name}: path {cfg['path']!r} is none of {PATHS}")
        entry["path"] = cfg["path"]
    if cfg.get("small_batch"):
        entry["small_batch"] = {key: int(cfg["small_batch"][key]) for key in SMALL_KEYS}
    return entry


@functools.cache
def _no_table(num_experts: int, n: int, k: int, device: str, dtype: str | None) -> None:
    if device != "cpu":  # said once per shape: the kernels run untuned block sizes
        logger.warning("no tuned fused MoE table %s: default block sizes (benchmarks/tuning/tune_fused_moe.py makes "
                       "one)", table_path(num_experts, n, k, device, dtype).name)


def _lookup(num_experts: int, n: int, k: int, num_tokens: int, device: str, dtype: str | None) -> dict | None:
    table = dtype and load_table(num_experts, n, k, device_name(device), dtype)
    table = table or load_table(num_experts, n, k, device_name(device))
    if table is None:
        _no_table(num_experts, n, k, device_name(device), dtype)
        return None
    return table[min((m for m in table if m >= num_tokens), default=max(table))]


def get_config(num_experts: int, n: int, k: int, num_tokens: int, device: str = "cuda",
               dtype: str | None = None) -> dict:
    """The grouped path's config. dtype: None for weights in the activations' dtype, "fp8_w8" for FP8."""
    entry = _lookup(num_experts, n, k, num_tokens, device, dtype)
    return default_config(num_tokens) if entry is None else {key: entry[key] for key in KEYS}


def get_small_config(num_experts: int, n: int, k: int, num_tokens: int, device: str = "cuda",
                     dtype: str | None = None) -> dict:
    """The small-batch kernels' config at this token count (tuned, else the default)."""
    entry = _lookup(num_experts, n, k, num_tokens, device, dtype) or {}
    return entry.get("small_batch") or default_small_config(num_tokens)


def select_path(num_experts: int, n: int, k: int, num_tokens: int, device: str = "cuda",
                dtype: str | None = None) -> tuple[str, dict]:
    """("small_batch", its config) or ("grouped", its config) for this token count (see the module doc)."""
    if num_tokens <= SMALL_BATCH_MAX_TOKENS:
        entry = _lookup(num_experts, n, k, num_tokens, device, dtype) or {}
        if entry.get("path", "small_batch") == "small_batch":
            return "small_batch", entry.get("small_batch") or default_small_config(num_tokens)
    return "grouped", get_config(num_experts, n, k, num_tokens, device, dtype)

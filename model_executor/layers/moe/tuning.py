"""Block-size configs of the fused MoE kernels: a tuned table per (E, N, K) and GPU, else a default.

Tables are JSON files in moe/configs/ named `E=<experts>,N=<2*I>,K=<H>,device=<GPU name>.json` (N, K: the
w13 GEMM's shape; the GPU name as torch.cuda.get_device_name gives it, spaces as underscores: `NVIDIA_H200`),
with `,dtype=fp8_w8` before `.json` for FP8 expert weights, mapping a token count to the kernel config
measured fastest at it (written by benchmarks/tune_fused_moe.py). A lookup takes the entry of the nearest
token count; FP8 weights without a table of their own use the shape's bf16 table. Read once per file.
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


def default_config(num_tokens: int) -> dict:
    """Small blocks for decode-sized batches (few assignments per expert), larger ones for extends. Each fits
    the shared memory of an A100/H100-class GPU in float32 too (the gated GEMM holds two B tiles a stage)."""
    if num_tokens <= 32:
        return {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 64, "GROUP_M": 1, "num_warps": 4, "num_stages": 4}
    if num_tokens <= 256:
        return {"BLOCK_M": 32, "BLOCK_N": 64, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 4, "num_stages": 3}
    return {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 4, "num_stages": 3}


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
    table = {int(m): {key: int(cfg[key]) for key in KEYS} for m, cfg in json.loads(path.read_text()).items()}
    logger.info("fused MoE configs for E=%d N=%d K=%d on %s: %s", num_experts, n, k, device, path.name)
    return table or None


@functools.cache
def _no_table(num_experts: int, n: int, k: int, device: str, dtype: str | None) -> None:
    if device != "cpu":  # said once per shape: the kernels run untuned block sizes
        logger.warning("no tuned fused MoE table %s: default block sizes (benchmarks/tune_fused_moe.py makes "
                       "one)", table_path(num_experts, n, k, device, dtype).name)


def get_config(num_experts: int, n: int, k: int, num_tokens: int, device: str = "cuda",
               dtype: str | None = None) -> dict:
    """dtype: None for weights in the activations' dtype, "fp8_w8" for FP8 weights."""
    table = dtype and load_table(num_experts, n, k, device_name(device), dtype)
    table = table or load_table(num_experts, n, k, device_name(device))
    if table is None:
        _no_table(num_experts, n, k, device_name(device), dtype)
        return default_config(num_tokens)
    return table[min(table, key=lambda m: abs(m - num_tokens))]

"""The small-M GEMM path: which kernel a linear layer runs at M rows, and the switch that turns the path off.

At decode-sized batches a linear layer is a read of its weight. The small-M kernel (small_m_gemm.py) streams
the weight once at memory bandwidth, and runs the norm, the activation, the rotary or the residual add next to
it in the same kernel. A linear with M rows of x on a CUDA device runs:

    weight      M       kernel
    bf16/fp16   1-16    the table's config for M's bucket; where the table says "cublas" or has no entry,
                        F.linear (cuBLAS)
                17+     F.linear
    FP8         1-16    the table's config; "w8a8" or an X_FP8 entry: the W8A8 path (activations quantized per
                        token, then torch._scaled_mm or the block-scaled GEMM); no entry: the kernel's
                        default config (weight-only FP8 reads half of bf16's bytes and skips the activation
                        quantization: it needs no table to win)
                17-64   the table's config; an X_FP8 entry: the W8A8 path with this kernel as its GEMM; no
                        entry: the W8A8 path
                65+     the W8A8 path

M takes the config of the next bucket up (M_BUCKETS). The fusions (the SiLU-and-mul, the RMSNorm before the
GEMM, the rotary + KV store after it, the residual add + RMSNorm epilogue) run up to MAX_FUSED_ROWS rows where
the config for those rows fuses (small_m_gemm_config.fuses); the RMSNorm inside the K loop only in a GEMV, up to
MAX_GEMV_ROWS rows. The layers ask here (quantization/base.py, fp8_linear.py, linear.py, embedding.py);
elsewhere they run their plain path.

The table is configs/small_m_gemm_<GPU>.json (small_m_gemm_config.py reads it; benchmarks/tuning/
tune_small_m_gemm.py writes it, docs/kernels.md). `configure` runs at start-up: it logs the table file in use,
or warns that none fits this GPU. With configure(enabled=False) (the server's --disable-small-m-gemm) every
linear runs its plain path: F.linear for bf16, the W8A8 GEMM for FP8.

Pure Python: importing this module imports neither Triton nor the kernel.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

import torch

from model_executor.layers.triton_ops.small_m_gemm_config import (
    GemmConfig,
    default_config,
    device_name,
    fuses,
    pairs,
    table_path,
    tiles_scale_block,
    tuned_configs,
    weight_kind,
)

logger = logging.getLogger("duet.small_m_gemm")

MAX_M = 16  # rows of x (bf16 / fp16 weights); the tl.dot tile's padded row count (its minimum) up to it
# FP8 weights up to this many rows, above MAX_M only where the table has a config for the bucket (against the
# W8A8 path: activation quantization + the FP8 GEMM). Above MAX_M the dot pads the rows to a power of two.
MAX_M_FP8 = 64
# A GEMV config (CUDA-core products) runs up to this many rows: the weight tile is loaded and converted once
# and multiplied into each row's accumulator (a tile of float32 sums per row: registers bound the count).
MAX_GEMV_ROWS = 4
# The fusions take up to this many rows: a GEMV config up to MAX_GEMV_ROWS, a single-split tl.dot tile up to
# its padded rows.
MAX_FUSED_ROWS = 16
# The row counts the table is tuned at: a batch takes the next one up's config, so the bits of a row can
# change between two batch sizes only across one of these.
M_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
assert MAX_GEMV_ROWS <= MAX_FUSED_ROWS <= MAX_M <= MAX_M_FP8 == M_BUCKETS[-1]

# Devices whose linears may take the kernel (tests add "cpu": the kernel then runs in Triton's interpreter).
DEVICES = ("cuda",)


@dataclass
class _Switch:
    enabled: bool = True


_switch = _Switch()  # one model per process: the server's flag, set at start-up by configure


def configure(enabled: bool, device: torch.device | str) -> None:
    """Turn the small-M path on or off for this process (the runner calls it at start-up, before the model
    runs) and, on a device the path serves, log the table in use, or warn that none fits this GPU."""
    _switch.enabled = enabled
    device = torch.device(device)
    if device.type not in DEVICES:
        return
    if not enabled:
        logger.info("small-M GEMM off (--disable-small-m-gemm): bf16 linears run cuBLAS, FP8 ones the W8A8 GEMM")
        return
    gpu = device_name(str(device))
    path = table_path(gpu)
    if path.is_file():
        logger.info("small-M GEMM configs for %s: %s", gpu, path.name)
    else:
        logger.warning("no small-M GEMM table %s for this GPU: bf16 linears run cuBLAS, FP8 ones the kernel's "
                       "default configs up to %d rows (benchmarks/tuning/tune_small_m_gemm.py makes one)",
                       path.name, MAX_M)


def enabled() -> bool:
    return _switch.enabled


# ---------------------------------------------------------------- the table's choice


def m_bucket(m: int) -> int:
    return next(b for b in M_BUCKETS if b >= m)


def max_rows(kind: str) -> int:
    """The most rows the kernel takes for a weight kind ("bf16", "fp16", "fp8", "fp8_block")."""
    return MAX_M_FP8 if kind.startswith("fp8") else MAX_M


def choose_config(m: int, n: int, k: int, kind: str, device: str) -> GemmConfig | None:
    """The kernel's config for an (M, N, K) GEMM on `device` (a name as device_name gives it), or None: the
    layer's other path (cuBLAS, or W8A8 for FP8). Tuned entries first (the next M bucket up; a GEMV entry only
    up to MAX_GEMV_ROWS rows; an X_FP8 entry belongs to the W8A8 path); otherwise the default for FP8 up to
    MAX_M rows (above it only a tuned entry) and the other path for the rest."""
    if m > max_rows(kind):
        return None
    tuned = tuned_configs(device, kind, n, k)
    if tuned is not None:
        bucket = m_bucket(m)
        if bucket in tuned and (tuned[bucket] is None or not tuned[bucket].GEMV or m <= MAX_GEMV_ROWS):
            return None if tuned[bucket] is not None and tuned[bucket].X_FP8 else tuned[bucket]
    return default_config(m, n, k, kind) if kind.startswith("fp8") and m <= MAX_M else None


def fused_config(n: int, k: int, kind: str, device: str, paired: bool = False, m: int = 1,
                 gemv: bool = False) -> GemmConfig | None:
    """The config of an m-row GEMM with something fused into it (a SiLU-and-mul, the rotary and KV store, an
    add + RMSNorm epilogue, pre-normed rows; `gemv`: an RMSNorm inside its K loop, which only the GEMV runs):
    choose_config's where it fuses() (and is a GEMV with `gemv`), else None. paired (the SiLU-and-mul, the
    rotary): each program takes half its rows from one block (gate; a head's first half) and half from the
    other (up; the second half): the same bytes per program, the same grid (a tl.dot tile keeps at least 16
    rows a block)."""
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


# ---------------------------------------------------------------- a layer's rows


def device_key(x: torch.Tensor) -> str:
    """The table's name for x's device ("cpu" for the interpreter's tensors)."""
    return device_name(str(x.device)) if x.is_cuda else "cpu"


def tracing() -> bool:
    """Whether something traces (dynamo, a dispatch mode): the fused paths then stay out of the graph."""
    return torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack() > 0


def may_take(m: int, weight: torch.Tensor, block: tuple[int, int] | None) -> bool:
    """Whether the kernel can take M rows of this weight at all: 1 <= M <= its row limit, K steps that tile
    the scale blocks, and not while dynamo compiles (the piecewise runner traces a symbolic token count once
    for every size: a branch on it would add a guard and a recompile, so its pieces keep the other path)."""
    if torch.compiler.is_compiling() or not 0 < m <= max_rows(weight_kind(weight, block)):
        return False
    return block is None or tiles_scale_block(block[1])  # steps must not straddle two scale blocks


def use_small_m(x2: torch.Tensor, weight: torch.Tensor, block: tuple[int, int] | None = None) -> bool:
    """Whether a linear with these rows x2 [M, K] takes the kernel (weight-only), whatever its device: a
    table entry, or for FP8 weights up to MAX_M rows the default config (may_take, choose_config)."""
    m = x2.shape[0]
    if not may_take(m, weight, block):
        return False
    n, k = weight.shape
    return choose_config(m, n, k, weight_kind(weight, block), device_key(x2)) is not None


def act_quant_config(xq: torch.Tensor, weight: torch.Tensor,
                     block: tuple[int, int] | None = None) -> GemmConfig | None:
    """The table's X_FP8 config for FP8 rows xq [M, K] and an FP8 weight (per-channel or block scales): the
    W8A8 path then runs this kernel instead of torch._scaled_mm or the block GEMM. None otherwise."""
    m = xq.shape[0]
    if not may_take(m, weight, block):
        return None
    tuned = tuned_configs(device_key(xq), weight_kind(weight, block), weight.shape[0], weight.shape[1])
    cfg = None if tuned is None else tuned.get(m_bucket(m))
    return cfg if cfg is not None and cfg.X_FP8 else None


def paired_config(x2: torch.Tensor, weight: torch.Tensor, block: tuple[int, int] | None) -> GemmConfig | None:
    """The table's fused config for a GEMM of this weight at x2's rows whose epilogue pairs its rows (the
    SiLU-and-mul, the rotary: half the column tile), or None (fused_config; above MAX_FUSED_ROWS rows, or while
    something traces)."""
    if not 0 < x2.shape[0] <= MAX_FUSED_ROWS or tracing():
        return None
    return fused_config(weight.shape[0], weight.shape[1], weight_kind(weight, block), device_key(x2), True,
                        x2.shape[0])


def takes_prenormed(x2: torch.Tensor, weight: torch.Tensor, block: tuple[int, int] | None) -> bool:
    """Whether a GEMM of this weight at x2's rows can take a PrenormedRow (the table's config for that many
    rows fuses, paired or not: the SiLU-and-mul and the rotary epilogue take half the column tile)."""
    return paired_config(x2, weight, block) is not None


def takes_kernel(x: torch.Tensor, weight: torch.Tensor, block: tuple[int, int] | None = None) -> bool:
    """Whether this linear (rows x [..., K] times `weight`) runs the small-M kernel, weight-only: the path on,
    a device it serves, not under dynamo, a decode-sized batch, and use_small_m."""
    if not _switch.enabled or x.device.type not in DEVICES or torch.compiler.is_compiling():
        return False
    if x.numel() > MAX_M_FP8 * x.shape[-1]:  # (above every weight kind's row limit)
        return False
    return use_small_m(x.reshape(-1, x.shape[-1]), weight, block)


def takes_fused_rows(x: torch.Tensor, weight: torch.Tensor, block: tuple[int, int] | None) -> bool:
    """takes_kernel for at most MAX_FUSED_ROWS contiguous rows x [..., K] (the fused paths' limit)."""
    # (compiling first: a symbolic token count compared with a constant would add a guard to the traced graph)
    if torch.compiler.is_compiling() or x.numel() > MAX_FUSED_ROWS * x.shape[-1] or not x.is_contiguous():
        return False
    return takes_kernel(x, weight, block)


def act_quant_kernel_config(xq: torch.Tensor, weight: torch.Tensor,
                            block: tuple[int, int] | None = None) -> GemmConfig | None:
    """The kernel's X_FP8 config where the W8A8 GEMM of FP8 rows xq [M, K] runs on it (act_quant_config, with
    the path on and a device it serves), else None: torch._scaled_mm or the block GEMM."""
    if not _switch.enabled or xq.device.type not in DEVICES or xq.shape[0] > MAX_M_FP8:
        return None
    return act_quant_config(xq, weight, block)

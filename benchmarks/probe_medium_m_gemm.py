"""probe_medium_m_gemm: could a Triton GEMM beat cuBLAS at an extend's row counts (M = 64-256)? (issue 23)

The 128-token Llama-3.2-1B extend spends 0.83 of its 1.25 ms of kernels in cuBLAS GEMMs at M = 128 (eighth
session's profile): 2.3 TB/s over its 1.94 GB of layer weights, qkv (12.6 MB) in 7.3 us and o_proj (8.4 MB) in
6.6 us; at M = 128 a bf16 GEMM is near the H200's ridge (2 * 128 / 2 = 128 FLOP a byte), so both the bytes
and the tensor cores bound it. The small-M kernel stops at 16 rows and the piecewise graphs trace the linear
layers through F.linear. Before building anything, this probe times, on cold weights in one CUDA graph
(tune_small_m_gemm.time_calls), F.linear under cuBLAS and under cuBLASLt against a minimal Triton split-K
GEMM over a small grid of tiles, and against the small-M kernel let past its row limit (`--kernels small_m`),
per (N, K) of the model's linear layers and M, and reports TB/s of weight read and the best Triton config's
ratio to cuBLAS. Measured on the H200 (docs/benchmarks.md, thirteenth and thirty-third sessions), both lose to
cuBLAS at 128 rows but on gate_up, where they tie.

    python -m benchmarks.probe_medium_m_gemm --json out.json
    python -m benchmarks.probe_medium_m_gemm --model llama-3.1-8b --m 128 256
    python -m benchmarks.probe_medium_m_gemm --m 128 --kernels small_m
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys

import torch
import triton
import triton.language as tl

TILES = [(bn, bk) for bn in (64, 128) for bk in (64, 128)]
# The small-M kernel (triton_ops/small_m_gemm.py: the swapped dot, rows padded to a power of two, split K with
# its reduce in the kernel) let past its row limit: (BLOCK_N, BLOCK_K, warps, stages), and split counts that
# give about one to two waves of programs on the GPU.
SMALL_M_TILES = ((64, 64, 4, 4), (64, 128, 4, 3), (128, 64, 8, 4), (128, 128, 8, 3))
SMALL_M_PROGRAMS = (64, 300)
SPLITS = (1, 2, 4)
WARPS_STAGES = ((4, 3), (8, 3), (4, 4))


@triton.jit
def _gemm_kernel(X, W, Y, M, k_per_split, stride_xm, stride_wn, stride_ym, stride_ys,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Program (n, m, s): Y[s][m-tile, n-tile] = X[m-tile, K range s] @ W[n-tile, K range s]^T, stored in Y's
    dtype (fp32 partials when K is split; with one split Y is the output). N and K multiples of the tiles;
    M rows masked."""
    pid_n, pid_m, pid_s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    rows_m = tl.where(offs_m < M, offs_m, 0)
    k0 = pid_s * k_per_split
    w_ptrs = W + offs_n[:, None].to(tl.int64) * stride_wn + (k0 + offs_k)[None, :]
    x_ptrs = X + rows_m[None, :] * stride_xm + (k0 + offs_k)[:, None]
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for _ in range(0, k_per_split, BLOCK_K):
        acc = tl.dot(tl.load(w_ptrs), tl.load(x_ptrs), acc)
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    y_ptrs = Y + pid_s * stride_ys + offs_m[None, :] * stride_ym + offs_n[:, None]
    tl.store(y_ptrs, acc.to(Y.dtype.element_ty), mask=(offs_m < M)[None, :])


def triton_call(x: torch.Tensor, w: torch.Tensor, bn: int, bk: int, split: int, warps: int, stages: int):
    """A call that computes x @ w^T; split > 1 writes fp32 partials and sums them (a second kernel). Row tiles
    of 64 or 128 (M = 256 reads each weight tile twice, the second time mostly from L2)."""
    m, k = x.shape
    n = w.shape[0]
    bm = 64 if m <= 64 else 128
    out = torch.empty(m, n, device=x.device, dtype=x.dtype)
    ws = torch.empty(split, m, n, device=x.device, dtype=torch.float32) if split > 1 else out
    grid = (n // bn, triton.cdiv(m, bm), split)

    def call():
        _gemm_kernel[grid](x, w, ws, m, k // split, x.stride(0), w.stride(0), n, m * n,
                           BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=stages)
        if split > 1:
            torch.sum(ws, dim=0, out=out)
        return out

    return call


def small_m_configs(n: int, k: int) -> list:
    from model_executor.layers.triton_ops.small_m_gemm import GemmConfig

    out = []
    for bn, bk, warps, stages in SMALL_M_TILES:
        for split in (1, 2, 4, 8, 16):
            programs = triton.cdiv(n, bn) * split
            if k // split >= bk and (SMALL_M_PROGRAMS[0] <= programs <= SMALL_M_PROGRAMS[1] or split == 1):
                out.append(GemmConfig(BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=split, num_warps=warps, num_stages=stages))
    return out


def small_m_call(x: torch.Tensor, w: torch.Tensor, cfg):
    """The small-M kernel at M rows. Its row limit and in-kernel reduce limit are lifted for this probe's
    process (module globals: nothing else runs here)."""
    from model_executor.layers.triton_ops import small_m_gemm as sm
    from model_executor.layers.triton_ops import small_m_gemm_config as smc

    sm.max_rows = smc.max_rows = lambda kind: max(256, x.shape[0])
    sm.IN_KERNEL_REDUCE_MAX_ROWS = max(256, x.shape[0])
    return lambda: sm._launch(x, w, None, None, None, cfg)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="llama-3.2-1b")
    p.add_argument("--m", type=int, nargs="+", default=[64, 128, 256])
    p.add_argument("--kernels", nargs="+", choices=("plain", "small_m"), default=["plain", "small_m"],
                   help="Triton candidates: the minimal split-K GEMM above, the small-M kernel past its rows")
    p.add_argument("--json", dest="json_out")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("probe_medium_m_gemm needs a CUDA device", file=sys.stderr)
        return 2
    import torch.nn.functional as F

    from benchmarks.tune_small_m_gemm import Weights, linear_shapes, time_calls
    from model_executor.configs import shape_path
    from model_executor.model_config import ModelConfig

    cfg = ModelConfig.from_pretrained(str(shape_path(args.model)))
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    print(f"{'layer':>8} {'N':>6} {'K':>6} {'M':>4} {'cublas us':>9} {'TB/s':>5} {'cublasLt us':>11} "
          f"{'triton us':>9} {'TB/s':>5} {'/cublas':>7}  best triton config")
    for name, (n, k) in linear_shapes(cfg, 1).items():
        wts = Weights("bf16", n, k, gen)
        for m in args.m:
            x = torch.randn(m, k, device="cuda", generator=gen).bfloat16()
            ref = F.linear(x, wts.w[0]).float()
            lib = {}
            default = torch.backends.cuda.preferred_blas_library()
            for backend in ("cublas", "cublaslt"):
                torch.backends.cuda.preferred_blas_library(backend)
                lib[backend] = time_calls([lambda w=w, x=x: F.linear(x, w) for w in wts.w])
            torch.backends.cuda.preferred_blas_library(default)
            best = None
            candidates = []
            if "plain" in args.kernels:
                candidates += [(f"{bn}x{bk} split {split} {warps}w/{stages}s",
                                lambda w, x=x, c=(bn, bk, split, warps, stages): triton_call(x, w, *c))
                               for (bn, bk), split, (warps, stages) in itertools.product(TILES, SPLITS, WARPS_STAGES)
                               if not (n % bn or k % (bk * split))]
            if "small_m" in args.kernels:
                candidates += [(f"small-M {c.BLOCK_N}x{c.BLOCK_K} split {c.SPLIT_K} {c.num_warps}w/{c.num_stages}s",
                                lambda w, x=x, c=c: small_m_call(x, w, c)) for c in small_m_configs(n, k)]
            for label, make in candidates:
                calls = [make(w) for w in wts.w]
                try:
                    err = float((calls[0]().float() - ref).abs().max() / ref.abs().max())
                    us = time_calls(calls)
                except Exception as exc:  # noqa: BLE001 (a tile over the GPU's resources: skip it)
                    print(f"  {label}: {type(exc).__name__}", file=sys.stderr)
                    continue
                if err > 1e-2:
                    raise RuntimeError(f"{name} M={m} {label}: relative error {err:.2e}")
                if best is None or us < best[0]:
                    best = (us, label)
            row = {"layer": name, "n": n, "k": k, "m": m, "cublas_us": lib["cublas"], "cublaslt_us": lib["cublaslt"],
                   "triton_us": best[0] if best else None, "triton_config": best[1] if best else None}
            rows.append(row)
            tb = wts.bytes / 1e6
            t_us = best[0] if best else float("nan")
            print(f"{name:>8} {n:>6} {k:>6} {m:>4} {lib['cublas']:>9.2f} {tb / lib['cublas']:>5.2f} "
                  f"{lib['cublaslt']:>11.2f} {t_us:>9.2f} {tb / t_us:>5.2f} {t_us / lib['cublas']:>7.2f}  "
                  f"{best[1] if best else '-'}", flush=True)
        del wts
        torch.cuda.empty_cache()
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "model": args.model, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

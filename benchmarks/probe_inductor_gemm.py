"""probe_inductor_gemm: does any of inductor's Triton GEMM templates beat cuBLAS at decode/extend row counts?
(issue 23)

The 128-token Llama-3.2-1B extend spends ~0.83 of its ~1.21 ms of kernels in cuBLAS GEMMs at M = 128, reading
its 1.94 GB of layer weights at ~2.3 TB/s; Llama-3.1-8B decode at 32-256 requests runs its GEMMs in cuBLAS too
(the small-M table stops at 16 rows). The thirteenth session's minimal Triton split-K GEMM
(probe_medium_m_gemm) lost to cuBLAS on three of four 1B shapes. This probe asks the wider question with
inductor's own search: F.linear compiled with max-autotune (ATen and Triton backends, the persistent TMA
templates enabled, the rest of inductor's defaults), one static shape per (N, K, M), timed on cold weights in one CUDA graph
(tune_small_m_gemm.time_calls) against F.linear. Inductor keeps ATen where it measured faster, so
"compiled / cuBLAS" near 1.0 means no template won; its choice per shape is printed (the autotune table
inductor writes to stderr lists every candidate's time).

    python -m benchmarks.probe_inductor_gemm --model llama-3.2-1b --m 128 --json out.json
    python -m benchmarks.probe_inductor_gemm --model llama-3.1-8b --m 32 256
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch
import torch._dynamo
import torch._inductor.config as ic
import torch.nn.functional as F


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", nargs="+", default=["llama-3.2-1b"])
    p.add_argument("--m", type=int, nargs="+", default=[128])
    p.add_argument("--json", dest="json_out")
    p.add_argument("--budget-s", type=float, default=480.0, help="stop starting new shapes after this long")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("probe_inductor_gemm needs a CUDA device", file=sys.stderr)
        return 2
    from benchmarks.tune_small_m_gemm import Weights, linear_shapes, time_calls
    from model_executor.configs import shape_path
    from model_executor.model_config import ModelConfig

    ic.max_autotune_gemm_backends = "ATEN,TRITON"
    ic.triton.enable_persistent_tma_matmul = True
    torch._dynamo.config.cache_size_limit = 256
    start = time.perf_counter()
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    print(f"{'model':>14} {'layer':>8} {'N':>6} {'K':>6} {'M':>4} {'cublas us':>9} {'TB/s':>5} {'compiled us':>11} "
          f"{'TB/s':>5} {'/cublas':>7} {'max rel err':>11} {'compile s':>9}", flush=True)
    for model in args.model:
        cfg = ModelConfig.from_pretrained(str(shape_path(model)))
        for name, (n, k) in linear_shapes(cfg, 1).items():
            wts = Weights("bf16", n, k, gen)
            for m in args.m:
                if time.perf_counter() - start > args.budget_s:
                    print(f"budget spent: {model} {name} M={m} and after not run", flush=True)
                    break
                x = torch.randn(m, k, device="cuda", generator=gen).bfloat16()
                ref = F.linear(x, wts.w[0]).float()
                cublas_us = time_calls([lambda w=w: F.linear(x, w) for w in wts.w])

                def linear(a, b):
                    return F.linear(a, b)

                compiled = torch.compile(linear, mode="max-autotune-no-cudagraphs", dynamic=False, fullgraph=True)
                t0 = time.perf_counter()
                out = compiled(x, wts.w[0])
                torch.cuda.synchronize()
                compile_s = time.perf_counter() - t0
                err = float((out.float() - ref).abs().max() / ref.abs().max())
                comp_us = time_calls([lambda w=w: compiled(x, w) for w in wts.w])
                tb = wts.bytes / 1e6
                row = {"model": model, "layer": name, "n": n, "k": k, "m": m, "cublas_us": round(cublas_us, 3),
                       "compiled_us": round(comp_us, 3), "ratio": round(comp_us / cublas_us, 3),
                       "max_rel_err": err, "compile_s": round(compile_s, 1)}
                rows.append(row)
                print(f"{model:>14} {name:>8} {n:>6} {k:>6} {m:>4} {cublas_us:>9.2f} {tb / cublas_us:>5.2f} "
                      f"{comp_us:>11.2f} {tb / comp_us:>5.2f} {comp_us / cublas_us:>7.3f} {err:>11.2e} "
                      f"{compile_s:>9.1f}", flush=True)
                if args.json_out:  # after every row: a call cut short keeps what it measured
                    with open(args.json_out, "w") as f:
                        json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows},
                                  f, indent=1)
            del wts
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""probe_fp8_weight_range: where does the FP8-weight small-M kernel stop giving finite, accurate outputs as bf16
activations grow? (issue 18)

The weight-only FP8 path runs its tensor-core dot in fp16, with bf16 x rescaled by X_PRESCALE (2^-4) into
fp16's range. The interpreter test `test_fp8_weights_keep_bf16_range_of_x` (x up to 6.1e5) passes on the CPU
and returned non-finite outputs on the H200 (twenty-second session). This probe runs that test's weight with
x's every ninth column scaled by 1 .. 3e5 (and every ninth + 1 by 1e-6, as the test does, or not), for a
split-K and a single-split config, and prints the non-finite count and the error against float32 math; then
the mma and conversion instructions of each compiled variant's PTX. It found (twenty-third session) the outputs
breaking at |x| > 65504: LLVM had turned the prescale into an fp16 multiply after the conversion, fixed by
triton_ops/kernels.py's to_f16_scaled.

    python -m benchmarks.probe_fp8_weight_range --json out.json
"""

from __future__ import annotations

import argparse
import json
import re
import sys

import torch

CONFIGS = {"split K": {"BLOCK_N": 16, "BLOCK_K": 32, "SPLIT_K": 3, "num_warps": 4, "num_stages": 2},
           "one split": {"BLOCK_N": 32, "BLOCK_K": 64, "SPLIT_K": 1, "num_warps": 4, "num_stages": 2}}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", dest="json_out")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("probe_fp8_weight_range needs a CUDA device", file=sys.stderr)
        return 2
    from model_executor.layers.quantization import fp8_math as fm
    from model_executor.layers.triton_ops import small_m_gemm as sm

    w = torch.randn(40, 128, generator=torch.Generator().manual_seed(11)) * 0.1
    q, s = fm.quantize_fp8_per_channel(w)
    w_deq = q.float() * s[:, None]
    rows = []
    print(f"{'x scale':>8} {'tiny':>6} {'config':>10} {'non-finite':>10} {'nan':>4} {'max|ref|':>10} {'rel err':>9}")
    for big in (1.0, 1e2, 1e3, 1e4, 3e4, 1e5, 3e5):
        for tiny in (1.0, 1e-6):
            x = torch.randn(4, 128, generator=torch.Generator().manual_seed(12))
            x[:, ::9] *= big
            x[:, 1::9] *= tiny
            x = x.to(torch.bfloat16)
            ref = x.float() @ w_deq.t()
            for name, cfg in CONFIGS.items():
                out = sm.small_m_linear(x.cuda(), q.cuda(), s.cuda(), None, None,
                                        config=sm.GemmConfig(**cfg)).float().cpu()
                bad = int((~torch.isfinite(out)).sum())
                err = ((out - ref).abs() / ref.abs().max()).nan_to_num(float("inf")).max().item()
                rows.append({"x_scale": big, "tiny": tiny, "config": name, "non_finite": bad,
                             "nan": int(out.isnan().sum()), "max_ref": ref.abs().max().item(), "rel_err": err})
                print(f"{big:>8g} {tiny:>6g} {name:>10} {bad:>10} {rows[-1]['nan']:>4} "
                      f"{rows[-1]['max_ref']:>10.3e} {err:>9.2e}")
    for cache in sm._small_m_gemm_kernel.device_caches.values():
        for kernel in cache[0].values():
            ptx = kernel.asm["ptx"]
            print(sorted(set(re.findall(r"(?:wgmma|mma)\.[\w.]+", ptx))), sorted(set(re.findall(r"cvt\.[\w.]+", ptx))))
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"benchmark": "probe_fp8_weight_range", "gpu": torch.cuda.get_device_name(),
                       "torch": torch.__version__, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

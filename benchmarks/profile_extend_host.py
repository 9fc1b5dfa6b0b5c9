"""Host time of one piecewise extend replay, piece by piece: where the CPU spends a small prefill.

    python -m benchmarks.profile_extend_host --model llama-3.2-1b --tokens 128 --json out.json

Each row runs one component back to back `--iters` times without synchronizing and reports the host time
per call ("host us") and, after a final synchronize, the wall time per call ("wall us"; when it exceeds the
host time, the GPU was the limit). Needs a CUDA device (the Triton backend and the captured pieces).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from datetime import datetime, timezone

import torch
import triton
import triton.language as tl

from benchmarks.bench_prefill import prepare
from model_executor.configs import SHAPES, shape_path
from model_executor.layers.attention.attention_op import attention_impl
from model_executor.layers.attention.forward_context import forward_context
from model_executor.layers.logits import compute_logits
from runners.model_runner import ModelRunner, RunnerConfig
from runners.piecewise_cuda_graph_runner import Phase, PiecewiseCudaGraphRunner


def host_and_wall_us(fn, iters: int, warmup: int = 10) -> tuple[float, float]:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    return (t1 - t0) / iters * 1e6, (t2 - t0) / iters * 1e6


@triton.jit
def _empty_kernel(a, b, c, d, e, f, g, h, i, j, k, l, m, n, o, p, q, r, s, t, BLOCK: tl.constexpr):
    pass


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.profile_extend_host",
                                description=__doc__.splitlines()[0])
    p.add_argument("--model", default="llama-3.2-1b", choices=SHAPES, help="a model shape, random weights")
    p.add_argument("--tokens", type=int, default=128, help="tokens of the extend batch (one request)")
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--json", dest="json_out", help="write the results here")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("needs a CUDA device")
    n = args.tokens
    cfg = RunnerConfig(model_path=str(shape_path(args.model)), device="cuda", attention_backend="triton",
                       max_running_requests=8, max_total_tokens=n + 64, context_length=n + 64, random_weights=True,
                       disable_cuda_graph=True, disable_piecewise_cuda_graph=True)
    runner = ModelRunner(cfg)
    pw = PiecewiseCudaGraphRunner(runner, [n])
    fb, _, _ = prepare(runner, n, 1, 0)
    layer = pw.attention_layers[0]
    heads, kv_heads, head_dim = layer.num_heads, layer.num_kv_heads, layer.head_dim
    dev, dtype = runner.device, runner.dtype
    q = torch.randn(n, heads * head_dim, device=dev, dtype=dtype)
    k = torch.randn(n, kv_heads * head_dim, device=dev, dtype=dtype)
    v = torch.randn_like(k)
    out = torch.empty_like(q)
    hidden = torch.randn(n, runner.model_config.hidden_size, device=dev, dtype=dtype)
    ints, tensors = list(range(1, 12)), [q] * 9
    piece = pw.pieces[1].entries[pw.levels[-1]].graph
    level = pw.levels[-1]

    many, few = args.iters, max(10, args.iters // 4)
    components = [  # (name, fn, iterations, needs the forward context: the op reads the batch from it)
        ("eager forward", lambda: runner.forward_eager(fb), few, False),
        ("piecewise replay (all of it)", lambda: pw.replay(fb), many, False),
        ("  inputs into static buffers", lambda: pw.buffers.load(fb, level), many, False),
        ("  pieces + attention (split module)", lambda: pw._run_backbone(fb, level, Phase.REPLAY), many, False),
        ("  one piece: graph.replay()", piece.replay, many, False),
        ("  logits head on the last token", lambda: compute_logits(pw.model.lm_head, hidden, fb), many, False),
        ("attention op through the dispatcher", lambda: torch.ops.duet.attention(q, k, v, out, 0), many, True),
        ("attention op implementation, direct", lambda: attention_impl(q, k, v, out, 0), many, True),
        ("  backend.forward (KV store + attention)",
         lambda: runner.attn_backend.forward(q, k, v, layer, fb, out=out), many, False),
        ("empty Triton kernel, 20 arguments", lambda: _empty_kernel[(1,)](*tensors, *ints, BLOCK=16), many, False),
    ]
    rows = []
    with torch.inference_mode():
        for name, fn, iters, needs_context in components:
            with forward_context(fb, pw.attention_layers) if needs_context else contextlib.nullcontext():
                host, wall = host_and_wall_us(fn, iters)
            rows.append({"component": name.strip(), "host_us": round(host, 1), "wall_us": round(wall, 1)})
            print(f"{name:<45} host {host:9.1f} us   wall {wall:9.1f} us", flush=True)
    report = {"benchmark": "profile_extend_host", "model": args.model, "tokens": n, "iters": args.iters,
              "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
              "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "results": rows}
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""probe_compiled_decode: decode graphs of the torch.compile'd model against today's decode graphs.

Issue 23 asks whether inductor inside the decode graphs measures faster (`--enable-torch-compile` reaches only
the piecewise extend pieces; it compiled Llama-3.2-1B bs=1 to 1.27 ms in an early probe, before the fused
decode kernels). Here the model's decode forward is compiled (`fullgraph`, one static specialization per batch
size, attention the opaque `duet::attention` op reading the static batch from the forward context, as the
piecewise runner does) and each size captured in a CUDA graph of its own, then timed against
`CudaGraphRunner` on the same batches. Under dynamo the model takes its traceable path: no small-M GEMV table,
no norms fused into GEMVs, no rotary fused into the KV store; the Triton norm / rotary / SiLU kernels stay
opaque ops; inductor sees the GEMMs and what is left between them.

    python -m benchmarks.probe_compiled_decode --model llama-3.2-1b --batch-size 1 64 256 --json out.json
    python -m benchmarks.probe_compiled_decode --model llama-3.1-8b --batch-size 1 256 --mode max-autotune-no-cudagraphs

Columns: "graph ms" today's decode graph and "compiled ms" the compiled one (one step each, host launch to
sync), "b2b" the same launched back to back; "max|diff|" the compiled graph's logits against eager on the first
batch.
"""

from __future__ import annotations

import argparse
import json
import time
from datetime import datetime, timezone

import torch

from benchmarks.bench_one_batch import (
    measure_copy_bandwidth,
    prepare,
    step_read_bytes,
    time_back_to_back,
    time_steps,
)
from model_executor.configs import SHAPES, shape_path
from model_executor.forward_batch import ForwardBatch
from model_executor.layers.attention.forward_context import forward_context
from model_executor.layers.attention.radix_attention import attention_layers
from runners.cuda_graph_runner import CudaGraphRunner
from runners.model_runner import ModelRunner, RunnerConfig


class CompiledDecodeGraphRunner(CudaGraphRunner):
    """CudaGraphRunner whose captured forward is the compiled model (backend: inductor, or any
    torch.compile backend; mode: inductor's)."""

    def __init__(self, model_runner, batch_sizes: list[int], backend: str = "inductor", mode: str | None = None,
                 capturer=None):
        model = model_runner.model
        self.attention_layers = attention_layers(model)
        self._traced: ForwardBatch | None = None  # the static batch being captured (read for its mode)

        def decode_forward(input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
            return model(input_ids, positions, self._traced)

        # one specialization per size (and the warm-up of each): let dynamo keep them all
        limit = torch._dynamo.config.recompile_limit
        torch._dynamo.config.recompile_limit = max(limit, 2 * len(batch_sizes) + 2)
        self.compiled = torch.compile(decode_forward, backend=backend, mode=mode, fullgraph=True, dynamic=False)
        self.compile_seconds: dict[int, float] = {}
        super().__init__(model_runner, batch_sizes, capturer)

    def _forward(self, fb: ForwardBatch) -> None:
        self._traced = fb
        t0 = time.perf_counter()
        with forward_context(fb, self.attention_layers):
            logits = self.compiled(fb.input_ids, fb.positions)
        self.compile_seconds.setdefault(fb.batch_size, time.perf_counter() - t0)  # the first call compiles
        self.buffers.logits[: fb.batch_size].copy_(logits)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.probe_compiled_decode", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="llama-3.2-1b", choices=SHAPES, help="a model shape, random weights")
    p.add_argument("--batch-size", type=int, nargs="+", default=[1, 64])
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=32, help="decode steps timed per mode")
    p.add_argument("--quantization", default=None, choices=("none", "fp8"))
    p.add_argument("--backend", default="inductor", help="torch.compile backend (eager: the plumbing alone)")
    p.add_argument("--mode", default=None, help="inductor mode, e.g. max-autotune-no-cudagraphs")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--json", dest="json_out", help="write the results here")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    sizes = sorted(set(args.batch_size))
    steps = args.output_len
    tokens = sizes[-1] * (args.input_len + steps) + 16
    cfg = RunnerConfig(model_path=str(shape_path(args.model)), device=str(device), attention_backend="auto",
                       max_running_requests=max(sizes[-1], 8), max_total_tokens=tokens,
                       context_length=args.input_len + steps + 16, random_weights=True, disable_cuda_graph=True,
                       disable_piecewise_cuda_graph=True, quantization=args.quantization)
    runner = ModelRunner(cfg)
    bandwidth = measure_copy_bandwidth(device)
    today = CudaGraphRunner(runner, sizes)
    t0 = time.perf_counter()
    compiled = CompiledDecodeGraphRunner(runner, sizes, backend=args.backend, mode=args.mode)
    capture_s = time.perf_counter() - t0
    results = []
    for bs in sizes:
        batches, _, (rows, loc) = prepare(runner, bs, args.input_len, steps)
        with torch.inference_mode():
            eager = runner.forward_eager(batches[0]).clone()
            ours = compiled.replay(batches[0]).clone()
        floor_ms = step_read_bytes(runner.model, bs) / bandwidth * 1e3
        row = {"batch_size": bs, "floor_ms": round(floor_ms, 4),
               "graph_ms": round(time_steps(today.replay, batches, device), 4),
               "compiled_ms": round(time_steps(compiled.replay, batches, device), 4),
               "graph_b2b_ms": round(time_back_to_back(today.replay, batches, device), 4),
               "compiled_b2b_ms": round(time_back_to_back(compiled.replay, batches, device), 4),
               "compile_s": round(compiled.compile_seconds[bs], 1),
               "compiled_vs_eager_max_abs_diff": (ours - eager).abs().max().item(),
               "greedy_tokens_equal": bool(torch.equal(ours.argmax(-1), eager.argmax(-1)))}
        results.append(row)
        runner.allocator.free(loc)
        for r in rows:
            runner.req_to_token_pool.free(r)
    report = {"benchmark": "probe_compiled_decode", "model": args.model, "device": str(device),
              "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "quantization": args.quantization, "backend": args.backend, "mode": args.mode,
              "attention_backend": type(runner.attn_backend).__name__, "input_len": args.input_len,
              "copy_bandwidth_tb_s": round(bandwidth / 1e12, 3), "compile_and_capture_s": round(capture_s, 1),
              "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "torch": torch.__version__,
              "results": results}
    print(f"{args.model} ({args.quantization or 'bf16'}, {report['attention_backend']}), input {args.input_len}; "
          f"torch.compile backend {args.backend} mode {args.mode}: {len(sizes)} sizes compiled and captured in "
          f"{capture_s:.1f} s")
    print(f"{'bs':>5} {'floor ms':>9} {'graph ms':>9} {'compiled ms':>12} {'ratio':>6} {'graph b2b':>10} "
          f"{'compiled b2b':>13} {'compile s':>10} {'max|diff|':>10} {'tokens=':>7}")
    for r in results:
        print(f"{r['batch_size']:>5} {r['floor_ms']:>9.3f} {r['graph_ms']:>9.3f} {r['compiled_ms']:>12.3f} "
              f"{r['compiled_ms'] / r['graph_ms']:>6.2f} {r['graph_b2b_ms']:>10.3f} {r['compiled_b2b_ms']:>13.3f} "
              f"{r['compile_s']:>10.1f} {r['compiled_vs_eager_max_abs_diff']:>10.2e} {r['greedy_tokens_equal']!s:>7}")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""bench_lora: the cost of multi-LoRA serving, in-process on one model runner (no scheduler, no HTTP).

    python -m benchmarks.bench_lora [--model-path P] [--device cuda] [--random-weights] [--batch-size 1 32]
        [--rank 16] [--num-adapters 8] [--extend-len 2048] [--context-len 512] [--repeats 5] [--json out.json]

Random PEFT adapters (rank --rank on q, k, v, o, gate, up and down of every layer, the model's own shapes, each
its own weights) are written to a temporary folder and loaded by one runner with --max-loras-per-batch
--num-adapters. Timed, interleaved, --repeats times (each the mean of --steps forward passes after a warm-up):

* decode steps at each --batch-size after --context-len tokens of KV per request: `base` (the LoRA layers
  detached: the model without LoRA, with its own graphs), `lora, no adapter` (LoRA on, every row the base
  model), `1 adapter` (every row the same adapter) and `N adapters` (rows spread over --num-adapters adapters);
* an extend of --extend-len tokens in one request: `base` and `1 adapter`.

On CUDA, decode steps replay decode graphs (captured at the batch sizes) and the extend replays the piecewise
pieces captured at --extend-len tokens (LoRA on: the adapters' slots read from the graphs' buffers); the base
gets graphs captured with the LoRA layers detached. On a CPU everything runs eagerly. The table gives the median
over repeats and the ratio to `base` measured in the same run, against the targets below; writes JSON (--json).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

from model_executor.forward_batch import ForwardMode
from model_executor.lora.adapter import TARGET_MODULES
from model_executor.lora.manager import LoraConfig
from runners.model_runner import ModelRunner, RunnerConfig

# The ratio to the base each configuration should stay under (decode at bs 1 with one adapter, at bs 32 with
# eight, the extend with one).
TARGETS = {("decode", 1, "1 adapter"): 1.15, ("decode", 32, "8 adapters"): 1.25, ("extend", 2048, "1 adapter"): 1.2}


def projection_shapes(cfg) -> dict[str, tuple[int, int]]:
    """(in, out) of each projection an adapter targets."""
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    h, i = cfg.hidden_size, cfg.intermediate_size
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h), "gate_proj": (h, i),
            "up_proj": (h, i), "down_proj": (i, h)}


def write_adapters(folder: Path, cfg, n: int, rank: int, seed: int = 0) -> list[tuple[str, str]]:
    """n PEFT adapter folders of random weights (bfloat16 files) for the model `cfg`; [(name, folder)]."""
    from safetensors.torch import save_file

    shapes = projection_shapes(cfg)
    g = torch.Generator().manual_seed(seed)
    out = []
    for k in range(n):
        path = folder / f"adapter{k}"
        path.mkdir(parents=True)
        tensors = {}
        for layer in range(cfg.num_hidden_layers):
            for module, (fan_in, fan_out) in shapes.items():
                parent = "mlp" if module in ("gate_proj", "up_proj", "down_proj") else "self_attn"
                key = f"base_model.model.model.layers.{layer}.{parent}.{module}"
                tensors[f"{key}.lora_A.weight"] = (torch.randn(rank, fan_in, generator=g) / fan_in**0.5).bfloat16()
                tensors[f"{key}.lora_B.weight"] = (torch.randn(fan_out, rank, generator=g) * 0.01).bfloat16()
        save_file(tensors, str(path / "adapter_model.safetensors"))
        (path / "adapter_config.json").write_text(json.dumps({
            "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(TARGET_MODULES),
            "bias": "none"}))
        out.append((f"adapter{k}", str(path)))
    return out


class LoraSwitch:
    """The runner with its LoRA layers attached (as built) or detached (the base model), each with its own graph
    runners and attention backend (a backend's graph state belongs to one decode graph runner): the base's are
    made while detached."""

    def __init__(self, runner: ModelRunner):
        self.runner = runner
        self.layers = [(m, m.lora) for m in runner.model.modules() if getattr(m, "lora", None) is not None]
        self.lora = runner.lora
        self.graphs = {True: runner._graph_runners(), False: (None,) * len(runner._graph_runners())}
        self.backends = {True: runner.attn_backend, False: runner.attn_backend}
        self.on = True

    def set(self, on: bool) -> None:
        r = self.runner
        self.graphs[self.on] = r._graph_runners()
        for m, lora in self.layers:
            m.lora = lora if on else None
        r.lora = self.lora if on else None
        (r.decode_graph_runner, r.extend_graph_runner, r.full_extend_graph_runner,
         r.verify_graph_runner) = self.graphs[on]
        r.attn_backend = self.backends[on]
        self.on = on

    def capture_base(self, batch_sizes: list[int], extend_len: int | None) -> None:
        """Capture the base model's decode graphs (and extend pieces at extend_len) with the LoRA layers off."""
        r = self.runner
        if r.device.type == "cuda":
            from model_executor.layers.attention import create_attention_backend

            self.backends[False] = create_attention_backend(r.config.attention_backend, r)
        self.set(False)
        if r.device.type == "cuda":
            from runners.cuda_graph_runner import CudaGraphRunner
            from runners.piecewise_cuda_graph_runner import PiecewiseCudaGraphRunner

            r.decode_graph_runner = CudaGraphRunner(r, batch_sizes)
            if extend_len:
                torch._dynamo.reset()  # (LoRA's pieces replay without dynamo; this trace has no LoRA layers)
                r.extend_graph_runner = PiecewiseCudaGraphRunner(r, [extend_len])
        self.set(True)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_forward(runner: ModelRunner, fb, steps: int) -> tuple[float, str]:
    """(mean ms of a forward pass over `steps` launched back to back after a warm-up, the path it took)."""
    with torch.inference_mode():
        before = dict(runner.path_counts)
        for _ in range(2):
            runner.forward(fb)
        path = next(k for k, v in runner.path_counts.items() if v != before.get(k, 0))
        sync(runner.device)
        t0 = time.perf_counter()
        for _ in range(steps):
            runner.forward(fb)
        sync(runner.device)
    return (time.perf_counter() - t0) * 1e3 / steps, path


@contextlib.contextmanager
def requests(runner: ModelRunner, bs: int, width: int):
    """bs request rows of `width` KV slots each; (rows, slots), freed after."""
    rows = [runner.req_to_token_pool.alloc() for _ in range(bs)]
    slots = runner.allocator.alloc(bs * width)
    try:
        for i, row in enumerate(rows):
            runner.req_to_token_pool.write(row, 0, slots[i * width:(i + 1) * width])
        yield rows, slots
    finally:
        runner.allocator.free(slots)
        for row in rows:
            runner.req_to_token_pool.free(row)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_lora", description=__doc__.splitlines()[0])
    p.add_argument("--model-path", help="HF folder (default: the default model)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--random-weights", action="store_true", help="real shapes, random weights (GPU shapes)")
    p.add_argument("--batch-size", type=int, nargs="+", default=[1, 32])
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--num-adapters", type=int, default=8, help="distinct adapters of the many-adapter rows")
    p.add_argument("--extend-len", type=int, default=2048, help="tokens of the timed extend (0: none)")
    p.add_argument("--context-len", type=int, default=512, help="KV tokens per request before a decode step")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--steps", type=int, default=None, help="forward passes per timing (default 20 on CUDA, 3 on CPU)")
    p.add_argument("--json", dest="json_out", help="write the results here")
    args = p.parse_args(argv)
    for name in ("rank", "num_adapters", "repeats", "context_len"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if min(args.batch_size) < 1 or args.extend_len < 0 or (args.steps is not None and args.steps < 1):
        p.error("--batch-size and --steps must be at least 1, --extend-len at least 0")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    model_path = args.model_path
    if model_path is None:
        from model_executor import default_model

        model_path = str(default_model.ensure_default_model())
    cuda = args.device.startswith("cuda")
    steps = args.steps or (20 if cuda else 3)
    batch_sizes = sorted(set(args.batch_size))
    max_bs = max(batch_sizes)
    width = args.context_len + 1
    with tempfile.TemporaryDirectory(prefix="bench-lora-") as tmp:
        from model_executor.model_config import ModelConfig

        cfg = ModelConfig.from_pretrained(model_path)
        adapters = write_adapters(Path(tmp), cfg, args.num_adapters, args.rank)
        runner = ModelRunner(RunnerConfig(
            model_path=model_path, device=args.device, random_weights=args.random_weights,
            max_running_requests=max_bs + 1, max_total_tokens=max_bs * width + args.extend_len + 64,
            max_prefill_tokens=max(args.extend_len, 1),
            disable_cuda_graph=not cuda, cuda_graph_bs=tuple(batch_sizes) if cuda else (),
            disable_piecewise_cuda_graph=not cuda or not args.extend_len,
            piecewise_cuda_graph_tokens=(args.extend_len,) if cuda and args.extend_len else (),
            lora=LoraConfig(paths=tuple(adapters), max_per_batch=args.num_adapters, max_rank=args.rank,
                            target_modules=TARGET_MODULES)))
    lora = runner.lora
    uids = [lora.uid(name) for name, _ in adapters]
    switch = LoraSwitch(runner)
    switch.capture_base(batch_sizes, args.extend_len)
    # (kind, size, config) -> (LoRA on, each request's adapter uid or None)
    many = f"{args.num_adapters} adapters"
    configs = {"base": (False, lambda bs: [None] * bs), "lora, no adapter": (True, lambda bs: [None] * bs),
               "1 adapter": (True, lambda bs: [uids[0]] * bs),
               many: (True, lambda bs: [uids[i % len(uids)] for i in range(bs)])}
    times: dict[tuple, list[float]] = {}
    paths: dict[tuple, str] = {}
    for _ in range(args.repeats):
        for bs in batch_sizes:
            with requests(runner, bs, width) as (rows, slots):
                loc = torch.stack([slots[i * width + args.context_len] for i in range(bs)])
                for name, (on, pick) in configs.items():
                    switch.set(on)
                    req_slots = lora.prepare(pick(bs)) if on else None
                    fb = runner.build_batch(ForwardMode.DECODE, [1] * bs, rows, [width] * bs, loc,
                                            lora_slots=req_slots)
                    ms, path = time_forward(runner, fb, steps)
                    times.setdefault(("decode", bs, name), []).append(ms)
                    paths["decode", bs, name] = path
        if args.extend_len:
            n = args.extend_len
            with requests(runner, 1, n) as (rows, slots):
                ids = torch.randint(3, cfg.vocab_size, (n,), generator=torch.Generator().manual_seed(0)).tolist()
                for name in ("base", "1 adapter"):
                    on, pick = configs[name]
                    switch.set(on)
                    req_slots = lora.prepare(pick(1)) if on else None
                    fb = runner.build_batch(ForwardMode.EXTEND, ids, rows, [n], slots, extend_seq_lens=[n],
                                            lora_slots=req_slots)
                    ms, path = time_forward(runner, fb, max(1, steps // 4))
                    times.setdefault(("extend", n, name), []).append(ms)
                    paths["extend", n, name] = path
    switch.set(True)
    rows_out = []
    for (kind, size, name), runs in times.items():
        ms = statistics.median(runs)
        base = statistics.median(times[kind, size, "base"])
        target = TARGETS.get((kind, size, name))
        rows_out.append({"kind": kind, "size": size, "config": name, "path": paths[kind, size, name],
                         "ms": round(ms, 3), "ratio": round(ms / base, 3), "target": target,
                         "meets": None if target is None else ms / base <= target,
                         "runs_ms": [round(t, 3) for t in runs]})
    meta = {"model_path": model_path, "device": args.device, "random_weights": args.random_weights,
            "dtype": str(runner.dtype), "rank": args.rank, "num_adapters": args.num_adapters,
            "targets": list(TARGET_MODULES), "context_len": args.context_len, "steps": steps,
            "repeats": args.repeats, "lora_backend": lora.backend, "lora_pool_bytes": lora.pool_bytes,
            "date": datetime.now(timezone.utc).strftime("%Y-%m-%d"),
            "machine": torch.cuda.get_device_name() if cuda else f"CPU, {os.cpu_count()} cores",
            "load_average": round(os.getloadavg()[0], 2)}
    print(f"\nLoRA rank {args.rank} on {', '.join(TARGET_MODULES)}; {meta['machine']}, {meta['dtype']}, "
          f"backend {lora.backend}; median of {args.repeats} x {steps} steps")
    print(f"{'kind':<7} {'size':>5} {'config':<18} {'path':<13} {'ms':>9} {'x base':>7} {'target':>7} {'meets':>6}")
    for r in rows_out:
        target = "" if r["target"] is None else f"{r['target']:.2f}"
        meets = "" if r["meets"] is None else ("yes" if r["meets"] else "NO")
        print(f"{r['kind']:<7} {r['size']:>5} {r['config']:<18} {r['path']:<13} {r['ms']:>9.3f} {r['ratio']:>7.3f} "
              f"{target:>7} {meets:>6}")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"meta": meta, "rows": rows_out}, f, indent=2)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())

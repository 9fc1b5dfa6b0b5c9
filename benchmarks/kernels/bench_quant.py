"""bench_quant: a quantized model against the same weights unquantized, in the same run: greedy agreement
over N decode steps (each run follows its own greedy tokens), the logits' relative error at each step of
the reference's sequence (teacher-forced), and decode tok/s at batch size 1.

    python -m benchmarks.kernels.bench_quant --quantization int8                       # CPU, the default model vs fp32
    python -m benchmarks.kernels.bench_quant --quantization fp8 --model llama-3.2-1b   # GPU, random weights vs bf16
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from datetime import datetime, timezone

import torch

from model_executor.configs import SHAPES, shape_path
from model_executor.forward_batch import ForwardMode
from runners.model_runner import ModelRunner, RunnerConfig


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.kernels.bench_quant",
                                description=__doc__.splitlines()[0])
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", choices=SHAPES, help="a model shape with random weights (GPU benchmarks)")
    src.add_argument("--model-path", help="an HF folder (default: the converted default model)")
    p.add_argument("--quantization", required=True, choices=("fp8", "int8", "int4"))
    p.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "fp8_e4m3"))
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", dest="json_out")
    args = p.parse_args(argv)
    if args.model and args.quantization == "int4":  # its packed weights load once: no second load_weights
        p.error("--quantization int4 compares a real model (--model-path, or the default model), not --model")
    return args


class Stream:
    """One request on a runner: prefill, then one decode step per call."""

    def __init__(self, runner: ModelRunner, prompt: list[int], max_len: int):
        self.runner = runner
        self.row = runner.req_to_token_pool.alloc()
        self.loc = runner.allocator.alloc(max_len)
        runner.req_to_token_pool.write(self.row, 0, self.loc)
        self.len = len(prompt)
        fb = runner.build_batch(ForwardMode.EXTEND, prompt, [self.row], [self.len], self.loc[: self.len],
                                extend_seq_lens=[self.len])
        self.logits = runner.forward(fb)[0].float()

    def step(self, token: int) -> torch.Tensor:
        fb = self.runner.build_batch(ForwardMode.DECODE, [token], [self.row], [self.len + 1],
                                     self.loc[self.len : self.len + 1])
        self.len += 1
        self.logits = self.runner.forward(fb)[0].float()
        return self.logits

    def close(self) -> None:
        self.runner.allocator.free(self.loc)
        self.runner.req_to_token_pool.free(self.row)


def teacher_forced_logits(runner: ModelRunner, ids: list[int]) -> torch.Tensor:
    """float32 logits [len(ids), vocab] at every position of one extend of `ids` (the model's layers, then
    the LM head on every hidden state, not only the last): a quantized model's error along a fixed text."""
    row = runner.req_to_token_pool.alloc()
    loc = runner.allocator.alloc(len(ids))
    try:
        runner.req_to_token_pool.write(row, 0, loc)
        fb = runner.build_batch(ForwardMode.EXTEND, ids, [row], [len(ids)], loc, extend_seq_lens=[len(ids)])
        with torch.inference_mode():
            runner.attn_backend.init_forward_metadata(fb)
            hidden = runner.model.model(fb.input_ids, fb.positions, fb)
            return runner.model.lm_head(hidden).float()
    finally:
        runner.allocator.free(loc)
        runner.req_to_token_pool.free(row)


def logits_error(ref: torch.Tensor, quant: torch.Tensor) -> dict:
    """Per-position relative error (max, mean), the largest absolute difference, and argmax agreement."""
    rel = (quant - ref).norm(dim=-1) / ref.norm(dim=-1)
    return {"positions": ref.shape[0], "rel_err_max": rel.max().item(), "rel_err_mean": rel.mean().item(),
            "max_abs_diff": (quant - ref).abs().max().item(),
            "argmax_equal": int((quant.argmax(-1) == ref.argmax(-1)).sum())}


def checkpoint_tensors(model: torch.nn.Module):
    """The model's weights under their HF checkpoint names (fused q/k/v and gate/up split again): feeding
    them to another model's load_weights loads the same weights, quantizing them if that model does."""
    fused: dict[str, list[str]] = {}  # our fused fragment -> the HF fragments, in shard order
    for hf_frag, our_frag, _ in model.stacked_params:
        fused.setdefault(our_frag, []).append(hf_frag)
    for name, param in model.named_parameters():
        our_frag = next((f for f in fused if f"{f}." in name), None)
        if our_frag is None:
            yield name, param
            continue
        layer = model.get_submodule(name.rsplit(".", 1)[0])
        sizes = [layer.q_size, layer.kv_size, layer.kv_size] if hasattr(layer, "q_size") else layer.output_sizes
        for frag, part in zip(fused[our_frag], param.split(sizes, dim=0)):
            yield name.replace(our_frag, frag), part


def sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def compare(ref: ModelRunner, quant: ModelRunner, prompt: list[int], steps: int) -> dict:
    """Greedy agreement (each model follows its own tokens; the first step where they differ) and the
    logits' relative error along the reference's own sequence (the quantized model fed the same tokens)."""
    max_len = len(prompt) + steps + 1
    a, b = Stream(ref, prompt, max_len), Stream(quant, prompt, max_len)
    errors, ref_tokens = [], []
    for _ in range(steps):
        errors.append(((b.logits - a.logits).norm() / a.logits.norm()).item())
        token = int(a.logits.argmax())
        ref_tokens.append(token)
        a.step(token)
        b.step(token)
    a.close()
    b.close()
    own = Stream(quant, prompt, max_len)
    quant_tokens = []
    for _ in range(steps):
        token = int(own.logits.argmax())
        quant_tokens.append(token)
        own.step(token)
    own.close()
    first_diff = next((i for i, (x, y) in enumerate(zip(ref_tokens, quant_tokens)) if x != y), steps)
    same = sum(x == y for x, y in zip(ref_tokens, quant_tokens))
    return {"steps": steps, "greedy_equal_prefix": first_diff, "greedy_same_position": same,
            "logits_rel_err_max": max(errors), "logits_rel_err_mean": sum(errors) / len(errors)}


def decode_tok_s(runner: ModelRunner, prompt: list[int], steps: int) -> float:
    s = Stream(runner, prompt, len(prompt) + steps + 1)
    token = int(s.logits.argmax())
    sync(runner.device)
    t0 = time.perf_counter()
    for _ in range(steps):
        token = int(s.step(token).argmax())
    sync(runner.device)
    s.close()
    return steps / (time.perf_counter() - t0)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.model:
        path, random = str(shape_path(args.model)), True
    else:
        if args.model_path:
            path = args.model_path
        else:
            from model_executor.default_model import ensure_default_model

            path = str(ensure_default_model())
        random = False
    common = {"model_path": path, "device": args.device, "max_running_requests": 4,
                  "max_total_tokens": 4 * (args.prompt_len + args.steps + 8), "context_length": args.prompt_len + args.steps + 8,
                  "random_weights": random, "seed": args.seed}
    ref = ModelRunner(RunnerConfig(**common))
    quant = ModelRunner(RunnerConfig(**common, quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype))
    if random:  # the same random weights in both (the quantized model quantizes the reference's)
        with torch.no_grad():
            quant.model.load_weights(checkpoint_tensors(ref.model))
    gen = torch.Generator().manual_seed(args.seed)
    prompt = torch.randint(10, ref.model_config.vocab_size, (args.prompt_len,), generator=gen).tolist()
    result = compare(ref, quant, prompt, args.steps)
    speed = {"ref_tok_s": decode_tok_s(ref, prompt, args.steps), "quant_tok_s": decode_tok_s(quant, prompt, args.steps)}
    from model_executor.weight_loader import weight_bytes

    report = {"benchmark": "bench_quant", "model": args.model or path, "device": args.device,
              "quantization": args.quantization, "kv_cache_dtype": args.kv_cache_dtype,
              "ref_dtype": str(ref.dtype).replace("torch.", ""), "ref_weight_bytes": weight_bytes(ref.model),
              "quant_weight_bytes": weight_bytes(quant.model), **result, **speed,
              "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "torch": torch.__version__}
    print(f"{report['model']} on {args.device}: {args.quantization} (kv {args.kv_cache_dtype}) vs {report['ref_dtype']}")
    print(f"weights {report['ref_weight_bytes'] / 1e6:.1f} MB -> {report['quant_weight_bytes'] / 1e6:.1f} MB")
    print(f"greedy: first {result['greedy_equal_prefix']}/{args.steps} tokens equal, {result['greedy_same_position']}"
          f"/{args.steps} equal position by position")
    print(f"logits relative error (teacher-forced on the reference's tokens): max {result['logits_rel_err_max']:.4f}, "
          f"mean {result['logits_rel_err_mean']:.4f}")
    print(f"decode bs=1: reference {speed['ref_tok_s']:.1f} tok/s, quantized {speed['quant_tok_s']:.1f} tok/s")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())

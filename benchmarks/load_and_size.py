"""Load a model shape from disk and show how its GPU memory is split: load time, peak memory while loading,
and weights / KV cache / graph and activation reserves, as a table and as JSON.

Random bfloat16 weights of the shape are written once as sharded safetensors (HF names) into a servable
folder (config, tokenizer), so `launch_server --model-path FOLDER` can serve it afterwards.

    python -m benchmarks.load_and_size qwen2.5-32b --folder /data/qwen32b --json out.json

A 32B shape needs about 65 GB of disk for its weights.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

import torch

from model_executor.configs import SHAPES
from model_executor.model_config import ModelConfig

WEIGHTS_DONE = ".weights-complete"


def hf_tensor_shapes(cfg: ModelConfig) -> list[tuple[str, tuple[int, ...]]]:
    """The HF checkpoint's tensor names and shapes for a Llama/Qwen2-family config, in file order."""
    h, i, hd = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    q, kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    out = [("model.embed_tokens.weight", (cfg.vocab_size, h))]
    for n in range(cfg.num_hidden_layers):
        p = f"model.layers.{n}."
        out += [(p + "input_layernorm.weight", (h,)), (p + "post_attention_layernorm.weight", (h,)),
                (p + "self_attn.q_proj.weight", (q, h)), (p + "self_attn.k_proj.weight", (kv, h)),
                (p + "self_attn.v_proj.weight", (kv, h)), (p + "self_attn.o_proj.weight", (h, q)),
                (p + "mlp.gate_proj.weight", (i, h)), (p + "mlp.up_proj.weight", (i, h)),
                (p + "mlp.down_proj.weight", (h, i))]
        if cfg.attention_bias:
            out += [(p + "self_attn.q_proj.bias", (q,)), (p + "self_attn.k_proj.bias", (kv,)),
                    (p + "self_attn.v_proj.bias", (kv,))]
    out.append(("model.norm.weight", (h,)))
    if not cfg.tie_word_embeddings:
        out.append(("lm_head.weight", (cfg.vocab_size, h)))
    return out


def write_random_checkpoint(shape: str, folder: Path, shard_bytes: int = 5 * 2**30, seed: int = 0) -> Path:
    """A servable folder of `shape` with random bf16 weights in shards (skipped when already written)."""
    from safetensors.torch import save_file

    from benchmarks.make_dummy_model import make_dummy_model

    folder = Path(folder)
    if (folder / WEIGHTS_DONE).is_file():
        return folder
    make_dummy_model(shape, folder)
    cfg = ModelConfig.from_pretrained(folder)
    device = "cuda" if torch.cuda.is_available() else "cpu"  # drawing on the GPU is much faster
    gen = torch.Generator(device=device).manual_seed(seed)
    shards: list[list[str]] = []  # tensor names of each written shard
    pending: dict[str, torch.Tensor] = {}

    def flush() -> None:
        save_file(pending, str(folder / f"shard-{len(shards)}.tmp"), metadata={"format": "pt"})
        shards.append(list(pending))
        pending.clear()

    for name, shp in hf_tensor_shapes(cfg):
        if name.endswith("norm.weight"):
            t = torch.ones(shp, dtype=torch.bfloat16)
        else:
            t = torch.empty(shp, dtype=torch.bfloat16, device=device).normal_(0.0, 0.02, generator=gen).cpu()
        if pending and sum(x.nbytes for x in pending.values()) + t.nbytes > shard_bytes:
            flush()
        pending[name] = t
    flush()
    weight_map = {}
    for k, names in enumerate(shards):
        final = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        (folder / f"shard-{k}.tmp").rename(folder / final)
        weight_map.update(dict.fromkeys(names, final))
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (folder / WEIGHTS_DONE).write_text("random bf16\n")
    return folder


def measure(folder: Path, *, max_running_requests: int, max_prefill_tokens: int, mem_fraction_static: float,
            graphs: bool, context_length: int | None) -> dict:
    from runners.capture_lists import get_batch_sizes_to_capture, get_token_levels
    from runners.model_runner import ModelRunner, RunnerConfig

    memory = torch.cuda.get_device_properties(0).total_memory
    decode_bs = tuple(get_batch_sizes_to_capture(None, None, max_running_requests, memory)) if graphs else ()
    extend_tokens = tuple(get_token_levels(min(max_prefill_tokens, 2048))) if graphs else ()
    cfg = RunnerConfig(model_path=str(folder), device="cuda", dtype="bfloat16", attention_backend="triton",
                       context_length=context_length, max_running_requests=max_running_requests,
                       max_prefill_tokens=max_prefill_tokens, mem_fraction_static=mem_fraction_static,
                       disable_cuda_graph=not graphs, cuda_graph_bs=decode_bs,
                       disable_piecewise_cuda_graph=not graphs, piecewise_cuda_graph_tokens=extend_tokens)
    t0 = time.perf_counter()
    runner = ModelRunner(cfg)
    info = runner.graph_info()
    result = {"folder": str(folder), "gpu": torch.cuda.get_device_name(0), "startup_seconds": round(
        time.perf_counter() - t0, 1), "context_len": runner.context_len, "memory": info["memory"],
        "capture_gib": info["capture_gib"], "split_line": runner.memory_split.line()}
    del runner  # give the GPU back: a server started after this in the same process tree sizes its KV cache
    gc.collect()
    torch.cuda.empty_cache()
    return result


def print_table(result: dict) -> None:
    mem = result["memory"]
    rows = [("load time (s)", mem["load_seconds"]), ("peak while loading (GiB)", mem["load_peak_gib"]),
            ("weights (GiB)", mem["weights_gib"]), ("KV cache (GiB)", mem["kv_gib"]),
            ("KV slots (tokens)", mem["num_slots"]), ("graphs reserve (GiB)", mem["graphs_gib"]),
            ("graphs measured (GiB)", mem.get("graphs_measured_gib")),
            ("activations reserve (GiB)", mem["activations_gib"]), ("other in use (GiB)", mem["other_gib"]),
            ("budget (GiB)", mem["budget_gib"]), ("GPU total (GiB)", mem["total_gib"]),
            ("start-up total (s)", result["startup_seconds"])]
    width = max(len(r[0]) for r in rows)
    for name, value in rows:
        print(f"{name:<{width}}  {value}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.load_and_size",
                                description=__doc__.splitlines()[0])
    p.add_argument("shape", choices=SHAPES)
    p.add_argument("--folder", type=Path, required=True, help="where the random checkpoint is (or goes)")
    p.add_argument("--shard-gib", type=float, default=5.0)
    p.add_argument("--max-running-requests", type=int, default=256)
    p.add_argument("--max-prefill-tokens", type=int, default=16384)
    p.add_argument("--mem-fraction-static", type=float, default=0.85)
    p.add_argument("--context-length", type=int, default=None)
    p.add_argument("--no-graphs", action="store_true", help="skip graph capture (reserve 0)")
    p.add_argument("--json", type=Path, default=None, help="also write the result here")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("error: this benchmark needs a CUDA GPU", file=sys.stderr)
        return 1
    t0 = time.perf_counter()
    write_random_checkpoint(args.shape, args.folder, int(args.shard_gib * 2**30))
    print(f"checkpoint ready in {time.perf_counter() - t0:.1f} s: {args.folder}", flush=True)
    result = measure(args.folder, max_running_requests=args.max_running_requests,
                     max_prefill_tokens=args.max_prefill_tokens, mem_fraction_static=args.mem_fraction_static,
                     graphs=not args.no_graphs, context_length=args.context_length)
    result["shape"] = args.shape
    print(result["split_line"])
    print_table(result)
    print(json.dumps(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

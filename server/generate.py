"""Offline generation CLI: check a model without the server.

    python -m server.generate --chat --prompt "What is the capital of France?"
"""

from __future__ import annotations

import argparse
import logging
import sys

from model_executor.sampling_params import SamplingParams, SamplingParamsError


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m server.generate", description=__doc__.splitlines()[0])
    p.add_argument("--prompt", required=True, help="prompt text")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--model-path", default=None, help="HF model folder or hub id org/name "
                                                      "(default: SmolLM2-135M-Instruct)")
    p.add_argument("--revision", default=None, help="hub revision of a --model-path hub id")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"))
    return p


def generate(model_path: str, prompt: str, params: SamplingParams, *, chat: bool = False, device: str = "cpu",
             dtype: str = "auto") -> str:
    import torch  # noqa: F401  (heavy imports after argument parsing)
    from transformers import AutoTokenizer

    from runners.model_runner import ModelRunner, RunnerConfig
    from scheduler.scheduler import Scheduler, SchedulerConfig

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    if chat:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                            tokenize=True)
        ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    else:
        ids = tokenizer.encode(prompt)
    total = len(ids) + params.max_new_tokens
    runner = ModelRunner(RunnerConfig(model_path=model_path, device=device, dtype=dtype, max_running_requests=1,
                                      max_total_tokens=total + 1))
    scheduler = Scheduler(runner, SchedulerConfig(max_running_requests=1, disable_radix_cache=True), tokenizer)
    scheduler.add_request("offline", list(ids), params)
    out: list[int] = []
    while scheduler.has_work():
        for o in scheduler.step():
            out.extend(o.new_token_ids)
            if o.finish_reason is not None and o.finish_reason.kind == "error":
                raise SystemExit(f"error: {o.finish_reason.message}")
    return tokenizer.decode(out, skip_special_tokens=True)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed)
    try:
        params.validate()
    except SamplingParamsError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    model_path = args.model_path
    if model_path is None:
        from model_executor.default_model import DefaultModelError, ensure_default_model

        try:
            model_path = str(ensure_default_model())
        except DefaultModelError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
    from server.model_source import (
        ModelSourceError,
        check_checkpoint_tensors,
        check_model_folder,
        resolve_folder,
    )

    try:  # the server's start-up checks: a one-line error instead of a traceback from deep inside loading
        folder, _ = resolve_folder(model_path, flag="--model-path", revision=args.revision, download_dir=None)
        check_checkpoint_tensors(folder, check_model_folder(folder))
    except ModelSourceError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    model_path = str(folder)
    device = args.device
    if device == "auto":
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    print(generate(model_path, args.prompt, params, chat=args.chat, device=device, dtype=args.dtype))
    return 0


if __name__ == "__main__":
    sys.exit(main())

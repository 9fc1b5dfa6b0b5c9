"""Offline generation CLI: check a model without the server.

    python -m server.generate --chat --prompt "What is the capital of France?"
"""

from __future__ import annotations

import argparse
import logging
import sys

from model_executor.sampling_params import SamplingParams, SamplingParamsError
from server.args import DTYPES, QUANTIZATION_CHOICES


class CliError(Exception):
    """A one-line message for stderr and the exit code (2: a bad flag, 1: an unusable model)."""

    def __init__(self, message: str, code: int):
        super().__init__(message)
        self.code = code


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
    p.add_argument("--dtype", default="auto", choices=DTYPES)
    p.add_argument("--quantization", default=None, choices=QUANTIZATION_CHOICES,
                   help="weight quantization, as the server's flag; default: the checkpoint's (the default model: "
                        "the server's default for this device)")
    p.add_argument("--tp-size", type=int, default=1, help="tensor-parallel ranks (processes; one GPU each on CUDA)")
    return p


def generate(model_path: str, prompt: str, params: SamplingParams, *, chat: bool = False, device: str = "cpu",
             dtype: str = "auto", quantization: str | None = None, tp_size: int = 1) -> str:
    import torch  # noqa: F401  (heavy imports after argument parsing)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    if chat:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                            tokenize=True)
        ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    else:
        ids = tokenizer.encode(prompt)
    if tp_size == 1:
        out = _generate_ids(model_path, list(ids), params, device, dtype, quantization)
    else:
        out = _generate_ids_tp(model_path, list(ids), params, device, dtype, quantization, tp_size)
    return tokenizer.decode(out, skip_special_tokens=True)


def _generate_ids(model_path: str, ids: list[int], params: SamplingParams, device: str, dtype: str,
                  quantization: str | None, tp_rank: int = 0, tp_size: int = 1,
                  init_method: str | None = None) -> list[int]:
    from transformers import AutoTokenizer

    from model_executor.distributed import parallel_state as ps
    from runners.model_runner import ModelRunner, RunnerConfig
    from scheduler.scheduler import Scheduler, SchedulerConfig

    total = len(ids) + params.max_new_tokens
    runner = ModelRunner(RunnerConfig(model_path=model_path, device=device, dtype=dtype, max_running_requests=1,
                                      max_total_tokens=total + 1, quantization=quantization, tp_rank=tp_rank,
                                      tp_size=tp_size, dist_init_method=init_method))
    tokenizer = AutoTokenizer.from_pretrained(model_path)  # stop strings
    scheduler = Scheduler(runner, SchedulerConfig(max_running_requests=1, disable_radix_cache=True), tokenizer)
    scheduler.add_request("offline", ids, params)
    out: list[int] = []
    try:
        while scheduler.has_work():  # every rank takes the same steps: same request, rank 0's sampled tokens
            for o in scheduler.step():
                out.extend(o.new_token_ids)
                if o.finish_reason is not None and o.finish_reason.kind in ("error", "invalid"):
                    raise SystemExit(f"error: {o.finish_reason.message}")
    finally:
        ps.destroy_tensor_parallel()
    return out


def _tp_rank_main(rank: int, tp_size: int, init_method: str, model_path: str, ids: list[int],
                  params: SamplingParams, device: str, dtype: str, quantization: str | None, results) -> None:
    rank_device = f"cuda:{rank}" if device == "cuda" else device
    out = _generate_ids(model_path, ids, params, rank_device, dtype, quantization, rank, tp_size, init_method)
    if rank == 0:
        results.put(out)


def _generate_ids_tp(model_path: str, ids: list[int], params: SamplingParams, device: str, dtype: str,
                     quantization: str | None, tp_size: int) -> list[int]:
    """One spawned process per rank (torch.multiprocessing); rank 0 hands back the tokens."""
    import torch.multiprocessing as mp

    from server.parallel import free_port

    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    init = f"tcp://127.0.0.1:{free_port()}"
    mp.spawn(_tp_rank_main, args=(tp_size, init, model_path, ids, params, device, dtype, quantization, results),
             nprocs=tp_size, join=True)
    return results.get()


def resolve_args(args: argparse.Namespace) -> argparse.Namespace:
    """The parsed flags with the model folder, the device and the quantization filled in, checked as the server
    checks them at start-up (server/launch_server.resolve_args); CliError instead of a traceback."""
    args = argparse.Namespace(**vars(args))
    if args.tp_size < 1:
        raise CliError(f"--tp-size must be a positive integer, got {args.tp_size}", 2)
    if args.device == "auto":
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.model_path is None:
        from model_executor.default_model import (
            DefaultModelError,
            default_dtype,
            default_quantization,
            ensure_default_model,
        )

        try:
            args.model_path = str(ensure_default_model())
        except DefaultModelError as e:
            raise CliError(str(e), 1) from None
        if args.quantization is None:  # the default model's own format, shared with the server
            args.quantization = default_quantization(args.device)
        if args.dtype == "auto":
            args.dtype = default_dtype(args.device)
    from server.model_source import (
        ModelSourceError,
        check_checkpoint_tensors,
        check_model_folder,
        resolve_folder,
    )

    try:  # the server's start-up checks: a one-line error instead of a traceback from deep inside loading
        folder, _ = resolve_folder(args.model_path, flag="--model-path", revision=args.revision, download_dir=None)
        check_checkpoint_tensors(folder, check_model_folder(folder))
    except ModelSourceError as e:
        raise CliError(str(e), 1) from None
    args.model_path = str(folder)
    from model_executor.layers.quantization import QuantizationError, resolve_quant_config
    from model_executor.model_config import ModelConfig
    from server.args import ArgsError, ServerArgs

    config = ModelConfig.from_pretrained(args.model_path)
    try:  # the flag against the device, then against the checkpoint (an FP8 checkpoint takes no int8)
        ServerArgs(device=args.device, dtype=args.dtype, quantization=args.quantization).validate()
        resolve_quant_config(args.quantization, config.hf_config, args.device)
    except (ArgsError, QuantizationError) as e:
        raise CliError(str(e), 2) from None
    if args.tp_size > 1:
        from model_executor.weight_loader import check_tensor_parallel

        try:
            check_tensor_parallel(config, args.tp_size)
        except ValueError as e:
            raise CliError(f"--tp-size {args.tp_size}: {e}", 2) from None
    if args.device == "cuda" and args.tp_size > 1:
        import torch

        if torch.cuda.device_count() < args.tp_size:
            raise CliError(f"--tp-size {args.tp_size} needs {args.tp_size} GPUs, {torch.cuda.device_count()} are "
                           "visible", 2)
    return args


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
    try:
        args = resolve_args(args)
    except CliError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.code
    print(generate(args.model_path, args.prompt, params, chat=args.chat, device=args.device, dtype=args.dtype,
                   quantization=args.quantization, tp_size=args.tp_size))
    return 0


if __name__ == "__main__":
    sys.exit(main())

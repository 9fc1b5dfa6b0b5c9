"""Helpers for the tensor-parallel tests: run the same work at tp 1 in-process and at tp N in N spawned gloo
ranks (torch.multiprocessing), and compare what rank 0 returns."""

from __future__ import annotations

import datetime
import faulthandler
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

PROMPTS = [[5, 17, 42, 99, 123, 7, 250, 31, 64, 8], [200, 11, 3, 77, 150, 9]]
DECODE_STEPS = 6


def prefill_decode_logits(runner, prompts: list[list[int]] = PROMPTS, steps: int = DECODE_STEPS,
                          lora_names: list[str | None] | None = None) -> list[torch.Tensor]:
    """Logits of one extend batch of all prompts, then of `steps` greedy decode batches. lora_names: each
    prompt's LoRA adapter (None: the base model)."""
    from model_executor.forward_batch import ForwardMode

    slots = None
    if lora_names is not None:
        slots = runner.lora.prepare([None if n is None else runner.lora.uid(n) for n in lora_names])
    rows = [runner.req_to_token_pool.alloc() for _ in prompts]
    seqs = [list(p) for p in prompts]
    loc = runner.allocator.alloc(sum(len(p) for p in prompts))
    start = 0
    for row, p in zip(rows, prompts):
        runner.req_to_token_pool.write(row, 0, loc[start : start + len(p)])
        start += len(p)
    fb = runner.build_batch(ForwardMode.EXTEND, [t for p in prompts for t in p], rows, [len(p) for p in prompts],
                            loc, extend_seq_lens=[len(p) for p in prompts], lora_slots=slots)
    out = [runner.forward(fb)]
    for _ in range(steps):
        next_ids = out[-1].argmax(-1).tolist()
        for s, t in zip(seqs, next_ids):
            s.append(t)
        loc = runner.allocator.alloc(len(seqs))
        for i, (row, s) in enumerate(zip(rows, seqs)):
            runner.req_to_token_pool.write(row, len(s) - 1, loc[i : i + 1])
        out.append(runner.forward(runner.build_batch(ForwardMode.DECODE, next_ids, rows, [len(s) for s in seqs],
                                                     loc, lora_slots=slots)))
    return [t.cpu() for t in out]


def greedy_tokens(runner, prompts: list[list[int]] = PROMPTS, max_new: int = 8,
                  temperature: float = 0.0, lora_names: list[str | None] | None = None) -> list[list[int]]:
    """Outputs through the real Scheduler (the sampler and its rank-0 broadcast included)."""
    from model_executor.sampling_params import SamplingParams
    from scheduler.scheduler import Scheduler, SchedulerConfig

    sched = Scheduler(runner, SchedulerConfig(max_running_requests=4))
    for i, p in enumerate(prompts):
        sched.add_request(f"r{i}", list(p), SamplingParams(max_new_tokens=max_new, temperature=temperature,
                                                         ignore_eos=True),
                          lora_name=None if lora_names is None else lora_names[i])
    out: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    while sched.has_work():
        for o in sched.step():
            out[o.rid].extend(o.new_token_ids)
    return [out[f"r{i}"] for i in range(len(prompts))]


def load_lora_as_served(runner, name: str, path: str) -> list[str]:
    """Load an adapter at run time the way POST /load_lora_adapter does: its LoadLoraReq arrives at rank 0's
    inbox, which relays it to every rank of the group (BroadcastInbox), and each rank's scheduler loop loads it.
    The adapters loaded on this rank after it."""
    from model_executor.distributed import parallel_state as ps
    from scheduler.io_struct import LoadLoraReq
    from scheduler.scheduler import Scheduler, SchedulerConfig
    from scheduler.scheduler_process import BroadcastInbox, SchedulerLoop, _NullSink

    class Arrived:
        def receive(self, wait_ms: int) -> list:
            return [LoadLoraReq(rid="load", lora_name=name, lora_path=path)]

    loop = SchedulerLoop(Scheduler(runner, SchedulerConfig(max_running_requests=4)),
                         BroadcastInbox(Arrived() if ps.get_tp_rank() == 0 else None), _NullSink(), _NullSink())
    for msg in loop.inbox.receive(0):
        loop._handle(msg)
    return runner.lora.names()


def run_model(path: str, tp_rank: int = 0, tp_size: int = 1, init_method: str | None = None,
              prompts: list[list[int]] = PROMPTS, lora_names: list[str | None] | None = None,
              late_loras: tuple[tuple[str, str], ...] = (), **overrides) -> dict:
    """overrides: RunnerConfig fields (device "cuda" means this rank's GPU, cuda:tp_rank). lora_names: each
    prompt's LoRA adapter (overrides' lora: the adapters at start-up); late_loras: (name, folder) of adapters
    loaded once the runner is up, as a server loads them at run time."""
    from model_executor.distributed import parallel_state as ps
    from runners.model_runner import ModelRunner, RunnerConfig

    if overrides.get("device") == "cuda":
        overrides["device"] = f"cuda:{tp_rank}"
    runner = ModelRunner(RunnerConfig(**{"model_path": path, "max_running_requests": 4, "max_total_tokens": 256,
                                         "tp_rank": tp_rank, "tp_size": tp_size, "dist_init_method": init_method,
                                         **overrides}))
    _phase(tp_rank, "runner ready")
    try:
        loras = [load_lora_as_served(runner, name, folder) for name, folder in late_loras]
        logits = prefill_decode_logits(runner, prompts, lora_names=lora_names)
        _phase(tp_rank, "prefill + decode logits")
        tokens = greedy_tokens(runner, prompts, lora_names=lora_names)
        _phase(tp_rank, "greedy tokens")
        torch.manual_seed(1000 + tp_rank)  # unseeded sampling draws differently on each rank ...
        # ... and rank 0's tokens must win everywhere
        sampled = greedy_tokens(runner, prompts, temperature=1.0, lora_names=lora_names)
        return {"logits": logits, "tokens": tokens, "sampled": sampled, "loras_after_loads": loras,
                "lora_pool_bytes": runner.lora.pool_bytes if runner.lora is not None else 0,
                "kv_heads": runner.kv_cache.k_buffers[0].shape[1], "num_slots": runner.num_kv_slots,
                "path_counts": dict(runner.path_counts), "one_shot_calls": ps.one_shot_calls(),
                "add_norm_calls": ps.one_shot_calls(add_norm=True)}
    finally:
        ps.destroy_tensor_parallel()


def _phase(rank: int, what: str) -> None:
    """Progress of a (possibly hanging) multi-GPU run, seen with pytest -s."""
    print(f"[tp rank {rank}] {time.strftime('%H:%M:%S')} {what}", file=sys.stderr, flush=True)


def _rank_main(rank: int, size: int, paths: list[str], out_dir: str, overrides: dict, per_rank: dict,
               per_path: list[dict]) -> None:
    torch.set_num_threads(1)
    if os.environ.get("DUET_TEST_STACKS_AFTER"):  # a hang dumps every thread's stack of this rank, then exits
        faulthandler.dump_traceback_later(int(os.environ["DUET_TEST_STACKS_AFTER"]), exit=True)
    for i, path in enumerate(paths):
        init = f"file://{out_dir}/init-{i}"
        result = run_model(path, rank, size, init, **{**overrides, **per_path[i], **per_rank.get(rank, {})})
        torch.save(result, os.path.join(out_dir, f"result-{i}-rank{rank}.pt"))
    if str(overrides.get("device", "")).startswith("cuda"):
        _phase(rank, "results saved; exiting without NCCL teardown")
        os._exit(0)  # NCCL teardown after graph-captured collectives can hang (pytorch/pytorch#115388)


def run_tp(paths: list[str], size: int = 2, per_rank: dict | None = None, per_path: list[dict] | None = None,
           **overrides) -> list[list[dict]]:
    """Each model at tp `size` in spawned ranks (gloo on CPU, NCCL on CUDA); [model][rank] -> run_model's
    result. per_rank: {rank: RunnerConfig overrides of that rank only}; per_path: run_model's arguments for
    each model."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="duet-tp-") as d:
        mp.spawn(_rank_main, args=(size, paths, d, overrides, per_rank or {}, per_path or [{}] * len(paths)),
                 nprocs=size, join=True)
        return [[torch.load(Path(d) / f"result-{i}-rank{r}.pt") for r in range(size)] for i in range(len(paths))]


def hf_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Our (tp 1) model's parameters under HF checkpoint names: fused q/k/v and gate/up split again."""
    out = {}
    for name, p in model.named_parameters():  # a tied LM head is listed once, as the embedding (HF's way)
        owner = model.get_submodule(name.rsplit(".", 1)[0])
        if ".qkv_proj." in name:
            for frag, t in zip(("q_proj", "k_proj", "v_proj"), p.split([owner.q_size, owner.kv_size, owner.kv_size])):
                out[name.replace("qkv_proj", frag)] = t
        elif ".gate_up_proj." in name:
            for frag, t in zip(("gate_proj", "up_proj"), p.split(owner.output_sizes)):
                out[name.replace("gate_up_proj", frag)] = t
        else:
            out[name] = p
    return {k: v.detach().contiguous().cpu() for k, v in out.items()}


def save_random_checkpoint(shape_dir: str | Path, out_dir: str | Path, seed: int = 0,
                           dtype: torch.dtype = torch.float32, device: str = "cpu") -> Path:
    """A real-shaped model folder (config.json from shape_dir) with random weights in safetensors, so that
    tp 1 and tp N load the very same weights (random init per rank would draw different shards)."""
    import shutil

    from safetensors.torch import save_file

    from model_executor.distributed import parallel_state as ps
    from model_executor.model_config import ModelConfig
    from model_executor.weight_loader import build_model, init_random_weights

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    shutil.copy(Path(shape_dir) / "config.json", out / "config.json")
    with ps.shard_as(0, 1):
        model = init_random_weights(build_model(ModelConfig.from_pretrained(out), dtype, device), seed)
    save_file(hf_state_dict(model), str(out / "model.safetensors"))
    del model
    return out


def _silent_peer_rank(rank: int, init_method: str, out_dir: str) -> None:
    """Rank 1 joins the group and then never takes part in a collective; rank 0 broadcasts and records
    how that ended."""
    import time

    from model_executor.distributed import parallel_state as ps

    ps.init_tensor_parallel(rank, 2, init_method, torch.device("cpu"), timeout_s=2.0)
    done = Path(out_dir) / "rank0.txt"
    if rank == 1:
        while not done.exists():
            time.sleep(0.1)
        return
    try:
        ps.broadcast_object(["a message"])
        done.write_text("returned")
    except Exception as e:  # noqa: BLE001 - the test reads what happened
        done.write_text(f"{type(e).__name__}: {e}")


def _teardown_rank(rank: int, init_method: str, out_dir: str, peer_leaves: bool) -> None:
    """Both ranks join; rank 1 reaches the teardown half a second late (writing rank1_arrived first), or with
    peer_leaves never (it returns without leaving the group). Rank 0 leaves at once, with a 5 s teardown wait,
    and records what it saw when destroy_tensor_parallel returned: whether rank 1 had arrived, and the warning."""
    import logging

    from model_executor.distributed import parallel_state as ps

    ps.init_tensor_parallel(rank, 2, init_method, torch.device("cpu"), timeout_s=30.0)
    out = Path(out_dir)
    if rank == 1:
        time.sleep(0.5)
        if peer_leaves:
            while not (out / "rank0.json").exists():
                time.sleep(0.1)
            return
        (out / "rank1_arrived").write_text("")
        ps.destroy_tensor_parallel()
        return
    warnings: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: warnings.append(record.getMessage())
    logging.getLogger("duet.parallel_state").addHandler(handler)
    ps.TEARDOWN_BARRIER = datetime.timedelta(seconds=5)
    ps.destroy_tensor_parallel()
    (out / "rank0.json").write_text(json.dumps({"peer_arrived": (out / "rank1_arrived").exists(),
                                                "initialized": torch.distributed.is_initialized(),
                                                "warnings": warnings}))

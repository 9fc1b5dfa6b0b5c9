"""CPU cost of one scheduler step with many running requests, the forward pass stubbed out.

    python -m benchmarks.bench_scheduler --running 256 --steps 50
"""

from __future__ import annotations

import argparse
import json
import pickle
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from model_executor.sampling_params import SamplingParams
from runners.model_runner import ModelRunner, RunnerConfig
from scheduler.scheduler import Scheduler, SchedulerConfig
from scheduler.scheduler_process import _batch_out

TINY = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 320, "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "eos_token_id": 2}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_scheduler", description=__doc__.splitlines()[0])
    p.add_argument("--running", type=int, default=256)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--json", dest="json_out")
    args = p.parse_args(argv)
    folder = Path(tempfile.mkdtemp())
    (folder / "config.json").write_text(json.dumps(TINY))
    n = args.running
    runner = ModelRunner(RunnerConfig(model_path=str(folder), random_weights=True, max_running_requests=n,
                                      max_total_tokens=n * (args.prompt_len + args.steps + 8)))
    vocab = TINY["vocab_size"]

    def stub_forward(fb):  # the scheduler's own work only: batch building, sampling, bookkeeping
        return torch.zeros(fb.batch_size, vocab)

    runner.forward = stub_forward
    sched = Scheduler(runner, SchedulerConfig(max_running_requests=n, max_prefill_tokens=n * args.prompt_len))
    for i in range(n):
        sched.add_request(str(i), [3 + (i + j) % 300 for j in range(args.prompt_len)],
                          SamplingParams(max_new_tokens=args.steps + 4, temperature=0.0, ignore_eos=True))
    sched.step()  # one extend admits everyone
    assert len(sched.running) == n, len(sched.running)
    times, ipc = [], []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        outputs = sched.step()
        times.append((time.perf_counter() - t0) * 1e3)
        # What the scheduler process sends per step: pickled by zmq's send_pyobj (the unpickling happens in
        # the detokenizer process).
        t0 = time.perf_counter()
        frame = pickle.dumps(_batch_out(outputs), pickle.HIGHEST_PROTOCOL)
        ipc.append((time.perf_counter() - t0) * 1e3)
    result = {"running": n, "median_step_ms": round(statistics.median(times), 3),
              "p90_step_ms": round(sorted(times)[int(0.9 * len(times))], 3), "steps": args.steps,
              "median_ipc_pickle_ms": round(statistics.median(ipc), 3), "ipc_frame_bytes": len(frame),
              "torch_threads": torch.get_num_threads()}
    print(f"{n} running requests: scheduler step (forward stubbed) median {result['median_step_ms']} ms, "
          f"p90 {result['p90_step_ms']} ms over {args.steps} decode steps; pickling the step's output message "
          f"median {result['median_ipc_pickle_ms']} ms ({len(frame)} bytes)")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

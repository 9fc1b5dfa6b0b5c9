"""CPU cost of one scheduler step with many running requests, the forward pass stubbed out.

    python -m benchmarks.bench_scheduler --running 256 --steps 50
    python -m benchmarks.bench_scheduler --running 256 --steps 50 --breakdown

The step time includes the torch ops the scheduler runs on CPU tensors here (the stub's logits, argmax, the
request-table write), which on a GPU are kernel launches: with several intra-op threads on a loaded machine
they can dominate (OMP_NUM_THREADS=1 shows the Python work alone). --breakdown adds the median time of each
phase of the step (schedule, build_batch, forward, sample, read, outputs; "other" is the rest of step()).
"""

from __future__ import annotations

import argparse
import json
import pickle
import statistics
import sys
import tempfile
import time
from collections import defaultdict
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
    p.add_argument("--breakdown", action="store_true", help="also time each phase of the step")
    p.add_argument("--overlap", action="store_true",
                   help="overlap scheduling (the server's default; off keeps the history's numbers comparable)")
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
    sched = Scheduler(runner, SchedulerConfig(max_running_requests=n, max_prefill_tokens=n * args.prompt_len,
                                              enable_overlap=args.overlap))
    for i in range(n):
        sched.add_request(str(i), [3 + (i + j) % 300 for j in range(args.prompt_len)],
                          SamplingParams(max_new_tokens=args.steps + 4, temperature=0.0, ignore_eos=True))
    sched.step()  # one extend admits everyone
    assert len(sched.running) == n, len(sched.running)
    phases = _time_phases(sched) if args.breakdown else None
    times, ipc = [], []
    for _ in range(args.steps):
        if phases is not None:
            phases.start_step()
        t0 = time.perf_counter()
        outputs = sched.step()
        times.append((time.perf_counter() - t0) * 1e3)
        if phases is not None:
            phases.end_step(times[-1])
        # What the scheduler process sends per step: pickled by zmq's send_pyobj (the unpickling happens in
        # the detokenizer process).
        t0 = time.perf_counter()
        frame = pickle.dumps(_batch_out(outputs), pickle.HIGHEST_PROTOCOL)
        ipc.append((time.perf_counter() - t0) * 1e3)
    result = {"running": n, "median_step_ms": round(statistics.median(times), 3),
              "p90_step_ms": round(sorted(times)[int(0.9 * len(times))], 3), "steps": args.steps,
              "median_ipc_pickle_ms": round(statistics.median(ipc), 3), "ipc_frame_bytes": len(frame),
              "torch_threads": torch.get_num_threads(), "overlap": args.overlap}
    print(f"{n} running requests: scheduler step (forward stubbed) median {result['median_step_ms']} ms, "
          f"p90 {result['p90_step_ms']} ms over {args.steps} decode steps; pickling the step's output message "
          f"median {result['median_ipc_pickle_ms']} ms ({len(frame)} bytes)")
    if phases is not None:
        result["phases_median_ms"] = phases.medians()
        print("  per phase (median ms): " + ", ".join(f"{k} {v}" for k, v in result["phases_median_ms"].items()))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(result, indent=2))
    return 0


class _PhaseTimes:
    """Time spent in wrapped methods, per step; a wrapped call made inside another counts for its own phase
    only (it is taken out of the caller's)."""

    def __init__(self):
        self.steps: list[dict[str, float]] = []
        self.current: dict[str, float] = defaultdict(float)
        self.stack: list[str] = []

    def wrap(self, obj, attr: str, phase: str) -> None:
        fn = getattr(obj, attr)

        def timed(*a, **kw):
            self.stack.append(phase)
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                elapsed = (time.perf_counter() - t0) * 1e3
                self.stack.pop()
                self.current[phase] += elapsed
                if self.stack:
                    self.current[self.stack[-1]] -= elapsed

        setattr(obj, attr, timed)

    def start_step(self) -> None:
        self.current = defaultdict(float)

    def end_step(self, total_ms: float) -> None:
        step = dict(self.current)
        step["other"] = total_ms - sum(step.values())
        step["total"] = total_ms
        self.steps.append(step)

    def medians(self) -> dict[str, float]:
        keys = list(dict.fromkeys(k for s in self.steps for k in s))
        return {k: round(statistics.median(s.get(k, 0.0) for s in self.steps), 3) for k in keys}


def _time_phases(sched: Scheduler) -> _PhaseTimes:
    """Phases of a decode step (the nested ones are subtracted from the phase that calls them)."""
    t = _PhaseTimes()
    t.wrap(sched, "_make_room_for_decode", "schedule")
    t.wrap(sched.runner, "build_batch", "build_batch")
    t.wrap(sched.runner, "forward", "forward")
    t.wrap(sched, "_sample", "sample")
    t.wrap(sched, "_append_sampled", "read")
    t.wrap(sched, "_collect_outputs", "outputs")
    return t


if __name__ == "__main__":
    sys.exit(main())

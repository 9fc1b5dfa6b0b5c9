"""CPU cost of one scheduler step with many running requests, the forward pass stubbed out.

    python -m benchmarks.bench_scheduler --running 256 --steps 50
    python -m benchmarks.bench_scheduler --running 256 --steps 50 --breakdown
    python -m benchmarks.bench_scheduler --running 64 --overlap --json-schema-ratio 0.5 --breakdown

--json-schema-ratio puts that share of the requests under bench_serving's json_schema (one unbounded string
field) with the vocabulary of --vocab-shape (make_dummy_model's word-level tokenizer, 128,256 tokens for
Llama-3.2-1B: the grammar compiler sees what the GPU server sees); the stub's logits then have that width and
are random, so the grammars walk through the states a random model drives them to (--vocab-shape alone gives
the plain run at the same width). The breakdown then also separates the grammar's phases (accept, fill, the
mask upload) from the vocabulary-sized tensor work that is a kernel on a GPU (the stub forward, the mask's
apply, the sampler): "host" is the step without the latter.

The step time includes the torch ops the scheduler runs on CPU tensors here (the stub's logits, argmax, the
request-table write), which on a GPU are kernel launches: with several intra-op threads on a loaded machine
they can dominate (OMP_NUM_THREADS=1 shows the Python work alone). --breakdown adds the median time of each
phase of the step (schedule, build_batch, forward, sample, read, outputs; "other" is the rest of step()), and
"host": the step without the phases marked (device).
"""

from __future__ import annotations

import argparse
import itertools
import json
import pickle
import random
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

from benchmarks.bench_serving import BENCH_JSON_SCHEMA
from benchmarks.make_dummy_model import make_dummy_model
from model_executor.configs import SHAPES
from model_executor.sampling_params import GrammarSpec, SamplingParams
from runners.model_runner import ModelRunner, RunnerConfig
from scheduler.scheduler import Scheduler, SchedulerConfig
from scheduler.scheduler_process import _batch_out

TINY = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 320, "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "eos_token_id": 2}

WARM_STEPS = 16
ADMIT_TIMEOUT_S = 300  # the requests' admission, the grammar's compilation included


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_scheduler",
                                description=__doc__.splitlines()[0])
    p.add_argument("--running", type=int, default=256)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--breakdown", action="store_true", help="also time each phase of the step")
    p.add_argument("--overlap", action="store_true",
                   help="overlap scheduling (the server's default; off keeps the history's numbers comparable)")
    p.add_argument("--json-schema-ratio", type=float, default=0.0,
                   help="share of the requests under bench_serving's json_schema (needs a real vocabulary: "
                        "--vocab-shape, default llama-3.2-1b then)")
    p.add_argument("--vocab-shape", choices=SHAPES,
                   help="use this model shape's vocabulary (make_dummy_model's tokenizer) with the tiny layers")
    p.add_argument("--json", dest="json_out")
    args = p.parse_args(argv)
    if not 0.0 <= args.json_schema_ratio <= 1.0:
        p.error("--json-schema-ratio must be in [0, 1]")
    if args.json_schema_ratio and args.vocab_shape is None:
        args.vocab_shape = "llama-3.2-1b"
    n = args.running
    folder, tokenizer = _model_folder(args.vocab_shape)
    runner = ModelRunner(RunnerConfig(model_path=str(folder), random_weights=True, max_running_requests=n,
                                      max_total_tokens=n * (args.prompt_len + args.steps + WARM_STEPS + 8)))
    vocab = runner.model_config.vocab_size
    runner.forward = _stub_forward(vocab, n, random_logits=args.vocab_shape is not None)
    sched = Scheduler(runner, SchedulerConfig(max_running_requests=n, max_prefill_tokens=n * args.prompt_len,
                                              enable_overlap=args.overlap), tokenizer=tokenizer)
    grammar = GrammarSpec("json_schema", json.dumps(BENCH_JSON_SCHEMA, sort_keys=True, separators=(",", ":")))
    constrained = set(random.Random(0).sample(range(n), round(args.json_schema_ratio * n)))
    ids = random.Random(1)
    for i in range(n):
        prompt = [3 + (i + j) % 300 for j in range(args.prompt_len)] if args.vocab_shape is None else \
            [ids.randrange(100, vocab) for _ in range(args.prompt_len)]
        sched.add_request(str(i), prompt, SamplingParams(max_new_tokens=args.steps + WARM_STEPS + 4, temperature=0.0,
                                                         ignore_eos=True,
                                                         grammar=grammar if i in constrained else None))
    deadline = time.monotonic() + ADMIT_TIMEOUT_S
    while len(sched.running) < n and time.monotonic() < deadline:
        sched.step()  # the grammar compiles in a thread (seconds on a loaded machine); then extends admit everyone
        if len(sched.running) < n:
            time.sleep(0.01)
    if len(sched.running) < n:
        raise RuntimeError(f"only {len(sched.running)} of {n} requests admitted in {ADMIT_TIMEOUT_S} s")
    for _ in range(WARM_STEPS if args.vocab_shape is not None else 0):
        sched.step()  # the constrained rows through the schema's fixed prefix ('{"text":"'), into the string
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
              "torch_threads": torch.get_num_threads(), "overlap": args.overlap, "vocab_size": vocab,
              "json_schema_ratio": args.json_schema_ratio, "constrained_running": sum(
                  r.grammar is not None for r in sched.running)}
    print(f"{n} running requests: scheduler step (forward stubbed) median {result['median_step_ms']} ms, "
          f"p90 {result['p90_step_ms']} ms over {args.steps} decode steps; pickling the step's output message "
          f"median {result['median_ipc_pickle_ms']} ms ({len(frame)} bytes)")
    if phases is not None:
        result["phases_median_ms"] = phases.medians()
        print("  per phase (median ms): " + ", ".join(f"{k} {v}" for k, v in result["phases_median_ms"].items()))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(result, indent=2))
    return 0


def _model_folder(vocab_shape: str | None) -> tuple[Path, object]:
    """The tiny model's folder and its tokenizer (None without a vocab shape: TINY's vocabulary has none)."""
    folder = Path(tempfile.mkdtemp())
    if vocab_shape is None:
        (folder / "config.json").write_text(json.dumps(TINY))
        return folder, None
    from transformers import AutoTokenizer

    make_dummy_model(vocab_shape, folder)  # the shape's tokenizer; its config keeps only vocab and EOS
    shape = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(
        dict(TINY, vocab_size=shape["vocab_size"], eos_token_id=shape["eos_token_id"])))
    return folder, AutoTokenizer.from_pretrained(folder)


def _stub_forward(vocab: int, max_bs: int, random_logits: bool):
    """The scheduler's own work only: batch building, sampling, bookkeeping. random_logits: rows of random
    logits (a few precomputed tables, taken in turn: drawing them each step would dwarf the step), so greedy
    sampling picks varied tokens, as a random model does."""
    if not random_logits:
        return lambda fb: torch.zeros(fb.batch_size, vocab)
    g = torch.Generator().manual_seed(0)
    tables = [torch.randn(max_bs, vocab, generator=g) for _ in range(4)]
    step = itertools.count()

    def forward(fb):
        # A fresh tensor each step, as the model's: the grammar mask is applied to it in place.
        return tables[next(step) % len(tables)][: fb.batch_size].clone()

    return forward


class _PhaseTimes:
    """Time spent in wrapped methods, per step; a wrapped call made inside another counts for its own phase
    only (it is taken out of the caller's)."""

    def __init__(self, device_phases: tuple[str, ...] = ()):
        self.device_phases = device_phases
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
        step["host"] = total_ms - sum(step.get(k, 0.0) for k in self.device_phases)
        self.steps.append(step)

    def medians(self) -> dict[str, float]:
        keys = list(dict.fromkeys(k for s in self.steps for k in s))
        return {k: round(statistics.median(s.get(k, 0.0) for s in self.steps), 3) for k in keys}


def _time_phases(sched: Scheduler) -> _PhaseTimes:
    """Phases of a decode step (the nested ones are subtracted from the phase that calls them). Those marked
    (device) are vocabulary-sized tensor work on the CPU here, kernels on a GPU: "host" leaves them out."""
    t = _PhaseTimes(device_phases=("forward (device)", "sampler (device)", "apply (device)"))
    t.wrap(sched, "_make_room_for_decode", "schedule")
    t.wrap(sched.runner, "build_batch", "build_batch")
    t.wrap(sched.runner, "forward", "forward (device)")
    t.wrap(sched, "_sample", "sample")
    t.wrap(sched.runner, "sample", "sampler (device)")
    t.wrap(sched, "_append_sampled", "read")
    t.wrap(sched, "_collect_outputs", "outputs")
    t.wrap(sched.grammars, "fill_masks", "grammar fill")
    t.wrap(sched.grammars, "apply_filled", "grammar upload")
    t.wrap(sched.grammars, "reapply", "apply (device)")
    t.wrap(sched.grammars, "accept", "grammar accept")
    return t


if __name__ == "__main__":
    sys.exit(main())

"""bench_speculative: speculative decoding against plain decoding, in-process (Scheduler, no HTTP), greedy.

    python -m benchmarks.bench_speculative [--model-path P] [--device cpu] [--batch-size 1 4 16 64]
        [--num-draft-tokens 4] [--oracle] [--never] [--draft-model-path D] [--json out.json]

Workloads (chat-formatted for the model's template): `rewrite` asks the model to repeat a given paragraph (its
answer quotes its prompt: NGRAM's case) and `prose` asks for new text (little to match); random weights from a
folder without a tokenizer (`--random-weights`, a GPU shape) get one prompt of random ids instead (`random`:
the oracle accepts every draft by force there (AcceptAll), never measures the overhead, NGRAM finds little). For
each workload and
batch size (that many copies of the request, decoding together) it runs, interleaved, --repeats times:

* `plain`: no speculation; its outputs are the reference;
* `ngram`: --speculative-algorithm NGRAM at each --num-draft-tokens; outputs must equal plain's token for token;
* `standalone` / `eagle3` (--draft-model-path): drafts from that model (an EAGLE-3 head's folder gives EAGLE3, any
  other model STANDALONE) at each --num-draft-tokens, adaptivity off; outputs must equal plain's. With the target
  itself as the draft on a CPU this is a correctness and overhead check (every draft hits, but the draft costs as
  much as the target), not a speed-up to expect;
* `oracle` (--oracle): drafts are plain's own greedy continuation (the mechanism's ceiling: every draft hits);
* `never` (--never): drafts that never match (plain's token + 1): `never_raw` with the adaptivity off (the cost of
  verifying k + 1 tokens where 1 would do) and `never` with the default adaptivity (what a missing draft costs).

With --verify-cost it also times the forward pass alone (no scheduler) of a verify batch of k + 1 = 2..max
--num-draft-tokens tokens per request against one decode step, at each batch size, after --context-len tokens of
KV each (on a GPU both replay their graphs).

Decode tokens/s counts the output tokens after each request's first over the time after the prefill step; the
table gives the median over repeats, the ratio to plain's in the same run, the mean accept length (tokens per
request and verify step) and whether the output equals plain's. Writes the table's numbers as JSON (--json).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from datetime import datetime, timezone

import torch

from model_executor.forward_batch import ForwardMode
from model_executor.sampling_params import SamplingParams
from model_executor.speculative_sampling import run_index
from runners.model_runner import ModelRunner, RunnerConfig
from scheduler.scheduler import Scheduler, SchedulerConfig
from scheduler.speculative import NgramProposer, SpeculativeConfig

PARAGRAPH = (
    "The lighthouse stood at the end of a narrow spit of rock, where the sea broke white on three sides. For a "
    "hundred years its keepers had climbed the spiral stair each evening to light the lamp, trimming the wick "
    "and polishing the great glass lens until it shone. Ships passing in the night saw its beam sweep across the "
    "water every ten seconds, a steady pulse that told them where the hidden reef lay. When the light was "
    "finally automated, the last keeper locked the door, walked down the path to the village, and never looked "
    "back."
)
WORKLOADS = {
    "rewrite": f"Repeat the following paragraph exactly, word for word:\n\n{PARAGRAPH}",
    "prose": "Write a short essay about the history of the bicycle.",
}

# Random weights from a folder without a tokenizer: one prompt of random ids (workload `random`).
RANDOM_PROMPT_TOKENS = 128


class RecordedDrafts(NgramProposer):
    """Drafts from a recorded greedy output: the true continuation (oracle) or a token that never matches."""

    def __init__(self, recorded: dict[str, list[int]], vocab: int, never: bool):
        self.recorded, self.vocab, self.never = recorded, vocab, never

    def propose_one(self, req, k: int) -> list[int]:
        ref = self.recorded[req.rid]
        n = len(req.output_ids)
        draft = ref[n:n + k]
        return [(t + 1) % self.vocab for t in draft] if self.never else draft


class AcceptAll:
    """Random weights: every draft is accepted whatever the target computes (a bench-only stand-in for the oracle).
    A random model's logits are nearly flat, so the verify pass and the decode step, which round apart, pick
    different argmaxes, and drafts from plain decoding miss; forcing the acceptance measures the mechanism's
    ceiling (a verify pass per k + 1 tokens) all the same. Its outputs are not plain's."""

    def __init__(self, runner: ModelRunner):
        self.runner, self.verify = runner, runner.verify

    def __enter__(self):
        self.runner.verify = self._verify_all
        return self

    def __exit__(self, *exc):
        self.runner.verify = self.verify

    def _verify_all(self, logits, info, drafts, num_rows, rows):
        out = self.verify(logits, info, drafts, num_rows, rows)
        starts, _, _ = run_index(num_rows, logits.device)
        out.row_tokens = torch.where(drafts >= 0, drafts, out.row_tokens)
        out.accept_lens = torch.tensor([n - 1 for n in num_rows], dtype=torch.int64, device=logits.device)
        out.final_tokens = out.row_tokens[starts + out.accept_lens]
        self.runner.last_token_ids[rows] = out.final_tokens
        return out


def make_scheduler(runner: ModelRunner, bs: int, spec: SpeculativeConfig | None) -> Scheduler:
    return Scheduler(runner, SchedulerConfig(max_running_requests=max(bs, 1), speculative=spec))


def run(s: Scheduler, prompt: list[int], bs: int, output_len: int) -> dict:
    for i in range(bs):
        s.add_request(f"r{i}", prompt, SamplingParams(max_new_tokens=output_len, temperature=0.0))
    out: dict[str, list[int]] = {}
    t0 = time.perf_counter()
    t_first = None
    while s.has_work():
        for o in s.step():
            out.setdefault(o.rid, []).extend(o.new_token_ids)
        if t_first is None:
            t_first = time.perf_counter()
    end = time.perf_counter()
    s.check_invariant()
    s.flush_cache()  # the runner's KV pool goes to the next scheduler empty
    tokens = sum(len(v) for v in out.values())
    decode_s = end - t_first
    return {"outputs": out, "tokens": tokens, "decode_tok_s": (tokens - bs) / decode_s if decode_s > 0 else 0.0,
            "total_s": end - t0, "stats": s.stats()}


def sync(runner: ModelRunner) -> None:
    if runner.device.type == "cuda":
        torch.cuda.synchronize(runner.device)


def verify_cost(runner: ModelRunner, bs: int, context: int, sizes: list[int], steps: int) -> dict[int, float]:
    """Median ms of one forward pass with n tokens per request (n = 1: the decode step; n > 1: the verify batch;
    graphs where captured) after `context` tokens of KV per request."""
    width = context + max(sizes)
    rows = [runner.req_to_token_pool.alloc() for _ in range(bs)]
    slots = runner.allocator.alloc(bs * width)
    try:
        for i, row in enumerate(rows):
            runner.req_to_token_pool.write(row, 0, slots[i * width:(i + 1) * width])
        out = {}
        for n in sizes:
            loc = torch.cat([slots[i * width + context:i * width + context + n] for i in range(bs)])
            seq_lens = [context + n] * bs
            times = []
            for _ in range(steps + 2):
                if n == 1:
                    fb = runner.build_batch(ForwardMode.DECODE, [1] * bs, rows, seq_lens, loc)
                    sync(runner)
                    t = time.perf_counter()
                    runner.forward(fb)
                else:
                    fb = runner.build_verify_batch([1] * (bs * n), rows, seq_lens, loc, [n] * bs)
                    sync(runner)
                    t = time.perf_counter()
                    runner.forward_verify(fb)
                sync(runner)
                times.append((time.perf_counter() - t) * 1e3)
            out[n] = statistics.median(times[2:])
        return out
    finally:
        runner.allocator.free(slots)
        for row in rows:
            runner.req_to_token_pool.free(row)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_speculative", description=__doc__.splitlines()[0])
    p.add_argument("--model-path", help="HF folder (default: the converted default model)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--random-weights", action="store_true", help="real shapes, random weights (GPU shapes)")
    p.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    p.add_argument("--batch-size", type=int, nargs="+", default=[1])
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--num-draft-tokens", type=int, nargs="+", default=[4],
                   help="NGRAM's tokens verified per step and request (each a run)")
    p.add_argument("--oracle", action="store_true", help="also drafts from plain's own output (the ceiling)")
    p.add_argument("--never", action="store_true", help="also drafts that never match (the overhead)")
    p.add_argument("--draft-model-path", help="also draft with this model (STANDALONE) or EAGLE-3 head (EAGLE3)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--verify-cost", action="store_true",
                   help="also time verify passes of 2..max(--num-draft-tokens) tokens per request")
    p.add_argument("--context-len", type=int, default=256, help="KV tokens per request for --verify-cost")
    p.add_argument("--skip-workloads", action="store_true", help="only --verify-cost")
    p.add_argument("--json", dest="json_out", help="write the results here")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    from transformers import AutoTokenizer

    from scheduler.cpu_threads import configure_scheduler_threads

    model_path = args.model_path
    if model_path is None:
        from model_executor import default_model

        model_path = str(default_model.ensure_default_model())
    threads = configure_scheduler_threads(args.device)
    try:
        tok = AutoTokenizer.from_pretrained(model_path)
    except (OSError, ValueError):  # a shape folder (random weights) has no tokenizer
        if not args.random_weights:
            raise
        tok = None
    max_bs = max(args.batch_size)
    runner = ModelRunner(RunnerConfig(model_path=model_path, device=args.device, max_running_requests=max_bs,
                                      random_weights=args.random_weights, max_total_tokens=(
                                          None if args.device != "cpu" else 16384),
                                      disable_cuda_graph=args.device == "cpu",
                                      # on a GPU, decode steps and verify passes replay graphs at these sizes
                                      cuda_graph_bs=() if args.device == "cpu" else tuple(sorted(set(args.batch_size))),
                                      speculative_tokens=max(args.num_draft_tokens), speculative_max_bs=max_bs))
    vocab = runner.model_config.vocab_size
    draft_algorithm = None
    if args.draft_model_path:
        with open(os.path.join(args.draft_model_path, "config.json")) as f:
            arch = json.load(f).get("architectures") or [""]
        draft_algorithm = "EAGLE3" if arch[0] == "LlamaForCausalLMEagle3" else "STANDALONE"
    rows, meta = [], {
        "model_path": model_path, "draft_model_path": args.draft_model_path, "device": args.device, "threads": threads, "output_len": args.output_len,
        "repeats": args.repeats, "date": datetime.now(timezone.utc).strftime("%Y-%m-%d"),
        "machine": torch.cuda.get_device_name() if args.device.startswith("cuda") else f"CPU, {os.cpu_count()} cores",
        "load_average": round(os.getloadavg()[0], 2)}
    cost_rows = []
    if args.verify_cost:
        for bs in args.batch_size:
            ms = verify_cost(runner, bs, args.context_len, list(range(1, max(args.num_draft_tokens) + 1)),
                             steps=5 if args.device == "cpu" else 20)
            cost_rows.append({"batch_size": bs, "context_len": args.context_len,
                              "ms": {n: round(v, 3) for n, v in ms.items()},
                              "ratio_to_decode": {n: round(v / ms[1], 3) for n, v in ms.items()}})
            print(json.dumps(cost_rows[-1]), file=sys.stderr)
    workloads = ["random"] if tok is None else args.workloads
    for workload in ([] if args.skip_workloads else workloads):
        if tok is None:  # random weights without a tokenizer: a random prompt (oracle / never still measure)
            prompt = torch.randint(3, vocab, (RANDOM_PROMPT_TOKENS,), generator=torch.Generator().manual_seed(0))
            prompt = prompt.tolist()
        else:
            messages = [{"role": "user", "content": WORKLOADS[workload]}]
            text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            prompt = tok.encode(text, add_special_tokens=False)
        for bs in args.batch_size:
            run(make_scheduler(runner, bs, None), prompt, bs, 8)  # warm-up
            plain0 = run(make_scheduler(runner, bs, None), prompt, bs, args.output_len)
            recorded = plain0["outputs"]
            configs: list[tuple[str, int, object]] = []
            for n in args.num_draft_tokens:
                configs.append((f"ngram k+1={n}", n, None))
                if draft_algorithm is not None:
                    configs.append((f"{draft_algorithm.lower()} k+1={n}", n, draft_algorithm))
            if args.oracle:
                configs.append(("oracle", max(args.num_draft_tokens), "oracle"))
            if args.never:
                configs.append(("never_raw", max(args.num_draft_tokens), "never_raw"))
                configs.append(("never", max(args.num_draft_tokens), "never"))
            results: dict[str, list[dict]] = {"plain": [plain0]}
            for _ in range(args.repeats):
                if len(results["plain"]) < args.repeats:
                    results["plain"].append(run(make_scheduler(runner, bs, None), prompt, bs, args.output_len))
                for name, n, kind in configs:
                    if kind in ("STANDALONE", "EAGLE3"):
                        spec = SpeculativeConfig(kind, n, draft_model_path=args.draft_model_path, adaptive=False)
                    else:
                        spec = SpeculativeConfig("NGRAM", n, adaptive=kind != "never_raw")
                    s = make_scheduler(runner, bs, spec)
                    if kind in ("oracle", "never", "never_raw"):
                        s.speculator.proposer = RecordedDrafts(recorded, vocab, never=kind != "oracle")
                    forced = kind == "oracle" and tok is None
                    with AcceptAll(runner) if forced else contextlib.nullcontext():
                        results.setdefault(name, []).append(run(s, prompt, bs, args.output_len))
                    runner.model.set_aux_hidden_state_layers(None)  # (EAGLE3 turned them on for its run)
            plain_tok_s = statistics.median(r["decode_tok_s"] for r in results["plain"])
            for name, runs in results.items():
                tok_s = statistics.median(r["decode_tok_s"] for r in runs)
                st = runs[-1]["stats"]
                rows.append({
                    "workload": workload, "batch_size": bs, "config": name, "prompt_tokens": len(prompt),
                    "output_tokens": runs[-1]["tokens"], "decode_tok_s": round(tok_s, 2),
                    "ratio": round(tok_s / plain_tok_s, 3),
                    "accept_length": st.get("spec_accept_length"),
                    "identical": None if name == "oracle" and tok is None else all(r["outputs"] == recorded
                                                                                     for r in runs),
                    "runs_tok_s": [round(r["decode_tok_s"], 2) for r in runs]})
                print(json.dumps(rows[-1]), file=sys.stderr)
    meta["load_average_after"] = round(os.getloadavg()[0], 2)
    print(f"\n{'workload':<9} {'bs':>3} {'config':<18} {'tok/s':>8} {'x plain':>8} {'accept len':>10} {'identical':>9}")
    for r in rows:
        acc = "-" if r["accept_length"] is None else f"{r['accept_length']:.2f}"
        print(f"{r['workload']:<9} {r['batch_size']:>3} {r['config']:<18} {r['decode_tok_s']:>8.1f} "
              f"{r['ratio']:>8.2f} {acc:>10} {'-' if r['identical'] is None else str(r['identical']):>9}")
    if cost_rows:
        print(f"\nverify pass / decode step (context {args.context_len}), k+1 tokens per request:")
        sizes = range(2, max(args.num_draft_tokens) + 1)
        print(f"{'bs':>3} {'decode ms':>9} " + " ".join(f"{n:>6}" for n in sizes))
        for r in cost_rows:
            print(f"{r['batch_size']:>3} {r['ms'][1]:>9.2f} "
                  + " ".join(f"{r['ratio_to_decode'][n]:>6.2f}" for n in sizes))
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"meta": meta, "rows": rows, "verify_cost": cost_rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())

"""bench_cpu_quality: the default model's CPU weight formats against float32, quality first, then speed.

    python -m benchmarks.bench_cpu_quality [--formats float32 bfloat16 float16 int8 int4] [--speed-all]
                                           [--json out.json]

Picks the default model's CPU format (model_executor/default_model.py, default_quantization) by a quality gate
measured on real text, then by speed. For each format, in one process, against float32 (the reference: the
converted checkpoint's own weights):

* teacher-forced over the texts in `cpu_quality_texts.json` (prose, code, a chat rendered with the chat
  template, lists, numbers; about 4,800 tokens): at every position, whether the format's argmax equals
  float32's (greedy agreement), the error of the log-probability it gives the text's next token
  (|logprob_fmt - logprob_fp32|, mean and max) and KL(float32 || format), mean over positions;
* short factual chat questions with known answers, greedy through the chat template (temperature 0,
  max_tokens 32, as the README's example): an answer is correct when it contains an expected word; also
  whether it equals float32's answer word for word;
* then, for the formats that pass the gate (all with --speed-all), speed through the scheduler (what the
  server runs, minus HTTP): decode tok/s at bs 1 and --batch, prefill tok/s of a --prefill-len prompt (the
  formats take turns, best of --repeats rounds).

The gate (GATE below): greedy agreement >= 95%, at most one factual question fewer correct than float32, and
the README's question ("What is the capital of France?") answered "Paris". Among the formats that pass, the
default is the fastest at bs=1 decode (one user chatting: the quick start's workload), unless its prefill is
more than 25% slower than float32's (a long prompt's wait is part of that user's latency too). bfloat16's
speed depends on the CPU: torch runs it through oneDNN where the CPU has AVX-512 (or Arm bf16), else through a
generic path; `ONEDNN_MAX_CPU_ISA=AVX2` in the environment measures the latter on an AVX-512 machine.
Prints two tables and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import sys
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import torch

TEXTS_FILE = Path(__file__).with_name("cpu_quality_texts.json")

GATE = {"min_greedy_agreement": 0.95, "max_factual_drop": 1, "readme_answer": "Paris"}
MAX_PREFILL_SLOWDOWN = 0.25  # a faster decode does not win with a prefill this much slower than float32's
README_QUESTION = "What is the capital of France?"


@dataclass(frozen=True)
class Format:
    """A CPU weight format as the server's flags spell it."""

    name: str
    dtype: str  # --dtype
    quantization: str  # --quantization

    @property
    def flags(self) -> str:
        return f"--dtype {self.dtype}" if self.quantization == "none" else f"--quantization {self.quantization}"


FORMATS = {f.name: f for f in (
    Format("float32", "float32", "none"),
    Format("bfloat16", "bfloat16", "none"),
    Format("float16", "float16", "none"),
    Format("int8", "float32", "int8"),  # weight-only int8 (bfloat16 activations in the GEMMs)
    Format("int4", "float32", "int4"),  # weight-only int4, groups of 32 (bfloat16 activations in the GEMMs)
)}

# (question, accepted answers): an answer is correct when one of them appears as a word (case-insensitive).
QUESTIONS = [
    (README_QUESTION, ["Paris"]),
    ("What is the largest planet in our solar system?", ["Jupiter"]),
    ("What is the chemical formula of water?", ["H2O", "H₂O"]),
    ("Who wrote Hamlet?", ["Shakespeare"]),
    ("What is the capital of Japan?", ["Tokyo"]),
    ("How many days are there in a week?", ["seven", "7"]),
    ("At what temperature in degrees Celsius does water boil at sea level?", ["100"]),
    ("Which planet is known as the Red Planet?", ["Mars"]),
    ("What is the largest ocean on Earth?", ["Pacific"]),
    ("Who painted the Mona Lisa?", ["Leonardo", "da Vinci"]),
    ("Which gas do plants take from the air for photosynthesis?", ["carbon dioxide", "CO2", "CO₂"]),
    ("What is the capital of Italy?", ["Rome"]),
    ("How many continents are there on Earth?", ["seven", "7"]),
    ("At what temperature in degrees Fahrenheit does water freeze?", ["32"]),
    ("What is the chemical symbol for gold?", ["Au"]),
    ("Who developed the theory of relativity?", ["Einstein"]),
    ("What is the tallest mountain in the world?", ["Everest"]),
    ("Which language is mainly spoken in Brazil?", ["Portuguese"]),
    ("How many legs does a spider have?", ["eight", "8"]),
    ("What is the square root of 81?", ["nine", "9"]),
    ("What is the capital of Germany?", ["Berlin"]),
    ("Which organ pumps blood through the human body?", ["heart"]),
]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_cpu_quality", description=__doc__.splitlines()[0])
    p.add_argument("--model-path", help="HF folder (default: the converted default model)")
    p.add_argument("--formats", nargs="+", default=["float32", "bfloat16", "int8", "int4"], choices=sorted(FORMATS),
                   help="formats to compare (float32, the reference, is always measured)")
    p.add_argument("--batch", type=int, default=16, help="the batched decode's batch size")
    p.add_argument("--decode-steps", type=int, default=32, help="decode steps timed per measurement")
    p.add_argument("--prefill-len", type=int, default=1024, help="tokens of the timed prefill")
    p.add_argument("--repeats", type=int, default=3, help="speed: best of this many rounds")
    p.add_argument("--speed-all", action="store_true", help="also time the formats that fail the gate")
    p.add_argument("--json", dest="json_out", help="write the results here")
    return p.parse_args(argv)


# ---- the engine, in process ---------------------------------------------------------------------


def make_runner(model_path: str, fmt: Format, max_running: int = 32, max_total_tokens: int = 8192):
    from runners.model_runner import ModelRunner, RunnerConfig

    return ModelRunner(RunnerConfig(model_path=model_path, device="cpu", dtype=fmt.dtype,
                                    quantization=fmt.quantization, max_running_requests=max_running,
                                    max_total_tokens=max_total_tokens))


@torch.inference_mode()
def teacher_forced_logprobs(runner, ids: list[int]) -> torch.Tensor:
    """float32 log-probabilities [len(ids) - 1, vocab]: row t is the model's distribution for token t + 1
    given ids[: t + 1], from one extend of the whole text (the engine's own batch, attention and kernels)."""
    from model_executor.forward_batch import ForwardMode

    row = runner.req_to_token_pool.alloc()
    slots = runner.allocator.alloc(len(ids))
    try:
        runner.req_to_token_pool.write(row, 0, slots)
        fb = runner.build_batch(ForwardMode.EXTEND, ids, [row], [len(ids)], slots, extend_seq_lens=[len(ids)])
        runner.attn_backend.init_forward_metadata(fb)
        hidden = runner.model.model(fb.input_ids, fb.positions, fb)  # every position's final-norm output
        return runner.model.lm_head(hidden[:-1]).float().log_softmax(-1)
    finally:
        runner.allocator.free(slots)
        runner.req_to_token_pool.free(row)


def run_requests(runner, prompts: list[list[int]], params) -> tuple[list[list[int]], float, float]:
    """All prompts through a fresh scheduler at once: (output ids per prompt, seconds until every prompt had
    its first token, seconds from then until the last finished)."""
    from scheduler.scheduler import Scheduler, SchedulerConfig

    sched = Scheduler(runner, SchedulerConfig(max_running_requests=max(1, len(prompts)), disable_radix_cache=True))
    for i, ids in enumerate(prompts):
        sched.add_request(str(i), ids, params)
    outs: list[list[int]] = [[] for _ in prompts]
    t0 = time.perf_counter()
    first_done = None
    while sched.has_work():
        for o in sched.step():
            outs[int(o.rid)].extend(o.new_token_ids)
        if first_done is None and all(outs):
            first_done = time.perf_counter()
    end = time.perf_counter()
    return outs, (first_done or end) - t0, end - (first_done or end)


# ---- quality ------------------------------------------------------------------------------------


def load_texts(tokenizer) -> list[dict]:
    data = json.loads(TEXTS_FILE.read_text())
    texts = []
    for t in data["texts"]:
        if "messages" in t:
            ids = tokenizer.apply_chat_template(t["messages"], tokenize=True, return_dict=True)["input_ids"]
        else:
            ids = tokenizer.encode(t["text"])
        texts.append({"kind": t["kind"], "source": t["source"], "ids": list(ids)})
    return texts


def chat_prompt(tokenizer, question: str) -> list[int]:
    ids = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                        tokenize=True, return_dict=True)["input_ids"]
    return list(ids)


def is_correct(answer: str, accepted: list[str]) -> bool:
    return any(re.search(rf"(?<!\w){re.escape(a)}(?!\w)", answer, re.IGNORECASE) for a in accepted)


def answer_questions(runner, tokenizer) -> list[str]:
    from model_executor.sampling_params import SamplingParams

    prompts = [chat_prompt(tokenizer, q) for q, _ in QUESTIONS]
    outs, _, _ = run_requests(runner, prompts, SamplingParams(max_new_tokens=32, temperature=0.0))
    return [tokenizer.decode(o, skip_special_tokens=True).strip() for o in outs]


def compare_logprobs(ref: torch.Tensor, got: torch.Tensor, targets: list[int]) -> dict:
    """Sums over positions (divided by the total count later) and maxima, for one text."""
    tgt = torch.tensor(targets)[:, None]
    err = (got.gather(1, tgt) - ref.gather(1, tgt)).abs()[:, 0]
    kl = (ref.exp() * (ref - got)).sum(-1)
    return {"n": len(targets), "agree": int((got.argmax(-1) == ref.argmax(-1)).sum()),
            "err_sum": float(err.sum()), "err_max": float(err.max()), "kl_sum": float(kl.sum()),
            "nll_sum": float(-got.gather(1, tgt).sum())}


def summarize(parts: list[dict]) -> dict:
    n = sum(p["n"] for p in parts)
    return {"tokens": n, "greedy_agreement": sum(p["agree"] for p in parts) / n,
            "logprob_err_mean": sum(p["err_sum"] for p in parts) / n,
            "logprob_err_max": max(p["err_max"] for p in parts), "kl_mean": sum(p["kl_sum"] for p in parts) / n,
            "perplexity": math.exp(sum(p["nll_sum"] for p in parts) / n)}


# ---- speed --------------------------------------------------------------------------------------


def measure_speed(runners: dict, args, prefill_ids: list[int]) -> dict[str, dict]:
    """Decode tok/s at bs 1 and --batch, prefill tok/s, per runner: the formats take turns, --repeats rounds,
    and each number is its format's best round (the machine may be shared: the best run is the least
    disturbed, and turns spread a disturbance over all formats instead of one)."""
    from model_executor.sampling_params import SamplingParams

    def decode_tok_s(runner, bs: int) -> float:
        prompts = [prefill_ids[i * 16 : (i + 1) * 16] for i in range(bs)]
        params = SamplingParams(max_new_tokens=args.decode_steps + 1, temperature=0.0, ignore_eos=True)
        _, _, decode_s = run_requests(runner, prompts, params)
        return bs * args.decode_steps / decode_s

    def prefill_tok_s(runner) -> float:
        prompt = prefill_ids[: args.prefill_len]
        _, first_s, _ = run_requests(runner, [prompt], SamplingParams(max_new_tokens=1, temperature=0.0))
        return len(prompt) / first_s

    keys = ("decode_bs1_tok_s", f"decode_bs{args.batch}_tok_s", "prefill_tok_s")
    runs = {name: {k: [] for k in keys} for name in runners}
    for runner in runners.values():
        decode_tok_s(runner, 2)  # warm-up
    for _ in range(args.repeats):
        for name, runner in runners.items():
            runs[name][keys[0]].append(decode_tok_s(runner, 1))
            runs[name][keys[1]].append(decode_tok_s(runner, args.batch))
            runs[name][keys[2]].append(prefill_tok_s(runner))
    return {name: {k: round(max(v), 2) for k, v in r.items()} | {"runs": r} for name, r in runs.items()}


# ---- main ---------------------------------------------------------------------------------------


def choose_default(results: dict) -> str:
    passing = [name for name, r in results.items() if r["gate"]["pass"]]
    ref_prefill = results["float32"]["speed"]["prefill_tok_s"]
    fast_enough = [n for n in passing
                   if results[n]["speed"]["prefill_tok_s"] >= (1 - MAX_PREFILL_SLOWDOWN) * ref_prefill]
    return max(fast_enough or ["float32"], key=lambda n: results[n]["speed"]["decode_bs1_tok_s"])


def cpu_runs_bfloat16_fast() -> bool:
    """Whether torch computes bfloat16 GEMMs on this CPU with oneDNN (else through a slow generic path)."""
    import torch

    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # a torch built without oneDNN
        return False


def main(argv=None) -> int:
    args = parse_args(argv)
    from transformers import AutoTokenizer

    from scheduler.cpu_threads import configure_scheduler_threads

    load_before = round(os.getloadavg()[0], 2)
    threads = configure_scheduler_threads("cpu")
    if args.model_path is None:
        from model_executor.default_model import ensure_default_model

        args.model_path = str(ensure_default_model())
    tokenizer = AutoTokenizer.from_pretrained(args.model_path)
    texts = load_texts(tokenizer)
    prefill_ids = [t for text in texts for t in text["ids"]]
    while len(prefill_ids) < max(args.prefill_len, 16 * args.batch):
        prefill_ids += prefill_ids
    names = ["float32"] + [n for n in args.formats if n != "float32"]
    print(f"{len(texts)} texts, {sum(len(t['ids']) - 1 for t in texts)} scored positions; "
          f"{len(QUESTIONS)} questions; formats: {', '.join(names)}", flush=True)

    results, ref_logprobs = {}, []
    for name in names:
        fmt = FORMATS[name]
        t0 = time.perf_counter()
        runner = make_runner(args.model_path, fmt, max_running=max(len(QUESTIONS), args.batch))
        parts, by_kind = [], {}
        for i, text in enumerate(texts):
            lp = teacher_forced_logprobs(runner, text["ids"])
            if name == "float32":
                ref_logprobs.append(lp)
            part = compare_logprobs(ref_logprobs[i], lp, text["ids"][1:])
            parts.append(part)
            by_kind.setdefault(text["kind"], []).append(part)
        answers = answer_questions(runner, tokenizer)
        r = {"flags": fmt.flags, **summarize(parts),
             "by_kind": {k: round(summarize(v)["greedy_agreement"], 4) for k, v in by_kind.items()},
             "answers": answers, "correct": [is_correct(a, acc) for a, (_, acc) in zip(answers, QUESTIONS)]}
        ref = results.get("float32", r)
        r["factual_correct"] = sum(r["correct"])
        r["same_answer_as_float32"] = sum(a == b for a, b in zip(answers, ref["answers"]))
        readme_ok = r["correct"][0]
        r["gate"] = {"greedy_agreement": r["greedy_agreement"] >= GATE["min_greedy_agreement"],
                     "factual": r["factual_correct"] >= ref["factual_correct"] - GATE["max_factual_drop"],
                     "readme_answer": readme_ok}
        r["gate"]["pass"] = all(r["gate"].values())
        r["seconds"] = round(time.perf_counter() - t0, 1)
        results[name] = r
        print(f"  {name}: agreement {r['greedy_agreement']:.4f}, factual {r['factual_correct']}/{len(QUESTIONS)}, "
              f"README answer {answers[0]!r}, gate {'pass' if r['gate']['pass'] else 'FAIL'} "
              f"({r['seconds']} s)", flush=True)
        del runner
    ref_logprobs.clear()
    timed = [n for n, r in results.items() if r["gate"]["pass"] or args.speed_all]
    print(f"speed, {args.repeats} rounds: {', '.join(timed)}", flush=True)
    runners = {n: make_runner(args.model_path, FORMATS[n], max_running=args.batch) for n in timed}
    for name, speed in measure_speed(runners, args, prefill_ids).items():
        results[name]["speed"] = speed
    del runners

    chosen = choose_default(results)
    print_tables(results, args.batch, chosen)
    result = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": {"platform": platform.platform(), "processor": platform.processor(),
                    "cores_usable": len(os.sched_getaffinity(0)), "threads": threads, "torch": torch.__version__,
                    "cpu_capability": torch.backends.cpu.get_cpu_capability(),
                    "onednn_bfloat16": cpu_runs_bfloat16_fast(),
                    "onednn_max_cpu_isa": os.environ.get("ONEDNN_MAX_CPU_ISA")},
        "command": "python -m benchmarks.bench_cpu_quality " + " ".join(sys.argv[1:] if argv is None else argv),
        "model_path": args.model_path, "gate": GATE, "max_prefill_slowdown": MAX_PREFILL_SLOWDOWN,
        "texts": [{"kind": t["kind"], "source": t["source"], "tokens": len(t["ids"])} for t in texts],
        "questions": [{"question": q, "accepted": a} for q, a in QUESTIONS],
        "formats": results, "chosen_default": chosen,
        "load_average": {"before": load_before, "after": round(os.getloadavg()[0], 2)},
    }
    print(f"load average before {result['load_average']['before']}, after {result['load_average']['after']}")
    if args.json_out:
        Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_out).write_text(json.dumps(result, indent=2, ensure_ascii=False) + "\n")
        print("wrote", args.json_out)
    return 0


def print_tables(results: dict, batch: int, chosen: str) -> None:
    n_q = len(QUESTIONS)
    rows = [("format", "flags", "greedy agree", "|dlogp| mean", "|dlogp| max", "KL mean", "ppl", "factual",
             "= fp32 answer", "README answer", "gate")]
    for name, r in results.items():
        rows.append((name, r["flags"], f"{100 * r['greedy_agreement']:.2f}%", f"{r['logprob_err_mean']:.4f}",
                     f"{r['logprob_err_max']:.3f}", f"{r['kl_mean']:.5f}", f"{r['perplexity']:.3f}",
                     f"{r['factual_correct']}/{n_q}", f"{r['same_answer_as_float32']}/{n_q}",
                     r["answers"][0][:40], "pass" if r["gate"]["pass"] else "FAIL"))
    print_table(rows)
    rows = [("format", "gate", "decode bs=1 tok/s", f"decode bs={batch} tok/s", "prefill tok/s", "")]
    for name, r in results.items():
        if "speed" in r:
            s = r["speed"]
            rows.append((name, "pass" if r["gate"]["pass"] else "FAIL", f"{s['decode_bs1_tok_s']:.1f}",
                         f"{s[f'decode_bs{batch}_tok_s']:.1f}", f"{s['prefill_tok_s']:.0f}",
                         "<- default" if name == chosen else ""))
    print_table(rows)


def print_table(rows: list[tuple]) -> None:
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip())


if __name__ == "__main__":
    sys.exit(main())

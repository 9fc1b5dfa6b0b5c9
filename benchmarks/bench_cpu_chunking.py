"""bench_cpu_chunking: how long a short chat waits behind a long prompt on the CPU, per prefill chunk size.

    python -m benchmarks.bench_cpu_chunking [--chunks 128 256 512 1024 2048] [--json out.json]

A long prompt is prefilled in chunks of --chunked-prefill-size tokens; between two chunks the running requests
decode, and a prompt that arrives meanwhile joins the next chunk's batch. So a chunk's time is how long any
other request waits behind the long prompt at a time. Two parts, in one run:

* steps (in process, the default model in the server's default CPU format): one --long-len-token prompt
  prefilled alone, per chunk size; each chunk's time (the last ones attend to the most tokens), and the
  prompt's prefill tok/s (the throughput a smaller chunk costs);
* serve (end to end, `python -m server.launch_server` with no model flags, as the quick start, plus
  --server-args per configuration): the long prompt sent as a completion, then --delay seconds later a short
  chat ("What is the capital of France?", temperature 0, max_tokens 32, streamed): its time to first token
  and to its whole answer, and the long prompt's time to its first token; --repeats rounds, each with a new
  long prompt (nothing in the prefix cache), median.

Prints two tables and writes JSON. The machine may be shared: the load average is recorded.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

SHORT_QUESTION = "What is the capital of France?"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_cpu_chunking", description=__doc__.splitlines()[0])
    p.add_argument("--chunks", type=int, nargs="+", default=[128, 256, 512, 1024, 2048],
                   help="chunk sizes of the steps part")
    p.add_argument("--long-len", type=int, default=4000, help="tokens of the long prompt")
    p.add_argument("--delay", type=float, default=1.0, help="seconds between the long prompt and the short chat")
    p.add_argument("--serve", nargs="*", default=["--chunked-prefill-size 2048", ""],
                   help="server configurations of the serve part, each one shell-quoted string of launch_server "
                        "flags ('' is the default); none: skip the serve part")
    p.add_argument("--repeats", type=int, default=2, help="serve: rounds per configuration")
    p.add_argument("--skip-steps", action="store_true", help="only the serve part")
    p.add_argument("--startup-timeout", type=float, default=600.0)
    p.add_argument("--json", dest="json_out", help="write the results here")
    return p.parse_args(argv)


def long_prompt(tokenizer, n: int, round_: int) -> list[int]:
    """n tokens of real text (the quality benchmark's texts, repeated), starting at a different place each
    round so that no round finds the previous one's prompt in the prefix cache."""
    from benchmarks.bench_cpu_quality import load_texts

    ids = [t for text in load_texts(tokenizer) for t in text["ids"]]
    start = (997 * round_) % len(ids)
    ids = ids[start:] + ids[:start]
    while len(ids) < n:
        ids += ids
    return ids[:n]


# ---- steps: one long prompt's chunks, in process ------------------------------------------------


def measure_steps(args, model_path: str, tokenizer) -> list[dict]:
    from model_executor.default_model import default_dtype, default_quantization
    from model_executor.sampling_params import SamplingParams
    from runners.model_runner import ModelRunner, RunnerConfig
    from scheduler.scheduler import Scheduler, SchedulerConfig

    dtype, quantization = default_dtype("cpu"), default_quantization("cpu")
    runner = ModelRunner(RunnerConfig(model_path=model_path, device="cpu", dtype=dtype, quantization=quantization,
                                      max_running_requests=4, max_total_tokens=args.long_len + 64))
    rows = []
    for i, chunk in enumerate([args.chunks[0], *args.chunks]):  # the first is a warm-up
        sched = Scheduler(runner, SchedulerConfig(max_running_requests=4, chunked_prefill_size=chunk,
                                                  disable_radix_cache=True))
        sched.add_request("long", long_prompt(tokenizer, args.long_len, i), SamplingParams(max_new_tokens=1,
                                                                                           temperature=0.0))
        times = []
        while sched.has_work():
            t0 = time.perf_counter()
            sched.step()
            times.append(time.perf_counter() - t0)
        if i == 0:
            continue
        total = sum(times)
        rows.append({"chunk": chunk, "chunks": len(times), "max_chunk_s": round(max(times), 3),
                     "mean_chunk_s": round(total / len(times), 3), "prefill_s": round(total, 2),
                     "prefill_tok_s": round(args.long_len / total, 1), "chunk_s": [round(t, 3) for t in times]})
        print(f"  chunk {chunk}: {len(times)} chunks, max {max(times):.2f} s, prefill {total:.1f} s", flush=True)
    return rows


# ---- serve: a short chat behind a long prompt, end to end ---------------------------------------


def start_server(flags: str, port: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "server.launch_server", "--host", "127.0.0.1", "--port", str(port),
           "--device", "cpu", "--log-level", "warning", *shlex.split(flags)]
    print("starting:", " ".join(cmd), flush=True)
    return subprocess.Popen(cmd, env=dict(os.environ, TOKENIZERS_PARALLELISM="false"))


def short_chat(client, base: str) -> dict:
    """The README's question, streamed: seconds to the first content and to the end, and the answer."""
    t0 = time.perf_counter()
    first, text = None, []
    body = {"messages": [{"role": "user", "content": SHORT_QUESTION}], "temperature": 0,
            "max_tokens": 32, "stream": True}
    with client.stream("POST", base + "/v1/chat/completions", json=body) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            delta = json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
            if delta and first is None:
                first = time.perf_counter() - t0
            text.append(delta)
    return {"ttft_s": first, "total_s": time.perf_counter() - t0, "answer": "".join(text)}


def long_completion(client, base: str, prompt: list[int], out: dict) -> None:
    t0 = time.perf_counter()
    first = None
    body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
            "stream": True}
    with client.stream("POST", base + "/v1/completions", json=body) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]" and first is None:
                first = time.perf_counter() - t0
    out.update(ttft_s=first, total_s=time.perf_counter() - t0)


def measure_serve(args, flags: str, tokenizer, seed: int) -> dict:
    import httpx

    from benchmarks.bench_cpu import free_port, get_json, wait_healthy

    port = free_port()
    base = f"http://127.0.0.1:{port}"
    proc = start_server(flags, port)
    try:
        wait_healthy(proc, base, args.startup_timeout)
        info = get_json(base + "/server_info").get("scheduler_info", {})
        rounds = []
        with httpx.Client(timeout=600) as client:
            short_chat(client, base)  # warm-up (and the chat prompt is then in the prefix cache, as in use)
            for r in range(args.repeats):
                long_out: dict = {}
                prompt = long_prompt(tokenizer, args.long_len, 100 * seed + r + 1)
                t = threading.Thread(target=long_completion, args=(client, base, prompt, long_out))
                t.start()
                time.sleep(args.delay)
                short = short_chat(client, base)
                t.join()
                rounds.append({"short": short, "long": long_out})
                print(f"  round {r}: short chat first token {short['ttft_s']:.2f} s, answer {short['total_s']:.2f} s "
                      f"({short['answer'][:40]!r}); long prompt first token {long_out['ttft_s']:.2f} s", flush=True)
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()

    def med(path):
        return round(statistics.median(r[path[0]][path[1]] for r in rounds), 2)

    return {"flags": flags, "chunked_prefill_size": info.get("chunked_prefill_size"),
            "quantization": info.get("quantization"), "dtype": info.get("dtype"),
            "short_ttft_s": med(("short", "ttft_s")), "short_answer_s": med(("short", "total_s")),
            "long_ttft_s": med(("long", "ttft_s")), "rounds": rounds}


# ---- main ---------------------------------------------------------------------------------------


def print_table(rows: list[tuple]) -> None:
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip())


def main(argv=None) -> int:
    args = parse_args(argv)
    from transformers import AutoTokenizer

    from model_executor.default_model import ensure_default_model
    from scheduler.cpu_threads import configure_scheduler_threads

    load_before = round(os.getloadavg()[0], 2)
    threads = configure_scheduler_threads("cpu")
    model_path = str(ensure_default_model())
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    steps = []
    if not args.skip_steps:
        print(f"steps: a {args.long_len}-token prompt alone, chunks of {args.chunks}", flush=True)
        steps = measure_steps(args, model_path, tokenizer)
        print_table([("chunk", "chunks", "max chunk s", "mean chunk s", "prefill s", "prefill tok/s")]
                    + [(r["chunk"], r["chunks"], r["max_chunk_s"], r["mean_chunk_s"], r["prefill_s"],
                        r["prefill_tok_s"]) for r in steps])
    serve = []
    for i, flags in enumerate(args.serve):
        print(f"serve: {flags or '(defaults)'}", flush=True)
        serve.append(measure_serve(args, flags, tokenizer, i))
    if serve:
        print_table([("server flags", "short chat: first token s", "answer s", "long prompt: first token s")]
                    + [(r["flags"] or "(defaults)", r["short_ttft_s"], r["short_answer_s"], r["long_ttft_s"])
                       for r in serve])
    result = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": {"platform": platform.platform(), "processor": platform.processor(),
                    "cores_usable": len(os.sched_getaffinity(0)), "threads": threads, "torch": torch.__version__},
        "command": "python -m benchmarks.bench_cpu_chunking " + shlex.join(sys.argv[1:] if argv is None else argv),
        "long_len": args.long_len, "delay_s": args.delay, "short_question": SHORT_QUESTION,
        "steps": steps, "serve": serve,
        "load_average": {"before": load_before, "after": round(os.getloadavg()[0], 2)},
    }
    print(f"load average before {result['load_average']['before']}, after {result['load_average']['after']}")
    if args.json_out:
        Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_out).write_text(json.dumps(result, indent=2) + "\n")
        print("wrote", args.json_out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

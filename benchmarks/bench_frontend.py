"""The front end alone: the real HTTP and detokenizer processes, a stand-in scheduler, bench_serving as client.

    python -m benchmarks.bench_frontend --out out/frontend.json

No model runs. The stand-in scheduler (run_standin_scheduler below, started through launch_server's
scheduler entry point) admits every request at once, and every --step-ms it sends one new token to each
running request, at most --max-running at a time, with the messages the real scheduler sends (the first
output carries the prompt's last tokens as detokenizer context, the last one finish "length"). The client is
benchmarks/bench_serving.py (streaming /v1/completions, ignore_eos), run in this process.

It reports delivered output tokens/s, CPU seconds per 1,000 output tokens of each process (HTTP, detokenizer,
stand-in scheduler, client), each process's CPU use as a share of one core, and the text events per token
the client received (below 1 when tokens that queued in the HTTP process were sent as one event). With
--repeat N it runs N times (one server) and reports medians. --profile DIR runs the HTTP and detokenizer
processes and the client under py-spy and writes their collapsed stacks there.

The model folder defaults to make_dummy_model's tokenizer for --shape (what bench_overlap serves on the GPU).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PROCESSES = ("http", "detokenizer", "scheduler")
OPTIONAL_SPEEDUPS = ("uvloop", "httptools", "orjson")


# ---- the stand-in scheduler (runs in the scheduler process) -------------------------------------


def run_standin_scheduler(args, ipc, ready_conn) -> None:
    """launch_server's scheduler contract (see server/scheduler_entry.py) without a model."""
    import zmq

    from scheduler.io_struct import (
        DETOKENIZER_CONTEXT_TOKENS,
        AbortReq,
        BatchTokenOut,
        ControlReply,
        FinishReason,
        TokenizedGenerateReq,
    )
    from scheduler.ipc import bind_pull, connect_push

    config = json.loads((Path(args.model_path) / "config.json").read_text())
    vocab = int(config["vocab_size"])
    step_s = float(os.environ.get("DUET_STANDIN_STEP_MS", "1.65")) / 1e3
    max_running = args.max_running_requests or 64
    ctx = zmq.Context()
    pull = bind_pull(ctx, ipc.scheduler_input)
    to_detok = connect_push(ctx, ipc.detokenizer_input)
    to_http = connect_push(ctx, ipc.http_input)
    ready_conn.send({"ok": True, "info": {
        "model_path": args.model_path, "context_len": int(config.get("max_position_embeddings", 4096)),
        "num_kv_slots": 1 << 20, "max_running_requests": max_running, "device": "cpu", "dtype": "none",
        "attention_backend": "standin", "vocab_size": vocab, "eos_token_ids": [], "scheduler_pid": os.getpid()}})
    ready_conn.close()

    waiting: list = []
    running: dict[str, list] = {}  # rid -> [request, tokens sent]
    aborted: list[str] = []
    next_step = time.monotonic()
    while True:
        busy = bool(running or waiting or aborted)
        timeout = max(0.0, next_step - time.monotonic()) if busy else 0.05
        if pull.poll(int(timeout * 1000)):
            while True:
                try:
                    msg = pull.recv_pyobj(zmq.NOBLOCK)
                except zmq.Again:
                    break
                if isinstance(msg, TokenizedGenerateReq):
                    waiting.append(msg)
                elif isinstance(msg, AbortReq):
                    if running.pop(msg.rid, None) is not None:
                        aborted.append(msg.rid)
                    waiting = [r for r in waiting if r.rid != msg.rid]
                elif hasattr(msg, "rid"):  # flush / stats
                    to_http.send_pyobj(ControlReply(msg.rid, True, {"num_running": len(running)}))
            continue
        if not busy:
            next_step = time.monotonic()
            continue
        if time.monotonic() < next_step:
            continue
        next_step += step_s
        while waiting and len(running) < max_running:
            r = waiting.pop(0)
            running[r.rid] = [r, 0]
        out = BatchTokenOut(rids=[], new_token_ids=[], finished=[], prompt_tokens=[], completion_tokens=[],
                            cached_tokens=[], logprobs=[], context_ids=[])
        for rid in aborted:
            out.rids.append(rid)
            out.new_token_ids.append([])
            out.finished.append(FinishReason("abort", message="aborted"))
            out.prompt_tokens.append(0)
            out.completion_tokens.append(0)
            out.cached_tokens.append(0)
            out.logprobs.append(None)
            out.context_ids.append([])
        aborted.clear()
        for rid, entry in list(running.items()):
            r, n = entry
            # Ids spread over the vocabulary, as a random-weight model's are; never 0 (the dummy unk).
            token = 1 + (hash(rid) + 7919 * n) % (vocab - 1)
            entry[1] = n = n + 1
            done = n >= r.params.max_new_tokens
            out.rids.append(rid)
            out.new_token_ids.append([token])
            out.finished.append(FinishReason("length") if done else None)
            out.prompt_tokens.append(len(r.input_ids))
            out.completion_tokens.append(n)
            out.cached_tokens.append(0)
            out.logprobs.append(None)
            out.context_ids.append(list(r.input_ids[-DETOKENIZER_CONTEXT_TOKENS:]) if n == 1 else [])
            if done:
                del running[rid]
        if out.rids:
            to_detok.send_pyobj(out)


# ---- measurement --------------------------------------------------------------------------------


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process so far, from /proc (psutil is only a dev dependency)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _get_json(url: str) -> dict:
    import httpx

    return httpx.get(url, timeout=5).json()


def start_server(model: Path, port: int, max_running: int, step_ms: float, log: Path,
                 profile_dir: Path | None) -> subprocess.Popen:
    from benchmarks.serving_sweep import wait_healthy

    cmd = [sys.executable, "-m", "benchmarks.bench_frontend", "--serve", "--model-path", str(model),
           "--port", str(port), "--device", "cpu", "--load-format", "dummy", "--max-running-requests", str(max_running),
           "--log-level", "warning"]
    env = dict(os.environ, DUET_STANDIN_STEP_MS=str(step_ms), TOKENIZERS_PARALLELISM="false")
    if profile_dir is not None:
        env["DUET_FRONTEND_PROFILE_DIR"] = str(profile_dir)
    proc = subprocess.Popen(cmd, stdout=log.open("wb"), stderr=subprocess.STDOUT, env=env,
                            cwd=Path(__file__).resolve().parent.parent)
    return wait_healthy(proc, port, log, 180)


def one_run(port: int, pids: dict[str, int], vocab: int, args) -> dict:
    from benchmarks import bench_serving

    before = {name: _cpu_s(pid) for name, pid in pids.items()}
    cli = ["--base-url", f"http://127.0.0.1:{port}", "--tokenizer", "none", "--vocab-size", str(vocab),
           "--num-prompts", str(args.num_prompts), "--random-input-len", str(args.input_len),
           "--random-output-len", str(args.output_len), "--random-range-ratio", "0",
           "--max-concurrency", str(args.streams), "--seed", "0", "--disable-tqdm", "--num-warmups", "1"]
    if args.http_client:
        cli += ["--http-client", args.http_client]
    res = bench_serving.run_benchmark(bench_serving.build_parser().parse_args(cli))
    res = asyncio.run(res)
    cpu = {name: _cpu_s(pid) - before[name] for name, pid in pids.items()}
    cpu["client"] = res["client_cpu_s"]
    tokens = res["total_output_tokens"]
    events = sum(len(itl) + 1 for itl, n in zip(res["itls"], res["output_lens"]) if n)
    dur = res["duration"]
    return {"output_tok_s": res["output_throughput"], "duration_s": dur, "tokens": tokens,
            "failed": res["failed"], "median_tpot_ms": res["median_tpot_ms"], "median_itl_ms": res["median_itl_ms"],
            "events_per_token": events / max(1, tokens),
            "cpu_s_per_1k_tokens": {k: 1e3 * v / max(1, tokens) for k, v in cpu.items()},
            "cpu_us_per_event": {k: 1e6 * v / max(1, events) for k, v in cpu.items()},
            "cpu_util": {k: v / dur for k, v in cpu.items()}}


def _median_run(runs: list[dict]) -> dict:
    med = {k: statistics.median(r[k] for r in runs) for k in runs[0] if not isinstance(runs[0][k], dict)}
    for k in ("cpu_s_per_1k_tokens", "cpu_us_per_event", "cpu_util"):
        med[k] = {p: statistics.median(r[k][p] for r in runs) for p in runs[0][k]}
    return med


def format_table(med: dict) -> str:
    procs = list(med["cpu_s_per_1k_tokens"])
    head = (f"output tok/s {med['output_tok_s']:.0f}   events/token {med['events_per_token']:.3f}   "
            f"median TPOT {med['median_tpot_ms']:.2f} ms   failed {med['failed']:.0f}")
    lines = [head, f"{'process':<12} {'CPU s / 1k tok':>15} {'CPU us / event':>15} {'CPU util':>9}"]
    for p in procs:
        lines.append(f"{p:<12} {med['cpu_s_per_1k_tokens'][p]:>15.4f} {med['cpu_us_per_event'][p]:>15.1f} "
                     f"{med['cpu_util'][p]:>9.2f}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_frontend",
                                description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="llama-3.2-1b")
    p.add_argument("--model-path", type=Path, help="a servable folder (default: make_dummy_model --shape)")
    p.add_argument("--streams", type=int, default=64, help="requests in flight (client and stand-in)")
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--step-ms", type=float, default=1.65, help="the stand-in scheduler's step interval")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--http-client", choices=("raw", "httpx"), help="bench_serving's --http-client (default: its own)")
    p.add_argument("--port", type=int, default=30300)
    p.add_argument("--profile", type=Path, help="py-spy the HTTP, detokenizer and client processes into this folder")
    p.add_argument("--label", default=None)
    p.add_argument("--out", type=Path, help="write the JSON here")
    args = p.parse_args(argv)
    from benchmarks.make_dummy_model import make_dummy_model

    model = args.model_path or make_dummy_model(args.shape, Path(tempfile.mkdtemp()) / args.shape)
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    log = Path(tempfile.mkstemp(prefix="bench-frontend-", suffix=".log")[1])
    proc = start_server(model, args.port, args.streams, args.step_ms, log, None)
    spies = []
    try:
        info = _get_json(f"http://127.0.0.1:{args.port}/server_info")
        pids = {name: int(info[f"{name}_pid"]) for name in PROCESSES}
        if args.profile:
            args.profile.mkdir(parents=True, exist_ok=True)
            for name, pid in (("http", pids["http"]), ("detokenizer", pids["detokenizer"]),
                              ("client", os.getpid())):
                spies.append(subprocess.Popen(
                    ["py-spy", "record", "--pid", str(pid), "--rate", "200", "--format", "raw",
                     "-o", str(args.profile / f"{name}.txt")], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT))
            time.sleep(1.0)
        runs = []
        for i in range(args.repeat):
            r = one_run(args.port, pids, vocab, args)
            runs.append(r)
            print(f"run {i + 1}/{args.repeat}: {r['output_tok_s']:.0f} tok/s, events/token "
                  f"{r['events_per_token']:.3f}", file=sys.stderr)
    finally:
        for s in spies:
            s.send_signal(signal.SIGINT)
            s.wait(30)
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
    med = _median_run(runs)
    result = {"label": args.label, "http_client": args.http_client, "shape": args.shape, "streams": args.streams, "num_prompts": args.num_prompts,
              "input_len": args.input_len, "output_len": args.output_len, "step_ms": args.step_ms,
              "cpu_count": os.cpu_count(), "affinity": len(os.sched_getaffinity(0)),
              "optional_speedups": {m: importlib.util.find_spec(m) is not None for m in OPTIONAL_SPEEDUPS},
              "median": med, "runs": runs}
    print(format_table(med))
    print("optional speedups installed: " + ", ".join(f"{k}={v}" for k, v in result["optional_speedups"].items()))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2))
    return 0


def _serve(argv: list[str]) -> None:
    from server.launch_server import main as launch

    launch(argv, scheduler_entrypoint="benchmarks.bench_frontend:run_standin_scheduler")


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if sys.argv[1:2] == ["--serve"]:
        _serve(sys.argv[2:])
    else:
        sys.exit(main())

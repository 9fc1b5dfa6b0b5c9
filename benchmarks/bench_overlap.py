"""Overlap scheduling and mixed chunks through HTTP: one server per configuration, in one run.

    python -m benchmarks.bench_overlap --shape llama-3.2-1b --out out/overlap

For each configuration (overlap on = the default, --disable-overlap-schedule) it measures, with random
prompts of --input-len tokens and --output-len output tokens:
  - C=1: median TPOT of one stream at a time (--c1-prompts requests); compare it with bench_one_batch's
    bs=1 graph step, run by --one-batch first in the same run (its JSON is read back);
  - C=64: output tokens/s of --c64-prompts requests with 64 in flight.
Then, with --itl, for mixed chunks off and on (overlap on): 16 streams decode --itl-output-len tokens and
one --long-prompt-len-token prompt (max_tokens 1) arrives after --long-after seconds; the 16 streams'
inter-token latencies give median and p99 (all of them, and those inside the long prompt's prefill window).
Prints a table and writes one JSON with everything.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from benchmarks import bench_serving
from benchmarks.make_dummy_model import make_dummy_model
from benchmarks.serving_sweep import start_server
from model_executor.configs import SHAPES

CONFIGS = {"overlap": [], "no_overlap": ["--disable-overlap-schedule"]}
ITL_CONFIGS = {"alternate": [], "mixed_chunk": ["--enable-mixed-chunk"]}


def serving(port: int, vocab: int, prompts: int, concurrency: int, input_len: int, output_len: int,
            label: str, out: Path, extra: tuple[str, ...] = (), http_client: str = "raw") -> dict:
    args = [*extra, "--base-url", f"http://127.0.0.1:{port}", "--tokenizer", "none", "--vocab-size", str(vocab),
            "--num-prompts", str(prompts), "--random-input-len", str(input_len), "--random-output-len",
            str(output_len), "--random-range-ratio", "0", "--max-concurrency", str(concurrency), "--seed", "0",
            "--label", label, "--disable-tqdm", "--output-file", str(out), "--http-client", http_client]
    bench_serving.main(args)
    return json.loads(out.read_text())


async def _stream(client: httpx.AsyncClient, port: int, prompt: list[int], max_tokens: int) -> list[float]:
    """Arrival times of each streamed token."""
    model = (await client.get(f"http://127.0.0.1:{port}/v1/models")).json()["data"][0]["id"]
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True,
            "ignore_eos": True, "temperature": 0}
    times = []
    async with client.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=body) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"HTTP {resp.status_code}: {(await resp.aread())[:300]!r}")
        async for line in resp.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                times.append(time.perf_counter())
    return times


async def itl_run(port: int, vocab: int, streams: int, output_len: int, long_len: int, long_after: float) -> dict:
    import random

    rng = random.Random(0)
    async with httpx.AsyncClient(timeout=600) as client:
        tasks = [asyncio.create_task(_stream(client, port, [rng.randrange(10, vocab) for _ in range(64)],
                                             output_len)) for _ in range(streams)]
        await asyncio.sleep(long_after)
        t_long = time.perf_counter()
        await _stream(client, port, [rng.randrange(10, vocab) for _ in range(long_len)], 1)
        t_long_done = time.perf_counter()
        all_times = await asyncio.gather(*tasks)
    itls, inside = [], []
    for times in all_times:
        for a, b in itertools.pairwise(times):
            itls.append((b - a) * 1e3)
            if a < t_long_done and b > t_long:
                inside.append((b - a) * 1e3)
    if not inside:
        raise RuntimeError("the streams ended before the long prompt arrived: raise --itl-output-len")
    itls.sort()
    return {"median_itl_ms": round(statistics.median(itls), 3),
            "p99_itl_ms": round(itls[min(len(itls) - 1, int(0.99 * len(itls)))], 3),
            "max_itl_ms": round(itls[-1], 3),
            "median_itl_during_long_prefill_ms": round(statistics.median(inside), 3),
            "max_itl_during_long_prefill_ms": round(max(inside), 3),
            "long_prompt_ms": round((t_long_done - t_long) * 1e3, 1), "num_itls": len(itls)}


def median_run(runs: list[dict], key: str) -> dict:
    """The run whose `key` is the median of the runs' (the lower middle one of an even count)."""
    return sorted(runs, key=lambda r: r[key])[(len(runs) - 1) // 2]


def stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    proc.wait(60)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_overlap",
                                description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="llama-3.2-1b", choices=SHAPES)
    p.add_argument("--configs", nargs="*", default=list(CONFIGS), choices=list(CONFIGS))
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--c1-prompts", type=int, default=16)
    p.add_argument("--c64-prompts", type=int, default=256)
    p.add_argument("--c64-repeats", type=int, default=1,
                   help="C=64 runs per server (each json run too); the table reports the median run")
    p.add_argument("--one-batch", action="store_true", help="run bench_one_batch bs=1 first (the C=1 floor)")
    p.add_argument("--itl", action="store_true", help="also the mixed-chunk ITL experiment")
    p.add_argument("--itl-streams", type=int, default=16)
    p.add_argument("--itl-output-len", type=int, default=2048, help="long enough to outlast the long prompt")
    p.add_argument("--long-prompt-len", type=int, default=8192)
    p.add_argument("--long-after", type=float, default=0.5)
    p.add_argument("--baseline-dir", type=Path, help="also run C=1 / C=64 against a server started from this "
                   "checkout (e.g. the code before overlap scheduling), labelled 'baseline'")
    p.add_argument("--json-schema-ratio", type=float, default=0.0,
                   help="also run each config's C=1 and C=64 with this share of json_schema requests")
    p.add_argument("--http-client", choices=("raw", "httpx"), default="raw",
                   help="bench_serving's client (httpx: the client of the measurements before it had raw)")
    p.add_argument("--port", type=int, default=30200)
    p.add_argument("--server-args", nargs=argparse.REMAINDER, default=[], help="extra launch_server flags (last)")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    if args.c64_repeats < 1:
        p.error("--c64-repeats must be at least 1")
    args.out.mkdir(parents=True, exist_ok=True)
    folder = make_dummy_model(args.shape, Path(tempfile.mkdtemp()) / args.shape)
    vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
    result: dict = {"shape": args.shape, "input_len": args.input_len, "output_len": args.output_len,
                    "http_client": args.http_client}
    if args.one_batch:
        one = args.out / "one_batch.json"
        subprocess.run([sys.executable, "-m", "benchmarks.bench_one_batch", "--model", args.shape, "--batch-size",
                        "1", "--input-len", str(args.input_len), "--json", str(one)], check=True)
        result["one_batch"] = json.loads(one.read_text())
    configs = [(name, CONFIGS[name], None) for name in args.configs]
    if args.baseline_dir:
        configs.append(("baseline", [], args.baseline_dir.resolve()))
    for name, flags, cwd in configs:
        proc = start_server(folder, args.port, flags + args.server_args, args.out / f"server_{name}.log", cwd)
        try:
            c1 = serving(args.port, vocab, args.c1_prompts, 1, args.input_len, args.output_len, f"{name}_c1",
                         args.out / f"{name}_c1.json", http_client=args.http_client)
            c64s = [serving(args.port, vocab, args.c64_prompts, 64, args.input_len, args.output_len, f"{name}_c64",
                            args.out / f"{name}_c64_{i}.json", http_client=args.http_client)
                    for i in range(args.c64_repeats)]
            c64 = median_run(c64s, "output_throughput")
            if args.json_schema_ratio:
                schema = ("--json-schema-ratio", str(args.json_schema_ratio))
                c1j = serving(args.port, vocab, args.c1_prompts, 1, args.input_len, args.output_len,
                              f"{name}_c1_json", args.out / f"{name}_c1_json.json", schema, http_client=args.http_client)
                c64js = [serving(args.port, vocab, args.c64_prompts, 64, args.input_len, args.output_len,
                                 f"{name}_c64_json", args.out / f"{name}_c64_json_{i}.json", schema,
                                 http_client=args.http_client) for i in range(args.c64_repeats)]
                c64j = median_run(c64js, "median_tpot_ms")
        finally:
            stop(proc)
        result[name] = {"c1_median_tpot_ms": c1["median_tpot_ms"], "c64_output_tok_s": c64["output_throughput"],
                        "c64_runs_tok_s": [round(r["output_throughput"]) for r in c64s],
                        "c64_median_tpot_ms": c64["median_tpot_ms"],
                        "c64_chunks_per_token": c64.get("text_chunks_per_output_token"),
                        "c64_client_cpu_util": c64.get("client_cpu_util")}
        if args.json_schema_ratio:
            result[name].update({
                "json_schema_ratio": args.json_schema_ratio,
                "c1_json_median_tpot_ms": c1j["median_tpot_ms"], "c64_json_median_tpot_ms": c64j["median_tpot_ms"],
                "c64_json_output_tok_s": c64j["output_throughput"],
                "c64_json_runs_tpot_ms": [r["median_tpot_ms"] for r in c64js],
                "c1_json_tpot_ratio": round(c1j["median_tpot_ms"] / c1["median_tpot_ms"], 3),
                "c64_json_tpot_ratio": round(c64j["median_tpot_ms"] / c64["median_tpot_ms"], 3)})
    if args.itl:
        for name, flags in ITL_CONFIGS.items():
            proc = start_server(folder, args.port, flags + args.server_args, args.out / f"server_itl_{name}.log")
            try:
                asyncio.run(itl_run(args.port, vocab, args.itl_streams, 64, 16, 0.0))  # warm-up
                result[f"itl_{name}"] = asyncio.run(itl_run(args.port, vocab, args.itl_streams,
                                                            args.itl_output_len, args.long_prompt_len,
                                                            args.long_after))
            finally:
                stop(proc)
    print(json.dumps(result, indent=2))
    print(f"\n{'config':<12} {'C=1 TPOT ms':>12} {'C=64 tok/s':>11}")
    for name, _, _ in configs:
        r = result[name]
        print(f"{name:<12} {r['c1_median_tpot_ms']:>12.3f} {r['c64_output_tok_s']:>11.0f}")
    (args.out / "bench_overlap.json").write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())

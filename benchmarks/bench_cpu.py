"""CPU quick-start benchmark: HF transformers vs duet (through HTTP) on the default model, in one run.

    python -m benchmarks.bench_cpu [--json out.json] [--quantization int8] [--server-args="--enable-torch-compile"]

Same model folder (the converted default model), same greedy decoding, same token-id prompt. HF runs the
float32 weights; duet runs what its server runs by default (for the default model on a CPU: int4 weights,
`--quantization none` for float32; the start-up line and the JSON's server_info say which):

* single stream: HF `generate` tok/s vs one duet streaming completion (`ignore_eos`);
* 16 concurrent streams: duet's aggregate tok/s vs HF's single stream;
* a 4,096-token prompt with max_tokens 1: duet's request time vs HF's one forward of the prompt.

duet runs as `python -m server.launch_server` on a free port, started after the HF part so the two never
share the cores; start-up (conversion, compile) is not timed. Prints a table of ratios and writes JSON.
Each number is the best of --repeats runs (the machine may be shared; the best run is the least disturbed).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone

import torch

TARGETS = {"single_stream": 3.0, "streams_16": 10.0, "long_prompt": 1.5}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_cpu", description=__doc__.splitlines()[0])
    p.add_argument("--model-path", help="HF folder (default: the converted default model)")
    p.add_argument("--output-len", type=int, default=64, help="tokens generated per stream")
    p.add_argument("--prompt-len", type=int, default=32, help="prompt tokens of the decode runs")
    p.add_argument("--streams", type=int, default=16)
    p.add_argument("--long-prompt-len", type=int, default=4096)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--quantization", help="passed to the server as --quantization (none, int8, int4; default: "
                                           "the server's default)")
    p.add_argument("--server-args", default="", help="extra launch_server arguments, one shell-quoted string")
    p.add_argument("--startup-timeout", type=float, default=1800.0, help="seconds to wait for the server")
    p.add_argument("--json", dest="json_out", help="write the results here")
    return p.parse_args(argv)


def prompt_ids(n: int, vocab: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, vocab - 100, (n,), generator=g).tolist()


# ---- HF transformers ----------------------------------------------------------------------------


def bench_hf(args, model_path: str, vocab: int) -> dict:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    ids = torch.tensor([prompt_ids(args.prompt_len, vocab, seed=0)])
    long_ids = torch.tensor([prompt_ids(args.long_prompt_len, vocab, seed=1)])
    n = args.output_len
    gen_s, fwd_s = [], []
    with torch.inference_mode():
        model.generate(ids, max_new_tokens=4, min_new_tokens=4, do_sample=False)  # warm-up
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)
            gen_s.append(time.perf_counter() - t0)
            assert out.shape[1] == ids.shape[1] + n
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            model(long_ids, use_cache=False, logits_to_keep=1)
            fwd_s.append(time.perf_counter() - t0)
    del model
    return {"generate_s": min(gen_s), "tok_s": n / min(gen_s), "long_forward_s": min(fwd_s),
            "runs": {"generate_s": gen_s, "long_forward_s": fwd_s}}


# ---- duet over HTTP -----------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(url: str, body: dict, timeout: float = 600.0) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


def get_json(url: str, timeout: float = 5.0) -> dict:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return json.loads(resp.read() or b"{}")


def start_server(args, port: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "server.launch_server", "--host", "127.0.0.1", "--port", str(port),
           "--device", "cpu", "--log-level", "warning"]
    if args.model_path_given:  # else the server's default model, with its default quantization
        cmd += ["--model-path", args.model_path]
    if args.quantization:
        cmd += ["--quantization", args.quantization]
    cmd += shlex.split(args.server_args)
    print("starting:", " ".join(cmd), flush=True)
    return subprocess.Popen(cmd, env=dict(os.environ, TOKENIZERS_PARALLELISM="false"))


def wait_healthy(proc: subprocess.Popen, base: str, timeout: float) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if proc.poll() is not None:
            raise SystemExit(f"error: the server exited during start-up (code {proc.returncode})")
        try:
            with urllib.request.urlopen(base + "/health", timeout=2) as resp:
                if resp.status == 200:
                    return time.monotonic() - t0
        except OSError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"error: the server was not healthy after {timeout:.0f} s")


def complete(base: str, prompt: list[int], max_tokens: int) -> tuple[float, int]:
    t0 = time.perf_counter()
    out = post(base + "/v1/completions", {"prompt": prompt, "max_tokens": max_tokens,
                                          "temperature": 0.0, "ignore_eos": True})
    return time.perf_counter() - t0, out["usage"]["completion_tokens"]


def bench_duet(args, base: str, vocab: int) -> dict:
    n = args.output_len
    ids = prompt_ids(args.prompt_len, vocab, seed=0)
    complete(base, ids, 4)  # warm-up (and the prompt is cached from here on, as it is for HF's repeats)
    single = []
    for _ in range(args.repeats):
        s, got = complete(base, ids, n)
        assert got == n, f"asked {n} tokens, got {got}"
        single.append(s)
    multi = []
    for r in range(args.repeats):
        prompts = [prompt_ids(args.prompt_len, vocab, seed=100 * r + i) for i in range(args.streams)]
        barrier = threading.Barrier(args.streams)

        def one(p, barrier=barrier):
            barrier.wait()
            return complete(base, p, n)

        t0 = time.perf_counter()
        with ThreadPoolExecutor(args.streams) as pool:
            results = list(pool.map(one, prompts))
        wall = time.perf_counter() - t0
        multi.append({"wall_s": wall, "tokens": sum(t for _, t in results)})
    long_s = []
    for r in range(args.repeats):  # a new prompt each time: nothing of it in the prefix cache
        s, _ = complete(base, prompt_ids(args.long_prompt_len, vocab, seed=1000 + r), 1)
        long_s.append(s)
    best_multi = max(multi, key=lambda m: m["tokens"] / m["wall_s"])
    return {"single_s": min(single), "tok_s": n / min(single),
            "streams_tok_s": best_multi["tokens"] / best_multi["wall_s"], "long_prompt_s": min(long_s),
            "runs": {"single_s": single, "streams": multi, "long_prompt_s": long_s}}


# ---- main ---------------------------------------------------------------------------------------


def main(argv=None) -> int:
    args = parse_args(argv)
    args.model_path_given = args.model_path is not None
    load_before = os.getloadavg()[0]
    if args.model_path is None:
        from model_executor.default_model import ensure_default_model

        args.model_path = str(ensure_default_model())
    with open(os.path.join(args.model_path, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    print(f"HF transformers (float32, greedy, {torch.get_num_threads()} threads) ...", flush=True)
    hf = bench_hf(args, args.model_path, vocab)
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    proc = start_server(args, port)
    try:
        startup_s = wait_healthy(proc, base, args.startup_timeout)
        print(f"duet healthy after {startup_s:.1f} s; measuring ...", flush=True)
        info = get_json(base + "/server_info")
        duet = bench_duet(args, base, vocab)
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
    ratios = {"single_stream": duet["tok_s"] / hf["tok_s"], "streams_16": duet["streams_tok_s"] / hf["tok_s"],
              "long_prompt": duet["long_prompt_s"] / hf["long_forward_s"]}
    rows = [
        ("single stream tok/s", f"{hf['tok_s']:.1f}", f"{duet['tok_s']:.1f}",
         f"{ratios['single_stream']:.2f}x", ">= 3x"),
        (f"{args.streams} streams aggregate tok/s", f"{hf['tok_s']:.1f} (1 stream)",
         f"{duet['streams_tok_s']:.1f}", f"{ratios['streams_16']:.2f}x", ">= 10x"),
        (f"{args.long_prompt_len}-token prompt s", f"{hf['long_forward_s']:.2f} (forward)",
         f"{duet['long_prompt_s']:.2f} (max_tokens 1)", f"{ratios['long_prompt']:.2f}x", "<= 1.5x"),
    ]
    engine = info.get("scheduler_info", {})
    print(f"HF: float32; duet: quantization {engine.get('quantization') or 'none'}, dtype {engine.get('dtype')}")
    header = ("", "HF transformers", "duet", "duet / HF", "target")
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(5)]
    for r in [header, *rows]:
        print("  ".join(str(c).rjust(w) if i else str(c).ljust(w) for i, (c, w) in enumerate(zip(r, widths))))
    result = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": {"platform": platform.platform(), "processor": platform.processor(),
                    "cores_usable": len(os.sched_getaffinity(0)), "torch": torch.__version__},
        "args": vars(args), "server_startup_s": startup_s, "server_info": info, "hf": hf, "duet": duet,
        "ratios": ratios, "targets": TARGETS,
        "load_average": {"before": round(load_before, 2), "after": round(os.getloadavg()[0], 2)},
    }
    print(f"load average before {result['load_average']['before']}, after {result['load_average']['after']}")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(result, f, indent=2, default=str)
        print("wrote", args.json_out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

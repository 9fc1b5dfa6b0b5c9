"""Serving sweep: start our server per configuration (graphs on / off), run bench_serving at several request
rates against it, write one JSON per run and a chart.

    python -m benchmarks.serving_sweep --shape llama-3.2-1b --rates 8 32 inf --out out/serving
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from benchmarks import bench_serving
from benchmarks.make_dummy_model import make_dummy_model
from model_executor.configs import SHAPES

CONFIGS = {
    "graphs": [],
    "eager": ["--disable-cuda-graph", "--disable-piecewise-cuda-graph"],
}


def start_server(folder: Path, port: int, extra: list[str], log: Path, cwd: Path | None = None) -> subprocess.Popen:
    """A dummy-weight server from this checkout (or the one at `cwd`), once /health answers."""
    cmd = [sys.executable, "-m", "server.launch_server", "--model-path", str(folder), "--load-format", "dummy",
           "--port", str(port), *extra]
    proc = subprocess.Popen(cmd, stdout=log.open("wb"), stderr=subprocess.STDOUT, cwd=cwd)
    return wait_healthy(proc, port, log, 600)


def wait_healthy(proc: subprocess.Popen, port: int, log: Path, timeout_s: float) -> subprocess.Popen:
    """proc once its /health answers 200; an exit (with the log's tail) or the timeout raises."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited {proc.returncode}: {log.read_text()[-2000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError("server did not become healthy")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.serving_sweep",
                                description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="llama-3.2-1b", choices=SHAPES)
    p.add_argument("--rates", nargs="+", default=["8", "32", "inf"])
    p.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    p.add_argument("--num-prompts", type=int, default=128)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--port", type=int, default=30100)
    p.add_argument("--server-args", nargs=argparse.REMAINDER, default=[], help="extra launch_server flags (last)")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    folder = make_dummy_model(args.shape, Path(tempfile.mkdtemp()) / args.shape)
    vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
    files, labels = [], []
    for name in args.configs:
        log = args.out / f"server_{name}.log"
        proc = start_server(folder, args.port, CONFIGS[name] + args.server_args, log)
        try:
            for rate in args.rates:
                out = args.out / f"serving_{name}_rate{rate}.json"
                bench_args = ["--base-url", f"http://127.0.0.1:{args.port}", "--tokenizer", "none",
                              "--vocab-size", str(vocab), "--num-prompts", str(args.num_prompts),
                              "--random-input-len", str(args.input_len), "--random-output-len",
                              str(args.output_len), "--request-rate", rate, "--seed", "0", "--label", name,
                              "--disable-tqdm", "--output-file", str(out)]
                bench_serving.main(bench_args)
                files.append(str(out))
                labels.append(name)
            metrics = httpx.get(f"http://127.0.0.1:{args.port}/metrics", timeout=10).text
            (args.out / f"metrics_{name}.txt").write_text(metrics)
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)
    from benchmarks import plot

    plot.main(["serving", *files, "--labels", *labels, "--out", str(args.out / "serving.png")])
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())

"""bench_startup: the server's start-up, phase by phase, over several starts.

    python -m benchmarks.bench_startup [--runs 3] [--device cpu] [--model-path PATH] [--load-format dummy]
        [--server-args "..."] [--json out.json]

Starts `python -m server.launch_server` --runs times with the given flags (no --model-path: the default model,
as the quick start), each time until /health answers, reads the start-up timeline from /server_info's
`startup` (server/startup_timeline.py: each phase's seconds, measured where it runs, and the total) and stops
it. All runs share one fresh Triton and inductor cache folder (TRITON_CACHE_DIR, TORCHINDUCTOR_CACHE_DIR), so
the first run starts cold and the later ones warm. The table gives each phase's median over all runs, the
first (cold) run's and the median of the warm ones; `unaccounted` is the total less the phases (mostly the
HTTP process's tokenizer or the detokenizer, where they keep the launcher waiting), and `ready (client)` the
seconds from the launch command to the first healthy /health, as a user sees it (the interpreter's start and
the launcher's own imports included). Prints the table and writes JSON. The machine may be shared: the load
average is recorded.
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
import tempfile
import time
import urllib.request
from datetime import datetime, timezone
from pathlib import Path

READY = "ready (client)"
UNACCOUNTED = "unaccounted"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_startup", description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=3, help="starts of the server (the first one cold)")
    p.add_argument("--device", default="cpu", help="the server's --device")
    p.add_argument("--model-path", help="the server's --model-path (default: the default model)")
    p.add_argument("--load-format", help="the server's --load-format (dummy: random weights, no disk read)")
    p.add_argument("--server-args", default="", help="more launch_server flags, one shell-quoted string")
    p.add_argument("--startup-timeout", type=float, default=1800.0, help="seconds one start may take")
    p.add_argument("--json", dest="json_out", help="write the results here")
    args = p.parse_args(argv)
    if args.runs < 1:
        p.error(f"--runs must be at least 1, got {args.runs}")
    return args


def server_flags(args) -> list[str]:
    """The launch_server flags of every start (the port aside)."""
    flags = ["--device", args.device, "--log-level", "warning"]
    if args.model_path:
        flags += ["--model-path", args.model_path]
    if args.load_format:
        flags += ["--load-format", args.load_format]
    return flags + shlex.split(args.server_args)


def get_json(url: str, timeout: float = 5.0) -> dict:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return json.loads(resp.read())


def start_once(args, cache_dir: str) -> dict:
    """One start: {"startup": /server_info's timeline, READY: seconds until /health answered}."""
    from benchmarks.bench_cpu import free_port

    port = free_port()
    base = f"http://127.0.0.1:{port}"
    env = dict(os.environ, TRITON_CACHE_DIR=os.path.join(cache_dir, "triton"),
               TORCHINDUCTOR_CACHE_DIR=os.path.join(cache_dir, "inductor"), TOKENIZERS_PARALLELISM="false")
    t0 = time.perf_counter()
    cmd = [sys.executable, "-m", "server.launch_server", "--host", "127.0.0.1", "--port", str(port), *server_flags(args)]
    proc = subprocess.Popen(cmd, env=env)
    try:
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"error: the server exited during start-up (code {proc.returncode})")
            if time.perf_counter() - t0 > args.startup_timeout:
                raise SystemExit(f"error: the server was not healthy after {args.startup_timeout:.0f} s")
            try:
                with urllib.request.urlopen(base + "/health", timeout=2) as resp:
                    if resp.status == 200:
                        break
            except OSError:
                pass
            time.sleep(0.05)
        ready = time.perf_counter() - t0
        return {"startup": get_json(base + "/server_info")["startup"], READY: round(ready, 3)}
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def run_rows(run: dict) -> dict[str, float]:
    """One run's rows: its phases in order, then unaccounted, total and the client's ready."""
    startup = dict(run["startup"])
    total = startup.pop("total")
    return {**startup, UNACCOUNTED: total - sum(startup.values()), "total": total, READY: run[READY]}


def summarize(runs: list[dict]) -> list[dict]:
    """Per row (phases in the order they first appear): the median over all runs, the first run's (cold) and
    the median of the others (warm; None with one run). A phase missing from a run counts for none."""
    per_run = [run_rows(r) for r in runs]
    names = list(dict.fromkeys(name for rows in per_run for name in rows))
    # (the summary rows last, whatever order the runs' phases came in)
    names = [n for n in names if n not in (UNACCOUNTED, "total", READY)] + [UNACCOUNTED, "total", READY]
    out = []
    for name in names:
        values = [rows[name] for rows in per_run if name in rows]
        warm = [rows[name] for rows in per_run[1:] if name in rows]
        out.append({"phase": name, "median_s": round(statistics.median(values), 3),
                    "cold_s": round(per_run[0][name], 3) if name in per_run[0] else None,
                    "warm_s": round(statistics.median(warm), 3) if warm else None})
    return out


def format_table(rows: list[dict], runs: int) -> str:
    def cell(v):
        return "-" if v is None else f"{v:.2f}"

    header = ("phase", f"median of {runs} s", "cold (first) s", f"warm (median of {runs - 1}) s")
    lines = [header] + [(r["phase"], cell(r["median_s"]), cell(r["cold_s"]), cell(r["warm_s"])) for r in rows]
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(line, widths)))
                     for line in lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    load_before = round(os.getloadavg()[0], 2)
    runs = []
    with tempfile.TemporaryDirectory(prefix="duet-startup-cache-") as cache_dir:
        for i in range(args.runs):
            print(f"start {i + 1} of {args.runs} ({'cold' if i == 0 else 'warm'} caches)", flush=True)
            runs.append(start_once(args, cache_dir))
            print(f"  total {runs[-1]['startup']['total']:.2f} s, ready (client) {runs[-1][READY]:.2f} s", flush=True)
    rows = summarize(runs)
    print(format_table(rows, args.runs))
    import torch

    result = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": {"platform": platform.platform(), "processor": platform.processor(),
                    "cores_usable": len(os.sched_getaffinity(0)), "torch": torch.__version__,
                    "gpu": torch.cuda.get_device_name() if args.device.startswith("cuda") else None},
        "command": "python -m benchmarks.bench_startup " + shlex.join(sys.argv[1:] if argv is None else argv),
        "server_flags": shlex.join(server_flags(args)),
        "rows": rows, "runs": runs,
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

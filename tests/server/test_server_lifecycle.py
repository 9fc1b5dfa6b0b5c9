"""Process management: clean SIGTERM (drain, then stop), SIGTERM to the whole process group, a dead
scheduler, a dead launcher, start-up failures, and the scheduler entry point being a test-harness parameter."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from server import launch_server
from server.launch_server import DRAIN_S
from tests.fake_scheduler import REPO_ROOT, ServerProcess, child_pids, free_port, pid_alive, tiny_model_dir
from tests.reliability_utils import late_request, tree_sockets, wait_until


def ipc_folder(pid: int) -> Path:
    """This server's private socket folder (found from its sockets: other servers may run beside it)."""
    folders = {Path(p).parent for p in tree_sockets(pid)[2].values()}
    assert len(folders) == 1, folders
    return folders.pop()


class Stream(threading.Thread):
    """One streamed completion in a thread: how it ended (completed / error: message / cut off) and when."""

    def __init__(self, url: str, max_tokens: int, prompt: str = "hello"):
        super().__init__(daemon=True)
        self.url, self.body = url, {"prompt": prompt, "max_tokens": max_tokens, "stream": True, "ignore_eos": True}
        self.first_data = threading.Event()
        self.outcome = "not ended"
        self.ended_at: float | None = None

    def run(self) -> None:
        events = []
        try:
            with httpx.stream("POST", f"{self.url}/v1/completions", json=self.body, timeout=120) as resp:
                for line in resp.iter_lines():
                    if line.startswith("data: "):
                        events.append(line[6:])
                        self.first_data.set()
        except httpx.HTTPError as e:
            events.append(f"{type(e).__name__}: {e}")
        finally:
            self.ended_at = time.monotonic()
            self.first_data.set()
        errors = [json.loads(e)["error"]["message"] for e in events[:-1] if '"error"' in e]
        if events and events[-1] == "[DONE]":
            self.outcome = f"error: {errors[0]}" if errors else "completed"
        else:
            self.outcome = f"cut off after {len(events)} events: {events[-1:]}"


def test_sigterm_stops_everything():
    srv = ServerProcess().wait_healthy()
    info = httpx.get(f"{srv.url}/server_info", timeout=10).json()
    kids = child_pids(srv.proc.pid)
    assert {info["scheduler_pid"], info["detokenizer_pid"]} <= set(kids)
    folder = ipc_folder(srv.proc.pid)
    assert folder.name.startswith("duet-ipc-")
    srv.proc.send_signal(signal.SIGTERM)
    assert srv.proc.wait(20) == 0, srv.output()
    wait_until(lambda: not any(pid_alive(p) for p in kids), 5, f"children {kids} to exit")
    assert "duet ready:" in srv.output()
    assert not folder.exists(), "the private socket folder outlived the server"


def test_sigterm_drains_short_requests_and_fails_long_ones_after_the_window():
    """In-flight requests get DRAIN_S to finish: a short one completes; a long one gets the shutdown error,
    and not before the window has passed. (Fake scheduler at 50 ms a token: the short request needs about
    a second, the long one minutes.)"""
    srv = ServerProcess(env={"DUET_FAKE_STEP_S": "0.05"}).wait_healthy()
    try:
        short, long = Stream(srv.url, 20, "short"), Stream(srv.url, 5000, "long")
        for s in (short, long):
            s.start()
        for s in (short, long):
            assert s.first_data.wait(30), "no token arrived"
        assert short.ended_at is None, "the short request ended before the signal: the test proves nothing"
        sent_at = time.monotonic()
        srv.proc.send_signal(signal.SIGTERM)

        late = wait_until(lambda: late_request(srv.url), 10, "the server to stop accepting")
        assert srv.proc.wait(30) == 0, srv.output()
        for s in (short, long):
            s.join(10)
        assert short.outcome == "completed", short.outcome
        assert long.outcome == "error: the server is shutting down", long.outcome
        assert long.ended_at - sent_at >= DRAIN_S, "the long request was failed before the drain window ended"
        assert late != "gone" and late.status_code == 503, late
        assert "shutting down" in late.json()["error"]["message"], late.text
    finally:
        srv.stop()


def test_sigterm_to_the_process_group_is_a_clean_shutdown():
    """SIGTERM to the whole group (a terminal, a container runtime) during a stream: the children ignore it
    and the launcher drains and stops them; not a crash (no ERROR line, exit 0) and nothing leaked (tqdm's
    multiprocessing lock, created while the real scheduler loads weights, is a named semaphore)."""
    srv = ServerProcess("--log-level", "info", model_dir=tiny_model_dir(), fake=False, own_group=True)
    srv.wait_healthy(300)
    try:
        stream = Stream(srv.url, 900)
        stream.start()
        assert stream.first_data.wait(60), "no token arrived"
        os.killpg(srv.proc.pid, signal.SIGTERM)
        assert srv.proc.wait(30) == 0, srv.output()
        stream.join(10)
        assert stream.outcome in ("completed", "error: the server is shutting down"), stream.outcome
        out = srv.output()
        assert "duet ready:" in out and "shutting down" in out, out
        assert " ERROR " not in out and "died" not in out, out
        assert "leaked semaphore" not in out, out
    finally:
        srv.stop()


def test_the_product_does_not_read_the_scheduler_entrypoint_from_the_environment(monkeypatch):
    """The scheduler target is a parameter of launch_server.run (the test harness passes a fake one), never
    an environment variable: with one set, the real scheduler is still what gets started."""
    for folder in ("server", "scheduler", "runners", "model_executor"):
        for path in (REPO_ROOT / folder).rglob("*.py"):
            assert "DUET_SCHEDULER_ENTRYPOINT" not in path.read_text(), path
    monkeypatch.setenv("DUET_SCHEDULER_ENTRYPOINT", "tests.fake_scheduler:run_fake_scheduler_process")
    started = []

    def start_child(ctx, name, entrypoint, *args, **kwargs):
        started.append((name, entrypoint))
        raise launch_server.LaunchError("stop here")

    monkeypatch.setattr(launch_server, "_start_child", start_child)
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        code = launch_server.run(["--model-path", str(tiny_model_dir()), "--device", "cpu", "--port", str(free_port())])
        assert started == [("scheduler", launch_server.DEFAULT_SCHEDULER_ENTRYPOINT)] and code == 1
        code = launch_server.run(["--model-path", str(tiny_model_dir()), "--device", "cpu", "--port", str(free_port())],
                                 scheduler_entrypoint="tests.fake_scheduler:run_fake_scheduler_process")
        assert started[1] == ("scheduler", "tests.fake_scheduler:run_fake_scheduler_process") and code == 1
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)


def test_killed_scheduler_fails_requests_and_exits_nonzero():
    srv = ServerProcess().wait_healthy()
    try:
        info = httpx.get(f"{srv.url}/server_info", timeout=10).json()
        model = info["served_model_name"]
        long = min(5000, info["scheduler_info"]["context_len"] - 20)
        results = {"stream": []}
        streaming = threading.Event()  # the stream's first event arrived: its 200 and headers are sent

        def stream():
            body = {"model": model, "prompt": "long", "max_tokens": long, "stream": True, "ignore_eos": True}
            with httpx.stream("POST", f"{srv.url}/v1/completions", json=body, timeout=30) as resp:
                for line in resp.iter_lines():
                    if line:
                        results["stream"].append(line)
                        streaming.set()

        def blocking():
            body = {"model": model, "prompt": "long", "max_tokens": long, "ignore_eos": True}
            results["plain"] = httpx.post(f"{srv.url}/v1/completions", json=body, timeout=30)

        threads = [threading.Thread(target=stream), threading.Thread(target=blocking)]
        for t in threads:
            t.start()
        wait_until(lambda: httpx.get(f"{srv.url}/server_info", timeout=10).json()["num_inflight_requests"] == 2,
                   10, "both requests to run")
        # A stream killed before its first event gets a plain 503 instead (checked like the blocking request's
        # below); this test is about one that already streams.
        assert streaming.wait(20), "the stream never sent its first event"
        os.kill(info["scheduler_pid"], signal.SIGKILL)
        saw_503 = False
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and srv.proc.poll() is None:
            try:
                r = httpx.get(f"{srv.url}/health", timeout=1)
                if r.status_code == 503:
                    saw_503 = True
                    assert "scheduler" in r.json()["error"]["message"]
                    break
            except httpx.HTTPError:
                break
            time.sleep(0.05)
        assert saw_503, "/health never reported 503"
        for t in threads:
            t.join(20)
        plain = results["plain"]
        assert plain.status_code == 503 and "scheduler process died" in plain.json()["error"]["message"]
        lines = results["stream"]
        assert lines[-1] == "data: [DONE]" and '"error"' in lines[-2] and "scheduler" in lines[-2]
        assert srv.proc.wait(15) == 1
        wait_until(lambda: not pid_alive(info["detokenizer_pid"]), 5, "the detokenizer to exit")
    finally:
        srv.stop()


def test_children_exit_when_the_launcher_is_killed():
    srv = ServerProcess().wait_healthy()
    kids = child_pids(srv.proc.pid)
    assert len(kids) >= 2
    folder = ipc_folder(srv.proc.pid)
    srv.proc.kill()
    srv.proc.wait(5)
    wait_until(lambda: not any(pid_alive(p) for p in kids), 5, f"orphans {kids} to exit")
    # The detokenizer removed the socket folder the launcher could not.
    wait_until(lambda: not folder.exists(), 5, "the IPC folder to be removed")


def test_scheduler_start_up_failure_is_reported():
    srv = ServerProcess(env={"DUET_FAKE_FAIL_STARTUP": "1"}, fake=True)
    try:
        assert srv.proc.wait(60) == 1
    finally:
        srv.stop()
    out = srv.output()
    assert "error: the scheduler failed to start:" in out and "DUET_FAKE_FAIL_STARTUP" in out


@pytest.mark.parametrize("case", ["busy_port", "bad_model_path", "bad_flag"])
def test_launch_errors(case, tmp_path):
    port = free_port()
    args = ["--port", str(port), "--model-path", str(tiny_model_dir()), "--device", "cpu"]
    if case == "bad_model_path":
        args[3] = str(tmp_path / "missing")
    if case == "bad_flag":
        args += ["--max-running-requests", "0"]
    with socket.socket() as blocker:
        if case == "busy_port":
            blocker.bind(("127.0.0.1", port))
            blocker.listen()
        proc = subprocess.run([sys.executable, "-m", "server.launch_server", *args], cwd=REPO_ROOT,
                              capture_output=True, text=True, timeout=60, check=False)
    expected = {"busy_port": (1, "cannot listen on"), "bad_model_path": (1, "is not a folder"),
                "bad_flag": (2, "--max-running-requests must be a positive integer")}[case]
    assert proc.returncode == expected[0], proc.stderr
    assert expected[1] in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr  # one line, no traceback

"""Process management: clean SIGTERM, a dead scheduler, a dead launcher, start-up failures."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import threading
import time

import httpx
import pytest

from tests.fake_scheduler import REPO_ROOT, ServerProcess, child_pids, free_port, pid_alive


def wait_until(pred, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_sigterm_stops_everything():
    ipc_folders = {p for p in os.listdir(tempfile.gettempdir()) if p.startswith("duet-ipc-")}
    srv = ServerProcess().wait_healthy()
    info = httpx.get(f"{srv.url}/server_info", timeout=10).json()
    kids = child_pids(srv.proc.pid)
    assert {info["scheduler_pid"], info["detokenizer_pid"]} <= set(kids)
    assert len({p for p in os.listdir(tempfile.gettempdir()) if p.startswith("duet-ipc-")} - ipc_folders) == 1
    srv.proc.send_signal(signal.SIGTERM)
    assert srv.proc.wait(20) == 0, srv.output()
    wait_until(lambda: not any(pid_alive(p) for p in kids), 5, f"children {kids} to exit")
    assert "duet ready:" in srv.output()
    # The private socket folder is gone with the server.
    assert {p for p in os.listdir(tempfile.gettempdir()) if p.startswith("duet-ipc-")} <= ipc_folders


def test_killed_scheduler_fails_requests_and_exits_nonzero():
    srv = ServerProcess().wait_healthy()
    try:
        info = httpx.get(f"{srv.url}/server_info", timeout=10).json()
        model = info["served_model_name"]
        long = min(5000, info["scheduler_info"]["context_len"] - 20)
        results = {}

        def stream():
            body = {"model": model, "prompt": "long", "max_tokens": long, "stream": True, "ignore_eos": True}
            with httpx.stream("POST", f"{srv.url}/v1/completions", json=body, timeout=30) as resp:
                results["stream"] = [line for line in resp.iter_lines() if line]

        def blocking():
            body = {"model": model, "prompt": "long", "max_tokens": long, "ignore_eos": True}
            results["plain"] = httpx.post(f"{srv.url}/v1/completions", json=body, timeout=30)

        threads = [threading.Thread(target=stream), threading.Thread(target=blocking)]
        for t in threads:
            t.start()
        wait_until(lambda: httpx.get(f"{srv.url}/server_info", timeout=10).json()["num_inflight_requests"] == 2,
                   10, "both requests to run")
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
    ipc_folders = {p for p in os.listdir(tempfile.gettempdir()) if p.startswith("duet-ipc-")}
    srv = ServerProcess().wait_healthy()
    kids = child_pids(srv.proc.pid)
    assert len(kids) >= 2
    srv.proc.kill()
    srv.proc.wait(5)
    wait_until(lambda: not any(pid_alive(p) for p in kids), 5, f"orphans {kids} to exit")
    # The detokenizer removed the socket folder the launcher could not.
    wait_until(lambda: not {p for p in os.listdir(tempfile.gettempdir()) if p.startswith("duet-ipc-")} - ipc_folders,
               5, "the IPC folder to be removed")


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
    args = ["--port", str(port), "--model-path", str(REPO_ROOT), "--device", "cpu"]
    if case == "bad_model_path":
        args[3] = str(tmp_path / "missing")
    if case == "bad_flag":
        args += ["--max-running-requests", "0"]
    import socket

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

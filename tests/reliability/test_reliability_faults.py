"""Faults under load on the real engine (default model, CPU); extends tests/server/test_server_lifecycle.py, which
covers the same faults without load on the fake scheduler.

* the scheduler or the detokenizer killed with SIGKILL while clients stream and wait: every in-flight
  request gets an error (an SSE error event then [DONE], or a 503 with the OpenAI error body) within a few
  seconds, /health answers 503 until the server exits, the server exits 1, no process of its tree is left
  and the private socket folder is gone;
* SIGTERM under the same load: new requests get a 503; in-flight ones have DRAIN_S to finish (short streams
  complete) and only then get a 503 error (SSE error event for streams); the server exits 0 without an
  ERROR or a leaked-semaphore warning, no process is left, the socket folder is gone.

CI: 12 clients; DUET_LONG=1: 48.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest

from server.launch_server import DRAIN_S
from tests.fake_scheduler import ServerProcess, pid_alive
from tests.reliability_utils import late_request, process_tree, server_info, size, tree_sockets, wait_until

N_CLIENTS = size(12, 48)
MAX_TOKENS = 400  # long enough to still be running when the fault hits (~0.1 s per step at this batch)
ERROR_WITHIN_S = 10.0  # every in-flight client has its answer this long after the kill
EXIT_WITHIN_S = 15.0


class Client(threading.Thread):
    """One request in its own thread; records how it ended and when."""

    def __init__(self, url: str, i: int, max_tokens: int = MAX_TOKENS):
        super().__init__(daemon=True)
        self.url, self.i, self.max_tokens = url, i, max_tokens
        self.kind = ["cmpl_stream", "chat_stream", "cmpl", "generate_stream", "generate"][i % 5]
        self.outcome: str | None = None  # completed | error_event | error_status | cut_off
        self.detail = ""
        self.ended_at: float | None = None
        self.first_data = threading.Event()  # a stream received its first event

    def body(self) -> tuple[str, dict]:
        prompt = f"Client {self.i} writes a long story about the sea:"
        if self.kind.startswith("generate"):
            return "/generate", {"text": prompt, "stream": self.kind.endswith("stream"),
                                 "sampling_params": {"max_new_tokens": self.max_tokens, "ignore_eos": True}}
        common = {"max_tokens": self.max_tokens, "ignore_eos": True, "stream": self.kind.endswith("stream")}
        if self.kind.startswith("chat"):
            return "/v1/chat/completions", dict(common, messages=[{"role": "user", "content": prompt}])
        return "/v1/completions", dict(common, prompt=prompt)

    def run(self) -> None:
        path, body = self.body()
        try:
            with httpx.stream("POST", self.url + path, json=body, timeout=120) as resp:
                if resp.status_code != 200:
                    data = resp.read()
                    try:
                        err = json.loads(data)["error"]
                        ok = set(err) == {"message", "type", "param", "code"} and err["code"] == resp.status_code
                    except (ValueError, KeyError, TypeError):
                        err, ok = {"message": data[:100].decode(errors="replace")}, False
                    self.outcome = "error_status" if ok else "bad_status"
                    self.detail = f"{resp.status_code} {err.get('message')}"
                    return
                if not body["stream"]:
                    data = resp.read()
                    self.outcome, self.detail = "completed", data[:100].decode(errors="replace")
                    return
                events = []
                for line in resp.iter_lines():
                    if line.startswith("data: "):
                        events.append(line[6:])
                        self.first_data.set()
                        if line == "data: [DONE]":
                            break
                if events and events[-1] == "[DONE]" and len(events) >= 2 and "error" in json.loads(events[-2]):
                    self.outcome, self.detail = "error_event", json.loads(events[-2])["error"]["message"]
                elif events and events[-1] == "[DONE]":
                    self.outcome = "completed"
                else:
                    self.outcome, self.detail = "cut_off", f"{len(events)} events, no [DONE]"
        except httpx.HTTPError as e:  # the connection dropped (the server went away mid-answer)
            self.outcome, self.detail = "cut_off", f"{type(e).__name__}: {e}"
        finally:
            self.first_data.set()
            self.ended_at = time.monotonic()


def ipc_folder(pid: int) -> str:
    _, _, unix = tree_sockets(pid)
    folders = {str(Path(p).parent) for p in unix.values()}
    assert len(folders) == 1, unix
    return folders.pop()


def start_loaded_server(model_dir):
    srv = ServerProcess(model_dir=model_dir, fake=False).wait_healthy(300)
    try:
        info = server_info(srv.url)
        clients = [Client(srv.url, i) for i in range(N_CLIENTS)]
        for c in clients:
            c.start()
        wait_until(lambda: server_info(srv.url)["num_inflight_requests"] >= N_CLIENTS, 120,
                   "every client to be in flight")
        for c in clients:  # streams have sent data; the engine is busy decoding
            if c.kind.endswith("stream"):
                assert c.first_data.wait(120)
        # stats is null when the scheduler does not answer within /server_info's 3 s (a loaded machine): not yet
        wait_until(lambda: (server_info(srv.url)["stats"] or {}).get("num_running", 0) >= N_CLIENTS // 2, 60,
                   "decoding")
        tree = process_tree(srv.proc.pid)
        assert len(tree) >= 3, tree  # launcher, scheduler, detokenizer (and multiprocessing's resource tracker)
        return srv, info, clients, tree, ipc_folder(srv.proc.pid)
    except BaseException:
        srv.stop()
        raise


def watch_health(url: str, proc, seconds: float) -> list[int | str]:
    """Poll /health until the server is gone or `seconds` pass; the statuses seen, in order, deduplicated."""
    seen: list[int | str] = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            status: int | str = httpx.get(f"{url}/health", timeout=1).status_code
        except httpx.HTTPError:
            status = "refused"
        if not seen or seen[-1] != status:
            seen.append(status)
        if status == "refused":
            break
        time.sleep(0.05)
    return seen


@pytest.mark.parametrize("victim", ["scheduler", "detokenizer"])
def test_killed_child_under_load(model_dir, victim):
    srv, info, clients, tree, folder = start_loaded_server(model_dir)
    try:
        killed_at = time.monotonic()
        os.kill(info[f"{victim}_pid"], signal.SIGKILL)
        health = watch_health(srv.url, srv.proc, EXIT_WITHIN_S)
        for c in clients:
            c.join(ERROR_WITHIN_S + 5)
        code = srv.proc.wait(EXIT_WITHIN_S)
        exited_after = time.monotonic() - killed_at
        outcomes = {c.i: (c.kind, c.outcome, round(c.ended_at - killed_at, 2) if c.ended_at else None,
                          c.detail[:80]) for c in clients}
        print(f"\nRELIABILITY-FAULT kill {victim}: exit {code} after {exited_after:.1f} s, /health {health}, "
              f"clients {json.dumps(outcomes)}")
        assert code == 1, srv.output()[-3000:]
        assert 503 in health, health
        for c in clients:
            assert c.ended_at is not None and c.ended_at - killed_at < ERROR_WITHIN_S, outcomes[c.i]
            # The launcher gives clients a second to receive their errors before it exits.
            assert c.outcome in ("error_event", "error_status"), outcomes[c.i]
            assert victim in c.detail, outcomes[c.i]
        wait_until(lambda: not any(pid_alive(p) for p in tree), 10, f"the process tree {tree} to exit")
        assert not os.path.exists(folder), f"the socket folder {folder} was left behind"
    finally:
        srv.stop()


def test_sigterm_under_load(model_dir):
    srv, _, clients, tree, folder = start_loaded_server(model_dir)
    try:
        # Short streams that fit in the drain time: each has its first token before the signal and must
        # then complete normally. The long requests (MAX_TOKENS at ~0.1 s a step) cannot finish in DRAIN_S.
        short = [Client(srv.url, 100 + 5 * i, max_tokens=3) for i in range(3)]  # i % 5 == 0: completion streams
        for c in short:
            c.start()
        for c in short:
            assert c.first_data.wait(60), (c.outcome, c.detail)
        assert any(c.ended_at is None for c in short), "every short request ended before the signal"
        sent_at = time.monotonic()
        srv.proc.send_signal(signal.SIGTERM)

        late = wait_until(lambda: late_request(srv.url), 10, "the server to stop accepting")
        code = srv.proc.wait(EXIT_WITHIN_S + 10)
        exited_after = time.monotonic() - sent_at
        for c in clients + short:
            c.join(10)
        outcomes = {c.i: (c.kind, c.outcome, round(c.ended_at - sent_at, 2) if c.ended_at else None,
                          c.detail[:80]) for c in clients + short}
        print(f"\nRELIABILITY-FAULT SIGTERM: exit {code} after {exited_after:.1f} s, clients {json.dumps(outcomes)}")
        assert code == 0, srv.output()[-3000:]
        for c in short:
            assert c.outcome == "completed", outcomes[c.i]
        for c in clients:
            assert c.ended_at is not None, f"client {c.i} hangs: {outcomes[c.i]}"
            # Regression: uvicorn used to cut streams off and answer plain requests with a bare 500. The
            # clean shutdown error comes only once the drain window is over.
            assert c.outcome in ("error_event", "error_status") and "shutting down" in c.detail, outcomes[c.i]
            assert c.ended_at - sent_at >= DRAIN_S, outcomes[c.i]
        assert late != "gone" and late.status_code == 503, late
        assert "shutting down" in late.json()["error"]["message"], late.text
        wait_until(lambda: not any(pid_alive(p) for p in tree), 10, f"the process tree {tree} to exit")
        assert not os.path.exists(folder), f"the socket folder {folder} was left behind"
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"{srv.url}/health", timeout=2)
        assert "leaked semaphore" not in srv.output() and " ERROR " not in srv.output(), srv.output()[-3000:]
    finally:
        srv.stop()

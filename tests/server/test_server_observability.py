"""What an operator sees: --log-requests, the scheduler's periodic status line, /metrics versus /server_info,
and `--help`."""

from __future__ import annotations

import re
import threading
import time

import httpx

from server.args import build_parser
from tests.fake_scheduler import ServerProcess, tiny_model_dir


def wait_for_line(srv: ServerProcess, pattern: str, timeout: float = 60.0) -> str:
    """Poll the server's log for a line matching pattern; the line."""
    deadline = time.monotonic() + timeout
    while True:
        for line in srv.output().splitlines():
            if re.search(pattern, line):
                return line
        assert time.monotonic() < deadline and srv.proc.poll() is None, \
            f"no log line matches {pattern!r}:\n{srv.output()[-3000:]}"
        time.sleep(0.1)


def test_request_log_and_status_line():
    """The real scheduler on a tiny model: --log-requests logs the arrival (prompt length, parameters) and
    the end (finish reason, output length) of each request; the status line appears while one runs."""
    srv = ServerProcess("--log-level", "info", "--log-requests", "--status-interval", "0.2",
                        model_dir=tiny_model_dir(), fake=False).wait_healthy(300)
    try:
        done = httpx.post(f"{srv.url}/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 4,
                                                              "temperature": 0, "ignore_eos": True}, timeout=60)
        assert done.status_code == 200, done.text
        line = wait_for_line(srv, r"INFO duet.tokenizer_manager: request cmpl-\w+-0: prompt_tokens=3 ")
        assert "max_new_tokens=4" in line and "temperature=0.0" in line and "ignore_eos=True" in line, line
        rid = re.search(r"request (cmpl-\w+-0)", line).group(1)
        wait_for_line(srv, rf"finished {rid}: finish_reason=length prompt_tokens=3 completion_tokens=4 ")

        stop = threading.Event()

        def long_stream():  # runs until the status line was seen, then the client goes away (an abort)
            body = {"prompt": [5, 6, 7], "max_tokens": 900, "ignore_eos": True, "stream": True}
            with httpx.stream("POST", f"{srv.url}/v1/completions", json=body, timeout=120) as resp:
                for _ in resp.iter_lines():
                    if stop.is_set():
                        return

        t = threading.Thread(target=long_stream, daemon=True)
        t.start()
        status = wait_for_line(srv, r"INFO duet.scheduler: status: #running-req: 1, #queue-req: 0, KV usage: ")
        stop.set()
        t.join(60)
        assert re.search(r"gen throughput \(token/s\): \d+\.\d, graph hit rate: 0% \(0 of [1-9]\d* forward", status), \
            status  # CPU: no graphs, and some forward passes since the previous line
        wait_for_line(srv, r"finished cmpl-\w+-0: finish_reason=abort prompt_tokens=3 ")
    finally:
        assert srv.stop() == 0


def test_no_request_log_without_the_flag_and_metrics_agree_with_server_info():
    srv = ServerProcess("--log-level", "debug").wait_healthy()
    try:
        out = httpx.post(f"{srv.url}/v1/completions", json={"prompt": "hello", "max_tokens": 3}, timeout=30)
        assert out.status_code == 200, out.text
        info = httpx.get(f"{srv.url}/server_info", timeout=10).json()
        metrics = httpx.get(f"{srv.url}/metrics", timeout=10)
        # /metrics is always served, and /server_info says so.
        assert info["args"]["enable_metrics"] is True and info["args"]["log_requests"] is False
        assert metrics.status_code == 200 and 'duet_requests_total{finish_reason="length"} 1.0' in metrics.text
    finally:
        assert srv.stop() == 0
    log = srv.output()
    assert '"POST /v1/completions HTTP/1.1" 200' in log, log  # the log is on at its most verbose
    assert not re.search(r"(request|finished) cmpl-", log), log


def test_help_shows_each_default_once():
    for action in build_parser()._actions:
        text = action.help or ""
        assert text.count("default") <= 1, (action.option_strings, text)
    helps = {a.option_strings[0]: a.help for a in build_parser()._actions if a.option_strings}
    assert helps["--port"].endswith("(default: 30000)")
    assert helps["--max-total-tokens"].endswith("(default: from memory on GPU, 16384 on CPU)")
    assert helps["--status-interval"].endswith("(default: 5.0)")

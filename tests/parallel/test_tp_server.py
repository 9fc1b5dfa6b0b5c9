"""launch_server with --tp-size / --dp-size on CPU (gloo ranks), over HTTP, on a tiny random Llama with a
real tokenizer: the same greedy tokens as one scheduler, requests spread over replicas, and a dead rank
bringing the server down with an error that names it."""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import signal
import time

import httpx
import pytest

from tests.fake_scheduler import ServerProcess, build_tiny_model_folder

PROMPTS = [[5, 17, 42, 99, 123, 7, 250, 31, 64, 8], [200, 11, 3, 77, 150, 9], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return build_tiny_model_folder(tmp_path_factory.mktemp("tp-server") / "tiny", with_weights=True)


def generate(url: str, ids: list[int], max_new_tokens: int = 8) -> list[int]:
    r = httpx.post(f"{url}/generate", timeout=60, json={
        "input_ids": ids, "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0,
                                              "ignore_eos": True}})
    assert r.status_code == 200, r.text
    return r.json()["output_ids"]


def outputs(server: ServerProcess, concurrent: bool = False) -> list[list[int]]:
    if not concurrent:
        return [generate(server.url, p) for p in PROMPTS]
    with concurrent_pool() as pool:
        return list(pool.map(lambda p: generate(server.url, p), PROMPTS * 2))


def rank_pid(url: str, name: str = "scheduler (tp rank 1)") -> int:
    return httpx.get(f"{url}/server_info", timeout=10).json()["scheduler_info"]["scheduler_pids"][name]


def concurrent_pool():
    return concurrent.futures.ThreadPoolExecutor(max_workers=6)


@pytest.fixture(scope="module")
def tp1_outputs(model_path):
    srv = ServerProcess(model_dir=model_path, fake=False).wait_healthy()
    try:
        return outputs(srv)
    finally:
        assert srv.stop() == 0


def test_tp2_server_gives_the_tp1_greedy_tokens(model_path, tp1_outputs):
    srv = ServerProcess("--tp-size", "2", model_dir=model_path, fake=False).wait_healthy()
    try:
        assert outputs(srv) == tp1_outputs
        info = httpx.get(f"{srv.url}/server_info", timeout=10).json()
        pids = info["scheduler_info"]["scheduler_pids"]
        assert set(pids) == {"scheduler", "scheduler (tp rank 1)"}
        assert info["scheduler_info"]["tp_size"] == 2
    finally:
        assert srv.stop() == 0


def routed_counts(url: str) -> dict[str, float]:
    metrics = httpx.get(f"{url}/metrics", timeout=10).text
    return {line.split('"')[1]: float(line.split()[-1]) for line in metrics.splitlines()
            if line.startswith("duet_dp_routed_requests_total{")}


def test_dp2_spreads_requests_over_both_replicas_with_dp1_outputs(model_path, tp1_outputs):
    """Sequential requests alternate between the replicas (least load, ties round-robin): an exact 3 / 3
    split. Concurrent ones give the dp1 tokens too; their split depends on when each finishes (a request
    done before the next arrives frees its replica), so only their total is checked."""
    srv = ServerProcess("--dp-size", "2", model_dir=model_path, fake=False).wait_healthy()
    try:
        assert outputs(srv) + outputs(srv) == tp1_outputs * 2
        assert routed_counts(srv.url) == {"0": 3.0, "1": 3.0}
        stats = httpx.get(f"{srv.url}/server_info", timeout=10).json()["stats"]
        assert [r["routed"] for r in stats["replicas"]] == [3, 3]
        assert stats["num_finished"] == sum(r["num_finished"] for r in stats["replicas"]) == 6
        assert outputs(srv, concurrent=True) == tp1_outputs * 2
        assert sum(routed_counts(srv.url).values()) == 12
        stats = httpx.get(f"{srv.url}/server_info", timeout=10).json()["stats"]
        assert stats["num_finished"] == sum(r["num_finished"] for r in stats["replicas"]) == 12
    finally:
        assert srv.stop() == 0


def test_a_dead_tp_rank_stops_the_server_with_its_name(model_path):
    srv = ServerProcess("--tp-size", "2", model_dir=model_path, fake=False).wait_healthy()
    try:
        pid = rank_pid(srv.url)
        killed = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        saw_503 = False
        while srv.proc.poll() is None and time.monotonic() - killed < 15:
            try:
                saw_503 |= httpx.get(f"{srv.url}/health", timeout=1).status_code == 503
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        rc = srv.proc.wait(max(0.1, 15 - (time.monotonic() - killed)))
        elapsed = time.monotonic() - killed
        assert rc != 0
        assert elapsed < 10, f"the server took {elapsed:.1f} s to exit"
        assert saw_503
        assert "the scheduler (tp rank 1) process died" in srv.output()
    finally:
        srv.stop()


def test_a_hung_tp_rank_stops_the_server_with_its_name(model_path):
    """A rank that stops making progress (alive, stuck: SIGSTOP) is caught by the watchdog within its
    timeout, not by the collective timeout: the server exits non-zero naming the rank."""
    srv = ServerProcess("--tp-size", "2", "--watchdog-timeout", "3", model_dir=model_path, fake=False).wait_healthy()
    pid = None
    try:
        pid = rank_pid(srv.url)
        stopped = time.monotonic()
        os.kill(pid, signal.SIGSTOP)
        rc = srv.proc.wait(30)
        elapsed = time.monotonic() - stopped
        assert rc != 0
        assert elapsed < 3 + 10, f"the server took {elapsed:.1f} s to exit"
        log = srv.output()
        assert "tensor-parallel ranks stopped making progress" in log
        assert "the scheduler (tp rank 1) process (" in log
    finally:
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        srv.stop()

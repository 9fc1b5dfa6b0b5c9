"""launch_server --tp-size 2 on two GPUs (NCCL, the one-shot all-reduce, CUDA graphs) over HTTP, on a tiny
random Llama in float32: the greedy tokens of one GPU, and a rank killed while requests run (the other rank
then waits inside a sum for a peer that is gone) stops the server with an error that names it, within
seconds. tests/parallel/test_tp_server.py runs the same on CPU (gloo ranks).

Needs two GPUs: skipped (mark gpu) when fewer are visible.
Run: pytest -m gpu tests/parallel/test_tp_server_gpu.py -s
"""

from __future__ import annotations

import concurrent.futures
import os
import signal
import threading
import time

import httpx
import pytest
import torch

from tests.fake_scheduler import ServerProcess, build_tiny_model_folder
from tests.parallel.test_tp_server import outputs, rank_pid

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason=f"needs 2 GPUs, {torch.cuda.device_count()} visible"),
]

GPU_ARGS = ("--device", "cuda", "--dtype", "float32")


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return build_tiny_model_folder(tmp_path_factory.mktemp("tp-server-gpu") / "tiny", with_weights=True)


def test_tp2_server_on_gpus_gives_one_gpus_greedy_tokens(model_path):
    one = ServerProcess(*GPU_ARGS, model_dir=model_path, fake=False).wait_healthy(300)
    try:
        want = outputs(one)
    finally:
        assert one.stop() == 0
    srv = ServerProcess(*GPU_ARGS, "--tp-size", "2", model_dir=model_path, fake=False).wait_healthy(300)
    try:
        assert outputs(srv) == want
        assert outputs(srv, concurrent=True) == want * 2
    finally:
        assert srv.stop() == 0


def test_a_rank_killed_mid_generation_stops_the_server(model_path):
    srv = ServerProcess(*GPU_ARGS, "--tp-size", "2", model_dir=model_path, fake=False).wait_healthy(300)
    stop = threading.Event()

    def load():  # long generations back to back until the server goes
        while not stop.is_set():
            try:
                httpx.post(f"{srv.url}/generate", timeout=30, json={
                    "input_ids": [5, 17, 42], "sampling_params": {"max_new_tokens": 900, "ignore_eos": True}})
            except httpx.HTTPError:
                return

    try:
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            for _ in range(4):
                pool.submit(load)
            time.sleep(3)
            pid = rank_pid(srv.url)
            killed = time.monotonic()
            os.kill(pid, signal.SIGKILL)
            rc = srv.proc.wait(60)
            elapsed = time.monotonic() - killed
            stop.set()
        print(f"\nthe server exited {rc} {elapsed:.1f} s after rank 1 was killed")
        assert rc != 0
        assert elapsed < 20, f"the server took {elapsed:.1f} s to exit"
        assert "the scheduler (tp rank 1) process died" in srv.output()
    finally:
        stop.set()
        srv.stop()

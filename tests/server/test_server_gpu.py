"""A server on the GPU serves requests through both graph paths (the /metrics path counters grow)."""

from __future__ import annotations

import importlib.util
import re

import httpx
import pytest

from benchmarks.make_dummy_model import make_dummy_model
from tests.fake_scheduler import ServerProcess

pytestmark = pytest.mark.gpu

BACKENDS = ["triton"] + (["flashinfer"] if importlib.util.find_spec("flashinfer") else [])


def path_counts(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return {m[0]: float(m[1]) for m in re.findall(r'duet_forward_passes_total\{path="(\w+)"\} ([0-9.e+]+)', text)}


# An FP8 KV cache with flashinfer (its FA2 kernels over FP8 K/V) once, beside each backend's default pool.
CASES = [(b, "auto") for b in BACKENDS] + [("flashinfer", "fp8_e4m3")] * ("flashinfer" in BACKENDS)


@pytest.mark.parametrize("backend,kv_cache_dtype", CASES)
def test_server_uses_decode_and_extend_graphs(tmp_path, backend, kv_cache_dtype):
    folder = make_dummy_model("smollm2-135m", tmp_path / "m")
    server = ServerProcess("--device", "cuda", "--load-format", "dummy", "--attention-backend", backend,
                           "--kv-cache-dtype", kv_cache_dtype,
                           "--cuda-graph-max-bs", "16", "--piecewise-cuda-graph-max-tokens", "256",
                           "--log-level", "info", model_dir=folder, fake=False).wait_healthy(timeout=300)
    try:
        before = path_counts(server.url)
        body = {"model": str(folder), "prompt": [5, 6, 7, 8, 9, 10, 11], "max_tokens": 12, "temperature": 0,
                "ignore_eos": True}
        model = httpx.get(f"{server.url}/v1/models").json()["data"][0]["id"]
        outs = [httpx.post(f"{server.url}/v1/completions", json={**body, "model": model}, timeout=120).json()
                for _ in range(3)]
        assert all(o["usage"]["completion_tokens"] == 12 for o in outs), outs
        assert outs[0]["choices"][0]["text"] == outs[1]["choices"][0]["text"]  # greedy, graphs or not
        after = path_counts(server.url)
        assert after["decode_graph"] >= before.get("decode_graph", 0) + 11
        assert after["extend_graph"] >= before.get("extend_graph", 0) + 1
        info = httpx.get(f"{server.url}/server_info").json()["scheduler_info"]
        print(f"\n{backend}: paths {after}; ready line: "
              f"{[line for line in server.output().splitlines() if 'duet ready' in line]}")
        # What was captured is what the flags asked for, on the asked backend.
        assert info["device"].startswith("cuda") and backend in info["attention_backend"].lower(), info
        assert info["kv_cache_dtype"] == ("float8_e4m3fn" if kv_cache_dtype == "fp8_e4m3" else info["dtype"]), info
        assert max(info["cuda_graph_bs"]) == 16 and 1 in info["cuda_graph_bs"], info
        assert max(info["piecewise_cuda_graph_tokens"]) == 256, info
        assert info["capture_seconds"] > 0 and info["capture_gib"] >= 0, info
    finally:
        assert server.stop() == 0

"""Every main Triton kernel compiles for sm_90 (H100 / H200) on this CPU machine, and none computes in fp16
(a float32 multiply the compiler narrowed): tests/sm90_compile.py, run in a subprocess with Triton in compiled
mode (the interpreter, which the other CPU tests use, does not type-check or lower a kernel; a kernel that runs
there can still fail to compile on the GPU)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "sm90_compile.py"
ROOT = SCRIPT.parents[1]


def test_kernels_compile_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, str(SCRIPT)], env=env, capture_output=True, text=True, timeout=900,
                          check=False)
    out = proc.stdout + proc.stderr[-3000:]
    assert proc.returncode == 0, out
    ok = [line for line in proc.stdout.splitlines() if line.startswith("ok ")]
    assert len(ok) == 41 and "FAILED" not in proc.stdout, out


@pytest.mark.parametrize("gpu", ["NVIDIA_H200", "NVIDIA_H100_80GB_HBM3"])
def test_shipped_table_compiles_for_sm90_unserialized(gpu):
    """Each bf16 entry of a shipped small-M table (H200, H100) for the Llama shapes it was tuned on compiles for
    sm_90, plain and in its layer's fused form, and none has a wgmma chain ptxas serialized (a serialized chain
    makes the kernel far slower: docs/kernels.md)."""
    table = ROOT / f"model_executor/layers/triton_ops/configs/small_m_gemm_{gpu}.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, str(SCRIPT), "--table", str(table), "--model", "llama-3.1-8b",
                           "llama-3.2-1b"], env=env, capture_output=True, text=True, timeout=900, check=False)
    out = proc.stdout + proc.stderr[-3000:]
    assert proc.returncode == 0, out
    assert "SERIALIZED" not in proc.stdout and "FAILED" not in proc.stdout, out
    # Every Triton entry at the two models' shapes was compiled plain, and the fused forms too (a retune may
    # change how many fuse: 37 of the 45 when this was written).
    llama = {"6144,4096", "4096,4096", "28672,4096", "4096,14336", "128256,4096",
             "3072,2048", "2048,2048", "16384,2048", "2048,8192", "128256,2048"}
    entries = {f"{nk} m={m}" for nk, per_m in json.loads(table.read_text())["bf16"].items() if nk in llama
               for m, cfg in per_m.items() if cfg != "cublas"}
    plain = {line.split(" plain:")[0] for line in proc.stdout.splitlines() if " plain: " in line}
    assert plain == entries and len(entries) >= 40, out
    assert sum(" fused " in line for line in proc.stdout.splitlines()) >= 30, out

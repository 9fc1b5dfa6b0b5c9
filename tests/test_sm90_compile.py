"""Every main Triton kernel compiles for sm_90 (H100 / H200) on this CPU machine, and none computes in fp16
(a float32 multiply the compiler narrowed): tests/sm90_compile.py, run in a subprocess with Triton in compiled
mode (the interpreter, which the other CPU tests use, does not type-check or lower a kernel; a kernel that runs
there can still fail to compile on the GPU)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).with_name("sm90_compile.py")


def test_kernels_compile_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, str(SCRIPT)], env=env, capture_output=True, text=True, timeout=900,
                          check=False)
    out = proc.stdout + proc.stderr[-3000:]
    assert proc.returncode == 0, out
    ok = [line for line in proc.stdout.splitlines() if line.startswith("ok ")]
    assert len(ok) == 40 and "FAILED" not in proc.stdout, out

"""Triton kernels in tests: compiled on a CUDA device, in Triton's CPU interpreter otherwise.

The interpreter must be chosen (TRITON_INTERPRET=1) before triton is first imported: tests/conftest.py sets it
on a machine without CUDA, and pytest loads it before any test module (so before anything imports triton). If
triton was nevertheless imported in compiled mode first (TRITON_INTERPRET=0 given, or a test run outside this
conftest), the module's `in_process` tests skip and its `subprocess_test` re-runs them in a fresh interpreter
process; otherwise that test skips. Exactly one of the pair runs, so both carry the
`triton_mode` mark, which is on the CI skip allowlist (tests/conftest.py).
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # (the dev extra installs it; TRITON_INTERPRET must be set first)

DEVICE = "cuda" if HAS_CUDA else "cpu"


def interpreting() -> bool:
    return type(triton.language.cdiv).__name__ == "InterpretedFunction"


# CPU, but triton came up compiled before this module: run the kernel tests in a subprocess instead.
RERUN_IN_SUBPROCESS = not HAS_CUDA and not interpreting()


def in_process(fn):
    skip = pytest.mark.skipif(RERUN_IN_SUBPROCESS, reason="triton was imported before TRITON_INTERPRET=1 "
                                                          "could be set; the module re-runs in a subprocess")
    return pytest.mark.triton_mode(skip(fn))


def interpreter_only(fn):
    """An `in_process` test whose CPU tensors stand in for CUDA ones while the kernels run in the interpreter
    (a layer's or model's dispatch to them, a launcher's refusals). A CUDA host's compiled kernels refuse CPU
    tensors, so there it skips; the `_gpu` tests run the same kernels on the device."""
    skip = pytest.mark.skipif(HAS_CUDA, reason="CPU tensors stand in for CUDA ones: interpreter only "
                                               "(the _gpu tests run these kernels on the device)")
    return skip(in_process(fn))


def subprocess_test(module_file: str, *pytest_args: str):
    """A test that re-runs `module_file` (its `pytest_args` selection) with the interpreter on."""

    @pytest.mark.triton_mode
    @pytest.mark.skipif(not RERUN_IN_SUBPROCESS, reason="triton runs in the right mode in this process")
    def test_in_subprocess():
        env = dict(os.environ, TRITON_INTERPRET="1")
        root = pathlib.Path(__file__).resolve().parents[1]  # the repository
        proc = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *pytest_args,
             str(pathlib.Path(module_file).resolve())],
            cwd=root, env=env, capture_output=True, text=True, timeout=600, check=False,
        )
        assert proc.returncode == 0 and " passed" in proc.stdout, proc.stdout[-6000:] + proc.stderr[-3000:]

    return test_in_subprocess

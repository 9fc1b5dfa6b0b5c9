"""CPU threads: the scheduler's pool follows the affinity mask; the HTTP and detokenizer side never imports
torch (so it owns no thread pool competing with the scheduler's)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch

from scheduler import cpu_threads

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_scheduler_threads_follow_the_affinity_mask(monkeypatch):
    before = torch.get_num_threads()
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(cpu_threads.os, "sched_getaffinity", lambda pid: {3})
    try:
        torch.set_num_threads(4)
        assert cpu_threads.configure_scheduler_threads("cpu") == 1 and torch.get_num_threads() == 1
        monkeypatch.setenv("OMP_NUM_THREADS", "3")  # the user's explicit choice wins
        assert cpu_threads.configure_scheduler_threads("cpu") == 3 and torch.get_num_threads() == 3
        assert cpu_threads.configure_scheduler_threads("cuda") is None and torch.get_num_threads() == 3
    finally:
        torch.set_num_threads(before)


def test_http_and_detokenizer_side_does_not_import_torch(model_dir):
    code = ("import sys, server.launch_server, server.http_server, server.detokenizer\n"
            "from server.detokenizer import load_tokenizer\n"
            f"load_tokenizer({str(model_dir)!r}).encode('hello world')\n"
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], check=False, cwd=REPO_ROOT, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"

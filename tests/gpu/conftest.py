"""GPU tests share one process: each module's runners (weights and a KV cache sized from free memory) must be
gone before the next module sizes its own, or it reads the previous module's memory as in use."""

from __future__ import annotations

import gc

import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def _free_gpu_memory_after_module():
    yield  # set up first, so torn down after the module's own fixtures
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()

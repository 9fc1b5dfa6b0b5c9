"""benchmarks/probe_l2_prefetch.py's L2 prefetch kernel on the GPU: it runs over whole tensors and row prefixes
of odd sizes without a fault and changes no byte. Whether it pays is the probe's question, not a test's."""

from __future__ import annotations

import pytest
import torch

from benchmarks.probe_l2_prefetch import l2_prefetch

pytestmark = pytest.mark.gpu


def test_prefetch_changes_nothing():
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("cp.async.bulk.prefetch needs sm_90")
    t = torch.randn(1000, 4104, device="cuda").to(torch.bfloat16)  # rows of 8208 bytes
    before = t.clone()
    for row_bytes in (None, 16, 1000, 8208, 10**6):
        l2_prefetch(t, row_bytes)
    l2_prefetch(t[1:], 4096)  # a view from the second row
    l2_prefetch(torch.zeros(7, device="cuda"))  # 28 bytes: one 16-byte chunk
    torch.cuda.synchronize()
    assert torch.equal(t, before)

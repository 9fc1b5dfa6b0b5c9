"""The LoRA update's paths agree with a per-row reference: the torch paths (segments by adapter, and the
graph-safe dense one) and the Triton kernels (SGMV for eager extends, per row for decode, token blocks for extend
graphs) in the CPU interpreter, over a batch mixing adapters of different ranks (zero-padded to the pool's rank),
fused parts and rows without one."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from model_executor.lora.layer import LoraBatch, LoraLayer
from tests import triton_mode
from tests.triton_mode import DEVICE, in_process

test_in_subprocess = triton_mode.subprocess_test(__file__)

R, K = 8, 80
SLICES = [(0, 64), (64, 32), (96, 32)]  # a qkv-like layer: three parts
RANKS = {1: 8, 2: 4, 3: 2}  # slot -> the adapter's rank (the rest of R is zero)


def make_layer(backend: str, seed: int = 0) -> LoraLayer:
    g = torch.Generator().manual_seed(seed)
    slots, out = 4, sum(s for _, s in SLICES)
    a = torch.zeros(slots, len(SLICES) * R, K)
    b = torch.zeros(slots, out, R)
    for slot, r in RANKS.items():
        for p in range(len(SLICES)):
            a[slot, p * R:p * R + r] = torch.randn(r, K, generator=g)
        b[slot, :, :r] = torch.randn(out, r, generator=g)
    scaling = torch.tensor([0.0, 2.0, 0.5, 1.5])
    state = SimpleNamespace(batch=None, scaling=scaling.to(DEVICE), scaling_host=scaling.tolist(), backend=backend)
    return LoraLayer(state, a.to(DEVICE), b.to(DEVICE), SLICES, R)


def reference(layer: LoraLayer, x: torch.Tensor, token_slots: list[int]) -> torch.Tensor:
    y = torch.zeros(x.shape[0], layer.b.shape[1])
    for t, slot in enumerate(token_slots):
        for p, (off, size) in enumerate(SLICES):
            a = layer.a[slot, p * R:(p + 1) * R].cpu()
            b = layer.b[slot, off:off + size].cpu()
            y[t, off:off + size] = b @ (a @ x[t].cpu()) * layer.state.scaling_host[slot]
    return y


# (request slots, extend lens or None for decode)
CASES = {
    "extend_mixed": ([1, 0, 2, 3, 1], [5, 3, 17, 1, 20]),
    "extend_one_adapter": ([2], [33]),
    "decode_mixed": ([0, 3, 1, 1, 2, 0, 3], None),
}


def run(layer: LoraLayer, req_slots, lens, graph: bool = False):
    batch = LoraBatch.build(req_slots, lens, DEVICE)
    if graph:  # what a captured graph has: the slot ids only
        batch = LoraBatch.of_graph(batch.token_slots, decode=lens is None)
    n = batch.token_slots.shape[0]
    x = torch.randn(n, K, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    base = torch.randn(n, layer.b.shape[1], generator=torch.Generator().manual_seed(2)).to(DEVICE)
    layer.state.batch = batch
    y = layer.apply(x, base.clone())
    return (y - base).cpu(), reference(layer, x, batch.token_slots.tolist())


@pytest.mark.parametrize("case", list(CASES))
def test_torch_paths_match_reference(case):
    req_slots, lens = CASES[case]
    for graph in (False, True):
        delta, ref = run(make_layer("torch"), req_slots, lens, graph=graph)
        torch.testing.assert_close(delta, ref, rtol=1e-4, atol=1e-4)
        assert delta.abs().sum() > 0
        rows_without = [t for t, s in enumerate(LoraBatch.build(req_slots, lens, "cpu").token_slots.tolist())
                        if s == 0]
        assert delta[rows_without].abs().sum() == 0  # rows without an adapter are left as they are


@in_process
@pytest.mark.parametrize("case", list(CASES))
def test_triton_kernels_match_torch(case):
    req_slots, lens = CASES[case]
    delta, ref = run(make_layer("triton"), req_slots, lens)
    torch.testing.assert_close(delta, ref, rtol=1e-4, atol=1e-4)
    torched, _ = run(make_layer("torch"), req_slots, lens)
    torch.testing.assert_close(delta, torched, rtol=1e-4, atol=1e-4)


@in_process
def test_triton_decode_kernel_reads_only_the_slot_ids():
    """A decode graph's batch (token_slots alone) through the per-row kernels."""
    delta, ref = run(make_layer("triton"), [3, 0, 1, 2], None, graph=True)
    torch.testing.assert_close(delta, ref, rtol=1e-4, atol=1e-4)


@in_process
@pytest.mark.parametrize("case", ["extend_mixed", "extend_one_adapter"])
def test_triton_token_block_kernels_read_only_the_slot_ids(case):
    """An extend graph's batch (token_slots alone): blocks of 16 tokens that cross request boundaries, slot 0
    rows in the same block as adapters' rows."""
    req_slots, lens = CASES[case]
    delta, ref = run(make_layer("triton"), req_slots, lens, graph=True)
    torch.testing.assert_close(delta, ref, rtol=1e-4, atol=1e-4)
    rows_without = [t for t, s in enumerate(LoraBatch.build(req_slots, lens, "cpu").token_slots.tolist()) if s == 0]
    assert delta[rows_without].abs().sum() == 0

"""The LoRA update's paths agree with a per-row reference: the torch paths (segments by adapter, and the
graph-safe dense one) and the Triton kernels (SGMV for eager extends, split-K per row for decode, token blocks
for extend graphs) in the CPU interpreter (compiled on a CUDA host), over a batch mixing adapters of different
ranks (zero-padded to the pool's rank), fused parts of unequal sizes and rows without one. The layer shapes
cover K split into several chunks with a ragged last one, several blocks of s columns, and output blocks that
straddle part boundaries."""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch

from model_executor.lora import kernels
from model_executor.lora.layer import LoraBatch, LoraLayer
from tests import triton_mode
from tests.triton_mode import DEVICE, in_process

test_in_subprocess = triton_mode.subprocess_test(__file__)


@dataclass(frozen=True)
class Shape:
    rank: int  # R, the pool's rank
    k: int  # the layer's input size
    slices: tuple[tuple[int, int], ...]  # each part's (offset, size) in the output
    ranks: tuple[int, ...]  # slot 1, 2, 3 -> the adapter's rank (the rest of R is zero)


SHAPES = {
    "qkv": Shape(8, 80, ((0, 64), (64, 32), (96, 32)), (8, 4, 2)),  # one K chunk, parts inside an output block
    # K in several chunks, a ragged last one (decode 4 x 128 + 88, extend 256 + 256 + 88), 96 s columns (two
    # shrink blocks), parts of 100, 20 and 44 columns (output blocks straddle both boundaries), ranks below R
    "qkv_split_k": Shape(32, 600, ((0, 100), (100, 20), (120, 44)), (32, 5, 17)),
    "gate_up_split_k": Shape(16, 520, ((0, 72), (72, 200)), (3, 16, 9)),
    "down": Shape(16, 300, ((0, 136),), (16, 1, 8)),
}
SCALING = (0.0, 2.0, 0.5, 1.5)


def make_layer(backend: str, shape: Shape, seed: int = 0) -> LoraLayer:
    g = torch.Generator().manual_seed(seed)
    slots, out, r_max = 4, sum(s for _, s in shape.slices), shape.rank
    a = torch.zeros(slots, len(shape.slices) * r_max, shape.k)
    b = torch.zeros(slots, out, r_max)
    for slot, r in enumerate(shape.ranks, start=1):
        for p in range(len(shape.slices)):
            a[slot, p * r_max:p * r_max + r] = torch.randn(r, shape.k, generator=g)
        b[slot, :, :r] = torch.randn(out, r, generator=g)
    scaling = torch.tensor(SCALING)
    state = SimpleNamespace(batch=None, scaling=scaling.to(DEVICE), scaling_host=scaling.tolist(), backend=backend)
    return LoraLayer(state, a.to(DEVICE), b.to(DEVICE), list(shape.slices), r_max)


def reference(layer: LoraLayer, x: torch.Tensor, token_slots: list[int]) -> torch.Tensor:
    r_max = layer.rank
    y = torch.zeros(x.shape[0], layer.b.shape[1], dtype=torch.float64)
    for t, slot in enumerate(token_slots):
        for p, (off, size) in enumerate(layer.out_slices):
            a = layer.a[slot, p * r_max:(p + 1) * r_max].cpu().double()
            b = layer.b[slot, off:off + size].cpu().double()
            y[t, off:off + size] = b @ (a @ x[t].cpu().double()) * layer.state.scaling_host[slot]
    return y.float()


def assert_close(delta: torch.Tensor, ref: torch.Tensor) -> None:
    """Tight in float32 (the CPU interpreter); on CUDA tl.dot rounds float32 operands to TF32 (10-bit mantissa),
    so the tolerance is relative to the update's magnitude there."""
    if DEVICE == "cuda":
        tol = 1e-2 * ref.abs().max().item()
        torch.testing.assert_close(delta, ref, rtol=1e-2, atol=tol)
    else:
        torch.testing.assert_close(delta, ref, rtol=1e-4, atol=1e-4)


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
    n, k = batch.token_slots.shape[0], layer.a.shape[2]
    x = torch.randn(n, k, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    base = torch.randn(n, layer.b.shape[1], generator=torch.Generator().manual_seed(2)).to(DEVICE)
    layer.state.batch = batch
    y = layer.apply(x, base.clone())
    return (y - base).cpu(), reference(layer, x, batch.token_slots.tolist())


def rows_without_adapter(req_slots, lens) -> list[int]:
    return [t for t, s in enumerate(LoraBatch.build(req_slots, lens, "cpu").token_slots.tolist()) if s == 0]


@pytest.mark.parametrize("case", list(CASES))
def test_torch_paths_match_reference(case):
    req_slots, lens = CASES[case]
    for graph in (False, True):
        delta, ref = run(make_layer("torch", SHAPES["qkv"]), req_slots, lens, graph=graph)
        torch.testing.assert_close(delta, ref, rtol=1e-4, atol=1e-4)
        assert delta.abs().sum() > 0
        assert delta[rows_without_adapter(req_slots, lens)].abs().sum() == 0  # rows without an adapter unchanged


@in_process
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("case", list(CASES))
def test_triton_kernels_match_torch(case, shape):
    req_slots, lens = CASES[case]
    delta, ref = run(make_layer("triton", SHAPES[shape]), req_slots, lens)
    assert_close(delta, ref)
    assert delta[rows_without_adapter(req_slots, lens)].abs().sum() == 0
    if shape == "qkv":
        torched, _ = run(make_layer("torch", SHAPES[shape]), req_slots, lens)
        assert_close(delta, torched)


def test_split_k_shapes():
    """The chunks the split-K tests rely on: several K chunks, a ragged last one."""
    assert kernels.split_chunk(7, 600) == 128  # decode: 600 = 4 x 128 + 88
    assert kernels.extend_chunk(6, 600) == 256  # extend: 600 = 256 + 256 + 88, 4 loop steps each
    # A large decode batch takes longer chunks (fewer programs), a multiple of the loop step.
    chunk = kernels.split_chunk(256, 14336)
    assert chunk > 128 and chunk % kernels.ROW_BLOCK_K == 0 and 256 * -(-14336 // chunk) <= 1024
    # A long extend has programs enough without a split.
    assert kernels.extend_chunk(8192 // kernels.BLOCK_M, 4096) >= 4096


@in_process
def test_triton_decode_chunks_of_several_steps(monkeypatch):
    """Decode chunks of two loop steps (what a large batch gets): 600 = 256 + 256 + 88."""
    monkeypatch.setattr(kernels, "split_chunk", lambda rows, k: 2 * kernels.ROW_BLOCK_K)
    req_slots, lens = CASES["decode_mixed"]
    delta, ref = run(make_layer("triton", SHAPES["qkv_split_k"]), req_slots, lens)
    assert_close(delta, ref)


@in_process
@pytest.mark.parametrize("shape", ["qkv", "qkv_split_k"])
def test_triton_decode_kernel_reads_only_the_slot_ids(shape):
    """A decode graph's batch (token_slots alone) through the split-K per-row kernels."""
    delta, ref = run(make_layer("triton", SHAPES[shape]), [3, 0, 1, 2], None, graph=True)
    assert_close(delta, ref)
    assert delta[1].abs().sum() == 0


@in_process
@pytest.mark.parametrize("shape", ["qkv", "gate_up_split_k"])
@pytest.mark.parametrize("case", ["extend_mixed", "extend_one_adapter"])
def test_triton_token_block_kernels_read_only_the_slot_ids(case, shape):
    """An extend graph's batch (token_slots alone): blocks of 16 tokens that cross request boundaries, slot 0
    rows in the same block as adapters' rows."""
    req_slots, lens = CASES[case]
    delta, ref = run(make_layer("triton", SHAPES[shape]), req_slots, lens, graph=True)
    assert_close(delta, ref)
    assert delta[rows_without_adapter(req_slots, lens)].abs().sum() == 0


@in_process
@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
@pytest.mark.parametrize("case", list(CASES))
def test_triton_kernels_bf16(case, graph):
    """bfloat16 weights and activations, as served on a GPU: the extend kernels' dots take bf16 operands (s
    rounded to B's dtype for the expand), the decode kernels' products float32. Against the float64 reference
    of the same bf16 values; the outputs differ by the roundings of s and of y + update to bf16."""
    req_slots, lens = CASES[case]
    layer = make_layer("triton", SHAPES["qkv_split_k"])
    layer.a, layer.b = layer.a.bfloat16(), layer.b.bfloat16()
    batch = LoraBatch.build(req_slots, lens, DEVICE)
    if graph:
        batch = LoraBatch.of_graph(batch.token_slots, decode=lens is None)
    n = batch.token_slots.shape[0]
    x = torch.randn(n, layer.a.shape[2], generator=torch.Generator().manual_seed(1)).bfloat16().to(DEVICE)
    base = torch.randn(n, layer.b.shape[1], generator=torch.Generator().manual_seed(2)).bfloat16().to(DEVICE)
    layer.state.batch = batch
    delta = (layer.apply(x, base.clone()).float() - base.float()).cpu()
    ref = reference(layer, x.float(), batch.token_slots.tolist())
    torch.testing.assert_close(delta, ref, rtol=2e-2, atol=2e-2 * ref.abs().max().item())
    assert delta[rows_without_adapter(req_slots, lens)].abs().sum() == 0


def test_launcher_refuses_parts_it_cannot_run():
    with pytest.raises(ValueError, match="contiguous"):
        kernels._part_ends([(0, 64), (80, 32)])
    with pytest.raises(ValueError, match="1 to 3"):
        kernels._part_ends([(0, 8)] * 4)
    assert kernels._part_ends([(0, 64), (64, 32)]) == (0, 64, 96, 96)

"""The one-shot all-reduce on two GPUs: every sum, one-shot or NCCL, equals the sum of both ranks' inputs
bit for bit (two addends: one rounding, the same on either path), eagerly and replayed from a CUDA graph,
and each size takes the path `fits` names for it (views that start mid-vector and strided ones included),
and eager calls mixed with graph replays keep the ranks' slots in step.

Needs two GPUs: skipped (mark gpu) when fewer are visible.
Run: pytest -m gpu tests/parallel/test_custom_all_reduce_gpu.py -s
"""

from __future__ import annotations

import os
import tempfile

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2,
                       reason=f"needs 2 GPUs, {torch.cuda.device_count()} visible"),
]

# (name, shape, dtype, expected path)
CASES = [
    ("bf16 1 row", (1, 4096), torch.bfloat16, "one-shot"),
    ("bf16 7 rows", (7, 4096), torch.bfloat16, "one-shot"),
    ("bf16 256 rows", (256, 4096), torch.bfloat16, "one-shot"),
    ("fp32 3 rows", (3, 2048), torch.float32, "one-shot"),
    ("bf16 odd size", (1, 4099), torch.bfloat16, "one-shot"),
    ("fp16", (4, 4096), torch.float16, "one-shot"),
    ("bf16 above the buffer", (2048, 4096), torch.bfloat16, "nccl"),
    ("int32", (4, 64), torch.int32, "nccl"),
]


def _input(seed: int, shape, dtype, device) -> torch.Tensor:
    gen = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(shape, device=device, generator=gen)
    if dtype.is_floating_point:
        x.view(-1)[::97] = -0.0  # the kernel's "not arrived" mark, as data
    return (x * 100).to(dtype) if not dtype.is_floating_point else x.to(dtype)


def _expected(seed: int, shape, dtype, device) -> torch.Tensor:
    """Both ranks' inputs (rank r drew seed + r) added in float32 and rounded once."""
    return (_input(seed, shape, dtype, device).float() + _input(seed + 1, shape, dtype, device).float()).to(dtype)


def _rank_main(rank: int, init: str, out_dir: str) -> None:
    from model_executor.distributed import parallel_state as ps

    device = torch.device(f"cuda:{rank}")
    torch.cuda.set_device(device)
    ps.init_tensor_parallel(rank, 2, init, device)
    report = {"describe": ps.describe_all_reduce(), "cases": {}}
    for i, (name, shape, dtype, _) in enumerate(CASES):
        seed = 100 * i
        before = ps.one_shot_calls()
        got = ps.tensor_model_parallel_all_reduce(_input(seed + rank, shape, dtype, device))
        report["cases"][name] = {"path": "one-shot" if ps.one_shot_calls() > before else "nccl",
                                 "equal": bool(torch.equal(got, _expected(seed, shape, dtype, device))),
                                 "out": got.cpu()}
    # a view 6 bytes into its storage (the kernel needs 16-byte alignment) and a strided view
    flat = _input(7 + rank, (2 * 4096 + 3,), torch.bfloat16, device)
    wide = _input(9 + rank, (4, 8192), torch.bfloat16, device)
    views = {"offset view": (flat[3 : 3 + 4096].view(1, 4096),
                             (_input(7, flat.shape, flat.dtype, device).float()
                              + _input(8, flat.shape, flat.dtype, device).float()).bfloat16()[3 : 3 + 4096]),
             "strided view": (wide[:, :4096], _expected(9, wide.shape, wide.dtype, device)[:, :4096])}
    for name, (x, want) in views.items():
        before = ps.one_shot_calls()
        got = ps.tensor_model_parallel_all_reduce(x)
        report["cases"][name] = {"path": "one-shot" if ps.one_shot_calls() > before else "nccl",
                                 "equal": bool(torch.equal(got.view(want.shape), want)), "out": got.cpu()}
    # three dependent sums captured in one graph (one-shot, one-shot, NCCL), replayed on new inputs
    static = torch.zeros(8, 4096, dtype=torch.bfloat16, device=device)

    def chain(x):
        y = ps.tensor_model_parallel_all_reduce(x)
        z = ps.tensor_model_parallel_all_reduce(y * 0.5 + 1)
        return y, z, ps.tensor_model_parallel_all_reduce(torch.cat([z] * 300))  # 19 MiB: NCCL

    chain(static)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = chain(static)
    replays = []
    for seed in (11, 12, 13):
        static.copy_(_input(seed * 10 + rank, static.shape, static.dtype, device))
        graph.replay()
        eager = chain(static)
        replays.append(all(torch.equal(a, b) for a, b in zip(outs, eager))
                       and torch.equal(outs[0], _expected(seed * 10, static.shape, static.dtype, device)))
    report["graph_replays_equal_eager"] = replays
    torch.cuda.synchronize()
    torch.save(report, os.path.join(out_dir, f"rank{rank}.pt"))
    os._exit(0)  # NCCL teardown after graph-captured collectives can hang (pytorch/pytorch#115388)


def test_one_shot_sums_equal_the_exact_sum_on_both_ranks():
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as d:
        mp.spawn(_rank_main, args=(f"file://{d}/init", d), nprocs=2, join=True)
        ranks = [torch.load(os.path.join(d, f"rank{r}.pt")) for r in range(2)]
    print(f"\n{ranks[0]['describe']}")
    assert ranks[0]["describe"].startswith("one-shot")
    expected_paths = {name: path for name, _, _, path in CASES} | {"offset view": "one-shot",
                                                                   "strided view": "one-shot"}
    for name, path in expected_paths.items():
        a, b = ranks[0]["cases"][name], ranks[1]["cases"][name]
        print(f"{name}: {a['path']}, equal to the exact sum: {a['equal']} / {b['equal']}")
        assert a["path"] == b["path"] == path, name
        assert a["equal"] and b["equal"], name
        assert torch.equal(a["out"], b["out"]), name  # both ranks hold the same bits
    assert ranks[0]["graph_replays_equal_eager"] == ranks[1]["graph_replays_equal_eager"] == [True] * 3

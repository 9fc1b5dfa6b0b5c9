"""bench_all_reduce: the tensor-parallel sum, NCCL against the one-shot kernels over peer memory, per size.

    python -m benchmarks.kernels.bench_all_reduce --json out.json                 # 2 GPUs, [rows, 4096] bf16
    python -m benchmarks.kernels.bench_all_reduce --rows 1 32 256 --hidden 2048 --dtype float32

Spawns one rank per GPU (NCCL). For each size, the paths as the model calls them
(`parallel_state._all_reduce_impl`): NCCL is a copy and an in-place `all_reduce`; one-shot is
`custom_all_reduce.OneShotAllReduce` (ours: stores into the peers' buffers, no barrier), built here with
buffers as large as the largest size so every size can be timed (the server's are MAX_BYTES); and, for
reference, torch symmetric memory's own `one_shot_all_reduce_copy_out` (loads from the peers' buffers
between two barriers). Each path: --calls sums captured in one CUDA graph
(as in the decode graphs, no launch overhead), the median over --replays replays of the time per sum;
before each replay the ranks meet on a small NCCL sum so neither waits on the other's start. Every
one-shot result is checked against NCCL's, bit for bit. Rank 0 prints the table and writes the JSON;
MAX_BYTES in custom_all_reduce.py is the crossover this measures.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from datetime import datetime, timezone

import torch

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
ROWS = [1, 8, 32, 64, 128, 256, 512, 1024, 2048]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.kernels.bench_all_reduce",
                                description=__doc__.splitlines()[0])
    p.add_argument("--world-size", type=int, default=2, help="ranks, one GPU each")
    p.add_argument("--rows", type=int, nargs="+", default=ROWS, help="sizes: [rows, hidden] tensors")
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--dtype", default="bfloat16", choices=DTYPES)
    p.add_argument("--calls", type=int, default=64, help="sums in one graph (a decode step of 32 layers: 64)")
    p.add_argument("--replays", type=int, default=20)
    p.add_argument("--tiles", nargs="+", default=[], metavar="BLOCKxWARPS",
                   help="also time the one-shot kernel at these (elements a program, warps), e.g. 512x4")
    p.add_argument("--json", dest="json_out")
    args = p.parse_args(argv)
    if args.world_size < 2:
        p.error(f"--world-size must be at least 2, got {args.world_size}")
    if min(args.rows) < 1 or args.hidden < 1 or args.calls < 1 or args.replays < 1:
        p.error("--rows, --hidden, --calls and --replays must be positive")
    try:
        args.tiles = [tuple(int(v) for v in t.split("x")) for t in args.tiles]
    except ValueError:
        p.error(f"--tiles: BLOCKxWARPS pairs, e.g. 512x4; got {args.tiles}")
    if any(len(t) != 2 or t[0] < 16 or t[0] & (t[0] - 1) or t[1] not in (1, 2, 4, 8, 16) for t in args.tiles):
        p.error(f"--tiles: BLOCK a power of two >= 16, WARPS 1-16 (a power of two); got {args.tiles}")
    return args


def _time_graph(call, calls: int, replays: int, align) -> float:
    """Median microseconds per call: `calls` calls captured in one graph, replayed `replays` times."""
    call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            call()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        align()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    del graph
    return statistics.median(times)


def _rank_main(rank: int, args: argparse.Namespace, init_method: str) -> None:
    import torch.distributed as dist
    import torch.distributed._symmetric_memory as symm_mem

    from model_executor.distributed.custom_all_reduce import OneShotAllReduce, one_shot_sum

    device = torch.device(f"cuda:{rank}")
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", init_method=init_method, world_size=args.world_size, rank=rank,
                            device_id=device)
    group = dist.group.WORLD
    dtype = DTYPES[args.dtype]
    sizes = [r * args.hidden * dtype.itemsize for r in args.rows]
    one_shot = OneShotAllReduce(group, device, max_bytes=max(sizes))
    torch_buf = symm_mem.empty(max(sizes) // dtype.itemsize, dtype=dtype, device=device)
    symm_mem.rendezvous(torch_buf, group.group_name)
    tick = torch.ones(1, device=device)

    def torch_one_shot(x):
        out = torch.empty_like(x)
        buf = torch_buf[: x.numel()].view(x.shape)
        return torch.ops.symm_mem.one_shot_all_reduce_copy_out(buf, x, "sum", group.group_name, out)

    def align():
        dist.all_reduce(tick)

    def nccl(x):
        y = x.clone()
        dist.all_reduce(y)
        return y

    rows = []
    for n_rows, nbytes in zip(args.rows, sizes):
        gen = torch.Generator(device=device).manual_seed(1000 * n_rows + rank)
        x = torch.randn(n_rows, args.hidden, device=device, generator=gen).to(dtype)
        row = {"rows": n_rows, "bytes": nbytes, "nccl_us": round(_time_graph(lambda x=x: nccl(x), args.calls,
                                                                            args.replays, align), 2)}
        if one_shot.fits(x):
            row["equal"] = bool(torch.equal(one_shot(x), nccl(x)))
            row["one_shot_us"] = round(_time_graph(lambda x=x: one_shot(x), args.calls, args.replays, align), 2)
            row["nccl_over_one_shot"] = round(row["nccl_us"] / row["one_shot_us"], 2)
            for block, warps in args.tiles:
                lane = one_shot.lanes[x.dtype]
                row[f"one_shot_{block}x{warps}_us"] = round(_time_graph(
                    lambda x=x, b=block, w=warps, lane=lane: one_shot_sum(x, lane, rank, args.world_size, b, w),
                    args.calls, args.replays, align), 2)
            row["torch_one_shot_us"] = round(_time_graph(lambda x=x: torch_one_shot(x), args.calls, args.replays,
                                                         align), 2)
        rows.append(row)
    torch.cuda.synchronize()
    if rank == 0:
        _report(args, rows)
    sys.stdout.flush()
    os._exit(0)  # leave NCCL to the exit: destroying a group whose sums were captured hangs (parallel_state)


def _report(args: argparse.Namespace, rows: list[dict]) -> None:
    print(f"all-reduce of [rows, {args.hidden}] {args.dtype} over {args.world_size} x "
          f"{torch.cuda.get_device_name(0)}: us per sum, {args.calls} sums in one CUDA graph, median of "
          f"{args.replays} replays")
    print(f"{'rows':>6} {'KiB':>8} {'nccl us':>9} {'one-shot us':>12} {'nccl/one-shot':>14} {'equal':>6} "
          f"{'torch one-shot us':>18}")
    for r in rows:
        print(f"{r['rows']:>6} {r['bytes'] / 1024:>8.0f} {r['nccl_us']:>9.2f} {r.get('one_shot_us', '-'):>12} "
              f"{r.get('nccl_over_one_shot', '-'):>14} {r.get('equal', '-')!s:>6} "
              f"{r.get('torch_one_shot_us', '-'):>18}"
              + "".join(f"  {b}x{w}: {r.get(f'one_shot_{b}x{w}_us', '-')}" for b, w in args.tiles))
    if args.json_out:
        report = {"benchmark": "bench_all_reduce", "world_size": args.world_size, "hidden": args.hidden,
                  "dtype": args.dtype, "calls": args.calls, "replays": args.replays,
                  "gpu": torch.cuda.get_device_name(0), "torch": torch.__version__,
                  "nccl": ".".join(map(str, torch.cuda.nccl.version())),
                  "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "results": rows}
        with open(args.json_out, "w") as f:
            json.dump(report, f, indent=1)


def main(argv=None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available() or torch.cuda.device_count() < args.world_size:
        print(f"bench_all_reduce: needs {args.world_size} CUDA devices, {torch.cuda.device_count()} visible",
              file=sys.stderr)
        return 2
    import torch.multiprocessing as mp

    from server.parallel import free_port

    mp.spawn(_rank_main, args=(args, f"tcp://127.0.0.1:{free_port()}"), nprocs=args.world_size, join=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

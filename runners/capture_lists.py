"""Which sizes get a graph: decode batch sizes (SGLang's schedule) and extend token-count levels."""

from __future__ import annotations

import bisect

GiB = 1024**3
DEFAULT_MAX_EXTEND_TOKENS = 2048
# Whole-backbone extend graphs (runners/full_extend_graph_runner.py) up to this many tokens: below it a
# piecewise replay waits on the host's attention launches (docs/benchmarks.md).
DEFAULT_FULL_EXTEND_MAX_TOKENS = 512


def default_cuda_graph_max_bs(gpu_memory_bytes: int) -> int:
    """SGLang's default from device memory: more memory, larger decode graphs."""
    gib = gpu_memory_bytes / GiB
    if gib < 20:
        return 8
    if gib < 35:
        return 24
    if gib < 60:
        return 32
    if gib < 160:
        return 256
    return 512


# An explicit list is captured exactly as given. A batch padded up to a captured size runs each GEMM at the
# padded row count, whose kernel config may differ from the one its own row count takes eagerly, so with FP8
# activations a padded graph's output may differ from eager in the last bit (docs/cuda_graphs.md); the default
# lists hold every row count where the small-M GEMM's config can change (its M buckets).


def get_batch_sizes_to_capture(cuda_graph_max_bs: int | None, cuda_graph_bs: tuple[int, ...] | None = None,
                               max_running_requests: int | None = None,
                               gpu_memory_bytes: int | None = None) -> list[int]:
    """Ascending decode capture list.

    The explicit list wins, as given (sorted, each size once; its largest entry is the max); otherwise 1, 2, 4,
    8, 12, 16..256 step 8, 272..496 step 16, 512.. step 32, up to max_bs. Sizes above max_running_requests are
    dropped.
    """
    if cuda_graph_bs:
        sizes = sorted(set(cuda_graph_bs))
    else:
        if cuda_graph_max_bs is None:
            cuda_graph_max_bs = default_cuda_graph_max_bs(gpu_memory_bytes or 0)
        schedule = ([1, 2, 4, 8, 12] + list(range(16, 257, 8)) + list(range(272, 497, 16))
                    + list(range(512, cuda_graph_max_bs + 1, 32)))
        sizes = [s for s in schedule if s <= cuda_graph_max_bs]
    if max_running_requests is not None:
        sizes = [s for s in sizes if s <= max_running_requests]
    return sizes


def get_token_levels(max_tokens: int, explicit: tuple[int, ...] | None = None) -> list[int]:
    """Ascending extend token-count levels: 1, 2, 4..32 step 4, 48..256 step 16, 288..512 step 32,
    576..1024 step 64, 1280..4096 step 256, 4608.. step 512, up to max_tokens; or the explicit list, as given
    (sorted, each level once)."""
    if explicit:
        return sorted(set(explicit))
    levels = ([1, 2] + list(range(4, 33, 4)) + list(range(48, 257, 16)) + list(range(288, 513, 32))
              + list(range(576, 1025, 64)) + list(range(1280, 4097, 256))
              + list(range(4608, max(max_tokens, 4608) + 1, 512)))
    return [t for t in levels if t <= max_tokens]


def pick_size(sizes: list[int], n: int) -> int | None:
    """Smallest captured size >= n (bisect), or None when n is above the largest."""
    i = bisect.bisect_left(sizes, n)
    return sizes[i] if i < len(sizes) else None


def resolve_decode_capture_list(args, max_running_requests: int) -> tuple[int, ...]:
    if args.disable_cuda_graph:
        return ()
    import torch

    if args.device == "cpu":
        # One dynamic-batch compile serves every size (runners/cpu_graph_runner.py): sizes cost only a
        # warm-up run each, so the list reaches max_running_requests.
        return tuple(get_batch_sizes_to_capture(args.cuda_graph_max_bs or max_running_requests, args.cuda_graph_bs,
                                                max_running_requests))
    memory = torch.cuda.get_device_properties(0).total_memory if torch.cuda.is_available() else 0
    return tuple(get_batch_sizes_to_capture(args.cuda_graph_max_bs, args.cuda_graph_bs, max_running_requests,
                                            memory))


def resolve_extend_token_levels(args, chunked_prefill_size: int | None) -> tuple[int, ...]:
    if args.disable_piecewise_cuda_graph:
        return ()
    # Default: up to the chunk size, capped at 2048 tokens: above that an extend is compute-bound and a
    # graph saves little, while each level costs start-up time and memory.
    max_tokens = args.piecewise_cuda_graph_max_tokens or min(chunked_prefill_size or 8192, DEFAULT_MAX_EXTEND_TOKENS)
    return tuple(get_token_levels(max_tokens, args.piecewise_cuda_graph_tokens))


def resolve_full_extend_max_tokens(args) -> int:
    """The largest extend level that also gets a whole-backbone graph (0: none); only with the piecewise levels."""
    if args.disable_piecewise_cuda_graph:
        return 0
    full = args.full_extend_graph_max_tokens
    return DEFAULT_FULL_EXTEND_MAX_TOKENS if full is None else full

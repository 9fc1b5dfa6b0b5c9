"""The scheduler process's entry point: the server's flags become the scheduler's and the runner's configs.

launch_server spawns `run_scheduler_process(args, ipc, ready_conn)` (with `rank=` and `heartbeat=` for
data/tensor-parallel ranks). The configs are built here, inside the spawned process: resolving the capture
lists asks the GPU for its memory, and the HTTP process must never hold a CUDA context. Then
scheduler/scheduler_process.py runs the engine; below this module nothing knows ServerArgs.
"""

from __future__ import annotations

import dataclasses

from runners.capture_lists import (
    resolve_decode_capture_list,
    resolve_extend_token_levels,
    resolve_full_extend_max_tokens,
)
from runners.model_runner import RunnerConfig
from scheduler import scheduler_process
from scheduler.ipc import IpcPaths
from scheduler.scheduler import SchedulerConfig
from scheduler.speculative import SpeculativeConfig
from server.args import ServerArgs
from server.parallel import SchedulerRank


def default_max_running_requests(args: ServerArgs) -> int:
    return args.max_running_requests or (256 if args.device == "cuda" else 64)


# CPU prefill chunk: its time is how long the running requests (and a prompt that arrives meanwhile) wait
# behind a long prompt at a time. 128 tokens take at most 0.53 s on 2 cores: a short chat sent during a
# 4,000-token prompt's prefill gets its first token in 0.4 s and its answer in 3 s (256: 0.6 and 5.1 s; 2,048:
# 7.9 and 8.7 s), for 15-20% of a long prompt's prefill speed (benchmarks/bench_cpu_chunking.py,
# docs/benchmarks.md "CPU").
CPU_CHUNKED_PREFILL_SIZE = 128
GPU_CHUNKED_PREFILL_SIZE = 8192
GPU_MAX_PREFILL_TOKENS = 16384


def default_chunked_prefill_size(args: ServerArgs) -> int | None:
    if args.chunked_prefill_size == -1:
        return None
    return args.chunked_prefill_size or (GPU_CHUNKED_PREFILL_SIZE if args.device == "cuda"
                                         else CPU_CHUNKED_PREFILL_SIZE)


def default_max_prefill_tokens(args: ServerArgs) -> int:
    """The token budget of one extend batch: on a CPU one chunk (a batch of many new prompts must not hold the
    running requests up longer than a long prompt's chunk does)."""
    if args.max_prefill_tokens is not None:
        return args.max_prefill_tokens
    chunk = default_chunked_prefill_size(args)
    return GPU_MAX_PREFILL_TOKENS if args.device == "cuda" or chunk is None else chunk


def runner_config(args: ServerArgs, rank: SchedulerRank | None = None) -> RunnerConfig:
    device = args.device
    max_running = default_max_running_requests(args)
    graphs = device == "cuda"
    # (the CPU's inductor decode graphs give no aux hidden states: an EAGLE3 target decodes eagerly there)
    compile_decode = args.enable_torch_compile and args.speculative_algorithm != "EAGLE3"
    spec = speculative_config(args)
    # A pooling server's requests never decode: no decode graphs to capture.
    pooling = args.is_embedding or args.is_reranker
    chunk = default_chunked_prefill_size(args)
    config = RunnerConfig(
        model_path=args.model_path,
        mm_max_pixels=args.mm_max_pixels,
        device=device,
        dtype=args.dtype,
        attention_backend=args.attention_backend,
        context_length=args.context_length,
        max_running_requests=max_running,
        max_total_tokens=args.max_total_tokens,
        mem_fraction_static=args.mem_fraction_static,
        # The largest extend batch the scheduler builds: its activation peak is what the profile measures.
        max_prefill_tokens=min(default_max_prefill_tokens(args), chunk or default_max_prefill_tokens(args)),
        random_weights=args.load_format == "dummy",
        seed=args.random_seed,
        # CPU: --enable-torch-compile compiles the decode list with inductor (runners/cpu_graph_runner.py);
        # off by default, eager measured faster end to end (docs/benchmarks.md).
        disable_cuda_graph=args.disable_cuda_graph or pooling or not (graphs or compile_decode),
        cuda_graph_bs=(resolve_decode_capture_list(args, max_running)
                       if (graphs or compile_decode) and not pooling else ()),
        disable_piecewise_cuda_graph=args.disable_piecewise_cuda_graph or not graphs,
        piecewise_cuda_graph_tokens=resolve_extend_token_levels(args, chunk) if graphs else (),
        full_extend_graph_max_tokens=resolve_full_extend_max_tokens(args) if graphs else 0,
        enable_torch_compile=args.enable_torch_compile,
        disable_small_m_gemm=args.disable_small_m_gemm,
        quantization=args.quantization,
        kv_cache_dtype=args.kv_cache_dtype,
        sampling_backend=args.sampling_backend,
        embedding_only=args.is_embedding,
        lora=args.lora_config(),
        speculative_tokens=spec.num_draft_tokens if spec is not None else 0,
        speculative_max_bs=spec.max_batch_size if spec is not None else 0,
        aux_hidden_state_layers=eagle3_aux_layers(args),
    )
    if rank is None:
        return config
    return dataclasses.replace(config, device=rank.device, tp_rank=rank.tp_rank, tp_size=rank.tp_size,
                               dist_init_method=rank.dist_init_method, dist_timeout_s=args.dist_timeout,
                               # peer memory reaches only this host's GPUs
                               custom_all_reduce=not args.disable_custom_all_reduce and args.nnodes == 1)


def scheduler_config(args: ServerArgs) -> SchedulerConfig:
    return SchedulerConfig(
        max_running_requests=default_max_running_requests(args),
        max_prefill_tokens=default_max_prefill_tokens(args),
        chunked_prefill_size=default_chunked_prefill_size(args),
        schedule_policy=args.schedule_policy,
        disable_radix_cache=args.disable_radix_cache,
        enable_overlap=not args.disable_overlap_schedule,
        enable_mixed_chunk=args.enable_mixed_chunk,
        grammar_backend=args.grammar_backend,
        speculative=speculative_config(args),
    )


def eagle3_aux_layers(args: ServerArgs) -> tuple[int, ...]:
    """An EAGLE3 target's aux hidden-state layers, known before its graphs are captured (empty otherwise, or
    where the draft's config does not load: the draft's own check then says why, in one line)."""
    if args.speculative_algorithm != "EAGLE3" or args.speculative_draft_model_path is None:
        return ()
    from model_executor.model_config import ModelConfig, ModelConfigError
    from model_executor.models.eagle3 import aux_layer_ids

    try:
        return tuple(aux_layer_ids(ModelConfig.from_pretrained(args.speculative_draft_model_path, draft=True),
                                   ModelConfig.from_pretrained(args.model_path)))
    except (ModelConfigError, OSError, ValueError):
        return ()


def speculative_config(args: ServerArgs) -> SpeculativeConfig | None:
    if args.speculative_algorithm is None:
        return None
    # On the CPU a verify pass grows with its tokens (compute-bound): past 4 decoding requests drafts that miss
    # cost more than plain decoding (docs/benchmarks.md, "Speculative decoding").
    return SpeculativeConfig(algorithm=args.speculative_algorithm, num_draft_tokens=args.resolved_num_draft_tokens,
                             draft_model_path=args.speculative_draft_model_path,
                             ngram_min_window=args.speculative_ngram_min_match_window_size,
                             ngram_max_window=args.speculative_ngram_max_match_window_size,
                             max_batch_size=4 if args.device == "cpu" else 64)


def scheduler_process_config(args: ServerArgs,
                             rank: SchedulerRank | None = None) -> scheduler_process.SchedulerProcessConfig:
    """rank: this process's place among the data/tensor-parallel ranks (None: the only scheduler)."""
    return scheduler_process.SchedulerProcessConfig(
        runner=runner_config(args, rank),
        scheduler=scheduler_config(args),
        tokenizer_path=args.tokenizer_path or args.model_path,
        dp_rank=rank.dp_rank if rank is not None else 0,
        status_interval=args.status_interval,
    )


def run_scheduler_process(args: ServerArgs, ipc: IpcPaths, ready_conn, rank: SchedulerRank | None = None,
                          heartbeat=None) -> None:
    """The spawned scheduler process's target (launch_server's scheduler entry point)."""
    scheduler_process.run_scheduler_process(scheduler_process_config(args, rank), ipc, ready_conn,
                                            heartbeat=heartbeat)

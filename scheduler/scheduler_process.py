"""The scheduler process: builds the model runner and the Scheduler, then loops over ZMQ messages.

Receives TokenizedGenerateReq / AbortReq / FlushCacheReq / GetStatsReq from the HTTP process, sends one
BatchTokenOut per step to the detokenizer and ControlReply messages straight back to the HTTP process.
While requests run it logs a status line every --status-interval seconds (StatusLine).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time

import zmq

from model_executor.distributed import parallel_state as ps
from runners.model_runner import ModelRunner, RunnerConfig
from scheduler.scheduler import ReqOutput, Scheduler, SchedulerConfig
from server.args import ServerArgs
from server.cpu_threads import configure_scheduler_threads
from server.ipc import (
    AbortReq,
    BatchTokenOut,
    ControlReply,
    FlushCacheReq,
    GetStatsReq,
    IpcPaths,
    TokenizedGenerateReq,
    bind_pull,
    connect_push,
)
from server.parallel import SchedulerRank

logger = logging.getLogger("duet.scheduler")

IDLE_POLL_MS = 50


def default_max_running_requests(args: ServerArgs) -> int:
    return args.max_running_requests or (256 if args.device == "cuda" else 64)


def default_chunked_prefill_size(args: ServerArgs) -> int | None:
    if args.chunked_prefill_size == -1:
        return None
    return args.chunked_prefill_size or (8192 if args.device == "cuda" else 2048)


def runner_config(args: ServerArgs, rank: SchedulerRank | None = None) -> RunnerConfig:
    from runners.capture_lists import (
        resolve_decode_capture_list,
        resolve_extend_token_levels,
        resolve_full_extend_max_tokens,
    )

    device = args.device
    max_running = default_max_running_requests(args)
    graphs = device == "cuda"
    chunk = default_chunked_prefill_size(args)
    config = RunnerConfig(
        model_path=args.model_path,
        device=device,
        dtype=args.dtype,
        attention_backend=args.attention_backend,
        context_length=args.context_length,
        max_running_requests=max_running,
        max_total_tokens=args.max_total_tokens,
        mem_fraction_static=args.mem_fraction_static,
        # The largest extend batch the scheduler builds: its activation peak is what the profile measures.
        max_prefill_tokens=min(args.max_prefill_tokens, chunk or args.max_prefill_tokens),
        random_weights=args.load_format == "dummy",
        seed=args.random_seed,
        # CPU: --enable-torch-compile compiles the decode list with inductor (runners/cpu_graph_runner.py);
        # off by default, eager measured faster end to end (docs/benchmarks.md).
        disable_cuda_graph=args.disable_cuda_graph or not (graphs or args.enable_torch_compile),
        cuda_graph_bs=resolve_decode_capture_list(args, max_running) if graphs or args.enable_torch_compile else (),
        disable_piecewise_cuda_graph=args.disable_piecewise_cuda_graph or not graphs,
        piecewise_cuda_graph_tokens=resolve_extend_token_levels(args, chunk) if graphs else (),
        full_extend_graph_max_tokens=resolve_full_extend_max_tokens(args) if graphs else 0,
        enable_torch_compile=args.enable_torch_compile,
        quantization=args.quantization,
        kv_cache_dtype=args.kv_cache_dtype,
        sampling_backend=args.sampling_backend,
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
        max_prefill_tokens=args.max_prefill_tokens,
        chunked_prefill_size=default_chunked_prefill_size(args),
        schedule_policy=args.schedule_policy,
        disable_radix_cache=args.disable_radix_cache,
        enable_overlap=not args.disable_overlap_schedule,
        enable_mixed_chunk=args.enable_mixed_chunk,
        grammar_backend=args.grammar_backend,
    )


def _exit_with_parent() -> None:
    """Orphans must not survive: exit as soon as the launching process is gone."""
    parent = os.getppid()

    def watch():
        while True:
            if os.getppid() != parent:
                os._exit(1)
            time.sleep(0.5)

    threading.Thread(target=watch, daemon=True, name="parent-watch").start()


def _batch_out(outputs: list[ReqOutput]) -> BatchTokenOut:
    return BatchTokenOut(
        rids=[o.rid for o in outputs],
        new_token_ids=[o.new_token_ids for o in outputs],
        finished=[o.finish_reason for o in outputs],
        prompt_tokens=[o.prompt_tokens for o in outputs],
        completion_tokens=[o.completion_tokens for o in outputs],
        cached_tokens=[o.cached_tokens for o in outputs],
        logprobs=[o.logprobs for o in outputs],
        context_ids=[o.context_ids for o in outputs],
        prompt_logprobs=([o.prompt_logprobs for o in outputs]
                         if any(o.prompt_logprobs is not None for o in outputs) else None),
    )


def ready_info(args: ServerArgs, runner: ModelRunner) -> dict:
    graph = runner.graph_info()
    return {
        "model_path": args.model_path,
        "context_len": runner.context_len,
        "num_kv_slots": runner.num_kv_slots,
        "max_running_requests": runner.req_to_token_pool.size,
        "device": str(runner.device),
        "dtype": str(runner.dtype).replace("torch.", ""),
        "quantization": runner.quant.method if runner.quant else None,
        "kv_cache_dtype": str(runner.kv_dtype).replace("torch.", ""),
        "attention_backend": type(runner.attn_backend).__name__,
        "sampling_backend": runner.sampler.backend,
        "chunked_prefill_size": default_chunked_prefill_size(args),
        "enable_mixed_chunk": args.enable_mixed_chunk,
        "vocab_size": runner.model_config.vocab_size,
        "eos_token_ids": list(runner.model_config.eos_token_ids),
        "scheduler_pid": os.getpid(),
        **graph,
    }


def run_scheduler_process(args: ServerArgs, ipc: IpcPaths, ready_conn, rank: SchedulerRank | None = None,
                          heartbeat=None) -> None:
    """rank: this process's place among the data/tensor-parallel ranks (None: the only scheduler).
    heartbeat: a shared double the loop sets to time.monotonic() after every iteration (the launcher's
    watchdog for hung tensor-parallel ranks)."""
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s scheduler %(levelname)s %(message)s")
    _exit_with_parent()
    try:
        from transformers import AutoTokenizer

        configure_scheduler_threads(args.device)
        runner = ModelRunner(runner_config(args, rank))
        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer_path or args.model_path)
        scheduler = Scheduler(runner, scheduler_config(args), tokenizer=tokenizer)
    except Exception as e:  # report start-up failures as one line to the launcher
        logger.exception("scheduler start-up failed")
        ready_conn.send({"ok": False, "error": f"{type(e).__name__}: {e}"})
        return
    if rank is not None and not rank.talks_to_clients:  # a TP follower: rank 0 relays its messages
        ready_conn.send({"ok": True, "info": ready_info(args, runner)})
        SchedulerLoop(scheduler, BroadcastInbox(None), _NullSink(), _NullSink(), heartbeat=heartbeat).run()
        return
    ctx = zmq.Context()
    recv = bind_pull(ctx, ipc.scheduler_input_of(rank.dp_rank if rank else 0))
    to_detokenizer = connect_push(ctx, ipc.detokenizer_input)
    to_http = connect_push(ctx, ipc.http_input)
    ready_conn.send({"ok": True, "info": ready_info(args, runner)})
    inbox = ZmqInbox(recv) if ps.get_tp_size() == 1 else BroadcastInbox(ZmqInbox(recv))
    SchedulerLoop(scheduler, inbox, to_detokenizer, to_http, StatusLine(args.status_interval),
                  heartbeat=heartbeat).run()


class ZmqInbox:
    """The messages that arrived on the scheduler's socket."""

    def __init__(self, sock):
        self.sock = sock

    def receive(self, wait_ms: int) -> list:
        """Everything queued now; when there is nothing, wait up to wait_ms for a first message."""
        if wait_ms and not self.sock.poll(wait_ms):
            return []
        msgs = []
        while True:
            try:
                msgs.append(self.sock.recv_pyobj(zmq.NOBLOCK))
            except zmq.Again:
                return msgs


class BroadcastInbox:
    """Tensor parallelism: rank 0 receives and broadcasts the list to every rank of its group each loop
    iteration (an empty list too), so every rank's scheduler sees the same messages in the same order and
    makes the same decisions. Followers (inner None) block in the broadcast; a dead peer fails it."""

    def __init__(self, inner: ZmqInbox | None):
        self.inner = inner

    def receive(self, wait_ms: int) -> list:
        return ps.broadcast_object(self.inner.receive(wait_ms) if self.inner is not None else None)


class _NullSink:
    """A TP follower's outputs and replies: rank 0 sends the same ones."""

    def send_pyobj(self, obj) -> None:
        pass


class StatusLine:
    """SGLang's periodic "Decode batch. #running-req ..." line: at INFO every `interval` seconds while
    requests run (0: never), with the throughput and graph use since the previous line."""

    GRAPH_PATHS = ("decode_graph", "extend_graph")

    def __init__(self, interval: float):
        self.interval = interval
        self.restart({})

    def restart(self, path_counts: dict) -> None:
        """Start a new window (after idle time, which must not dilute tokens/s)."""
        self.since = time.monotonic()
        self.tokens = 0
        self.paths = dict(path_counts)

    def after_step(self, scheduler: Scheduler, outputs: list[ReqOutput]) -> None:
        if not self.interval:
            return
        self.tokens += sum(len(o.new_token_ids) for o in outputs)
        elapsed = time.monotonic() - self.since
        if elapsed < self.interval:
            return
        s = scheduler.stats()
        paths = s["path_counts"]
        passes = {k: v - self.paths.get(k, 0) for k, v in paths.items()}
        total = sum(passes.values())
        graph = sum(passes.get(k, 0) for k in self.GRAPH_PATHS)
        kv = s["kv_used"] / s["kv_total"] if s["kv_total"] else 0.0
        logger.info("status: #running-req: %d, #queue-req: %d, KV usage: %.1f%%, gen throughput (token/s): "
                    "%.1f, graph hit rate: %.0f%% (%d of %d forward passes)", s["num_running"], s["num_waiting"],
                    100 * kv, self.tokens / elapsed, 100 * graph / total if total else 0.0, graph, total)
        self.restart(paths)


class SchedulerLoop:
    def __init__(self, scheduler: Scheduler, inbox, to_detokenizer, to_http, status: StatusLine | None = None,
                 heartbeat=None):
        self.scheduler = scheduler
        self.heartbeat = heartbeat
        self.inbox = inbox
        self.to_detokenizer = to_detokenizer
        self.to_http = to_http
        self.status = status or StatusLine(0)

    def run(self) -> None:
        while True:
            busy = self.scheduler.has_work()
            # Block only when idle; while batches run, take whatever arrived since the last step.
            for msg in self.inbox.receive(0 if busy else IDLE_POLL_MS):
                self._handle(msg)
            if self.scheduler.has_work():
                if not busy and self.status.interval:
                    self.status.restart(self.scheduler.runner.path_counts)
                outputs = self.scheduler.step()
                if outputs:
                    self.to_detokenizer.send_pyobj(_batch_out(outputs))
                self.status.after_step(self.scheduler, outputs)
            elif busy:
                self.scheduler.check_invariant()  # just went idle: every slot must be accounted for
            if self.heartbeat is not None:
                self.heartbeat.value = time.monotonic()  # CLOCK_MONOTONIC: comparable across processes

    def _handle(self, msg) -> None:
        if isinstance(msg, TokenizedGenerateReq):
            self.scheduler.add_request(msg.rid, msg.input_ids, msg.params)
        elif isinstance(msg, AbortReq):
            self.scheduler.abort(msg.rid)
        elif isinstance(msg, FlushCacheReq):
            ok = self.scheduler.flush_cache()
            self.to_http.send_pyobj(ControlReply(msg.rid, ok, {} if ok else {
                "message": "cannot flush the cache while requests are running"}))
        elif isinstance(msg, GetStatsReq):
            self.to_http.send_pyobj(ControlReply(msg.rid, True, self.scheduler.stats()))
        else:
            logger.warning("ignoring unknown message %r", type(msg).__name__)

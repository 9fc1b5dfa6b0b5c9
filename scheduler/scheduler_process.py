"""The scheduler process: builds the model runner and the Scheduler, then loops over ZMQ messages.

Receives TokenizedGenerateReq / AbortReq / FlushCacheReq / GetStatsReq from the HTTP process, sends one
BatchTokenOut per step to the detokenizer and ControlReply messages straight back to the HTTP process.
While requests run it logs a status line every `status_interval` seconds (StatusLine).

Its input is a SchedulerProcessConfig: the launcher's entry point (server/scheduler_entry.py) builds it
from the server's flags inside this process, so nothing here knows the server's arguments.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass

import zmq

from model_executor.distributed import parallel_state as ps
from model_executor.lora.adapter import LoraError
from runners.model_runner import ModelRunner, RunnerConfig
from scheduler.cpu_threads import configure_scheduler_threads
from scheduler.io_struct import (
    AbortReq,
    BatchTokenOut,
    ControlReply,
    FlushCacheReq,
    GetStatsReq,
    LoadLoraReq,
    TokenizedGenerateReq,
    UnloadLoraReq,
)
from scheduler.ipc import IpcPaths, bind_pull, connect_push
from scheduler.scheduler import ReqOutput, Scheduler, SchedulerConfig

logger = logging.getLogger("duet.scheduler")

IDLE_POLL_MS = 50


@dataclass(frozen=True)
class SchedulerProcessConfig:
    """Everything one scheduler process (one rank) needs, resolved and validated by the launcher."""

    runner: RunnerConfig  # its tp_rank / tp_size / device place this process in its replica's TP group
    scheduler: SchedulerConfig
    tokenizer_path: str
    dp_rank: int = 0  # the data-parallel replica: which scheduler socket its TP rank 0 binds
    status_interval: float = 0.0  # seconds between status lines while requests run; 0: none

    @property
    def talks_to_clients(self) -> bool:
        """TP rank 0 receives the requests and sends the outputs of its replica; the others follow it."""
        return self.runner.tp_rank == 0


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
        decode_options=([o.decode_options for o in outputs]
                        if any(o.decode_options is not None for o in outputs) else None),
        embeddings=([o.embedding for o in outputs] if any(o.embedding is not None for o in outputs) else None),
        spec_counts=[o.spec_counts for o in outputs] if outputs and outputs[0].spec_counts is not None else None,
    )


def ready_info(config: SchedulerProcessConfig, runner: ModelRunner, phases: dict[str, float]) -> dict:
    """What the ready message tells the launcher. startup: this process's start-up phases (seconds, in order)
    and `ready_at`, time.perf_counter() now (CLOCK_MONOTONIC, comparable across processes on one host)."""
    graph = runner.graph_info()
    return {
        "model_path": config.runner.model_path,
        "context_len": runner.context_len,
        "num_kv_slots": runner.num_kv_slots,
        "max_running_requests": runner.req_to_token_pool.size,
        "device": str(runner.device),
        "dtype": str(runner.dtype).replace("torch.", ""),
        "quantization": runner.quant.method if runner.quant else None,
        "kv_cache_dtype": str(runner.kv_dtype).replace("torch.", ""),
        "attention_backend": type(runner.attn_backend).__name__,
        "sampling_backend": runner.sampler.backend,
        "chunked_prefill_size": config.scheduler.chunked_prefill_size,
        "max_prefill_tokens": config.scheduler.max_prefill_tokens,
        "enable_mixed_chunk": config.scheduler.enable_mixed_chunk,
        "speculative": config.scheduler.speculative.info() if config.scheduler.speculative is not None else None,
        "vocab_size": runner.model_config.vocab_size,
        "hidden_size": runner.model_config.hidden_size,  # an embedding's size
        "eos_token_ids": list(runner.model_config.eos_token_ids),
        "lora": runner.lora.info() if runner.lora is not None else None,
        "scheduler_pid": os.getpid(),
        **graph,
        "startup": {"phases": phases, "ready_at": time.perf_counter()},
    }


def run_scheduler_process(config: SchedulerProcessConfig, ipc: IpcPaths, ready_conn, heartbeat=None) -> None:
    """Start the engine, report {"ok": True, "info": ...} (or {"ok": False, "error": ...}) on ready_conn, then
    serve until the process is stopped. heartbeat: a shared double the loop sets to time.monotonic() after
    every iteration (the launcher's watchdog for hung tensor-parallel ranks)."""
    _exit_with_parent()
    try:
        from transformers import AutoTokenizer

        configure_scheduler_threads(config.runner.device)
        runner = ModelRunner(config.runner)
        phases = runner.startup_phases()
        t0 = time.perf_counter()
        tokenizer = AutoTokenizer.from_pretrained(config.tokenizer_path)
        t1 = time.perf_counter()
        scheduler = Scheduler(runner, config.scheduler, tokenizer=tokenizer)
        phases.update(tokenizer=t1 - t0, scheduler_setup=time.perf_counter() - t1)
    except Exception as e:  # report start-up failures as one line to the launcher
        logger.exception("scheduler start-up failed")
        ready_conn.send({"ok": False, "error": f"{type(e).__name__}: {e}"})
        return
    if not config.talks_to_clients:  # a TP follower: rank 0 relays its messages
        ready_conn.send({"ok": True, "info": ready_info(config, runner, phases)})
        SchedulerLoop(scheduler, BroadcastInbox(None), _NullSink(), _NullSink(), heartbeat=heartbeat).run()
        return
    ctx = zmq.Context()
    recv = bind_pull(ctx, ipc.scheduler_input_of(config.dp_rank))
    to_detokenizer = connect_push(ctx, ipc.detokenizer_input)
    to_http = connect_push(ctx, ipc.http_input)
    ready_conn.send({"ok": True, "info": ready_info(config, runner, phases)})
    inbox = ZmqInbox(recv) if ps.get_tp_size() == 1 else BroadcastInbox(ZmqInbox(recv))
    SchedulerLoop(scheduler, inbox, to_detokenizer, to_http, StatusLine(config.status_interval),
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
            self.scheduler.add_request(msg.rid, msg.input_ids, msg.params, msg.pooling, msg.lora_name,
                                          msg.images)
        elif isinstance(msg, AbortReq):
            self.scheduler.abort(msg.rid)
        elif isinstance(msg, FlushCacheReq):
            ok = self.scheduler.flush_cache()
            self.to_http.send_pyobj(ControlReply(msg.rid, ok, {} if ok else {
                "message": "cannot flush the cache while requests are running"}))
        elif isinstance(msg, GetStatsReq):
            self.to_http.send_pyobj(ControlReply(msg.rid, True, self.scheduler.stats()))
        elif isinstance(msg, LoadLoraReq):
            try:
                self.scheduler.load_lora(msg.lora_name, msg.lora_path, msg.pinned)
                self.to_http.send_pyobj(ControlReply(msg.rid, True, {"adapters": self.scheduler.lora_names()}))
            except LoraError as e:
                self.to_http.send_pyobj(ControlReply(msg.rid, False, {"message": str(e)}))
        elif isinstance(msg, UnloadLoraReq):
            error = self.scheduler.unload_lora(msg.lora_name)
            self.to_http.send_pyobj(ControlReply(msg.rid, error is None, {"message": error} if error else
                                                 {"adapters": self.scheduler.lora_names()}))
        else:
            logger.warning("ignoring unknown message %r", type(msg).__name__)

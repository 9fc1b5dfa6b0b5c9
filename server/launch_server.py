"""launch_server: the CLI entry point; owns the three processes' lives.

Start-up: parse and resolve the flags (device, default model), bind the HTTP port (so a busy port fails
before the model loads), create the private IPC folder, spawn the scheduler and the detokenizer, wait for
both to report ready on a pipe, then serve the FastAPI app with uvicorn in this process.

Shut-down: SIGTERM/SIGINT stop uvicorn gracefully: new requests get a 503 at once, in-flight ones have
DRAIN_S to finish and are then failed with a 503 (an SSE error event for streams), so no client is cut off
mid-answer; then the children are stopped (then killed), the IPC folder is removed, and the exit code
is 0. The children ignore SIGINT and SIGTERM sent to the whole process group (Ctrl-C, `kill -- -PGID`,
a container runtime): the engine must keep running while this process drains. They exit on SIGTERM only
after this process asked them to on their stop pipe, and then exit normally, so that their exit handlers
run (tqdm's multiprocessing lock, a named semaphore, would otherwise be reported as leaked).
If a child dies while serving, the tokenizer manager fails the in-flight requests and turns /health to
503; the server stops about a second later and exits 1. Children watch this process and exit if it dies,
so no orphans remain even after a SIGKILL.

`run`/`main` take the scheduler process's entry point as a Python argument (the test harness passes a
fake scheduler, see tests/fake_server.py); nothing in the environment can replace it.
"""

from __future__ import annotations

import importlib
import logging
import multiprocessing
import os
import shutil
import signal
import socket
import sys
import threading
import time

from scheduler.ipc import IpcPaths
from server.args import ArgsError, ServerArgs, parse_args
from server.startup_timeline import StartupClock, largest_phases, timeline_line

logger = logging.getLogger("duet.launch_server")

DEFAULT_SCHEDULER_ENTRYPOINT = "server.scheduler_entry:run_scheduler_process"
DETOKENIZER_ENTRYPOINT = "server.detokenizer:run_detokenizer_process"
FATAL_GRACE_S = 1.0  # after the engine died: time for clients to receive their errors before exiting
CHILD_STOP_TIMEOUT_S = 5.0
DRAIN_S = 3.0  # on SIGTERM: time in-flight requests get to finish (uvicorn's own limit, 5 s, cuts them off)


class UsageError(ValueError):
    """A flag that is invalid once the device is known: exit code 2, like argparse's errors."""


class LaunchError(RuntimeError):
    """Start-up failed; the message is one line for the user."""


class _Interrupted(BaseException):
    """SIGTERM/SIGINT outside uvicorn's own handling (start-up, or re-raised by uvicorn after it stopped)."""


def configure_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        force=True)


# ---- children -----------------------------------------------------------------------------------


def _exit_with_parent(parent_pid: int, cleanup_dir: str | None) -> None:
    """Die with the launcher: a thread polls the parent pid; on Linux the kernel also kills the child at
    once (PR_SET_PDEATHSIG) unless the child has a folder to remove first (the detokenizer removes the IPC
    folder that a SIGKILLed launcher could not)."""
    if cleanup_dir is None:
        try:
            import ctypes

            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass

    def poll() -> None:
        while True:
            if os.getppid() != parent_pid:
                if cleanup_dir is not None:
                    shutil.rmtree(cleanup_dir, ignore_errors=True)
                os._exit(1)
            time.sleep(0.5)

    threading.Thread(target=poll, name="duet-parent-watch", daemon=True).start()


def _stop_when_asked(stop_conn) -> None:
    """SIGINT is ignored; SIGTERM ends the child (SystemExit, so exit handlers run) only when the launcher
    wrote on the stop pipe first. A signal to the whole group (Ctrl-C, `kill -- -PGID`) leaves the child
    running while the launcher drains the in-flight requests; the launcher then stops it."""

    def on_sigterm(signum, frame):
        try:
            asked = stop_conn.poll(0)
        except (OSError, EOFError):
            asked = True  # the launcher is gone: its death watch would end us anyway
        if asked:
            raise SystemExit(0)

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, on_sigterm)


def _child_main(entrypoint: str, log_level: str, parent_pid: int, cleanup_dir: str | None, stop_conn,
                *entry_args, **entry_kwargs) -> None:
    """Runs in a spawned child: guard against orphaning, then call `module:function(*entry_args)`.

    The last entry argument is the ready pipe. Before the target runs, the child sends on it when its code
    began and when the entry's imports were done (time.perf_counter, for the start-up timeline); a crash
    before the child reported ready is sent on it as one line, so the launcher can show the reason instead
    of only an exit code.
    """
    began = time.perf_counter()
    _stop_when_asked(stop_conn)
    _exit_with_parent(parent_pid, cleanup_dir)
    configure_logging(log_level)
    ready_conn = entry_args[-1]
    try:
        module, _, func = entrypoint.partition(":")
        target = getattr(importlib.import_module(module), func)
        ready_conn.send({"started": {"at": began, "imported_at": time.perf_counter()}})
        target(*entry_args, **entry_kwargs)
    except SystemExit:
        raise  # stopped by the launcher
    except BaseException as e:
        try:
            ready_conn.send({"ok": False, "error": f"{type(e).__name__}: {e}".splitlines()[0]})
        except (OSError, ValueError):
            pass  # already reported ready and closed the pipe: the liveness watch reports the death
        raise


def _start_child(ctx, name: str, entrypoint: str, log_level: str, entry_args: tuple,
                 cleanup_dir: str | None = None, entry_kwargs: dict | None = None):
    recv_conn, send_conn = ctx.Pipe(duplex=False)
    stop_recv, stop_send = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child_main, name=f"duet-{name}",
                       args=(entrypoint, log_level, os.getpid(), cleanup_dir, stop_recv, *entry_args, send_conn),
                       kwargs=entry_kwargs or {})
    proc.start()
    send_conn.close()  # the child holds the only write end, so its death reads as EOF
    stop_recv.close()
    proc.stop_conn = stop_send  # see _stop_children
    return proc, recv_conn


def _wait_ready(children: dict, started: dict[str, dict] | None = None) -> dict[str, dict]:
    """Wait for {"ok": True, "info": ...} from each (proc, conn); LaunchError on failure or early death.
    started: filled with each child's {"at", "imported_at"} message (_child_main)."""
    infos: dict[str, dict] = {}
    while len(infos) < len(children):
        for name, (proc, conn) in children.items():
            if name in infos:
                continue
            if conn.poll(0.1):
                try:
                    msg = conn.recv()
                except EOFError:
                    proc.join(2.0)
                    raise LaunchError(f"the {name} process exited during start-up "
                                      f"(exit code {proc.exitcode})") from None
                if "started" in msg:
                    if started is not None:
                        started[name] = msg["started"]
                    continue
                if not msg.get("ok"):
                    raise LaunchError(f"the {name} failed to start: {msg.get('error') or 'no reason given'}")
                infos[name] = msg.get("info") or {}
            elif not proc.is_alive():
                raise LaunchError(f"the {name} process exited during start-up (exit code {proc.exitcode})")
    return infos


def _stop_children(procs: dict) -> None:
    for proc in procs.values():
        if proc.is_alive():
            try:
                proc.stop_conn.send("stop")  # before the signal: the child checks for it (_stop_when_asked)
            except OSError:
                pass  # it is exiting anyway
            proc.terminate()
    deadline = time.monotonic() + CHILD_STOP_TIMEOUT_S
    for name, proc in procs.items():
        proc.join(max(0.0, deadline - time.monotonic()))
        if proc.is_alive():
            logger.warning("the %s process did not stop within %.0f s; killing it", name, CHILD_STOP_TIMEOUT_S)
            proc.kill()
            proc.join(2.0)
        proc.stop_conn.close()


# ---- start-up -------------------------------------------------------------------------------------


def resolve_args(args: ServerArgs) -> ServerArgs:
    """Fill in the device and the model folder; LaunchError for a missing or unusable model."""
    changes = {}
    if args.device == "auto":
        import torch

        changes["device"] = "cuda" if torch.cuda.is_available() else "cpu"
    if args.model_path is None:
        from model_executor.default_model import DefaultModelError, ensure_default_model

        try:
            changes["model_path"] = str(ensure_default_model())
        except DefaultModelError as e:
            raise LaunchError(str(e)) from None
        from model_executor.default_model import default_dtype, default_quantization

        device = changes.get("device", args.device)
        if args.quantization is None:  # the default model's own format, shared with the offline CLI
            changes["quantization"] = default_quantization(device)
        if args.dtype == "auto":
            changes["dtype"] = default_dtype(device)
    from server.model_source import ModelSourceError, resolve_model_source

    try:  # a local, checked folder (hub ids are downloaded or taken from the cache) before any child starts
        changes.update(resolve_model_source(args.replace(**changes)))
    except ModelSourceError as e:
        raise LaunchError(str(e)) from None
    resolved = args.replace(**changes)
    try:
        resolved.validate()
    except ArgsError as e:
        raise UsageError(str(e)) from None
    check_parallel_fits(resolved)
    return resolved


def check_reranker_tokenizer(args: ServerArgs, tokenizer) -> None:
    """A yes/no reranker (--is-reranker on a causal LM) needs "yes" and "no" tokens: LaunchError if not."""
    if not args.is_reranker:
        return
    from model_executor.pooling_config import resolve_pooling
    from server.serving_rerank import yes_no_token_ids

    if resolve_pooling(args.model_path, args.is_embedding, args.is_reranker).reranker == "yes_no":
        try:
            yes_no_token_ids(tokenizer)
        except ValueError as e:
            raise LaunchError(str(e)) from None


def check_parallel_fits(args: ServerArgs) -> None:
    """The ranks fit this host's GPUs and the model's heads split over --tp-size; else UsageError."""
    from server.parallel import gpus_needed

    if args.device == "cuda" and (args.tp_size > 1 or args.dp_size > 1):
        import torch

        have, need = torch.cuda.device_count(), gpus_needed(args)
        if need > have:
            raise UsageError(f"--tp-size {args.tp_size} x --dp-size {args.dp_size} needs {need} GPUs on this host "
                             f"(one per rank), but {have} are visible")
    if args.tp_size > 1:
        from model_executor.model_config import ModelConfig
        from model_executor.weight_loader import check_tensor_parallel

        try:
            check_tensor_parallel(ModelConfig.from_pretrained(args.model_path), args.tp_size)
        except ValueError as e:
            raise UsageError(f"--tp-size {args.tp_size}: {e}") from None


def bind_http_socket(host: str, port: int) -> socket.socket:
    try:
        family, _, _, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                   flags=socket.AI_PASSIVE)[0]
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
    except OSError as e:
        raise LaunchError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    return sock


def _fmt_sizes(sizes) -> str:
    if not sizes:
        return "off"
    sizes = list(sizes)
    if len(sizes) <= 8:
        return "[" + ",".join(map(str, sizes)) + "]"
    return f"[{sizes[0]},{sizes[1]},{sizes[2]},...,{sizes[-1]}] ({len(sizes)} sizes)"


def summary_line(args: ServerArgs, info: dict, served_model_name: str, startup: dict | None = None) -> str:
    host = f"[{args.host}]" if ":" in args.host else args.host
    parts = [f"model={served_model_name}", f"dtype={info.get('dtype')}", f"quantization={info.get('quantization') or 'none'}",
             f"device={info.get('device', args.device)}",
             f"context={info.get('context_len')}", f"kv_slots={info.get('num_kv_slots')}",
             f"kv_dtype={info.get('kv_cache_dtype')}",
             f"max_running={info.get('max_running_requests')}", f"attention={info.get('attention_backend')}",
             f"sampling={info.get('sampling_backend', 'pytorch')}"]
    if args.tp_size > 1 or args.dp_size > 1:
        parts.append(f"tp={args.tp_size} dp={args.dp_size}")
    if str(info.get("device", args.device)).startswith("cuda"):
        parts.append(f"decode_graph_bs={_fmt_sizes(info.get('cuda_graph_bs'))}")
        parts.append(f"extend_graph_tokens={_fmt_sizes(info.get('piecewise_cuda_graph_tokens'))}")
        if info.get("full_extend_graph_tokens"):
            parts.append(f"whole_extend_graphs_up_to={info['full_extend_graph_tokens'][-1]}")
        parts.append(f"capture={float(info.get('capture_seconds') or 0):.1f}s/"
                     f"{float(info.get('capture_gib') or 0):.2f}GiB")
    else:  # the CPU's decode is compiled by inductor (runners/cpu_graph_runner.py)
        parts.append(f"compiled_decode_bs={_fmt_sizes(info.get('cuda_graph_bs'))}")
        parts.append(f"compile={float(info.get('capture_seconds') or 0):.1f}s")
    if startup:
        parts.append(largest_phases(startup))
    return "duet ready: " + " ".join(parts) + f" url=http://{host}:{args.port}"


def combine_infos(args: ServerArgs, infos: dict[str, dict], ranks: list, procs: dict) -> dict:
    """The engine's start-up info: replica 0's, with the limits every replica meets (the smallest KV pool)
    and where each rank runs."""
    leaders = [infos[r.name] for r in ranks if r.talks_to_clients]
    info = dict(leaders[0])
    if len(leaders) > 1:
        info["num_kv_slots"] = min(i["num_kv_slots"] for i in leaders)
        info["replicas"] = [{"num_kv_slots": i["num_kv_slots"], "scheduler_pid": i.get("scheduler_pid")}
                            for i in leaders]
    info["tp_size"], info["dp_size"] = args.tp_size, args.dp_size
    info["scheduler_pids"] = {r.name: procs[r.name].pid for r in ranks}
    return info


def _run_follower_node(args: ServerArgs, ctx, ranks: list, scheduler_entrypoint: str) -> int:
    """--node-rank > 0: run this host's TP ranks (node 0 serves HTTP); exit 1 when one of them dies."""
    procs: dict = {}
    try:
        children = {r.name: _start_child(ctx, r.name, scheduler_entrypoint, args.log_level,
                                         (args, IpcPaths("/nonexistent")), entry_kwargs={"rank": r})
                    for r in ranks}
        procs = {name: proc for name, (proc, _) in children.items()}
        _wait_ready(children)
        print(f"duet node {args.node_rank} of {args.nnodes} ready: tp ranks "
              f"{[r.tp_rank for r in ranks]} joined {ranks[0].dist_init_method}", flush=True)
        while True:
            for name, proc in procs.items():
                if not proc.is_alive():
                    print(f"error: the {name} process died (exit code {proc.exitcode})", file=sys.stderr, flush=True)
                    return 1
            time.sleep(0.5)
    finally:
        _stop_children(procs)


def _serve(args: ServerArgs, ipc: IpcPaths, info: dict, tokenizer, procs: dict, sock: socket.socket,
           heartbeats: dict | None = None, clock: StartupClock | None = None) -> int:
    import asyncio

    import uvicorn

    from server.http_server import AppState, create_app, served_name
    from server.metrics import ServerMetrics
    from server.tokenizer_manager import TokenizerManager, load_chat_template

    exit_code = 0
    server: uvicorn.Server | None = None

    def on_fatal(message: str) -> None:
        nonlocal exit_code
        exit_code = 1
        asyncio.get_running_loop().call_later(FATAL_GRACE_S, lambda: setattr(server, "should_exit", True))

    from server.dp_router import DpRouter

    metrics = ServerMetrics()
    tm = TokenizerManager(tokenizer, ipc, info, metrics, processes=procs, on_fatal=on_fatal, heartbeats=heartbeats,
                          watchdog_timeout=args.watchdog_timeout,
                          log_requests=args.log_requests,
                          router=DpRouter(args.dp_size, args.dp_routing, metrics) if args.dp_size > 1 else None,
                          chat_template=load_chat_template(args.chat_template) if args.chat_template else None)
    from server.multimodal import ImageProcessor, parse_image_limit

    tm.images = ImageProcessor.load(args.model_path, tokenizer, parse_image_limit(args.limit_mm_per_prompt),
                                    args.mm_min_pixels, args.mm_max_pixels, not args.disable_image_url_fetch,
                                    args.allowed_local_media_path)
    name = served_name(args)
    state = AppState(args=args, info=info, tokenizer_manager=tm, served_model_name=name,
                     pids={"http": os.getpid(), **{k: p.pid for k, p in procs.items()}})

    class _Server(uvicorn.Server):
        async def startup(self, sockets=None) -> None:
            await super().startup(sockets=sockets)
            if self.started and not self.should_exit:
                if clock is not None:  # (before any request is read: nothing is awaited in between)
                    state.startup.update(clock.timeline(time.perf_counter()))
                    logger.info(timeline_line(state.startup))
                print(summary_line(args, info, name, state.startup), flush=True)

        async def shutdown(self, sockets=None) -> None:
            # Without this, uvicorn cancels what is still running after its graceful timeout: a bare
            # "500 Internal Server Error" for plain requests, a stream cut off without an error or [DONE].
            tm.accepting = False
            deadline = time.monotonic() + DRAIN_S
            while tm.num_inflight and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            tm.fail_all("the server is shutting down", fatal=False)
            await super().shutdown(sockets=sockets)

    config = uvicorn.Config(create_app(state), log_level=args.log_level, access_log=args.log_level == "debug",
                            timeout_graceful_shutdown=5, lifespan="on")
    server = _Server(config)
    try:
        server.run(sockets=[sock])
    except _Interrupted:
        pass  # uvicorn re-raises the signal it handled, after its graceful shutdown
    return exit_code


def run(argv: list[str] | None = None, scheduler_entrypoint: str = DEFAULT_SCHEDULER_ENTRYPOINT) -> int:
    """The server's life; the exit code. scheduler_entrypoint (`module:function`) is the scheduler
    process's target: tests pass a fake one (tests/fake_server.py)."""
    clock = StartupClock()
    args = parse_args(argv)
    configure_logging(args.log_level)

    def interrupted(signum, frame):
        raise _Interrupted(signum)

    signal.signal(signal.SIGTERM, interrupted)
    signal.signal(signal.SIGINT, interrupted)
    procs: dict = {}
    ipc = None
    sock = None
    try:
        args = resolve_args(args)
        from server.parallel import plan_ranks

        ranks = plan_ranks(args)
        ctx = multiprocessing.get_context("spawn")
        if args.node_rank > 0:
            return _run_follower_node(args, ctx, ranks, scheduler_entrypoint)
        sock = bind_http_socket(args.host, args.port)
        ipc = IpcPaths.create()
        clock.spawned = time.perf_counter()
        parallel = args.tp_size > 1 or args.dp_size > 1  # the scheduler entry point takes rank= only then
        # Tensor-parallel ranks report each loop iteration: a hung rank (alive, stuck) is caught by the
        # watchdog in seconds, not by the collective timeout.
        heartbeats = {r.name: ctx.Value("d", 0.0, lock=False) for r in ranks} if args.tp_size > 1 else {}
        children = {
            r.name: _start_child(ctx, r.name, scheduler_entrypoint, args.log_level, (args, ipc),
                                 entry_kwargs={"rank": r, "heartbeat": heartbeats.get(r.name)} if parallel else None)
            for r in ranks
        }
        children["detokenizer"] = _start_child(ctx, "detokenizer", DETOKENIZER_ENTRYPOINT, args.log_level,
                                               (args.tokenizer_path or args.model_path, ipc),
                                               cleanup_dir=ipc.folder)
        procs = {name: proc for name, (proc, _) in children.items()}
        from server.detokenizer import load_tokenizer

        tokenizer = load_tokenizer(args.tokenizer_path or args.model_path)  # while the children load
        check_reranker_tokenizer(args, tokenizer)
        started: dict[str, dict] = {}
        info = combine_infos(args, _wait_ready(children, started), ranks, procs)
        clock.children_ready = time.perf_counter()
        clock.child_started = started.get(ranks[0].name)
        clock.engine = info.pop("startup", None)
        for _, conn in children.values():
            conn.close()
        return _serve(args, ipc, info, tokenizer, procs, sock, heartbeats, clock)
    except UsageError as e:
        print(f"launch_server: error: {e}", file=sys.stderr, flush=True)
        return 2
    except LaunchError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 1
    except _Interrupted:
        logger.info("interrupted during start-up")
        return 0
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # let the clean-up below finish
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        _stop_children(procs)
        if ipc is not None:
            ipc.remove()
        if sock is not None:
            sock.close()


def main(argv: list[str] | None = None, scheduler_entrypoint: str = DEFAULT_SCHEDULER_ENTRYPOINT) -> None:
    sys.exit(run(argv, scheduler_entrypoint))


if __name__ == "__main__":
    main()

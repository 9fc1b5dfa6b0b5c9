"""A stand-in scheduler process for the server tests, and helpers to run a real server around it.

`run_fake_scheduler_process(args, ipc, ready_conn)` has the contract of
`server.scheduler_entry.run_scheduler_process` (see server/launch_server.py) but no model: it
"generates" deterministic tokens so the HTTP, detokenizer and process-management code can be tested on
CPU in seconds. `python -m tests.fake_server` runs the launcher with it (ServerProcess does so by default).

Generation rules (all deterministic unless sampling without a seed):
* greedy (temperature 0 or top_k 1): the i-th token is a function of the prompt ids and i;
* temperature > 0: drawn from `random.Random(seed)` (unseeded: from the system);
* tokens are picked from ordinary " word" tokens, so text is readable and stop strings can be built
  from it; a prompt containing ``[unicode]`` yields multi-byte characters (accents, CJK, emoji) split
  over byte-level tokens; ``[eos N]`` makes token N the EOS token (unless ignore_eos / min_tokens);
* stop_token_ids, EOS, stop strings (decoded with the tokenizer), max_new_tokens, min_new_tokens,
  abort, flush, stats and (fake but well-formed) logprobs are honoured like the real scheduler;
* logit_bias of +100 forces its token (the lowest such id), as it does on a real model;
* the request's decode options (skip_special_tokens...) go to the detokenizer with its first output.
"""

from __future__ import annotations

import atexit
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import zmq

from scheduler.io_struct import (
    AbortReq,
    BatchTokenOut,
    ControlReply,
    FinishReason,
    FlushCacheReq,
    GetStatsReq,
    TokenizedGenerateReq,
    TokenLogprob,
)
from scheduler.ipc import IpcPaths, bind_pull, connect_push

STEP_S = float(os.environ.get("DUET_FAKE_STEP_S", "0.004"))
UNICODE_TEXT = " naïve café 😀 日本語 ✓ Ω≈ç"


@dataclass
class _Req:
    rid: str
    input_ids: list[int]
    params: object  # SamplingParams
    rng: random.Random
    base: int
    eos_at: int | None
    unicode_ids: list[int] | None
    cached_tokens: int = 0
    out: list[int] = field(default_factory=list)


class FakeScheduler:
    def __init__(self, args, ipc: IpcPaths, tokenizer, config: dict):
        self.tok = tokenizer
        self.ctx = zmq.Context()
        self.pull = bind_pull(self.ctx, ipc.scheduler_input)
        self.to_detok = connect_push(self.ctx, ipc.detokenizer_input)
        self.to_http = connect_push(self.ctx, ipc.http_input)
        self.kv_total = args.max_total_tokens or 16384
        self.max_running = args.max_running_requests or 64
        self.context_len = args.context_length or int(config.get("max_position_embeddings", 2048))
        eos = config.get("eos_token_id", tokenizer.eos_token_id)
        self.eos_ids = list(eos) if isinstance(eos, list) else [eos]
        self.vocab_size = int(config.get("vocab_size", len(tokenizer)))
        self.words = self._word_tokens()
        self.waiting: deque[_Req] = deque()
        self.running: list[_Req] = []
        self.aborted: list[tuple[str, int, int, int]] = []
        self.cache: list[tuple[int, ...]] = []
        self.path_counts = {"decode_graph": 0, "decode_eager": 0, "extend_graph": 0, "extend_eager": 0}
        self.num_finished = 0
        self.prompt_tokens_seen = 0
        self.cached_tokens_seen = 0

    def info(self, args) -> dict:
        return {"model_path": args.model_path, "context_len": self.context_len, "num_kv_slots": self.kv_total,
                "max_running_requests": self.max_running, "device": args.device, "dtype": "float32",
                "kv_cache_dtype": "float32",
                "attention_backend": "fake", "vocab_size": self.vocab_size, "eos_token_ids": self.eos_ids,
                "cuda_graph_bs": [], "piecewise_cuda_graph_tokens": [], "capture_seconds": 0.0,
                "capture_gib": 0.0}

    def _word_tokens(self) -> list[int]:
        special = set(self.tok.all_special_ids)
        words = []
        for i in range(min(self.vocab_size, len(self.tok))):
            if i in special:
                continue
            if re.fullmatch(r" [a-z]{2,8}", self.tok.decode([i])):
                words.append(i)
            if len(words) >= 512:
                break
        if len(words) < 16:  # a tiny tokenizer: anything printable
            words = [i for i in range(min(self.vocab_size, len(self.tok))) if i not in special
                     and self.tok.decode([i]).isprintable() and "\ufffd" not in self.tok.decode([i])]
        return words

    # ---- messages ---------------------------------------------------------------------------------

    def _handle(self, msg) -> None:
        if isinstance(msg, TokenizedGenerateReq):
            p = msg.params
            text = self.tok.decode(msg.input_ids)
            m = re.search(r"\[eos (\d+)\]", text)
            rng = random.Random(p.seed) if p.seed is not None else random.Random()
            base = sum((j + 1) * t for j, t in enumerate(msg.input_ids)) % 1_000_003
            uni = self.tok.encode(UNICODE_TEXT, add_special_tokens=False) if "[unicode]" in text else None
            self.waiting.append(_Req(msg.rid, list(msg.input_ids), p, rng, base,
                                     int(m.group(1)) if m else None, uni))
        elif isinstance(msg, AbortReq):
            for queue in (self.waiting, self.running):
                for r in list(queue):
                    if r.rid == msg.rid:
                        queue.remove(r)
                        self.aborted.append((r.rid, len(r.input_ids), len(r.out), r.cached_tokens))
        elif isinstance(msg, FlushCacheReq):
            self.cache.clear()
            self.to_http.send_pyobj(ControlReply(rid=msg.rid, ok=True, data={}))
        elif isinstance(msg, GetStatsReq):
            self.to_http.send_pyobj(ControlReply(rid=msg.rid, ok=True, data=self.stats()))

    def stats(self) -> dict:
        used = self._kv_used()
        cached = min(sum(len(p) for p in self.cache), self.kv_total - used)
        return {"num_running": len(self.running), "num_waiting": len(self.waiting), "kv_total": self.kv_total,
                "kv_free": self.kv_total - used - cached, "kv_cached": cached, "kv_used": used,
                "cache_hit_rate": self.cached_tokens_seen / max(1, self.prompt_tokens_seen),
                "path_counts": dict(self.path_counts), "num_finished": self.num_finished}

    def _kv_used(self) -> int:
        return sum(len(r.input_ids) + len(r.out) for r in self.running)

    # ---- generation -------------------------------------------------------------------------------

    def _admit(self) -> bool:
        admitted = False
        while self.waiting and len(self.running) < self.max_running:
            r = self.waiting[0]
            if self._kv_used() + len(r.input_ids) + r.params.max_new_tokens > self.kv_total:
                break
            self.waiting.popleft()
            best = 0
            for p in self.cache:
                k = 0
                for a, b in zip(p, r.input_ids):
                    if a != b:
                        break
                    k += 1
                best = max(best, k)
            r.cached_tokens = min(best, len(r.input_ids) - 1)
            self.prompt_tokens_seen += len(r.input_ids)
            self.cached_tokens_seen += r.cached_tokens
            self.cache = [p for p in self.cache if p != tuple(r.input_ids)][-63:] + [tuple(r.input_ids)]
            self.running.append(r)
            admitted = True
        return admitted

    def _next_token(self, r: _Req) -> int:
        i = len(r.out)
        p = r.params
        if r.eos_at is not None and i == r.eos_at:
            return self.eos_ids[0]
        forced = [t for t, bias in p.logit_bias if bias >= 100]
        if forced:
            return min(forced)
        if r.unicode_ids:
            return r.unicode_ids[i % len(r.unicode_ids)]
        if p.is_greedy:
            return self.words[(r.base + 31 * i + i * i) % len(self.words)]
        return self.words[r.rng.randrange(len(self.words))]

    def _finish_reason(self, r: _Req, token: int) -> FinishReason | None:
        p = r.params
        n = len(r.out)
        if n >= p.min_new_tokens:
            if token in p.stop_token_ids:
                return FinishReason("stop", matched=token)
            if token in self.eos_ids and not p.ignore_eos:
                return FinishReason("stop", matched=token)
            if p.stop:
                text = self.tok.decode(r.out, skip_special_tokens=True)
                for s in p.stop:
                    if s in text:
                        return FinishReason("stop", matched=s)
        if n >= p.max_new_tokens:
            return FinishReason("length")
        return None

    def _logprobs(self, r: _Req, token: int) -> TokenLogprob:
        i = len(r.out)
        lp = -0.1 - 0.01 * (i % 7)
        k = r.params.top_logprobs or 0
        top = [(token, lp)] + [(self.words[(r.base + 7 * j + i) % len(self.words)], lp - 0.5 * (j + 1))
                               for j in range(max(0, k - 1))]
        return TokenLogprob(token_id=token, logprob=lp, top=top[:k])

    def step(self) -> None:
        admitted = self._admit()
        if not self.running and not self.aborted:
            return
        self.path_counts["extend_eager" if admitted else "decode_eager"] += 1
        out = BatchTokenOut(rids=[], new_token_ids=[], finished=[], prompt_tokens=[], completion_tokens=[],
                            cached_tokens=[], logprobs=[], decode_options=[])
        for rid, prompt_len, num_out, cached in self.aborted:
            out.rids.append(rid)
            out.new_token_ids.append([])
            out.finished.append(FinishReason("abort", message="aborted"))
            out.prompt_tokens.append(prompt_len)
            out.completion_tokens.append(num_out)
            out.cached_tokens.append(cached)
            out.logprobs.append(None)
            out.decode_options.append(None)
        self.aborted.clear()
        for r in list(self.running):
            token = self._next_token(r)
            lp = self._logprobs(r, token) if r.params.top_logprobs is not None else None
            r.out.append(token)
            finish = self._finish_reason(r, token)
            out.rids.append(r.rid)
            out.new_token_ids.append([token])
            out.finished.append(finish)
            out.prompt_tokens.append(len(r.input_ids))
            out.completion_tokens.append(len(r.out))
            out.cached_tokens.append(r.cached_tokens)
            out.logprobs.append([lp] if lp is not None else None)
            out.decode_options.append(r.params.decode_options if len(r.out) == 1 else None)
            if finish is not None:
                self.running.remove(r)
                self.num_finished += 1
        self.to_detok.send_pyobj(out)

    def loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self.pull, zmq.POLLIN)
        while True:
            busy = bool(self.running or self.waiting or self.aborted)
            events = dict(poller.poll(0 if busy else 50))
            while self.pull in events:
                self._handle(self.pull.recv_pyobj())
                events = dict(poller.poll(0))
            if self.running or self.waiting or self.aborted:
                self.step()
                time.sleep(STEP_S)


def run_fake_scheduler_process(args, ipc: IpcPaths, ready_conn) -> None:
    try:
        from server.detokenizer import load_tokenizer

        tokenizer = load_tokenizer(args.model_path)
        config = json.loads((Path(args.model_path) / "config.json").read_text())
        if os.environ.get("DUET_FAKE_FAIL_STARTUP"):
            raise RuntimeError("fake start-up failure requested by DUET_FAKE_FAIL_STARTUP")
        sched = FakeScheduler(args, ipc, tokenizer, config)
    except Exception as e:  # noqa: BLE001 - reported as one line
        ready_conn.send({"ok": False, "error": f"{type(e).__name__}: {e}".splitlines()[0]})
        return
    ready_conn.send({"ok": True, "info": sched.info(args)})
    ready_conn.close()
    sched.loop()


# =================================================================================================
# Helpers for the server tests (tests/server/): a model folder and a live server process.
# =================================================================================================

REPO_ROOT = Path(__file__).resolve().parent.parent

SMOLLM_CHAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful assistant<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def build_tiny_model_folder(path: Path, with_weights: bool = False) -> Path:
    """A byte-level BPE tokenizer (320 ids, like tests/conftest.py's TINY_LLAMA) plus config.json, and
    random weights if asked (for the real scheduler). Built offline in about a second."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    path.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    corpus = ["the quick brown fox jumps over the lazy dog and then the cat sat on the mat " * 4,
              "hello world, this is a small test corpus for the tokenizer of the duet server tests",
              "once upon a time there was a model that served text to many clients at once"] * 20
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                   unk_token="<|endoftext|>", pad_token="<|im_end|>")
    fast.chat_template = SMOLLM_CHAT_TEMPLATE
    fast.save_pretrained(path)
    if with_weights:
        from tests.conftest import TINY_LLAMA, save_tiny_hf_model

        save_tiny_hf_model(path, dict(TINY_LLAMA, max_position_embeddings=1024))
    else:
        cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 320,
               "max_position_embeddings": 1024, "bos_token_id": 1, "eos_token_id": 2}
        (path / "config.json").write_text(json.dumps(cfg))
    return path


def server_model_dir() -> Path:
    """The model folder the server tests use.

    ``DUET_TEST_MODEL_PATH`` if set; ``DUET_TEST_MODEL=tiny`` for a tiny tokenizer with random weights
    (fast with the real scheduler); else the default model (its real tokenizer), falling back to the tiny
    folder when the default model cannot be fetched.
    """
    if os.environ.get("DUET_TEST_MODEL_PATH"):
        return Path(os.environ["DUET_TEST_MODEL_PATH"])
    if os.environ.get("DUET_TEST_MODEL") != "tiny":
        try:
            from model_executor.default_model import ensure_default_model

            return ensure_default_model()
        except Exception as e:  # noqa: BLE001 - offline or not written yet: use the tiny folder
            print(f"default model unavailable ({e}); using a tiny tokenizer", file=sys.stderr)
    return tiny_model_dir()


def tiny_model_dir() -> Path:
    """A tiny tokenizer with random weights, built once per machine: the real scheduler starts on it in
    seconds."""
    tiny = Path(tempfile.gettempdir()) / f"duet-test-tiny-model-{os.getuid()}"
    if not (tiny / ".complete").is_file():
        tmp = Path(tempfile.mkdtemp(prefix="duet-test-tiny-"))
        build_tiny_model_folder(tmp / "m", with_weights=True)
        (tmp / "m" / ".complete").write_text("ok\n")
        try:
            os.replace(tmp / "m", tiny)
        except OSError:
            pass  # another test process won
        shutil.rmtree(tmp, ignore_errors=True)
    return tiny


def use_real_scheduler() -> bool:
    """``DUET_TEST_REAL_SCHEDULER=1`` runs the server tests against the real scheduler
    (server/scheduler_entry.py, scheduler/scheduler_process.py)."""
    return os.environ.get("DUET_TEST_REAL_SCHEDULER", "") not in ("", "0")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """The server on 127.0.0.1: `python -m tests.fake_server` (the launcher with the fake scheduler), or
    `python -m server.launch_server` when the real scheduler is asked (fake=False or DUET_TEST_REAL_SCHEDULER).
    own_group: start it in a process group of its own, so that a test can signal the whole group as a
    terminal or a container runtime would (otherwise it stays in the test's group, which Ctrl-C reaches).
    quick_start: no --model-path, as the README's quick start (the default model from $DUET_CACHE_DIR, with
    its default format)."""

    def __init__(self, *extra_args: str, model_dir: Path | None = None, env: dict | None = None,
                 fake: bool | None = None, own_group: bool = False, test_scheduler: str | None = None,
                 quick_start: bool = False):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.model_dir = None if quick_start else model_dir or server_model_dir()
        fake = fake if fake is not None else not use_real_scheduler()
        # test_scheduler (MODULE:FUNCTION): a scheduler process of a test's own instead of the fake one.
        if test_scheduler is not None:
            launcher = ["tests.fake_server", "--test-scheduler", test_scheduler]
        else:
            launcher = ["tests.fake_server" if fake else "server.launch_server"]
        model = [] if quick_start else ["--model-path", str(self.model_dir)]
        cmd = [sys.executable, "-m", *launcher, "--host", "127.0.0.1", "--port", str(self.port), *model,
               "--device", "cpu", "--log-level", "warning", *extra_args]
        full_env = dict(os.environ, TOKENIZERS_PARALLELISM="false", **(env or {}))
        fd, self.log_path = tempfile.mkstemp(prefix="duet-server-", suffix=".log")
        atexit.register(Path(self.log_path).unlink, missing_ok=True)
        with os.fdopen(fd, "wb") as log:
            self.proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=full_env, stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=own_group)

    def output(self) -> str:
        return Path(self.log_path).read_text(errors="replace")

    def wait_healthy(self, timeout: float = 120.0) -> ServerProcess:
        import httpx

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.output()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1.0).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"server not healthy after {timeout} s:\n{self.output()}")

    def stop(self, timeout: float = 20.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        return self.proc.returncode


def child_pids(pid: int) -> list[int]:
    """Direct children of pid, from /proc (psutil is not a dependency)."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(entry.name))
    return out


def pid_alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"

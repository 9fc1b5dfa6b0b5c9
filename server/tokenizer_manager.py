"""TokenizerManager: the HTTP process's side of the engine.

It owns the tokenizer (chat template, prompt encoding, token strings for logprobs), the prompt-length
checks, and the life of every scheduler request issued by the HTTP routes: sending it, routing the
detokenizer's text deltas back to the waiting coroutine, trimming stop strings, aborting on client
disconnect, and failing everything when the scheduler or detokenizer process dies.

Stop strings: the scheduler ends a request when a stop string appears in its output, but the text the
client sees is built here, from the detokenizer's deltas. Each request keeps its accumulated text; a
stop string found in it ends the request (cut before the string, or after it with
include_stop_str_in_output; the scheduler is told to abort if it has not finished yet), and while streaming the last (longest stop - 1) characters are held back so that
no prefix of a stop string is ever sent. The non-streaming response is the concatenation of the same
chunks, so streamed and non-streamed text are equal by construction.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import re
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path

import zmq
import zmq.asyncio

from model_executor.sampling_params import SamplingParams
from scheduler.io_struct import (
    AbortReq,
    BatchStrOut,
    ControlReply,
    FinishReason,
    ImageInput,
    PoolingSpec,
    PromptLogprobs,
    SpecCounts,
    TokenizedGenerateReq,
    TokenLogprob,
)
from scheduler.ipc import IpcPaths, bind_pull, connect_push
from server.dp_router import DpRouter, merge_stats
from server.metrics import ServerMetrics
from server.multimodal import ImageProcessor, ImageRef
from server.protocol import ApiError

logger = logging.getLogger("duet.tokenizer_manager")

LIVENESS_POLL_S = 0.5
CONTROL_TIMEOUT_S = 10.0
# Texts longer than this are tokenized in a worker thread: the Rust tokenizer releases the GIL, so a
# megabytes-long prompt (seconds of work) no longer stalls every other stream on the event loop.
THREAD_TOKENIZE_CHARS = 32 * 1024
# Engine messages read in one wake-up of the read loop at most, so that a flood cannot starve the streams.
MAX_MESSAGES_PER_WAKE = 256


# apply_chat_template arguments that chat_template_kwargs must not replace.
_RESERVED_TEMPLATE_KWARGS = {"conversation", "messages", "tools", "tokenize", "chat_template", "return_dict",
                             "return_tensors", "add_generation_prompt", "continue_final_message",
                             "tokenizer_kwargs"}


def load_chat_template(value: str) -> str:
    """--chat-template: a file's text, or the template itself when no such file exists."""
    path = Path(value).expanduser()
    if path.is_file():
        return path.read_text()
    return value


@dataclass
class GenRequest:
    """One scheduler request: a prompt and its sampling parameters (one per choice). constraint_param: the
    request field its output constraint came from, which the 400 of a constraint that cannot be met names."""

    input_ids: list[int]
    params: SamplingParams
    constraint_param: str | None = None
    pooling: PoolingSpec | None = None  # a pooling request: its finishing chunk carries the vector
    lora_name: str | None = None  # the LoRA adapter it runs with (None: the base model)
    images: list[ImageInput] | None = None  # a multimodal prompt's images (their pad tokens are in input_ids)


@dataclass
class GenChunk:
    """What a route receives per step and request: the text to send now plus token data."""

    index: int  # position of the request in the list given to generate()
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None
    finish: FinishReason | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    prompt_logprobs: PromptLogprobs | None = None  # with the first output tokens, when asked for
    embedding: object | None = None  # a pooling request's vector (float32 numpy array), with its finish
    spec_counts: SpecCounts | None = None  # with speculative decoding on: the request's counts so far


@dataclass
class _Fragment:
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None
    finish: FinishReason | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    prompt_logprobs: PromptLogprobs | None = None
    embedding: object | None = None
    spec_counts: SpecCounts | None = None


    def merged(self, later: _Fragment) -> _Fragment:
        """This fragment followed by `later` (same request) as one: the texts, tokens and logprobs joined,
        the counts and finish of the later one."""
        logprobs = None if self.logprobs is None and later.logprobs is None else \
            [*(self.logprobs or []), *(later.logprobs or [])]
        # Prompt logprobs come with a request's first output only: the earlier fragment's, if any.
        return _Fragment(self.text + later.text, self.token_ids + later.token_ids, logprobs, later.finish,
                         later.prompt_tokens, later.completion_tokens, later.cached_tokens,
                         self.prompt_logprobs if self.prompt_logprobs is not None else later.prompt_logprobs,
                         later.embedding,
                         later.spec_counts if later.spec_counts is not None else self.spec_counts)


def _coalesce(items: list[tuple]) -> list[tuple]:
    """Queued (state, item) pairs with each request's consecutive fragments joined into one, in order.

    When the HTTP process falls behind the engine (many streams, a fast model), a stream's fragments pile
    up in its queue; one chunk for all of them costs one response event instead of one per token, as
    SGLang and vLLM stream. A fragment that finishes its request is never joined with a later item."""
    out: list[tuple] = []
    last: dict[int, int] = {}  # id(state) -> index in out of its fragment that may still grow
    for st, item in items:
        i = last.get(id(st))
        if isinstance(item, _Fragment) and i is not None:
            out[i] = (st, out[i][1].merged(item))
        else:
            out.append((st, item))
            i = len(out) - 1
        if isinstance(item, _Fragment) and item.finish is None:
            last[id(st)] = i
        else:
            last.pop(id(st), None)
    return out


class _Inbox:
    """The (state, item) pairs the read loop hands one generate() call, taken all at once.

    It is filled once per request per engine step: a list and a future to wake the consumer cost much less
    than asyncio.Queue's bookkeeping (its unfinished-task count and Event on every put)."""

    __slots__ = ("_items", "_waiter")

    def __init__(self) -> None:
        self._items: list = []
        self._waiter: asyncio.Future | None = None

    def put_nowait(self, item) -> None:
        self._items.append(item)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def get_all(self) -> list:
        """Everything put since the last call, in order; waits while there is nothing."""
        while not self._items:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        items, self._items = self._items, []
        return items


_FATAL = object()  # queued to every request when the engine died
_ZERO_TOKENS = object()  # queued for max_tokens == 0: finished without asking the scheduler


@dataclass
class _ReqState:
    rid: str
    index: int
    params: SamplingParams
    queue: _Inbox
    prompt_tokens: int
    created: float
    text: str = ""
    sent: int = 0  # characters of text already handed out
    search_from: int = 0  # where the next stop-string search starts
    completion_tokens: int = 0
    cached_tokens: int = 0
    replica: int | None = None  # the data-parallel replica serving it (None: not sent)
    prompt_only: bool = False  # max_tokens 0 with prompt logprobs: one token is generated and dropped
    constraint_param: str | None = None  # (GenRequest's)
    first_token_at: float | None = None
    last_token_at: float | None = None
    done: bool = False
    max_stop_len: int = field(init=False)

    def __post_init__(self):
        self.max_stop_len = max((len(s) for s in self.params.stop), default=0)


def _params_text(params: SamplingParams) -> str:
    """The sampling parameters that differ from the defaults, e.g. `max_new_tokens=8 temperature=0.0`."""
    default = SamplingParams()
    return " ".join(f"{f.name}={getattr(params, f.name)!r}" for f in dataclasses.fields(params)
                    if getattr(params, f.name) != getattr(default, f.name)) or "defaults"


def _find_first_stop(text: str, stops: tuple[str, ...], start: int) -> tuple[int, str] | None:
    best = None
    for s in stops:
        pos = text.find(s, start)
        if pos >= 0 and (best is None or pos < best[0]):
            best = (pos, s)
    return best


@functools.lru_cache(maxsize=1)
def _byte_level_decoder() -> dict[str, int]:
    """GPT-2's bytes_to_unicode, inverted: byte-level BPE token characters -> raw bytes."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


class TokenizerManager:
    def __init__(self, tokenizer, ipc: IpcPaths, info: dict, metrics: ServerMetrics,
                 processes: dict | None = None, on_fatal: Callable[[str], None] | None = None,
                 heartbeats: dict | None = None, watchdog_timeout: float = 0.0,
                 log_requests: bool = False, router: DpRouter | None = None, chat_template: str | None = None):
        self.tokenizer = tokenizer
        self.chat_template = chat_template  # --chat-template (its text); None: the tokenizer's
        # A vision-language model's image processor (server/multimodal.py); None: a text-only model.
        self.images: ImageProcessor | None = None
        self.log_requests = log_requests  # --log-requests: one INFO line at arrival and one at the end
        self.router = router  # --dp-size > 1: picks each request's replica
        self._replica_pushes: dict = {}  # replicas 1 and up; replica 0's socket is _push
        self.ipc = ipc
        self.info = info
        self.metrics = metrics
        self.processes = processes or {}  # name -> multiprocessing Process, watched for liveness
        # name -> shared double: the rank's last finished loop iteration (time.monotonic()); 0: not yet
        self.heartbeats = heartbeats or {}
        self.watchdog_timeout = watchdog_timeout
        self.on_fatal = on_fatal
        self.context_len = int(info["context_len"])
        self.num_kv_slots = int(info["num_kv_slots"])
        self.vocab_size = int(info.get("vocab_size") or len(tokenizer))
        self.healthy = True
        self.fatal_error: str | None = None
        self.accepting = True  # False once the server is stopping (SIGTERM): new requests get a 503
        self._reqs: dict[str, _ReqState] = {}
        self._controls: dict[str, asyncio.Future] = {}
        self._tasks: list[asyncio.Task] = []
        self._ctx: zmq.asyncio.Context | None = None
        self._next_id = 0
        try:
            self._byte_level = type(tokenizer.backend_tokenizer.decoder).__name__ == "ByteLevel"
        except AttributeError:
            self._byte_level = False

    # ---- lifecycle ----------------------------------------------------------------------------

    async def start(self) -> None:
        self._ctx = zmq.asyncio.Context()
        self._pull = bind_pull(self._ctx, self.ipc.http_input)
        # The same socket, blocking API: drains what else is queued without a trip through the event loop.
        self._pull_now = zmq.Socket.shadow(self._pull.underlying)
        self._push = connect_push(self._ctx, self.ipc.scheduler_input)
        for d in range(1, self.router.size if self.router else 1):
            self._replica_pushes[d] = connect_push(self._ctx, self.ipc.scheduler_input_of(d))
        self._tasks = [asyncio.create_task(self._read_loop(), name="duet-read-outputs"),
                       asyncio.create_task(self._watch_loop(), name="duet-liveness")]

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):  # shutting down anyway
                await t
        self._tasks = []
        if self._ctx is not None:
            self._ctx.destroy(linger=0)
            self._ctx = None

    @property
    def num_inflight(self) -> int:
        return len(self._reqs)

    def check_alive(self) -> None:
        if not self.healthy:
            raise ApiError(503, self.fatal_error or "the server is shutting down")
        if not self.accepting:
            raise ApiError(503, "the server is shutting down")

    # ---- tokenization and validation ------------------------------------------------------------

    def encode_prompt(self, text: str) -> list[int]:
        """A completions prompt: encoded with the tokenizer's special tokens (BOS where it adds one)."""
        return self.tokenizer.encode(text)

    def encode_chat(self, messages: list[dict], tools: list[dict] | None = None,
                    template_kwargs: dict | None = None, add_generation_prompt: bool = True,
                    continue_final_message: bool = False) -> list[int]:
        text = self.render_chat(messages, tools, template_kwargs, add_generation_prompt, continue_final_message)
        return self.tokenizer.encode(text, add_special_tokens=False)

    def encode_chat_images(self, messages: list[dict], images: list[ImageRef],
                           **kwargs) -> tuple[list[int], list[ImageInput]]:
        """encode_chat for messages with image parts ({"type": "image"}, in the order of `images`): the prompt
        with each image's pad tokens, and the images processed (blocking: fetches, decodes, resizes)."""
        if self.images is None:
            raise ApiError(400, "image content needs a vision-language model; this model is text-only",
                           images[0].where)
        self.images.check_count(images)
        text = self.render_chat(messages, **kwargs)
        loaded = self.images.load_images(images)
        return self.images.expand(text, loaded, lambda t: self.tokenizer.encode(t, add_special_tokens=False))

    def render_chat(self, messages: list[dict], tools: list[dict] | None = None,
                    template_kwargs: dict | None = None, add_generation_prompt: bool = True,
                    continue_final_message: bool = False) -> str:
        """Render the chat template as text, then encode it without adding special tokens again: the
        template already writes BOS where the model wants one (vLLM and SGLang do the same).

        tools: the functions' definitions, passed to the template as `tools` (OpenAI's function objects
        wrapped as {"type": "function", "function": ...}, the shape HF templates expect).
        continue_final_message: the last message is left open (no end-of-turn after it), for the model to
        continue it."""
        template = self.chat_template or getattr(self.tokenizer, "chat_template", None)
        if not template:
            raise ApiError(400, "this model has no chat template; use /v1/completions (or start the server "
                                "with --chat-template)", "messages")
        extra = dict(template_kwargs or {})
        reserved = sorted(set(extra) & _RESERVED_TEMPLATE_KWARGS)
        if reserved:
            raise ApiError(400, f"chat_template_kwargs may not set {', '.join(reserved)}", "chat_template_kwargs")
        if tools:
            extra["tools"] = [{"type": "function", "function": t} for t in tools]
        try:
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                      continue_final_message=continue_final_message,
                                                      tokenize=False, chat_template=template, **extra)
        except Exception as e:
            raise ApiError(400, f"the chat template rejected the messages: {e}", "messages") from e
        return text

    async def encode_prompts_async(self, texts: list[str]) -> list[list[int]]:
        """encode_prompt for each text; off the event loop when they are long (see THREAD_TOKENIZE_CHARS)."""
        if sum(len(t) for t in texts) < THREAD_TOKENIZE_CHARS:
            return [self.encode_prompt(t) for t in texts]
        return await asyncio.to_thread(lambda: [self.encode_prompt(t) for t in texts])

    async def encode_chat_async(self, messages: list[dict], **kwargs) -> list[int]:
        if sum(len(m["content"]) if isinstance(m.get("content"), str) else 0 for m in messages) < THREAD_TOKENIZE_CHARS:
            return self.encode_chat(messages, **kwargs)
        return await asyncio.to_thread(functools.partial(self.encode_chat, messages, **kwargs))

    def check_token_ids(self, ids: list[int], param: str) -> None:
        bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise ApiError(400, f"{param}: token id {bad} is out of range [0, {self.vocab_size})", param)

    @property
    def max_total_len(self) -> int:
        """The most tokens (prompt + output) one request may need."""
        return min(self.context_len, self.num_kv_slots)

    def default_max_tokens(self, prompt_len: int, prompt_param: str) -> int:
        """Chat's default: run to the context limit."""
        self.check_prompt_len(prompt_len, prompt_param)
        return self.max_total_len - prompt_len

    def check_prompt_len(self, prompt_len: int, prompt_param: str) -> None:
        if prompt_len == 0:
            raise ApiError(400, f"the {prompt_param} is empty", prompt_param)
        if prompt_len >= self.max_total_len:
            raise ApiError(400, f"{self._limit_text()} However, your {prompt_param} has {prompt_len} tokens, "
                                "which leaves no room for the completion. Please shorten it.", prompt_param)

    def check_length(self, prompt_len: int, max_new_tokens: int, prompt_param: str, max_param: str) -> None:
        self.check_prompt_len(prompt_len, prompt_param)
        total = prompt_len + max_new_tokens
        if total > self.max_total_len:
            raise ApiError(400, f"{self._limit_text()} However, you requested {total} tokens ({prompt_len} in "
                                f"the {prompt_param}, {max_new_tokens} for the completion). Please reduce the "
                                f"length of the {prompt_param} or {max_param}.", max_param)

    def _limit_text(self) -> str:
        if self.context_len <= self.num_kv_slots:
            return f"This model's maximum context length is {self.context_len} tokens."
        return f"This server's KV cache holds {self.num_kv_slots} tokens, the most one request can use."

    # ---- token strings (logprobs) ---------------------------------------------------------------

    @functools.lru_cache(maxsize=65536)  # noqa: B019 - one manager per process, lives as long
    def token_bytes(self, token_id: int) -> bytes:
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        if isinstance(piece, str):
            if self._byte_level:
                dec = _byte_level_decoder()
                if all(c in dec for c in piece):
                    return bytes(dec[c] for c in piece)
            m = _BYTE_TOKEN.fullmatch(piece)
            if m:
                return bytes([int(m.group(1), 16)])
        return self.tokenizer.decode([token_id], skip_special_tokens=False).encode()

    @functools.lru_cache(maxsize=65536)  # noqa: B019
    def token_str(self, token_id: int) -> str:
        """A token's text for logprob listings; `bytes:\\xNN...` when it is not whole UTF-8 (OpenAI's way)."""
        text = self.tokenizer.decode([token_id], skip_special_tokens=False)
        if "\ufffd" in text:
            raw = self.token_bytes(token_id)
            try:
                return raw.decode("utf-8")
            except UnicodeDecodeError:
                return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
        return text

    # ---- generation ---------------------------------------------------------------------------

    def new_rid(self, prefix: str) -> str:
        self._next_id += 1
        return f"{prefix}{self._next_id}"

    async def generate(self, reqs: list[GenRequest], rid: str) -> AsyncIterator[GenChunk]:
        """Run the requests (the choices of one HTTP request) and yield their chunks as they arrive.

        Exactly one chunk per request carries `finish`. Leaving the iteration early (client disconnect,
        error, cancellation) aborts the requests still running. A dead engine raises ApiError(503).
        """
        self.check_alive()
        queue = _Inbox()
        now = time.monotonic()
        states = [_ReqState(rid=f"{rid}-{i}", index=i, params=r.params, queue=queue,
                            prompt_tokens=len(r.input_ids), created=now, constraint_param=r.constraint_param)
                  for i, r in enumerate(reqs)]
        outcome = "abort"
        if self.log_requests:
            for st in states:
                logger.info("request %s: prompt_tokens=%d params=%s", st.rid, st.prompt_tokens,
                            _params_text(st.params))
        try:
            for st, r in zip(states, reqs):
                params = r.params
                if params.max_new_tokens == 0 and r.pooling is None:
                    if params.prompt_logprob_start is None:
                        queue.put_nowait((st, _ZERO_TOKENS))
                        continue
                    # Scoring a prompt (echo with max_tokens 0, SGLang's max_new_tokens 0): the scheduler
                    # prefills it for one token, which the client never sees (vLLM does the same).
                    st.prompt_only = True
                    params = dataclasses.replace(params, max_new_tokens=1, min_new_tokens=0, stop=(),
                                                 grammar=None)
                self._reqs[st.rid] = st
                st.replica = self.router.choose(r.input_ids) if self.router else 0
                await self._socket(st.replica).send_pyobj(TokenizedGenerateReq(rid=st.rid, input_ids=r.input_ids,
                                                                               params=params, pooling=r.pooling,
                                                                               lora_name=r.lora_name,
                                                                               images=r.images))
            remaining = len(states)
            while remaining:
                items = await queue.get_all()
                for st, item in _coalesce(items) if len(items) > 1 else items:
                    if st.done:
                        continue
                    chunk = self._apply(st, item)
                    if chunk is None:
                        continue
                    if chunk.finish is not None:
                        remaining -= 1
                        self._finish(st, chunk.finish)
                    yield chunk
        except ApiError:
            outcome = "error"
            raise
        finally:
            for st in states:
                if not st.done:
                    st.done = True
                    if self._reqs.pop(st.rid, None) is not None and self.healthy:
                        self._send_nowait(AbortReq(rid=st.rid), st.replica)
                    self._release(st)
                    self._observe(st, outcome)

    async def pool(self, reqs: list[GenRequest], rid: str) -> list[GenChunk]:
        """Run pooling requests (each GenRequest with its PoolingSpec) to the end; their finishing chunks, in
        order, each with its vector."""
        done: list[GenChunk | None] = [None] * len(reqs)
        async for chunk in self.generate(reqs, rid):
            if chunk.finish is not None:
                if chunk.embedding is None:  # aborted (the server is stopping)
                    raise ApiError(503, f"the request was not completed: {chunk.finish.message or 'aborted'}")
                done[chunk.index] = chunk
        return done

    def _apply(self, st: _ReqState, item) -> GenChunk | None:
        if item is _FATAL:
            raise ApiError(503, self.fatal_error or "the engine stopped")
        if item is _ZERO_TOKENS:
            return GenChunk(st.index, "", [], None, FinishReason("length"), st.prompt_tokens, 0, 0)
        frag: _Fragment = item
        if st.prompt_only:
            finish = frag.finish
            if finish is not None and finish.kind in ("stop", "length"):
                finish = FinishReason("length")
            frag = dataclasses.replace(frag, text="", token_ids=[], logprobs=None, completion_tokens=0,
                                       finish=finish)
        now = time.monotonic()
        if frag.token_ids:
            if st.first_token_at is None:
                st.first_token_at = now
                self.metrics.ttft.observe(now - st.created)
            elif st.last_token_at is not None:
                self.metrics.itl.observe((now - st.last_token_at) / len(frag.token_ids))
            st.last_token_at = now
        st.prompt_tokens = frag.prompt_tokens or st.prompt_tokens
        st.completion_tokens = frag.completion_tokens
        st.cached_tokens = frag.cached_tokens
        finish = frag.finish
        if finish is not None and finish.kind == "error":
            raise ApiError(500, f"generation failed: {finish.message or 'internal error'}",
                           type="InternalServerError")
        if finish is not None and finish.kind == "invalid":
            raise ApiError(400, finish.message or "the request cannot be completed as asked", st.constraint_param)
        st.text += frag.text
        stops = st.params.stop
        if stops:
            found = None
            if st.completion_tokens >= st.params.min_new_tokens:
                found = _find_first_stop(st.text, stops, st.search_from)
            if found is None and finish is not None and finish.kind == "stop" and isinstance(finish.matched, str):
                pos = st.text.rfind(finish.matched)  # the scheduler's match ends the text: the last one
                found = (pos, finish.matched) if pos >= 0 else None
            if found is not None:
                pos, matched = found
                end = pos + len(matched) if st.params.include_stop_str_in_output else pos
                st.text = st.text[:max(end, st.sent)]
                if finish is None or finish.kind != "stop":
                    if finish is None and self._reqs.pop(st.rid, None) is not None and self.healthy:
                        self._send_nowait(AbortReq(rid=st.rid), st.replica)  # we saw it first; stop it
                    finish = FinishReason("stop", matched=matched)
            else:
                st.search_from = max(0, len(st.text) - st.max_stop_len + 1)
        if finish is not None or not stops:
            end = len(st.text)
        else:
            end = max(st.sent, len(st.text) - (st.max_stop_len - 1))
        text = st.text[st.sent:end]
        st.sent = end
        if not text and not frag.token_ids and finish is None and frag.prompt_logprobs is None:
            return None
        return GenChunk(st.index, text, frag.token_ids, frag.logprobs, finish, st.prompt_tokens,
                        st.completion_tokens, st.cached_tokens, frag.prompt_logprobs, frag.embedding,
                        frag.spec_counts)

    def _finish(self, st: _ReqState, finish: FinishReason) -> None:
        st.done = True
        self._reqs.pop(st.rid, None)
        self._release(st)
        self._observe(st, finish.kind)

    def _observe(self, st: _ReqState, outcome: str) -> None:
        ttft = None if st.first_token_at is None else st.first_token_at - st.created
        e2e = time.monotonic() - st.created
        self.metrics.observe_finished(outcome, st.prompt_tokens, st.completion_tokens, e2e, ttft)
        if self.log_requests:
            logger.info("finished %s: finish_reason=%s prompt_tokens=%d completion_tokens=%d cached_tokens=%d "
                        "e2e=%.3fs", st.rid, outcome, st.prompt_tokens, st.completion_tokens, st.cached_tokens, e2e)

    def _release(self, st: _ReqState) -> None:
        if self.router is not None and st.replica is not None:
            self.router.release(st.replica)
            st.replica = None

    def _socket(self, replica: int | None):
        return self._replica_pushes[replica] if replica else self._push

    def _send_nowait(self, obj, replica: int | None = 0) -> None:
        """Send without awaiting (usable in finally blocks of cancelled tasks); pyzmq completes the send
        at once unless the peer's queue is full, and then from the event loop."""
        try:
            self._socket(replica).send_pyobj(obj)
        except Exception:
            logger.debug("could not send %s", type(obj).__name__, exc_info=True)

    async def control(self, req_cls, timeout: float = CONTROL_TIMEOUT_S, **fields) -> ControlReply:
        """Send a FlushCacheReq/GetStatsReq and wait for the scheduler's ControlReply (every replica's,
        merged, under data parallelism)."""
        if self.router is None:
            return await self._control_one(req_cls, timeout, 0, **fields)
        replies = await asyncio.gather(*(self._control_one(req_cls, timeout, d, **fields)
                                         for d in range(self.router.size)))
        failed = next((r for r in replies if not r.ok), None)
        if failed is not None:
            return ControlReply(replies[0].rid, False, failed.data)
        data = merge_stats([r.data for r in replies])
        data["replicas"] = [dict(r.data, inflight=n, routed=m)
                            for r, n, m in zip(replies, self.router.inflight, self.router.routed)]
        return ControlReply(replies[0].rid, True, data)

    async def _control_one(self, req_cls, timeout: float, replica: int, **fields) -> ControlReply:
        self.check_alive()
        rid = self.new_rid("ctl-")
        fut = asyncio.get_running_loop().create_future()
        self._controls[rid] = fut
        try:
            await self._socket(replica).send_pyobj(req_cls(rid=rid, **fields))
            return await asyncio.wait_for(fut, timeout)
        except asyncio.TimeoutError:
            raise ApiError(503, f"the scheduler did not answer {req_cls.__name__} within {timeout:g} s") from None
        finally:
            self._controls.pop(rid, None)

    # ---- background tasks ---------------------------------------------------------------------

    async def _read_loop(self) -> None:
        while True:
            try:
                msgs = [await self._pull.recv_pyobj()]
            except asyncio.CancelledError:
                raise
            except Exception:
                logger.exception("cannot read a message from the engine")
                continue
            # Every message already queued is dispatched before any stream runs: a stream that fell behind
            # then finds all its new tokens at once and sends them as one event (see _coalesce), instead
            # of one event per engine step, each behind one more trip through the event loop.
            while len(msgs) < MAX_MESSAGES_PER_WAKE:
                try:
                    msgs.append(self._pull_now.recv_pyobj(zmq.NOBLOCK))
                except zmq.Again:
                    break
                except Exception:  # the next await reports a lasting fault; do not spin on it here
                    logger.exception("cannot read a message from the engine")
                    break
            for msg in msgs:
                self._handle_message(msg)

    def _handle_message(self, msg) -> None:
        if isinstance(msg, BatchStrOut):
            self._dispatch(msg)
        elif isinstance(msg, ControlReply):
            fut = self._controls.get(msg.rid)
            if fut is not None and not fut.done():
                fut.set_result(msg)
        else:
            logger.warning("ignoring unexpected message %s", type(msg).__name__)

    def _dispatch(self, out: BatchStrOut) -> None:
        for i, rid in enumerate(out.rids):
            st = self._reqs.get(rid)
            if st is None:  # aborted or already finished here
                continue
            st.queue.put_nowait((st, _Fragment(
                text=out.text_deltas[i], token_ids=out.new_token_ids[i],
                logprobs=out.logprobs[i] if out.logprobs else None, finish=out.finished[i],
                prompt_tokens=out.prompt_tokens[i], completion_tokens=out.completion_tokens[i],
                cached_tokens=out.cached_tokens[i],
                prompt_logprobs=out.prompt_logprobs[i] if out.prompt_logprobs else None,
                embedding=out.embeddings[i] if out.embeddings else None,
                spec_counts=out.spec_counts[i] if out.spec_counts else None)))

    async def _watch_loop(self) -> None:
        while self.healthy:
            await asyncio.sleep(LIVENESS_POLL_S)
            for name, proc in self.processes.items():
                if not proc.is_alive():
                    self.fail_all(f"the {name} process died (exit code {proc.exitcode}); "
                                  "the server is shutting down")
                    return
            hung = self._hung_rank()
            if hung is not None:
                self.fail_all(hung)
                return

    def _hung_rank(self) -> str | None:
        """The message for ranks whose loop has not finished an iteration for watchdog_timeout seconds, else
        None. When one rank hangs, its peers stop too, waiting for it in their next collective, so every
        stalled rank is named (the ages cannot tell the culprit: the ranks step in lock-step)."""
        if not self.watchdog_timeout:
            return None
        now = time.monotonic()
        ages = {name: now - hb.value for name, hb in self.heartbeats.items() if hb.value}
        stalled = sorted((name for name, age in ages.items() if age > self.watchdog_timeout), key=ages.get,
                         reverse=True)
        if not stalled:
            return None
        names = ", ".join(f"the {name} process ({ages[name]:.0f} s)" for name in stalled)
        return (f"tensor-parallel ranks stopped making progress: {names} finished no scheduler step for longer "
                f"than --watchdog-timeout {self.watchdog_timeout:g} s (one hung; its peers wait for it in a "
                "collective); the server is shutting down")

    def fail_all(self, message: str, fatal: bool = True) -> None:
        """Fail every in-flight request and control call with a 503 and turn /health to 503.

        fatal: the engine is gone (the server then exits 1); not fatal: the server is stopping (SIGTERM)
        and these requests did not finish within the drain time."""
        if not self.healthy:
            return
        (logger.error if fatal else logger.info)("%s", message)
        self.healthy = False
        self.fatal_error = message
        if fatal:
            self.metrics.set_scheduler_stats(None, scheduler_up=False)
        for st in list(self._reqs.values()):
            st.queue.put_nowait((st, _FATAL))
        self._reqs.clear()
        for fut in self._controls.values():
            if not fut.done():
                fut.set_exception(ApiError(503, message))
        if fatal and self.on_fatal is not None:
            self.on_fatal(message)

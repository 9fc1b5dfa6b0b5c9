"""What the serving modules share: the per-app context (tokenizer manager, defaults, model names), SSE
framing, a stream's start (its first chunk awaited before the 200), client-disconnect handling, usage over
choices and the logprob formatting of both OpenAI shapes."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from fastapi import Request
from fastapi.responses import Response

from model_executor.pooling_config import PoolingConfig
from scheduler.io_struct import PoolingSpec, PromptLogprobs, TokenLogprob
from server.args import ServerArgs
from server.chat_tools import ChatFormat
from server.protocol import ApiError
from server.tokenizer_manager import GenChunk, TokenizerManager

SSE_DONE = "data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


@dataclass
class ServingContext:
    tm: TokenizerManager
    args: ServerArgs
    sampling: dict  # --sampling-defaults resolved: what unset temperature/top_p/top_k/min_p become
    served_model_name: str
    # Tool-call and reasoning formats (server/chat_tools.py), resolved at start-up from the flags and the
    # chat template.
    chat_format: ChatFormat = field(default_factory=ChatFormat)
    # What a pooling server serves (--is-embedding / --is-reranker, model_executor/pooling.py); None: generation.
    pooling: PoolingConfig | None = None
    yes_no_ids: tuple[int, int] | None = None  # a yes/no reranker's "no" and "yes" token ids
    # The LoRA adapters loaded now, name -> folder (updated by /load_lora_adapter and /unload_lora_adapter).
    lora_adapters: dict[str, str] = field(default_factory=dict)

    @property
    def task(self) -> str:
        return self.pooling.task if self.pooling is not None else "generate"

    def require_task(self, task: str, endpoint: str) -> None:
        """400 for an endpoint this server does not serve, naming the flag that would serve it."""
        if self.task == task:
            return
        serves = {"generate": "text generation (start it with --is-embedding for an embedding model, "
                              "--is-reranker for a reranker)",
                  "embed": "embeddings (--is-embedding): use /v1/embeddings",
                  "rerank": "reranking (--is-reranker): use /v1/rerank or /v1/score"}[self.task]
        raise ApiError(400, f"{endpoint} is not available: this server serves {serves}")

    def pooling_spec(self) -> PoolingSpec:
        """The scheduler's pooling request for this server's model."""
        if self.pooling.task == "embed":
            return PoolingSpec(self.pooling.pooling)
        return PoolingSpec("logits", self.yes_no_ids or ())

    @property
    def grammar_enabled(self) -> bool:
        return self.args.grammar_backend != "none"

    def check_model(self, name: str | None) -> str:
        if name is not None and name not in (self.served_model_name, str(self.args.model_path)):
            raise ApiError(404, f"The model '{name}' does not exist; this server serves "
                                f"'{self.served_model_name}'.", "model", "NotFoundError")
        return self.served_model_name

    def resolve_model(self, name: str | None, lora_path: str | None = None) -> tuple[str, str | None]:
        """(the model name the response names, the LoRA adapter or None) for a generation request's `model`
        (the base model, an adapter's name as vLLM, or "base:adapter" as SGLang) and `lora_path` (SGLang's
        field: an adapter's name); 404 naming what is not loaded."""
        if lora_path is not None:
            if lora_path not in self.lora_adapters:
                raise ApiError(404, f"The LoRA adapter '{lora_path}' is not loaded.", "lora_path", "NotFoundError")
            if name is not None and name not in (self.served_model_name, str(self.args.model_path), lora_path):
                self.check_model(name)
            return lora_path, lora_path
        if name is not None and name not in (self.served_model_name, str(self.args.model_path)):
            base, sep, adapter = name.partition(":")
            if name in self.lora_adapters:
                return name, name
            if sep and base in (self.served_model_name, str(self.args.model_path)):
                if adapter not in self.lora_adapters:
                    raise ApiError(404, f"The LoRA adapter '{adapter}' is not loaded.", "model", "NotFoundError")
                return name, adapter
            if self.lora_adapters:
                raise ApiError(404, f"The model '{name}' does not exist; this server serves "
                                    f"'{self.served_model_name}' and the LoRA adapters "
                                    f"{sorted(self.lora_adapters)}.", "model", "NotFoundError")
        return self.check_model(name), None


_encode = json.JSONEncoder(ensure_ascii=False).encode  # (json.dumps without its per-call set-up)
# Three characters that JSON leaves raw end a line for readers that split as str.splitlines does (httpx's
# aiter_lines among them), which would cut an event's JSON in two: they go out as \u escapes, the same value.
_LINE_BREAKS = re.compile("[\x85\u2028\u2029]")


def _json(value) -> str:
    """value as JSON text for an SSE data line: UTF-8 as is, but for the line breaks above."""
    return _LINE_BREAKS.sub(lambda m: f"\\u{ord(m.group()):04x}", _encode(value))


def sse(obj) -> str:
    return f"data: {_json(obj)}\n\n"


class ChoiceChunks:
    """sse() of one stream's per-choice chunks, {"id", "object", "created", "model", "choices": [{"index",
    <the choice's fields>}], "usage": null}, written from text around the parts that change: a stream sends
    one per choice per engine step, and encoding the whole dict each time was a good part of the HTTP
    process's work per token. The text is exactly sse()'s (tests/server/test_frontend_stream.py)."""

    def __init__(self, rid: str, obj: str, created: int, model: str):
        self._head = (f'data: {{"id": {_json(rid)}, "object": {_json(obj)}, "created": {_json(created)}, '
                      f'"model": {_json(model)}, "choices": [{{"index": ')
        self._tail = '}], "usage": null}\n\n'

    def __call__(self, index: int, fields: dict) -> str:
        """fields: the choice's keys after "index", in order."""
        parts = [self._head, str(index)]
        for key, value in fields.items():
            parts += (', "', key, '": ', _json(value))
        parts.append(self._tail)
        return "".join(parts)


async def _wait_disconnect(request: Request) -> None:
    while True:
        msg = await request.receive()
        if msg["type"] == "http.disconnect":
            return


async def unless_disconnected(request: Request, coro):
    """Run coro; if the client goes away first, cancel it (which aborts its scheduler requests)."""
    task = asyncio.ensure_future(coro)
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if task in done:
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await task
    return Response(status_code=499)  # nobody reads it: the client is gone


_END = object()


async def start_stream(request: Request, chunks: AsyncIterator[GenChunk]) -> AsyncIterator[GenChunk] | Response:
    """Wait for a streamed request's first chunk before its 200 goes out, so that an error the engine finds
    before any output (a constraint that admits no token at all, a prompt it refuses, a dead engine) is the
    response's own status and OpenAI error body, as for a request that does not stream; errors after output
    stay events in the stream. Returns the chunks (the first one included), or a 499 Response when the
    client left while waiting (its requests aborted). What a stream sends before its first token (the chat
    role chunk, a completions echo) therefore goes out with that token, not ahead of it."""
    it = aiter(chunks)

    async def first():
        try:
            return await anext(it)
        except StopAsyncIteration:
            return _END

    got = await unless_disconnected(request, first())
    if isinstance(got, Response):
        return got

    async def rest() -> AsyncIterator[GenChunk]:
        try:
            if got is not _END:
                yield got
                async for chunk in it:
                    yield chunk
        finally:
            await it.aclose()  # (a client gone mid-stream: the requests still running are aborted now)

    return rest()


def usage_body(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


class UsageTracker:
    """Usage over all choices: each prompt's tokens count once however many choices it has."""

    def __init__(self, n: int, num_prompts: int):
        self.n = n
        self.prompt = [0] * num_prompts
        self.cached = [0] * num_prompts
        self.completion: dict[int, int] = {}

    def update(self, chunk: GenChunk) -> None:
        p = chunk.index // self.n
        self.prompt[p] = chunk.prompt_tokens
        self.cached[p] = max(self.cached[p], min(chunk.cached_tokens, chunk.prompt_tokens))
        self.completion[chunk.index] = chunk.completion_tokens

    def body(self) -> dict:
        return usage_body(sum(self.prompt), sum(self.completion.values()), sum(self.cached))


def token_label(tm: TokenizerManager, token_id: int, as_ids: bool = False) -> str:
    """A token as logprobs list it: its text, or "token_id:N" (vLLM's return_tokens_as_token_ids, for tokens
    whose text is not whole)."""
    return f"token_id:{token_id}" if as_ids else tm.token_str(token_id)


def completion_logprobs(tm: TokenizerManager, lps: list[TokenLogprob], offset: int,
                        as_ids: bool = False) -> tuple[dict, int]:
    """text_offset counts the tokens' text even when they are listed as ids."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for lp in lps:
        s = token_label(tm, lp.token_id, as_ids)
        out["tokens"].append(s)
        out["token_logprobs"].append(lp.logprob)
        top = {s: lp.logprob}
        for tid, val in lp.top:
            top.setdefault(token_label(tm, tid, as_ids), val)
        out["top_logprobs"].append(top)
        out["text_offset"].append(offset)
        offset += len(tm.token_str(lp.token_id))
    return out, offset


# What -inf becomes in a JSON body (JSON has no infinities; OpenAI and vLLM use the same value).
MIN_LOGPROB = -9999.0


def prompt_completion_logprobs(tm: TokenizerManager, prompt_ids: list[int], lps: PromptLogprobs | None,
                               num_top: int, as_ids: bool = False) -> dict:
    """OpenAI's legacy shape for echoed prompt tokens: the first has no logprob (nothing precedes it: None, and
    None for its alternatives); offsets run over the token strings from 0."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    offset = 0
    values = {} if lps is None else {lps.first + i: i for i in range(len(lps))}
    for pos, tid in enumerate(prompt_ids):
        s = token_label(tm, tid, as_ids)
        out["tokens"].append(s)
        out["text_offset"].append(offset)
        offset += len(tm.token_str(tid))
        i = values.get(pos)
        if i is None:
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
            continue
        value = max(lps.logprobs[i], MIN_LOGPROB)
        out["token_logprobs"].append(value)
        top = {s: value}
        for t, v in zip(lps.top_ids[i][:num_top], lps.top_logprobs[i][:num_top]):
            top.setdefault(token_label(tm, t, as_ids), max(v, MIN_LOGPROB))
        out["top_logprobs"].append(top)
    return out


def vllm_prompt_logprobs(tm: TokenizerManager, prompt_ids: list[int], lps: PromptLogprobs | None,
                         num_top: int) -> list[dict | None]:
    """vLLM's `prompt_logprobs`: per prompt token None (the first) or {token id: {logprob, rank, decoded_token}}
    for the prompt token and the best `num_top` alternatives."""
    out: list[dict | None] = [None] * len(prompt_ids)
    if lps is None:
        return out
    for i in range(len(lps)):
        tid = lps.token_ids[i]
        entry = {str(tid): {"logprob": max(lps.logprobs[i], MIN_LOGPROB), "rank": lps.ranks[i],
                            "decoded_token": tm.token_str(tid)}}
        for rank, (t, v) in enumerate(zip(lps.top_ids[i][:num_top], lps.top_logprobs[i][:num_top]), start=1):
            entry.setdefault(str(t), {"logprob": max(v, MIN_LOGPROB), "rank": rank, "decoded_token": tm.token_str(t)})
        out[lps.first + i] = entry
    return out


def chat_logprobs(tm: TokenizerManager, lps: list[TokenLogprob], num_top: int, as_ids: bool = False) -> list[dict]:
    return [{"token": token_label(tm, lp.token_id, as_ids), "logprob": lp.logprob,
             "bytes": list(tm.token_bytes(lp.token_id)),
             "top_logprobs": [{"token": token_label(tm, t, as_ids), "logprob": v, "bytes": list(tm.token_bytes(t))}
                              for t, v in lp.top[:num_top]]}
            for lp in lps]


def check_stream_options(req) -> None:
    if req.stream_options is not None and not req.stream:
        raise ApiError(400, "stream_options is only allowed together with stream=true", "stream_options")

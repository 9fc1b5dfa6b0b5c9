"""The FastAPI app: OpenAI-compatible routes, SGLang-style native routes, errors, auth and body limits.

Routes turn requests into `GenRequest`s (one per choice), hand them to the TokenizerManager and format
its chunks as OpenAI JSON or SSE. Every user mistake becomes a 400 (or 401/404/413) with an OpenAI-style
body; FastAPI's 422 is mapped to 400.

`n > 1`: each choice is its own scheduler request. With a `seed`, choice i samples with `seed + i`, so
the choices differ from each other while the whole response stays reproducible.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from model_executor.generation_defaults import fill_unset, sampling_defaults
from model_executor.sampling_params import MAX_TOP_LOGPROBS, SamplingParams, SamplingParamsError
from server.args import ServerArgs
from server.ipc import FlushCacheReq, GetStatsReq, TokenLogprob
from server.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from server.protocol import (
    MAX_N,
    MAX_SUBREQUESTS,
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    ErrorResponse,
    GenerateRequest,
    ModelCard,
    ModelList,
    error_body,
)
from server.tokenizer_manager import GenChunk, GenRequest, TokenizerManager

MAX_LOGPROBS = MAX_TOP_LOGPROBS  # completions' logprobs and chat's top_logprobs
_OPEN_PATHS = ("/health", "/metrics")  # everything else needs the API key when one is set


@dataclass
class AppState:
    args: ServerArgs  # resolved (model_path and device set)
    info: dict  # the scheduler's ready info
    tokenizer_manager: TokenizerManager
    served_model_name: str
    pids: dict[str, int] = field(default_factory=dict)
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def metrics(self):
        return self.tokenizer_manager.metrics


def _json_error(status: int, message: str, param: str | None = None, type: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, type), status_code=status)


# ---- ASGI guard: API key and body size ----------------------------------------------------------


class _GuardMiddleware:
    """Checks the API key, then reads the whole body under the size limit (413 above it) and replays it.

    Pure ASGI (not BaseHTTPMiddleware) so streaming responses and disconnect detection pass through.
    """

    _DRAIN_LIMIT = 64 * 1024 * 1024  # read and drop this much of an oversized body so the 413 arrives

    def __init__(self, app, api_key: str | None, max_bytes: int):
        self.app = app
        self.api_key = api_key.encode() if api_key else None
        self.max_bytes = max_bytes

    async def _reply(self, send, status: int, message: str, param: str | None = None) -> None:
        body = json.dumps(error_body(status, message, param)).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        if status == 401:
            headers.append((b"www-authenticate", b"Bearer"))
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        if self.api_key is not None and scope["path"] not in _OPEN_PATHS:
            auth = headers.get(b"authorization", b"")
            scheme, _, token = auth.partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self.api_key):
                return await self._reply(send, 401, "Incorrect or missing API key: send the header "
                                                    "'Authorization: Bearer <key>'.")
        if scope["method"] in ("POST", "PUT", "PATCH"):
            ctype = headers.get(b"content-type", b"").split(b";")[0].strip().lower()
            if ctype in (b"", b"application/x-www-form-urlencoded", b"text/plain"):
                # `curl -d '{...}'` sends form encoding: read the body as the JSON it is.
                scope = dict(scope, headers=[(k, v) for k, v in scope["headers"] if k != b"content-type"]
                             + [(b"content-type", b"application/json")])
        too_large = (f"The request body is larger than this server's limit of {self.max_bytes} bytes "
                     "(--max-request-bytes).")
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            if headers.get(b"expect", b"").lower() != b"100-continue":
                await self._drain(receive)
            return await self._reply(send, 413, too_large)
        chunks, size = [], 0
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return
            body = msg.get("body", b"")
            size += len(body)
            if size > self.max_bytes:
                if msg.get("more_body"):
                    await self._drain(receive, size)
                return await self._reply(send, 413, too_large)
            chunks.append(body)
            if not msg.get("more_body"):
                break
        body = b"".join(chunks)
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _drain(self, receive, size: int = 0) -> None:
        while size <= self._DRAIN_LIMIT:
            msg = await receive()
            if msg["type"] != "http.request":
                return
            size += len(msg.get("body", b""))
            if not msg.get("more_body"):
                return


# ---- helpers ------------------------------------------------------------------------------------


def _validation_param(loc) -> str | None:
    parts = [str(p) for p in loc if p != "body"]
    return ".".join(parts) or None


async def _wait_disconnect(request: Request) -> None:
    while True:
        msg = await request.receive()
        if msg["type"] == "http.disconnect":
            return


async def _unless_disconnected(request: Request, coro):
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


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


_SSE_DONE = "data: [DONE]\n\n"
_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def _stop_tuple(stop) -> tuple[str, ...]:
    if stop is None:
        return ()
    return (stop,) if isinstance(stop, str) else tuple(stop)


def _build_params(*, defaults: dict, max_tokens: int, temperature, top_p, top_k, min_p, seed, stop,
                  stop_token_ids, ignore_eos: bool, min_tokens: int, top_logprobs: int | None,
                  param_names: dict[str, str] | None = None) -> SamplingParams:
    """defaults: what a value the request leaves unset (None) becomes (--sampling-defaults)."""
    s = fill_unset({"temperature": temperature, "top_p": top_p, "top_k": top_k, "min_p": min_p}, defaults)
    params = SamplingParams(
        max_new_tokens=max_tokens,
        temperature=float(s["temperature"]),
        top_p=float(s["top_p"]),
        top_k=int(s["top_k"]),
        min_p=float(s["min_p"]),
        seed=seed,
        stop=_stop_tuple(stop),
        stop_token_ids=tuple(stop_token_ids or ()),
        ignore_eos=ignore_eos,
        min_new_tokens=min_tokens,
        top_logprobs=top_logprobs,
    )
    try:
        params.validate()
    except SamplingParamsError as e:
        names = param_names or {}
        raise ApiError(400, str(e), names.get(e.param, e.param)) from None
    return params


def _choices_params(params: SamplingParams, n: int) -> list[SamplingParams]:
    if n == 1 or params.seed is None:
        return [params] * n
    # seed + i per choice (wrapped into int64) so seeded choices differ yet stay reproducible.
    return [dataclasses.replace(params, seed=((params.seed + i + 2**63) % 2**64) - 2**63) for i in range(n)]


def _check_n(n: int, num_prompts: int = 1) -> None:
    if not 1 <= n <= MAX_N:
        raise ApiError(400, f"n must be in [1, {MAX_N}], got {n}", "n")
    if n * num_prompts > MAX_SUBREQUESTS:
        raise ApiError(400, f"n x number of prompts must be at most {MAX_SUBREQUESTS}, got {n * num_prompts}",
                       "n")


def _usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


class _UsageTracker:
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
        return _usage(sum(self.prompt), sum(self.completion.values()), sum(self.cached))


@dataclass
class _GenerateAccumulator:
    text: str = ""
    output_ids: list[int] = field(default_factory=list)
    lps: list = field(default_factory=list)
    top: list = field(default_factory=list)


# ---- the app ------------------------------------------------------------------------------------


def create_app(state: AppState) -> FastAPI:
    tm = state.tokenizer_manager
    args = state.args
    sampling = sampling_defaults(args.model_path, args.sampling_defaults)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        await tm.start()
        try:
            yield
        finally:
            await tm.stop()

    # Every route may answer 4xx/5xx with the OpenAI error body. Declaring the ranges also keeps FastAPI from
    # documenting its 422, which this server never sends (validation errors are 400).
    error_responses = {"4XX": {"model": ErrorResponse, "description": "A client error (OpenAI error body)"},
                       "5XX": {"model": ErrorResponse, "description": "The engine failed or stopped"}}
    app = FastAPI(title="duet", version="0.1.0", lifespan=lifespan, responses=error_responses)
    app.state.duet = state
    app.add_middleware(_GuardMiddleware, api_key=args.api_key, max_bytes=args.max_request_bytes)

    # ---- errors -------------------------------------------------------------------------------

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError):
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        errors = exc.errors()
        first = errors[0] if errors else {"loc": (), "msg": "invalid request"}
        if first.get("type") == "json_invalid":
            detail = (first.get("ctx") or {}).get("error", "")
            return _json_error(400, f"The request body is not valid JSON: {detail}".rstrip(": "))
        loc = tuple(first.get("loc", ()))
        param = _validation_param(loc)
        if first.get("type") == "missing" and param is None:
            return _json_error(400, "The request body must be a JSON object.")
        msg = first.get("msg", "invalid value")
        return _json_error(400, f"{param}: {msg}" if param else msg, param)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        message = exc.detail if isinstance(exc.detail, str) else json.dumps(exc.detail)
        if exc.status_code == 404 and message == "Not Found":
            message = f"No route {request.method} {request.url.path}"
        return _json_error(exc.status_code, message)

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception):
        return _json_error(500, f"internal server error: {type(exc).__name__}: {exc}")

    # ---- model names --------------------------------------------------------------------------

    accepted_names = {state.served_model_name, str(args.model_path)}

    def check_model(name: str | None) -> str:
        if name is not None and name not in accepted_names:
            raise ApiError(404, f"The model '{name}' does not exist; this server serves "
                                f"'{state.served_model_name}'.", "model", "NotFoundError")
        return state.served_model_name

    def model_card() -> ModelCard:
        return ModelCard(id=state.served_model_name, created=state.created, root=str(args.model_path),
                         max_model_len=tm.context_len)

    # ---- routes: health, info, models ------------------------------------------------------------

    @app.get("/health")
    async def health():
        if not tm.healthy or not tm.accepting:
            return _json_error(503, tm.fatal_error or "the server is shutting down")
        return Response(status_code=200)

    @app.get("/v1/models")
    async def list_models():
        return ModelList(data=[model_card()]).model_dump()

    @app.get("/v1/models/{model_id:path}")
    async def retrieve_model(model_id: str):
        check_model(model_id)
        return model_card().model_dump()

    async def current_stats() -> dict | None:
        try:
            return (await tm.control(GetStatsReq, timeout=3.0)).data
        except ApiError:
            return None

    @app.get("/server_info")
    @app.get("/get_server_info")
    async def server_info():
        resolved = dataclasses.asdict(args)
        if resolved.get("api_key"):
            resolved["api_key"] = "<redacted>"
        return {
            "args": resolved,
            "served_model_name": state.served_model_name,
            "sampling_defaults": sampling,
            "scheduler_info": state.info,
            "stats": await current_stats() if tm.healthy else None,
            "healthy": tm.healthy,
            "scheduler_pid": state.pids.get("scheduler"),
            "detokenizer_pid": state.pids.get("detokenizer"),
            "http_pid": state.pids.get("http"),
            "num_inflight_requests": tm.num_inflight,
        }

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache():
        reply = await tm.control(FlushCacheReq)
        if not reply.ok:
            raise ApiError(400, str(reply.data.get("message") or reply.data.get("error")
                                    or "the cache cannot be flushed now (requests are running)"))
        return {"success": True, "message": "cache flushed", **reply.data}

    @app.get("/metrics")
    async def metrics():
        stats = await current_stats() if tm.healthy else None
        state.metrics.set_scheduler_stats(stats, scheduler_up=tm.healthy)
        return Response(state.metrics.render(), media_type=METRICS_CONTENT_TYPE)

    # ---- logprob formatting -------------------------------------------------------------------

    def completion_logprobs(lps: list[TokenLogprob], offset: int) -> tuple[dict, int]:
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for lp in lps:
            s = tm.token_str(lp.token_id)
            out["tokens"].append(s)
            out["token_logprobs"].append(lp.logprob)
            top = {s: lp.logprob}
            for tid, val in lp.top:
                top.setdefault(tm.token_str(tid), val)
            out["top_logprobs"].append(top)
            out["text_offset"].append(offset)
            offset += len(s)
        return out, offset

    def chat_logprobs(lps: list[TokenLogprob], num_top: int) -> list[dict]:
        return [{"token": tm.token_str(lp.token_id), "logprob": lp.logprob,
                 "bytes": list(tm.token_bytes(lp.token_id)),
                 "top_logprobs": [{"token": tm.token_str(t), "logprob": v, "bytes": list(tm.token_bytes(t))}
                                  for t, v in lp.top[:num_top]]}
                for lp in lps]

    def common_checks(req) -> None:
        if req.stream_options is not None and not req.stream:
            raise ApiError(400, "stream_options is only allowed together with stream=true", "stream_options")

    # ---- /v1/completions ----------------------------------------------------------------------

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        model = check_model(req.model)
        common_checks(req)
        if req.logprobs is not None and not 0 <= req.logprobs <= MAX_LOGPROBS:
            raise ApiError(400, f"logprobs must be in [0, {MAX_LOGPROBS}], got {req.logprobs}", "logprobs")
        if req.echo and req.logprobs is not None:
            raise ApiError(400, "echo together with logprobs is not supported (no prompt logprobs)", "echo")
        prompt = req.prompt
        if isinstance(prompt, str):
            prompts = [((await tm.encode_prompts_async([prompt]))[0], prompt)]
        elif not prompt:
            raise ApiError(400, "the prompt is empty", "prompt")
        elif isinstance(prompt[0], int):
            prompts = [(list(prompt), None)]
        elif isinstance(prompt[0], str):
            prompts = list(zip(await tm.encode_prompts_async(prompt), prompt))
        else:
            prompts = [(list(p), None) for p in prompt]
        _check_n(req.n, len(prompts))
        max_tokens = 16 if req.max_tokens is None else req.max_tokens
        params = _build_params(defaults=sampling, max_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p,
                               top_k=req.top_k, min_p=req.min_p, seed=req.seed, stop=req.stop,
                               stop_token_ids=req.stop_token_ids, ignore_eos=req.ignore_eos,
                               min_tokens=req.min_tokens, top_logprobs=req.logprobs)
        tm.check_token_ids(params.stop_token_ids, "stop_token_ids")
        for ids, _ in prompts:
            tm.check_token_ids(ids, "prompt")
            tm.check_length(len(ids), max_tokens, "prompt", "max_tokens")
        tm.check_alive()
        n = req.n
        gen = [GenRequest(ids, p) for ids, _ in prompts for p in _choices_params(params, n)]
        echoes = []
        if req.echo:
            for ids, text in prompts:
                echoes.extend([text if text is not None else tm.tokenizer.decode(ids)] * n)
        rid = f"cmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        want_lp = req.logprobs is not None

        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)

            async def stream() -> AsyncIterator[str]:
                usage = _UsageTracker(n, len(prompts))
                offsets = [len(e) for e in echoes] if echoes else [0] * len(gen)

                def chunk(index: int, text: str, logprobs=None, finish=None) -> str:
                    return _sse({"id": rid, "object": "text_completion", "created": created, "model": model,
                                 "choices": [{"index": index, "text": text, "logprobs": logprobs,
                                              "finish_reason": finish}], "usage": None})
                try:
                    for i, e in enumerate(echoes):
                        if e:
                            yield chunk(i, e)
                    async for c in tm.generate(gen, rid):
                        usage.update(c)
                        lp = None
                        if want_lp and c.logprobs:
                            lp, offsets[c.index] = completion_logprobs(c.logprobs, offsets[c.index])
                        if c.text or lp or c.finish:
                            yield chunk(c.index, c.text, lp, c.finish.openai_reason if c.finish else None)
                    if include_usage:
                        yield _sse({"id": rid, "object": "text_completion", "created": created, "model": model,
                                    "choices": [], "usage": usage.body()})
                except ApiError as e:
                    yield _sse(e.body())
                yield _SSE_DONE

            return StreamingResponse(stream(), media_type="text/event-stream", headers=_SSE_HEADERS)

        async def collect():
            usage = _UsageTracker(n, len(prompts))
            texts = list(echoes) if echoes else [""] * len(gen)
            lps = [{"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []} for _ in gen]
            offsets = [len(t) for t in texts]
            finish = [None] * len(gen)
            async for c in tm.generate(gen, rid):
                usage.update(c)
                texts[c.index] += c.text
                if want_lp and c.logprobs:
                    part, offsets[c.index] = completion_logprobs(c.logprobs, offsets[c.index])
                    for k in lps[c.index]:
                        lps[c.index][k].extend(part[k])
                if c.finish:
                    finish[c.index] = c.finish.openai_reason
            return {"id": rid, "object": "text_completion", "created": created, "model": model,
                    "choices": [{"index": i, "text": texts[i], "logprobs": lps[i] if want_lp else None,
                                 "finish_reason": finish[i]} for i in range(len(gen))],
                    "usage": usage.body()}

        return await _unless_disconnected(request, collect())

    # ---- /v1/chat/completions ---------------------------------------------------------------------

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, request: Request):
        model = check_model(req.model)
        common_checks(req)
        if req.top_logprobs is not None:
            if not 0 <= req.top_logprobs <= MAX_LOGPROBS:
                raise ApiError(400, f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {req.top_logprobs}",
                               "top_logprobs")
            if not req.logprobs:
                raise ApiError(400, "top_logprobs needs logprobs=true", "top_logprobs")
        _check_n(req.n)
        messages = []
        for i, m in enumerate(req.messages):
            content = m.content
            if isinstance(content, list):
                parts = []
                for part in content:
                    if part.type != "text" or part.text is None:
                        raise ApiError(400, f"content parts of type {part.type!r} are not supported; "
                                            "only text", f"messages.{i}.content")
                    parts.append(part.text)
                content = "\n".join(parts)
            messages.append({"role": "system" if m.role == "developer" else m.role, "content": content or ""})
        input_ids = await tm.encode_chat_async(messages)
        if req.max_completion_tokens is not None:
            max_tokens, max_param = req.max_completion_tokens, "max_completion_tokens"
        elif req.max_tokens is not None:
            max_tokens, max_param = req.max_tokens, "max_tokens"
        else:
            max_tokens, max_param = tm.default_max_tokens(len(input_ids), "messages"), "max_tokens"
        num_top = (req.top_logprobs or 0) if req.logprobs else None
        params = _build_params(defaults=sampling, max_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p,
                               top_k=req.top_k, min_p=req.min_p, seed=req.seed, stop=req.stop,
                               stop_token_ids=req.stop_token_ids, ignore_eos=req.ignore_eos,
                               min_tokens=req.min_tokens, top_logprobs=num_top,
                               param_names={"max_tokens": max_param})
        tm.check_token_ids(params.stop_token_ids, "stop_token_ids")
        tm.check_length(len(input_ids), max_tokens, "messages", max_param)
        tm.check_alive()
        n = req.n
        gen = [GenRequest(input_ids, p) for p in _choices_params(params, n)]
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        created = int(time.time())

        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)

            async def stream() -> AsyncIterator[str]:
                usage = _UsageTracker(n, 1)

                def chunk(index: int, delta: dict, logprobs=None, finish=None) -> str:
                    return _sse({"id": rid, "object": "chat.completion.chunk", "created": created,
                                 "model": model, "choices": [{"index": index, "delta": delta,
                                                              "logprobs": logprobs, "finish_reason": finish}],
                                 "usage": None})
                try:
                    for i in range(n):
                        yield chunk(i, {"role": "assistant", "content": ""})
                    async for c in tm.generate(gen, rid):
                        usage.update(c)
                        lp = None
                        if num_top is not None and c.logprobs:
                            lp = {"content": chat_logprobs(c.logprobs, num_top)}
                        if c.text or lp or c.finish:
                            yield chunk(c.index, {"content": c.text} if c.text else {}, lp,
                                        c.finish.openai_reason if c.finish else None)
                    if include_usage:
                        yield _sse({"id": rid, "object": "chat.completion.chunk", "created": created,
                                    "model": model, "choices": [], "usage": usage.body()})
                except ApiError as e:
                    yield _sse(e.body())
                yield _SSE_DONE

            return StreamingResponse(stream(), media_type="text/event-stream", headers=_SSE_HEADERS)

        async def collect():
            usage = _UsageTracker(n, 1)
            texts = [""] * n
            lps: list[list] = [[] for _ in range(n)]
            finish = [None] * n
            async for c in tm.generate(gen, rid):
                usage.update(c)
                texts[c.index] += c.text
                if num_top is not None and c.logprobs:
                    lps[c.index].extend(chat_logprobs(c.logprobs, num_top))
                if c.finish:
                    finish[c.index] = c.finish.openai_reason
            return {"id": rid, "object": "chat.completion", "created": created, "model": model,
                    "choices": [{"index": i, "message": {"role": "assistant", "content": texts[i]},
                                 "logprobs": {"content": lps[i]} if num_top is not None else None,
                                 "finish_reason": finish[i]} for i in range(n)],
                    "usage": usage.body()}

        return await _unless_disconnected(request, collect())

    # ---- /generate (SGLang native) --------------------------------------------------------------

    @app.post("/generate")
    async def generate(req: GenerateRequest, request: Request):
        if (req.text is None) == (req.input_ids is None):
            raise ApiError(400, "give exactly one of text and input_ids", "text")
        if req.text is not None:
            ids, param = (await tm.encode_prompts_async([req.text]))[0], "text"
        else:
            ids, param = list(req.input_ids), "input_ids"
            tm.check_token_ids(ids, param)
        sp = req.sampling_params
        if not 0 <= req.top_logprobs_num <= MAX_LOGPROBS:
            raise ApiError(400, f"top_logprobs_num must be in [0, {MAX_LOGPROBS}]", "top_logprobs_num")
        params = _build_params(defaults=sampling, max_tokens=sp.max_new_tokens, temperature=sp.temperature,
                               top_p=sp.top_p,
                               top_k=sp.top_k, min_p=sp.min_p, seed=sp.seed, stop=sp.stop,
                               stop_token_ids=sp.stop_token_ids, ignore_eos=sp.ignore_eos,
                               min_tokens=sp.min_new_tokens,
                               top_logprobs=req.top_logprobs_num if req.return_logprob else None,
                               param_names={"max_tokens": "sampling_params.max_new_tokens",
                                            "min_tokens": "sampling_params.min_new_tokens"})
        tm.check_token_ids(params.stop_token_ids, "sampling_params.stop_token_ids")
        tm.check_length(len(ids), sp.max_new_tokens, param, "sampling_params.max_new_tokens")
        tm.check_alive()
        rid = f"gen-{uuid.uuid4().hex}"
        gen = [GenRequest(ids, params)]

        acc = _GenerateAccumulator()

        def absorb(c: GenChunk) -> dict:
            acc.text += c.text
            acc.output_ids.extend(c.token_ids)
            if req.return_logprob and c.logprobs:
                acc.lps.extend([lp.logprob, lp.token_id, None] for lp in c.logprobs)
                acc.top.extend([[v, t, None] for t, v in lp.top] for lp in c.logprobs)
            meta = {"id": rid, "prompt_tokens": c.prompt_tokens, "completion_tokens": c.completion_tokens,
                    "cached_tokens": c.cached_tokens,
                    "finish_reason": None if c.finish is None else
                    {"type": c.finish.kind, "matched": c.finish.matched}}
            if req.return_logprob:
                meta["output_token_logprobs"] = acc.lps
                meta["output_top_logprobs"] = acc.top
            return {"text": acc.text, "output_ids": list(acc.output_ids), "meta_info": meta}

        if req.stream:
            async def stream() -> AsyncIterator[str]:
                try:
                    async for c in tm.generate(gen, rid):
                        out = absorb(c)
                        if c.text or c.token_ids or c.finish:
                            yield _sse(out)  # SGLang streams the cumulative text
                except ApiError as e:
                    yield _sse(e.body())
                yield _SSE_DONE

            return StreamingResponse(stream(), media_type="text/event-stream", headers=_SSE_HEADERS)

        async def collect():
            out = None
            async for c in tm.generate(gen, rid):
                out = absorb(c)
            return out

        return await _unless_disconnected(request, collect())

    return app


def served_name(args: ServerArgs) -> str:
    return args.served_model_name or Path(str(args.model_path)).name

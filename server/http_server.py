"""The FastAPI app: route wiring, errors, auth and body limits, health, models, info, cache and metrics.

The generation routes live in `serving_completions.py`, `serving_chat.py`, `serving_generate.py` and
`serving_tokenize.py` (request -> SamplingParams in `protocol_convert.py`). Every user mistake becomes a 400
(or 401/404/413) with an OpenAI-style body; FastAPI's 422 is mapped to 400, and an unknown field is a 400
naming it.

`n > 1`: each choice is its own scheduler request. With a `seed`, choice i samples with `seed + i`, so
the choices differ from each other while the whole response stays reproducible.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hmac
import json
import time
from dataclasses import dataclass, field
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from model_executor.generation_defaults import sampling_defaults
from server.args import ServerArgs
from server.ipc import FlushCacheReq, GetStatsReq
from server.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from server.protocol import (
    UNSUPPORTED_HINTS,
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ErrorResponse,
    GenerateRequest,
    ModelCard,
    ModelList,
    TokenizeRequest,
    error_body,
)
from server.protocol_responses import ResponsesRequest
from server.serving_chat import create_chat_completion
from server.serving_common import ServingContext
from server.serving_completions import create_completion
from server.serving_generate import generate
from server.serving_responses import ResponseStore, create_response, delete_response, retrieve_response
from server.serving_tokenize import detokenize, tokenize
from server.tokenizer_manager import TokenizerManager

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
        if first.get("type") == "extra_forbidden":
            name = str(loc[-1]) if loc else param
            hint = UNSUPPORTED_HINTS.get(name)
            return _json_error(400, f"{param}: duet does not support this field" + (f" ({hint})" if hint else "")
                               + "; remove it from the request", param)
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

    ctx = ServingContext(tm, args, sampling, state.served_model_name)
    check_model = ctx.check_model

    def model_card() -> ModelCard:
        return ModelCard(id=state.served_model_name, created=state.created, root=str(args.model_path),
                         max_model_len=tm.context_len, capabilities=capabilities(args))

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
            "capabilities": capabilities(args),
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

    # ---- generation routes (server/serving_*.py) ------------------------------------------------

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        return await create_completion(ctx, req, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, request: Request):
        return await create_chat_completion(ctx, req, request)

    responses_store = ResponseStore()

    @app.post("/v1/responses")
    async def responses_create(req: ResponsesRequest, request: Request):
        return await create_response(ctx, responses_store, req, request)

    @app.get("/v1/responses/{response_id}")
    async def responses_retrieve(response_id: str):
        return retrieve_response(responses_store, response_id)

    @app.delete("/v1/responses/{response_id}")
    async def responses_delete(response_id: str):
        return delete_response(responses_store, response_id)

    @app.post("/generate")
    async def generate_route(req: GenerateRequest, request: Request):
        return await generate(ctx, req, request)

    @app.post("/tokenize")
    async def tokenize_route(req: TokenizeRequest):
        return await tokenize(ctx, req)

    @app.post("/detokenize")
    async def detokenize_route(req: DetokenizeRequest):
        return await detokenize(ctx, req)

    return app


def capabilities(args: ServerArgs) -> dict:
    """What this server implements beyond plain generation (in /v1/models and /server_info)."""
    grammar = args.grammar_backend != "none"
    return {
        "structured_outputs": ["json_object", "json_schema", "regex", "ebnf"] if grammar else [],
        "grammar_backend": args.grammar_backend,
        "tool_choice": (["none"] + (["auto"] if args.tool_call_parser else [])
                        + (["required", "named"] if grammar else [])),
        "tool_call_parser": args.tool_call_parser,
        "reasoning_parser": args.reasoning_parser,
        "sampling": ["temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "min_tokens",
                     "ignore_eos", "logprobs", "top_logprobs", "presence_penalty", "frequency_penalty",
                     "repetition_penalty", "logit_bias", "n"],
        "prompt_logprobs": ["echo with logprobs", "prompt_logprobs", "logprob_start_len"],
        "accepted_without_effect": ["user", "store", "metadata", "service_tier", "safety_identifier",
                                    "prompt_cache_key"],
        "not_supported": ["best_of > n", "suffix", "image/audio content",
                          "functions/function_call (use tools)"],
    }


def served_name(args: ServerArgs) -> str:
    return args.served_model_name or Path(str(args.model_path)).name

"""The FastAPI app: route wiring, errors, auth and body limits, health, models, info, cache and metrics.

The generation routes live in `serving_completions.py`, `serving_chat.py`, `serving_generate.py` and
`serving_tokenize.py` (request -> SamplingParams in `protocol_convert.py`); the tool-call and reasoning
formats are resolved once here (`chat_tools.py`) and logged. Aliases the peers serve: /v1/tokenize and
/v1/detokenize (vLLM's /tokenize, /detokenize), /get_server_info, /get_model_info, /version and
/health_generate (SGLang's). Every user mistake becomes a 400
(or 401/404/413) with an OpenAI-style body; FastAPI's 422 is mapped to 400, and an unknown field is a 400
naming it.

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
from dataclasses import dataclass, field
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from model_executor.generation_defaults import sampling_defaults
from model_executor.pooling_config import resolve_pooling
from model_executor.sampling_params import SamplingParams
from scheduler.io_struct import FlushCacheReq, GetStatsReq
from server.args import ServerArgs
from server.chat_tools import ChatFormat, log_chat_format, resolve_chat_format
from server.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from server.protocol import (
    UNSUPPORTED_HINTS,
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ErrorResponse,
    GenerateRequest,
    LoadLoraAdapterRequest,
    ModelCard,
    ModelList,
    TokenizeRequest,
    UnloadLoraAdapterRequest,
    error_body,
)
from server.protocol_anthropic import (
    AnthropicCountTokensRequest,
    AnthropicErrorResponse,
    AnthropicMessageResponse,
    AnthropicMessagesRequest,
    AnthropicTokenCount,
    anthropic_error_body,
    uses_anthropic_errors,
)
from server.protocol_embedding import (
    EmbeddingRequest,
    EmbeddingResponse,
    RerankRequest,
    RerankResponse,
    ScoreRequest,
    ScoreResponse,
)
from server.protocol_responses import ResponsesRequest
from server.serving_chat import create_chat_completion
from server.serving_common import ServingContext
from server.serving_completions import create_completion
from server.serving_embedding import create_embedding
from server.serving_generate import generate
from server.serving_lora import load_lora_adapter, unload_lora_adapter
from server.serving_messages import count_tokens, create_message
from server.serving_rerank import create_rerank, yes_no_token_ids
from server.serving_responses import ResponseStore, create_response, delete_response, retrieve_response
from server.serving_score import create_score
from server.serving_tokenize import detokenize, tokenize
from server.tokenizer_manager import GenRequest, TokenizerManager

_OPEN_PATHS = ("/health", "/metrics")  # everything else needs the API key when one is set
HEALTH_GENERATE_TIMEOUT_S = 20.0  # /health_generate: a 1-token generation must finish within this
VERSION = "0.1.0"


@dataclass
class AppState:
    args: ServerArgs  # resolved (model_path and device set)
    info: dict  # the scheduler's ready info
    tokenizer_manager: TokenizerManager
    served_model_name: str
    pids: dict[str, int] = field(default_factory=dict)
    startup: dict[str, float] = field(default_factory=dict)  # the start-up timeline (server/startup_timeline.py)
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def metrics(self):
        return self.tokenizer_manager.metrics


def _error_body(path: str, status: int, message: str, param: str | None = None, type: str | None = None) -> dict:
    """The error body of the API that path belongs to: Anthropic's for /v1/messages, else OpenAI's."""
    if uses_anthropic_errors(path):
        return anthropic_error_body(status, message, param)
    return error_body(status, message, param, type)


def _json_error(request: Request, status: int, message: str, param: str | None = None,
                type: str | None = None) -> JSONResponse:
    return JSONResponse(_error_body(request.url.path, status, message, param, type), status_code=status)


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

    async def _reply(self, send, scope, status: int, message: str) -> None:
        body = json.dumps(_error_body(scope["path"], status, message)).encode()
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
            if scheme.lower() != b"bearer":  # Anthropic's clients send the key as x-api-key
                token = headers.get(b"x-api-key", b"")
            if not hmac.compare_digest(token.strip(), self.api_key):
                return await self._reply(send, scope, 401, "Incorrect or missing API key: send the header "
                                                           "'Authorization: Bearer <key>' (or 'x-api-key: <key>').")
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
            return await self._reply(send, scope, 413, too_large)
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
                return await self._reply(send, scope, 413, too_large)
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
    app = FastAPI(title="duet", version=VERSION, lifespan=lifespan, responses=error_responses)
    app.state.duet = state
    app.add_middleware(_GuardMiddleware, api_key=args.api_key, max_bytes=args.max_request_bytes)

    # ---- errors -------------------------------------------------------------------------------

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError):
        return _json_error(request, exc.status, exc.message, exc.param, exc.type)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        errors = exc.errors()
        first = errors[0] if errors else {"loc": (), "msg": "invalid request"}
        if first.get("type") == "json_invalid":
            detail = (first.get("ctx") or {}).get("error", "")
            return _json_error(request, 400, f"The request body is not valid JSON: {detail}".rstrip(": "))
        loc = tuple(first.get("loc", ()))
        param = _validation_param(loc)
        if first.get("type") == "missing" and param is None:
            return _json_error(request, 400, "The request body must be a JSON object.")
        if first.get("type") == "extra_forbidden":
            name = str(loc[-1]) if loc else param
            hint = UNSUPPORTED_HINTS.get(name)
            return _json_error(request, 400, f"{param}: duet does not support this field"
                               + (f" ({hint})" if hint else "") + "; remove it from the request", param)
        msg = first.get("msg", "invalid value")
        return _json_error(request, 400, f"{param}: {msg}" if param else msg, param)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        message = exc.detail if isinstance(exc.detail, str) else json.dumps(exc.detail)
        if exc.status_code == 404 and message == "Not Found":
            message = f"No route {request.method} {request.url.path}"
        return _json_error(request, exc.status_code, message)

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception):
        return _json_error(request, 500, f"internal server error: {type(exc).__name__}: {exc}")

    # ---- model names --------------------------------------------------------------------------

    chat_format = resolve_chat_format(tm.tokenizer, tm.chat_template or getattr(tm.tokenizer, "chat_template", None),
                                      args.tool_call_parser, args.reasoning_parser)
    log_chat_format(chat_format)
    pooling = resolve_pooling(args.model_path, args.is_embedding, args.is_reranker)
    yes_no = yes_no_token_ids(tm.tokenizer) if pooling is not None and pooling.reranker == "yes_no" else None
    ctx = ServingContext(tm, args, sampling, state.served_model_name, chat_format, pooling, yes_no)
    check_model = ctx.check_model
    ctx.lora_adapters.update(args.lora_adapters())

    def model_card() -> ModelCard:
        return ModelCard(id=state.served_model_name, created=state.created, root=str(args.model_path),
                         max_model_len=tm.context_len, capabilities=capabilities(args, chat_format, pooling, tm.images is not None))

    # ---- routes: health, info, models ------------------------------------------------------------

    @app.get("/health")
    async def health():
        if not tm.healthy or not tm.accepting:
            return JSONResponse(error_body(503, tm.fatal_error or "the server is shutting down"), status_code=503)
        return Response(status_code=200)

    @app.get("/health_generate")
    async def health_generate(request: Request):
        """SGLang's deep health check: 200 once a 1-token generation went through the engine, else 503."""
        tm.check_alive()
        gen = [GenRequest([0], SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True),
                          pooling=ctx.pooling_spec() if pooling is not None else None)]

        async def one_token():
            async for _ in tm.generate(gen, tm.new_rid("health-")):
                pass

        try:
            await asyncio.wait_for(one_token(), HEALTH_GENERATE_TIMEOUT_S)
        except asyncio.TimeoutError:
            return _json_error(request, 503, f"a 1-token generation did not finish within {HEALTH_GENERATE_TIMEOUT_S:g} s")
        except ApiError as e:
            return _json_error(request, 503, f"a 1-token generation failed: {e.message}")
        return Response(status_code=200)

    @app.get("/version")
    async def version():
        return {"version": VERSION}

    @app.get("/get_model_info")
    async def model_info():
        """SGLang's model description."""
        return {"model_path": str(args.model_path), "tokenizer_path": str(args.tokenizer_path or args.model_path),
                "served_model_name": state.served_model_name, "is_generation": pooling is None,
                "max_model_len": tm.context_len, "preferred_sampling_params": None}

    def adapter_card(name: str) -> ModelCard:
        return ModelCard(id=name, created=state.created, root=ctx.lora_adapters[name],
                         parent=state.served_model_name, max_model_len=tm.context_len)

    @app.get("/v1/models")
    async def list_models():
        return ModelList(data=[model_card(), *map(adapter_card, ctx.lora_adapters)]).model_dump()

    @app.get("/v1/models/{model_id:path}")
    async def retrieve_model(model_id: str):
        if model_id in ctx.lora_adapters:
            return adapter_card(model_id).model_dump()
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
            "capabilities": capabilities(args, chat_format, pooling, tm.images is not None),
            "scheduler_info": state.info,
            "startup": state.startup,
            "stats": await current_stats() if tm.healthy else None,
            "healthy": tm.healthy,
            "scheduler_pid": state.pids.get("scheduler"),
            "detokenizer_pid": state.pids.get("detokenizer"),
            "http_pid": state.pids.get("http"),
            "num_inflight_requests": tm.num_inflight,
        }

    # One route per method: a route with two methods gives both the same OpenAPI operation id.
    @app.get("/flush_cache", operation_id="flush_cache_get")
    @app.post("/flush_cache", operation_id="flush_cache_post")
    async def flush_cache():
        reply = await tm.control(FlushCacheReq)
        if not reply.ok:
            raise ApiError(400, str(reply.data.get("message") or reply.data.get("error")
                                    or "the cache cannot be flushed now (requests are running)"))
        return {"success": True, "message": "cache flushed", **reply.data}

    # ---- LoRA adapters (server/serving_lora.py) ----------------------------------------------------
    @app.post("/load_lora_adapter")
    @app.post("/v1/load_lora_adapter", operation_id="load_lora_adapter_v1")
    async def load_lora(req: LoadLoraAdapterRequest):
        return await load_lora_adapter(ctx, req)

    @app.post("/unload_lora_adapter")
    @app.post("/v1/unload_lora_adapter", operation_id="unload_lora_adapter_v1")
    async def unload_lora(req: UnloadLoraAdapterRequest):
        return await unload_lora_adapter(ctx, req)

    @app.get("/metrics")
    async def metrics():
        stats = await current_stats() if tm.healthy else None
        state.metrics.set_scheduler_stats(stats, scheduler_up=tm.healthy)
        return Response(state.metrics.render(), media_type=METRICS_CONTENT_TYPE)

    # ---- generation routes (server/serving_*.py) ------------------------------------------------

    # A pooling server (--is-embedding / --is-reranker) answers the generation routes with a 400 naming what it
    # serves, in each API's own error shape (the handlers pick it by path).
    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        ctx.require_task("generate", "/v1/completions")
        return await create_completion(ctx, req, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, request: Request):
        ctx.require_task("generate", "/v1/chat/completions")
        return await create_chat_completion(ctx, req, request)

    # The Anthropic Messages API (server/serving_messages.py); its errors have Anthropic's shape.
    anthropic_errors = {
        "4XX": {"model": AnthropicErrorResponse, "description": "A client error (Anthropic error body)"},
        "5XX": {"model": AnthropicErrorResponse, "description": "The engine failed or stopped"}}

    @app.post("/v1/messages", responses={200: {"model": AnthropicMessageResponse}, **anthropic_errors})
    async def messages(req: AnthropicMessagesRequest, request: Request):
        ctx.require_task("generate", "/v1/messages")
        return await create_message(ctx, req, request)

    @app.post("/v1/messages/count_tokens", responses={200: {"model": AnthropicTokenCount}, **anthropic_errors})
    async def messages_count_tokens(req: AnthropicCountTokensRequest):
        return await count_tokens(ctx, req)

    responses_store = ResponseStore()

    @app.post("/v1/responses")
    async def responses_create(req: ResponsesRequest, request: Request):
        ctx.require_task("generate", "/v1/responses")
        return await create_response(ctx, responses_store, req, request)

    @app.get("/v1/responses/{response_id}")
    async def responses_retrieve(response_id: str):
        return retrieve_response(responses_store, response_id)

    @app.delete("/v1/responses/{response_id}")
    async def responses_delete(response_id: str):
        return delete_response(responses_store, response_id)

    @app.post("/generate")
    async def generate_route(req: GenerateRequest, request: Request):
        ctx.require_task("generate", "/generate")
        return await generate(ctx, req, request)

    # ---- pooling routes (server/serving_embedding.py, serving_rerank.py, serving_score.py) ----------------

    @app.post("/v1/embeddings", responses={200: {"model": EmbeddingResponse}})
    async def embeddings(req: EmbeddingRequest, request: Request):
        return await create_embedding(ctx, req, request)

    @app.post("/v1/rerank", responses={200: {"model": RerankResponse}})
    async def rerank(req: RerankRequest, request: Request):
        return await create_rerank(ctx, req, request)

    @app.post("/v1/score", responses={200: {"model": ScoreResponse}})
    async def score(req: ScoreRequest, request: Request):
        return await create_score(ctx, req, request)

    @app.post("/tokenize")
    @app.post("/v1/tokenize")
    async def tokenize_route(req: TokenizeRequest):
        return await tokenize(ctx, req)

    @app.post("/detokenize")
    @app.post("/v1/detokenize")
    async def detokenize_route(req: DetokenizeRequest):
        return await detokenize(ctx, req)

    return app


def capabilities(args: ServerArgs, chat_format: ChatFormat, pooling=None, vision: bool = False) -> dict:
    """What this server implements beyond plain generation (in /v1/models and /server_info); a pooling server's
    task and endpoints."""
    if pooling is not None:
        if pooling.task == "embed":
            return {"task": "embed", "endpoints": ["/v1/embeddings"], "pooling": pooling.pooling,
                    "normalize": pooling.normalize, "embedding_fields": ["encoding_format", "dimensions"]}
        return {"task": "rerank", "endpoints": ["/v1/rerank", "/v1/score"], "reranker": pooling.reranker}
    grammar = args.grammar_backend != "none"
    return {
        "structured_outputs": ["json_object", "json_schema", "regex", "ebnf"] if grammar else [],
        "grammar_backend": args.grammar_backend,
        "tool_choice": ["none", "auto"] + (["required", "named"] if grammar else []),
        "tool_call_parser": chat_format.tool_parser,
        # flag, template (detected), default (duet's format: the template renders no tools) or unknown
        "tool_call_format": chat_format.tool_source,
        "reasoning_parser": chat_format.reasoning_parser,
        "sampling": ["temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "min_tokens",
                     "ignore_eos", "logprobs", "top_logprobs", "presence_penalty", "frequency_penalty",
                     "repetition_penalty", "logit_bias", "n"],
        "output_text": ["skip_special_tokens", "spaces_between_special_tokens", "include_stop_str_in_output",
                        "return_tokens_as_token_ids"],
        "chat_template": ["chat_template_kwargs", "add_generation_prompt", "continue_final_message"],
        "prompt_logprobs": ["echo with logprobs", "prompt_logprobs", "logprob_start_len"],
        "accepted_without_effect": ["user", "store", "metadata", "service_tier", "safety_identifier",
                                    "prompt_cache_key"],
        # image_url parts (chat), image blocks (/v1/messages), input_image (/v1/responses): docs/vision.md
        "images": vision,
        "not_supported": ["best_of > n", "suffix", "audio content" if vision else "image/audio content",
                          "functions/function_call (use tools)", "priority other than 0"],
    }


def served_name(args: ServerArgs) -> str:
    return args.served_model_name or Path(str(args.model_path)).name

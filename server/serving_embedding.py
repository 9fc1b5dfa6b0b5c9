"""/v1/embeddings (OpenAI's API) on an embedding server (--is-embedding): each input is one pooling request
through the scheduler (batched with the others, chunked when long); its pooled final hidden state is
L2-normalised when the model's sentence-transformers config has a Normalize module (or has no such config),
cut to `dimensions` first (Matryoshka), and sent as floats or base64 (little-endian float32)."""

from __future__ import annotations

import base64
import uuid

import numpy as np
from fastapi import Request

from model_executor.sampling_params import SamplingParams
from server.protocol import ApiError
from server.protocol_embedding import (
    MAX_EMBEDDING_INPUTS,
    EmbeddingData,
    EmbeddingRequest,
    EmbeddingResponse,
    EmbeddingUsage,
)
from server.serving_common import ServingContext, unless_disconnected
from server.tokenizer_manager import GenRequest


async def create_embedding(ctx: ServingContext, req: EmbeddingRequest, request: Request):
    model = ctx.check_model(req.model)
    ctx.require_task("embed", "/v1/embeddings")
    tm = ctx.tm
    hidden = int(tm.info.get("hidden_size") or 0)
    if req.dimensions is not None and not 1 <= req.dimensions <= hidden:
        raise ApiError(400, f"dimensions must be in [1, {hidden}] (the model's embedding size), got "
                            f"{req.dimensions}", "dimensions")
    prompts = await encode_inputs(ctx, req.input)
    tm.check_alive()
    spec = ctx.pooling_spec()
    gen = [GenRequest(ids, SamplingParams(max_new_tokens=0), pooling=spec) for ids in prompts]
    chunks = await unless_disconnected(request, tm.pool(gen, f"embd-{uuid.uuid4().hex}"))
    if not isinstance(chunks, list):
        return chunks  # the client left
    data = [EmbeddingData(index=i, embedding=encode_vector(finish_vector(c.embedding, req.dimensions,
                                                                         ctx.pooling.normalize),
                                                           req.encoding_format))
            for i, c in enumerate(chunks)]
    used = sum(len(p) for p in prompts)
    return EmbeddingResponse(data=data, model=model, usage=EmbeddingUsage(prompt_tokens=used, total_tokens=used))


async def encode_inputs(ctx: ServingContext, value) -> list[list[int]]:
    """`input` as token id lists: a string, strings, token ids, or lists of token ids; each checked."""
    tm = ctx.tm
    if isinstance(value, str) or value and isinstance(value[0], int):
        value = [value]
    if not value:
        raise ApiError(400, "input is empty", "input")
    if len(value) > MAX_EMBEDDING_INPUTS:
        raise ApiError(400, f"input has {len(value)} items; at most {MAX_EMBEDDING_INPUTS} per request", "input")
    if isinstance(value[0], str):
        if any(not s for s in value):
            raise ApiError(400, "input contains an empty string", "input")
        prompts = await tm.encode_prompts_async(value)
    else:
        prompts = [list(ids) for ids in value]
    for i, ids in enumerate(prompts):
        where = "input" if len(prompts) == 1 else f"input[{i}]"
        if not ids:
            raise ApiError(400, f"{where} is empty", "input")
        tm.check_token_ids(ids, "input")
        check_pooling_length(ctx, len(ids), where, "input")
    return prompts


def check_pooling_length(ctx: ServingContext, n: int, where: str, param: str) -> None:
    limit = ctx.tm.max_total_len
    if n > limit:
        raise ApiError(400, f"{where} has {n} tokens; this server takes at most {limit} per input (its context "
                            "length or KV cache size). Please shorten it.", param)


def finish_vector(vec: np.ndarray, dimensions: int | None, normalize: bool) -> np.ndarray:
    """The first `dimensions` values, then the L2 normalisation (Matryoshka: cut, then normalise again)."""
    vec = np.asarray(vec, dtype=np.float32)
    if dimensions is not None:
        vec = vec[:dimensions]
    if normalize:
        norm = float(np.linalg.norm(vec.astype(np.float64)))
        if norm > 0:
            vec = (vec / norm).astype(np.float32)
    return vec


def encode_vector(vec: np.ndarray, encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":
        return base64.b64encode(vec.astype("<f4").tobytes()).decode("ascii")
    return vec.tolist()

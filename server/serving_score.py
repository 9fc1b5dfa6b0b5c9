"""/v1/score (vLLM's API) on a reranker server: text_1 against each text_2 (one against one or many), or two
lists of the same length pairwise; each pair scored as /v1/rerank scores a (query, document)
(server/serving_rerank.py)."""

from __future__ import annotations

import time
import uuid

from fastapi import Request

from server.protocol import ApiError
from server.protocol_embedding import EmbeddingUsage, ScoreData, ScoreRequest, ScoreResponse
from server.serving_common import ServingContext
from server.serving_rerank import score_pairs


async def create_score(ctx: ServingContext, req: ScoreRequest, request: Request):
    model = ctx.check_model(req.model)
    ctx.require_task("rerank", "/v1/score")
    first = [req.text_1] if isinstance(req.text_1, str) else list(req.text_1)
    second = [req.text_2] if isinstance(req.text_2, str) else list(req.text_2)
    if not first:
        raise ApiError(400, "text_1 is empty", "text_1")
    if not second:
        raise ApiError(400, "text_2 is empty", "text_2")
    if len(first) == 1:
        first = first * len(second)
    elif len(first) != len(second):
        raise ApiError(400, f"text_1 has {len(first)} texts and text_2 {len(second)}: give one text_1, or as many "
                            "text_2 as text_1", "text_2")
    scored = await score_pairs(ctx, request, first, second, req.instruction, "text_2", "score")
    if not isinstance(scored, tuple):
        return scored
    scores, used = scored
    return ScoreResponse(id=f"score-{uuid.uuid4().hex}", created=int(time.time()), model=model,
                         data=[ScoreData(index=i, score=s) for i, s in enumerate(scores)],
                         usage=EmbeddingUsage(prompt_tokens=used, total_tokens=used))

"""/v1/rerank (the request and response shape of Jina's, Cohere's and vLLM's rerank APIs) on a reranker server
(--is-reranker), and the (query, document) scoring /v1/score shares.

Each pair is one pooling request through the scheduler, which returns the last position's logits:
- a *ForSequenceClassification model (a cross-encoder): the pair is encoded as the tokenizer encodes a text
  pair, and the score is the sigmoid of its one label's logit;
- a causal LM as Qwen3-Reranker: the pair is written into Qwen3-Reranker's prompt (system message, then
  `<Instruct>: ... <Query>: ... <Document>: ...`, then an empty think block), and the score is p("yes") of the
  softmax over the "no" and "yes" logits.
"""

from __future__ import annotations

import asyncio
import math
import uuid

from fastapi import Request

from model_executor.sampling_params import SamplingParams
from server.protocol import ApiError
from server.protocol_embedding import (
    MAX_RERANK_DOCUMENTS,
    RerankDocument,
    RerankRequest,
    RerankResponse,
    RerankResult,
    RerankUsage,
)
from server.serving_common import ServingContext, unless_disconnected
from server.serving_embedding import check_pooling_length
from server.tokenizer_manager import THREAD_TOKENIZE_CHARS, GenRequest

# Qwen3-Reranker's prompt (its model card's), around "<Instruct>: {instruction}\n<Query>: {query}\n<Document>: {doc}"
QWEN3_RERANKER_PREFIX = ("<|im_start|>system\nJudge whether the Document meets the requirements based on the Query "
                         "and the Instruct provided. Note that the answer can only be \"yes\" or \"no\"."
                         "<|im_end|>\n<|im_start|>user\n")
QWEN3_RERANKER_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
DEFAULT_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"


def yes_no_token_ids(tokenizer) -> tuple[int, int]:
    """The "no" and "yes" tokens a yes/no reranker is scored by; ValueError when the vocabulary lacks one."""
    ids = []
    for word in ("no", "yes"):
        tid = tokenizer.convert_tokens_to_ids(word)
        if tid is None or tid == tokenizer.unk_token_id:
            raise ValueError(f"--is-reranker: the tokenizer has no token {word!r}, which a yes/no reranker "
                             "(Qwen3-Reranker) is scored by")
        ids.append(int(tid))
    return ids[0], ids[1]


def encode_pairs(ctx: ServingContext, queries: list[str], documents: list[str],
                 instruction: str | None) -> list[list[int]]:
    """The token ids of each (query, document) pair, as the model is scored on them."""
    tok = ctx.tm.tokenizer
    if ctx.pooling.reranker == "classifier":
        if instruction is not None:
            raise ApiError(400, "instruction applies to yes/no rerankers (Qwen3-Reranker); this model scores "
                                "with a classification head", "instruction")
        return [tok(q, d)["input_ids"] for q, d in zip(queries, documents)]
    inst = DEFAULT_INSTRUCTION if instruction is None else instruction
    prefix = tok.encode(QWEN3_RERANKER_PREFIX, add_special_tokens=False)
    suffix = tok.encode(QWEN3_RERANKER_SUFFIX, add_special_tokens=False)
    return [prefix + tok.encode(f"<Instruct>: {inst}\n<Query>: {q}\n<Document>: {d}", add_special_tokens=False)
            + suffix for q, d in zip(queries, documents)]


def score_of(ctx: ServingContext, vec) -> float:
    """A pair's relevance in [0, 1] from its last-position logits (see the module's text)."""
    if ctx.pooling.reranker == "classifier":
        x = float(vec[0])
    else:
        no, yes = float(vec[0]), float(vec[1])
        x = yes - no  # softmax over [no, yes] -> p(yes) = sigmoid(yes - no)
    return 1.0 / (1.0 + math.exp(-x)) if x >= 0 else math.exp(x) / (1.0 + math.exp(x))


async def score_pairs(ctx: ServingContext, request: Request, queries: list[str], documents: list[str],
                      instruction: str | None, param: str, prefix: str) -> tuple[list[float], int] | object:
    """Scores of the pairs and the tokens they took; or the 499 Response when the client left."""
    tm = ctx.tm
    if len(documents) > MAX_RERANK_DOCUMENTS:
        raise ApiError(400, f"{param} has {len(documents)} items; at most {MAX_RERANK_DOCUMENTS} per request", param)
    if sum(len(q) + len(d) for q, d in zip(queries, documents)) < THREAD_TOKENIZE_CHARS:
        prompts = encode_pairs(ctx, queries, documents, instruction)
    else:
        prompts = await asyncio.to_thread(encode_pairs, ctx, queries, documents, instruction)
    for i, ids in enumerate(prompts):
        check_pooling_length(ctx, len(ids), f"the pair of {param}[{i}]", param)
    tm.check_alive()
    spec = ctx.pooling_spec()
    gen = [GenRequest(ids, SamplingParams(max_new_tokens=0), pooling=spec) for ids in prompts]
    chunks = await unless_disconnected(request, tm.pool(gen, f"{prefix}-{uuid.uuid4().hex}"))
    if not isinstance(chunks, list):
        return chunks
    return [score_of(ctx, c.embedding) for c in chunks], sum(len(p) for p in prompts)


async def create_rerank(ctx: ServingContext, req: RerankRequest, request: Request):
    model = ctx.check_model(req.model)
    ctx.require_task("rerank", "/v1/rerank")
    if not req.documents:
        raise ApiError(400, "documents is empty", "documents")
    if req.top_n is not None and req.top_n < 1:
        raise ApiError(400, f"top_n must be at least 1, got {req.top_n}", "top_n")
    scored = await score_pairs(ctx, request, [req.query] * len(req.documents), req.documents, req.instruction,
                               "documents", "rerank")
    if not isinstance(scored, tuple):
        return scored
    scores, used = scored
    order = sorted(range(len(scores)), key=lambda i: -scores[i])[: req.top_n]
    results = [RerankResult(index=i, relevance_score=scores[i],
                            document=RerankDocument(text=req.documents[i]) if req.return_documents else None)
               for i in order]
    return RerankResponse(id=f"rerank-{uuid.uuid4().hex}", model=model, results=results,
                          usage=RerankUsage(total_tokens=used)).model_dump(exclude_none=True)

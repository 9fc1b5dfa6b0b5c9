"""Request and response models of the pooling endpoints: /v1/embeddings (OpenAI's), /v1/rerank (the shape of
Jina's, Cohere's and vLLM's rerank APIs) and /v1/score (vLLM's). As everywhere, an unknown field is a 400
naming it."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from server.protocol import _Request, _Response

MAX_EMBEDDING_INPUTS = 2048  # OpenAI's limit on inputs per request
MAX_RERANK_DOCUMENTS = 1024  # pairs per /v1/rerank or /v1/score request


class EmbeddingRequest(_Request):
    # A string, a list of strings, a list of token ids, or a list of lists of token ids.
    input: str | list[int] | list[str] | list[list[int]]
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None  # Matryoshka: the first `dimensions` values, L2-normalised again
    user: object | None = None  # no effect on a single server (NOOP_FIELDS)


class RerankRequest(_Request):
    query: str
    documents: list[str]
    model: str | None = None
    top_n: int | None = None  # the best top_n results only (default: all)
    return_documents: bool = True  # each result carries {"text": document}
    # A Qwen3-Reranker's task instruction (its prompt's <Instruct>); the default is the model card's.
    instruction: str | None = None
    user: object | None = None


class ScoreRequest(_Request):
    # One text against one or many, or two lists of the same length, scored pairwise.
    text_1: str | list[str]
    text_2: str | list[str]
    model: str | None = None
    instruction: str | None = None  # (RerankRequest's)
    user: object | None = None


# ---- responses ----------------------------------------------------------------------------------


class EmbeddingUsage(_Response):
    prompt_tokens: int
    total_tokens: int


class EmbeddingData(_Response):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str  # base64: little-endian float32, as OpenAI's


class EmbeddingResponse(_Response):
    object: Literal["list"] = "list"
    data: list[EmbeddingData] = Field(default_factory=list)
    model: str
    usage: EmbeddingUsage


class RerankDocument(_Response):
    text: str


class RerankResult(_Response):
    index: int
    relevance_score: float
    document: RerankDocument | None = None


class RerankUsage(_Response):
    total_tokens: int


class RerankResponse(_Response):
    id: str
    model: str
    results: list[RerankResult] = Field(default_factory=list)
    usage: RerankUsage


class ScoreData(_Response):
    index: int
    object: Literal["score"] = "score"
    score: float


class ScoreResponse(_Response):
    id: str
    object: Literal["list"] = "list"
    created: int
    model: str
    data: list[ScoreData] = Field(default_factory=list)
    usage: EmbeddingUsage

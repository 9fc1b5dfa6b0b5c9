"""The messages between the HTTP process, the scheduler and the detokenizer (scheduler/ipc.py carries them).

One dataclass per intent; token and text outputs are batched per scheduler step. The scheduler owns these
types: the server (tokenizer manager, detokenizer) imports them from here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from model_executor.sampling_params import SamplingParams

# ---- HTTP process -> scheduler ----------------------------------------------------------------


@dataclass(frozen=True)
class PoolingSpec:
    """A pooling request (embedding, reranking): prefilled like any prompt, it returns one vector instead of
    sampled tokens. kind: "last", "mean" or "cls" pool the final hidden states (the last token's, the mean of
    all, the first token's); "logits" takes the last position's logits at token_ids (all of them when empty:
    a classification head's labels)."""

    kind: str
    token_ids: tuple[int, ...] = ()

    @property
    def needs_every_row(self) -> bool:
        """Mean and cls pooling read hidden states a cached prefix would skip: no prefix cache for them."""
        return self.kind in ("mean", "cls")


@dataclass(frozen=True)
class ImageInput:
    """One image of a prompt, processed by the model's image processor in the HTTP process: its patches
    (pixel_values, a float32 numpy array [patches, C * temporal_patch * patch * patch]), their grid (t, h, w),
    where its num_tokens pad tokens start in the prompt, and a hash of its pixels (the prefix cache's key for
    those tokens)."""

    pixel_values: object
    grid_thw: tuple[int, int, int]
    offset: int
    num_tokens: int
    content_hash: int


@dataclass
class TokenizedGenerateReq:
    rid: str
    input_ids: list[int]
    params: SamplingParams
    pooling: PoolingSpec | None = None  # a pooling request (params.max_new_tokens 0)
    lora_name: str | None = None  # the LoRA adapter it runs with (None: the base model)
    images: list[ImageInput] | None = None  # a multimodal prompt's images, in prompt order
    # Decoded prompt text is not needed by the scheduler; stop strings are checked on output tokens.


@dataclass
class AbortReq:
    rid: str


@dataclass
class FlushCacheReq:
    rid: str  # the control request's id, echoed in the reply


@dataclass
class GetStatsReq:
    rid: str


@dataclass
class LoadLoraReq:
    rid: str
    lora_name: str
    lora_path: str
    pinned: bool = False


@dataclass
class UnloadLoraReq:
    rid: str
    lora_name: str


# ---- scheduler -> detokenizer -> HTTP process -------------------------------------------------


@dataclass
class FinishReason:
    kind: str  # "stop" | "length" | "abort" | "error" | "invalid" (the request cannot be done as asked: HTTP 400)
    matched: int | str | None = None  # the stop token id or stop string that ended the request
    message: str | None = None  # for "error", "invalid" and "abort"

    @property
    def openai_reason(self) -> str:
        return {"stop": "stop", "length": "length"}.get(self.kind, "abort")


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)  # best alternatives, descending


@dataclass
class PromptLogprobs:
    """Logprobs of the prompt tokens at positions first, first + 1, ..., each given the tokens before it, as
    columns (compact for long prompts). rank: 1 for the most likely token. top: the best alternatives, best
    first, as many as the request asked for."""

    first: int
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    ranks: list[int] = field(default_factory=list)
    top_ids: list[list[int]] = field(default_factory=list)
    top_logprobs: list[list[float]] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.token_ids)

    def extend(self, other: PromptLogprobs) -> None:
        """Append the positions that follow (the next chunk of the same prompt)."""
        assert other.first == self.first + len(self), "prompt logprob chunks must be contiguous"
        self.token_ids += other.token_ids
        self.logprobs += other.logprobs
        self.ranks += other.ranks
        self.top_ids += other.top_ids
        self.top_logprobs += other.top_logprobs


@dataclass(frozen=True)
class SpecCounts:
    """One request's speculative decoding so far (SGLang's meta_info names)."""

    spec_verify_ct: int  # decode steps that verified drafts of it
    spec_accept_token_num: int  # drafts accepted
    spec_draft_token_num: int  # drafts verified

    def meta(self) -> dict:
        ct = self.spec_verify_ct
        return {"spec_verify_ct": ct, "spec_accept_token_num": self.spec_accept_token_num,
                "spec_draft_token_num": self.spec_draft_token_num,
                # tokens emitted per verify step (accepted drafts + the token after them)
                "spec_accept_length": round((self.spec_accept_token_num + ct) / ct, 4) if ct else 0.0}


# Prompt tokens sent along with a request's first output tokens: the detokenizer decodes after them.
DETOKENIZER_CONTEXT_TOKENS = 5


@dataclass
class BatchTokenOut:
    """New output tokens of every request that advanced in one scheduler step."""

    rids: list[str]
    new_token_ids: list[list[int]]
    finished: list[FinishReason | None]
    prompt_tokens: list[int]
    completion_tokens: list[int]
    cached_tokens: list[int]
    logprobs: list[list[TokenLogprob] | None]
    # The last prompt tokens of each request reporting its first output (else empty): the detokenizer's
    # context. None: no context for any request.
    context_ids: list[list[int]] | None = None
    # Prompt logprobs, sent with a request's first output tokens (else None). None: none in this batch.
    prompt_logprobs: list[PromptLogprobs | None] | None = None
    # SamplingParams.decode_options of each request reporting its first output, when not the defaults (else
    # None). None: defaults for every request in this batch.
    decode_options: list[tuple | None] | None = None
    # The pooled vector (float32 numpy array) of each pooling request that finished (else None). None: no
    # pooling output in this batch.
    embeddings: list | None = None
    # Speculative decoding: each request's SpecCounts so far (verify steps, accepted drafts, drafts), or None
    # for all when speculation is off.
    spec_counts: list[SpecCounts | None] | None = None


@dataclass
class BatchStrOut:
    """Incremental text deltas plus token data; the HTTP side trims stop strings (it knows each request's)."""

    rids: list[str]
    text_deltas: list[str]
    new_token_ids: list[list[int]]
    finished: list[FinishReason | None]
    prompt_tokens: list[int]
    completion_tokens: list[int]
    cached_tokens: list[int]
    logprobs: list[list[TokenLogprob] | None]
    prompt_logprobs: list[PromptLogprobs | None] | None = None
    embeddings: list | None = None  # (BatchTokenOut's)
    spec_counts: list[SpecCounts | None] | None = None  # (BatchTokenOut's)


# ---- scheduler -> HTTP process (control replies) ----------------------------------------------


@dataclass
class ControlReply:
    rid: str
    ok: bool
    data: dict = field(default_factory=dict)

"""Req: one request's state inside the scheduler (tokens, KV held, prefix matched, finish reason)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum, auto

import torch

from model_executor.sampling_params import SamplingParams
from scheduler.io_struct import FinishReason, PoolingSpec, PromptLogprobs, TokenLogprob


class ReqStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


@dataclass(eq=False)
class Req:
    rid: str
    input_ids: list[int]
    params: SamplingParams
    output_ids: list[int] = field(default_factory=list)
    status: ReqStatus = ReqStatus.WAITING
    finish_reason: FinishReason | None = None
    # KV state: req_to_token[req_pool_idx, :kv_len] are this request's slots; the first
    # len(prefix_slots) of them belong to the radix tree (locked through last_node).
    req_pool_idx: int | None = None
    kv_len: int = 0
    prefix_slots: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.int64))
    last_node: object | None = None
    cached_tokens: int = 0  # prompt tokens served from the prefix cache at first admission
    # Tokens sampled by launched batches; ahead of len(output_ids) while a batch's tokens are in flight
    # (overlap scheduling). The index of the token the next step samples (seeded sampling, min_tokens).
    num_sampled: int = 0
    num_retractions: int = 0
    # Output not yet reported to the client.
    pending_ids: list[int] = field(default_factory=list)
    pending_logprobs: list[TokenLogprob] = field(default_factory=list)
    arrival_time: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None
    # Structured output (scheduler/grammar.py): the compilation in flight, then this request's matcher.
    grammar_future: object | None = None
    grammar: object | None = None
    # Prompt logprobs (scheduler/prompt_logprobs.py): the next prompt position whose hidden state is scored
    # (its logits give the token after it); None when none are wanted or all are scored. What was scored and
    # not yet reported goes out with the first output token.
    prompt_logprob_next: int | None = field(init=False, default=None)
    pending_prompt_logprobs: PromptLogprobs | None = None
    # A pooling request (io_struct.PoolingSpec): it never samples; after its last prompt chunk it finishes with
    # `embedding` (a float32 numpy array). pool_sum / pool_first: mean / cls pooling's state across chunks.
    pooling: PoolingSpec | None = None
    embedding: object | None = None
    pool_sum: torch.Tensor | None = None
    pool_first: torch.Tensor | None = None
    # Speculative decoding (scheduler/speculative.py): the request's drafting state and counts, made on first use.
    spec: object | None = None
    # Derived once from params for the per-step checks (Scheduler._add_request lowers max_output to what the
    # context length leaves): the request stops by length once it has max_output tokens, and on any token of
    # stop_ids (its stop_token_ids, and EOS unless ignore_eos) once it has min_new_tokens.
    # The LoRA adapter the request runs with (LoraManager's id; None: the base model). Also its prefix cache's
    # namespace: KV computed under one adapter is never reused under another.
    lora_id: int | None = None
    # A prompt with images (scheduler/multimodal.py): positions, prefix-cache key, embeddings between chunks.
    mm: object | None = None
    max_output: int = field(init=False)
    stop_ids: frozenset[int] = field(init=False)

    def __post_init__(self):
        self.max_output = self.params.max_new_tokens
        self.stop_ids = frozenset(self.params.stop_token_ids)
        start = self.params.prompt_logprob_start
        # The last prompt position is the sampling row: scored rows end before it.
        if start is not None and start < len(self.input_ids) - 1:
            self.prompt_logprob_next = start

    @property
    def fill_ids(self) -> list[int]:
        """Every token that must have KV before the next token is sampled."""
        return self.input_ids + self.output_ids

    @property
    def cache_key(self) -> list[int]:
        """fill_ids as the prefix cache keys them: each image's pad tokens as its content's value."""
        return self.fill_ids if self.mm is None else self.mm.cache_ids + self.output_ids

    @property
    def seq_len(self) -> int:
        return len(self.input_ids) + len(self.output_ids)

    @property
    def num_uncomputed(self) -> int:
        """Tokens still to prefill (0 for a request that is decoding)."""
        return self.seq_len - self.kv_len

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def wants_logprobs(self) -> bool:
        return self.params.top_logprobs is not None

    @property
    def remaining_new_tokens(self) -> int:
        return max(0, self.params.max_new_tokens - len(self.output_ids))

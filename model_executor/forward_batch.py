"""ForwardBatch: the one context object a forward pass gets (ids, positions, lengths, KV slots)."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum, auto
from functools import cached_property
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from model_executor.layers.attention.base import AttentionBackend
    from model_executor.lora.layer import LoraBatch
    from model_executor.memory_pool import KVCache, ReqToTokenPool
    from model_executor.pooling import PooledHidden, PoolingPlan
    from model_executor.prompt_logprobs import PromptLogprobPlan, PromptLogprobsOutput


@dataclass
class MultimodalBatch:
    """An extend batch's multimodal inputs: positions [3, tokens] (t, h, w; a text token's are its position three
    times), and the image embeddings [K, H] that replace the input embeddings of the K batch rows embed_rows (the
    image pad tokens of this chunk; None: no image token in the chunk)."""

    positions: torch.Tensor
    embed_rows: torch.Tensor | None = None
    embeds: torch.Tensor | None = None


class ForwardMode(Enum):
    EXTEND = auto()  # prefill of new tokens, possibly after a cached prefix
    DECODE = auto()  # exactly one new token per request

    def is_decode(self) -> bool:
        return self is ForwardMode.DECODE

    def is_extend(self) -> bool:
        return self is ForwardMode.EXTEND


@dataclass
class ForwardBatch:
    mode: ForwardMode
    batch_size: int
    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    req_pool_indices: torch.Tensor  # [bs] int64, rows of req_to_token
    seq_lens: torch.Tensor  # [bs] int64 (the other index rows' dtype), total KV length after this step
    out_cache_loc: torch.Tensor  # [num_tokens] int64, KV slot written by each new token
    req_to_token_pool: ReqToTokenPool
    kv_cache: KVCache
    attn_backend: AttentionBackend
    seq_lens_cpu: list[int]
    # Extend only: new tokens per request and where each request's tokens start in input_ids.
    extend_seq_lens: torch.Tensor | None = None  # [bs] int32
    extend_start_loc: torch.Tensor | None = None  # [bs] int32
    extend_seq_lens_cpu: list[int] | None = None
    # Extend graphs (runners/full_extend_graph_runner.py): a static batch's bound on every request's new
    # tokens, whatever lengths are replayed into its buffers (a captured kernel keeps the grid it was sized for).
    max_extend_len_bound: int | None = None
    # Extend only: prompt rows to score besides the last tokens (set by the scheduler), and their scores
    # (set by the logits head).
    prompt_logprob_plan: PromptLogprobPlan | None = None
    prompt_logprobs: PromptLogprobsOutput | None = None
    # Extend only: the batch has pooling requests (set by the scheduler); their pooled final hidden states (set
    # by the logits head, model_executor/pooling.py).
    pooling_plan: PoolingPlan | None = None
    pooled: PooledHidden | None = None
    # Set by a target model that captures the hidden states an EAGLE-3 draft head reads
    # (LlamaForCausalLM.set_aux_hidden_state_layers): [num_tokens, layers * H], the layers' outputs side by side.
    aux_hidden_states: torch.Tensor | None = None
    # Where the LM head writes the float32 logits [bs, vocab], if given (a decode graph's static output: the
    # logits land there without a copy after the head); None: a new tensor.
    logits_out: torch.Tensor | None = None
    # Extend only: logits of every token instead of each request's last (a speculative verify batch, whose
    # tokens are [last sampled token, drafts...] per request: the logits at each give the next token's).
    all_token_logits: bool = False
    # Extend only, with a multimodal model: the batch's M-RoPE positions and image embeddings (None: every
    # token's position is its text position, and no image token is in the batch).
    mm: MultimodalBatch | None = None
    # The requests' LoRA adapters (model_executor/lora/layer.py: each token's pool slot); None: none uses one.
    lora: LoraBatch | None = None

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]

    @cached_property
    def max_extend_len(self) -> int:
        """Extend only: the longest request's new tokens, or the static batch's bound on them (sizes kernel grids;
        computed once per batch)."""
        if self.max_extend_len_bound is not None:
            return self.max_extend_len_bound
        return max(self.extend_seq_lens_cpu or (), default=0)

    @property
    def extend_prefix_lens_cpu(self) -> list[int]:
        assert self.extend_seq_lens_cpu is not None
        return [s - e for s, e in zip(self.seq_lens_cpu, self.extend_seq_lens_cpu)]

    @classmethod
    def build(
        cls,
        mode: ForwardMode,
        input_ids: list[int],
        req_pool_indices: list[int],
        seq_lens: list[int],
        out_cache_loc: torch.Tensor,
        *,
        extend_seq_lens: list[int] | None,
        req_to_token_pool: ReqToTokenPool,
        kv_cache: KVCache,
        attn_backend: AttentionBackend,
        device: torch.device | str,
    ) -> ForwardBatch:
        """Build the batch tensors from host lists (one host-to-device copy per field)."""
        bs = len(seq_lens)
        if mode.is_decode():
            positions = [s - 1 for s in seq_lens]
            ext, start = None, None
        else:
            assert extend_seq_lens is not None and len(extend_seq_lens) == bs
            positions = [p for s, e in zip(seq_lens, extend_seq_lens) for p in range(s - e, s)]
            starts, acc = [], 0
            for e in extend_seq_lens:
                starts.append(acc)
                acc += e
            ext = torch.tensor(extend_seq_lens, dtype=torch.int32, device=device)
            start = torch.tensor(starts, dtype=torch.int32, device=device)
        return cls(
            mode=mode,
            batch_size=bs,
            input_ids=torch.tensor(input_ids, dtype=torch.int64, device=device),
            positions=torch.tensor(positions, dtype=torch.int64, device=device),
            req_pool_indices=torch.tensor(req_pool_indices, dtype=torch.int64, device=device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int64, device=device),
            out_cache_loc=out_cache_loc.to(device=device, dtype=torch.int64),
            req_to_token_pool=req_to_token_pool,
            kv_cache=kv_cache,
            attn_backend=attn_backend,
            seq_lens_cpu=list(seq_lens),
            extend_seq_lens=ext,
            extend_start_loc=start,
            extend_seq_lens_cpu=list(extend_seq_lens) if extend_seq_lens is not None else None,
        )

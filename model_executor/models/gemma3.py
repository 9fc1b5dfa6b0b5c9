"""Gemma 3 text (`Gemma3ForCausalLM`, and the text tower of `Gemma3ForConditionalGeneration` checkpoints).

Each decoder layer: input norm -> attention -> post-attention norm -> + residual -> pre-feedforward norm -> MLP
(GELU-tanh gated) -> post-feedforward norm -> + residual. Its differences from the Llama block (llama.py):
- RMSNorm scales by (1 + w) (GemmaRMSNorm: the loader stores 1 + w, so the norm kernels take it as a plain
  weight), also for the per-head q / k norms;
- the embedding is scaled by sqrt(hidden_size), rounded to the model dtype first (as HF);
- attention scales by query_pre_attn_scalar ** -0.5; the sliding-window layers (5 of every 6 by default) turn
  with their own RoPE base (rope_local_base_freq) and no scaling, the global ones with rope_theta and
  rope_scaling;
- the final logits are capped by cap * tanh(logits / cap) where config.json has final_logit_softcapping;
- the LM head is tied to the embedding.
The norms around attention and the MLP run as their own kernels (the post-norms sit between a projection and
the residual add, where the Llama block fuses the add).

A multimodal checkpoint's tensors are named `language_model.model.*` (transformers 4) or
`model.language_model.*` (transformers 5); its vision tower and projector are not loaded.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from model_executor.forward_batch import ForwardBatch
from model_executor.layers.attention.radix_attention import RadixAttention
from model_executor.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from model_executor.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    default_weight_loader,
)
from model_executor.layers.norm import RMSNorm
from model_executor.layers.rotary import RotaryEmbedding
from model_executor.lazy_slice import materialize
from model_executor.model_config import ModelConfig
from model_executor.models.llama import OwnBackboneForCausalLM


def _gemma_norm_loader(param: torch.Tensor, loaded: torch.Tensor, shard_id=None) -> None:
    """A Gemma norm's checkpoint weight w, stored as the 1 + w the norm multiplies by (computed in float32)."""
    default_weight_loader(param, (1.0 + materialize(loaded).float()).to(param.dtype))


class GemmaRMSNorm(RMSNorm):
    """x / rms(x) * (1 + w): the weight parameter holds 1 + w (its loader adds the 1), so the fused norm kernels
    read it as any RMSNorm's. The plain path multiplies in float32 before the cast, as HF does."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__(hidden_size, eps)
        self.weight.weight_loader = _gemma_norm_loader

    def forward_native(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is not None:
            x = x + residual
            residual = x
        xf = x.float()
        out = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight.float()).to(x.dtype)
        return out if residual is None else (out, residual)


class SoftcappedLMHead(ParallelLMHead):
    """The LM head whose logits are capped: cap * tanh(logits / cap) (Gemma's final_logit_softcapping)."""

    def __init__(self, vocab_size: int, hidden_size: int, cap: float):
        super().__init__(vocab_size, hidden_size)
        self.cap = cap

    def forward(self, hidden, out: torch.Tensor | None = None) -> torch.Tensor:
        logits = super().forward(hidden, out=out)
        return logits.div_(self.cap).tanh_().mul_(self.cap)


class Gemma3MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(cfg.hidden_size, [cfg.intermediate_size] * 2)
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


class Gemma3Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, rotary_emb: RotaryEmbedding):
        super().__init__()
        hd = cfg.head_dim
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, hd, cfg.num_attention_heads, cfg.num_key_value_heads,
                                          bias=cfg.attention_bias)
        self.o_proj = RowParallelLinear(cfg.num_attention_heads * hd, cfg.hidden_size, bias=cfg.attention_bias)
        self.q_norm = GemmaRMSNorm(hd, cfg.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(hd, cfg.rms_norm_eps)
        self.attn = RadixAttention(layer_id, self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads, hd,
                                   cfg.query_pre_attn_scalar**-0.5, rotary_emb=rotary_emb,
                                   qk_norm=(self.q_norm, self.k_norm),
                                   sliding_window=cfg.layer_sliding_window(layer_id))

    def forward(self, positions: torch.Tensor, x: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        q, k, v = self.qkv_proj.split(self.qkv_proj(x))
        return self.o_proj(self.attn(q, k, v, fb, positions))


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, rotary_emb: RotaryEmbedding):
        super().__init__()
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.self_attn = Gemma3Attention(cfg, layer_id, rotary_emb)
        self.mlp = Gemma3MLP(cfg)
        self.input_layernorm = GemmaRMSNorm(h, eps)
        self.post_attention_layernorm = GemmaRMSNorm(h, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(h, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(h, eps)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None,
                fb: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, residual) after the layer: the stream is x + residual (the MLP's normed output and the sum
        before it)."""
        if residual is None:
            residual, x = hidden, self.input_layernorm(hidden)
        else:
            x, residual = self.input_layernorm(hidden, residual)
        x = self.post_attention_layernorm(self.self_attn(positions, x, fb))
        x, residual = self.pre_feedforward_layernorm(x, residual)
        return self.post_feedforward_layernorm(self.mlp(x)), residual


class Gemma3Model(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.embed_scale = cfg.hidden_size**0.5
        served = cfg.served_context_len
        table_len = max(cfg.max_position_embeddings, served or 0)
        # The global layers' table (rope_theta, rope_scaling) and the sliding-window layers' (their own base)
        self.rotary_emb = RotaryEmbedding(cfg.head_dim, table_len, cfg.rope_theta, cfg.rope_scaling,
                                          original_max_position=cfg.max_position_embeddings, seq_len=served)
        self.rotary_emb_local = RotaryEmbedding(cfg.head_dim, table_len, cfg.rope_local_theta,
                                                original_max_position=cfg.max_position_embeddings, seq_len=served)
        self.layers = nn.ModuleList(
            Gemma3DecoderLayer(cfg, i, self.rotary_emb_local if cfg.layer_sliding_window(i) else self.rotary_emb)
            for i in range(cfg.num_hidden_layers))
        self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        """The final norm's output, [tokens, H]."""
        hidden = self.embed_tokens(input_ids)
        # (HF rounds the scale to the model dtype before the multiply)
        hidden = hidden * torch.tensor(self.embed_scale, dtype=hidden.dtype, device=hidden.device)
        residual = None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual, fb)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class Gemma3ForCausalLM(OwnBackboneForCausalLM):
    """Loads through LlamaForCausalLM's mapping (q/k/v and gate/up into the fused layers)."""

    # Sharded as the Llama block: q/k/v heads and gate/up columns per rank; the per-head q/k norms, the norms
    # around the blocks, the embedding scale and the soft cap (after the LM head's gather) are whole on every rank.
    supports_tensor_parallel = True
    backbone_class = Gemma3Model

    def make_lm_head(self, cfg: ModelConfig) -> ParallelLMHead:
        cap = cfg.final_logit_softcapping
        return (SoftcappedLMHead(cfg.vocab_size, cfg.hidden_size, cap) if cap
                else ParallelLMHead(cfg.vocab_size, cfg.hidden_size))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return super().load_weights(_text_tower(weights))


def _text_tower(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """A checkpoint's text-model tensors under Gemma3ForCausalLM's names: a multimodal checkpoint's
    `language_model.model.X` / `model.language_model.X` as `model.X`, `language_model.lm_head.*` as `lm_head.*`;
    its vision tower and projector left out."""
    for name, tensor in weights:
        if name.startswith(("vision_tower.", "multi_modal_projector.", "model.vision_tower.",
                            "model.multi_modal_projector.")):
            continue
        if name.startswith("language_model.model."):
            name = "model." + name[len("language_model.model."):]
        elif name.startswith("language_model."):
            name = name[len("language_model."):]
        elif name.startswith("model.language_model."):
            name = "model." + name[len("model.language_model."):]
        yield name, tensor

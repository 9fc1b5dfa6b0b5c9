"""Llama-family decoder (Llama 2/3, SmolLM2, Mistral) and Qwen2/2.5 (the same block with q/k/v bias)."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from model_executor.forward_batch import ForwardBatch
from model_executor.layers.activation import SiluAndMul
from model_executor.layers.attention.radix_attention import RadixAttention
from model_executor.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from model_executor.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    default_weight_loader,
)
from model_executor.layers.logits import compute_logits
from model_executor.layers.norm import RMSNorm
from model_executor.layers.rotary import RotaryEmbedding
from model_executor.model_config import CheckpointMismatchError, ModelConfig


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(cfg.hidden_size, [cfg.intermediate_size] * 2)
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size)
        self.act = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, rotary_emb: RotaryEmbedding):
        super().__init__()
        hd = cfg.head_dim
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, hd, cfg.num_attention_heads, cfg.num_key_value_heads,
                                          bias=cfg.attention_bias)
        self.o_proj = RowParallelLinear(cfg.num_attention_heads * hd, cfg.hidden_size)
        self.rotary_emb = rotary_emb  # the model's one table, shared by every layer
        self.attn = RadixAttention(layer_id, self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads, hd, hd**-0.5)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        q, k, v = self.qkv_proj.split(self.qkv_proj(x))
        t = x.shape[0]
        q, k = self.rotary_emb(positions, q.view(t, -1, self.attn.head_dim), k.view(t, -1, self.attn.head_dim))
        out = self.attn(q.reshape(t, -1), k.reshape(t, -1), v, fb)
        return self.o_proj(out)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, rotary_emb: RotaryEmbedding):
        super().__init__()
        self.self_attn = LlamaAttention(cfg, layer_id, rotary_emb)
        self.mlp = LlamaMLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, positions, hidden, residual, fb: ForwardBatch):
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, fb)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.rotary_emb = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta,
                                          cfg.rope_scaling)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, i, self.rotary_emb)
                                    for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        residual = None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual, fb)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class LlamaForCausalLM(nn.Module):
    # HF checkpoint name fragment -> (our fused parameter fragment, shard id)
    stacked_params = (
        (".q_proj", ".qkv_proj", "q"),
        (".k_proj", ".qkv_proj", "k"),
        (".v_proj", ".qkv_proj", "v"),
        (".gate_proj", ".gate_up_proj", 0),
        (".up_proj", ".gate_up_proj", 1),
    )

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = LlamaModel(cfg)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size)
        if cfg.tie_word_embeddings:  # one tensor (weight_loader's materialization keeps the sharing)
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        """Returns float32 logits [bs, vocab] of each request's last token."""
        return compute_logits(self.lm_head, self.model(input_ids, positions, fb), fb)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy HF-named tensors into the fused parameters; returns the names of parameters loaded.

        CheckpointMismatchError names the first tensor that is not a parameter here or has the wrong shape.
        """
        params = dict(self.named_parameters(remove_duplicate=False))
        loaded: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:
                continue  # old HF checkpoints saved the RoPE frequencies; ours are computed
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue
            for hf_frag, our_frag, shard_id in self.stacked_params:
                if hf_frag in name:
                    target = name.replace(hf_frag, our_frag)
                    break
            else:
                target, shard_id = name, None
            param = params.get(target)
            if param is None:
                raise CheckpointMismatchError(
                    f"checkpoint tensor {name!r} is not a parameter of {self.config.architecture} with this "
                    f"config.json (unexpected tensor)")
            loader = getattr(param, "weight_loader", default_weight_loader)
            try:
                # load_dtype: quantized layers' own (online quantization takes the model dtype, not fp8)
                loader(param, tensor.to(getattr(param, "load_dtype", param.dtype)), shard_id)
            except ValueError as e:  # the layers' checked copy: shapes differ
                raise CheckpointMismatchError(f"checkpoint tensor {name!r} {tuple(tensor.shape)} does not fit "
                                              f"the config.json shape ({e})") from None
            loaded.add(target if shard_id is None else f"{target}#{shard_id}")
        return loaded

    def expected_weight_names(self) -> set[str]:
        names = set()
        for name, _ in self.named_parameters():
            if ".qkv_proj." in name:
                names |= {f"{name}#q", f"{name}#k", f"{name}#v"}
            elif ".gate_up_proj." in name:
                names |= {f"{name}#0", f"{name}#1"}
            else:
                names.add(name)
        return names

    def checkpoint_name(self, name: str) -> str:
        """The HF tensor name behind one of expected_weight_names' names (for error messages)."""
        target, _, shard = name.partition("#")
        for hf_frag, our_frag, shard_id in self.stacked_params:
            if our_frag in target and str(shard_id) == shard:
                return target.replace(our_frag, hf_frag)
        return target


# Mistral and Qwen2 share the Llama block; Qwen2's q/k/v bias comes from ModelConfig.attention_bias.
MODEL_REGISTRY = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
}

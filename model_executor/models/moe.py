"""Qwen3-MoE and Mixtral: the Llama block (llama.py) whose MLP is a router and fused experts
(layers/moe/layer.SparseMoeBlock) in the layers ModelConfig.moe_layers names; Qwen3-MoE's other layers keep the
dense MLP.

Their checkpoints keep one tensor per expert and projection: `<prefix>.experts.<e>.<proj>.weight` goes into
`<prefix>.experts.w13_weight` (gate, up) or `.w2_weight` (down) with shard id (e, projection).
"""

from __future__ import annotations

import re
from typing import ClassVar

from torch import nn

from model_executor.forward_batch import ForwardBatch
from model_executor.layers.moe.layer import DOWN, GATE, UP, FusedMoE, SparseMoeBlock
from model_executor.layers.rotary import RotaryEmbedding
from model_executor.model_config import ModelConfig
from model_executor.models.llama import LlamaDecoderLayer, LlamaForCausalLM, NextInput


class SparseMoeDecoderLayer(LlamaDecoderLayer):
    """norm -> attention -> norm -> router + experts. The post-attention norm runs as its own kernel (the
    experts' GEMMs take no PrenormedRow); Mixtral keeps the routing weights in float32."""

    router_weights_in_model_dtype = False

    def build_mlp(self, cfg: ModelConfig) -> nn.Module:
        return SparseMoeBlock(cfg.num_experts, cfg.num_experts_per_tok, cfg.hidden_size, cfg.moe_intermediate_size,
                              cfg.norm_topk_prob, self.router_weights_in_model_dtype)

    def forward(self, positions, hidden, residual, fb: ForwardBatch, next_input: NextInput | None = None):
        hidden, residual = self.self_attn(positions, hidden, residual, self.input_layernorm, fb)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class Qwen3MoeDecoderLayer(SparseMoeDecoderLayer):
    router_weights_in_model_dtype = True  # Qwen3-MoE rounds the routing weights to the model dtype


class SparseMoeForCausalLM(LlamaForCausalLM):
    """A Llama-block model with MoE layers: their experts load from per-expert checkpoint tensors."""

    moe_layer: ClassVar[type[SparseMoeDecoderLayer]] = SparseMoeDecoderLayer
    # checkpoint projection name -> GATE, UP or DOWN
    expert_projections: ClassVar[dict[str, int]] = {}
    # `.weight`, and a block-quantized checkpoint's `.weight_scale_inv`
    _EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(\w+)\.(weight|weight_scale_inv)$")
    _FUSED_EXPERTS = re.compile(r"^(.*\.experts)\.(w13|w2)_(weight|weight_scale_inv)$")

    def decoder_layer(self, cfg: ModelConfig, layer_id: int, rotary_emb: RotaryEmbedding) -> nn.Module:
        if layer_id in cfg.moe_layers:
            return self.moe_layer(cfg, layer_id, rotary_emb)
        return super().decoder_layer(cfg, layer_id, rotary_emb)

    def _fused_target(self, name: str) -> tuple[str, object]:
        m = self._EXPERT.match(name)
        if m is not None and m.group(3) in self.expert_projections:
            proj = self.expert_projections[m.group(3)]
            fused = "w2" if proj == DOWN else "w13"
            return f"{m.group(1)}.{fused}_{m.group(4)}", (int(m.group(2)), proj)
        return super()._fused_target(name)

    def _expected_shards(self, name: str, owner: nn.Module) -> set[str]:
        if isinstance(owner, FusedMoE):
            return {f"{name}#{shard}" for shard in owner.expected_shards(name)}
        return super()._expected_shards(name, owner)

    def checkpoint_name(self, name: str) -> str:
        target, _, shard = name.partition("#")
        m = self._FUSED_EXPERTS.match(target)
        if m is None:
            return super().checkpoint_name(name)
        expert, proj = shard.split("/")
        hf_proj = next(k for k, v in self.expert_projections.items() if v == int(proj))
        return super().checkpoint_name(f"{m.group(1)}.{expert}.{hf_proj}.{m.group(3)}")


class Qwen3MoeForCausalLM(SparseMoeForCausalLM):
    moe_layer = Qwen3MoeDecoderLayer
    expert_projections: ClassVar[dict[str, int]] = {"gate_proj": GATE, "up_proj": UP, "down_proj": DOWN}


class MixtralForCausalLM(SparseMoeForCausalLM):
    expert_projections: ClassVar[dict[str, int]] = {"w1": GATE, "w3": UP, "w2": DOWN}
    renames = ((".block_sparse_moe.", ".mlp."),)

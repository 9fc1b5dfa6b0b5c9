"""Llama-family decoder (Llama 2/3, SmolLM2, Mistral), Qwen2/2.5 (the same block with q/k/v bias), Qwen3
(RMSNorm over each q and k head before the rotary) and the MoE models on the same block, whose MLP is a
router and fused experts (Qwen3-MoE, Mixtral)."""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import ClassVar

import torch
from torch import nn

from model_executor.forward_batch import ForwardBatch
from model_executor.layers.activation import SiluAndMul
from model_executor.layers.attention.radix_attention import RadixAttention
from model_executor.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from model_executor.layers.linear import (
    LinearBase,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    all_reduce_add_rmsnorm,
    default_weight_loader,
    linear_add_rmsnorm,
)
from model_executor.layers.logits import compute_logits
from model_executor.layers.moe.layer import DOWN, GATE, UP, FusedMoE, SparseMoeBlock
from model_executor.layers.norm import PrenormedRow, RMSNorm
from model_executor.layers.rotary import RotaryEmbedding
from model_executor.model_config import CheckpointMismatchError, ModelConfig


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(cfg.hidden_size, [cfg.intermediate_size] * 2)
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size)
        self.act = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        act = self.gate_up_proj.silu_and_mul(x)  # one kernel at a decode row where the small-M GEMV runs
        return self.down_proj(act) if act is not None else self._down(self.gate_up_proj(x))

    def _down(self, gate_up: torch.Tensor) -> torch.Tensor:
        """down_proj(silu(gate) * up); FP8 rows above 16 quantize the activation in its kernel."""
        out = self.down_proj.forward_gated(gate_up)
        return out if out is not None else self.down_proj(self.act(gate_up))

    def forward_after(self, o_proj: RowParallelLinear, x: torch.Tensor, residual: torch.Tensor, norm: RMSNorm,
                      next_input: tuple[RMSNorm, LinearBase | ParallelLMHead] | None = None
                      ) -> tuple[torch.Tensor | PrenormedRow, torch.Tensor]:
        """(self(norm(h)), h) for h = o_proj(x) + residual. At a decode row where the small-M GEMVs run, the
        residual add and the norm's sums go into o_proj's epilogue and the 1 / rms into the gate/up GEMV (the
        norm's own launch goes). With next_input, the (norm, linear) that the layer's output h' = mlp + h
        feeds next, the down projection's epilogue likewise adds h and returns (PrenormedRow of h', h')."""
        fused = linear_add_rmsnorm(o_proj, x, residual, norm, self.gate_up_proj, after_attention=True)
        if fused is None:  # tensor parallel: the add and the norm's sums in the all-reduce's kernel instead
            fused = all_reduce_add_rmsnorm(o_proj, x, residual, norm, self.gate_up_proj)
        if fused is None:
            h = o_proj(x)
            quantized = self.gate_up_proj.forward_normed_quantized(norm, h, residual)  # (FP8 rows above 16)
            if quantized is not None:
                gate_up, residual = quantized
                return self._down(gate_up), residual
            fused = norm(h, residual)
        hidden, residual = fused
        act = self.gate_up_proj.silu_and_mul(hidden)
        if act is None:
            if isinstance(hidden, PrenormedRow):  # (not expected: linear_add_rmsnorm checked gate/up's config)
                hidden = norm(residual)
            gate_up = self.gate_up_proj(hidden)
            out = self.down_proj.forward_gated(gate_up)
            if out is not None:
                return out, residual
            act = self.act(gate_up)  # (then down's epilogue may still take the next layer's add and norm)
        if next_input is not None:
            fused = linear_add_rmsnorm(self.down_proj, act, residual, *next_input)
            if fused is not None:
                return fused
        return self.down_proj(act), residual


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, rotary_emb: RotaryEmbedding):
        super().__init__()
        hd = cfg.head_dim
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, hd, cfg.num_attention_heads, cfg.num_key_value_heads,
                                          bias=cfg.attention_bias)
        self.o_proj = RowParallelLinear(cfg.num_attention_heads * hd, cfg.hidden_size)
        self.rotary_emb = rotary_emb  # the model's one table, shared by every layer
        # The attention layer applies Qwen3's norms and the rotary (fused with the KV store where the
        # backend can); the norms' parameters live here, under their checkpoint names.
        if cfg.qk_norm:
            self.q_norm = RMSNorm(hd, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(hd, cfg.rms_norm_eps)
        self.attn = RadixAttention(layer_id, self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads, hd, hd**-0.5,
                                   rotary_emb=rotary_emb,
                                   qk_norm=(self.q_norm, self.k_norm) if cfg.qk_norm else None)

    def forward(self, positions: torch.Tensor, x: torch.Tensor | PrenormedRow, residual: torch.Tensor | None,
                norm: RMSNorm, fb: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """(attention of norm(h), h) for h = x + residual (x when residual is None; residual when x is a
        PrenormedRow of it), before o_proj (the decoder layer runs o_proj, with what follows it where it
        can). At a decode token, where the small-M GEMV and the backend allow, the norm, qkv_proj, the rotary
        and the KV store are one kernel; elsewhere the norm goes into qkv_proj's GEMV where it can."""
        rope = self.attn.rope_store(fb, positions)
        fused = None if rope is None else self.qkv_proj.forward_normed_rope(norm, x, residual, rope)
        if fused is not None:
            qkv, residual = fused
            return self.attn.forward_stored(qkv[:, : self.qkv_proj.q_size], fb), residual
        qkv, residual = self.qkv_proj.forward_normed(norm, x, residual)
        q, k, v = self.qkv_proj.split(qkv)
        return self.attn(q, k, v, fb, positions), residual


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, rotary_emb: RotaryEmbedding):
        super().__init__()
        self.self_attn = LlamaAttention(cfg, layer_id, rotary_emb)
        if layer_id in cfg.moe_layers:
            # Qwen3-MoE rounds the routing weights to the model dtype; Mixtral keeps them in float32.
            self.mlp = SparseMoeBlock(cfg.num_experts, cfg.num_experts_per_tok, cfg.hidden_size,
                                      cfg.moe_intermediate_size, cfg.norm_topk_prob,
                                      router_weights_in_model_dtype=cfg.architecture == "Qwen3MoeForCausalLM")
        else:
            self.mlp = LlamaMLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, positions, hidden, residual, fb: ForwardBatch,
                next_input: tuple[RMSNorm, LinearBase | ParallelLMHead] | None = None):
        """(hidden, residual) for what follows: hidden is the MLP's output, or at a decode row (a dense MLP
        and a next_input) a PrenormedRow of next_input's norm (residual then holds the sum). next_input is
        the (norm, linear) the layer's output goes into next: the next layer's input norm and qkv_proj, or
        the final norm and the LM head.
        At a decode row the input norm goes into qkv_proj's GEMV (whole, or its 1 / rms after a
        PrenormedRow); the post-attention norm into o_proj's epilogue (the add and the sums of squares) and
        the gate/up GEMV (the 1 / rms). Computed whole inside the gate/up GEMV it measured slower."""
        attn, residual = self.self_attn(positions, hidden, residual, self.input_layernorm, fb)
        if isinstance(self.mlp, LlamaMLP):
            return self.mlp.forward_after(self.self_attn.o_proj, attn, residual, self.post_attention_layernorm,
                                          next_input)
        hidden, residual = self.post_attention_layernorm(self.self_attn.o_proj(attn), residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size)
        served = cfg.served_context_len
        self.rotary_emb = RotaryEmbedding(cfg.head_dim, max(cfg.max_position_embeddings, served or 0),
                                          cfg.rope_theta, cfg.rope_scaling,
                                          original_max_position=cfg.max_position_embeddings, seq_len=served)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, i, self.rotary_emb)
                                    for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, fb: ForwardBatch,
                lm_head: ParallelLMHead | None = None) -> torch.Tensor | PrenormedRow:
        """The final norm's output, [tokens, H]. With lm_head (a decode batch, for its logits only): at up to 16 rows
        where the small-M kernels fuse, a PrenormedRow of it instead, made in the last down projection's epilogue
        (the norm's own launch goes; the LM head's GEMV scales by 1 / rms)."""
        hidden = self.embed_tokens(input_ids)
        residual = None
        for i, layer in enumerate(self.layers):
            if i + 1 < len(self.layers):
                nxt = self.layers[i + 1]
                next_input = (nxt.input_layernorm, nxt.self_attn.qkv_proj)
            else:
                next_input = None if lm_head is None else (self.norm, lm_head)
            hidden, residual = layer(positions, hidden, residual, fb, next_input)
        if isinstance(hidden, PrenormedRow):
            return hidden
        hidden, _ = self.norm(hidden, residual)
        return hidden


class LlamaForCausalLM(nn.Module):
    # Every layer here shards under tensor parallelism (model_executor/weight_loader.check_tensor_parallel).
    supports_tensor_parallel = True
    # HF checkpoint name fragment -> (our fused parameter fragment, shard id)
    stacked_params = (
        (".q_proj", ".qkv_proj", "q"),
        (".k_proj", ".qkv_proj", "k"),
        (".v_proj", ".qkv_proj", "v"),
        (".gate_proj", ".gate_up_proj", 0),
        (".up_proj", ".gate_up_proj", 1),
    )
    # MoE checkpoints keep one tensor per expert and projection: `<prefix>.experts.<e>.<proj>.weight` goes
    # into `<prefix>.experts.w13_weight` (gate, up) or `.w2_weight` (down) with shard (e, projection).
    expert_projections: ClassVar[dict[str, int]] = {}
    # Checkpoint name fragment -> ours, applied first (Mixtral's MLP is `block_sparse_moe` in its checkpoint).
    renames: tuple[tuple[str, str], ...] = ()

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = LlamaModel(cfg)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size)
        if cfg.tie_word_embeddings:  # one tensor (weight_loader's materialization keeps the sharing)
            self.lm_head.tie(self.model.embed_tokens)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        """Returns float32 logits [bs, vocab] of each request's last token."""
        # A decode batch's hidden states go to the LM head only: its final norm may go into the GEMVs around it.
        head = self.lm_head if fb.mode.is_decode() and fb.prompt_logprob_plan is None else None
        return compute_logits(self.lm_head, self.model(input_ids, positions, fb, head), fb)

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
            target, shard_id = self._target(name)
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
            loaded.add(target if shard_id is None else f"{target}#{_shard_str(shard_id)}")
        return loaded

    # `.weight`, and a block-quantized checkpoint's `.weight_scale_inv`
    _EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(\w+)\.(weight|weight_scale_inv)$")
    _FUSED_EXPERTS = re.compile(r"^(.*\.experts)\.(w13|w2)_(weight|weight_scale_inv)$")

    def _target(self, name: str) -> tuple[str, object]:
        """Our parameter and shard id for a checkpoint tensor name."""
        for hf_frag, our_frag in self.renames:
            name = name.replace(hf_frag, our_frag)
        m = self._EXPERT.match(name)
        if m is not None and m.group(3) in self.expert_projections:
            proj = self.expert_projections[m.group(3)]
            fused = "w2" if proj == DOWN else "w13"
            return f"{m.group(1)}.{fused}_{m.group(4)}", (int(m.group(2)), proj)
        for hf_frag, our_frag, shard_id in self.stacked_params:
            if hf_frag in name:
                return name.replace(hf_frag, our_frag), shard_id
        return name, None

    def expected_weight_names(self) -> set[str]:
        names = set()
        modules = dict(self.named_modules())
        for name, _ in self.named_parameters():
            owner = modules[name.rpartition(".")[0]]
            if isinstance(owner, FusedMoE):
                names |= {f"{name}#{shard}" for shard in owner.expected_shards(name)}
            elif ".qkv_proj." in name:
                names |= {f"{name}#q", f"{name}#k", f"{name}#v"}
            elif ".gate_up_proj." in name:
                names |= {f"{name}#0", f"{name}#1"}
            else:
                names.add(name)
        return names

    def checkpoint_name(self, name: str) -> str:
        """The HF tensor name behind one of expected_weight_names' names (for error messages)."""
        target, _, shard = name.partition("#")
        m = self._FUSED_EXPERTS.match(target)
        if m is not None:
            expert, proj = shard.split("/")
            hf_proj = next(k for k, v in self.expert_projections.items() if v == int(proj))
            target = f"{m.group(1)}.{expert}.{hf_proj}.{m.group(3)}"
        for hf_frag, our_frag, shard_id in self.stacked_params:
            if our_frag in target and str(shard_id) == shard:
                target = target.replace(our_frag, hf_frag)
                break
        for hf_frag, our_frag in self.renames:
            target = target.replace(our_frag, hf_frag)
        return target


def _shard_str(shard_id) -> str:
    return "/".join(map(str, shard_id)) if isinstance(shard_id, tuple) else str(shard_id)


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    expert_projections: ClassVar[dict[str, int]] = {"gate_proj": GATE, "up_proj": UP, "down_proj": DOWN}


class MixtralForCausalLM(LlamaForCausalLM):
    expert_projections: ClassVar[dict[str, int]] = {"w1": GATE, "w3": UP, "w2": DOWN}
    renames = ((".block_sparse_moe.", ".mlp."),)


# Mistral, Qwen2 and Qwen3 share the Llama block; Qwen2's q/k/v bias comes from ModelConfig.attention_bias,
# Qwen3's q/k norms from ModelConfig.qk_norm, the MoE layers from ModelConfig.moe_layers.
MODEL_REGISTRY = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
}

"""Llama-family decoder (Llama 2/3, SmolLM2, Mistral), Qwen2/2.5 (the same block with q/k/v bias) and Qwen3
(RMSNorm over each q and k head before the rotary). The MoE models on this block are in moe.py.

Each decoder layer is norm -> attention (qkv -> rotary + attention -> o_proj) -> norm -> MLP (gate_up -> SiLU-and-mul
-> down) on a residual stream (hidden, residual): a norm runs in the linear that takes its output, a residual add
in the linear before it where the kernels can (the fusions are the linear layers' own: layers/linear.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import ClassVar

import torch
from torch import nn

from model_executor.forward_batch import ForwardBatch
from model_executor.layers.attention.radix_attention import RadixAttention
from model_executor.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from model_executor.layers.linear import (
    LinearBase,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    default_weight_loader,
)
from model_executor.layers.logits import compute_logits
from model_executor.layers.norm import PrenormedRow, RMSNorm
from model_executor.layers.rotary import RotaryEmbedding
from model_executor.model_config import CheckpointMismatchError, ModelConfig

# The (norm, linear) a layer's output goes into next: the next layer's input norm and qkv_proj, or the final
# norm and the LM head.
NextInput = tuple[RMSNorm, LinearBase | ParallelLMHead]


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(cfg.hidden_size, [cfg.intermediate_size] * 2)
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor | PrenormedRow, residual: torch.Tensor, norm: RMSNorm,
                next_input: NextInput | None = None) -> tuple[torch.Tensor | PrenormedRow, torch.Tensor]:
        """norm -> gate_up -> SiLU-and-mul -> down on h = x + residual: (down's output, h), the stream the next
        norm takes (with next_input, where down's epilogue adds h: a PrenormedRow of that norm, and the sum)."""
        act, residual = self.gate_up_proj.forward_silu_and_mul(norm, x, residual)
        return self.down_proj.forward_residual(act, residual, next_input)


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
                                   qk_norm=(self.q_norm, self.k_norm) if cfg.qk_norm else None,
                                   sliding_window=cfg.layer_sliding_window(layer_id))

    def forward(self, positions: torch.Tensor, x: torch.Tensor | PrenormedRow, residual: torch.Tensor | None,
                norm: RMSNorm, fb: ForwardBatch,
                next_input: NextInput | None = None) -> tuple[torch.Tensor | PrenormedRow, torch.Tensor]:
        """norm -> qkv -> rotary + attention -> o_proj on h = x + residual: (o_proj's output, h), the stream the
        next norm takes (with next_input, where o_proj's epilogue adds h: a PrenormedRow of that norm, and the
        sum). Where the backend lets qkv_proj store the KV, its kernel runs the rotary and the store too."""
        qkv, residual, stored = self.qkv_proj.forward_qkv(norm, x, residual, self.attn.rope_store(fb, positions))
        q, k, v = self.qkv_proj.split(qkv)
        out = self.attn.forward_stored(q, fb) if stored else self.attn(q, k, v, fb, positions)
        return self.o_proj.forward_residual(out, residual, next_input, after_attention=True)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, rotary_emb: RotaryEmbedding):
        super().__init__()
        self.self_attn = LlamaAttention(cfg, layer_id, rotary_emb)
        self.mlp = self.build_mlp(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def build_mlp(self, cfg: ModelConfig) -> nn.Module:
        return LlamaMLP(cfg)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor | PrenormedRow, residual: torch.Tensor | None,
                fb: ForwardBatch, next_input: NextInput | None = None):
        """(hidden, residual) of the stream after the layer: hidden is the MLP's output, or where the down
        projection's epilogue took the add (decode rows), a PrenormedRow of next_input's norm."""
        hidden, residual = self.self_attn(positions, hidden, residual, self.input_layernorm, fb,
                                          next_input=(self.post_attention_layernorm, self.mlp.gate_up_proj))
        return self.mlp(hidden, residual, self.post_attention_layernorm, next_input)


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig,
                 decoder_layer: Callable[[ModelConfig, int, RotaryEmbedding], nn.Module] = LlamaDecoderLayer):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.rotary_emb = self.make_rotary(cfg)
        self.layers = nn.ModuleList(decoder_layer(cfg, i, self.rotary_emb) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        # The layers whose outputs forward also gives, in ascending order (set_aux_hidden_state_layers); empty:
        # none, and nothing is captured.
        self.aux_layer_ids: tuple[int, ...] = ()

    def make_rotary(self, cfg: ModelConfig) -> RotaryEmbedding:
        served = cfg.served_context_len
        return RotaryEmbedding(cfg.head_dim, max(cfg.max_position_embeddings, served or 0), cfg.rope_theta,
                               cfg.rope_scaling, original_max_position=cfg.max_position_embeddings, seq_len=served,
                               rotary_dim=int(cfg.head_dim * cfg.partial_rotary_factor))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, fb: ForwardBatch,
                lm_head: ParallelLMHead | None = None,
                input_embeds: torch.Tensor | None = None) -> torch.Tensor | PrenormedRow:
        """The final norm's output, [tokens, H]. With lm_head (a decode batch, for its logits only): at up to 16 rows
        where the small-M kernels fuse, a PrenormedRow of it instead, made in the last down projection's epilogue
        (the norm's own launch goes; the LM head's GEMV scales by 1 / rms). With aux_layer_ids, the residual
        stream after each of those layers goes into fb.aux_hidden_states, side by side: [tokens, len * H].
        input_embeds: the tokens' embeddings, given (a multimodal prompt's, images in them) instead of looked up."""
        hidden = self.embed_tokens(input_ids) if input_embeds is None else input_embeds
        residual = None
        aux = []
        for i, layer in enumerate(self.layers):
            if i + 1 < len(self.layers):
                nxt = self.layers[i + 1]
                next_input = (nxt.input_layernorm, nxt.self_attn.qkv_proj)
            else:
                next_input = None if lm_head is None else (self.norm, lm_head)
            hidden, residual = layer(positions, hidden, residual, fb, next_input)
            if self.aux_layer_ids and i in self.aux_layer_ids:
                # the stream is hidden + residual, or residual itself where the next norm's sums were taken
                aux.append(residual if isinstance(hidden, PrenormedRow) else hidden + residual)
        if aux:
            fb.aux_hidden_states = torch.cat(aux, dim=-1)
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
    # Checkpoint name fragment -> ours, applied first (Mixtral's MLP is `block_sparse_moe` in its checkpoint).
    renames: tuple[tuple[str, str], ...] = ()

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = self.make_backbone(cfg)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size)
        if cfg.tie_word_embeddings:  # one tensor (weight_loader's materialization keeps the sharing)
            self.lm_head.tie(self.model.embed_tokens)

    def make_backbone(self, cfg: ModelConfig) -> LlamaModel:
        return LlamaModel(cfg, self.decoder_layer)

    def decoder_layer(self, cfg: ModelConfig, layer_id: int, rotary_emb: RotaryEmbedding) -> nn.Module:
        return LlamaDecoderLayer(cfg, layer_id, rotary_emb)

    def set_aux_hidden_state_layers(self, layer_ids: Iterable[int] | None) -> None:
        """From now on, each forward also sets fb.aux_hidden_states: the outputs of these layers (the residual
        stream after each, before any norm), side by side in ascending layer order, for every token of the
        batch: what an EAGLE-3 draft head reads (models/eagle3.aux_layer_ids picks them). None or empty: off.

        ValueError (one line) for a layer this model does not have or a repeated one."""
        ids = tuple(layer_ids or ())
        n = self.config.num_hidden_layers
        if len(set(ids)) != len(ids) or any(not 0 <= i < n for i in ids):
            raise ValueError(f"hidden-state layers {list(ids)} must be distinct layers of the model's {n} "
                             f"(0..{n - 1})")
        self.model.aux_layer_ids = tuple(sorted(ids))

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

    def _target(self, name: str) -> tuple[str, object]:
        """Our parameter and shard id for a checkpoint tensor name."""
        for hf_frag, our_frag in self.renames:
            name = name.replace(hf_frag, our_frag)
        return self._fused_target(name)

    def _fused_target(self, name: str) -> tuple[str, object]:
        """The fused parameter and shard id a (renamed) checkpoint tensor goes into (stacked_params), or the
        name itself and None."""
        for hf_frag, our_frag, shard_id in self.stacked_params:
            if hf_frag in name:
                return name.replace(hf_frag, our_frag), shard_id
        return name, None

    def expected_weight_names(self) -> set[str]:
        names = set()
        modules = dict(self.named_modules())
        for name, _ in self.named_parameters():
            names |= self._expected_shards(name, modules[name.rpartition(".")[0]])
        return names

    def _expected_shards(self, name: str, owner: nn.Module) -> set[str]:
        """The names a parameter is loaded under: name#shard for each shard of a fused one."""
        if ".qkv_proj." in name:
            return {f"{name}#q", f"{name}#k", f"{name}#v"}
        if ".gate_up_proj." in name:
            return {f"{name}#0", f"{name}#1"}
        return {name}

    def checkpoint_name(self, name: str) -> str:
        """The HF tensor name behind one of expected_weight_names' names (for error messages)."""
        target, _, shard = name.partition("#")
        for hf_frag, our_frag, shard_id in self.stacked_params:
            if our_frag in target and str(shard_id) == shard:
                target = target.replace(our_frag, hf_frag)
                break
        for hf_frag, our_frag in self.renames:
            target = target.replace(our_frag, hf_frag)
        return target


class OwnBackboneForCausalLM(LlamaForCausalLM):
    """A causal LM with a backbone of its own (`backbone_class`: Gemma 3, gpt-oss) under the Llama tensor names,
    loaded through LlamaForCausalLM's mapping; its decode rows keep the final norm outside the LM head, and it
    gives no hidden states to a draft head."""

    backbone_class: ClassVar[type[nn.Module]]

    def __init__(self, cfg: ModelConfig):
        nn.Module.__init__(self)
        self.config = cfg
        self.model = self.backbone_class(cfg)
        self.lm_head = self.make_lm_head(cfg)
        if cfg.tie_word_embeddings:
            self.lm_head.tie(self.model.embed_tokens)

    def make_lm_head(self, cfg: ModelConfig) -> ParallelLMHead:
        return ParallelLMHead(cfg.vocab_size, cfg.hidden_size)

    def set_aux_hidden_state_layers(self, layer_ids) -> None:
        raise ValueError(f"{self.config.architecture} does not give hidden states to a draft head")

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        """Returns float32 logits [bs, vocab] of each request's last token."""
        return compute_logits(self.lm_head, self.model(input_ids, positions, fb), fb)


class LlamaEmbeddingModel(LlamaForCausalLM):
    """A pooling server's model (--is-embedding): the backbone's final hidden states are what the requests
    take (layers/logits.py pools them). Reads a `*Model` checkpoint (a sentence-transformers save: tensor
    names without the `model.` prefix, no LM head) as well as a causal LM's; the LM head is tied to the
    embeddings, so no head needs loading (the logits it computes are never read)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__(dataclasses.replace(cfg, tie_word_embeddings=True))

    def _target(self, name: str) -> tuple[str, object]:
        if not name.startswith(("model.", "lm_head.")):
            name = "model." + name
        return super()._target(name)


class LlamaForSequenceClassification(LlamaForCausalLM):
    """A reranker with a classification head (HF's *ForSequenceClassification: `score`, a linear layer without
    bias on the last token's hidden state). The head takes the LM head's place, so the "logits" of the last
    token are the num_labels scores; it is small and replicated on every tensor-parallel rank."""

    renames = (("score.", "lm_head."),)

    def __init__(self, cfg: ModelConfig):
        super().__init__(dataclasses.replace(cfg, tie_word_embeddings=False))
        self.lm_head = ParallelLMHead(cfg.num_labels, cfg.hidden_size, tp_rank=0, tp_size=1)


def _shard_str(shard_id) -> str:
    """A shard id as loaded names spell it: "q", "0", or "3/1" for a tuple (an expert's projection)."""
    return "/".join(map(str, shard_id)) if isinstance(shard_id, tuple) else str(shard_id)

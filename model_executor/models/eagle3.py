"""EAGLE-3 draft head (LlamaForCausalLMEagle3 checkpoints): one Llama decoder layer that drafts a target
model's next tokens from the target's own hidden states.

Per token, with e its embedding (the target's table, shared, unless the checkpoint brings its own) and g the
hidden state it is given:

    g   = fc([a_low; a_mid; a_high])  the target's outputs of three layers at that token (aux_layer_ids), or
          the head's own `hidden` of the step before (later draft steps: already H wide, no fc)
    x   = [input_layernorm(e); hidden_norm(g)]          2H wide: q, k and v read both halves
    h   = g + o_proj(attention(rotary(q, k), v))          causal, over this head's own one-layer KV cache
    out = h + mlp(post_attention_layernorm(h))
    logits = lm_head(norm(out))    over the draft vocabulary; draft id i is target id i + d2t[i]

`out` (before the final norm) is the `hidden` the next draft step takes as g. The head runs in a ModelRunner of
its own (RunnerConfig(draft=True)): its ModelConfig has one layer, so its KV pool has one layer, and its
attention goes through the same backends as the target's.

The checkpoint names are the published ones: fc.weight, midlayer.{input_layernorm, hidden_norm,
post_attention_layernorm}.weight, midlayer.self_attn.{q,k,v,o}_proj.weight, midlayer.mlp.{gate,up,down}_proj.weight,
norm.weight, lm_head.weight, d2t (draft -> target id offsets), t2d (a mask over the target vocabulary, checked
against d2t), and optionally embed_tokens.weight; safetensors or PyTorch *.bin.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

import torch
from torch import nn

from model_executor.forward_batch import ForwardBatch
from model_executor.layers.attention.radix_attention import RadixAttention
from model_executor.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from model_executor.layers.linear import (
    ColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    default_weight_loader,
)
from model_executor.layers.logits import compute_logits
from model_executor.layers.norm import PrenormedRow, RMSNorm
from model_executor.layers.rotary import RotaryEmbedding
from model_executor.model_config import CheckpointMismatchError, ModelConfig, ModelConfigError
from model_executor.models.llama import LlamaForCausalLM, LlamaMLP, NextInput


def default_aux_layer_ids(num_layers: int) -> tuple[int, int, int]:
    """The target layers an EAGLE-3 head reads when its config names none: a low, a middle and a high one
    (SGLang's and SpecForge's choice: the outputs of layers 1, L/2 - 1 and L - 4)."""
    return 1, num_layers // 2 - 1, num_layers - 4


def aux_layer_ids(draft: ModelConfig, target: ModelConfig) -> tuple[int, ...]:
    """The target layers whose outputs the head takes, ascending: its config's, else the default for the
    target's depth. ModelConfigError (one line) when they are not three distinct layers of the target."""
    ids = draft.aux_hidden_state_layer_ids
    named = ids is not None
    if ids is None:
        ids = default_aux_layer_ids(target.num_hidden_layers)
    n = target.num_hidden_layers
    if len(set(ids)) != 3 or any(not 0 <= i < n for i in ids):
        where = "its config's" if named else "the default"
        raise ModelConfigError(f"the EAGLE-3 head's target layers ({where}: {list(ids)}) are not 3 distinct layers "
                               f"of the target's {n}; set eagle_config.eagle_aux_hidden_state_layer_ids")
    return tuple(sorted(ids))


def check_draft_fits_target(draft: ModelConfig, target: ModelConfig) -> None:
    """ModelConfigError (one line) where an EAGLE-3 head cannot draft for this target: another vocabulary,
    another width of the hidden states it reads, or target layers the target does not have."""
    if draft.architecture != "LlamaForCausalLMEagle3":
        raise ModelConfigError(f"the draft model is a {draft.architecture}, not an EAGLE-3 head "
                               f"(LlamaForCausalLMEagle3)")
    if draft.vocab_size != target.vocab_size:
        raise ModelConfigError(f"the EAGLE-3 head's vocab_size {draft.vocab_size} is not the target's "
                               f"{target.vocab_size}")
    if draft.target_hidden_size != target.hidden_size:
        raise ModelConfigError(f"the EAGLE-3 head reads hidden states of width {draft.target_hidden_size} "
                               f"(config.json target_hidden_size or hidden_size) but the target's hidden_size is "
                               f"{target.hidden_size}")
    aux_layer_ids(draft, target)


class DraftOutput(NamedTuple):
    logits: torch.Tensor  # float32 [bs, draft_vocab]: each request's last token (decode: every row)
    hidden: torch.Tensor  # [num_tokens, H]: every token's output before the final norm (the next step's g)


class Eagle3Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary_emb: RotaryEmbedding):
        super().__init__()
        hd = cfg.head_dim
        # q, k and v read the normed embedding and the normed hidden state side by side: 2H inputs
        self.qkv_proj = QKVParallelLinear(2 * cfg.hidden_size, hd, cfg.num_attention_heads, cfg.num_key_value_heads,
                                          bias=cfg.attention_bias)
        self.o_proj = RowParallelLinear(cfg.num_attention_heads * hd, cfg.hidden_size)
        self.attn = RadixAttention(0, self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads, hd, hd**-0.5,
                                   rotary_emb=rotary_emb)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor, fb: ForwardBatch,
                next_input: NextInput) -> tuple[torch.Tensor | PrenormedRow, torch.Tensor]:
        """qkv -> rotary + attention -> o_proj on x [T, 2H]; (o_proj's output, h = it + residual) as
        RowParallelLinear.forward_residual gives them (the next norm's first step in its epilogue where it can)."""
        q, k, v = self.qkv_proj.split(self.qkv_proj(x))
        out = self.attn(q, k, v, fb, positions)
        return self.o_proj.forward_residual(out, residual, next_input, after_attention=True)


class Eagle3DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary_emb: RotaryEmbedding):
        super().__init__()
        self.self_attn = Eagle3Attention(cfg, rotary_emb)
        self.mlp = LlamaMLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)  # the embedding's
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)  # the hidden state's
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, positions: torch.Tensor, embeds: torch.Tensor, hidden: torch.Tensor, fb: ForwardBatch,
                next_input: NextInput | None = None) -> tuple[torch.Tensor | PrenormedRow, torch.Tensor]:
        """(mlp's output, h) of the stream out = mlp's output + h, as LlamaDecoderLayer gives them; the hidden
        state is the stream's start (the residual of attention)."""
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)
        out, residual = self.self_attn(positions, x, hidden, fb,
                                       next_input=(self.post_attention_layernorm, self.mlp.gate_up_proj))
        return self.mlp(out, residual, self.post_attention_layernorm, next_input)


class Eagle3ForCausalLM(nn.Module):
    """The head. Before its first forward it needs an embedding: the checkpoint's own, or the target's
    (share_target_embedding)."""

    supports_tensor_parallel = False  # fc and the head are not sharded yet (weight_loader refuses tp > 1)
    reads_pytorch_bin = True  # published heads often come as pytorch_model.bin
    # The checkpoint's names are Llama's, and so is the fusing of q/k/v and gate/up.
    stacked_params = LlamaForCausalLM.stacked_params
    renames: tuple[tuple[str, str], ...] = ()
    _target = LlamaForCausalLM._target
    _fused_target = LlamaForCausalLM._fused_target
    _expected_shards = LlamaForCausalLM._expected_shards
    checkpoint_name = LlamaForCausalLM.checkpoint_name

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        if cfg.draft_vocab_size is None or cfg.target_hidden_size is None:
            raise ModelConfigError(f"{cfg.architecture} is not an EAGLE-3 head's config")
        self.config = cfg
        self.hidden_size = cfg.hidden_size
        self.aux_width = 3 * cfg.target_hidden_size  # fc's input: three target layers side by side
        if self.aux_width == cfg.hidden_size:  # (forward tells a first pass from a later one by the width)
            raise ModelConfigError(f"an EAGLE-3 head of hidden_size {cfg.hidden_size} reading target states of "
                                   f"width {cfg.target_hidden_size} is not supported")
        served = cfg.served_context_len
        self.rotary_emb = RotaryEmbedding(cfg.head_dim, max(cfg.max_position_embeddings, served or 0),
                                          cfg.rope_theta, cfg.rope_scaling,
                                          original_max_position=cfg.max_position_embeddings, seq_len=served)
        self.fc = ColumnParallelLinear(self.aux_width, cfg.hidden_size, bias=bool(cfg.hf_config.get("bias", False)))
        self.midlayer = Eagle3DecoderLayer(cfg, self.rotary_emb)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        # Tied (draft_vocab_size == vocab_size then): the head reads the embedding table, whichever it is.
        self.lm_head = ParallelLMHead(cfg.draft_vocab_size, cfg.hidden_size)
        # The checkpoint's own table (load_weights makes it where the checkpoint has one), else the target's,
        # held in a tuple so that it is not registered here (its parameter stays the target's).
        self.embed_tokens: VocabParallelEmbedding | None = None
        self._target_embed: tuple[VocabParallelEmbedding, ...] = ()
        self._draft_to_target: torch.Tensor | None = None  # from d2t; None: draft id i is target id i

    # ---- the embedding ----------------------------------------------------------------------------
    @property
    def needs_target_embedding(self) -> bool:
        return self.embed_tokens is None and not self._target_embed

    def share_target_embedding(self, target: nn.Module) -> None:
        """Use the target's embedding table (one tensor for both models; a tied head reads it too) where the
        head is as wide as its target: the checkpoint's own copy, if any, is dropped (EAGLE-3 trains with the
        target's table frozen). A head of another width keeps its own (loading required it). ModelConfigError
        where it has none to use."""
        embedding = target.model.embed_tokens
        if (self.config.target_hidden_size != self.hidden_size or embedding.weight.shape[-1] != self.hidden_size
                or embedding.vocab_size != self.config.vocab_size):
            if self.embed_tokens is None:
                raise ModelConfigError(f"the EAGLE-3 head has no embedding of its own and the target's "
                                       f"[{embedding.vocab_size}, {embedding.weight.shape[-1]}] does not fit its "
                                       f"[{self.config.vocab_size}, {self.hidden_size}]")
            return
        self.embed_tokens = None
        self._target_embed = (embedding,)
        if self.config.tie_word_embeddings:
            self.lm_head.tie(embedding)

    def _embedding(self) -> VocabParallelEmbedding:
        if self.embed_tokens is not None:
            return self.embed_tokens
        if not self._target_embed:
            raise RuntimeError("the EAGLE-3 head has no embedding table: call share_target_embedding(target) "
                               "after loading")
        return self._target_embed[0]

    # ---- the vocabulary map -----------------------------------------------------------------------
    @property
    def draft_to_target(self) -> torch.Tensor:
        """int64 [draft_vocab]: the target id of each draft id."""
        if self._draft_to_target is None:
            self._draft_to_target = torch.arange(self.config.draft_vocab_size, device=self.norm.weight.device)
        return self._draft_to_target

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary ids (any shape) -> the target's ids."""
        return self.draft_to_target[draft_ids]

    # ---- forward ----------------------------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, fb: ForwardBatch,
                hidden_states: torch.Tensor | None = None) -> DraftOutput:
        """One draft pass over the batch's tokens. hidden_states [num_tokens, 3 * target H]: the target's
        aux hidden states (fb.aux_hidden_states of its forward), fused by fc here; or [num_tokens, H]: the
        `hidden` of this head's previous pass (no fc)."""
        if hidden_states is None:
            raise ValueError("an EAGLE-3 head's forward needs the hidden states it drafts from")
        width = hidden_states.shape[-1]
        if width == self.aux_width:
            hidden_states = self.fc(hidden_states)
        elif width != self.hidden_size:
            raise ValueError(f"EAGLE-3 hidden states of width {width}: expected {self.aux_width} (the target's "
                             f"three layers) or {self.hidden_size} (the head's own)")
        embeds = self._embedding()(input_ids)
        # A decode batch's hidden states go to the LM head only: the final norm may go into the GEMVs around it.
        head = self.lm_head if fb.mode.is_decode() and fb.prompt_logprob_plan is None else None
        out, residual = self.midlayer(positions, embeds, hidden_states, fb,
                                      None if head is None else (self.norm, head))
        if isinstance(out, PrenormedRow):  # the down projection's epilogue made the stream (residual) and its norm
            return DraftOutput(compute_logits(self.lm_head, out, fb), residual)
        normed, stream = self.norm(out, residual)
        return DraftOutput(compute_logits(self.lm_head, normed, fb), stream)

    # ---- loading ----------------------------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy the published tensors into the fused parameters; returns the names loaded (as
        expected_weight_names spells them). CheckpointMismatchError names the first tensor that does not fit."""
        params = dict(self.named_parameters(remove_duplicate=False))
        loaded: set[str] = set()
        t2d = None
        for name, tensor in weights:
            name = name.removeprefix("model.")  # (some conversions keep the training wrapper's prefix)
            if name == "d2t":
                self._load_d2t(tensor)
                loaded.add(name)
                continue
            if name == "t2d":
                t2d = tensor
                continue
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue
            if name == "embed_tokens.weight" and self.embed_tokens is None:
                self._make_embedding()
                params = dict(self.named_parameters(remove_duplicate=False))
            target, shard_id = self._target(name)
            param = params.get(target)
            if param is None:
                raise CheckpointMismatchError(f"checkpoint tensor {name!r} is not a parameter of an EAGLE-3 head "
                                              f"with this config.json (unexpected tensor)")
            loader = getattr(param, "weight_loader", default_weight_loader)
            try:
                loader(param, tensor.to(getattr(param, "load_dtype", param.dtype)), shard_id)
            except ValueError as e:
                raise CheckpointMismatchError(f"checkpoint tensor {name!r} {tuple(tensor.shape)} does not fit "
                                              f"the config.json shape ({e})") from None
            loaded.add(target if shard_id is None else f"{target}#{shard_id}")
        if t2d is not None and "d2t" in loaded:  # (without d2t, the completeness check names it)
            self._check_t2d(t2d)
        if self.config.tie_word_embeddings and self.embed_tokens is not None:
            self.lm_head.tie(self.embed_tokens)
        return loaded

    def _make_embedding(self) -> None:
        """The checkpoint's own embedding table: made when its tensor arrives, on the head's device and dtype."""
        ref = self.norm.weight
        with torch.device(ref.device):
            self.embed_tokens = VocabParallelEmbedding(self.config.vocab_size, self.hidden_size).to(ref.dtype)

    def _load_d2t(self, d2t: torch.Tensor) -> None:
        cfg = self.config
        if tuple(d2t.shape) != (cfg.draft_vocab_size,):
            raise CheckpointMismatchError(f"checkpoint tensor 'd2t' {tuple(d2t.shape)} does not fit the draft "
                                          f"vocabulary ({cfg.draft_vocab_size},)")
        if d2t.is_meta:  # (a header check: shapes only)
            return
        ids = d2t.to(torch.int64) + torch.arange(cfg.draft_vocab_size)
        if ids.min() < 0 or ids.max() >= cfg.vocab_size:
            raise CheckpointMismatchError(f"checkpoint tensor 'd2t' maps draft ids outside the target vocabulary "
                                          f"(0..{cfg.vocab_size - 1})")
        self._draft_to_target = ids.to(self.norm.weight.device)

    def _check_t2d(self, t2d: torch.Tensor) -> None:
        """t2d (a mask over the target vocabulary) says again what d2t says: checked, not needed."""
        cfg = self.config
        if tuple(t2d.shape) != (cfg.vocab_size,):
            raise CheckpointMismatchError(f"checkpoint tensor 't2d' {tuple(t2d.shape)} does not fit the target "
                                          f"vocabulary ({cfg.vocab_size},)")
        if t2d.is_meta:
            return
        mask = t2d.bool()
        if int(mask.sum()) != cfg.draft_vocab_size or not bool(mask[self.draft_to_target.cpu()].all()):
            raise CheckpointMismatchError("checkpoint tensors 't2d' and 'd2t' name different draft vocabularies")

    def expected_weight_names(self) -> set[str]:
        names = set()
        modules = dict(self.named_modules())
        for name, _ in self.named_parameters():
            names |= self._expected_shards(name, modules[name.rpartition(".")[0]])
        if self.config.tie_word_embeddings:
            names.discard("lm_head.weight")
        if self.config.draft_vocab_size < self.config.vocab_size:
            names.add("d2t")  # the map cannot be guessed
        if self.config.target_hidden_size != self.hidden_size:
            names.add("embed_tokens.weight")  # the target's table has another width
        return names

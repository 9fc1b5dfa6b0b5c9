"""ModelConfig: the model's shape and special tokens, read once from an HF folder's config.json."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                           "Qwen3MoeForCausalLM", "MixtralForCausalLM", "Phi3ForCausalLM", "Gemma3ForCausalLM",
                           # Gemma 3's multimodal checkpoints: their text tower (models/gemma3.py)
                           "Gemma3ForConditionalGeneration", "GptOssForCausalLM",
                           # Vision-language: images through the vision tower (models/qwen2_5_vl.py)
                           "Qwen2_5_VLForConditionalGeneration",
                           # Embedding checkpoints (the backbone alone, no LM head) and rerankers with a
                           # classification head (model_executor/models/llama.py); served with --is-embedding.
                           "LlamaModel", "MistralModel", "Qwen2Model", "Qwen3Model",
                           "LlamaForSequenceClassification", "MistralForSequenceClassification",
                           "Qwen2ForSequenceClassification", "Qwen3ForSequenceClassification")
# Draft heads for speculative decoding: loaded only as a draft model (from_pretrained(..., draft=True)); they
# take the target's hidden states and cannot be served on their own.
DRAFT_ARCHITECTURES = ("LlamaForCausalLMEagle3",)
# The rope types whose tables duet builds (through transformers' ROPE_INIT_FUNCTIONS: layers/rotary.py).
SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3", "longrope")
_QWEN = ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Qwen2Model", "Qwen3Model",
         "Qwen2ForSequenceClassification", "Qwen3ForSequenceClassification")


class ModelConfigError(ValueError):
    pass


class WeightLoadError(RuntimeError):
    """The weight files are missing, unreadable or do not fit; the message is one line for the user."""


class CheckpointMismatchError(WeightLoadError):
    """The checkpoint's tensors do not match the model built from config.json (names the first one)."""


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    rope_scaling: dict | None = None
    qk_norm: bool = False  # Qwen3: RMSNorm over each q and k head before the rotary
    # Mixture of experts (num_experts 0: a dense model); moe_layers: the layers whose MLP is the MoE block.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False  # renormalise the top-k router probabilities to sum to one
    moe_layers: tuple[int, ...] = ()
    # EAGLE-3 draft heads (LlamaForCausalLMEagle3): the reduced vocabulary of the head (vocab_size is the
    # target's, which d2t maps into), the width of the target's hidden states (3 of them go into fc), and the
    # target layers whose outputs it reads (None: the default for the target's depth,
    # models/eagle3.aux_layer_ids).
    draft_vocab_size: int | None = None
    target_hidden_size: int | None = None
    aux_hidden_state_layer_ids: tuple[int, ...] | None = None
    # The attention window (Mistral v0.1: 4096; Gemma 3: 1024) of the layers sliding_window_layers names: a query
    # at position p attends to positions p - sliding_window + 1 .. p there (HF's window); None: full attention.
    sliding_window: int | None = None
    sliding_window_layers: tuple[int, ...] = ()
    # The MLP's gated activation: silu, or gelu_pytorch_tanh (Gemma 3)
    hidden_act: str = "silu"
    # The fraction of each head the rotary turns (its first dims; Phi-4-mini: 0.75)
    partial_rotary_factor: float = 1.0
    # Gemma 3: the RoPE base of the sliding-window layers (the global ones take rope_theta and rope_scaling),
    # the attention scale's denominator (query_pre_attn_scalar ** -0.5) and the final logits' tanh cap.
    rope_local_theta: float | None = None
    query_pre_attn_scalar: float | None = None
    final_logit_softcapping: float | None = None
    # gpt-oss: a learned sink logit per query head in every attention layer, and the experts' clamped SwiGLU
    # ((up + 1) * gate * sigmoid(alpha * gate), gate clamped above at swiglu_limit, up to +-swiglu_limit).
    attention_sinks: bool = False
    swiglu_alpha: float | None = None
    swiglu_limit: float | None = None
    # The context length being served (build_model sets it): the RoPE table covers it, and the dynamic /
    # longrope tables are computed for it (layers/rotary.py).
    served_context_len: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    torch_dtype: str | None = None
    # Pooling (embedding / reranking) servers: the backbone's last hidden states are the output, the LM head is
    # never read (the runner sets this for --is-embedding); num_labels: a *ForSequenceClassification head's.
    embedding_only: bool = False
    num_labels: int = 0
    # Vision-language models (Qwen2.5-VL): M-RoPE's split of the rotary dims among (t, h, w), and the token
    # a prompt holds once per image embedding; empty / None for text-only models.
    mrope_section: tuple[int, ...] = ()
    image_token_id: int | None = None
    hf_config: dict = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def from_dict(cls, cfg: dict, draft: bool = False) -> ModelConfig:
        """draft: the config of a speculative draft model (a draft head's architecture is accepted)."""
        archs = cfg.get("architectures") or []
        head = next((a for a in archs if a in DRAFT_ARCHITECTURES), None)
        if head is not None and not draft:
            raise ModelConfigError(f"model architecture {head!r} is an EAGLE-3 draft head, not a model to serve "
                                   f"on its own: give it as the speculative draft model of its target")
        arch = head or next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            name = ", ".join(archs) or cfg.get("model_type", "unknown")
            if cfg.get("auto_map"):
                raise ModelConfigError(
                    f"model architecture {name!r} needs remote code (auto_map in config.json); duet runs only "
                    f"its own model code, for {', '.join(SUPPORTED_ARCHITECTURES)}")
            raise ModelConfigError(
                f"unsupported model architecture {name!r}; duet supports {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if arch.startswith("Gemma3"):
            cfg = _gemma3_text_config(arch, cfg)
        mrope: tuple[int, ...] = ()
        if arch == "Qwen2_5_VLForConditionalGeneration":
            cfg, mrope = _qwen2_5_vl_text_config(cfg)
        num_heads = cfg["num_attention_heads"]
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        rope_scaling = cfg.get("rope_scaling")
        rope_theta = cfg.get("rope_theta")
        partial = float(cfg.get("partial_rotary_factor", 1.0) or 1.0)
        if isinstance(cfg.get("rope_parameters"), dict):
            partial = float(cfg["rope_parameters"].get("partial_rotary_factor", partial) or 1.0)
        if rope_theta is None and isinstance(cfg.get("rope_parameters"), dict):  # transformers >= 5 layout
            rope_theta = cfg["rope_parameters"].get("rope_theta")
            if rope_scaling is None and cfg["rope_parameters"].get("rope_type", "default") != "default":
                rope_scaling = cfg["rope_parameters"]
        if rope_scaling is not None and rope_scaling.get("rope_type", rope_scaling.get("type")) in (None, "default"):
            rope_scaling = None
        if rope_scaling is not None:
            kind = rope_scaling.get("rope_type", rope_scaling.get("type"))
            if kind == "su" and arch == "Phi3ForCausalLM":  # Phi-3's name for longrope (HF's Phi-3 renames it)
                kind = "longrope"
            if kind not in SUPPORTED_ROPE_TYPES:
                raise ModelConfigError(f"config.json rope_type {kind!r} is not supported; duet supports "
                                       f"{', '.join(SUPPORTED_ROPE_TYPES)}")
            rope_scaling = {k: v for k, v in rope_scaling.items() if k not in ("type", "partial_rotary_factor")}
            rope_scaling["rope_type"] = kind
            if kind == "longrope" and "original_max_position_embeddings" not in rope_scaling:
                # Phi-3 keeps it at the top level of config.json
                rope_scaling["original_max_position_embeddings"] = cfg.get("original_max_position_embeddings",
                                                                           cfg.get("max_position_embeddings", 2048))
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // num_heads
        if not 0.0 < partial <= 1.0 or int(head_dim * partial) % 2:
            raise ModelConfigError(f"config.json partial_rotary_factor {partial} must be in (0, 1] and turn an even "
                                   f"number of the head's {head_dim} dims")
        moe = _moe_fields(arch, cfg)
        act = cfg.get("hidden_activation") or cfg.get("hidden_act", "silu")
        if act not in ("silu", "gelu_pytorch_tanh") or (act != "silu" and not arch.startswith("Gemma3")):
            raise ModelConfigError(f"config.json hidden_act {act!r} is not supported for {arch}; duet's MLP and "
                                   f"experts use silu (Gemma 3: gelu_pytorch_tanh)")
        window, window_layers = _sliding_window(arch, cfg)
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=num_heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta if rope_theta is not None else 10000.0),
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            # Qwen2 always has q/k/v bias; Llama only when attention_bias says so.
            attention_bias=arch.startswith("Qwen2") or bool(cfg.get("attention_bias", arch == "GptOssForCausalLM")),
            rope_scaling=rope_scaling,
            qk_norm=arch.startswith(("Qwen3", "Gemma3")),
            **moe,
            **_eagle3_fields(arch, cfg),
            sliding_window=window,
            sliding_window_layers=window_layers,
            hidden_act=act,
            partial_rotary_factor=partial,
            **_gemma3_fields(arch, cfg),
            **_gpt_oss_fields(arch, cfg),
            eos_token_ids=eos_ids,
            bos_token_id=cfg.get("bos_token_id"),
            torch_dtype=cfg.get("torch_dtype") or cfg.get("dtype"),
            num_labels=_num_labels(arch, cfg),
            mrope_section=mrope,
            image_token_id=cfg.get("image_token_id") if mrope else None,
            hf_config=cfg,
        )

    @classmethod
    def from_pretrained(cls, model_path: str | Path, draft: bool = False) -> ModelConfig:
        """draft: the folder holds a speculative draft model (a draft head's architecture is accepted)."""
        path = Path(model_path)
        if not path.is_dir():
            raise ModelConfigError(f"model path {str(path)!r} is not a folder")
        config_file = path / "config.json"
        if not config_file.is_file():
            raise ModelConfigError(f"model folder {str(path)!r} has no config.json")
        try:
            cfg = json.loads(config_file.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ModelConfigError(f"{config_file} is not valid JSON ({e})") from None
        # generation_config.json may list more EOS ids (Llama 3 instruct models do).
        gen_file = path / "generation_config.json"
        if gen_file.is_file():
            gen_eos = json.loads(gen_file.read_text()).get("eos_token_id")
            if gen_eos is not None:
                base = cfg.get("eos_token_id")
                ids = set(base if isinstance(base, list) else ([] if base is None else [base]))
                ids |= set(gen_eos if isinstance(gen_eos, list) else [gen_eos])
                cfg = {**cfg, "eos_token_id": sorted(ids)}
        try:
            return cls.from_dict(cfg, draft=draft)
        except KeyError as e:
            raise ModelConfigError(f"{config_file} has no {e.args[0]!r}, which the model needs") from None

    @property
    def context_len(self) -> int:
        """The default context length: max_position_embeddings."""
        return self.max_position_embeddings

    def layer_sliding_window(self, layer_id: int) -> int | None:
        """The attention window of a layer (None: full attention)."""
        return self.sliding_window if layer_id in self.sliding_window_layers else None

    @property
    def max_context_len(self) -> int:
        """The longest context the positions support: max_position_embeddings, or with RoPE scaling the
        original length times the scaling factor when that is larger."""
        limit = self.max_position_embeddings
        if self.rope_scaling is not None:
            original = self.rope_scaling.get("original_max_position_embeddings") or self.max_position_embeddings
            limit = max(limit, int(original * float(self.rope_scaling.get("factor", 1.0))))
        return limit

    def check_context_length(self, context_length: int | None) -> int:
        """The context length to serve: the flag's value when the positions support it, else the model's."""
        if self.draft_vocab_size is not None:
            # A draft head serves its target's context: past its own positions its drafts may be accepted less
            # often, never wrongly (the target checks every token); the RoPE table is built that long.
            return context_length or self.context_len
        if context_length is None:
            return self.context_len
        if context_length > self.max_context_len:
            why = "with its RoPE scaling" if self.rope_scaling is not None else "and config.json has no RoPE scaling"
            raise ModelConfigError(f"--context-length {context_length} is above the model's "
                                   f"{self.max_context_len} positions ({why}); use at most {self.max_context_len}")
        return context_length

    def num_params(self) -> int:
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        q = self.num_attention_heads * self.head_dim
        kv = self.num_key_value_heads * self.head_dim
        norms = 4 * h if self.architecture.startswith("Gemma3") else 2 * h  # Gemma 3: pre- and post-norms
        per_layer = h * (q + 2 * kv) + q * h + norms + (2 * self.head_dim if self.qk_norm else 0)
        mlp = 3 * h * i * (self.num_hidden_layers - len(self.moe_layers))
        experts = len(self.moe_layers) * self.num_experts * (3 * h * self.moe_intermediate_size + h)
        return v * h * (1 if self.tie_word_embeddings else 2) + self.num_hidden_layers * per_layer + mlp + experts + h


def _moe_fields(arch: str, cfg: dict) -> dict:
    """ModelConfig's MoE fields from an HF config (Qwen3-MoE, Mixtral or gpt-oss); empty for dense models."""
    if arch == "GptOssForCausalLM":  # top-k of the router's logits, softmax over those k: renormalised
        return {"num_experts": cfg["num_local_experts"],
                "num_experts_per_tok": cfg.get("num_experts_per_tok", cfg.get("experts_per_token", 4)),
                "moe_intermediate_size": cfg["intermediate_size"], "norm_topk_prob": True,
                "moe_layers": tuple(range(cfg["num_hidden_layers"]))}
    if arch == "MixtralForCausalLM":
        num_experts = cfg["num_local_experts"]
        return {"num_experts": num_experts, "num_experts_per_tok": cfg.get("num_experts_per_tok", 2),
                    "moe_intermediate_size": cfg["intermediate_size"], "norm_topk_prob": True,
                    "moe_layers": tuple(range(cfg["num_hidden_layers"]))}
    if arch != "Qwen3MoeForCausalLM":
        return {}
    # transformers >= 5 saves num_experts as num_local_experts (its attribute map); hub configs say num_experts
    num_experts = cfg.get("num_experts", cfg.get("num_local_experts"))
    if not num_experts:
        raise ModelConfigError("config.json of Qwen3MoeForCausalLM has no num_experts")
    step = cfg.get("decoder_sparse_step", 1) or 1
    dense = set(cfg.get("mlp_only_layers") or ())
    layers = tuple(i for i in range(cfg["num_hidden_layers"]) if i not in dense and (i + 1) % step == 0)
    return {"num_experts": num_experts, "num_experts_per_tok": cfg["num_experts_per_tok"],
                "moe_intermediate_size": cfg["moe_intermediate_size"],
                "norm_topk_prob": bool(cfg.get("norm_topk_prob", False)), "moe_layers": layers}


def _sliding_window(arch: str, cfg: dict) -> tuple[int | None, tuple[int, ...]]:
    """(window, the layers it applies to) as HF's attention applies it: layer_types' sliding_attention layers
    where config.json lists them (Gemma 3 without it: every sliding_window_pattern-th layer is global); Qwen
    only with use_sliding_window (the layers from max_window_layers on, without layer_types); Mistral, Mixtral
    and Phi-3 on every layer whenever sliding_window is set; Llama never."""
    window = cfg.get("sliding_window")
    n = cfg["num_hidden_layers"]
    if not window or arch.startswith("Llama") or (arch in _QWEN and not cfg.get("use_sliding_window", False)):
        return None, ()
    window = int(window)
    types = cfg.get("layer_types")
    if arch == "GptOssForCausalLM" and not types:  # (HF's default: sliding first, then alternating)
        types = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n)]
    if arch.startswith("Gemma3") and not types:
        pattern = int(cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern") or 6)
        types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n)]
    if types and not arch.startswith(("Mistral", "Mixtral")):  # (HF's Mistral ignores layer_types)
        if len(types) != n:
            raise ModelConfigError(f"config.json layer_types has {len(types)} entries for {n} layers")
        return window, tuple(i for i, t in enumerate(types) if t == "sliding_attention")
    if arch in _QWEN and "Moe" not in arch:
        return window, tuple(range(int(cfg.get("max_window_layers", n)), n))
    return window, tuple(range(n))


def _gemma3_text_config(arch: str, cfg: dict) -> dict:
    """A Gemma 3 config.json's text model: the text_config of a multimodal checkpoint, with HF's defaults for
    what it leaves out (transformers' Gemma3TextConfig fills them; rope_parameters in its layout)."""
    from transformers import Gemma3TextConfig

    text = cfg.get("text_config", cfg) if arch == "Gemma3ForConditionalGeneration" else cfg
    keep = {k: v for k, v in text.items() if k not in ("architectures", "model_type", "auto_map")}
    full = Gemma3TextConfig(**keep).to_dict()
    for k in ("eos_token_id", "bos_token_id", "torch_dtype", "dtype", "tie_word_embeddings"):
        if k in cfg and cfg is not text:  # the served model's own (outer) config wins
            full[k] = cfg[k]
    full["architectures"] = [arch]
    glob = (full.get("rope_parameters") or {}).get("full_attention") or {}
    full["rope_theta"] = glob.get("rope_theta", 1_000_000.0)
    full["rope_scaling"] = glob if glob.get("rope_type", "default") != "default" else None
    return full


def _qwen2_5_vl_text_config(cfg: dict) -> tuple[dict, tuple[int, ...]]:
    """A Qwen2.5-VL config.json's text model at the top level (transformers 5 nests it in text_config; 4 has it
    there already) with its vision_config and image token ids kept, and its mrope_section; the rope type
    "mrope" / "default" is the plain table (M-RoPE only chooses the positions)."""
    text = cfg.get("text_config") or {}
    full = {**{k: v for k, v in cfg.items() if k != "text_config"}, **text}
    full["architectures"] = cfg.get("architectures")
    for key in ("image_token_id", "vision_start_token_id", "vision_end_token_id", "video_token_id"):
        if key in cfg:
            full[key] = cfg[key]
    rope = dict(full.get("rope_parameters") or full.get("rope_scaling") or {})
    section = rope.get("mrope_section")
    if not section or "vision_config" not in full:
        raise ModelConfigError("a Qwen2.5-VL config.json needs rope mrope_section and vision_config")
    if rope.get("rope_type", rope.get("type")) in ("mrope", "default", None):
        full["rope_theta"] = rope.get("rope_theta", full.get("rope_theta"))
        full["rope_scaling"] = None
        full.pop("rope_parameters", None)
    return full, tuple(int(n) for n in section)


def _gemma3_fields(arch: str, cfg: dict) -> dict:
    """ModelConfig's Gemma 3 fields (cfg: _gemma3_text_config's); empty for other models."""
    if not arch.startswith("Gemma3"):
        return {}
    if cfg.get("attn_logit_softcapping") is not None:
        raise ModelConfigError("config.json attn_logit_softcapping is not supported (Gemma 3 has none)")
    if cfg.get("use_bidirectional_attention"):
        raise ModelConfigError("config.json use_bidirectional_attention is not supported (a causal LM is served)")
    local = (cfg.get("rope_parameters") or {}).get("sliding_attention") or {}
    if local.get("rope_type", "default") != "default":
        raise ModelConfigError(f"config.json rope_parameters.sliding_attention rope_type {local['rope_type']!r} "
                               f"is not supported (duet scales only the global layers' RoPE)")
    cap = cfg.get("final_logit_softcapping")
    return {"rope_local_theta": float(local.get("rope_theta", cfg.get("rope_local_base_freq", 10000.0))),
            "query_pre_attn_scalar": float(cfg.get("query_pre_attn_scalar", 256)),
            "final_logit_softcapping": float(cap) if cap else None}


def _gpt_oss_fields(arch: str, cfg: dict) -> dict:
    """ModelConfig's gpt-oss fields (HF's defaults where config.json leaves them out); empty for other models."""
    if arch != "GptOssForCausalLM":
        return {}
    return {"attention_sinks": True, "swiglu_alpha": float(cfg.get("swiglu_alpha", 1.702)),
            "swiglu_limit": float(cfg.get("swiglu_limit", 7.0))}


def _num_labels(arch: str, cfg: dict) -> int:
    """A *ForSequenceClassification model's label count (transformers: num_labels, else len(id2label))."""
    if not arch.endswith("ForSequenceClassification"):
        return 0
    return int(cfg.get("num_labels") or len(cfg.get("id2label") or {}) or 2)
def _eagle3_fields(arch: str, cfg: dict) -> dict:
    """ModelConfig's EAGLE-3 fields from a LlamaForCausalLMEagle3 config.json; empty for other models.

    The target layers come from eagle_config.eagle_aux_hidden_state_layer_ids (SGLang's and SpecForge's
    layout: the outputs of those layers), or a top-level eagle_aux_hidden_state_layer_ids (vLLM's layout,
    counted as the inputs of those layers: id i there is the output of layer i - 1)."""
    if arch not in DRAFT_ARCHITECTURES:
        return {}
    if cfg["num_hidden_layers"] != 1:
        raise ModelConfigError(f"config.json of {arch} has num_hidden_layers {cfg['num_hidden_layers']}; "
                               f"duet runs EAGLE-3 heads of one decoder layer")
    vocab = cfg["vocab_size"]
    draft_vocab = cfg.get("draft_vocab_size") or vocab
    if not 0 < draft_vocab <= vocab:
        raise ModelConfigError(f"config.json of {arch}: draft_vocab_size {draft_vocab} must be in 1..vocab_size "
                               f"({vocab})")
    if cfg.get("tie_word_embeddings") and draft_vocab != vocab:
        raise ModelConfigError(f"config.json of {arch} ties the LM head to the embedding but its draft_vocab_size "
                               f"{draft_vocab} is not vocab_size {vocab}")
    nested = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    top = cfg.get("eagle_aux_hidden_state_layer_ids")
    ids = None
    if nested is not None:
        ids = tuple(int(i) for i in nested)
    if top is not None:
        from_top = tuple(int(i) - 1 for i in top)
        if ids is not None and ids != from_top:
            raise ModelConfigError(f"config.json of {arch} names two different target layer lists: "
                                   f"eagle_config.eagle_aux_hidden_state_layer_ids {list(nested)} and "
                                   f"eagle_aux_hidden_state_layer_ids {list(top)} (layer inputs)")
        ids = from_top
    if ids is not None and (len(ids) != 3 or len(set(ids)) != 3 or min(ids) < 0):
        raise ModelConfigError(f"config.json of {arch}: eagle_aux_hidden_state_layer_ids must name 3 distinct "
                               f"target layers, got {list(nested if nested is not None else top)}")
    return {"draft_vocab_size": draft_vocab, "target_hidden_size": cfg.get("target_hidden_size") or cfg["hidden_size"],
            "aux_hidden_state_layer_ids": ids}

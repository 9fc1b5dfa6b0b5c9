"""Pooling models: what a model folder serves (embeddings or reranking scores, from the flags and the folder's
sentence-transformers files), and the pooling of an extend batch's final hidden states.

A pooling request is prefilled like any prompt (chunked when long, batched with other requests) and returns,
instead of a sampled token, either its pooled final hidden state (last token, mean, or first token) or its
last position's logits at a few ids (a Qwen3-Reranker's "no"/"yes", a classification head's labels).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from model_executor.model_config import ModelConfig

POOLING_MODES = ("last", "mean", "cls")
# sentence-transformers' 1_Pooling/config.json keys -> ours
_ST_MODES = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls"}
_ST_MODULES_OK = ("Transformer", "Pooling", "Normalize")


class PoolingConfigError(ValueError):
    """The folder's pooling set-up cannot be served; one line naming the file or the flag."""


@dataclass(frozen=True)
class PoolingConfig:
    task: str  # "embed" (/v1/embeddings) or "rerank" (/v1/rerank, /v1/score)
    pooling: str = "last"  # embed: last | mean | cls
    normalize: bool = True  # embed: L2-normalise the pooled vector
    reranker: str | None = None  # rerank: "classifier" (a sequence-classification head) or "yes_no"

    @property
    def embedding_only(self) -> bool:
        """The model's LM head is never read (a yes/no reranker reads it; a classifier has its own head)."""
        return self.task == "embed"


def resolve_pooling(model_path: str | Path, is_embedding: bool, is_reranker: bool) -> PoolingConfig | None:
    """What the model folder serves: None for generation. A *ForSequenceClassification architecture is a
    reranker; --is-reranker on a causal LM scores as Qwen3-Reranker; --is-embedding, a sentence-transformers
    folder (modules.json, 1_Pooling/config.json) or a backbone-only *Model architecture serve embeddings."""
    path = Path(model_path)
    cfg = ModelConfig.from_pretrained(path)
    arch = cfg.architecture
    if arch.endswith("ForSequenceClassification"):
        if cfg.num_labels != 1:
            raise PoolingConfigError(f"{arch} with {cfg.num_labels} labels: duet's rerank scores use a one-label "
                                     "head (sigmoid of its logit)")
        return PoolingConfig("rerank", reranker="classifier")
    if is_reranker:
        if arch.endswith("Model"):
            raise PoolingConfigError(f"--is-reranker: {arch} has no LM head to read the 'yes'/'no' logits from")
        if cfg.num_experts:
            raise PoolingConfigError(f"--is-reranker supports the dense Llama and Qwen families, not {arch}")
        return PoolingConfig("rerank", reranker="yes_no")
    modules_file, pooling_file = path / "modules.json", path / "1_Pooling" / "config.json"
    detected = modules_file.is_file() or pooling_file.is_file() or arch.endswith("Model")
    if not (is_embedding or detected):
        return None
    if cfg.num_experts:
        raise PoolingConfigError(f"embeddings are served for the dense Llama and Qwen families, not {arch}")
    normalize = True
    if modules_file.is_file():
        modules = _read_json(modules_file)
        if not isinstance(modules, list):
            raise PoolingConfigError(f"{modules_file}: expected a list of modules")
        kinds = [str(m.get("type", "")).rpartition(".")[2] for m in modules if isinstance(m, dict)]
        other = [k for k in kinds if k not in _ST_MODULES_OK]
        if other:
            raise PoolingConfigError(f"{modules_file}: module {other[0]} is not supported (duet serves "
                                     "Transformer -> Pooling -> Normalize)")
        normalize = "Normalize" in kinds
        for m in modules:
            if isinstance(m, dict) and str(m.get("type", "")).endswith("Pooling") and m.get("path"):
                pooling_file = path / m["path"] / "config.json"
    pooling = "last"
    if pooling_file.is_file():
        pooling = _st_pooling_mode(pooling_file, _read_json(pooling_file))
    return PoolingConfig("embed", pooling=pooling, normalize=normalize)


def _read_json(file: Path):
    try:
        return json.loads(file.read_text())
    except (OSError, ValueError) as e:
        raise PoolingConfigError(f"{file} is not readable JSON ({e})") from None


def _st_pooling_mode(file: Path, cfg) -> str:
    if not isinstance(cfg, dict):
        raise PoolingConfigError(f"{file}: expected a JSON object")
    on = [k for k, v in cfg.items() if k.startswith("pooling_mode_") and v]
    if len(on) != 1 or on[0] not in _ST_MODES:
        raise PoolingConfigError(f"{file}: pooling {', '.join(on) or 'none'} is not supported (duet pools "
                                 "with one of pooling_mode_lasttoken, pooling_mode_mean_tokens, "
                                 "pooling_mode_cls_token)")
    return _ST_MODES[on[0]]


# ---- the forward pass's side ----------------------------------------------------------------------------


@dataclass(frozen=True)
class PoolingPlan:
    """What an extend batch with pooling requests needs from its final hidden states besides each request's
    last row (always taken): per-request row sums (mean pooling) and first rows (cls pooling)."""

    sums: bool = False
    firsts: bool = False


@dataclass
class PooledHidden:
    """float32 [bs, H] each: every request's last row, and its rows' sum / first row when the plan asks."""

    last: torch.Tensor
    sums: torch.Tensor | None = None
    firsts: torch.Tensor | None = None


def pool_hidden(hidden: torch.Tensor, extend_start_loc: torch.Tensor, extend_seq_lens: torch.Tensor,
                plan: PoolingPlan) -> PooledHidden:
    """hidden: [tokens, H], the final norm's output of an extend batch whose requests' rows start at
    extend_start_loc and number extend_seq_lens."""
    starts, lens = extend_start_loc.long(), extend_seq_lens.long()
    out = PooledHidden(hidden.index_select(0, starts + lens - 1).float())
    if plan.sums:
        seg = torch.repeat_interleave(torch.arange(len(lens), device=hidden.device), lens,
                                      output_size=hidden.shape[0])
        out.sums = torch.zeros(len(lens), hidden.shape[1], dtype=torch.float32,
                               device=hidden.device).index_add_(0, seg, hidden.float())
    if plan.firsts:
        out.firsts = hidden.index_select(0, starts).float()
    return out

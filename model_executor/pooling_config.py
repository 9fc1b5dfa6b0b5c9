"""What a model folder serves: embeddings or reranking scores, from the flags and the folder's
sentence-transformers files. Torch-free: the HTTP process reads it (model_executor/pooling.py pools the
hidden states)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

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

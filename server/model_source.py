"""Where the model comes from: a local folder or a Hugging Face hub id, checked before any process starts.

`resolve_model_source(args)` turns `--model-path` / `--tokenizer-path` into local folders (hub ids through
huggingface_hub's snapshot_download, which honours HF_HOME, HF_HUB_CACHE and HF_HUB_OFFLINE) and checks the
folder: config.json, a supported architecture without remote code, the context length, the checkpoint's
tensor names and shapes (headers only) and the tokenizer files. Every failure is a ModelSourceError whose
message is one line for the user.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

# What a served model needs from a hub repo: skips *.bin / *.pth duplicates of the weights.
HUB_ALLOW_PATTERNS = ["*.json", "*.safetensors", "tokenizer.model", "*.tiktoken", "merges.txt", "vocab.txt",
                      "*.jinja"]
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


class ModelSourceError(ValueError):
    """The model or tokenizer cannot be used; the message is one line naming the flag or the file."""


def hub_offline() -> bool:
    """Read at call time (huggingface_hub reads it once, at import)."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def hub_cache_dir(download_dir: str | None = None) -> str:
    """--download-dir, else HF_HUB_CACHE, else HF_HOME/hub, else ~/.cache/huggingface/hub (read at call time)."""
    if download_dir:
        return str(Path(download_dir).expanduser())
    if os.environ.get("HF_HUB_CACHE"):
        return os.environ["HF_HUB_CACHE"]
    home = os.environ.get("HF_HOME") or str(Path(os.environ.get("XDG_CACHE_HOME", "~/.cache")) / "huggingface")
    return str(Path(home).expanduser() / "hub")


def is_hub_id(name: str) -> bool:
    return bool(_REPO_ID.match(name)) and ".." not in name and not Path(name).exists()


def download_from_hub(repo_id: str, *, revision: str | None = None, download_dir: str | None = None,
                      flag: str = "--model-path") -> Path:
    """The local snapshot folder of repo_id (downloaded unless cached, or taken from the cache when offline)."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    cache = hub_cache_dir(download_dir)
    offline = hub_offline()
    rev = revision or "main"
    try:
        return Path(snapshot_download(repo_id, revision=revision, cache_dir=cache, allow_patterns=HUB_ALLOW_PATTERNS,
                                      local_files_only=offline))
    except GatedRepoError:
        raise ModelSourceError(f"{flag} {repo_id}: the hub repo is gated; accept its terms and log in "
                               "(`hf auth login`) or pass a local folder") from None
    except RevisionNotFoundError:
        raise ModelSourceError(f"--revision {rev} does not exist in hub repo {repo_id}") from None
    except RepositoryNotFoundError:
        raise ModelSourceError(f"{flag} {repo_id}: no such folder, and no such hub repo (or it is private)") from None
    except LocalEntryNotFoundError:
        if offline:
            raise ModelSourceError(
                f"{flag} {repo_id} (revision {rev}) is not in the local Hugging Face cache {cache} and "
                f"HF_HUB_OFFLINE is set; download it first (`hf download {repo_id}`) or unset HF_HUB_OFFLINE"
            ) from None
        raise ModelSourceError(f"{flag} {repo_id}: cannot reach the Hugging Face hub and the model is not in "
                               f"the cache {cache}") from None
    except Exception as e:  # noqa: BLE001 (network, disk, HTTP errors of every kind: one line, no traceback)
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ModelSourceError(f"{flag} {repo_id}: download failed ({type(e).__name__}: {reason})") from None


def resolve_folder(name: str, *, flag: str, revision: str | None, download_dir: str | None) -> tuple[Path, bool]:
    """(local folder, whether it came from the hub)."""
    path = Path(name).expanduser()
    if path.is_dir():
        return path, False
    if path.exists():
        raise ModelSourceError(f"{flag} {name} is a file; an HF model folder or a hub id (org/name) is needed")
    if not is_hub_id(name):
        raise ModelSourceError(f"{flag} {name} is not a folder (no such path, and not a hub id org/name)")
    return download_from_hub(name, revision=revision, download_dir=download_dir, flag=flag), True


def check_tokenizer_folder(folder: Path, flag: str) -> None:
    if not any((folder / f).is_file() for f in TOKENIZER_FILES):
        raise ModelSourceError(f"{flag} folder {str(folder)!r} has no tokenizer ({' / '.join(TOKENIZER_FILES)} "
                               f"missing); add the tokenizer files or pass --tokenizer-path")


def check_model_folder(folder: Path, *, context_length: int | None = None, check_weights: bool = True):
    """config.json, architecture and context length, then the weight files; returns the ModelConfig.

    Torch is imported only for the last check (tensor names and shapes), so the common mistakes are
    reported in a fraction of a second."""
    from model_executor.checkpoint_files import checkpoint_files
    from model_executor.model_config import ModelConfig, ModelConfigError, WeightLoadError

    try:
        cfg = ModelConfig.from_pretrained(folder)
        cfg.check_context_length(context_length)
        if check_weights:
            checkpoint_files(folder)
    except (ModelConfigError, WeightLoadError) as e:
        raise ModelSourceError(str(e)) from None
    return cfg


def check_checkpoint_tensors(folder: Path, cfg) -> None:
    from model_executor.model_config import WeightLoadError
    from model_executor.weight_loader import check_checkpoint

    try:
        check_checkpoint(folder, cfg)
    except WeightLoadError as e:
        raise ModelSourceError(str(e)) from None


def resolve_pooling_task(folder: Path, args):
    """The folder's PoolingConfig under --is-embedding / --is-reranker (None: a generation server)."""
    from model_executor.model_config import ModelConfigError
    from model_executor.pooling_config import PoolingConfigError, resolve_pooling

    try:
        return resolve_pooling(folder, args.is_embedding, args.is_reranker)
    except (PoolingConfigError, ModelConfigError) as e:
        raise ModelSourceError(str(e)) from None


def check_draft_model(args, target_cfg) -> dict:
    """--speculative-draft-model-path as a local folder whose config can draft for the target (STANDALONE: the same
    vocabulary; EAGLE3: an EAGLE-3 head that fits the target); {} without one."""
    if args.speculative_draft_model_path is None:
        return {}
    from model_executor.model_config import ModelConfig, ModelConfigError, WeightLoadError
    from scheduler.draft_model import check_draft_config

    flag = "--speculative-draft-model-path"
    folder, _ = resolve_folder(args.speculative_draft_model_path, flag=flag, revision=None,
                               download_dir=args.download_dir)
    try:
        draft = ModelConfig.from_pretrained(folder, draft=args.speculative_algorithm == "EAGLE3")
        check_draft_config(args.speculative_algorithm, draft, target_cfg)
    except (ModelConfigError, WeightLoadError) as e:
        raise ModelSourceError(f"{flag}: {e}") from None
    return {"speculative_draft_model_path": str(folder)}


def resolve_model_source(args) -> dict:
    """The ServerArgs changes that make --model-path / --tokenizer-path local, checked folders."""
    model, from_hub = resolve_folder(args.model_path, flag="--model-path", revision=args.revision,
                                     download_dir=args.download_dir)
    if args.tokenizer_path is None:
        tokenizer, tokenizer_flag = model, "--model-path"
    else:
        tokenizer, _ = resolve_folder(args.tokenizer_path, flag="--tokenizer-path", revision=None,
                                      download_dir=args.download_dir)
        tokenizer_flag = "--tokenizer-path"
    # Order: what a user fixes first. An empty folder reports its missing config.json.
    check_weights = args.load_format != "dummy"
    cfg = check_model_folder(model, context_length=args.context_length, check_weights=check_weights)
    check_tokenizer_folder(tokenizer, tokenizer_flag)
    pooling = resolve_pooling_task(model, args)
    if pooling is not None and pooling.embedding_only:
        import dataclasses

        cfg = dataclasses.replace(cfg, embedding_only=True)  # its tensors are read as the embedding model's
    if check_weights:
        check_checkpoint_tensors(model, cfg)
    changes = {"model_path": str(model), "tokenizer_path": str(tokenizer),
               **check_draft_model(args, cfg),
               # what the folder serves, detected where the flags leave it open (model_executor/pooling.py)
               "is_embedding": pooling is not None and pooling.task == "embed",
               "is_reranker": pooling is not None and pooling.task == "rerank"}
    if from_hub and args.served_model_name is None:
        changes["served_model_name"] = args.model_path  # not the snapshot folder's commit hash
    return changes

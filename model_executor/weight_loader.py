"""Builds a model from a config and loads its weights from `*.safetensors` (or random, for benchmarks).

The model is built on the meta device (no memory at all), cast to the target dtype there, and only then
given real storage on its device, so nothing is ever created in float32 and then cast. Checkpoint tensors
stream in one at a time from memory-mapped shards; a dtype conversion happens on the host, so the device
never holds more than the weights themselves. Buffers that are not in the checkpoint (the RoPE table) are
computed after that materialization.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm

from model_executor.checkpoint_files import checkpoint_files, read_header
from model_executor.distributed import parallel_state as ps
from model_executor.layers.embedding import VocabParallelEmbedding
from model_executor.layers.quantization import (
    QuantConfig,
    QuantizationError,
    checkpoint_quant_config,
    finish_loading,
    quantization_context,
    restore_kept_dtypes,
)
from model_executor.layers.rotary import RotaryEmbedding
from model_executor.lazy_slice import LazySlice
from model_executor.model_config import CheckpointMismatchError, ModelConfig, WeightLoadError
from model_executor.models import EMBEDDING_CLASS, MODEL_REGISTRY

logger = logging.getLogger("duet.weight_loader")

__all__ = ["CheckpointMismatchError", "WeightLoadError", "build_model", "check_checkpoint", "load_model"]

PROGRESS_MIN_BYTES = 256 * 1024**2  # no progress bar for small checkpoints (tests, the default model)
# safetensors header dtype names; only shapes matter for the header check, so anything else reads as float32.
_HEADER_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                  "F8_E4M3": torch.float8_e4m3fn}


def _model_class(cfg: ModelConfig):
    cls = MODEL_REGISTRY[cfg.architecture]
    if cfg.embedding_only and cls is not EMBEDDING_CLASS:
        if cfg.num_experts or cfg.num_labels or cls is not MODEL_REGISTRY["LlamaForCausalLM"]:
            raise ValueError(f"{cfg.architecture} cannot be served for embeddings (--is-embedding supports the "
                             "dense Llama and Qwen families)")
        return EMBEDDING_CLASS
    return cls


def check_tensor_parallel(cfg: ModelConfig, tp_size: int) -> None:
    """ValueError (one line) unless the architecture shards and its heads and MLP split over tp_size ranks."""
    if tp_size == 1:
        return
    if not getattr(_model_class(cfg), "supports_tensor_parallel", False):
        raise ValueError(f"{cfg.architecture} does not support tensor parallelism yet")
    ps.heads_per_rank(cfg.num_attention_heads, tp_size)
    ps.kv_heads_per_rank(cfg.num_key_value_heads, tp_size)
    if cfg.intermediate_size % tp_size:  # (the MLP's, and gpt-oss's experts')
        raise ValueError(f"intermediate size {cfg.intermediate_size} cannot be split over {tp_size} "
                         f"tensor-parallel ranks")


def build_meta_model(cfg: ModelConfig, dtype: torch.dtype = torch.float32,
                     quant: QuantConfig | None = None) -> torch.nn.Module:
    """The model with shapes and dtypes only (meta tensors): costs no memory.

    quant: the linear layers' quantization; their quantized tensors keep their own dtypes."""
    check_tensor_parallel(cfg, ps.get_tp_size())
    if ps.get_tp_size() > 1 and (quant is not None or checkpoint_quant_config(cfg.hf_config) is not None):
        raise ValueError("quantized models do not support tensor parallelism yet (their scales are not sharded)")
    with torch.device("meta"), quantization_context(quant):
        model = _model_class(cfg)(cfg)
    model = model.to(dtype=dtype)
    restore_kept_dtypes(model)
    return model


def build_model(cfg: ModelConfig, dtype: torch.dtype, device: torch.device | str,
                max_positions: int | None = None, quant: QuantConfig | None = None) -> torch.nn.Module:
    """The model on `device` in `dtype`, parameters uninitialized (load or init them next).

    max_positions: the served context length (a longer RoPE table than the config's when a --context-length
    that RoPE scaling allows is above max_position_embeddings).
    """
    if max_positions is not None:
        cfg = dataclasses.replace(cfg, served_context_len=max_positions)
    model = build_meta_model(cfg, dtype, quant)
    _materialize(model, torch.device(device))
    for module in model.modules():  # modules() yields the shared table once
        if isinstance(module, RotaryEmbedding):
            module.init_cache()
    return model.eval()


def _materialize(model: torch.nn.Module, device: torch.device) -> None:
    """Give every meta parameter and buffer uninitialized storage on `device`, same shape and dtype.

    Unlike `Module.to_empty`, this keeps each parameter's attributes (the layers' `weight_loader`) and
    its sharing (tied embeddings stay one tensor)."""
    new: dict[int, torch.nn.Parameter] = {}
    for module in model.modules():
        for name, p in module._parameters.items():
            if p is None:
                continue
            if id(p) not in new:
                fresh = torch.nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device=device),
                                           requires_grad=p.requires_grad)
                fresh.__dict__.update(p.__dict__)
                new[id(p)] = fresh
            module._parameters[name] = new[id(p)]
        for name, b in module._buffers.items():
            if b is not None:
                module._buffers[name] = torch.empty(b.shape, dtype=b.dtype, device=device)


_DTYPE_BYTES = {"F64": 8, "I64": 8, "F32": 4, "I32": 4, "F16": 2, "BF16": 2, "I16": 2, "U8": 1, "I8": 1,
                "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}


def _reads_pytorch_bin(cfg: ModelConfig) -> bool:
    """Whether the architecture's weights may come as PyTorch *.bin shards (draft heads are often published so)."""
    return getattr(_model_class(cfg), "reads_pytorch_bin", False)


def _load_bin(file: Path, meta: bool = False) -> dict[str, torch.Tensor]:
    """A PyTorch *.bin shard's tensors (weights_only: no code runs), memory-mapped where its format allows; meta:
    their shapes and dtypes only."""
    try:
        try:
            tensors = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError:  # the legacy (non-zip) format cannot be memory-mapped
            tensors = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 (torch.load raises many types for a bad file)
        raise WeightLoadError(f"{file} is not a readable PyTorch weight file ({type(e).__name__})") from None
    if not isinstance(tensors, dict):
        raise WeightLoadError(f"{file} holds no tensor dictionary")
    if meta:
        return {k: torch.empty(v.shape, dtype=v.dtype, device="meta") for k, v in tensors.items()}
    return tensors


def _iter_weights(files: list[Path]) -> Iterator[tuple[str, torch.Tensor | LazySlice]]:
    """(name, tensor) of safetensors or PyTorch *.bin shards, in file order."""
    if files and files[0].suffix == ".bin":
        for file in files:
            yield from _load_bin(file).items()
        return
    yield from _iter_safetensors(files)


def _iter_safetensors(files: list[Path], lazy: bool | None = None) -> Iterator[tuple[str, torch.Tensor | LazySlice]]:
    """(name, tensor) in file order. lazy (default: under tensor parallelism) yields LazySlices, so each
    rank reads only the shard its layers narrow them to."""
    lazy = ps.get_tp_size() > 1 if lazy is None else lazy
    total = sum(f.stat().st_size for f in files)
    with tqdm(total=total, desc="loading weights", unit="B", unit_scale=True, unit_divisor=1024,
              disable=total < PROGRESS_MIN_BYTES) as bar:
        for i, file in enumerate(files, 1):
            bar.set_postfix_str(f"shard {i}/{len(files)}")
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open handles are not mappings)
                    if lazy:
                        sl = f.get_slice(name)
                        shape = tuple(sl.get_shape())
                        yield name, LazySlice(sl, shape)
                        bar.update(_DTYPE_BYTES.get(sl.get_dtype(), 4) * int(torch.Size(shape).numel()))
                        continue
                    tensor = f.get_tensor(name)
                    yield name, tensor
                    bar.update(tensor.nbytes)


# Per-layer KV-cache scales as FP8 checkpoints store them (compressed-tensors kv_cache_scheme: attention's
# k_scale / v_scale; older ones: the k/v projections' output_scale). They belong to the KV cache, not to a
# layer: taken out of the stream here and handed to the model runner.
_KV_SCALE_SUFFIXES = {".self_attn.k_scale": 0, ".self_attn.v_scale": 1,
                      ".self_attn.k_proj.output_scale": 0, ".self_attn.v_proj.output_scale": 1}


def _take_kv_scales(weights: Iterator[tuple[str, torch.Tensor]], into: dict[tuple[int, int], torch.Tensor]):
    """Yield every tensor but the KV scales; those go into `into[(layer, 0 for K / 1 for V)]`."""
    for name, tensor in weights:
        suffix = next((s for s in _KV_SCALE_SUFFIXES if name.endswith(s)), None)
        if suffix is None or ".layers." not in name:
            yield name, tensor
            continue
        layer = int(name.split(".layers.", 1)[1].split(".", 1)[0])
        into[(layer, _KV_SCALE_SUFFIXES[suffix])] = tensor


def kv_scales_from(found: dict[tuple[int, int], torch.Tensor], num_layers: int) -> tuple[list[float], list[float]] | None:
    """(k_scales, v_scales) per layer when the checkpoint gave them for every layer; None when it gave none."""
    if not found:
        return None
    missing = [(i, kv) for i in range(num_layers) for kv in (0, 1) if (i, kv) not in found]
    if missing:
        layer, kv = missing[0]
        raise CheckpointMismatchError(f"the checkpoint has KV-cache scales but none for layer {layer}'s "
                                      f"{'KV'[kv]} ({len(missing)} missing)")
    return ([float(found[(i, 0)]) for i in range(num_layers)], [float(found[(i, 1)]) for i in range(num_layers)])


def _check_complete(model: torch.nn.Module, loaded: set[str], path: Path) -> None:
    missing = sorted(model.expected_weight_names() - loaded)
    if missing:
        raise CheckpointMismatchError(
            f"checkpoint in {str(path)!r} has no tensor {model.checkpoint_name(missing[0])!r} "
            f"({len(missing)} missing tensors)")


def check_checkpoint(path: str | Path, cfg: ModelConfig) -> None:
    """Match the shards' tensor names and shapes against the model built from cfg, reading only the
    headers: a mismatch is found in milliseconds, before anything is loaded.

    Raises WeightLoadError (files) or CheckpointMismatchError (the first mismatching tensor)."""
    path = Path(path)
    files = checkpoint_files(path, allow_bin=_reads_pytorch_bin(cfg))
    try:  # a pre-quantized checkpoint's tensors are its method's (online quantization keeps the names)
        model = build_meta_model(cfg, quant=checkpoint_quant_config(cfg.hf_config))
    except QuantizationError as e:
        raise WeightLoadError(str(e)) from None

    def meta_tensors():
        for file in files:
            if file.suffix == ".bin":
                yield from _load_bin(file, meta=True).items()
                continue
            for name, info in read_header(file).items():
                dtype = _HEADER_DTYPES.get(info.get("dtype"), torch.float32)
                yield name, torch.empty(info.get("shape", ()), dtype=dtype, device="meta")

    _check_complete(model, model.load_weights(_take_kv_scales(meta_tensors(), {})), path)


def load_model(model_path: str | Path, cfg: ModelConfig, dtype: torch.dtype, device: torch.device | str,
               max_positions: int | None = None, quant: QuantConfig | None = None) -> torch.nn.Module:
    path = Path(model_path)
    files = checkpoint_files(path, allow_bin=_reads_pytorch_bin(cfg))
    model = build_model(cfg, dtype, device, max_positions, quant)
    with torch.no_grad():
        found: dict[tuple[int, int], torch.Tensor] = {}
        loaded = model.load_weights(_take_kv_scales(_iter_weights(files), found))
    _check_complete(model, loaded, path)
    finish_loading(model)
    model.kv_scales = kv_scales_from(found, cfg.num_hidden_layers)  # for an FP8 KV cache
    return model


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the parameters and buffers (a tied weight counts once)."""
    tensors = {id(t): t for t in (*model.parameters(), *model.buffers())}
    return sum(t.numel() * t.element_size() for t in tensors.values())


def init_random_weights(model: torch.nn.Module, seed: int = 0, std: float = 0.02) -> torch.nn.Module:
    """Random weights with sane scales (norms at 1), for benchmarks and GPU tests of real shapes.

    Drawn in place in the parameter's dtype: no float32 copy of a large tensor ever exists. Quantized
    layers draw their weight in the dtype they quantize from, one layer at a time, and quantize it."""
    with torch.no_grad():
        done: set[str] = set()
        for i, (prefix, module) in enumerate(model.named_modules()):
            method = getattr(module, "quant_method", None)
            if method is not None:
                device = next(module.parameters()).device  # (FusedMoE has no `weight`)
                gen = torch.Generator(device=device).manual_seed(seed + 100_000 + i)
                done |= {f"{prefix}.{name}" for name in method.init_random(module, gen, std)}
            elif isinstance(module, VocabParallelEmbedding):  # an int8 table quantizes what it draws
                gen = torch.Generator(device=module.weight.device).manual_seed(seed + 100_000 + i)
                done |= {f"{prefix}.{name}" for name in module.init_random(gen, std)}
        for i, (name, p) in enumerate(model.named_parameters()):
            if name in done:
                continue
            if name.endswith("norm.weight") or "layernorm" in name:
                p.fill_(1.0)
            else:
                gen = torch.Generator(device=p.device).manual_seed(seed + i)
                p.normal_(0.0, std, generator=gen)
    finish_loading(model)
    return model

"""QuantConfig: which quantization the linear layers use, resolved once from `--quantization` and the
checkpoint's config.json `quantization_config`.

Methods:
    fp8          online: a bf16/fp32 checkpoint quantized at load time (per-output-channel weight scales,
                 dynamic per-token activation scales)
    fp8_block    a pre-quantized checkpoint with block-wise weight scales (`quant_method: fp8` with
                 `weight_block_size`, as the Qwen3 -FP8 and DeepSeek checkpoints ship): `weight_scale_inv`
                 [N / bn, K / bk], activations quantized per token and group of bk columns
    fp8_channel  a pre-quantized checkpoint with per-channel or per-tensor `weight_scale` (compressed-tensors
                 FP8, as the Llama FP8 checkpoints ship; or `quant_method: fp8` without a block size), an
                 optional static per-tensor `input_scale`, else dynamic per-token activation scales
    int8         online weight-only int8 with per-channel scales (CPU only)
    int4         online weight-only int4, a scale and zero per group of 32 inputs (CPU only)

int8 and int4 also store the vocabulary table (embedding and LM head) in int8 with per-row scales.
"""

from __future__ import annotations

from dataclasses import dataclass

QUANTIZATION_CHOICES = ("none", "fp8", "int8", "int4")
KV_CACHE_DTYPES = ("auto", "fp8_e4m3")
#: The attention backends whose kernels read an FP8 KV pool (with its per-layer scales).
FP8_KV_BACKENDS = ("triton", "flashinfer")


class QuantizationError(ValueError):
    """The quantization asked for cannot run here (or the checkpoint's is not supported); one line."""


@dataclass(frozen=True)
class QuantConfig:
    method: str  # "fp8" | "fp8_block" | "fp8_channel" | "int8" | "int4"
    block: tuple[int, int] | None = None  # fp8_block: (bn, bk)
    weight_strategy: str = "channel"  # fp8_channel: "channel" or "tensor" (as stored in the checkpoint)
    static_input_scale: bool = False  # fp8_channel: the checkpoint holds a per-tensor `input_scale`

    @property
    def is_fp8(self) -> bool:
        return self.method.startswith("fp8")

    @property
    def pre_quantized(self) -> bool:
        return self.method in ("fp8_block", "fp8_channel")


def _from_fp8_method(qc: dict) -> QuantConfig:
    if qc.get("fmt", "e4m3") != "e4m3":
        raise QuantizationError(f"config.json quantization_config fmt {qc.get('fmt')!r} is not supported; "
                                "only e4m3")
    block = qc.get("weight_block_size")
    if block is not None:
        if len(block) != 2 or qc.get("activation_scheme", "dynamic") != "dynamic":
            raise QuantizationError("config.json quantization_config: block-wise FP8 needs a 2-entry "
                                    "weight_block_size and activation_scheme dynamic")
        return QuantConfig("fp8_block", block=(int(block[0]), int(block[1])))
    static = qc.get("activation_scheme", "dynamic") == "static"
    return QuantConfig("fp8_channel", weight_strategy="tensor", static_input_scale=static)


def _from_compressed_tensors(qc: dict) -> QuantConfig:
    groups = list((qc.get("config_groups") or {}).values())
    if len(groups) != 1:
        raise QuantizationError(f"compressed-tensors checkpoints with {len(groups)} config groups are not "
                                "supported; only one group of FP8 linear layers")
    g = groups[0]
    w, a = g.get("weights") or {}, g.get("input_activations") or {}
    if w.get("type") != "float" or w.get("num_bits") != 8 or a.get("type", "float") != "float":
        raise QuantizationError("compressed-tensors checkpoint is not FP8 (weights/activations float, 8 bits); "
                                "only FP8 is supported")
    if w.get("strategy") not in ("channel", "tensor"):
        raise QuantizationError(f"compressed-tensors weight strategy {w.get('strategy')!r} is not supported; "
                                "channel or tensor")
    ignored = [name for name in qc.get("ignore") or [] if name != "lm_head"]
    if ignored:
        raise QuantizationError(f"compressed-tensors checkpoint leaves {ignored[0]!r} unquantized; only "
                                "lm_head may be left out")
    static = bool(a) and not a.get("dynamic", True)
    if static and a.get("strategy") != "tensor":
        raise QuantizationError("compressed-tensors static activation scales must be per tensor")
    return QuantConfig("fp8_channel", weight_strategy=w["strategy"], static_input_scale=static)


def checkpoint_quant_config(hf_config: dict) -> QuantConfig | None:
    """The quantization a checkpoint's config.json declares; None for an unquantized checkpoint."""
    qc = hf_config.get("quantization_config")
    if not qc:
        return None
    method = qc.get("quant_method")
    if method == "fp8":
        return _from_fp8_method(qc)
    if method == "compressed-tensors":
        return _from_compressed_tensors(qc)
    if method == "mxfp4":
        if "GptOssForCausalLM" in (hf_config.get("architectures") or ()):
            return None  # its experts are dequantized to the model dtype as they load (models/gpt_oss.py)
        raise QuantizationError("config.json quantization_config quant_method 'mxfp4' is supported for "
                                "GptOssForCausalLM only (its *_blocks / *_scales expert tensors)")
    raise QuantizationError(f"config.json quantization_config quant_method {method!r} is not supported; "
                            "duet reads fp8 and compressed-tensors (FP8) checkpoints")


def resolve_quant_config(flag: str | None, hf_config: dict, device: str, dtype=None) -> QuantConfig | None:
    """The one quantization for this model: the checkpoint's when it has one (`--quantization fp8` agrees
    with an FP8 checkpoint), else the flag's; QuantizationError where it cannot run."""
    ckpt = checkpoint_quant_config(hf_config)
    if ckpt is not None and flag in ("none", "int8", "int4"):
        raise QuantizationError(f"--quantization {flag}: the checkpoint is already FP8-quantized "
                                f"({ckpt.method}); leave --quantization unset or use fp8")
    if flag not in (None, *QUANTIZATION_CHOICES):
        raise QuantizationError(f"--quantization must be one of {', '.join(QUANTIZATION_CHOICES)}, got {flag!r}")
    quant = ckpt or ({m: QuantConfig(m) for m in ("fp8", "int8", "int4")}.get(flag or "none"))
    if quant is None:
        return None
    check_device(quant, device, dtype)
    return quant


def fp8_unsupported_reason(device: str) -> str | None:
    """Why FP8 cannot run on `device` (None when it can): FP8 tensor cores start at sm89 (Ada, Hopper)."""
    if device != "cuda":
        return "needs a CUDA GPU of compute capability 8.9 or newer (Ada, Hopper); this is a CPU"
    import torch

    major, minor = torch.cuda.get_device_capability()
    if (major, minor) < (8, 9):
        return (f"needs a CUDA GPU of compute capability 8.9 or newer (Ada, Hopper); "
                f"{torch.cuda.get_device_name()} is {major}.{minor}")
    return None


def check_device(quant: QuantConfig, device: str, dtype=None) -> None:
    import torch

    if quant.is_fp8:
        why = fp8_unsupported_reason(device)
        if why:
            what = "the checkpoint's FP8 quantization" if quant.pre_quantized else "--quantization fp8"
            raise QuantizationError(f"{what} {why}")
        if dtype is not None and dtype != torch.bfloat16:
            raise QuantizationError(f"FP8 weights need --dtype bfloat16 (the FP8 GEMMs write bfloat16), got {dtype}")
    elif quant.method in ("int8", "int4") and device != "cpu":
        raise QuantizationError(f"--quantization {quant.method} is weight-only {quant.method} for the CPU; "
                                "on a GPU use fp8")

"""How FusedMoE stores its experts under each quantization: the tensors, the checkpoint shards' loading, the
random init for benchmarks, and what the expert GEMMs get (the scales, the tile of block scales).

    none, int8   the model dtype (int8 is the linear layers' CPU weight-only method: the experts stay in the
                 model dtype, said once at build time)
    fp8 (online) FP8 codes per output row: each checkpoint shard quantized as it arrives, scales a buffer
                 w13_weight_scale [E, 2I] / w2_weight_scale [E, H] (nothing in the checkpoint for them)
    fp8_block    a block-quantized checkpoint's FP8 codes and its `weight_scale_inv` per bn x bk tile
                 (w13_weight_scale_inv [E, 2I / bn, H / bk], w2_weight_scale_inv [E, H / bn, I / bk])
    fp8_channel  refused (compressed-tensors MoE checkpoints): QuantizationError, one line

The FP8 expert GEMMs are weight-only: the activations stay in the model dtype (moe/fused_moe.py).
"""

from __future__ import annotations

import functools
import logging

import torch
from torch import nn

from model_executor.layers.quantization import fp8_math
from model_executor.layers.quantization.base import set_kept_dtype
from model_executor.layers.quantization.config import QuantConfig, QuantizationError
from model_executor.lazy_slice import materialize

logger = logging.getLogger("duet.moe")

GATE, UP, DOWN = 0, 1, 2
FP8 = fp8_math.FP8_DTYPE


def _copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    if dst.shape != src.shape:
        raise ValueError(f"shape mismatch: parameter {tuple(dst.shape)} vs checkpoint {tuple(src.shape)}")
    dst.copy_(src)


def _param(layer: nn.Module, name: str, shape: tuple[int, ...], dtype: torch.dtype | None = None,
           load_dtype: torch.dtype | None = None) -> nn.Parameter:
    p = nn.Parameter(torch.empty(shape) if dtype is None else torch.empty(shape, dtype=dtype), requires_grad=False)
    p.weight_loader = layer.weight_loader
    if load_dtype is not None:
        p.load_dtype = load_dtype
    if dtype is not None:
        set_kept_dtype(layer, name, dtype)
    setattr(layer, name, p)
    return p


class UnquantizedExperts:
    """w13_weight [E, 2I, H] (gate rows, then up rows) and w2_weight [E, H, I] in the model dtype."""

    block: tuple[int, int] | None = None  # the tile of block scales (None: per-row scales, or none)
    weight_dtype: torch.dtype | None = None  # None: the model dtype
    load_dtype: torch.dtype | None = None  # what checkpoint tensors are converted to before load()

    def create_weights(self, layer: nn.Module) -> None:
        e, i, h = layer.num_experts, layer.intermediate_size, layer.hidden_size
        _param(layer, "w13_weight", (e, 2 * i, h), self.weight_dtype, self.load_dtype)
        _param(layer, "w2_weight", (e, h, i), self.weight_dtype, self.load_dtype)

    @staticmethod
    def rows(layer: nn.Module, t: torch.Tensor, expert: int, proj: int, per: int = 1) -> torch.Tensor:
        """The rows of `t` (a weight, or a scale with one row per `per` weight rows) that hold one
        checkpoint tensor: expert `expert`'s gate, up or down projection."""
        if proj == DOWN:
            return t.data[expert]
        inter = layer.intermediate_size // per
        return t.data[expert].narrow(0, proj * inter, inter)

    def load(self, layer: nn.Module, param: nn.Parameter, loaded: torch.Tensor, expert: int, proj: int) -> None:
        _copy(self.rows(layer, param, expert, proj), materialize(loaded))

    def init_random(self, layer: nn.Module, generator: torch.Generator, std: float) -> set[str]:
        """Random weights for benchmarks: the names of the parameters it filled (the generic init fills the
        rest)."""
        return set()

    def scales(self, layer: nn.Module) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        return None, None

    def finish_loading(self, layer: nn.Module) -> None:
        """After every shard is in (quantization.base.finish_loading calls it on every quant_method): the
        experts' layouts are all built shard by shard."""

    def describe(self) -> str:
        return "the model dtype"


def _random_experts(method: UnquantizedExperts, layer: nn.Module, generator: torch.Generator, std: float) -> None:
    """One expert's projection at a time drawn in bfloat16 and loaded as a checkpoint tensor would be."""
    device = layer.w13_weight.device
    for expert in range(layer.num_experts):
        for proj, param in ((GATE, layer.w13_weight), (UP, layer.w13_weight), (DOWN, layer.w2_weight)):
            shape = method.rows(layer, param, expert, proj).shape
            w = torch.empty(shape, dtype=torch.bfloat16, device=device).normal_(0.0, std, generator=generator)
            method.load_random(layer, param, w, expert, proj)


class Fp8OnlineExperts(UnquantizedExperts):
    """Online FP8: every checkpoint tensor quantized per output row as it loads (on the device: peak memory
    is the FP8 experts plus one tensor and its float32 copy)."""

    weight_dtype = FP8
    load_dtype = torch.bfloat16

    def create_weights(self, layer):
        super().create_weights(layer)
        e, i, h = layer.num_experts, layer.intermediate_size, layer.hidden_size
        for name, shape in (("w13_weight_scale", (e, 2 * i)), ("w2_weight_scale", (e, h))):
            layer.register_buffer(name, torch.empty(shape, dtype=torch.float32))
            set_kept_dtype(layer, name, torch.float32)

    def load(self, layer, param, loaded, expert, proj):
        dst = self.rows(layer, param, expert, proj)
        loaded = materialize(loaded)
        if dst.shape != loaded.shape:
            raise ValueError(f"shape mismatch: parameter {tuple(dst.shape)} vs checkpoint {tuple(loaded.shape)}")
        q, scale = fp8_math.quantize_fp8_per_channel(loaded.to(dst.device))
        dst.copy_(q)
        scales = layer.w2_weight_scale if param is layer.w2_weight else layer.w13_weight_scale
        self.rows(layer, scales, expert, proj).copy_(scale)

    load_random = load

    def init_random(self, layer, generator, std):
        _random_experts(self, layer, generator, std)
        return {"w13_weight", "w2_weight"}

    def scales(self, layer):
        return layer.w13_weight_scale, layer.w2_weight_scale

    def describe(self) -> str:
        return "FP8 weight-only, per-output-channel scales quantized at load"


class Fp8BlockExperts(UnquantizedExperts):
    """A block-quantized checkpoint's experts: FP8 codes and `weight_scale_inv` per bn x bk tile as stored."""

    weight_dtype = FP8
    load_dtype = FP8

    def __init__(self, block: tuple[int, int]):
        self.block = block

    def create_weights(self, layer):
        bn, bk = self.block
        e, i, h = layer.num_experts, layer.intermediate_size, layer.hidden_size
        if i % bn:  # the gate and up tensors' tiles would share a row of scales in w13
            raise QuantizationError(f"block-wise FP8 MoE: the experts' intermediate size {i} is not a multiple "
                                    f"of the block {bn}")
        super().create_weights(layer)
        _param(layer, "w13_weight_scale_inv", (e, 2 * i // bn, -(-h // bk)), torch.float32, torch.float32)
        _param(layer, "w2_weight_scale_inv", (e, -(-h // bn), -(-i // bk)), torch.float32, torch.float32)

    def load(self, layer, param, loaded, expert, proj):
        if param is layer.w13_weight_scale_inv or param is layer.w2_weight_scale_inv:
            return _copy(self.rows(layer, param, expert, proj, per=self.block[0]), materialize(loaded))
        return super().load(layer, param, loaded, expert, proj)

    def load_random(self, layer, param, w, expert, proj):
        q, scale = fp8_math.quantize_fp8_block(w, self.block)
        self.rows(layer, param, expert, proj).copy_(q)
        scales = layer.w2_weight_scale_inv if param is layer.w2_weight else layer.w13_weight_scale_inv
        self.rows(layer, scales, expert, proj, per=self.block[0]).copy_(scale)

    def init_random(self, layer, generator, std):
        _random_experts(self, layer, generator, std)
        return {"w13_weight", "w2_weight", "w13_weight_scale_inv", "w2_weight_scale_inv"}

    def scales(self, layer):
        return layer.w13_weight_scale_inv, layer.w2_weight_scale_inv

    def describe(self) -> str:
        bn, bk = self.block
        return f"FP8 weight-only from the checkpoint, {bn}x{bk} block scales (activations in the model dtype)"


@functools.cache
def _say(message: str) -> None:
    logger.info(message)


def experts_method(quant: QuantConfig | None) -> UnquantizedExperts:
    """The experts' storage under the model's quantization (QuantizationError where it is not supported)."""
    if quant is None:
        return UnquantizedExperts()
    if quant.method == "fp8":
        method = Fp8OnlineExperts()
    elif quant.method == "fp8_block":
        method = Fp8BlockExperts(quant.block)
    elif quant.method == "int8":
        method = UnquantizedExperts()
    else:
        raise QuantizationError(f"MoE experts of a {quant.method} checkpoint are not supported (duet reads "
                                "block-wise fp8 MoE checkpoints, or quantizes bf16 ones with --quantization fp8)")
    _say(f"MoE under {quant.method}: experts {method.describe()}; the router's gate unquantized (model dtype)")
    return method

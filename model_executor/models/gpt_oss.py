"""gpt-oss (`GptOssForCausalLM`): pre-norm decoder layers of attention and a mixture of experts.

Its differences from the Llama block (llama.py) and the other MoE models (moe.py):
- attention has biases on q, k, v and o, and a learned sink logit per query head (RadixAttention's sinks: it
  joins each query's softmax denominator with no value); layers alternate between a sliding window (128) and
  full attention by config.json's layer_types; the RoPE is YaRN (through transformers' init, layers/rotary.py);
- the router is a linear layer with a bias; each token takes the top-k experts by logit, weighted by a softmax
  over those k logits;
- each expert is gate_up (with bias) -> clamped SwiGLU: gate clamped above at swiglu_limit, up to
  +-swiglu_limit, (up + 1) * gate * sigmoid(swiglu_alpha * gate) -> down (with bias).

The experts run through the fused MoE path (layers/moe/fused_moe.fused_experts, as Qwen3-MoE and Mixtral):
the router's softmax over all experts, top k, renormalized (the same weights as a softmax over the k logits),
then the Triton kernels on CUDA (graph-safe: decode graphs and extend pieces) with the experts' biases and
the clamped SwiGLU, the torch path on CPU; each step reads only the experts its tokens route to.

Tensor parallelism: attention as the Llama block's (q/k/v heads and o_proj's input columns per rank, o_proj's
bias added once), with each rank's sinks those of its query heads; every expert's intermediate dimension split
over the ranks (w13's gate and up rows and their biases, w2's input columns), so each rank runs every expert on
its slice and one all-reduce sums the MoE's output; w2's bias is held by rank 0 only (zeros elsewhere), so the
sum adds it once. The router is whole on every rank: every rank routes each token to the same experts.

Checkpoints: the bf16 / fp32 layout that transformers' save_pretrained writes. The experts' tensors are stacked
over experts and stored input-major: `experts.gate_up_proj` [E, H, 2I] with the gate and up columns interleaved
(gate 0, up 0, gate 1, ...), `experts.down_proj` [E, I, H], and their biases; they load into the [E, 2I, H]
(gate rows, then up rows) and [E, H, I] layout of the fused MoE path. MXFP4 checkpoints (the released
weights: each expert tensor as `*_blocks`, two e2m1 values a byte in blocks of 32 along the input, and
`*_scales`, one e8m0 exponent a block) are dequantized to the model dtype as they load (dequantize_mxfp4):
the experts then take the bf16 weights' memory, about 4x the checkpoint's.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import ClassVar

import torch
from torch import nn

from model_executor.distributed import parallel_state as ps
from model_executor.forward_batch import ForwardBatch
from model_executor.layers.attention.radix_attention import RadixAttention
from model_executor.layers.embedding import VocabParallelEmbedding
from model_executor.layers.linear import (
    LinearBase,
    QKVParallelLinear,
    RowParallelLinear,
    default_weight_loader,
)
from model_executor.layers.moe import fused_experts, select_experts
from model_executor.layers.norm import RMSNorm
from model_executor.layers.quantization.base import quantization_context
from model_executor.layers.rotary import RotaryEmbedding
from model_executor.lazy_slice import materialize
from model_executor.model_config import CheckpointMismatchError, ModelConfig
from model_executor.models.llama import OwnBackboneForCausalLM

# The e2m1 values of the 16 four-bit codes (sign bit 3)
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
_MXFP4 = re.compile(r"^(.*\.experts\.(?:gate_up_proj|down_proj))_(blocks|scales)$")


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """MXFP4 -> dtype: blocks [E, R, G, 16] bytes (two e2m1 codes each, the low nibble first) and scales
    [E, R, G] (e8m0: 2 ** (s - 127) for each block of 32 values) -> [E, R, 32 G]. One expert at a time, so the
    float32 intermediates stay one expert's size."""
    if blocks.dim() != 4 or blocks.shape[-1] != 16 or tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do not pair up "
                         f"(blocks [E, R, G, 16], scales [E, R, G])")
    e, r, g, _ = blocks.shape
    if blocks.is_meta or scales.is_meta:  # (the header check: shapes only)
        return torch.empty(e, r, 32 * g, dtype=dtype, device="meta")
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32)
    out = torch.empty(e, r, 32 * g, dtype=dtype)
    for i in range(e):
        codes = blocks[i].to(torch.uint8).long()
        values = torch.stack([lut[codes & 0x0F], lut[codes >> 4]], dim=-1).flatten(-2)  # [R, G, 32]
        exponent = scales[i].to(torch.int32).sub(127).float()
        out[i] = (values * torch.exp2(exponent)[..., None]).flatten(-2).to(dtype)
    return out


def _dequantized(weights: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype,
                 ) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors with each MXFP4 pair (`X_blocks`, `X_scales`) as the bf16 checkpoint's `X`, in
    its layout ([E, H, 2I] / [E, I, H]: the dequantized [E, out, in] transposed)."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in weights:
        m = _MXFP4.match(name)
        if m is None:
            yield name, tensor
            continue
        pair = pending.setdefault(m.group(1), {})
        pair[m.group(2)] = tensor
        if len(pair) == 2:
            del pending[m.group(1)]
            try:  # (whole: the experts' loaders take each rank's slice of the dequantized tensor)
                full = dequantize_mxfp4(materialize(pair["blocks"]), materialize(pair["scales"]), dtype)
            except ValueError as e:
                raise CheckpointMismatchError(f"checkpoint tensor {name!r}: {e}") from None
            yield m.group(1), full.transpose(1, 2)
    if pending:
        base, pair = next(iter(pending.items()))
        missing = "scales" if "blocks" in pair else "blocks"
        raise CheckpointMismatchError(f"checkpoint has {base}_{next(iter(pair))!s} but no {base}_{missing} "
                                      f"(MXFP4 tensors come in pairs)")


def _checked(param: torch.Tensor, loaded: torch.Tensor, shape: tuple[int, ...]) -> None:
    if tuple(loaded.shape) != shape:
        raise ValueError(f"expected {shape}")


class GptOssRMSNorm(RMSNorm):
    """RMSNorm whose plain path multiplies by the weight in float32 before the cast, as HF's gpt-oss norm does
    (HF keeps the norms in float32)."""

    def forward_native(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is not None:
            x = x + residual
            residual = x
        xf = x.float()
        out = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight.float()).to(x.dtype)
        return out if residual is None else (out, residual)


class GptOssExperts(nn.Module):
    """Every expert's weights, stacked: w13_weight [E, 2I, H] (gate rows, then up rows) and w13_bias [E, 2I];
    w2_weight [E, H, I] and w2_bias [E, H]. Under tensor parallelism I is this rank's slice of the
    intermediate dimension (units rank * I .. (rank + 1) * I of every expert)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        e, h, i = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.tp_rank, self.tp_size = ps.get_tp_rank(), ps.get_tp_size()
        if i % self.tp_size:
            raise ValueError(f"the experts' intermediate size {i} cannot be split over {self.tp_size} "
                             f"tensor-parallel ranks")
        i //= self.tp_size
        self.num_experts, self.top_k, self.intermediate_size = e, cfg.num_experts_per_tok, i
        self.alpha, self.limit = cfg.swiglu_alpha, cfg.swiglu_limit
        self.w13_weight = nn.Parameter(torch.empty(e, 2 * i, h), requires_grad=False)
        self.w13_bias = nn.Parameter(torch.empty(e, 2 * i), requires_grad=False)
        self.w2_weight = nn.Parameter(torch.empty(e, h, i), requires_grad=False)
        self.w2_bias = nn.Parameter(torch.empty(e, h), requires_grad=False)
        self.w13_weight.weight_loader = self._load_gate_up
        self.w13_bias.weight_loader = self._load_gate_up_bias
        self.w2_weight.weight_loader = self._load_down
        self.w2_bias.weight_loader = self._load_down_bias

    def _interleaved_slice(self, loaded: torch.Tensor, dim: int) -> torch.Tensor:
        """This rank's units of a tensor whose `dim` interleaves gate and up (gate 0, up 0, gate 1, ...): one
        contiguous run of 2I entries, read as such from a lazy slice."""
        i = self.intermediate_size
        return materialize(loaded.narrow(dim, 2 * i * self.tp_rank, 2 * i))

    def _load_gate_up(self, param: torch.Tensor, loaded: torch.Tensor, shard_id=None) -> None:
        """[E, H, 2I] with interleaved gate / up columns -> [E, 2I, H]: the gate rows, then the up rows."""
        e, two_i, h = param.shape
        _checked(param, loaded, (e, h, two_i * self.tp_size))
        w = self._interleaved_slice(loaded, 2).transpose(1, 2)
        default_weight_loader(param, torch.cat([w[:, 0::2], w[:, 1::2]], dim=1))

    def _load_gate_up_bias(self, param: torch.Tensor, loaded: torch.Tensor, shard_id=None) -> None:
        """[E, 2I] interleaved -> [E, 2I]: the gate biases, then the up biases."""
        e, two_i = param.shape
        _checked(param, loaded, (e, two_i * self.tp_size))
        b = self._interleaved_slice(loaded, 1)
        default_weight_loader(param, torch.cat([b[:, 0::2], b[:, 1::2]], dim=1))

    def _load_down(self, param: torch.Tensor, loaded: torch.Tensor, shard_id=None) -> None:
        """[E, I, H] -> [E, H, I]."""
        e, h, i = param.shape
        _checked(param, loaded, (e, i * self.tp_size, h))
        default_weight_loader(param, materialize(loaded.narrow(1, i * self.tp_rank, i)).transpose(1, 2))

    def _load_down_bias(self, param: torch.Tensor, loaded: torch.Tensor, shard_id=None) -> None:
        """[E, H]: whole on rank 0, zeros on the others (the all-reduce after the experts adds it once)."""
        _checked(param, loaded, tuple(param.shape))
        default_weight_loader(param, materialize(loaded) if self.tp_rank == 0 else torch.zeros_like(param))

    def forward(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        """x [T, H], router_logits [T, E] -> [T, H]: the top-k experts' outputs, weighted by a softmax over their
        logits (HF takes it in the logits' dtype: the weights are rounded to x's dtype, round_weights); under
        tensor parallelism, this rank's part of the sum (the caller all-reduces)."""
        weights, ids = select_experts(router_logits, self.top_k, renormalize=True)
        return fused_experts(x, self.w13_weight, self.w2_weight, weights, ids, round_weights=True,
                             w13_bias=self.w13_bias, w2_bias=self.w2_bias, swiglu=(self.alpha, self.limit))


class GptOssMoE(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        with quantization_context(None):  # the router stays unquantized (moe.py's SparseMoeBlock does too)
            self.router = LinearBase(cfg.hidden_size, cfg.num_experts, bias=True)
        self.experts = GptOssExperts(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ps.tensor_model_parallel_all_reduce(self.experts(x, self.router(x)))


class GptOssAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, rotary_emb: RotaryEmbedding):
        super().__init__()
        hd = cfg.head_dim
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, hd, cfg.num_attention_heads, cfg.num_key_value_heads,
                                          bias=cfg.attention_bias)
        self.o_proj = RowParallelLinear(cfg.num_attention_heads * hd, cfg.hidden_size, bias=cfg.attention_bias)
        self.attn = RadixAttention(layer_id, self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads, hd, hd**-0.5,
                                   rotary_emb=rotary_emb, sliding_window=cfg.layer_sliding_window(layer_id),
                                   sinks=True)
        self.attn.sinks.weight_loader = self._load_sinks
        self.head_start = ps.get_tp_rank() * self.qkv_proj.num_heads

    def _load_sinks(self, param: torch.Tensor, loaded: torch.Tensor, shard_id=None) -> None:
        """This rank's query heads' sinks (all of them at tp 1)."""
        total = self.qkv_proj.total_sizes["q"] // self.qkv_proj.head_dim
        _checked(param, loaded, (total,))
        default_weight_loader(param, materialize(loaded.narrow(0, self.head_start, param.shape[0])))

    def forward(self, positions: torch.Tensor, x: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        q, k, v = self.qkv_proj.split(self.qkv_proj(x))
        return self.o_proj(self.attn(q, k, v, fb, positions))


class GptOssDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, rotary_emb: RotaryEmbedding):
        super().__init__()
        self.self_attn = GptOssAttention(cfg, layer_id, rotary_emb)
        self.mlp = GptOssMoE(cfg)
        self.input_layernorm = GptOssRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = GptOssRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None,
                fb: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, residual) after the layer: the stream is x + residual (the MoE's output and the sum before it)."""
        if residual is None:
            residual, x = hidden, self.input_layernorm(hidden)
        else:
            x, residual = self.input_layernorm(hidden, residual)
        x, residual = self.post_attention_layernorm(self.self_attn(positions, x, fb), residual)
        return self.mlp(x), residual


class GptOssModel(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size)
        served = cfg.served_context_len
        self.rotary_emb = RotaryEmbedding(cfg.head_dim, max(cfg.max_position_embeddings, served or 0),
                                          cfg.rope_theta, cfg.rope_scaling,
                                          original_max_position=cfg.max_position_embeddings, seq_len=served)
        self.layers = nn.ModuleList(GptOssDecoderLayer(cfg, i, self.rotary_emb) for i in range(cfg.num_hidden_layers))
        self.norm = GptOssRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        """The final norm's output, [tokens, H]."""
        hidden, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual, fb)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class GptOssForCausalLM(OwnBackboneForCausalLM):
    """Loads through LlamaForCausalLM's mapping (q/k/v into the fused projection) with the renames below."""

    supports_tensor_parallel = True  # (the experts, sinks and attention as the module's docstring says)
    backbone_class = GptOssModel
    # (the bias renames first: `gate_up_proj` is a prefix of `gate_up_proj_bias`)
    renames: ClassVar[tuple[tuple[str, str], ...]] = (
        (".self_attn.sinks", ".self_attn.attn.sinks"),
        (".experts.gate_up_proj_bias", ".experts.w13_bias"),
        (".experts.gate_up_proj", ".experts.w13_weight"),
        (".experts.down_proj_bias", ".experts.w2_bias"),
        (".experts.down_proj", ".experts.w2_weight"),
    )

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """LlamaForCausalLM's loading, MXFP4 expert tensors dequantized to the model dtype first."""
        return super().load_weights(_dequantized(weights, self.model.embed_tokens.weight.dtype))

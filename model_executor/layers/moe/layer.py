"""FusedMoE: a router (softmax, top-k, optional renormalisation) and every expert's weights as two tensors.

    w13_weight [E, 2*I, H]: each expert's gate projection (rows 0..I) then its up projection (rows I..2I)
    w2_weight  [E, H, I]:   each expert's down projection

The checkpoint keeps one tensor per expert and projection; the weight loader copies each into its rows
(shard_id = (expert, 0 gate | 1 up | 2 down)), so nothing is concatenated at load. Under quantization the
tensors are moe/quant.py's (FP8 codes and their scales).
"""

from __future__ import annotations

import torch
from torch import nn

from model_executor.layers.linear import LinearBase
from model_executor.layers.moe.fused_moe import fused_experts
from model_executor.layers.moe.quant import DOWN, GATE, UP, experts_method
from model_executor.layers.moe.router import select_experts
from model_executor.layers.quantization.base import current_quant_config, quantization_context


class FusedMoE(nn.Module):
    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int, renormalize: bool,
                 router_weights_in_model_dtype: bool = False):
        super().__init__()
        self.num_experts, self.top_k = num_experts, top_k
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self.renormalize = renormalize
        # Qwen3-MoE rounds the routing weights to the model dtype before they scale the experts' outputs;
        # Mixtral keeps them in float32.
        self.router_weights_in_model_dtype = router_weights_in_model_dtype
        # The experts' tensors under the model's quantization (moe/quant.py); `quant_method` as the linear
        # layers name theirs, so random init and the benchmarks' byte counts find it.
        self.quant_method = experts_method(current_quant_config())
        self.quant_method.create_weights(self)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: tuple[int, int]) -> None:
        expert, proj = shard_id
        if not 0 <= expert < self.num_experts:
            raise ValueError(f"expert {expert} is outside the config's {self.num_experts} experts")
        self.quant_method.load(self, param, loaded, expert, proj)

    def expected_shards(self, param_name: str) -> list[str]:
        projs = (DOWN,) if param_name.rpartition(".")[2].startswith("w2_") else (GATE, UP)
        return [f"{e}/{p}" for e in range(self.num_experts) for p in projs]

    def forward(self, hidden: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        # The router renormalises (one kernel on CUDA); the rounding happens inside fused_experts.
        weights, ids = select_experts(router_logits, self.top_k, self.renormalize)
        w13_scale, w2_scale = self.quant_method.scales(self)
        return fused_experts(hidden, self.w13_weight, self.w2_weight, weights, ids, False,
                             self.router_weights_in_model_dtype, w13_scale, w2_scale, self.quant_method.block)


class SparseMoeBlock(nn.Module):
    """The MLP of an MoE layer: the router's linear gate [E, H] and the experts (Qwen3-MoE, Mixtral)."""

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int, renormalize: bool,
                 router_weights_in_model_dtype: bool = False):
        super().__init__()
        # Replicated on every rank, and never quantized (as SGLang and vLLM): FP8 router logits would move
        # tokens between experts, and block-quantized checkpoints keep the gate in bf16.
        with quantization_context(None):
            self.gate = LinearBase(hidden_size, num_experts, bias=False)
        self.experts = FusedMoE(num_experts, top_k, hidden_size, intermediate_size, renormalize,
                                router_weights_in_model_dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.experts(x, self.gate(x))

"""Mixture-of-experts: the router, the experts stored fused, and the expert computation (torch or Triton)."""

from model_executor.layers.moe.fused_moe import fused_experts, fused_experts_torch
from model_executor.layers.moe.layer import FusedMoE, select_experts

__all__ = ["FusedMoE", "fused_experts", "fused_experts_torch", "select_experts"]

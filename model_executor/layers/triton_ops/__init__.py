"""Fused Triton ops of the Llama block (RMSNorm with residual add, rotary, SiLU-and-mul, KV store),
registered as `duet::` custom ops; see ops.py. Importing this package does not import triton."""

from model_executor.layers.triton_ops.ops import apply_rotary, rmsnorm, silu_and_mul, store_kv

__all__ = ["apply_rotary", "rmsnorm", "silu_and_mul", "store_kv"]

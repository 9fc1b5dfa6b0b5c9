"""Triton attention kernels over the token-level KV pool: split-KV decode and causal extend."""

from model_executor.layers.attention.triton_ops.decode_attention import (
    DecodeWorkspace,
    alloc_decode_workspace,
    decode_attention_fwd,
    get_num_kv_splits,
)
from model_executor.layers.attention.triton_ops.extend_attention import (
    ExtendConfig,
    extend_attention_fwd,
    get_extend_config,
)

__all__ = [
    "DecodeWorkspace",
    "ExtendConfig",
    "alloc_decode_workspace",
    "decode_attention_fwd",
    "extend_attention_fwd",
    "get_extend_config",
    "get_num_kv_splits",
]

"""Phi-3 and Phi-4 (`Phi3ForCausalLM`): the Llama block (llama.py) whose checkpoints keep q, k and v in one
`qkv_proj` tensor and gate and up in one `gate_up_proj` tensor, rows stacked in that order. Each fused tensor is
cut into its pieces and loaded as the Llama layout's q/k/v and gate/up shards, so tensor parallelism shards them
as it does Llama's. LongRoPE (rope type longrope, or su in older configs) and a partial rotary come from
ModelConfig and layers/rotary.py; a sliding window (Phi-3-mini: 2047) from ModelConfig.sliding_window_layers.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from model_executor.model_config import CheckpointMismatchError
from model_executor.models.llama import LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return super().load_weights(self._split_fused(weights))

    def _split_fused(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """The checkpoint's tensors with each fused qkv_proj / gate_up_proj weight cut into the Llama layout's
        q_proj, k_proj, v_proj / gate_proj, up_proj (rows: q, k, v / gate, up)."""
        cfg = self.config
        q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
        for name, tensor in weights:
            if ".qkv_proj." in name:
                pieces = {"q_proj": (0, q), "k_proj": (q, kv), "v_proj": (q + kv, kv)}
                total, fused = q + 2 * kv, ".qkv_proj."
            elif ".gate_up_proj." in name:
                i = cfg.intermediate_size
                pieces = {"gate_proj": (0, i), "up_proj": (i, i)}
                total, fused = 2 * i, ".gate_up_proj."
            else:
                yield name, tensor
                continue
            if tensor.shape[0] != total:
                raise CheckpointMismatchError(f"checkpoint tensor {name!r} {tuple(tensor.shape)} does not fit the "
                                              f"config.json shape ({total} rows: {', '.join(pieces)})")
            for piece, (start, size) in pieces.items():
                yield name.replace(fused, f".{piece}."), tensor.narrow(0, start, size)

    def checkpoint_name(self, name: str) -> str:
        """The fused tensor a shard comes from (`...qkv_proj.weight` for `...qkv_proj.weight#q`)."""
        return name.partition("#")[0]

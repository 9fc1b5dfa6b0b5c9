"""triton: our Triton kernels over the token-level pool; graph-capturable decode (lengths and slots are read
from device buffers, the split-KV workspace is allocated once at the largest batch)."""

from __future__ import annotations

import torch

from model_executor.distributed import parallel_state as ps
from model_executor.forward_batch import ForwardBatch
from model_executor.layers.attention.base import AttentionBackend
from model_executor.layers.attention.radix_attention import RadixAttention
from model_executor.layers.attention.triton_ops import (
    alloc_decode_workspace,
    decode_attention_fwd,
    extend_attention_fwd,
    get_num_kv_splits,
)


class TritonAttnBackend(AttentionBackend):
    supports_cuda_graph = True

    def __init__(self, runner):
        cfg = runner.model_config
        self.num_kv_splits = get_num_kv_splits(runner.context_len)
        self.attn_logits, self.attn_lse = alloc_decode_workspace(
            runner.req_to_token_pool.size, ps.heads_per_rank(cfg.num_attention_heads, ps.get_tp_size()), cfg.head_dim, self.num_kv_splits, runner.device)

    def forward_decode(self, q: torch.Tensor, layer: RadixAttention, fb: ForwardBatch, out: torch.Tensor) -> None:
        k_buf, v_buf = fb.kv_cache.get_kv(layer.layer_id)
        k_scale, v_scale = fb.kv_cache.get_scales(layer.layer_id)
        decode_attention_fwd(q, k_buf, v_buf, out, fb.req_to_token_pool.req_to_token, fb.req_pool_indices,
                             fb.seq_lens, self.attn_logits, self.attn_lse, self.num_kv_splits, layer.scaling,
                             k_scale=k_scale, v_scale=v_scale)

    def forward_extend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: RadixAttention,
                       fb: ForwardBatch, out: torch.Tensor) -> None:
        k_buf, v_buf = fb.kv_cache.get_kv(layer.layer_id)
        k_scale, v_scale = fb.kv_cache.get_scales(layer.layer_id)
        extend_attention_fwd(q, k, v, out, k_buf, v_buf, fb.out_cache_loc, fb.req_to_token_pool.req_to_token,
                             fb.req_pool_indices, fb.seq_lens, fb.extend_seq_lens, fb.extend_start_loc,
                             fb.max_extend_len, layer.scaling,
                             k_scale=k_scale, v_scale=v_scale)

"""triton: our Triton kernels over the token-level pool; graph-capturable decode (lengths and slots are read
from device buffers, the split-KV workspace is allocated once at the largest batch).

Decode batches get q and k unrotated (fuses_rotary): one kernel rotates q, and rotates k and stores it
with v in the pool (model_executor/layers/rotary_store_kv.py), instead of the rotary and then the store;
for Qwen3 the same kernel applies the per-head q/k norms first (instead of qk_norm_rope, then the store).

The decode split count (triton_ops/decode_attention.py, decode_split_plan) is fixed per batch size by how
many stage-1 programs fill the GPU, and drops to 1 (the single-stage kernel, no merge launch) for large
batches and for batches whose longest request is short. A CUDA graph fixes the launches, so a size that can
take both gets two graphs (decode_graph_variants) and the runner replays the one the batch's lengths pick.
"""

from __future__ import annotations

import torch

from model_executor.distributed import parallel_state as ps
from model_executor.forward_batch import ForwardBatch
from model_executor.layers.attention.base import AttentionBackend, AttentionLayer
from model_executor.layers.attention.triton_ops import (
    alloc_decode_workspace,
    decode_attention_fwd,
    extend_attention_fwd,
    get_num_kv_splits,
)
from model_executor.layers.attention.triton_ops import decode_attention as decode_mod
from model_executor.layers.rotary_store_kv import rotary_store_kv

# Off CUDA (Triton's interpreter, in tests) there are no SMs to fill: a small stand-in count keeps the
# plan logic (split caps above and at 1) exercised at small batch sizes.
INTERPRETER_NUM_SMS = 1


class TritonAttnBackend(AttentionBackend):
    supports_cuda_graph = True
    supports_extend_cuda_graph = True

    def __init__(self, runner):
        cfg = runner.model_config
        tp = ps.get_tp_size()
        self.num_heads = ps.heads_per_rank(cfg.num_attention_heads, tp)
        self.num_kv_heads = ps.kv_heads_per_rank(cfg.num_key_value_heads, tp)
        self.max_kv_splits = get_num_kv_splits(runner.context_len)
        self.num_sms = (torch.cuda.get_device_properties(runner.device).multi_processor_count
                        if runner.device.type == "cuda" else INTERPRETER_NUM_SMS)
        self.single_stage_max_len = decode_mod.SINGLE_STAGE_MAX_LEN
        self.programs_per_sm = decode_mod.programs_per_sm(runner.dtype, runner.kv_dtype)
        self.min_splits = decode_mod.min_splits(runner.dtype, runner.kv_dtype)
        self.attn_logits, self.attn_lse, self.combine_counters = alloc_decode_workspace(
            runner.req_to_token_pool.size, self.num_heads, cfg.head_dim, self.max_kv_splits, runner.device)
        # The split count of the decode batch being run, and that batch; set by init_forward_metadata or the
        # graph hooks (a graph bakes it in).
        self._decode_splits: tuple[ForwardBatch, int] | None = None

    # ---- the decode split plan ----------------------------------------------------------------------
    def split_cap(self, bs: int) -> int:
        return decode_mod.decode_split_cap(bs, self.num_heads, self.num_kv_heads, self.num_sms, self.max_kv_splits,
                                           self.programs_per_sm, self.min_splits)

    def decode_splits(self, fb: ForwardBatch) -> int:
        cap = self.split_cap(fb.batch_size)
        if cap == 1:  # no host read of the lengths needed
            return 1
        return decode_mod.decode_split_plan(cap, max(fb.seq_lens_cpu), self.single_stage_max_len)

    def init_forward_metadata(self, fb: ForwardBatch) -> None:
        self._decode_splits = (fb, self.decode_splits(fb)) if fb.mode.is_decode() else None

    def decode_graph_variants(self, bs: int) -> tuple[int, ...]:
        cap = self.split_cap(bs)
        return (cap,) if cap == 1 else (cap, 1)

    def decode_graph_variant(self, fb: ForwardBatch) -> int:
        return self.decode_splits(fb)

    def init_forward_metadata_capture_cuda_graph(self, fb: ForwardBatch, variant=None) -> None:
        self._decode_splits = (fb, self.decode_splits(fb) if variant is None else variant)

    def init_forward_metadata_replay_cuda_graph(self, fb: ForwardBatch) -> None:
        self.init_forward_metadata(fb)

    # ---- attention ----------------------------------------------------------------------------------
    def fuses_rotary(self, fb: ForwardBatch) -> bool:
        return fb.mode.is_decode()

    def kv_store_target(self, layer: AttentionLayer, fb: ForwardBatch) -> tuple | None:
        if not fb.mode.is_decode():
            return None
        return (*fb.kv_cache.get_kv(layer.layer_id), fb.out_cache_loc, *fb.kv_cache.get_scales(layer.layer_id))

    def rotary_store_kv(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        layer: AttentionLayer, fb: ForwardBatch) -> None:
        k_buf, v_buf = fb.kv_cache.get_kv(layer.layer_id)
        k_scale, v_scale = fb.kv_cache.get_scales(layer.layer_id)
        # (one eps: q_norm and k_norm are built with the model's rms_norm_eps, as qk_norm_rope assumes too)
        norms = {} if layer.qk_norm is None else {
            "q_norm_weight": layer.qk_norm[0].weight, "k_norm_weight": layer.qk_norm[1].weight,
            "norm_eps": layer.qk_norm[0].eps}
        rotary_store_kv(positions, q, k, v, layer.rotary_emb.cos_sin_cache, k_buf, v_buf, fb.out_cache_loc,
                        k_scale, v_scale, **norms)

    def forward_decode(self, q: torch.Tensor, layer: AttentionLayer, fb: ForwardBatch, out: torch.Tensor,
                       after_qkv: bool = False) -> None:
        if self._decode_splits is None or self._decode_splits[0] is not fb:
            self.init_forward_metadata(fb)  # a caller that runs the model directly (tests, references)
        k_buf, v_buf = fb.kv_cache.get_kv(layer.layer_id)
        k_scale, v_scale = fb.kv_cache.get_scales(layer.layer_id)
        decode_attention_fwd(q, k_buf, v_buf, out, fb.req_to_token_pool.req_to_token, fb.req_pool_indices,
                             fb.seq_lens, self.attn_logits, self.attn_lse, self._decode_splits[1], layer.scaling,
                             k_scale=k_scale, v_scale=v_scale, counters=self.combine_counters, after_qkv=after_qkv,
                             sliding_window=getattr(layer, "sliding_window", None), sinks=getattr(layer, "sinks", None))

    def forward_decode_stored(self, q: torch.Tensor, layer: AttentionLayer, fb: ForwardBatch,
                              out: torch.Tensor) -> None:
        self.forward_decode(q, layer, fb, out, after_qkv=True)

    def forward_extend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: AttentionLayer,
                       fb: ForwardBatch, out: torch.Tensor) -> None:
        k_buf, v_buf = fb.kv_cache.get_kv(layer.layer_id)
        k_scale, v_scale = fb.kv_cache.get_scales(layer.layer_id)
        extend_attention_fwd(q, k, v, out, k_buf, v_buf, fb.out_cache_loc, fb.req_to_token_pool.req_to_token,
                             fb.req_pool_indices, fb.seq_lens, fb.extend_seq_lens, fb.extend_start_loc,
                             fb.max_extend_len, layer.scaling,
                             k_scale=k_scale, v_scale=v_scale, sliding_window=getattr(layer, "sliding_window", None),
                             sinks=getattr(layer, "sinks", None))

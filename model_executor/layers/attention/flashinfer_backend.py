"""flashinfer: BatchDecode/BatchPrefill wrappers over the token-level pool (page size 1).

KV indices come from req_to_token; each page holds one token, so every last-page length is 1. Decode
graphs get one CUDA-graph wrapper per captured batch size over fixed index buffers, planned outside the
graph before each replay (planning reads lengths on the host).

An FP8 pool (`--kv-cache-dtype fp8_e4m3`) is planned with kv_data_type float8_e4m3fn and each run gets its
layer's k_scale / v_scale (the pool stores K / k_scale and V / v_scale): flashinfer folds k_scale into the
softmax scale and multiplies the output by v_scale. Extends then run flashinfer's FA2 prefill kernels, which
take bf16 queries over FP8 K/V; its Hopper (FA3) kernels need Q and K of one type. An extend stores its new K/V
first and attends over the pool, so its tokens see each other's K/V as stored (rounded to FP8), where the
triton backend's extend kernel reads them unrounded.

Sliding windows and the softmax scale: flashinfer takes both at plan time (window_left = W - 1 keys before the
query; sm_scale, 1 / sqrt(head_dim) when not given), so the backend keeps one wrapper per distinct (window,
scale) of the model's attention layers (Gemma 3: its local window and -1, none, for the global layers, both at
query_pre_attn_scalar ** -0.5), each planned over the same KV indices, and each layer runs the wrapper of its
own window and scale.
"""

from __future__ import annotations

from itertools import accumulate

import torch

from model_executor.distributed import parallel_state as ps
from model_executor.forward_batch import ForwardBatch
from model_executor.layers.attention.base import AttentionBackend, AttentionLayer
from model_executor.layers.attention.radix_attention import attention_layers

WORKSPACE_BYTES = 256 * 1024 * 1024


class FlashInferAttnBackend(AttentionBackend):
    supports_cuda_graph = True

    def __init__(self, runner):
        import flashinfer

        self._flashinfer = flashinfer
        cfg = runner.model_config
        tp = ps.get_tp_size()  # this rank's heads
        self.num_qo_heads = ps.heads_per_rank(cfg.num_attention_heads, tp)
        self.num_kv_heads = ps.kv_heads_per_rank(cfg.num_key_value_heads, tp)
        self.head_dim = cfg.head_dim
        self.dtype = runner.dtype
        self.kv_dtype = runner.kv_dtype
        self.fp8_kv = self.kv_dtype == torch.float8_e4m3fn
        self.device = runner.device
        self.req_to_token = runner.req_to_token_pool.req_to_token
        self.workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=runner.device)
        # Tensor-core decode kernels pay off once several query heads share a KV head (SGLang's rule).
        self.decode_tensor_cores = self.num_qo_heads // self.num_kv_heads >= 4
        # The layers' (window_left, softmax scale) pairs (window_left -1: full attention), one wrapper pair each
        self.plan_keys = sorted({self._plan_key(layer) for layer in attention_layers(runner.model).values()})
        self.decode_wrappers = {key: flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace, "NHD", use_tensor_cores=self.decode_tensor_cores) for key in self.plan_keys}
        self.prefill_wrappers = {key: flashinfer.BatchPrefillWithPagedKVCacheWrapper(
            self.workspace, "NHD", backend="fa2" if self.fp8_kv else "auto") for key in self.plan_keys}
        self.graph_wrappers: dict[int, dict[tuple, object]] = {}  # batch size -> plan key -> wrapper
        self._decode = self.decode_wrappers

    # ---- metadata --------------------------------------------------------------------------------
    def _kv_indices(self, fb: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(indptr, last-page lengths) on the host from the batch's host lengths, and the requests' KV slots
        on the device, gathered from req_to_token with the total known on the host. flashinfer's plan reads
        indptr on the host: built here, it needs no device sync, so a step is planned while the one before
        still runs (a device indptr, or a boolean-mask gather, would wait for it)."""
        indptr = torch.tensor([0, *accumulate(fb.seq_lens_cpu)], dtype=torch.int32)
        total = int(indptr[-1])
        lens = fb.seq_lens
        rows = torch.repeat_interleave(fb.req_pool_indices, lens, output_size=total)
        starts = torch.repeat_interleave(torch.cumsum(lens, 0) - lens, lens, output_size=total)
        positions = torch.arange(total, device=self.device) - starts
        last = torch.ones(fb.batch_size, dtype=torch.int32)
        return indptr, self.req_to_token[rows, positions], last

    @staticmethod
    def _plan_key(layer: AttentionLayer) -> tuple[int, float]:
        """The wrapper a layer runs: (window_left, softmax scale)."""
        window = getattr(layer, "sliding_window", None)
        return -1 if window is None else window - 1, layer.scaling

    @staticmethod
    def _plan_args(key: tuple[int, float]) -> dict:
        """plan()'s window and scale arguments (no window argument for full attention)."""
        window_left, sm_scale = key
        return {"sm_scale": sm_scale} if window_left < 0 else {"window_left": window_left, "sm_scale": sm_scale}

    def _plan_decode(self, wrappers: dict, fb: ForwardBatch) -> None:
        indptr, indices, last = self._kv_indices(fb)
        for key, wrapper in wrappers.items():
            wrapper.plan(indptr, indices, last, self.num_qo_heads, self.num_kv_heads, self.head_dim, 1,
                         q_data_type=self.dtype, kv_data_type=self.kv_dtype, **self._plan_args(key))

    def init_forward_metadata(self, fb: ForwardBatch) -> None:
        if fb.mode.is_decode():
            self._decode = self.decode_wrappers
            self._plan_decode(self._decode, fb)
            return
        indptr, indices, last = self._kv_indices(fb)
        qo_indptr = torch.tensor([0, *accumulate(fb.extend_seq_lens_cpu)], dtype=torch.int32)
        for key, wrapper in self.prefill_wrappers.items():
            wrapper.plan(qo_indptr, indptr, indices, last, self.num_qo_heads, self.num_kv_heads, self.head_dim, 1,
                         causal=True, q_data_type=self.dtype, kv_data_type=self.kv_dtype, **self._plan_args(key))

    # ---- attention -------------------------------------------------------------------------------
    def _paged(self, fb: ForwardBatch, layer: AttentionLayer):
        k, v = fb.kv_cache.get_kv(layer.layer_id)
        return k.unsqueeze(1), v.unsqueeze(1)  # [slots, page_size=1, Hk, D]

    def _scales(self, fb: ForwardBatch, layer: AttentionLayer) -> dict:
        """An FP8 pool's scales for this layer's run (v_scale costs flashinfer a multiply of the output: given
        only where it is not 1)."""
        if not self.fp8_kv:
            return {}
        k_scale, v_scale = fb.kv_cache.get_scales(layer.layer_id)
        return {"k_scale": k_scale, "v_scale": v_scale if v_scale != 1.0 else None}

    def forward_decode(self, q: torch.Tensor, layer: AttentionLayer, fb: ForwardBatch,
                       out: torch.Tensor) -> None:
        self._decode[self._plan_key(layer)].run(q, self._paged(fb, layer), out=out,
                                                         **self._scales(fb, layer))

    def forward_extend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: AttentionLayer,
                       fb: ForwardBatch, out: torch.Tensor) -> None:
        fb.kv_cache.set_kv(layer.layer_id, fb.out_cache_loc, k, v)
        self.prefill_wrappers[self._plan_key(layer)].run(q, self._paged(fb, layer), out=out,
                                                                  **self._scales(fb, layer))

    # ---- graph hooks -----------------------------------------------------------------------------
    def _max_graph_indices(self, max_bs: int) -> int:
        # The summed sequence lengths of a batch are bounded by max_bs x context, not by the pool size:
        # requests sharing a radix-cached prefix each list its slots again (SGLang sizes it the same way).
        return max_bs * self.req_to_token.shape[1]

    def cuda_graph_state_bytes(self, max_bs: int) -> int:
        """What init_cuda_graph_state will allocate, for the model runner's graph reserve."""
        return WORKSPACE_BYTES + 4 * (self._max_graph_indices(max_bs) + 2 * max_bs + 1) if max_bs else 0

    def init_cuda_graph_state(self, max_bs: int) -> None:
        # Captured kernels keep pointers into these buffers and into each size's wrapper: one decode graph
        # runner per backend, allocated once. Graph wrappers get a workspace of their own, so eager
        # wrappers never write there between replays.
        if self.graph_wrappers:
            raise RuntimeError("flashinfer decode graphs were already captured on this backend")
        self.graph_workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)
        max_indices = self._max_graph_indices(max_bs)
        self.graph_indptr = torch.zeros(max_bs + 1, dtype=torch.int32, device=self.device)
        self.graph_indices = torch.zeros(max_indices, dtype=torch.int32, device=self.device)
        self.graph_last_page = torch.ones(max_bs, dtype=torch.int32, device=self.device)

    def init_forward_metadata_capture_cuda_graph(self, fb: ForwardBatch, variant=None) -> None:
        bs = fb.batch_size
        # (the wrappers of each window and scale plan the same indices into the same buffers)
        wrappers = {key: self._flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self.graph_workspace, "NHD", use_cuda_graph=True, use_tensor_cores=self.decode_tensor_cores,
            paged_kv_indptr_buffer=self.graph_indptr[: bs + 1], paged_kv_indices_buffer=self.graph_indices,
            paged_kv_last_page_len_buffer=self.graph_last_page[:bs]) for key in self.plan_keys}
        self.graph_wrappers[bs] = wrappers
        self._decode = wrappers
        self._plan_decode(wrappers, fb)

    def init_forward_metadata_replay_cuda_graph(self, fb: ForwardBatch) -> None:
        self._decode = self.graph_wrappers[fb.batch_size]
        self._plan_decode(self._decode, fb)

"""CudaGraphRunner: decode batches replayed from full CUDA graphs captured at fixed batch sizes.

Static GraphInputBuffers are allocated once at the largest size; graphs are captured largest first into
one shared pool; a replay bisects to the smallest captured size >= bs, copies the real rows in, pads the
rest (padding rows write KV slot 0 and have the backend's fill sequence length) and returns views of the
real rows of a static logits buffer. Sampling runs after the graph.

A backend whose decode kernels differ by batch (the triton backend's split count: one stage for short
batches) names its plans per size (decode_graph_variants): each size gets one graph per plan, and a replay
takes the one the backend picks from the batch's host lengths (decode_graph_variant).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch
from tqdm import tqdm

from model_executor.forward_batch import ForwardBatch, ForwardMode
from model_executor.lora.layer import LoraBatch
from runners.capture_lists import pick_size
from runners.graph_seam import AuxOut, GraphCapturer, default_capturer, frozen_gc

logger = logging.getLogger("duet.cuda_graph_runner")

WARMUP_RUNS = 2


@dataclass
class GraphInputBuffers:
    input_ids: torch.Tensor  # [max_bs] int64
    positions: torch.Tensor  # [max_bs] int64
    req_pool_indices: torch.Tensor  # [max_bs] int64
    seq_lens: torch.Tensor  # [max_bs] int64
    out_cache_loc: torch.Tensor  # [max_bs] int64
    logits: torch.Tensor  # [max_bs, vocab] float32, outside the graph pool
    seq_len_fill: int
    # Each row's LoRA pool slot (0: no adapter), with LoRA on: the graphs read it like the ids, so loading an
    # adapter (a copy into the pool) never recaptures. None: LoRA off.
    lora_slots: torch.Tensor | None = None
    # Views of the first bs rows, made once per bs: a replay's host time comes before its graph is queued,
    # and each tensor slice is a dispatcher call (profile_decode_host, docs/benchmarks.md).
    _rows: dict[int, tuple[list[torch.Tensor], torch.Tensor]] = field(default_factory=dict, repr=False)

    @classmethod
    def allocate(cls, max_bs: int, vocab_size: int, seq_len_fill: int, device,
                 lora: bool = False) -> GraphInputBuffers:
        def zeros(dtype):
            return torch.zeros(max_bs, dtype=dtype, device=device)

        return cls(input_ids=zeros(torch.int64), positions=zeros(torch.int64), req_pool_indices=zeros(torch.int64),
                   seq_lens=torch.full((max_bs,), seq_len_fill, dtype=torch.int64, device=device),
                   out_cache_loc=zeros(torch.int64),
                   logits=torch.zeros(max_bs, vocab_size, dtype=torch.float32, device=device),
                   seq_len_fill=seq_len_fill, lora_slots=zeros(torch.int64) if lora else None)

    def batch(self, bs: int, model_runner, backend) -> ForwardBatch:
        """A decode batch over the first bs rows of the buffers (all padding until `load` fills them)."""
        (input_ids, positions, req_pool_indices, out_cache_loc, seq_lens, *lora), logits = self.rows(bs)
        return ForwardBatch(
            mode=ForwardMode.DECODE, batch_size=bs, input_ids=input_ids, positions=positions,
            req_pool_indices=req_pool_indices, seq_lens=seq_lens,
            out_cache_loc=out_cache_loc, req_to_token_pool=model_runner.req_to_token_pool,
            kv_cache=model_runner.kv_cache, attn_backend=backend, seq_lens_cpu=[self.seq_len_fill] * bs,
            logits_out=logits, lora=LoraBatch(token_slots=lora[0], decode=True) if lora else None)

    def rows(self, bs: int) -> tuple[list[torch.Tensor], torch.Tensor]:
        """([input_ids, positions, req_pool_indices, out_cache_loc, seq_lens, (lora_slots)][:bs], logits[:bs]),
        cached."""
        views = self._rows.get(bs)
        if views is None:
            ints = [self.input_ids, self.positions, self.req_pool_indices, self.out_cache_loc, self.seq_lens]
            if self.lora_slots is not None:
                ints.append(self.lora_slots)
            views = self._rows[bs] = ([t[:bs] for t in ints], self.logits[:bs])
        return views

    def load(self, fb: ForwardBatch, padded_bs: int) -> None:
        """Copy the real rows in and reset rows bs..padded_bs to padding (token 0, slot 0, row 0). The five
        rows go as one multi-tensor launch rather than a copy each (a replay waits for them; each launch is
        host time before it): torch takes that path only for rows of one dtype, hence int64 seq_lens."""
        bs = fb.batch_size
        src = [fb.input_ids, fb.positions, fb.req_pool_indices, fb.out_cache_loc, fb.seq_lens]
        zeroed = [self.input_ids, self.positions, self.req_pool_indices, self.out_cache_loc]
        if self.lora_slots is not None:  # a batch without adapters: every row's slot 0
            src.append(fb.lora.token_slots if fb.lora is not None else self.lora_slots.new_zeros(bs))
            zeroed.append(self.lora_slots)
        torch._foreach_copy_(self.rows(bs)[0], src, non_blocking=True)
        if padded_bs > bs:
            torch._foreach_zero_([buf[bs:padded_bs] for buf in zeroed])
            self.seq_lens[bs:padded_bs].fill_(self.seq_len_fill)


class CudaGraphRunner:
    def __init__(self, model_runner, batch_sizes: list[int], capturer: GraphCapturer | None = None):
        self.model_runner = model_runner
        self.model = model_runner.model
        self.lora = getattr(model_runner, "lora", None)  # the LoRA manager, or None
        self.backend = model_runner.attn_backend
        self.batch_sizes = sorted(batch_sizes)
        self.max_bs = self.batch_sizes[-1]
        self.capturer = capturer or default_capturer(model_runner.device)
        self.buffers = GraphInputBuffers.allocate(self.max_bs, model_runner.model_config.vocab_size,
                                                  self.backend.get_cuda_graph_seq_len_fill_value(),
                                                  model_runner.device, lora=self.lora is not None)
        self.backend.init_cuda_graph_state(self.max_bs)
        self.static_batches = {bs: self._static_batch(bs) for bs in self.batch_sizes}
        self.graphs: dict[tuple[int, object], object] = {}  # by (batch size, the backend's plan)
        self.aux = AuxOut(self.max_bs)
        self.capture_seconds = 0.0
        self.capture_bytes = 0
        self.capture()

    def _static_batch(self, bs: int) -> ForwardBatch:
        return self.buffers.batch(bs, self.model_runner, self.backend)

    def _forward(self, fb: ForwardBatch) -> None:
        """The model's step into the static logits (fb.logits_out: the LM head writes them there)."""
        if self.lora is not None:
            self.lora.batch = fb.lora  # the static batch's: its slot ids are the buffer's rows
        logits = self.model(fb.input_ids, fb.positions, fb)
        if logits.data_ptr() != fb.logits_out.data_ptr():  # (a model that does not honour logits_out)
            fb.logits_out.copy_(logits)
        self.aux.write(fb.aux_hidden_states)

    @torch.inference_mode()
    def capture(self) -> None:
        before = self.capturer.memory_in_use()
        start = time.perf_counter()
        bar = tqdm(list(reversed(self.batch_sizes)), desc="capturing decode graphs", unit="graph",
                   disable=self.model_runner.device.type != "cuda")
        with frozen_gc():
            for bs in bar:  # largest first: smaller graphs reuse its pool memory
                fb = self.static_batches[bs]
                self.buffers.load(fb, bs)  # all rows padding: safe to run
                for variant in self.backend.decode_graph_variants(bs):
                    self.backend.init_forward_metadata_capture_cuda_graph(fb, variant)
                    for _ in range(WARMUP_RUNS):
                        self._forward(fb)
                    self.capturer.synchronize()
                    # The forward reads the static batch and the backend: what a graph bakes in of them.
                    self.graphs[bs, variant] = self.capturer.capture(lambda fb=fb: self._forward(fb),
                                                                     host_state=(fb, self.backend))
                used = (self.capturer.memory_in_use() - before) / 2**30
                bar.set_postfix_str(f"bs={bs} mem={used:.2f} GiB")
        self.capturer.synchronize()
        self.capture_seconds = time.perf_counter() - start
        self.capture_bytes = self.capturer.memory_in_use() - before
        logger.info("captured %d decode graphs in %.1f s, %.2f GiB", len(self.graphs), self.capture_seconds,
                    self.capture_bytes / 2**30)

    def can_run(self, fb: ForwardBatch) -> bool:
        return fb.mode.is_decode() and fb.batch_size <= self.max_bs

    def replay(self, fb: ForwardBatch) -> torch.Tensor:
        bs = fb.batch_size
        padded = pick_size(self.batch_sizes, bs)
        static = self.static_batches[padded]
        self.buffers.load(fb, padded)
        static.seq_lens_cpu = fb.seq_lens_cpu + [self.buffers.seq_len_fill] * (padded - bs)
        variant = self.backend.decode_graph_variant(static)
        self.backend.init_forward_metadata_replay_cuda_graph(static)
        self.graphs[padded, variant].replay()
        fb.aux_hidden_states = self.aux.read(bs)
        return self.buffers.rows(bs)[1]

    def info(self) -> dict:
        return {"cuda_graph_bs": list(self.batch_sizes), "decode_capture_seconds": round(self.capture_seconds, 2),
                "decode_capture_gib": round(self.capture_bytes / 2**30, 3)}

"""FullExtendGraphRunner: small extend batches replayed from one CUDA graph of the whole backbone per token level.

A piecewise replay (runners/piecewise_cuda_graph_runner.py) runs attention eagerly between its pieces, one
host launch per layer. At a few hundred tokens that host time is as long as the GPU's work, so the GPU waits
on Python, and more so on a slow host. A backend whose extend kernel reads every length, row and slot from
device tensors (AttentionBackend.supports_extend_cuda_graph: triton) can run inside the graph instead. This
runner captures the backbone (embedding -> layers -> final norm) whole at each token level up to a small
maximum, over static batches of one request row and of `max_requests` rows, whose tokens, positions, KV
slots, lengths and starts live in static buffers (and, with LoRA on, each token's adapter slot: the LoRA layers
read it through their graph-safe path, so loading an adapter never recaptures).

Padding. The attention grid is sized for the level and the row count (ForwardBatch.max_extend_len_bound).
Rows past the real requests get no new tokens, so their programs exit at once. Tokens past the real ones
(whatever ids and positions an earlier batch left there) belong to no request: they are never attended to or
stored, and their hidden states are cut off after the replay. The logits head then runs eagerly on the real
batch, as after a piecewise replay. Batches with more requests, or more tokens than the largest level, go to
the piecewise runner.

Memory: the graphs are captured largest first into the piecewise runner's pool (its capturer), and their
outputs are kept as weak references. A replay's output is read by the logits head before any other extend
replay can run, so the two runners' graphs may share the same blocks.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch
from tqdm import tqdm

from model_executor.forward_batch import ForwardBatch, ForwardMode
from model_executor.layers.logits import compute_logits
from model_executor.lora.layer import LoraBatch
from runners.capture_lists import pick_size
from runners.graph_seam import AuxOut, GraphCapturer, default_capturer, frozen_gc
from runners.piecewise_cuda_graph_runner import weak_ref_tensor

logger = logging.getLogger("duet.full_extend_graph_runner")

WARMUP_RUNS = 2
# Request rows of the larger static batch of each level: an extend with more requests goes to the piecewise
# runner. A padding row's programs exit at once but still cost: 2-4% of a 1B extend of 16-512 tokens at 8 rows
# against 1 (docs/benchmarks.md), hence a one-row graph per level as well.
DEFAULT_MAX_REQUESTS = 8


@dataclass
class FullExtendBuffers:
    input_ids: torch.Tensor  # [max_tokens] int64
    positions: torch.Tensor  # [max_tokens] int64
    out_cache_loc: torch.Tensor  # [max_tokens] int64
    req_pool_indices: torch.Tensor  # [max_requests] int64
    seq_lens: torch.Tensor  # [max_requests] int64
    extend_seq_lens: torch.Tensor  # [max_requests] int32
    extend_start_loc: torch.Tensor  # [max_requests] int32
    # Each token's LoRA pool slot (0: no adapter), with LoRA on (None: off). Loading an adapter copies into
    # the pool, so it never recaptures.
    lora_slots: torch.Tensor | None = None

    @classmethod
    def allocate(cls, max_tokens: int, max_requests: int, device, lora: bool = False) -> FullExtendBuffers:
        def zeros(n, dtype):
            return torch.zeros(n, dtype=dtype, device=device)

        return cls(input_ids=zeros(max_tokens, torch.int64), positions=zeros(max_tokens, torch.int64),
                   out_cache_loc=zeros(max_tokens, torch.int64), req_pool_indices=zeros(max_requests, torch.int64),
                   seq_lens=zeros(max_requests, torch.int64), extend_seq_lens=zeros(max_requests, torch.int32),
                   extend_start_loc=zeros(max_requests, torch.int32),
                   lora_slots=zeros(max_tokens, torch.int64) if lora else None)

    def batch(self, level: int, requests: int, model_runner) -> ForwardBatch:
        """The static batch of one graph: `level` tokens over `requests` rows (padding until `load` fills them)."""
        return ForwardBatch(
            mode=ForwardMode.EXTEND, batch_size=requests, input_ids=self.input_ids[:level],
            positions=self.positions[:level], req_pool_indices=self.req_pool_indices[:requests],
            seq_lens=self.seq_lens[:requests], out_cache_loc=self.out_cache_loc[:level],
            req_to_token_pool=model_runner.req_to_token_pool, kv_cache=model_runner.kv_cache,
            attn_backend=model_runner.attn_backend, seq_lens_cpu=[0] * requests,
            extend_seq_lens=self.extend_seq_lens[:requests], extend_start_loc=self.extend_start_loc[:requests],
            extend_seq_lens_cpu=[0] * requests, max_extend_len_bound=level,
            lora=None if self.lora_slots is None else LoraBatch.of_graph(self.lora_slots[:level], decode=False))

    def load(self, fb: ForwardBatch, requests: int) -> None:
        """Copy the real batch in; rows bs..requests get no new tokens. Nothing else of the padding is read:
        tokens n..level keep the ids and positions of an earlier batch (valid ones) and belong to no request."""
        n, bs = fb.num_tokens, fb.batch_size
        dst = [self.input_ids[:n], self.positions[:n], self.out_cache_loc[:n], self.req_pool_indices[:bs],
               self.seq_lens[:bs]]
        src = [fb.input_ids, fb.positions, fb.out_cache_loc, fb.req_pool_indices, fb.seq_lens]
        if self.lora_slots is not None:  # (padding tokens keep an earlier batch's slots: their rows are cut off)
            dst.append(self.lora_slots[:n])
            src.append(fb.lora.token_slots if fb.lora is not None else self.lora_slots.new_zeros(n))
        torch._foreach_copy_(dst, src, non_blocking=True)
        torch._foreach_copy_([self.extend_seq_lens[:bs], self.extend_start_loc[:bs]],
                             [fb.extend_seq_lens, fb.extend_start_loc], non_blocking=True)
        if requests > bs:
            self.extend_seq_lens[bs:requests].zero_()


class FullExtendGraphRunner:
    capture_desc = "capturing full extend graphs"

    def __init__(self, model_runner, token_levels: list[int], max_requests: int = DEFAULT_MAX_REQUESTS,
                 capturer: GraphCapturer | None = None):
        self.model_runner = model_runner
        self.backbone = model_runner.model.model
        self.lm_head = model_runner.model.lm_head
        self.backend = model_runner.attn_backend
        if not self.backend.supports_extend_cuda_graph:
            raise ValueError(f"{type(self.backend).__name__} cannot run extend attention inside a CUDA graph")
        self.device = model_runner.device
        self.levels = sorted(set(token_levels))
        self.max_tokens = self.levels[-1]
        self.max_requests = min(max_requests, model_runner.req_to_token_pool.size)
        self.capturer = capturer or default_capturer(self.device)
        self.lora = getattr(model_runner, "lora", None)  # the LoRA manager, or None
        self.buffers = FullExtendBuffers.allocate(self.max_tokens, self.max_requests, self.device,
                                                  lora=self.lora is not None)
        self.keys = self.graph_keys()
        self.static_batches = {key: self.static_batch(key) for key in self.keys}
        self.graphs: dict[tuple[int, int], object] = {}
        # The hidden states each graph writes (weak references on CUDA: the pool owns the memory).
        self.hidden: dict[tuple[int, int], torch.Tensor] = {}
        self.aux = AuxOut(self.max_tokens)
        self.replays = 0
        self.capture_seconds = 0.0
        self.capture_bytes = 0
        self.capture()

    def graph_keys(self) -> list[tuple[int, int]]:
        """Graphs by (token level, request rows): every level has a graph of one row (a lone request, the usual
        extend of an interactive prompt) and one of every row it can hold."""
        return [(level, rows) for level in self.levels for rows in sorted({1, self.requests_at(level)})]

    def static_batch(self, key: tuple[int, int]) -> ForwardBatch:
        return self.buffers.batch(*key, self.model_runner)

    def requests_at(self, level: int) -> int:
        """The most request rows a level's graphs hold: a batch of `level` tokens has at most that many requests."""
        return min(self.max_requests, level)

    def key(self, fb: ForwardBatch) -> tuple[int, int]:
        level = pick_size(self.levels, fb.num_tokens)
        return level, 1 if fb.batch_size == 1 else self.requests_at(level)

    def _forward(self, key: tuple[int, int]) -> None:
        fb = self.static_batches[key]
        if self.lora is not None:
            self.lora.batch = fb.lora  # the static batch's: its slot ids are the buffer's rows
        self.hidden[key] = self.backbone(fb.input_ids, fb.positions, fb)
        self.aux.write(fb.aux_hidden_states)

    @torch.inference_mode()
    def capture(self) -> None:
        before = self.capturer.memory_in_use()
        start = time.perf_counter()
        bar = tqdm(list(reversed(self.keys)), desc=self.capture_desc, unit="graph",
                   disable=self.device.type != "cuda")
        with frozen_gc():
            for key in bar:  # largest first: smaller graphs reuse its pool memory
                fb = self.static_batches[key]
                self.buffers.load(fb, fb.batch_size)  # no new tokens in any row: safe to run
                self.backend.init_forward_metadata(fb)
                for _ in range(WARMUP_RUNS):
                    self._forward(key)
                self.capturer.synchronize()
                self.graphs[key] = self.capturer.capture(lambda key=key: self._forward(key),
                                                         host_state=(fb, self.backend))
                if self.device.type == "cuda":  # the next (smaller) capture may reuse the blocks
                    self.hidden[key] = weak_ref_tensor(self.hidden[key])
                used = (self.capturer.memory_in_use() - before) / 2**30
                bar.set_postfix_str(f"tokens={key[0]} requests={key[1]} mem={used:.2f} GiB")
        self.capturer.synchronize()
        self.capture_seconds = time.perf_counter() - start
        self.capture_bytes = self.capturer.memory_in_use() - before
        self.log_capture()

    def log_capture(self) -> None:
        logger.info("captured %d full extend graphs (up to %d tokens, %d requests) in %.1f s, %.2f GiB",
                    len(self.graphs), self.max_tokens, self.max_requests, self.capture_seconds,
                    self.capture_bytes / 2**30)

    def can_run(self, fb: ForwardBatch) -> bool:
        return fb.mode.is_extend() and fb.num_tokens <= self.max_tokens and fb.batch_size <= self.max_requests

    @torch.inference_mode()
    def replay(self, fb: ForwardBatch) -> torch.Tensor:
        key = self.key(fb)
        self.buffers.load(fb, key[1])
        self.graphs[key].replay()
        self.replays += 1
        fb.aux_hidden_states = self.aux.read(fb.num_tokens)
        # The hidden states alias the pool: the head (prompt rows included) reads them before another replay.
        return compute_logits(self.lm_head, self.hidden[key][: fb.num_tokens], fb)

    def info(self) -> dict:
        return {"full_extend_graph_tokens": list(self.levels), "full_extend_graph_requests": self.max_requests,
                "full_extend_capture_seconds": round(self.capture_seconds, 2),
                "full_extend_capture_gib": round(self.capture_bytes / 2**30, 3)}

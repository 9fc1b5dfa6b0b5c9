"""CpuGraphRunner: the CPU analogue of the decode CUDA-graph runner, through torch.compile (inductor, CPU).

A CPU step is host-bound: the eager model spends most of a small decode step in Python and in the
dispatcher, op by op. Inductor turns each layer's norms, projections, rotary embedding and MLP into a few
fused C++ kernels around the GEMMs. Attention stays an opaque custom op (`duet::attention`, the seam the
piecewise runner splits at): the lengths and KV slots it reads change every step, so it runs eagerly on
the real batch from the forward context, stores the new K/V of the real rows only and zeroes the padded
ones.

Like the CUDA-graph runner, batches are padded up to the smallest captured size (bisect) so the compiled
code seen at start-up serves every batch: with `dynamic=False` each size gets its own specialization
(compiled once, at start-up, largest first), with `dynamic=True` one trace with a symbolic batch serves
every size above 1 (dynamo specializes size 1, which gets a trace of its own). Inductor's caches live under
`$DUET_CACHE_DIR/inductor` (default ~/.cache/duet/inductor), so a second start skips C++ code generation.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time

import torch
from tqdm import tqdm

from model_executor.default_model import cache_dir
from model_executor.forward_batch import ForwardBatch
from model_executor.layers.attention.forward_context import forward_context
from model_executor.layers.attention.radix_attention import attention_layers
from runners.capture_lists import pick_size
from runners.cuda_graph_runner import GraphInputBuffers

logger = logging.getLogger("duet.cpu_graph_runner")

WARMUP_RUNS = 1  # the first call at a size compiles (or checks that no compile is needed)


def use_duet_inductor_cache() -> str:
    """Point inductor's caches under duet's cache dir, unless the user chose a directory of their own.

    Inductor writes its default (a per-user folder under the system temp dir, cleared at reboot) into the
    environment the first time anything asks for it, so that value counts as not chosen."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    current = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if current is None or os.path.abspath(current) == os.path.abspath(default_cache_dir()):
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache_dir() / "inductor")
    return os.environ["TORCHINDUCTOR_CACHE_DIR"]


class CpuGraphRunner:
    def __init__(self, model_runner, batch_sizes: list[int], dynamic: bool = False):
        self.model_runner = model_runner
        self.model = model_runner.model
        self.backend = model_runner.attn_backend
        self.batch_sizes = sorted(batch_sizes)
        self.max_bs = self.batch_sizes[-1]
        self.dynamic = dynamic
        self.attention_layers = attention_layers(self.model)
        # One spare row: every batch is then a strict view of the buffers. A batch that is the whole buffer
        # makes dynamo guard on "the view is its base", and the next, smaller batch would recompile.
        self.buffers = GraphInputBuffers.allocate(self.max_bs + 1, model_runner.model_config.vocab_size,
                                                  self.backend.get_cuda_graph_seq_len_fill_value(),
                                                  model_runner.device)
        self.cache_dir = use_duet_inductor_cache()
        # Every static size is a specialization of the same code: let dynamo keep them all.
        limit = torch._dynamo.config.recompile_limit
        torch._dynamo.config.recompile_limit = max(limit, len(self.batch_sizes) + 2)
        # The traced forward reads the batch only for its mode (decode: every row is a last token); attention
        # gets the real batch from the forward context. It returns its logits: none go into the buffers.
        self._traced_batch = dataclasses.replace(self._padded_batch(self.max_bs), logits_out=None)
        model = self.model

        def decode_forward(input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
            return model(input_ids, positions, self._traced_batch)

        self.compiled = torch.compile(decode_forward, fullgraph=True, dynamic=dynamic)
        self.capture_seconds = 0.0
        self.capture_bytes = 0  # compiled code holds no device memory of its own
        self.capture()

    def _padded_batch(self, bs: int) -> ForwardBatch:
        return self.buffers.batch(bs, self.model_runner, self.backend)

    def _run(self, padded: ForwardBatch, real: ForwardBatch) -> torch.Tensor:
        self.backend.init_forward_metadata(real)
        with forward_context(real, self.attention_layers):
            return self.compiled(padded.input_ids, padded.positions)

    @torch.inference_mode()
    def capture(self) -> None:
        start = time.perf_counter()
        bar = tqdm(list(reversed(self.batch_sizes)), desc="compiling decode (inductor, CPU)", unit="size")
        for bs in bar:
            fb = self._padded_batch(bs)
            self.buffers.load(fb, bs)  # all rows padding: row 0, slot 0, safe to run
            t0 = time.perf_counter()
            for _ in range(WARMUP_RUNS):
                self._run(fb, fb)
            bar.set_postfix_str(f"bs={bs} {time.perf_counter() - t0:.1f} s")
        self.capture_seconds = time.perf_counter() - start
        logger.info("compiled decode at %d batch sizes in %.1f s (%s, cache %s)", len(self.batch_sizes),
                    self.capture_seconds, "one dynamic trace" if self.dynamic else "one trace per size",
                    self.cache_dir)

    def can_run(self, fb: ForwardBatch) -> bool:
        return fb.mode.is_decode() and fb.batch_size <= self.max_bs

    def replay(self, fb: ForwardBatch) -> torch.Tensor:
        bs = fb.batch_size
        padded_bs = pick_size(self.batch_sizes, bs)
        padded = self._padded_batch(padded_bs)
        self.buffers.load(fb, padded_bs)
        return self._run(padded, fb)[:bs]

    def info(self) -> dict:
        return {"cuda_graph_bs": list(self.batch_sizes), "decode_capture_seconds": round(self.capture_seconds, 2),
                "decode_capture_gib": 0.0, "decode_compiled": "dynamic" if self.dynamic else "static"}

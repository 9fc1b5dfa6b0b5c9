"""PiecewiseCudaGraphRunner: extend (prefill) batches replayed from per-piece CUDA graphs at token levels.

The backbone (embedding -> layers -> final norm) is traced once by torch.compile with the token dimension
dynamic, and split at the `duet::attention` op (runners/fx_split.py) into num_layers + 1 pieces. Every
piece is captured at every token level, largest level first, into one shared pool on one stream; between
pieces, attention runs eagerly on the real (unpadded) batch, which it reads from the forward context
(model_executor/layers/attention/forward_context.py). A replay rounds the token count up to a level (bisect), copies ids and
positions into static buffers and zeroes the padding (token 0, position 0), runs pieces and attention,
slices the hidden states back to the real tokens, and runs the logits head eagerly on each request's
last token. With LoRA on, each token's adapter slot is a third static buffer (padding: slot 0) that the
pieces' LoRA updates read (model_executor/lora/layer.py, the `duet::lora_update` op inside the pieces). Above the largest level the batch runs eagerly. Prompt logprobs need no eager path: the head runs
outside the graphs on the replayed hidden states of every token, so it scores the prompt rows the batch's
PromptLogprobPlan names the same way as in an eager forward (model_executor/prompt_logprobs.py).

Memory: a captured piece's outputs are kept only as weak references (tensors that alias the pool memory
without owning it). Once a level's capture is done nothing holds its blocks, so the next (smaller) level
is captured into the same blocks and the pool stays about the size of the largest level's working set
(keeping every level's outputs alive would make it the sum of every level's).

Host time is what a small extend pays for, so the attention between two pieces is kept cheap: replays
call the op's implementation directly (no dispatcher round trip, runners/fx_split.py), the extend kernel
also stores the new K/V (one launch instead of two), the backend writes into the `out` buffer the next
piece reads (no copy), and replays call the split module directly with the arguments recorded at capture
(no dynamo frame). Large extends are GPU-bound, so nothing extra runs on the GPU either: the logits head
runs eagerly on the last token of each request (not over every token inside the graph), attention reads
host lists prepared before the pieces (no host sync per layer), piece outputs are not copied, only the
padded tail [n, level) is zeroed, and the trace happens once. What each of these measured is in
docs/benchmarks.md.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from enum import Enum, auto

import torch
import torch.utils._pytree as pytree
from torch import nn
from tqdm import tqdm

from model_executor.forward_batch import ForwardBatch, ForwardMode
from model_executor.layers.attention.forward_context import forward_context
from model_executor.layers.attention.radix_attention import attention_layers
from model_executor.layers.logits import compute_logits
from model_executor.lora.layer import LoraBatch
from runners.capture_lists import pick_size
from runners.fx_split import PiecewiseBackend
from runners.graph_seam import GraphCapturer, default_capturer, frozen_gc

logger = logging.getLogger("duet.piecewise_cuda_graph_runner")

WARMUP_RUNS = 2
MIN_LEVEL = 2  # dynamo specializes sizes 0 and 1: a level of 1 would force a second trace


def weak_ref_tensor(t: torch.Tensor) -> torch.Tensor:
    """A tensor over t's memory that does not keep it allocated (the allocator may hand the block out again)."""
    storage = t.untyped_storage()
    weak = torch._C._construct_storage_from_data_pointer(storage.data_ptr(), t.device, storage.nbytes())
    return torch.empty((), dtype=t.dtype, device=t.device).set_(weak, t.storage_offset(), t.size(), t.stride())


def _weak_if_cuda(x):
    return weak_ref_tensor(x) if isinstance(x, torch.Tensor) and x.is_cuda else x


def _addresses(args) -> list:
    return [a.data_ptr() if isinstance(a, torch.Tensor) else a for a in args]


@dataclass
class ExtendInputBuffers:
    input_ids: torch.Tensor  # [max_tokens] int64
    positions: torch.Tensor  # [max_tokens] int64
    # Each token's LoRA pool slot (0: no adapter), with LoRA on: the pieces read it (a graph input, like the
    # ids), so loading an adapter (a copy into the pool) never recaptures. None: LoRA off.
    lora_slots: torch.Tensor | None = None

    @classmethod
    def allocate(cls, max_tokens: int, device, lora: bool = False) -> ExtendInputBuffers:
        def zeros():
            return torch.zeros(max_tokens, dtype=torch.int64, device=device)

        return cls(input_ids=zeros(), positions=zeros(), lora_slots=zeros() if lora else None)

    def load(self, fb: ForwardBatch, level: int) -> None:
        """Copy the real tokens in; tokens n..level are padding (id 0, position 0, slot 0)."""
        n = fb.num_tokens
        self.input_ids[:n].copy_(fb.input_ids, non_blocking=True)
        self.positions[:n].copy_(fb.positions, non_blocking=True)
        if self.lora_slots is not None:
            if fb.lora is not None:
                self.lora_slots[:n].copy_(fb.lora.token_slots, non_blocking=True)
            else:
                self.lora_slots[:n].zero_()
        if level > n:
            self.input_ids[n:level].zero_()
            self.positions[n:level].zero_()
            if self.lora_slots is not None:
                self.lora_slots[n:level].zero_()


class Phase(Enum):
    EAGER = auto()  # trace and warm-up runs: pieces run as compiled, nothing recorded
    CAPTURE = auto()  # each piece is captured at `level`
    REPLAY = auto()  # each piece replays its graph of `level`


@dataclass
class PieceState:
    """What every piece wrapper of one runner does on its next call (set by the runner around a pass)."""

    phase: Phase = Phase.EAGER
    level: int = 0


@dataclass
class _Entry:
    graph: object = None
    output: object = None  # weak references on CUDA (the pool owns the memory)
    addresses: list | None = None  # data pointers of the inputs the graph was captured reading


class CapturedPiece(nn.Module):
    """One piece of the backbone at every level: runs eagerly, captures, or replays by the shared state."""

    def __init__(self, index: int, fn, state: PieceState, capturer: GraphCapturer, check_addresses: bool):
        super().__init__()
        self.index = index
        self.fn = fn
        self.state = state
        self.capturer = capturer
        self.check_addresses = check_addresses
        self.entries: dict[int, _Entry] = {}

    def forward(self, *args):
        state = self.state
        if state.phase is Phase.REPLAY:
            entry = self.entries[state.level]
            if self.check_addresses and _addresses(args) != entry.addresses:
                raise RuntimeError(f"piece {self.index} replayed at level {state.level} with inputs at other "
                                   "addresses than captured")
            entry.graph.replay()
            return entry.output
        if state.phase is Phase.EAGER:
            return self.fn(*args)
        return self._capture(args, state.level)

    def _capture(self, args, level: int):
        entry = _Entry(addresses=_addresses(args))

        def run():
            out = self.fn(*args)
            if entry.output is None:
                entry.output = out
            else:  # the CPU stand-in re-runs on replay: write where a real graph would (its captured outputs)
                for dst, src in zip(pytree.tree_leaves(entry.output), pytree.tree_leaves(out)):
                    if isinstance(dst, torch.Tensor):
                        dst.copy_(src)

        entry.graph = self.capturer.capture(run)
        strong = entry.output
        entry.output = pytree.tree_map(_weak_if_cuda, strong)
        self.entries[level] = entry
        return strong  # alive only until the next pieces of this level have read it


class PiecewiseCudaGraphRunner:
    def __init__(self, model_runner, token_levels: list[int], capturer: GraphCapturer | None = None,
                 check_addresses: bool | None = None):
        self.model_runner = model_runner
        self.model = model_runner.model
        self.attn_backend = model_runner.attn_backend
        self.device = model_runner.device
        self.levels = sorted({max(MIN_LEVEL, t) for t in token_levels})
        self.max_tokens = self.levels[-1]
        self.capturer = capturer or default_capturer(self.device)
        self.check_addresses = self.device.type != "cuda" if check_addresses is None else check_addresses
        self.attention_layers = attention_layers(self.model)
        self.state = PieceState()
        self.pieces: list[CapturedPiece] = []
        compiler = "inductor" if model_runner.config.enable_torch_compile else "eager"
        self.backend = PiecewiseBackend(self._wrap_piece, piece_compiler=compiler)
        # dynamic=False: only the marked token dimension is symbolic. With automatic dynamic, a float that
        # differs from an earlier compile of the same code (another model's RMSNorm eps) became a graph
        # input tensor read with .item(): a new address every call and a host sync.
        self.compiled = torch.compile(self._backbone_fn(), backend=self.backend, fullgraph=True, dynamic=False)
        self.capture_seconds = 0.0
        self.compile_seconds = 0.0
        self.capture_bytes = 0
        self._memory_before = self.capturer.memory_in_use()
        self.lora = getattr(model_runner, "lora", None)  # the LoRA manager, or None
        self.buffers = ExtendInputBuffers.allocate(self.max_tokens, self.device, lora=self.lora is not None)
        # The LoRA layers' batch while tracing and capturing: the slot buffer's first `level` rows. The trace
        # lifts them into a graph input, which each level's recorded arguments (level_args) hold.
        self.lora_batch = LoraBatch.of_graph(self.buffers.lora_slots, decode=False) if self.lora else None
        self.level_args: dict[int, tuple] = {}  # per level: the split module's arguments at capture
        self.capture()

    def _backbone_fn(self):
        backbone = self.model.model

        def run_backbone(input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
            # No ForwardBatch in the traced graph: attention takes it from the forward context.
            return backbone(input_ids, positions, None)

        return run_backbone

    def _wrap_piece(self, index: int, name: str, fn) -> CapturedPiece:
        if self.pieces and index == 0:
            raise RuntimeError("the piecewise backbone was traced again after capture (a recompile); "
                               "run with TORCH_LOGS=recompiles to see the failing guard")
        piece = CapturedPiece(index, fn, self.state, self.capturer, self.check_addresses)
        self.pieces.append(piece)
        return piece

    def _capture_batch(self) -> ForwardBatch:
        """Attention's batch during warm-up and capture: one token in the padding row, writing slot 0."""
        return self.model_runner.build_batch(ForwardMode.EXTEND, [0], [0], [1], torch.zeros(1, dtype=torch.int64),
                                             extend_seq_lens=[1])

    def _run_backbone(self, fb: ForwardBatch, level: int, phase: Phase) -> torch.Tensor:
        """Trace / warm-up / capture go through torch.compile. A replay calls the split module directly with
        the arguments dynamo gave it when `level` was captured: the same static input buffers and parameters,
        and replayed pieces read nothing else. That skips dynamo's frame (guards and the bytecode around the
        graph, host time paid before the first kernel); the guards still checked the trace and capture."""
        self.state.phase, self.state.level = phase, level
        try:
            with forward_context(fb, self.attention_layers):
                if phase is Phase.REPLAY:
                    (hidden,) = self.backend.split.module(*self.level_args[level])
                    return hidden
                input_ids = self.buffers.input_ids[:level]
                positions = self.buffers.positions[:level]
                # Same buffers, token dimension dynamic: one trace serves every level (no duck-sizing recompiles).
                torch._dynamo.mark_dynamic(input_ids, 0)
                torch._dynamo.mark_dynamic(positions, 0)
                if self.lora is not None:
                    self.lora_batch.token_slots = self.buffers.lora_slots[:level]
                    torch._dynamo.mark_dynamic(self.lora_batch.token_slots, 0)
                    self.lora.batch = self.lora_batch
                return self.compiled(input_ids, positions)
        finally:
            self.state.phase = Phase.EAGER
            if self.lora is not None:
                self.lora.batch = None

    @torch.inference_mode()
    def capture(self) -> None:
        start = time.perf_counter()
        fb = self._capture_batch()
        self.attn_backend.init_forward_metadata(fb)
        bar = tqdm(list(reversed(self.levels)), desc="capturing extend pieces", unit="level",
                   disable=self.device.type != "cuda")
        with frozen_gc():
            for level in bar:  # largest first: smaller levels reuse its pool memory
                self.buffers.input_ids[:level].zero_()
                self.buffers.positions[:level].zero_()
                for _ in range(WARMUP_RUNS):
                    t0 = time.perf_counter()
                    self._run_backbone(fb, level, Phase.EAGER)
                    if self.backend.num_traces == 1 and not self.compile_seconds:
                        self.capturer.synchronize()
                        self.compile_seconds = time.perf_counter() - t0  # trace + split (+ inductor) + one run
                self.capturer.synchronize()
                self._run_backbone(fb, level, Phase.CAPTURE)
                self.level_args[level] = self.backend.last_args
                used = (self.capturer.memory_in_use() - self._memory_before) / 2**30
                bar.set_postfix_str(f"tokens={level} mem={used:.2f} GiB")
        self.capturer.synchronize()
        self.capture_seconds = time.perf_counter() - start - self.compile_seconds
        self.capture_bytes = self.capturer.memory_in_use() - self._memory_before
        logger.info("captured %d extend levels in %.1f s (compile %.1f s), %.2f GiB", len(self.levels),
                    self.capture_seconds, self.compile_seconds, self.capture_bytes / 2**30)

    @property
    def num_traces(self) -> int:
        return self.backend.num_traces

    def can_run(self, fb: ForwardBatch) -> bool:
        return fb.mode.is_extend() and fb.num_tokens <= self.max_tokens

    @torch.inference_mode()
    def replay(self, fb: ForwardBatch) -> torch.Tensor:
        n = fb.num_tokens
        level = pick_size(self.levels, n)
        self.buffers.load(fb, level)
        self.attn_backend.init_forward_metadata(fb)
        hidden = self._run_backbone(fb, level, Phase.REPLAY)
        # hidden aliases the pool (a weak reference): the head, prompt rows included, reads it before the
        # next replay can overwrite it.
        return compute_logits(self.model.lm_head, hidden[:n], fb)

    def info(self) -> dict:
        return {"piecewise_cuda_graph_tokens": list(self.levels),
                "extend_capture_seconds": round(self.capture_seconds, 2),
                "extend_compile_seconds": round(self.compile_seconds, 2),
                "extend_capture_gib": round(self.capture_bytes / 2**30, 3)}

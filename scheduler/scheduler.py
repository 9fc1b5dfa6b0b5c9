"""The continuous-batching scheduler: admits waiting requests into extend batches, runs decode steps for
the running ones, and owns every request's KV slots (radix prefix cache, chunked prefill, retraction).

Drivable in-process (tests call `add_request` / `step`); `scheduler_process.py` wraps it in the ZMQ loop.

Overlap scheduling (`enable_overlap`, SGLang's default): a step launches the next batch before it reads the
previous batch's sampled tokens, so the device never waits for the host's bookkeeping (stop checks, output
messages) between steps. This works because nothing the next batch needs comes from the host's copy of
those tokens: a decode step's input ids are the tokens its rows sampled last, which stay on the device
(`ModelRunner.last_token_ids`); its positions are each request's KV length, which the host advances when it
launches a step. The price is a step that a request which just stopped (on EOS or a stop string) runs
once more: that token is discarded when its batch is read, and its KV slot goes back with the rest of the
request's (the slot holds the KV of the request's last, known token, so the prefix cache may keep it).
Requests that stop on their length never run the extra step (the host counts sampled tokens). With overlap
off the same code reads each batch's tokens right after launching it; on the CPU both run synchronously.

Faults stay with the request that causes them: an exception while admitting a request or handling its
sampled token fails that request alone; a batch whose forward pass raises is rolled back and rerun one
request at a time, so only the request that raises again fails. A failed request ends with an "error"
finish reason (HTTP 500 for its client) and its KV slots and request row are freed.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from dataclasses import dataclass

import torch

from model_executor.forward_batch import ForwardMode
from model_executor.memory_pool import OutOfSlotsError
from model_executor.penalties import PenaltyState
from model_executor.pooling import PooledHidden, PoolingPlan
from model_executor.sampler import HostSample
from model_executor.sampling_params import SamplingParams
from model_executor.speculative_sampling import HostVerify
from runners.model_runner import ModelRunner
from scheduler.batch_facts import BatchFacts
from scheduler.draft_model import build_draft_proposer
from scheduler.grammar import GrammarCompilerPool, GrammarDeadEnd, GrammarManager
from scheduler.io_struct import (
    DETOKENIZER_CONTEXT_TOKENS,
    FinishReason,
    ImageInput,
    PoolingSpec,
    PromptLogprobs,
    SpecCounts,
    TokenLogprob,
)
from scheduler.multimodal import MmState, MultimodalError, build_mm_batch
from scheduler.policy import order_waiting
from scheduler.prompt_logprobs import LaunchedPromptLogprobs, plan_prompt_logprobs
from scheduler.radix_cache import RadixCache
from scheduler.req import Req, ReqStatus
from scheduler.speculative import SpeculativeConfig, Speculator

logger = logging.getLogger("duet.scheduler")


@dataclass(frozen=True)
class SchedulerConfig:
    max_running_requests: int
    max_prefill_tokens: int = 16384
    chunked_prefill_size: int | None = None  # None: prompts are never split
    schedule_policy: str = "fcfs"
    disable_radix_cache: bool = False
    # Share of each request's remaining output tokens kept free at admission; retraction covers the rest.
    new_token_ratio: float = 0.3
    enable_overlap: bool = False  # the server turns it on unless --disable-overlap-schedule
    # Run the running requests' decode inside each extend batch (SGLang's mixed chunk), instead of
    # alternating extend and decode steps: their inter-token latency stays steady while prompts arrive.
    enable_mixed_chunk: bool = False
    grammar_backend: str = "xgrammar"  # or "none"
    # Speculative decoding (scheduler/speculative.py); None: off. It runs with overlap scheduling off.
    speculative: SpeculativeConfig | None = None


@dataclass
class LaunchedSample:
    """The tokens a launched batch samples for `reqs`, on their way to the host. `epochs` are the requests'
    retraction counts at launch: a request retracted since then has its token discarded. An extend batch also
    brings the prompt logprobs it scored; one that completes no prompt samples nothing (result None)."""

    reqs: list[Req]
    epochs: list[int]
    result: HostSample | None
    prompt_logprobs: LaunchedPromptLogprobs | None = None
    # Pooling requests whose last prompt chunk this batch ran, with their vectors (on the device until read).
    pooled: list[tuple[Req, torch.Tensor]] | None = None
    verify: LaunchedVerify | None = None  # a verify batch's outcome (then result is None)


@dataclass
class LaunchedVerify:
    """A verify batch's acceptance on its way to the host, and what applying it needs: each request's drafts,
    its KV length before the batch, and the batch's slots (each request's len(drafts) + 1, in order)."""

    result: HostVerify
    drafts: list[list[int]]
    starts: list[int]
    out_loc: torch.Tensor
    hidden: torch.Tensor | None = None  # the target's aux hidden states of every row (EAGLE3)


@dataclass(slots=True)
class ReqOutput:
    rid: str
    new_token_ids: list[int]
    finish_reason: FinishReason | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    logprobs: list[TokenLogprob] | None
    context_ids: list[int] = dataclasses.field(default_factory=list)  # last prompt tokens, with the first output
    prompt_logprobs: PromptLogprobs | None = None  # with the first output
    decode_options: tuple | None = None  # SamplingParams.decode_options, with the first output
    embedding: object | None = None  # a pooling request's vector (float32 numpy array), when it finishes
    spec_counts: SpecCounts | None = None  # with speculative decoding on


class Scheduler:
    def __init__(self, runner: ModelRunner, config: SchedulerConfig, tokenizer=None):
        if config.speculative is not None and config.enable_overlap:
            # A verify step's input is its requests' accepted tokens, known only once the previous step is read.
            logger.info("speculative decoding (%s): overlap scheduling is off", config.speculative.algorithm)
            config = dataclasses.replace(config, enable_overlap=False)
        self.speculator = None
        if config.speculative is not None:
            self.speculator = Speculator(config.speculative, build_draft_proposer(config.speculative, runner))
        self.runner = runner
        self.config = config
        self.tokenizer = tokenizer  # needed only for stop strings
        self.allocator = runner.allocator
        self.req_pool = runner.req_to_token_pool
        self.tree = None if config.disable_radix_cache else RadixCache(self.allocator)
        self.max_running = min(config.max_running_requests, self.req_pool.size)
        self.eos_ids = set(runner.model_config.eos_token_ids)
        self.waiting: list[Req] = []
        self.running: list[Req] = []
        self.chunked_req: Req | None = None  # admitted, partly prefilled
        self.reqs: dict[str, Req] = {}
        self._outbox: dict[str, Req] = {}  # requests with something to report after this step
        self._last_step_extend = False
        self._in_flight: list[LaunchedSample] = []  # overlap: the batch launched last step, not yet read
        # Bumped whenever a request is admitted or gives its KV back (finish, retraction): the decode batch's
        # BatchFacts are reused while it holds the same requests and this has not moved.
        self._generation = 0
        self._decode_facts: BatchFacts | None = None
        self._finished_at_filter = 0  # num_finished when self.running was last cleared of finished requests
        self.num_finished = 0
        self.num_prompt_tokens = 0
        self.num_cached_tokens = 0
        self.num_retractions = 0
        # Sampling-API state (model_executor/penalties.py, scheduler/grammar.py): see the hooks marked "# hook".
        vocab = runner.model_config.vocab_size
        self.penalties = PenaltyState(self.req_pool.req_to_token.shape[0], vocab, self.req_pool.req_to_token.device)
        make_compilers = None
        if config.grammar_backend == "xgrammar" and tokenizer is not None:
            eos = sorted(self.eos_ids)
            make_compilers = lambda: GrammarCompilerPool.for_tokenizer(tokenizer, vocab, eos)
        self.grammars = GrammarManager(make_compilers, vocab)

    # ---- requests in -----------------------------------------------------------------------------
    def add_request(self, rid: str, input_ids: list[int], params: SamplingParams,
                    pooling: PoolingSpec | None = None, lora_name: str | None = None,
                    images: list[ImageInput] | None = None) -> None:
        """pooling: a pooling request, which returns a vector instead of tokens (io_struct.PoolingSpec).
        lora_name: the LoRA adapter it runs with (None: the base model). images: a multimodal prompt's images
        (their pad tokens are in input_ids)."""
        try:
            self._add_request(rid, input_ids, params, pooling, lora_name, images)
        except Exception as exc:  # noqa: BLE001 - one bad request must not stop the loop
            req = self.reqs.get(rid)
            if req is None:
                req = self.reqs[rid] = Req(rid, [], params)
            if req in self.waiting:
                self.waiting.remove(req)
            self._fail(req, exc)

    def _add_request(self, rid: str, input_ids: list[int], params: SamplingParams,
                     pooling: PoolingSpec | None = None, lora_name: str | None = None,
                     images: list[ImageInput] | None = None) -> None:
        if params.top_k > self.runner.model_config.vocab_size:
            # Keeping the best k > vocab tokens keeps them all (top-k off); a k beyond int64 would also
            # overflow the sampler's tensor and take the whole scheduler down.
            params = dataclasses.replace(params, top_k=-1)
        if pooling is not None:  # prefilled, never sampled: no output tokens to reserve room for
            params = dataclasses.replace(params, max_new_tokens=0, prompt_logprob_start=None, grammar=None)
        req = Req(rid, list(input_ids), params)
        req.pooling = pooling
        invalid = self._resolve_lora(req, lora_name)
        if images and invalid is None:
            invalid = self._attach_images(req, images)
        req.max_output = min(params.max_new_tokens, self.runner.context_len - len(req.input_ids))
        if not params.ignore_eos:
            req.stop_ids = req.stop_ids | self.eos_ids
        self.reqs[rid] = req
        error = self._admission_error(req)
        if invalid is not None:
            self._finish(req, FinishReason("invalid", message=invalid))
        elif error is not None:
            self._finish(req, FinishReason("error", message=error))
        elif params.max_new_tokens == 0 and pooling is None:
            self._finish(req, FinishReason("length"))
        elif not self.grammars.defer(req):  # hook (a): a request with a grammar waits for its compilation
            self.waiting.append(req)

    def _attach_images(self, req: Req, images: list[ImageInput]) -> str | None:
        """Set the request's multimodal state; an error message when its images cannot be served."""
        cfg = self.runner.model_config
        if self.speculator is not None:
            return "images are not served with speculative decoding"
        if req.pooling is not None:
            return "images are not served for pooling requests"
        try:
            req.mm = MmState.build(req.input_ids, images, cfg.image_token_id,
                                   int(cfg.hf_config.get("vision_config", {}).get("spatial_merge_size", 2)))
        except MultimodalError as e:
            return str(e)
        return None

    def _resolve_lora(self, req: Req, name: str | None) -> str | None:
        """Set the request's adapter id; an error message when it names one that is not loaded."""
        if name is None:
            return None
        lora = self.runner.lora
        req.lora_id = lora.uid(name) if lora is not None else None
        if req.lora_id is None:
            return f"LoRA adapter {name!r} is not loaded" if lora is not None else \
                "this server serves no LoRA adapters (start it with --enable-lora)"
        return None

    def load_lora(self, name: str, path: str, pinned: bool = False) -> None:
        """Load an adapter (LoraError, one line, when it cannot be served)."""
        self.runner.lora.load(name, path, pinned)

    def unload_lora(self, name: str) -> str | None:
        """Unload an adapter; an error message when it is not loaded or requests still use it."""
        lora = self.runner.lora
        uid = lora.uid(name)
        if uid is None:
            return f"LoRA adapter {name!r} is not loaded"
        users = sum(r.lora_id == uid for r in self.reqs.values() if not r.is_finished)
        if users:
            return f"LoRA adapter {name!r} is in use by {users} request(s); unload it when they finish"
        lora.unload(name)
        return None

    def lora_names(self) -> list[str]:
        return self.runner.lora.names() if self.runner.lora is not None else []

    def _lora_slots(self, reqs: list[Req]) -> list[int] | None:
        """Each request's LoRA pool slot for a batch of them (loading their adapters into the pool)."""
        return None if self.runner.lora is None else self.runner.lora.prepare([r.lora_id for r in reqs])

    def _admission_error(self, req: Req) -> str | None:
        total = len(req.input_ids) + req.params.max_new_tokens
        if not req.input_ids:
            return "the prompt is empty"
        if total > self.runner.context_len:
            return (f"prompt ({len(req.input_ids)} tokens) + max_tokens ({req.params.max_new_tokens}) exceeds the "
                    f"context length {self.runner.context_len}")
        if total > self.allocator.num_slots:
            return f"prompt + max_tokens ({total}) exceeds the KV cache size {self.allocator.num_slots}"
        vocab = self.runner.model_config.vocab_size
        if any(not 0 <= t < vocab for t in req.input_ids):
            return f"prompt token ids must be in [0, {vocab})"
        if any(not 0 <= t < vocab for t in req.params.stop_token_ids):
            # Checked here too (the HTTP process rejects them first): an id beyond the vocabulary would
            # index past the logits row in _mask_early_stops and take the whole scheduler down.
            return f"stop_token_ids must be in [0, {vocab})"
        return None

    def abort(self, rid: str) -> None:
        req = self.reqs.get(rid)
        if req is None or req.is_finished:
            return
        if req in self.waiting:
            self.waiting.remove(req)
        elif self.grammars.remove(req):  # hook (a)
            pass
        elif req is self.chunked_req:
            self.chunked_req = None
        elif req in self.running:
            self.running.remove(req)
        self._finish(req, FinishReason("abort", message="aborted"))

    def flush_cache(self) -> bool:
        return self.tree.flush() if self.tree is not None else True

    # ---- the loop --------------------------------------------------------------------------------
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.chunked_req or self._outbox or self._in_flight
                    or len(self.grammars))

    @torch.inference_mode()
    def step(self) -> list[ReqOutput]:
        """Launch one forward pass (an extend batch, else a decode batch) and read the tokens of the one
        launched before it (overlap) or of this one; returns what each request produced."""
        self._admit_compiled_grammars()  # hook (a)
        launched = self._launch()  # (may read the in-flight batch itself: see _sample)
        if self.config.enable_overlap:
            launched, self._in_flight = self._in_flight, launched
        self._read(launched)
        if self.num_finished != self._finished_at_filter:  # else none of them finished (only _finish counts)
            self.running = [r for r in self.running if r.finish_reason is None]
            self._finished_at_filter = self.num_finished
        return self._collect_outputs()

    def _read(self, batches: list[LaunchedSample]) -> None:
        """Apply the launched batches' tokens to their requests (waiting for them if needed)."""
        for batch in batches:
            self._append_sampled(batch)

    def _launch(self) -> list[LaunchedSample]:
        # Alternate with decode so running requests keep going while long prompts prefill in chunks (with
        # mixed chunks they decode inside the extend batches).
        if not (self._last_step_extend and self.running):
            batch = self._schedule_extend()
            if batch:
                reqs, lens = batch
                decodes = self._mixed_decodes(sum(lens)) if self.config.enable_mixed_chunk else []
                self._last_step_extend = not decodes
                return self._launch_extend(reqs + decodes, lens + [1] * len(decodes),
                                           [False] * len(reqs) + [True] * len(decodes))
        self._last_step_extend = False
        return self._launch_decode()

    def _mixed_decodes(self, extend_tokens: int) -> list[Req]:
        """The running requests that decode inside this extend batch: all of them, if the pool has a slot for
        each after the extend's (else none: the next step is a plain decode, which may retract)."""
        decodes = [r for r in self.running if self._may_continue(r)]
        if len(decodes) + extend_tokens > self.allocator.available_size() + self._evictable():
            return []
        return decodes

    def _admit_compiled_grammars(self) -> None:
        idle = not (self.waiting or self.running or self.chunked_req)
        ready, failed = self.grammars.pop_ready(wait_s=0.005 if idle else 0.0)
        self.waiting.extend(ready)
        for req, exc in failed:
            self._fail(req, exc)

    # ---- extend ----------------------------------------------------------------------------------
    def _schedule_extend(self) -> tuple[list[Req], list[int]] | None:
        if not self.waiting and self.chunked_req is None:
            return None  # the common decode-only step: skip the admission bookkeeping
        chunk = self.config.chunked_prefill_size or math.inf
        budget = self.config.max_prefill_tokens
        reqs, lens = [], []
        self.waiting = order_waiting(self.waiting, self.config.schedule_policy, self.tree)
        reserved = sum(self._reserve(r) for r in self.running)
        if self.chunked_req is not None:
            req = self.chunked_req
            # The next chunk gets what is free after the running requests' reserve (at least each one's
            # next decode slot): a bigger chunk might not be allocatable (SGLang's add_chunked_req
            # truncates the same way).
            keep = max(len(self.running), sum(self._reserve(r) for r in self.running))
            room = self.allocator.available_size() + self._evictable() - keep
            n = int(min(req.num_uncomputed, chunk, max(budget, 1), room))
            if n <= 0:
                if not self.running:  # nothing will free memory: cannot happen while admission holds
                    self._fail(req, OutOfSlotsError("out of KV cache memory for the next prefill chunk"))
                return None  # decode this step; finishing or retracted requests free slots
            self.chunked_req = None
            if n < req.num_uncomputed:
                # The prompt is not done after this chunk either: waiting prompts that fit whole in the chunk go
                # first, in the same batch, so a short request waits one chunk, not a long prompt's whole
                # prefill; the long prompt takes what they leave of the chunk, and at least half of it (it
                # always moves on; the batch stays within 1.5 chunks).
                reserved = self._admit_waiting(reqs, lens, n, chunk, reserved, whole=True, pending=(req, n))
                n = max(n - sum(lens), (n + 1) // 2)
            reqs.append(req)
            lens.append(n)
            budget -= sum(lens)
            reserved += self._reserve(req)
        self._admit_waiting(reqs, lens, budget, chunk, reserved)
        return (reqs, lens) if reqs else None

    def _admit_waiting(self, reqs: list[Req], lens: list[int], budget: int, chunk: float, reserved: int,
                       whole: bool = False, pending: tuple[Req, int] | None = None) -> int:
        """Admit waiting requests in order into the batch (reqs, lens) while the token budget, the running
        limit and the KV pool allow; the last one admitted may be chunked, unless `whole` (then the first
        that does not fit whole ends the admission). pending: a request and its tokens that join the batch
        after these. Returns the reserve of future decode slots, with the admitted requests'."""
        pending_req, pending_n = pending or (None, 0)
        taken = len(self.running) + (pending_req is not None)
        # The pending request's tokens and its reserve are the same for every candidate: counted once.
        pending_need = pending_n + (self._reserve(pending_req, extra=pending_req.num_uncomputed - pending_n)
                                    if pending_req is not None else 0)
        while self.waiting and budget > 0 and taken + len(reqs) < self.max_running:
            if lens and lens[-1] < reqs[-1].num_uncomputed:
                break  # one partly-prefilled request per batch, and it goes last
            req = self.waiting[0]
            if self.runner.lora is not None and not self.runner.lora.fits(
                    {r.lora_id for r in (*self._admitted(), *reqs, req)} | ({pending_req.lora_id} if pending_req
                                                                               else set())):
                break  # one more adapter than a batch holds: it waits for a running adapter to finish
            locked = None
            try:
                prefix, node = self._match(req)
                n_new = req.seq_len - len(prefix)
                n = int(min(n_new, chunk, budget))
                if whole and n < n_new:
                    break
                self._lock(node)
                locked = node
                available = self.allocator.available_size() + self._evictable()
                need = sum(lens) + pending_need + n + reserved + self._reserve(req, extra=n_new - n)
                if need > available and (reqs or self.running or pending_req is not None):
                    self._unlock(node)
                    break  # wait for running requests to free memory
                if n + sum(lens) + pending_n > available:
                    self._unlock(node)
                    break
                self.waiting.pop(0)
                self._admit(req, prefix, node)
            except Exception as exc:  # noqa: BLE001 - fail this request, admit the others
                if req.req_pool_idx is None:  # _admit did not take over the lock
                    self._unlock(locked)
                if self.waiting and self.waiting[0] is req:
                    self.waiting.pop(0)
                self._fail(req, exc)
                continue
            reqs.append(req)
            lens.append(n)
            budget -= n
            reserved += self._reserve(req)
        return reserved

    def _reserve(self, req: Req, extra: int = 0) -> int:
        return math.ceil(req.remaining_new_tokens * self.config.new_token_ratio) + extra

    def _match(self, req: Req):
        if self.tree is None:
            return torch.empty(0, dtype=torch.int64), None
        key = req.cache_key
        limit = len(key) - 1  # keep >= 1 token to compute logits from
        if req.prompt_logprob_next is not None:
            limit = min(limit, req.prompt_logprob_next)  # rows to score need their hidden states: no cache there
        if req.pooling is not None and req.pooling.needs_every_row:
            limit = 0
        return self.tree.match_prefix(key[:limit], req.lora_id)

    def _lock(self, node) -> None:
        if node is not None:
            self.tree.inc_lock_ref(node)

    def _unlock(self, node) -> None:
        if node is not None:
            self.tree.dec_lock_ref(node)

    def _evictable(self) -> int:
        return self.tree.evictable_size() if self.tree is not None else 0

    def _admit(self, req: Req, prefix: torch.Tensor, node) -> None:
        req.req_pool_idx = self.req_pool.alloc()
        self._generation += 1
        req.prefix_slots, req.last_node = prefix, node  # from here on, releasing the request unlocks node
        req.kv_len = len(prefix)
        if len(prefix):
            self.req_pool.write(req.req_pool_idx, 0, prefix)
        self.penalties.init_row(req.req_pool_idx, req.params, req.input_ids, req.output_ids)  # hook (a)
        if req.num_retractions == 0:
            req.cached_tokens = len(prefix)
            self.num_prompt_tokens += len(req.input_ids)
            self.num_cached_tokens += len(prefix)
        req.status = ReqStatus.RUNNING

    def _launch_extend(self, reqs: list[Req], lens: list[int], decoding: list[bool]) -> list[LaunchedSample]:
        """An extend batch; the requests marked `decoding` (last in the batch) are running ones taking their
        decode step in it (mixed chunk)."""
        launched = []
        decoding_reqs = {r for r, dec in zip(reqs, decoding) if dec}  # already running
        for part, sample in self._run_isolated(self._extend_forward, reqs, lens, decoding):
            for req in part:
                if req.num_uncomputed > 0 and not req.is_finished and req not in decoding_reqs:
                    self.chunked_req = req
            if sample is not None:
                launched.append(sample)
                # They decode from the next step on, before this step's tokens are read.
                self.running.extend(r for r in sample.reqs if r not in decoding_reqs and self._may_continue(r))
        return launched

    def _extend_forward(self, reqs: list[Req], lens: list[int], decoding: list[bool]):
        """Prefill lens[i] more tokens of each request; samples for those whose prompt is then complete, and
        for the decoding ones (one token each, last in the batch)."""
        out_loc = self._alloc_slots(sum(lens))
        start = [r.kv_len for r in reqs]
        try:
            input_ids, seq_lens, offset = [], [], 0
            for req, n, dec in zip(reqs, lens, decoding):
                # A decoding request's input is its last sampled token, which may still be on the device only.
                input_ids.extend([0] if dec else req.fill_ids[req.kv_len : req.kv_len + n])
                self.req_pool.write(req.req_pool_idx, req.kv_len, out_loc[offset : offset + n])
                req.kv_len += n
                seq_lens.append(req.kv_len)
                offset += n
            mm = build_mm_batch(reqs, lens, start, decoding, self.runner.encode_images)
            fb = self.runner.build_batch(ForwardMode.EXTEND, input_ids, [r.req_pool_idx for r in reqs], seq_lens,
                                         out_loc, extend_seq_lens=lens, num_decode_tail=sum(decoding),
                                         lora_slots=self._lora_slots(reqs), mm=mm,
                                         mrope_deltas=[r.mm.delta if r.mm is not None else 0 for r in reqs])
            scoring = plan_prompt_logprobs(reqs, lens, start, self.runner.device, self.runner.pin_memory)
            fb.prompt_logprob_plan = scoring.plan if scoring is not None else None
            pooling = [i for i, r in enumerate(reqs) if r.pooling is not None]
            if pooling:
                kinds = {reqs[i].pooling.kind for i in pooling}
                fb.pooling_plan = PoolingPlan(sums="mean" in kinds, firsts="cls" in kinds)
            logits = self.runner.forward(fb)
            if mm is not None:
                for r in reqs:
                    if r.mm is not None:
                        r.mm.drop_done(r.kv_len)
            if self.speculator is not None and self.speculator.wants_hidden:
                self._observe_hidden(reqs, start, lens, fb.aux_hidden_states)
            scored = scoring.launched(fb.prompt_logprobs) if scoring is not None else None
            done = [i for i, r in enumerate(reqs) if decoding[i] or (r.num_uncomputed == 0 and r.pooling is None)]
            if not done:
                sample = None if scored is None and not pooling else LaunchedSample([], [], None)
            elif len(done) < len(reqs):
                sample = self._sample(logits[done], [reqs[i] for i in done], fb.req_pool_indices[done])
            else:
                sample = self._sample(logits, reqs, fb.req_pool_indices)
            if scoring is not None:
                scoring.advance()
                sample.prompt_logprobs = scored
            if pooling:  # last: a batch that raised before this is rerun, and must not pool its rows twice
                sample.pooled = self._pool(reqs, pooling, start, logits, fb.pooled)
            return sample
        except BaseException:
            self._roll_back(reqs, start, out_loc)
            raise

    @staticmethod
    def _pool(reqs: list[Req], rows: list[int], start: list[int], logits: torch.Tensor,
              hidden: PooledHidden) -> list[tuple[Req, torch.Tensor]]:
        """Take the pooling requests' (reqs[rows]) share of this chunk; returns those whose prompt is complete,
        each with its vector (still on the device: read with the batch)."""
        out = []
        for i in rows:
            req = reqs[i]
            kind = req.pooling.kind
            if kind == "mean":
                req.pool_sum = hidden.sums[i] if req.pool_sum is None else req.pool_sum + hidden.sums[i]
            elif kind == "cls" and start[i] == 0:
                req.pool_first = hidden.firsts[i]
            if req.num_uncomputed:
                continue  # more chunks to come
            if kind == "last":
                vec = hidden.last[i]
            elif kind == "mean":
                vec = req.pool_sum / len(req.input_ids)
            elif kind == "cls":
                vec = req.pool_first
            else:  # "logits" (a copy: the logits may be a graph's static buffer, which the next step overwrites)
                ids = req.pooling.token_ids
                vec = logits[i, list(ids)] if ids else logits[i].clone()
            req.pool_sum = req.pool_first = None
            out.append((req, vec.float()))
        return out

    def _roll_back(self, reqs: list[Req], start: list[int], out_loc: torch.Tensor) -> None:
        """Undo a failed forward pass: its slots were never filled, so none may reach the prefix cache."""
        for req, kv_len in zip(reqs, start):
            req.kv_len = kv_len
        self.allocator.free(out_loc)

    def _run_isolated(self, forward, reqs: list[Req], *per_req: list) -> list[tuple[list[Req], object]]:
        """forward(reqs, *per_req) as one batch; if it raises, once per request so only the culprit fails."""
        try:
            return [(reqs, forward(reqs, *per_req))]
        except Exception as exc:  # noqa: BLE001 - isolate the request that raises
            if len(reqs) == 1:
                self._fail(reqs[0], exc)
                return []
            logger.warning("a batch of %d requests failed (%s: %s); running them one at a time",
                           len(reqs), type(exc).__name__, exc)
        results = []
        for i, req in enumerate(reqs):
            try:
                results.append(([req], forward([req], *[[arg[i]] for arg in per_req])))
            except Exception as exc:  # noqa: BLE001
                self._fail(req, exc)
        return results

    # ---- decode ----------------------------------------------------------------------------------
    @staticmethod
    def _may_continue(req: Req) -> bool:
        """False once the request has sampled its last token by length (known before the token is read)."""
        return req.finish_reason is None and req.num_sampled < req.max_output

    def _launch_decode(self) -> list[LaunchedSample]:
        reqs = self._make_room_for_decode()
        if not reqs:
            return []
        drafts = self._drafts(reqs) if self.speculator is not None else None
        if drafts is not None:
            return [sample for _, sample in self._run_isolated(self._verify_forward, reqs, drafts)]
        return [sample for _, sample in self._run_isolated(self._decode_forward, reqs)]

    # ---- speculative verify ------------------------------------------------------------------------
    def _drafts(self, reqs: list[Req]) -> list[list[int]] | None:
        """Each request's drafts this step, within the KV slots left after each one's own next slot (None:
        nobody drafts, a plain decode step)."""
        room = self.allocator.available_size() + self._evictable() - len(reqs)
        drafts = self.speculator.drafts(reqs, room)
        return drafts if any(drafts) else None

    def _verify_forward(self, reqs: list[Req], drafts: list[list[int]]) -> LaunchedSample:
        """One extend-like pass over each request's [last sampled token, drafts...] (its KV prefix before
        them), then the acceptance of the drafts; every request emits at least one token."""
        lens = [len(d) + 1 for d in drafts]
        out_loc = self._alloc_slots(sum(lens))
        start = [r.kv_len for r in reqs]
        try:
            input_ids, seq_lens, offset = [], [], 0
            for req, draft, n in zip(reqs, drafts, lens):
                input_ids.append(req.output_ids[-1])  # (overlap is off: the last token is on the host)
                input_ids.extend(draft)
                self.req_pool.write(req.req_pool_idx, req.kv_len, out_loc[offset:offset + n])
                req.kv_len += n
                seq_lens.append(req.kv_len)
                offset += n
            fb = self.runner.build_verify_batch(input_ids, [r.req_pool_idx for r in reqs], seq_lens, out_loc, lens)
            logits = self.runner.forward_verify(fb)
            sample = self._verify_sample(logits, reqs, drafts, lens, fb.req_pool_indices, start, out_loc)
            sample.verify.hidden = fb.aux_hidden_states
            return sample
        except BaseException:
            self._roll_back(reqs, start, out_loc)
            raise

    def _verify_sample(self, logits: torch.Tensor, reqs: list[Req], drafts: list[list[int]], lens: list[int],
                       rows: torch.Tensor, start: list[int], out_loc: torch.Tensor) -> LaunchedSample:
        """The logits of every row processed as plain sampling's (row i of a request as if d_1..d_i were
        already its output: min_tokens, penalties counting them), then the acceptance."""
        row_reqs = [r for r, n in zip(reqs, lens) for _ in range(n)]
        steps = [r.num_sampled + i for r, n in zip(reqs, lens) for i in range(n)]
        facts = BatchFacts.gather(row_reqs, self._generation)
        drafted = [d[:i] for d in drafts for i in range(len(d) + 1)] if facts.penalized else None
        self._process_logits(logits, row_reqs, facts, steps, drafted)
        info = facts.sampling_info_for(steps, self.runner.device)
        row_drafts = torch.tensor([t for d in drafts for t in (*d, -1)], dtype=torch.int64)
        row_drafts = row_drafts.to(self.runner.device, non_blocking=True)
        out = self.runner.verify(logits, info, row_drafts, lens, rows)
        self.speculator.counts.verify_batches += 1
        return LaunchedSample(reqs, [r.num_retractions for r in reqs], None,
                              verify=LaunchedVerify(out.to_host(), drafts, start, out_loc))

    def _append_verified(self, batch: LaunchedSample) -> None:
        """Apply a verify batch: each request takes its accepted drafts and the token after them, one at a time
        (a stop, max_tokens or a failure cuts the run there), then keeps the KV of the tokens it took and
        frees the slots of the rest."""
        v = batch.verify
        row_tokens, accept_lens, chosen, top_ids, top_vals = v.result.lists()
        now = time.monotonic()
        offset = 0
        for req, epoch, draft, start, accepted in zip(batch.reqs, batch.epochs, v.drafts, v.starts, accept_lens):
            first, n = offset, len(draft) + 1
            offset += n
            if req.finish_reason is not None or req.num_retractions != epoch:
                continue  # (cannot happen with overlap off: nothing runs between the launch and this read)
            if draft:
                self.speculator.record(req, len(draft), accepted)
            taken, reason, failure = 0, None, None
            for row in range(first, first + accepted + 1):
                try:
                    reason = self._take_token(req, row_tokens[row], now, row, chosen, top_ids, top_vals)
                except GrammarDeadEnd as exc:
                    reason = FinishReason("invalid", message=str(exc))
                except Exception as exc:  # noqa: BLE001 - as in _append_sampled
                    failure = exc
                    break
                taken += 1
                if reason is not None:
                    break
            # The batch wrote [last token, d_1..d_k] from `start`; the request now holds its last token and the
            # first taken - 1 tokens it took (the newest one has no KV yet, as after a decode step).
            req.kv_len = start + taken
            self.allocator.free(v.out_loc[first + taken:first + n])
            if self.speculator.wants_hidden:  # (before a finish below releases the draft's state)
                self.speculator.observe(req, start, None if v.hidden is None else v.hidden[first:first + taken])
            req.num_sampled = len(req.output_ids)
            if req.params.has_penalties and taken:
                self.penalties.count_tokens(req.req_pool_idx, req.output_ids[-taken:])
            if failure is not None:
                self._fail(req, failure)
            elif reason is not None:
                self._finish(req, reason)

    def _observe_hidden(self, reqs: list[Req], starts: list[int], lens: list[int],
                        hidden: torch.Tensor | None) -> None:
        """Hand each request's rows of the target's aux hidden states (positions starts[i].., lens[i] of them) to
        the draft (EAGLE3)."""
        offset = 0
        for req, start, n in zip(reqs, starts, lens):
            self.speculator.observe(req, start, None if hidden is None else hidden[offset:offset + n])
            offset += n

    def _decode_forward(self, reqs: list[Req]) -> LaunchedSample:
        out_loc = self._alloc_slots(len(reqs))
        facts = self._decode_facts
        if facts is None or not facts.matches(reqs, self._generation):
            facts = self._decode_facts = BatchFacts.gather(reqs, self._generation)
        seq_lens = []
        try:
            for r in reqs:  # each takes one more KV slot
                r.kv_len += 1
                seq_lens.append(r.kv_len)
            # Input ids None: each row's last sampled token, read on the device.
            fb = self.runner.build_batch(ForwardMode.DECODE, None, facts.rows, seq_lens, out_loc,
                                         lora_slots=self._lora_slots(reqs))
            logits = self.runner.forward(fb)
            if self.speculator is not None and self.speculator.wants_hidden:
                self._observe_hidden(reqs, [n - 1 for n in seq_lens], [1] * len(reqs), fb.aux_hidden_states)
            return self._sample(logits, reqs, fb.req_pool_indices, facts)
        except BaseException:
            self._roll_back(reqs[: len(seq_lens)], [n - 1 for n in seq_lens], out_loc)
            raise

    def _make_room_for_decode(self) -> list[Req]:
        """Each running request that decodes needs one slot; evict cached prefixes, then retract the
        partly-prefilled request (it has no output yet; with the radix cache its chunks stay cached), then the
        newest. Returns the requests that decode this step."""
        while True:
            reqs = [r for r in self.running if self._may_continue(r)]
            if self._short_after_evicting(len(reqs)) <= 0:
                return reqs
            if self.chunked_req is not None:
                req, self.chunked_req = self.chunked_req, None
                self._retract(req)
            elif len(self.running) > 1:
                self._retract(self.running.pop())
            else:
                # One request alone cannot grow: admission guarantees prompt + max_tokens fits the pool, so
                # this means other cached KV is locked; fail it rather than hang.
                req = self.running.pop()
                self._finish(req, FinishReason("error", message="out of KV cache memory"))

    def _short_after_evicting(self, need: int) -> int:
        """Slots `need` decoding requests still lack after evicting cached prefixes."""
        short = need - self.allocator.available_size()
        if short > 0 and self.tree is not None:
            self.tree.evict(short)
            short = need - self.allocator.available_size()
        return short

    def _retract(self, req: Req) -> None:
        logger.info("retracting request %s (%d tokens) to free KV memory", req.rid, req.kv_len)
        self._release_kv(req)
        req.status = ReqStatus.WAITING
        req.num_retractions += 1  # a token of it still in flight is discarded when read
        req.num_sampled = len(req.output_ids)
        req.pool_sum = req.pool_first = None  # a pooling request prefills again from its first token
        if req.mm is not None:
            req.mm.embeds.clear()  # encoded again when its image tokens are prefilled again
        self.num_retractions += 1
        self.waiting.insert(0, req)

    def _alloc_slots(self, n: int) -> torch.Tensor:
        short = n - self.allocator.available_size()
        if short > 0 and self.tree is not None:
            self.tree.evict(short)
        return self.allocator.alloc(n)

    # ---- sampling and stopping -------------------------------------------------------------------
    def _sample(self, logits: torch.Tensor, reqs: list[Req], rows: torch.Tensor,
                facts: BatchFacts | None = None) -> LaunchedSample:
        """Launch sampling of each request's next token (rows: their device request rows, where the tokens
        are also kept for the next decode step) and the copy of the results to the host. facts: the batch's
        (gathered here when not given)."""
        if facts is None:
            facts = BatchFacts.gather(reqs, self._generation)
        if self._in_flight and facts.has_grammar:
            # A grammar's mask for the next token needs the previous token accepted: read the batch in flight
            # now, after this batch's forward pass is launched, so the wait and the matchers' work overlap it.
            # Requests that finish in that read are still sampled here (their rows unconstrained: fill_masks
            # skips a released grammar); the token is discarded when read, as any token in flight past a stop.
            self._read(self._in_flight)
            self._in_flight = []
        steps = [r.num_sampled for r in reqs]
        self._process_logits(logits, reqs, facts, steps)
        info = facts.sampling_info_for(steps, self.runner.device)
        out = self.runner.sample(logits, facts.params, steps, rows, info=info)
        # The penalties count the new tokens on the device, before the host reads them (overlap).
        if facts.penalized:
            self.penalties.count_sampled(rows, out.next_token_ids, facts.penalized)
        for r in reqs:
            r.num_sampled += 1
        return LaunchedSample(reqs, facts.epochs, out.to_host())

    def _process_logits(self, logits: torch.Tensor, reqs: list[Req], facts: BatchFacts, steps: list[int],
                        drafted: list[list[int]] | None = None) -> None:
        """Everything but the sampler's own settings, in place on logits [rows, vocab] (row i: reqs[i]'s output
        token steps[i]): min_tokens bans, logit bias and penalties (drafted[i]: tokens counted as output on top
        of the request's own, a verify row's drafts before it), then the grammar mask."""
        grammar_rows = self.grammars.fill_masks(reqs) if facts.has_grammar else []
        # The logits before any ban, for a constrained row the bans leave with no token (none without bans).
        banned = facts.min_tokens or facts.penalized or facts.has_logit_bias
        raw = logits.clone() if grammar_rows and banned else None
        if facts.min_tokens:
            self._mask_early_stops(logits, reqs, facts.min_tokens, steps)
        # hook (b): logit bias and penalties, then the grammar mask (last: it must have the final say).
        if facts.penalized or facts.has_logit_bias:
            # The rows at launch: a request that stopped in the read above has released its row (its token
            # here is discarded), and must not break the batch.
            self.penalties.apply(logits, facts.rows, facts.params, drafted)
        self.grammars.apply_filled(logits, grammar_rows)
        if raw is not None:
            self._keep_a_grammar_token(logits, raw)

    def _append_sampled(self, batch: LaunchedSample) -> None:
        """Read a launched batch's tokens (waiting for them if needed) and apply them to its requests."""
        if batch.prompt_logprobs is not None:  # before the tokens: they follow the prompt
            batch.prompt_logprobs.apply()
        if batch.pooled:
            self._finish_pooled(batch.pooled)
        if batch.verify is not None:
            self._append_verified(batch)
            return
        if batch.result is None:
            return
        tokens, chosen, top_ids, top_vals = batch.result.lists()
        now = time.monotonic()
        for i, (req, token, epoch) in enumerate(zip(batch.reqs, tokens, batch.epochs)):
            if req.finish_reason is not None or req.num_retractions != epoch:
                continue  # aborted, failed or stopped since launch; or retracted (it samples it again)
            try:
                reason = self._take_token(req, token, now, i, chosen, top_ids, top_vals)
            except GrammarDeadEnd as exc:  # the request's own grammar cannot go on: a client error
                reason = FinishReason("invalid", message=str(exc))
            except Exception as exc:  # noqa: BLE001 - e.g. the tokenizer failing on this request's output
                self._fail(req, exc)
                continue
            if reason is not None:
                self._finish(req, reason)

    def _finish_pooled(self, pooled: list[tuple[Req, torch.Tensor]]) -> None:
        """Read the pooling requests' vectors (one copy to the host when they have one size) and finish them."""
        if len({v.numel() for _, v in pooled}) == 1:
            vectors = list(torch.stack([v for _, v in pooled]).cpu().numpy())
        else:
            vectors = [v.cpu().numpy() for _, v in pooled]
        for (req, _), vec in zip(pooled, vectors):
            if req.finish_reason is None:  # else aborted since launch
                req.embedding = vec
                self._finish(req, FinishReason("stop"))

    def _take_token(self, req: Req, token: int, now: float, row: int, chosen: list[float] | None,
                    top_ids: list[list[int]] | None, top_vals: list[list[float]] | None) -> FinishReason | None:
        """Append one sampled token (row: its row in the batch's logprob lists) and check what it ends."""
        req.output_ids.append(token)
        req.pending_ids.append(token)
        if req.first_token_time is None:
            req.first_token_time = now
        if chosen is not None and req.params.top_logprobs is not None:
            k = req.params.top_logprobs
            top = list(zip(top_ids[row][:k], top_vals[row][:k])) if top_ids is not None else []
            req.pending_logprobs.append(TokenLogprob(token, chosen[row], top))
        self._outbox[req.rid] = req
        # hook (c): the grammar accepts the token; its termination ends the request
        reason = None
        if req.grammar is not None:
            reason = self.grammars.accept(req, token)
        # (_check_stop finds nothing unless one of these holds: most tokens skip the call)
        if reason is None and (token in req.stop_ids or req.params.stop or len(req.output_ids) >= req.max_output):
            reason = self._check_stop(req, token)
        return reason

    def _keep_a_grammar_token(self, logits: torch.Tensor, raw: torch.Tensor) -> None:
        """A row whose bans and penalties left no token its grammar accepts (every logit -inf or NaN) falls
        back to its logits before them, under the grammar mask alone: the grammar is the hard constraint, the
        rest yields (else token 0 comes out and the grammar rejects it). All on the device, nothing read back:
        with overlap a host sync here would wait for the forward pass just launched."""
        dead = ~(logits > float("-inf")).any(dim=-1, keepdim=True)
        self.grammars.reapply(raw)
        logits.copy_(torch.where(dead, raw, logits))

    def _mask_early_stops(self, logits: torch.Tensor, reqs: list[Req], positions: list[int],
                          steps: list[int]) -> None:
        """Before min_tokens is reached, EOS and stop tokens cannot be sampled (unless a grammar allows nothing
        else: _keep_a_grammar_token). positions: the batch rows whose requests have a min_tokens; steps: each
        row's output token index."""
        for i in positions:
            req = reqs[i]
            if steps[i] < req.params.min_new_tokens and req.stop_ids:
                logits[i, sorted(req.stop_ids)] = float("-inf")

    def _check_stop(self, req: Req, token: int) -> FinishReason | None:
        num_out = len(req.output_ids)
        p = req.params
        if num_out >= p.min_new_tokens:
            if token in req.stop_ids:  # a stop token, or EOS unless ignore_eos
                return FinishReason("stop", matched=token)
            if p.stop and self.tokenizer is not None:
                # A stop string of L characters ends within the last L tokens (+ a few for merges).
                longest = max(len(s) for s in p.stop)
                tail = self.tokenizer.decode(req.output_ids[-(longest + 4):], skip_special_tokens=True)
                for s in p.stop:
                    if s in tail:
                        return FinishReason("stop", matched=s)
        if num_out >= req.max_output:  # max_tokens, or the context length
            return FinishReason("length")
        return None

    # ---- finishing -------------------------------------------------------------------------------
    def _fail(self, req: Req, exc: BaseException) -> None:
        """End req with an error (its client gets HTTP 500); the scheduler goes on with the others."""
        logger.error("request %s failed in the scheduler: %s: %s", req.rid, type(exc).__name__, exc,
                     exc_info=exc)
        if req.is_finished:
            return
        if req is self.chunked_req:
            self.chunked_req = None
        # Callers drop failed requests from self.running (it may be the list they iterate over).
        self._finish(req, FinishReason("error", message=f"scheduler error: {type(exc).__name__}: {exc}"))

    def _finish(self, req: Req, reason: FinishReason) -> None:
        req.finish_reason = reason
        self.grammars.release(req)  # hook (d)
        if req.req_pool_idx is not None:
            self._release_kv(req)
        req.status = ReqStatus.FINISHED
        self._outbox[req.rid] = req
        self.num_finished += 1

    def _release_kv(self, req: Req) -> None:
        """Give the request's KV to the prefix cache (or free it) and its request row back."""
        slots = self.req_pool.slots(req.req_pool_idx, req.kv_len)
        if self.tree is not None:
            num_prefix = len(req.prefix_slots)
            already = self.tree.insert(req.cache_key[: req.kv_len], slots, req.lora_id)
            self.allocator.free(slots[num_prefix:already])  # duplicates of what the tree now holds
            self._unlock(req.last_node)
        else:
            self.allocator.free(slots)
        self.req_pool.free(req.req_pool_idx)
        if self.speculator is not None:
            self.speculator.release(req)  # the draft model's KV of it
        self._generation += 1
        req.req_pool_idx, req.kv_len, req.last_node = None, 0, None
        req.prefix_slots = torch.empty(0, dtype=torch.int64)

    def _collect_outputs(self) -> list[ReqOutput]:
        outputs = []
        append = outputs.append
        spec = self.speculator is not None
        for req in self._outbox.values():
            pending, num_out = req.pending_ids, len(req.output_ids)
            first = 0 < len(pending) == num_out
            logprobs = None
            if req.params.top_logprobs is not None:  # only these requests collect logprobs
                logprobs, req.pending_logprobs = req.pending_logprobs, []
            # Positional (ReqOutput's field order): a keyword call costs more per request.
            append(ReqOutput(req.rid, pending, req.finish_reason, len(req.input_ids), num_out, req.cached_tokens,
                             logprobs, req.input_ids[-DETOKENIZER_CONTEXT_TOKENS:] if first else [],
                             req.pending_prompt_logprobs, req.params.decode_options if first else None,
                             req.embedding,
                             self._spec_counts(req) if spec else None))
            req.pending_ids = []
            req.pending_prompt_logprobs = None
            if req.finish_reason is not None:
                del self.reqs[req.rid]
        self._outbox = {}
        return outputs

    @staticmethod
    def _spec_counts(req: Req) -> SpecCounts:
        st = req.spec
        return SpecCounts(0, 0, 0) if st is None else SpecCounts(st.verify_ct, st.accepted, st.drafted)

    # ---- introspection ---------------------------------------------------------------------------
    def num_held_slots(self) -> int:
        """Slots held by requests (outside the tree) plus every slot in the tree."""
        held = sum(r.kv_len - len(r.prefix_slots) for r in self._admitted())
        return held + (self.tree.total_size() if self.tree is not None else 0)

    def _admitted(self) -> list[Req]:
        return self.running + ([self.chunked_req] if self.chunked_req is not None else [])

    def check_invariant(self) -> None:
        """free + held by requests + cached == total; cheap enough to run whenever the loop is idle."""
        self.allocator.check_invariant(self.num_held_slots())

    def stats(self) -> dict:
        total = self.allocator.num_slots
        free = self.allocator.available_size()
        cached_only = self._evictable()
        return {
            "num_running": len(self._admitted()),
            "num_waiting": len(self.waiting),
            "kv_total": total,
            "kv_free": free,
            "kv_cached": cached_only,
            "kv_used": total - free - cached_only,
            "cache_hit_rate": self.num_cached_tokens / self.num_prompt_tokens if self.num_prompt_tokens else 0.0,
            "req_rows_total": self.req_pool.size,
            "req_rows_free": self.req_pool.available_size(),
            "num_tracked_reqs": len(self.reqs),  # waiting, running or with output not yet reported
            "num_finished": self.num_finished,
            "num_retractions": self.num_retractions,
            "path_counts": dict(self.runner.path_counts),
            **(self.speculator.stats() if self.speculator is not None else {}),
        }

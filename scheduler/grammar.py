"""Grammar-constrained decoding with xgrammar: compiling off the scheduler's critical path, the grammar
queue, one matcher per request, the token bitmask on the logits, and accepting sampled tokens.

- `GrammarCompilerPool` compiles a `GrammarSpec` against the model's vocabulary in a thread pool and caches
  the result by spec (a Future per spec, so concurrent requests with one schema compile it once).
  xgrammar's compiler runs in C++ and releases the GIL, so the scheduler keeps stepping meanwhile.
- `GrammarManager` is the scheduler's small API: `defer(req)` parks a request that has a grammar in the
  grammar queue (SGLang's grammar_queue) until its grammar is compiled; `pop_ready()` hands back the
  requests whose grammar is ready (each with its own `GrammarMatcher`) and those whose compilation failed;
  `apply_mask(logits, reqs)` fills the bitmask rows of the constrained requests and applies it (xgrammar's
  CPU path on CPU, its kernel on GPU; the scheduler does it in two steps, `fill_masks` and `apply_filled`,
  and `reapply` puts it again on a fallback copy of a row the other bans left with no token; no host sync);
  `accept(req, token)` advances the matcher and says when the grammar terminated; `release(req)` drops the
  matcher.

Overlap scheduling note: a request's bitmask for step N+1 needs step N's token accepted first, so a batch
with constrained requests must accept the previous step's tokens before its mask is filled.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from model_executor.sampling_params import GrammarSpec
from scheduler.io_struct import FinishReason

logger = logging.getLogger("duet.grammar")

COMPILE_THREADS = 2
MAX_CACHED_GRAMMARS = 1024
# Whitespace runs allowed between JSON tokens: enough for pretty-printing, and a small model cannot loop on
# newlines until max_tokens.
MAX_JSON_WHITESPACE = 16


class GrammarError(RuntimeError):
    """A grammar that cannot be compiled or a token the grammar rejected."""


class GrammarDeadEnd(GrammarError):
    """The request's grammar admits no token at all from where the output stands: its language is empty from
    here (a regex or schema pattern that matches nothing). The request cannot be completed as asked: a client
    error, not a server one."""


class GrammarCompilerPool:
    """info: an xgrammar TokenizerInfo (see `for_tokenizer`) covering the model's whole vocabulary."""

    def __init__(self, info, threads: int = COMPILE_THREADS):
        import xgrammar as xgr

        self.xgr = xgr
        self.info = info
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=threads)
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="grammar-compile")
        self.cache: dict[GrammarSpec, Future] = {}
        self.lock = threading.Lock()

    @classmethod
    def for_tokenizer(cls, tokenizer, vocab_size: int, stop_token_ids: list[int]) -> GrammarCompilerPool:
        """vocab_size: the model's (its logits' width, which may exceed the tokenizer's)."""
        import xgrammar as xgr

        return cls(xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                      stop_token_ids=list(stop_token_ids) or None))

    def submit(self, spec: GrammarSpec) -> Future:
        with self.lock:
            fut = self.cache.get(spec)
            if fut is None or (fut.done() and fut.exception() is not None):
                if len(self.cache) >= MAX_CACHED_GRAMMARS:
                    self.cache.pop(next(iter(self.cache)))  # oldest first (dicts keep insertion order)
                fut = self.cache[spec] = self.pool.submit(self._compile, spec)
            return fut

    def _compile(self, spec: GrammarSpec):
        c = self.compiler
        if spec.kind == "json_object":
            return c.compile_builtin_json_grammar()
        if spec.kind == "json_schema":
            return c.compile_json_schema(spec.value, strict_mode=True, max_whitespace_cnt=MAX_JSON_WHITESPACE)
        if spec.kind == "regex":
            return c.compile_regex(spec.value)
        if spec.kind == "ebnf":
            return c.compile_grammar(spec.value)
        raise GrammarError(f"unknown grammar kind {spec.kind!r}")

    def new_matcher(self, compiled):
        return self.xgr.GrammarMatcher(compiled)


class GrammarManager:
    """make_compilers: builds the GrammarCompilerPool on first use (None: grammars are off)."""

    def __init__(self, make_compilers, vocab_size: int):
        self._make_compilers = make_compilers
        self.compilers: GrammarCompilerPool | None = None
        self.vocab_size = vocab_size
        self.queue: list = []  # requests waiting for their grammar
        self._bitmask: torch.Tensor | None = None
        self._filled_rows: set[int] = set()  # rows of the host mask a grammar filled (the others: all bits set)
        self._device_mask: torch.Tensor | None = None  # the last applied mask, on the logits' device

    def __len__(self) -> int:
        return len(self.queue)

    # ---- arrival ------------------------------------------------------------------------------
    def defer(self, req) -> bool:
        """Park req in the grammar queue if it has a grammar (True); raises if grammars are off."""
        spec = req.params.grammar
        if spec is None:
            return False
        if self.compilers is None:
            if self._make_compilers is None:
                raise GrammarError("this scheduler has no grammar backend (--grammar-backend none)")
            self.compilers = self._make_compilers()
        req.grammar_future = self.compilers.submit(spec)
        self.queue.append(req)
        return True

    def pop_ready(self, wait_s: float = 0.0) -> tuple[list, list[tuple[object, BaseException]]]:
        """(requests whose grammar is compiled, each with a fresh matcher; (request, error) pairs that failed).
        wait_s: block up to this long for the first compilation (when the scheduler has nothing else to do)."""
        if not self.queue:
            return [], []
        if wait_s > 0:
            concurrent.futures.wait([r.grammar_future for r in self.queue], timeout=wait_s,
                                    return_when=concurrent.futures.FIRST_COMPLETED)
        ready, failed, waiting = [], [], []
        for req in self.queue:
            fut = req.grammar_future
            if not fut.done():
                waiting.append(req)
                continue
            req.grammar_future = None
            try:
                req.grammar = self.compilers.new_matcher(fut.result())
                ready.append(req)
            except Exception as exc:  # noqa: BLE001 - the request fails, the scheduler goes on
                failed.append((req, GrammarError(f"the grammar could not be compiled: {exc}")))
        self.queue = waiting
        return ready, failed

    def remove(self, req) -> bool:
        """Take req out of the grammar queue (abort); True if it was there."""
        if req in self.queue:
            self.queue.remove(req)
            req.grammar_future = None
            return True
        return False

    # ---- the step -----------------------------------------------------------------------------
    def fill_masks(self, reqs: list) -> list[int]:
        """Fill the host bitmask row of each constrained request with the tokens its grammar accepts next, and
        allow every token in the other rows; returns the constrained rows (apply_filled applies the mask when
        there are any)."""
        rows = [i for i, r in enumerate(reqs) if r.grammar is not None]
        if rows:
            bitmask = self._get_bitmask(len(reqs))
            # Rows without a grammar must have all bits set. A fill overwrites its whole row, so only the rows a
            # grammar filled earlier and none fills now are set back, one at a time: one memset of the whole
            # mask (vocab-sized rows) is split by torch over its intra-op threads (a GPU host's cores), whose
            # wake-ups and barrier on a busy host cost milliseconds a step (docs/benchmarks.md).
            for i in self._filled_rows.difference(rows):
                bitmask[i].fill_(-1)
            self._filled_rows = set(rows)
            # One matcher at a time (32 rows take ~0.2 ms): xgrammar's BatchGrammarMatcher measured no better on
            # the H200 host (docs/benchmarks.md, 2026-12-01).
            for i in rows:
                reqs[i].grammar.fill_next_token_bitmask(bitmask, i)
        return rows

    def apply_mask(self, logits: torch.Tensor, reqs: list) -> None:
        """Allow only the tokens each constrained request's grammar accepts next (rows without a grammar
        are left alone): fill_masks, then apply_filled."""
        self.apply_filled(logits, self.fill_masks(reqs))

    def apply_filled(self, logits: torch.Tensor, rows: list[int]) -> None:
        """Apply the mask fill_masks filled (when it returned constrained rows) to every row of logits.

        One upload from pinned memory, no row indices and nothing read back: no host sync, so with overlap
        the scheduler does not wait here for the forward pass in flight. The device copy is kept for
        reapply (the pinned buffer is refilled only after this step's tokens were read)."""
        if not rows:
            return
        self._device_mask = self._bitmask[: logits.shape[0]].to(logits.device, non_blocking=True)
        self.reapply(logits)

    def reapply(self, logits: torch.Tensor) -> None:
        """The last applied mask again, on other logits of the same batch (e.g. a fallback copy)."""
        self.compilers.xgr.apply_token_bitmask_inplace(logits, self._device_mask, vocab_size=self.vocab_size)

    def _get_bitmask(self, bs: int) -> torch.Tensor:
        if self._bitmask is None or self._bitmask.shape[0] < bs:
            size = max(bs, 2 * (0 if self._bitmask is None else self._bitmask.shape[0]), 8)
            bitmask = self.compilers.xgr.allocate_token_bitmask(size, self.vocab_size)  # all bits set
            self._bitmask = bitmask.pin_memory() if torch.cuda.is_available() else bitmask
            self._filled_rows = set()
        return self._bitmask

    def accept(self, req, token: int) -> FinishReason | None:
        """Advance req's matcher by its sampled token; "stop" once the grammar terminated."""
        if req.grammar is None:
            return None
        if not req.grammar.accept_token(token):
            if self._allows_nothing(req.grammar):
                raise GrammarDeadEnd(
                    f"the {req.params.grammar.kind} constraint admits no token after {len(req.output_ids) - 1} "
                    "generated tokens: the language it describes is empty from there (e.g. a regex or a schema "
                    "pattern that matches nothing)")
            raise GrammarError(f"the grammar rejected the sampled token {token}")
        if req.grammar.is_terminated():
            return FinishReason("stop", matched=token)
        return None

    def _allows_nothing(self, matcher) -> bool:
        """Whether the matcher's next-token mask is empty (only on the error path: a fresh one-row mask)."""
        mask = self.compilers.xgr.allocate_token_bitmask(1, self.vocab_size)
        matcher.fill_next_token_bitmask(mask, 0)
        return not bool(mask.any())

    def release(self, req) -> None:
        req.grammar = None
        req.grammar_future = None

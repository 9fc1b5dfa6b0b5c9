"""Drafts from a draft model (STANDALONE, EAGLE3): chains of greedy tokens (top-k 1) for Speculator's policy.

The draft model runs in a ModelRunner of its own, with its own KV pool and request rows, sized like the target's
(the same running requests and KV slots). Per request the draft keeps the KV of a prefix of the request's tokens;
the radix cache is the target's only, so a draft prefills a request's prompt from scratch the first time it drafts.

Each step that a request drafts k tokens:

1. catch-up: one extend over the tokens the draft has no KV for yet (the prompt the first time, then the tokens
   the request took since it last drafted: the accepted drafts and the token after them), for all drafting
   requests in one batch; its last logits give draft 1;
2. k - 1 decode steps, each feeding the draft just proposed, batched over the requests that want more;
3. the KV of those draft steps goes back to the draft pool at once: the next catch-up extends whatever of them
   the target accepted (one extend of a few tokens instead of tracking which draft slots survived).

STANDALONE (`StandaloneDrafts`): a smaller model with the target's tokenizer (the same vocab_size); positions are
the request's own.

EAGLE3 (`Eagle3Drafts`): an EAGLE-3 head (model_executor/models/eagle3.py) reading the target's aux hidden
states. Head row p pairs token p + 1 with the target's hidden states at position p (the target's state after p
predicts p + 1; the head, given that token too, predicts p + 2). The scheduler hands over the aux rows of every
token the target keeps KV for (`observe`: prefill chunks, decode steps, the taken rows of verify steps); the
catch-up extend runs over the rows pending since the head last drafted, and its draft steps feed the head's own
`hidden` back. Draft ids map to target ids through d2t. The head's rows start at the first token the target
computed for the request: a prompt prefix the target took from its radix cache has no hidden states, so the head
sees the request from there on (its positions count from there too; rotary attention only sees distances). A
request whose pending rows pass `MAX_PENDING_ROWS` (it did not draft for that long: many requests decoding, or
its drafts kept missing, or a longer prompt) keeps only the newest of them and the head starts over there.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from model_executor.forward_batch import ForwardMode
from model_executor.model_config import ModelConfig, ModelConfigError
from runners.model_runner import ModelRunner, RunnerConfig
from scheduler.req import Req

logger = logging.getLogger("duet.draft_model")

# EAGLE3: aux rows a request may hold for the head before it starts over from its newest ones.
MAX_PENDING_ROWS = 2048


@dataclass
class DraftSeq:
    """One request's state in the draft runner."""

    row: int | None = None  # its request row in the draft's pool (None: none yet)
    length: int = 0  # draft rows with KV (STANDALONE: the request's first `length` tokens)
    base: int = 0  # EAGLE3: the target position of head row 0
    pending: list[torch.Tensor] = field(default_factory=list)  # EAGLE3: aux rows not yet run through the head
    num_pending: int = 0


def token_slice(req: Req, start: int, end: int) -> list[int]:
    """req's tokens (prompt, then output) start..end - 1, without joining the whole sequence."""
    n_in = len(req.input_ids)
    if start >= n_in:
        return req.output_ids[start - n_in:end - n_in]
    return req.input_ids[start:end] + (req.output_ids[:end - n_in] if end > n_in else [])


# A GPU: the draft runner is built after the target's, whose KV cache took its --mem-fraction-static share; the
# draft plans its weights, activations and KV within this share of the device (a memory plan that reserves the
# draft's room before the target's KV cache is not built yet; a lower --mem-fraction-static leaves it more).
DRAFT_MEM_FRACTION = 0.95


def draft_runner_config(target: ModelRunner, path: str, draft: bool, max_bs: int) -> RunnerConfig:
    """The draft's runner: the target's device, dtype, attention backend, context, running requests, KV slots and
    largest extend. A STANDALONE draft replays its decode steps from CUDA graphs at the target's decode sizes up
    to max_bs (the most requests that draft); its catch-up extends and an EAGLE-3 head (whose forward takes the
    target's hidden states besides the ids) run eagerly."""
    cfg = target.config
    sizes = () if draft or cfg.disable_cuda_graph else tuple(bs for bs in cfg.cuda_graph_bs if bs <= max_bs)
    return RunnerConfig(model_path=path, device=cfg.device, dtype=cfg.dtype, attention_backend=cfg.attention_backend,
                        context_length=target.context_len, max_running_requests=target.req_to_token_pool.size,
                        max_total_tokens=target.allocator.num_slots, max_prefill_tokens=cfg.max_prefill_tokens,
                        mem_fraction_static=DRAFT_MEM_FRACTION, seed=cfg.seed, draft=draft,
                        disable_cuda_graph=not sizes or cfg.device == "cpu", cuda_graph_bs=sizes,
                        disable_piecewise_cuda_graph=True)


class DraftModelProposer:
    """What STANDALONE and EAGLE3 share: the draft runner, each request's DraftSeq, the catch-up extend and the
    draft decode steps. Subclasses say what a forward takes and gives (`_forward_extend`, `_forward_decode`)."""

    wants_hidden = False

    def __init__(self, runner: ModelRunner):
        self.runner = runner
        self.seqs: dict[str, DraftSeq] = {}

    # ---- per request ------------------------------------------------------------------------------
    def release(self, req: Req) -> None:
        seq = self.seqs.pop(req.rid, None)
        if seq is not None and seq.row is not None:
            self._drop_kv(seq)
            self.runner.req_to_token_pool.free(seq.row)

    def observe(self, req: Req, start: int, hidden: torch.Tensor | None) -> None:
        pass

    def _drop_kv(self, seq: DraftSeq, keep: int = 0) -> None:
        """Free the draft KV of the rows from `keep` on."""
        if seq.length > keep:
            slots = self.runner.req_to_token_pool.slots(seq.row, seq.length)[keep:]
            self.runner.allocator.free(slots)
            seq.length = keep

    # ---- drafting ---------------------------------------------------------------------------------
    @torch.inference_mode()
    def propose(self, reqs: list[Req], ks: list[int]) -> list[list[int]]:
        try:
            return self._propose(reqs, ks)
        except Exception as exc:  # a failing draft costs drafts, never a request
            logger.error("the draft model failed (%s: %s): %d requests verify no drafts this step and draft again "
                         "from scratch", type(exc).__name__, exc, len(reqs), exc_info=exc)
            for req in reqs:
                self.release(req)
            return [[] for _ in reqs]

    def _propose(self, reqs: list[Req], ks: list[int]) -> list[list[int]]:
        out: list[list[int]] = [[] for _ in reqs]
        batch = []  # (index, seq, input ids of the catch-up)
        for i, req in enumerate(reqs):
            seq = self.seqs.get(req.rid)
            if seq is None:
                seq = self.seqs[req.rid] = DraftSeq()
            ids = self._catch_up_ids(req, seq)
            if ids:
                batch.append((i, seq, ids))
        if not batch:
            return out
        pool, alloc = self.runner.req_to_token_pool, self.runner.allocator
        need = sum(len(ids) + ks[i] - 1 for i, _, ids in batch)
        rows_needed = sum(seq.row is None for _, seq, _ in batch)
        if need > alloc.available_size() or rows_needed > pool.available_size():
            return out  # (the draft pool holds no more than the target's; this is a safety net)
        for _, seq, _ in batch:
            if seq.row is None:
                seq.row = pool.alloc()
        # 1. the catch-up extend
        lens = [len(ids) for _, _, ids in batch]
        loc = alloc.alloc(sum(lens))
        offset, seq_lens = 0, []
        for (_, seq, _), n in zip(batch, lens):
            pool.write(seq.row, seq.length, loc[offset:offset + n])
            seq.length += n
            seq_lens.append(seq.length)
            offset += n
        fb = self.runner.build_batch(ForwardMode.EXTEND, [t for _, _, ids in batch for t in ids],
                                     [seq.row for _, seq, _ in batch], seq_lens, loc, extend_seq_lens=lens)
        tokens, state = self._forward_extend(fb, [seq for _, seq, _ in batch], lens)
        for (i, _, _), t in zip(batch, tokens):
            out[i].append(t)
        # 2. the draft steps (their KV is freed right after: 3.)
        step_slots = []
        live = list(range(len(batch)))  # positions in `batch` still drafting
        step = 1
        try:
            while True:
                live = [j for j in live if ks[batch[j][0]] > step]
                if not live:
                    break
                loc = alloc.alloc(len(live))
                step_slots.append(loc)
                fb = self.runner.build_batch(ForwardMode.DECODE, [out[batch[j][0]][-1] for j in live],
                                             [batch[j][1].row for j in live],
                                             [batch[j][1].length + step for j in live], loc)
                tokens, state = self._forward_decode(fb, state, live)
                for j, t in zip(live, tokens):
                    out[batch[j][0]].append(t)
                step += 1
        finally:
            for loc in step_slots:
                alloc.free(loc)
        return out

    def _catch_up_ids(self, req: Req, seq: DraftSeq) -> list[int]:
        raise NotImplementedError

    def _forward_extend(self, fb, seqs: list[DraftSeq], lens: list[int]) -> tuple[list[int], object]:
        """The catch-up's draft 1 per request, and what the draft steps carry over (per batch row)."""
        raise NotImplementedError

    def _forward_decode(self, fb, state, live: list[int]) -> tuple[list[int], object]:
        raise NotImplementedError


class StandaloneDrafts(DraftModelProposer):
    """STANDALONE: a smaller causal LM with the target's vocabulary."""

    def _catch_up_ids(self, req: Req, seq: DraftSeq) -> list[int]:
        total = req.seq_len
        if seq.length >= total:  # (cannot happen: a request takes a token between two drafts) redo the last one
            self._drop_kv(seq, total - 1)
        return token_slice(req, seq.length, total)

    def _forward_extend(self, fb, seqs, lens):
        return self.runner.forward(fb).argmax(-1).tolist(), None

    def _forward_decode(self, fb, state, live):
        return self.runner.forward(fb).argmax(-1).tolist(), None


class Eagle3Drafts(DraftModelProposer):
    """EAGLE3: an EAGLE-3 head on the target's aux hidden states."""

    wants_hidden = True

    def observe(self, req: Req, start: int, hidden: torch.Tensor | None) -> None:
        seq = self.seqs.get(req.rid)
        if seq is not None and (hidden is None or seq.base + seq.length + seq.num_pending != start):
            self.release(req)  # a gap in what the head has seen: it starts over from these rows
            seq = None
        if hidden is None or not len(hidden):
            return
        if seq is None:
            seq = self.seqs[req.rid] = DraftSeq(base=start)
        seq.pending.append(hidden)
        seq.num_pending += len(hidden)
        if seq.num_pending > MAX_PENDING_ROWS:
            self._keep_newest(seq)

    def _keep_newest(self, seq: DraftSeq) -> None:
        """Only the newest MAX_PENDING_ROWS pending rows stay; the head starts over from the first of them (its KV,
        which they no longer follow, goes back)."""
        length = seq.length
        if length:
            self._drop_kv(seq)
        extra = seq.num_pending - MAX_PENDING_ROWS
        seq.pending = [torch.cat(seq.pending)[extra:]]
        seq.num_pending = MAX_PENDING_ROWS
        seq.base += length + extra

    def _catch_up_ids(self, req: Req, seq: DraftSeq) -> list[int]:
        # Head rows base + length .. (pending) pair target positions p with tokens p + 1.
        first = seq.base + seq.length + 1
        last = first + seq.num_pending  # exclusive; at most seq_len (the target has KV up to seq_len - 1)
        if seq.num_pending == 0 or last > req.seq_len:
            return []
        return token_slice(req, first, last)

    def _forward_extend(self, fb, seqs, lens):
        hidden = torch.cat([h for s in seqs for h in s.pending])
        for s in seqs:
            s.pending, s.num_pending = [], 0
        out = self._run(fb, hidden)
        last = torch.tensor(lens, device=out.hidden.device).cumsum(0) - 1
        return self._tokens(out.logits), out.hidden[last]

    def _forward_decode(self, fb, state, live):
        """state: each catch-up row's newest head `hidden` [batch rows, H]; live: the rows drafting this step."""
        rows = torch.tensor(live, device=state.device)
        out = self._run(fb, state[rows])
        state = state.clone()
        state[rows] = out.hidden
        return self._tokens(out.logits), state

    def _run(self, fb, hidden: torch.Tensor):
        # Head positions count from its row 0 (a constant shift of the target's: rotary sees only distances).
        self.runner.attn_backend.init_forward_metadata(fb)
        return self.runner.model(fb.input_ids, fb.positions, fb, hidden)

    def _tokens(self, logits: torch.Tensor) -> list[int]:
        return self.runner.model.to_target_ids(logits.argmax(-1)).tolist()


def check_draft_config(algorithm: str, draft: ModelConfig, target: ModelConfig) -> None:
    """ModelConfigError (one line) where the draft model cannot draft for the target."""
    if algorithm == "EAGLE3":
        from model_executor.models.eagle3 import check_draft_fits_target

        check_draft_fits_target(draft, target)
    elif draft.vocab_size != target.vocab_size:
        raise ModelConfigError(f"the draft model's vocab_size {draft.vocab_size} is not the target's "
                               f"{target.vocab_size} (STANDALONE needs the same tokenizer)")


def build_draft_proposer(config, target: ModelRunner) -> DraftModelProposer | None:
    """The proposer for a SpeculativeConfig with a draft model (None for NGRAM). ModelConfigError (one line) where
    the draft cannot draft for this target."""
    if config.algorithm == "NGRAM":
        return None
    from model_executor.models.eagle3 import aux_layer_ids

    eagle = config.algorithm == "EAGLE3"
    check_draft_config(config.algorithm, ModelConfig.from_pretrained(config.draft_model_path, draft=eagle),
                       target.model_config)
    if eagle and not hasattr(target.model, "set_aux_hidden_state_layers"):
        raise ModelConfigError(f"EAGLE3 needs the target's hidden states, which {target.model_config.architecture} "
                               f"does not give")
    runner = ModelRunner(draft_runner_config(target, config.draft_model_path, eagle, config.max_batch_size))
    if not eagle:
        return StandaloneDrafts(runner)
    # (a server named them before the target's graphs were captured: this is then a no-op)
    target.set_aux_hidden_state_layers(aux_layer_ids(runner.model_config, target.model_config))
    runner.model.share_target_embedding(target.model)
    return Eagle3Drafts(runner)

"""GrammarManager's token bitmask on a synthetic byte vocabulary (no model, no tokenizer download): the mask
leaves exactly the grammar's next tokens, greedy decoding under it spells a string the grammar accepts and
ends with the grammar, and rows without a grammar are untouched."""

from __future__ import annotations

import re

import torch

from model_executor.sampling_params import GrammarSpec
from scheduler.grammar import GrammarCompilerPool, GrammarManager
from scheduler.req import Req

EOS = 0


def synthetic_pool(vocab_size: int) -> tuple[GrammarCompilerPool, list[bytes]]:
    """Token 0 is EOS, tokens 1..255 single bytes, the rest two-letter pieces (several tokens may spell one
    string, as in a real BPE vocabulary)."""
    import xgrammar as xgr

    letters = b"abcdefghijklmnopqrstuvwxyz0123456789 ,{}:\""
    vocab = [b"</s>"] + [bytes([i]) for i in range(1, 256)]
    pairs = [bytes([a, b]) for a in letters for b in letters]
    vocab += pairs[: vocab_size - len(vocab)]
    vocab += [f"<pad{i}>".encode() for i in range(vocab_size - len(vocab))]
    info = xgr.TokenizerInfo(vocab, vocab_type=xgr.VocabType.RAW, vocab_size=vocab_size, stop_token_ids=[EOS])
    return GrammarCompilerPool(info), vocab


def greedy_under_grammar(manager: GrammarManager, req: Req, logits_fn, steps: int, device="cpu") -> list[int]:
    out = []
    for step in range(steps):
        logits = logits_fn(step).to(device)
        manager.apply_mask(logits, [req])
        token = int(logits.argmax(-1)[0])
        out.append(token)
        if manager.accept(req, token) is not None:
            break
    return out


def make_req(manager: GrammarManager, spec: GrammarSpec) -> Req:
    from model_executor.sampling_params import SamplingParams

    req = Req("r", [1], SamplingParams(grammar=spec))
    assert manager.defer(req)
    ready, failed = manager.pop_ready(wait_s=30)
    assert ready == [req] and not failed
    return req


def test_greedy_under_the_mask_spells_a_match_and_terminates():
    vocab_size = 2000
    pool, vocab = synthetic_pool(vocab_size)
    manager = GrammarManager(lambda: pool, vocab_size)
    pattern = r"(yes|no), [0-9]{3}"
    req = make_req(manager, GrammarSpec("regex", pattern))
    g = torch.Generator().manual_seed(0)
    out = greedy_under_grammar(manager, req, lambda _: torch.randn(1, vocab_size, generator=g), 20)
    assert out[-1] == EOS
    assert re.fullmatch(pattern, b"".join(vocab[t] for t in out[:-1]).decode())
    assert req.grammar.is_terminated()


def test_mask_rows_and_unconstrained_rows():
    vocab_size = 2000
    pool, vocab = synthetic_pool(vocab_size)
    manager = GrammarManager(lambda: pool, vocab_size)
    req = make_req(manager, GrammarSpec("regex", r"ab+"))
    plain = Req("p", [1], req.params.__class__())
    logits = torch.randn(3, vocab_size)
    before = logits.clone()
    manager.apply_mask(logits, [plain, req, plain])
    allowed = set(torch.nonzero(logits[1] > float("-inf")).flatten().tolist())
    # First step of ab+: "a" or "ab" (a two-byte token), nothing else (not EOS: the regex needs a b).
    assert allowed == {vocab.index(b"a"), vocab.index(b"ab")}
    torch.testing.assert_close(logits[[0, 2]], before[[0, 2]])


def test_several_constrained_rows_each_get_their_own_grammar():
    """Each constrained row gets its own grammar's tokens, unconstrained rows between them keep every token."""
    vocab_size = 2000
    pool, vocab = synthetic_pool(vocab_size)
    manager = GrammarManager(lambda: pool, vocab_size)
    ab, ba = make_req(manager, GrammarSpec("regex", r"ab+")), make_req(manager, GrammarSpec("regex", r"ba+"))
    plain = Req("p", [1], ab.params.__class__())
    logits = torch.randn(4, vocab_size)
    before = logits.clone()
    manager.apply_mask(logits, [ba, plain, ab, plain])
    allowed = [set(torch.nonzero(row > float("-inf")).flatten().tolist()) for row in logits]
    assert allowed[2] == {vocab.index(b"a"), vocab.index(b"ab")}
    assert allowed[0] == {vocab.index(b"b")} | ({vocab.index(b"ba")} if b"ba" in vocab else set())
    torch.testing.assert_close(logits[[1, 3]], before[[1, 3]])
    # The next step the constrained rows' requests are gone: rows 0 and 2 of the reused buffer hold every
    # token again (the buffer is refilled, not only the constrained rows).
    other = make_req(manager, GrammarSpec("regex", r"ab+"))
    logits = torch.randn(4, vocab_size)
    before = logits.clone()
    manager.apply_mask(logits, [plain, plain, plain, other])
    torch.testing.assert_close(logits[:3], before[:3])


def test_the_host_mask_is_never_reset_as_a_whole():
    """Each host-side torch op of fill_masks covers at most one mask row: a memset of the whole [bs, vocab/32]
    mask is split over torch's intra-op threads, which on a busy GPU host cost milliseconds a step.
    A steady batch resets nothing; a row whose grammar left is reset alone (and holds every token again)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Record(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.numels = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if isinstance(out, torch.Tensor):
                self.numels.append((str(func), out.numel()))
            return out

    vocab_size = 2000
    pool, _ = synthetic_pool(vocab_size)
    manager = GrammarManager(lambda: pool, vocab_size)
    a, b = make_req(manager, GrammarSpec("regex", r"ab+")), make_req(manager, GrammarSpec("regex", r"ba+"))
    plain = Req("p", [1], a.params.__class__())
    manager.fill_masks([a, plain, b, plain])  # the first call allocates the buffer
    row = manager._bitmask.shape[1]
    with Record() as steady:
        manager.fill_masks([a, plain, b, plain])
    assert steady.numels == []
    with Record() as changed:
        rows = manager.fill_masks([plain, plain, b, plain])  # a's grammar left row 0
    assert rows == [2] and changed.numels and max(n for _, n in changed.numels) <= row, changed.numels
    assert bool((manager._bitmask[[0, 1, 3]] == -1).all())

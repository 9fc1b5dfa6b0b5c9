"""Server pieces without processes: incremental detokenization and stop-string trimming / hold-back."""

from __future__ import annotations

import asyncio

import pytest

from model_executor.sampling_params import SamplingParams
from scheduler.io_struct import AbortReq, BatchStrOut, BatchTokenOut, FinishReason
from server.detokenizer import IncrementalDetokenizer, load_tokenizer
from server.metrics import ServerMetrics
from server.protocol import ApiError
from server.tokenizer_manager import TokenizerManager, _Fragment, _Inbox, _ReqState
from tests.fake_scheduler import server_model_dir

TEXTS = [
    "Hello world, this is a plain sentence.",
    " naïve café 😀 日本語 ✓ Ω≈ç — “quotes” and emoji 🎉🎉 mixed with ASCII",
    "  leading spaces and\nnew lines\n\n\tand tabs",
]


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(str(server_model_dir()))


def sentencepiece_tokenizer():
    """A Llama-2 / Mistral style tokenizer (SentencePiece BPE: "▁" for spaces, byte fallback, the first
    leading space stripped when decoding), trained here on a few sentences."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    specials = ["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)]
    tok.train_from_iterator([t for t in TEXTS for _ in range(5)] + ["Hello there"] * 5,
                            trainers.BpeTrainer(vocab_size=400, special_tokens=specials))
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def stream_text(detok, ids, context, rid="r"):
    """Feed ids one by one; returns the text emitted after each token (the last call finishes)."""
    out, texts = "", []
    for i, t in enumerate(ids):
        out += detok.step(rid, [t], FinishReason("length") if i == len(ids) - 1 else None,
                          context if i == 0 else ())
        texts.append(out)
    return texts


@pytest.mark.parametrize("kind", ["byte_level", "sentencepiece"])
@pytest.mark.parametrize("text", TEXTS)
def test_decode_stream_equals_full_decode_for_every_prefix(tokenizer, kind, text):
    """After every token the text emitted so far is the full decode of the tokens so far (after the prompt's
    last tokens), or a prefix of it while a character is incomplete; at the end, exactly the full decode."""
    tok = tokenizer if kind == "byte_level" else sentencepiece_tokenizer()
    context = tok.encode("Hello there", add_special_tokens=False)[-5:]
    ids = tok.encode(text, add_special_tokens=False)
    texts = stream_text(IncrementalDetokenizer(tok), ids, context)

    def after_context(n):
        return tok.decode(context + ids[:n])[len(tok.decode(context)):]

    for n, emitted in enumerate(texts, start=1):
        full = after_context(n)
        assert full.startswith(emitted), (n, emitted, full)
        if not full.endswith("\ufffd"):
            assert emitted == full, (n, emitted, full)
    assert texts[-1] == after_context(len(ids))
    # Finishing while a character is incomplete gives the full decode (with its U+FFFD), not less.
    cut = [n for n in range(1, len(ids)) if after_context(n).endswith("\ufffd")]
    assert cut or kind == "sentencepiece" or text.isascii()
    for n in cut:
        assert stream_text(IncrementalDetokenizer(tok), ids[:n], context)[-1] == after_context(n)


def test_first_output_token_keeps_its_leading_space_after_the_prompt():
    """SentencePiece drops the leading space of the first token of a decode; the first output token comes
    after the prompt, so its space is part of the output (the prompt's last tokens are the context)."""
    tok = sentencepiece_tokenizer()
    prompt = tok.encode("Hello", add_special_tokens=False)
    ids = tok.encode("Hello there", add_special_tokens=False)[len(prompt):]
    assert tok.decode(ids).startswith("there")  # decoded alone, the space is lost
    assert "".join(stream_text(IncrementalDetokenizer(tok), ids, prompt)[-1:]) == " there"


@pytest.mark.parametrize("text", TEXTS)
def test_incremental_detokenization_matches_full_decode(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer)
    deltas = [detok.step("r", [t], None) for t in ids[:-1]]
    deltas.append(detok.step("r", [ids[-1]], FinishReason("length")))
    assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=True)
    assert all("\ufffd" not in d for d in deltas), "an incomplete UTF-8 character was emitted"
    assert "r" not in detok.states, "finished requests must be forgotten"


def test_detokenizer_skips_special_tokens_and_stop_token_text(tokenizer):
    ids = tokenizer.encode(" alpha beta gamma", add_special_tokens=False)
    eos = tokenizer.eos_token_id
    detok = IncrementalDetokenizer(tokenizer)
    out = "".join(detok.step("a", [t], None) for t in ids) + detok.step("a", [eos], FinishReason("stop", eos))
    assert out == " alpha beta gamma"
    # A non-special stop token id: its text is left out, like vLLM.
    out = "".join(detok.step("b", [t], None) for t in ids[:-1])
    out += detok.step("b", [ids[-1]], FinishReason("stop", matched=ids[-1]))
    assert out == tokenizer.decode(ids[:-1])


def test_detokenizer_batches_keep_requests_apart(tokenizer):
    a = tokenizer.encode(" one two three", add_special_tokens=False)
    b = tokenizer.encode(" 日本語 😀", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer)
    texts = {"a": "", "b": ""}
    for i in range(max(len(a), len(b))):
        rids, ids, fin = [], [], []
        for rid, seq in (("a", a), ("b", b)):
            if i < len(seq):
                rids.append(rid)
                ids.append([seq[i]])
                fin.append(FinishReason("length") if i == len(seq) - 1 else None)
        n = len(rids)
        out = detok.process(BatchTokenOut(rids, ids, fin, [1] * n, [i + 1] * n, [0] * n, [None] * n))
        assert out.rids == rids and out.new_token_ids == ids and out.finished == fin
        for rid, d in zip(out.rids, out.text_deltas):
            texts[rid] += d
    assert texts == {"a": tokenizer.decode(a), "b": tokenizer.decode(b)}
    assert detok.states == {}


# ---- stop strings in the tokenizer manager --------------------------------------------------------


class _Push:
    def __init__(self):
        self.sent = []

    def send_pyobj(self, obj):
        self.sent.append(obj)


class _Tok:
    def __len__(self):
        return 100


def _manager() -> TokenizerManager:
    tm = TokenizerManager(_Tok(), ipc=None, info={"context_len": 64, "num_kv_slots": 1000, "vocab_size": 100},
                          metrics=ServerMetrics())
    tm._push = _Push()
    return tm


def _run(tm, deltas, stop, finish_last=None, min_tokens=0):
    params = SamplingParams(max_new_tokens=100, stop=tuple(stop), min_new_tokens=min_tokens)
    st = _ReqState(rid="r-0", index=0, params=params, queue=_Inbox(), prompt_tokens=3, created=0.0)
    tm._reqs[st.rid] = st
    chunks = []
    for i, d in enumerate(deltas):
        fin = finish_last if i == len(deltas) - 1 else None
        c = tm._apply(st, _Fragment(d, [i], None, fin, 3, i + 1, 0))
        if c is not None:
            chunks.append(c)
        if c is not None and c.finish is not None:
            break
    return chunks


@pytest.mark.parametrize("deltas", [["ab", "cS", "TO", "Pxyz"], ["abcSTOPxyz"], list("abcSTOPxyz")])
def test_stop_string_split_across_deltas_is_never_emitted(deltas):
    tm = _manager()
    chunks = _run(tm, deltas, ["STOP"])
    assert "".join(c.text for c in chunks) == "abc"
    for c in chunks:
        assert not any(p in c.text for p in ("S", "ST", "STO")), c.text
    assert chunks[-1].finish.kind == "stop" and chunks[-1].finish.matched == "STOP"
    assert sum(c.finish is not None for c in chunks) == 1
    # The scheduler had not finished: the manager tells it to stop.
    assert [type(m) for m in tm._push.sent] == [AbortReq]


def test_scheduler_finish_on_stop_string_cuts_at_first_occurrence():
    tm = _manager()
    chunks = _run(tm, ["hello ", "wor", "ld end"], ["world", "end"], FinishReason("stop", matched="world"))
    assert "".join(c.text for c in chunks) == "hello "
    assert chunks[-1].finish.matched == "world"
    assert tm._push.sent == []  # the scheduler finished by itself


def test_hold_back_is_released_at_finish_without_stop():
    tm = _manager()
    chunks = _run(tm, ["abc", "de", "f"], ["xyzw"], FinishReason("length"))
    texts = [c.text for c in chunks]
    assert "".join(texts) == "abcdef"
    assert texts[-1] != ""  # the held-back tail arrives with the finish
    assert chunks[-1].finish.kind == "length"


def test_stop_strings_ignored_before_min_tokens():
    tm = _manager()
    chunks = _run(tm, ["ST", "OP", "a", "STOP", "b"], ["STOP"], min_tokens=3)
    assert "".join(c.text for c in chunks) == "STOPa"


def test_engine_death_raises_503():
    tm = _manager()
    params = SamplingParams(max_new_tokens=5)

    async def go():
        tm._push = _Async()
        agen = tm.generate([_gen(params)], "x")
        task = asyncio.ensure_future(agen.__anext__())
        await asyncio.sleep(0.01)
        tm.fail_all("the scheduler process died (exit code -9)")
        with pytest.raises(ApiError) as e:
            await task
        assert e.value.status == 503 and "scheduler" in e.value.message
        assert not tm.healthy

    asyncio.run(go())


class _Async(_Push):
    def send_pyobj(self, obj):
        super().send_pyobj(obj)
        fut = asyncio.get_running_loop().create_future()
        fut.set_result(None)
        return fut


def _gen(params):
    from server.tokenizer_manager import GenRequest

    return GenRequest([1, 2, 3], params)


class _AsyncPush:
    def __init__(self):
        self.sent = []

    async def send_pyobj(self, obj):
        self.sent.append(obj)


def _out(rid: str, text: str, token: int, n: int, finish=None, logprob=None) -> BatchStrOut:
    return BatchStrOut(rids=[rid], text_deltas=[text], new_token_ids=[[token]], finished=[finish], prompt_tokens=[3],
                       completion_tokens=[n], cached_tokens=[0], logprobs=[[logprob]] if logprob else [])


def test_fragments_queued_while_the_consumer_is_busy_stream_as_one_chunk():
    """An HTTP process behind the engine sends a stream's piled-up tokens as one chunk (texts, tokens and
    logprobs joined, the last counts), never joining across a finished fragment."""
    from scheduler.io_struct import TokenLogprob
    from server.tokenizer_manager import GenRequest

    async def main():
        tm = _manager()
        tm._push = _AsyncPush()
        gen = tm.generate([GenRequest([1, 2, 3], SamplingParams(max_new_tokens=5))], "c")
        first = asyncio.ensure_future(gen.__anext__())
        await asyncio.sleep(0)  # the request is sent; the consumer waits on its queue
        rid = tm._push.sent[0].rid
        lp = [TokenLogprob(token_id=t, logprob=-0.5 * t) for t in (7, 8, 9)]
        tm._dispatch(_out(rid, " a", 7, 1, logprob=lp[0]))
        tm._dispatch(_out(rid, " b", 8, 2, logprob=lp[1]))
        tm._dispatch(_out(rid, " c", 9, 3, FinishReason("length"), logprob=lp[2]))
        chunks = [await first] + [c async for c in gen]
        return chunks, lp

    chunks, lp = asyncio.run(main())
    assert len(chunks) == 1
    (c,) = chunks
    assert (c.text, c.token_ids, c.completion_tokens, c.finish.kind) == (" a b c", [7, 8, 9], 3, "length")
    assert c.logprobs == lp


def test_coalesce_keeps_order_and_never_joins_past_a_finish_or_a_marker():
    from server.tokenizer_manager import _FATAL, _coalesce

    a, b = object(), object()
    f = [_Fragment(t, [i], None, None, 3, i + 1, 0) for i, t in enumerate("wxyz")]
    done = _Fragment("!", [9], None, FinishReason("stop"), 3, 9, 0)
    out = _coalesce([(a, f[0]), (b, f[1]), (a, f[2]), (a, done), (a, f[3]), (b, _FATAL), (b, f[3])])
    assert [(s is a, x if not isinstance(x, _Fragment) else (x.text, x.token_ids, x.finish)) for s, x in out] == [
        (True, ("wy!", [0, 2, 9], FinishReason("stop"))),
        (False, ("x", [1], None)),
        (True, ("z", [3], None)),
        (False, _FATAL),
        (False, ("z", [3], None)),
    ]

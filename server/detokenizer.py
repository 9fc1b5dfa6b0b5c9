"""The detokenizer process: turns each step's new token ids into text deltas, per request.

Incremental detokenization runs on `tokenizers.DecodeStream` (one per request, in Rust): it returns the
text each new token completes, holding back bytes of an incomplete UTF-8 character (a byte-level token
sequence split mid-character) until the character is complete. Each stream starts from the last few
prompt tokens (the scheduler sends them with a request's first output), so tokenizers whose decoders
depend on the neighbours (SentencePiece's leading space, merges) give the output the text it has after
the prompt. Bytes still held back when a request finishes are decoded then; a run of tokens that never
completes a character (stray byte tokens) is emitted, U+FFFD and all, after a few tokens.

Stop strings are not handled here: the HTTP process keeps the full text per request and trims it (it
knows the request's stop strings; see tokenizer_manager). A request that finished on a stop token id
has that token's text left out, like vLLM, unless it asked for include_stop_str_in_output.

Special tokens are left out of the text unless a request asks for skip_special_tokens false; it may then
ask for spaces_between_special_tokens, which sets each special token apart from the text around it by a
space (HF's slow tokenizers' way; the fast ones, and so vLLM and SGLang, write them without spaces). These
per-request options come with a request's first output (SamplingParams.decode_options; None: defaults).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

import zmq
from tokenizers.decoders import DecodeStream

from scheduler.io_struct import BatchStrOut, BatchTokenOut, FinishReason
from scheduler.ipc import IpcPaths, bind_pull, connect_push

logger = logging.getLogger("duet.detokenizer")

# A UTF-8 character is at most 4 bytes, so after this many held-back tokens the bytes are genuinely
# invalid output (e.g. stray byte tokens), not a character still being completed.
_MAX_PENDING_TOKENS = 6
_WINDOW = 4  # tokens of context kept for decoding held-back bytes


@dataclass
class DecodeState:
    stream: DecodeStream
    recent: list[int]  # the last tokens whose text was emitted (context for held-back bytes)
    pending: list[int] = field(default_factory=list)  # tokens stepped whose text is held back
    skip_special: bool = True  # (SamplingParams.skip_special_tokens)
    spaces: bool = False  # (SamplingParams.spaces_between_special_tokens; only when special tokens are kept)
    keep_stop: bool = False  # (SamplingParams.include_stop_str_in_output)
    emitted: bool = False  # some text was emitted (spaces: a special token after it is set apart)
    after_special: bool = False  # spaces: the last text emitted was a special token's


class IncrementalDetokenizer:
    """Per-request incremental decoding state for one (fast, `tokenizers`-backed) HF tokenizer."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.backend = tokenizer.backend_tokenizer
        self.states: dict[str, DecodeState] = {}
        self.special_ids = {i for i, t in tokenizer.added_tokens_decoder.items() if t.special}

    @staticmethod
    def _stream(context: list[int], skip_special: bool = True) -> DecodeStream:
        return DecodeStream(ids=list(context), skip_special_tokens=skip_special)

    def _flush(self, st: DecodeState) -> str:
        """The text of the held-back tokens, decoded after the recent ones."""
        def decode(ids):
            return self.tokenizer.decode(ids, skip_special_tokens=st.skip_special, clean_up_tokenization_spaces=False)

        return decode(st.recent + st.pending)[len(decode(st.recent)):]

    def _spaced(self, st: DecodeState, token: int, text: str) -> str:
        """spaces_between_special_tokens: text (which token completed) set apart from a special token."""
        if token in self.special_ids:
            text = (" " if st.emitted else "") + text
            st.after_special = True
        elif text and st.after_special:
            text, st.after_special = " " + text, False
        st.emitted = st.emitted or bool(text)
        return text

    def step(self, rid: str, new_ids: list[int], finish: FinishReason | None, context: list[int] = (),
             options: tuple[bool, bool, bool] | None = None) -> str:
        """Append new_ids to rid's output and return the text that became final; forget rid on finish.
        `context`: the last prompt tokens, and `options` (SamplingParams.decode_options), given with the
        request's first output."""
        st = self.states.get(rid)
        if st is None:
            skip, spaces, keep_stop = options or (True, False, False)
            st = self.states[rid] = DecodeState(self._stream(context, skip), list(context)[-_WINDOW:],
                                                skip_special=skip, spaces=spaces and not skip, keep_stop=keep_stop)
        ids = list(new_ids)
        if (finish is not None and finish.kind == "stop" and isinstance(finish.matched, int)
                and not isinstance(finish.matched, bool) and ids and ids[-1] == finish.matched
                and not st.keep_stop):
            ids.pop()  # the stop token's own text is not part of the output
        out = []
        for token in ids:
            chunk = st.stream.step(self.backend, token)
            st.pending.append(token)
            if chunk is not None:
                out.append(self._spaced(st, token, chunk) if st.spaces else chunk)
                st.recent = (st.recent + st.pending)[-_WINDOW:]
                st.pending = []
            elif len(st.pending) >= _MAX_PENDING_TOKENS:
                out.append(self._flush(st))
                st.recent = (st.recent + st.pending)[-_WINDOW:]
                st.stream, st.pending = self._stream(st.recent, st.skip_special), []
        if finish is not None:
            del self.states[rid]
            if st.pending:
                out.append(self._flush(st))
        return "".join(out)

    def process(self, batch: BatchTokenOut) -> BatchStrOut:
        deltas = []
        contexts = batch.context_ids or [()] * len(batch.rids)
        options = batch.decode_options or [None] * len(batch.rids)
        for rid, ids, finish, context, opts in zip(batch.rids, batch.new_token_ids, batch.finished, contexts,
                                                   options):
            try:
                deltas.append(self.step(rid, ids, finish, context, opts))
            except Exception:  # a bad id must not take the process (and every other request) down
                logger.exception("detokenizing request %s failed", rid)
                self.states.pop(rid, None)
                deltas.append("")
        return BatchStrOut(
            rids=batch.rids, text_deltas=deltas, new_token_ids=batch.new_token_ids, finished=batch.finished,
            prompt_tokens=batch.prompt_tokens, completion_tokens=batch.completion_tokens,
            cached_tokens=batch.cached_tokens, logprobs=batch.logprobs, prompt_logprobs=batch.prompt_logprobs,
            embeddings=batch.embeddings,
            spec_counts=batch.spec_counts,
        )


def load_tokenizer(model_path: str):
    """The model folder's HF tokenizer, as AutoTokenizer would pick it.

    When tokenizer_config.json names the class, that class is loaded directly: AutoTokenizer's import
    pulls in torch (seconds of start-up) which the HTTP and detokenizer processes do not otherwise need.
    """
    import transformers

    folder = Path(model_path)
    try:
        name = json.loads((folder / "tokenizer_config.json").read_text()).get("tokenizer_class")
    except (OSError, ValueError):
        name = None
    if name and (folder / "tokenizer.json").is_file():
        for candidate in (name, name.removesuffix("Fast")):
            try:
                cls = getattr(transformers, candidate, None)
            except Exception:  # noqa: BLE001 - a lazy import that fails: let AutoTokenizer decide
                cls = None
            if cls is not None and hasattr(cls, "from_pretrained"):
                return cls.from_pretrained(model_path)
    return transformers.AutoTokenizer.from_pretrained(model_path)


def run_detokenizer_process(model_path: str, ipc: IpcPaths, ready_conn) -> None:
    """Process entry point: load the tokenizer, report ready, then detokenize forever."""
    ctx = zmq.Context()
    try:
        detok = IncrementalDetokenizer(load_tokenizer(model_path))
        pull = bind_pull(ctx, ipc.detokenizer_input)
        push = connect_push(ctx, ipc.http_input)
    except Exception as e:  # noqa: BLE001 - reported to the launcher as one line
        ready_conn.send({"ok": False, "error": f"detokenizer: cannot load the tokenizer from {model_path}: "
                                               f"{type(e).__name__}: {e}".splitlines()[0]})
        return
    ready_conn.send({"ok": True})
    ready_conn.close()
    while True:
        msg = pull.recv_pyobj()
        if isinstance(msg, BatchTokenOut):
            push.send_pyobj(detok.process(msg))
        else:
            logger.warning("detokenizer: ignoring unexpected message %s", type(msg).__name__)

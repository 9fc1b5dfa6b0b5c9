"""The detokenizer process: turns each step's new token ids into text deltas, per request.

Incremental detokenization (vLLM's and SGLang's scheme): each request keeps its output ids and two
offsets. ``prefix_offset..read_offset`` is the window already emitted; decoding
``ids[prefix_offset:]`` and dropping the window's text gives the new text. Decoding a short window
rather than single tokens keeps the spacing and merges of tokenizers that depend on neighbours, and
text that ends in U+FFFD (an incomplete UTF-8 character, split across byte-level tokens) is held back
until the character completes or the request finishes.

Stop strings are not handled here: the HTTP process keeps the full text per request and trims it (it
knows the request's stop strings; see tokenizer_manager). A request that finished on a stop token id
has that token's text left out, like vLLM.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

import zmq

from server.ipc import BatchStrOut, BatchTokenOut, FinishReason, IpcPaths, bind_pull, connect_push

logger = logging.getLogger("duet.detokenizer")

# A UTF-8 character is at most 4 bytes, so after this many pending tokens a trailing U+FFFD is
# genuinely invalid output (e.g. stray byte tokens), not a character still being completed.
_MAX_PENDING_TOKENS = 6


@dataclass
class DecodeState:
    ids: list[int] = field(default_factory=list)
    prefix_offset: int = 0
    read_offset: int = 0


class IncrementalDetokenizer:
    """Per-request incremental decoding state for one tokenizer."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.states: dict[str, DecodeState] = {}

    def _decode(self, ids: list[int]) -> str:
        if not ids:
            return ""
        return self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def step(self, rid: str, new_ids: list[int], finish: FinishReason | None) -> str:
        """Append new_ids to rid's output and return the text that became final; forget rid on finish."""
        st = self.states.get(rid)
        if st is None:
            st = self.states[rid] = DecodeState()
        st.ids.extend(new_ids)
        end = len(st.ids)
        if (finish is not None and finish.kind == "stop" and isinstance(finish.matched, int)
                and not isinstance(finish.matched, bool) and end > st.read_offset
                and st.ids[-1] == finish.matched):
            end -= 1  # the stop token's own text is not part of the output
        prefix_text = self._decode(st.ids[st.prefix_offset:st.read_offset])
        new_text = self._decode(st.ids[st.prefix_offset:end])
        if finish is not None:
            del self.states[rid]
            return new_text[len(prefix_text):]
        pending = end - st.read_offset
        if len(new_text) > len(prefix_text) and (not new_text.endswith("\ufffd")
                                                 or pending >= _MAX_PENDING_TOKENS):
            st.prefix_offset = st.read_offset
            st.read_offset = end
            return new_text[len(prefix_text):]
        return ""

    def process(self, batch: BatchTokenOut) -> BatchStrOut:
        deltas = []
        for rid, ids, finish in zip(batch.rids, batch.new_token_ids, batch.finished):
            try:
                deltas.append(self.step(rid, ids, finish))
            except Exception:  # a bad id must not take the process (and every other request) down
                logger.exception("detokenizing request %s failed", rid)
                self.states.pop(rid, None)
                deltas.append("")
        return BatchStrOut(
            rids=batch.rids, text_deltas=deltas, new_token_ids=batch.new_token_ids, finished=batch.finished,
            prompt_tokens=batch.prompt_tokens, completion_tokens=batch.completion_tokens,
            cached_tokens=batch.cached_tokens, logprobs=batch.logprobs,
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

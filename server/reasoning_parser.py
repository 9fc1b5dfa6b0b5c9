"""Reasoning parsers (`--reasoning-parser`): split `<think>...</think>` reasoning from the answer, into the
message's `reasoning_content` and `content`.

- deepseek-r1: the chat template opens `<think>` in the prompt, so the output starts inside the reasoning
  (a leading `<think>` is dropped) and the answer follows `</think>`; without `</think>` it is all reasoning.
- qwen3: the model writes `<think>` itself when it thinks; output that does not start with it is all answer
  (thinking off, e.g. `chat_template_kwargs: {"enable_thinking": false}`).
- gpt-oss (the harmony format; its output is read with its special tokens): the `analysis` channel's
  messages are the reasoning, the `final` (and other) channels' the answer; a message to a function
  (`to=functions.NAME` in its header) goes to the content as written, header and `<|call|>` included, for
  the gpt-oss tool-call parser (server/tool_parsers.py) to read. Header markup is never content.
The same state machine serves streaming and non-streaming replies, so both split the text identically.
"""

from __future__ import annotations

REASONING_PARSERS = ("qwen3", "deepseek-r1", "gpt-oss")
START, END = "<think>", "</think>"


def _partial(text: str, marker: str) -> int:
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


# The harmony format's markers (special tokens of gpt-oss's tokenizer)
H_START, H_MESSAGE, H_END, H_CALL, H_RETURN = "<|start|>", "<|message|>", "<|end|>", "<|call|>", "<|return|>"
_H_BODY_ENDS = (H_END, H_CALL, H_RETURN, H_START)


class HarmonyStream:
    """ReasoningStream's gpt-oss kind: harmony messages (header `...<|message|>`, body up to `<|end|>`,
    `<|call|>`, `<|return|>` or the next `<|start|>`) split by channel."""

    def __init__(self):
        self.buf = ""
        self.dest: str | None = None  # the body being read: "reasoning", "content" or "call"; None: a header

    def _hold(self) -> int:
        """How much of buf's end may be the start of a marker that ends a body."""
        return max(_partial(self.buf, m) for m in _H_BODY_ENDS)

    def feed(self, delta: str) -> tuple[str, str]:
        self.buf += delta
        reasoning = content = ""
        while self.buf:
            if self.dest is None:  # a header; text that does not start one is plain answer
                if not self.buf.startswith("<|") and not "<|".startswith(self.buf):
                    self.dest = "content"
                    continue
                i = self.buf.find(H_MESSAGE)
                if i < 0:
                    break
                header, self.buf = self.buf[:i], self.buf[i + len(H_MESSAGE):]
                if "to=" in header:
                    self.dest = "call"
                    content += header + H_MESSAGE
                else:
                    self.dest = "reasoning" if "<|channel|>analysis" in header else "content"
                continue
            ends = [(self.buf.find(m), m) for m in _H_BODY_ENDS if m in self.buf]
            if ends:
                j, marker = min(ends)
                text, self.buf = self.buf[:j], self.buf[j + (0 if marker == H_START else len(marker)):]
            else:
                keep = self._hold()
                text, self.buf = self.buf[:len(self.buf) - keep], self.buf[len(self.buf) - keep:]
            if self.dest == "reasoning":
                reasoning += text
            else:
                content += text + (H_CALL if ends and self.dest == "call" else "")
            if not ends:
                break
            self.dest = None
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        rest, self.buf = self.buf, ""
        if self.dest is None:  # (an unfinished header: markup, not answer)
            return "", ""
        return (rest, "") if self.dest == "reasoning" else ("", rest)


class ReasoningStream:
    def __init__(self, kind: str):
        self.kind = kind
        self.state = "reasoning" if kind == "deepseek-r1" else "undecided"
        self.buf = ""  # text not yet classified
        self.after_end = False  # newlines right after </think> are separators, not answer

    def feed(self, delta: str) -> tuple[str, str]:
        """(reasoning delta, content delta) to send now."""
        self.buf += delta
        reasoning = content = ""
        if self.state == "undecided":
            stripped = self.buf.lstrip()
            if START.startswith(stripped) and len(stripped) < len(START):
                return "", ""  # may still become <think>
            if stripped.startswith(START):
                self.state, self.buf = "reasoning", stripped[len(START):]
            else:
                self.state = "content"
        if self.state == "reasoning" and self.kind == "deepseek-r1":
            stripped = self.buf.lstrip()
            if stripped.startswith(START):
                self.buf = stripped[len(START):]
            elif START.startswith(stripped) and stripped:
                return "", ""
        if self.state == "reasoning":
            pos = self.buf.find(END)
            if pos >= 0:
                reasoning, self.buf = self.buf[:pos], self.buf[pos + len(END):]
                self.state, self.after_end = "content", True
            else:
                keep = _partial(self.buf, END)
                reasoning, self.buf = self.buf[:len(self.buf) - keep], self.buf[len(self.buf) - keep:]
                return reasoning, ""
        if self.state == "content":
            if self.after_end:
                self.buf = self.buf.lstrip("\n")
                self.after_end = not self.buf
            content, self.buf = self.buf, ""
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        rest, self.buf = self.buf, ""
        if self.state == "reasoning":
            return rest, ""
        return "", rest


def make_reasoning_stream(kind: str) -> ReasoningStream | HarmonyStream:
    """The state machine of a REASONING_PARSERS kind (feed(delta) -> (reasoning, content); finish())."""
    return HarmonyStream() if kind == "gpt-oss" else ReasoningStream(kind)


def split_reasoning(kind: str, text: str) -> tuple[str | None, str]:
    stream = make_reasoning_stream(kind)
    r1, c1 = stream.feed(text)
    r2, c2 = stream.finish()
    reasoning = r1 + r2
    if kind == "gpt-oss":
        return reasoning or None, c1 + c2
    return (reasoning if stream.state != "content" or reasoning or kind == "deepseek-r1" else None), c1 + c2

"""Reasoning parsers (`--reasoning-parser`): split `<think>...</think>` reasoning from the answer, into the
message's `reasoning_content` and `content`.

- deepseek-r1: the chat template opens `<think>` in the prompt, so the output starts inside the reasoning
  (a leading `<think>` is dropped) and the answer follows `</think>`; without `</think>` it is all reasoning.
- qwen3: the model writes `<think>` itself when it thinks; output that does not start with it is all answer
  (thinking off, e.g. `chat_template_kwargs: {"enable_thinking": false}`).
The same state machine serves streaming and non-streaming replies, so both split the text identically.
"""

from __future__ import annotations

REASONING_PARSERS = ("qwen3", "deepseek-r1")
START, END = "<think>", "</think>"


def _partial(text: str, marker: str) -> int:
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


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


def split_reasoning(kind: str, text: str) -> tuple[str | None, str]:
    stream = ReasoningStream(kind)
    r1, c1 = stream.feed(text)
    r2, c2 = stream.finish()
    reasoning = r1 + r2
    return (reasoning if stream.state != "content" or reasoning or kind == "deepseek-r1" else None), c1 + c2

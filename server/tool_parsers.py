"""Tool-call parsers (`--tool-call-parser`): find the calls a model wrote in its text output.

Each parser knows one model family's format:
- hermes (Qwen2.5/Qwen3, Hermes): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, repeated;
- llama3 (Llama 3.1+ JSON tool calling): the reply is `{"name": ..., "parameters": {...}}` (optionally after
  `<|python_tag|>`), several separated by `;`;
- mistral: `[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]` (the marker is a special token that the
  detokenizer drops, so a reply that starts with `[{` counts too);
- qwen3_coder (Qwen3-Coder, Qwen3.5): `<tool_call>\n<function=NAME>\n<parameter=KEY>\nVALUE\n</parameter>...
  </function>\n</tool_call>`, repeated; each value is text, converted to the type the function's JSON schema
  gives the parameter (number, boolean, object...; a string, or a parameter the schema does not type, stays
  text).
- gpt-oss (harmony): messages to `functions.NAME`, the recipient in the header
  (`<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>ARGS<|call|>`, or
  `<|start|>assistant to=functions.NAME<|channel|>...`); the gpt-oss reasoning parser passes them on as
  written and keeps every other message's markup out of the content.
Text the parser cannot read as calls stays content (vLLM's behaviour): a call is never invented. Which
parser a server uses: server/chat_tools.py (the flag, or detected from the chat template).

`ToolCallStream` runs a parser over streamed text: content before the calls is sent as it arrives (holding
back what may be the start of a marker); the calls are parsed and sent once the output is complete, as one
OpenAI `tool_calls` delta per call, so the deltas concatenate to exactly the non-streamed calls.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

TOOL_CALL_PARSERS = ("hermes", "llama3", "mistral", "qwen3_coder", "gpt-oss")


@dataclass
class ParsedToolCall:
    name: str
    arguments: str  # JSON text
    id: str = ""

    def __post_init__(self):
        self.id = self.id or f"call_{uuid.uuid4().hex[:24]}"

    def to_openai(self, index: int | None = None) -> dict:
        out = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return out if index is None else {"index": index, **out}


def _held_back(text: str, marker: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of marker (may become the marker)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


def _call(obj, args_keys: tuple[str, ...]) -> ParsedToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = next((obj[k] for k in args_keys if k in obj), {})
    return ParsedToolCall(obj["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False))


class ToolParser:
    """scan(text) -> (index where calls start or None, how much of text is safe to send as content);
    extract(text) -> (content or None, calls)."""

    def scan(self, text: str) -> tuple[int | None, int]:
        raise NotImplementedError

    def extract(self, text: str) -> tuple[str | None, list[ParsedToolCall]]:
        raise NotImplementedError


def _content(text: str) -> str | None:
    return text if text.strip() else None


class HermesParser(ToolParser):
    START, END = "<tool_call>", "</tool_call>"
    _BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)

    def scan(self, text):
        pos = text.find(self.START)
        if pos >= 0:
            return pos, pos
        return None, len(text) - _held_back(text, self.START)

    def extract(self, text):
        pos = text.find(self.START)
        if pos < 0:
            return _content(text), []
        calls = []
        for block in self._BLOCK.findall(text[pos:]):
            try:
                call = _call(json.loads(block.strip()), ("arguments", "parameters"))
            except json.JSONDecodeError:
                call = None
            if call is None:
                return _content(text), []
            calls.append(call)
        return _content(text[:pos]), calls


def _json_values(text: str) -> list | None:
    """Consecutive JSON values separated by whitespace or ';' (all of text), or None."""
    dec, out, i = json.JSONDecoder(), [], 0
    while True:
        while i < len(text) and (text[i].isspace() or text[i] == ";"):
            i += 1
        if i == len(text):
            return out
        try:
            value, i = dec.raw_decode(text, i)
        except json.JSONDecodeError:
            return None
        out.append(value)


class Llama3JsonParser(ToolParser):
    TAG = "<|python_tag|>"

    def scan(self, text):
        stripped = text.lstrip()
        if not stripped or self.TAG.startswith(stripped):
            return None, 0  # undecided: hold everything
        if stripped.startswith(("{", self.TAG)):
            return len(text) - len(stripped), 0
        return None, len(text)  # plain content: the whole reply

    def extract(self, text):
        start, _ = self.scan(text)
        if start is None:
            return _content(text), []
        body = text[start:].removeprefix(self.TAG)
        values = _json_values(body)
        calls = [_call(v, ("parameters", "arguments")) for v in values or []]
        if not values or any(c is None for c in calls):
            return _content(text), []
        return None, calls


class MistralParser(ToolParser):
    MARKER = "[TOOL_CALLS]"

    def scan(self, text):
        pos = text.find(self.MARKER)
        if pos >= 0:
            return pos, pos
        stripped = text.lstrip()
        if not stripped:
            return None, 0
        if stripped.startswith("["):
            return len(text) - len(stripped), 0
        return None, len(text) - _held_back(text, self.MARKER)

    def extract(self, text):
        start, _ = self.scan(text)
        if start is None:
            return _content(text), []
        body = text[start:].removeprefix(self.MARKER)
        values = _json_values(body)
        items = [x for v in values or [] for x in (v if isinstance(v, list) else [v])]
        calls = [_call(v, ("arguments", "parameters")) for v in items]
        if not items or any(c is None for c in calls):
            return _content(text), []
        return _content(text[:start]), calls


class Qwen3CoderParser(HermesParser):
    """hermes' markers (so its scan), XML inside."""

    _FUNCTION = re.compile(r"^\s*<function=([^>\n]+)>(.*?)</function>\s*$", re.DOTALL)
    _PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.DOTALL)

    def __init__(self, tools: list[dict] | None = None):
        self.schemas = {t["name"]: (t.get("parameters") or {}).get("properties") or {} for t in tools or []}

    def _value(self, function: str, key: str, text: str):
        text = text.removeprefix("\n").removesuffix("\n")
        schema = self.schemas.get(function, {}).get(key)
        kind = schema.get("type") if isinstance(schema, dict) else None
        if kind in (None, "string") or (isinstance(kind, list) and "string" in kind):
            return text
        try:
            return json.loads(text)
        except json.JSONDecodeError:
            return text

    def extract(self, text):
        pos = text.find(self.START)
        if pos < 0:
            return _content(text), []
        calls = []
        for block in self._BLOCK.findall(text[pos:]):
            m = self._FUNCTION.match(block)
            if m is None:
                return _content(text), []
            name, body = m.group(1).strip(), m.group(2)
            args = {key.strip(): self._value(name, key.strip(), value) for key, value in self._PARAMETER.findall(body)}
            calls.append(ParsedToolCall(name, json.dumps(args, ensure_ascii=False)))
        return _content(text[:pos]), calls


class HarmonyParser(ToolParser):
    _MESSAGE = re.compile(r"((?:<\|start\|>[^<]*)?<\|channel\|>[^<]*(?:<\|constrain\|>[^<]*)?)<\|message\|>"
                          r"(.*?)(?:<\|call\|>|<\|end\|>|$)", re.DOTALL)
    _RECIPIENT = re.compile(r"to=functions\.([^\s<]+)")
    _HEADS = ("<|start|>", "<|channel|>")

    def scan(self, text):
        starts = [i for i in (text.find(h) for h in self._HEADS) if i >= 0]
        if starts:
            return min(starts), min(starts)
        return None, len(text) - max(_held_back(text, h) for h in self._HEADS)

    def extract(self, text):
        calls, first = [], None
        for m in self._MESSAGE.finditer(text):
            recipient = self._RECIPIENT.search(m.group(1))
            if recipient is None:
                continue
            first = m.start() if first is None else first
            calls.append(ParsedToolCall(recipient.group(1), m.group(2).strip()))
        if not calls:
            return _content(text), []
        return _content(text[:first]), calls


def make_tool_parser(name: str, tools: list[dict] | None = None) -> ToolParser:
    """The parser of a format (TOOL_CALL_PARSERS); tools (the request's function definitions) type the
    qwen3_coder parameters."""
    if name == "qwen3_coder":
        return Qwen3CoderParser(tools)
    return {"hermes": HermesParser, "llama3": Llama3JsonParser, "mistral": MistralParser,
            "gpt-oss": HarmonyParser}[name]()


class ToolCallStream:
    """One choice's streamed output through a parser: feed() returns the content to send now."""

    def __init__(self, parser: ToolParser):
        self.parser = parser
        self.text = ""
        self.sent = 0
        self.in_calls = False

    def feed(self, delta: str) -> str:
        self.text += delta
        if self.in_calls:
            return ""
        start, safe = self.parser.scan(self.text)
        end = safe
        if start is not None:
            self.in_calls, end = True, start
        out = self.text[self.sent:max(end, self.sent)]
        self.sent = max(end, self.sent)
        return out

    def finish(self) -> tuple[str, list[ParsedToolCall]]:
        """(content not sent yet, the calls)."""
        _, calls = self.parser.extract(self.text)
        if not calls:
            rest, self.sent = self.text[self.sent:], len(self.text)
            return rest, []
        return "", calls


def tool_call_schema(tools: list[dict], name: str | None, parallel: bool) -> dict:
    """The JSON schema that `tool_choice` required (name None) or a named function enforces (vLLM's shape):
    named: the function's arguments object; required: an array of {"name", "parameters"} objects."""
    def params_of(t: dict) -> dict:
        return t.get("parameters") or {"type": "object", "properties": {}}

    if name is not None:
        return params_of(next(t for t in tools if t["name"] == name))
    items = {"anyOf": [{"type": "object", "properties": {"name": {"type": "string", "enum": [t["name"]]},
                                                          "parameters": params_of(t)},
                        "required": ["name", "parameters"]} for t in tools]}
    schema = {"type": "array", "minItems": 1, "items": items}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def calls_from_required(text: str) -> list[ParsedToolCall] | None:
    """The calls of a `tool_choice: required` reply (a JSON array the grammar enforced), or None."""
    try:
        values = json.loads(text)
    except json.JSONDecodeError:
        return None
    if not isinstance(values, list):
        return None
    calls = [_call(v, ("parameters",)) for v in values]
    return None if any(c is None for c in calls) else calls

"""Tool-call and reasoning parsers (pure Python): each format's calls, text that is not a call stays content,
streamed pieces give the same content and calls as the whole text, and the tool_choice schemas."""

from __future__ import annotations

import json

import jsonschema
import pytest

from server.reasoning_parser import ReasoningStream, split_reasoning
from server.tool_parsers import ToolCallStream, calls_from_required, make_tool_parser, tool_call_schema

CASES = [
    ("hermes", ('Sure. <tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>\n'
                '<tool_call>{"name": "g", "arguments": {}}</tool_call>'), "Sure. ", [("f", {"a": 1}), ("g", {})]),
    ("hermes", "no calls here", "no calls here", []),
    ("hermes", "<tool_call>{not json}</tool_call>", "<tool_call>{not json}</tool_call>", []),
    ("llama3", ' {"name": "f", "parameters": {"a": 1}}; {"name": "g", "parameters": {"b": "x"}}', None,
     [("f", {"a": 1}), ("g", {"b": "x"})]),
    ("llama3", '<|python_tag|>{"name": "f", "parameters": {}}', None, [("f", {})]),
    ("llama3", "The answer is {1}", "The answer is {1}", []),
    ("mistral", '[TOOL_CALLS] [{"name": "f", "arguments": {"a": 2}}]', None, [("f", {"a": 2})]),
    ("mistral", '[{"name": "f", "arguments": {"a": 2}}, {"name": "g", "arguments": {}}]', None,
     [("f", {"a": 2}), ("g", {})]),
    ("mistral", "[1, 2] is a list", "[1, 2] is a list", []),
]


@pytest.mark.parametrize("parser,text,content,calls", CASES)
def test_parsers_whole_and_streamed(parser, text, content, calls):
    got_content, got_calls = make_tool_parser(parser).extract(text)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in got_calls] == calls
    # Streamed one character at a time: the content sent plus the final calls match.
    stream = ToolCallStream(make_tool_parser(parser))
    sent = "".join(stream.feed(ch) for ch in text)
    rest, streamed_calls = stream.finish()
    assert (sent + rest).strip() == (content or "").strip()
    assert [(c.name, c.arguments) for c in streamed_calls] == [(c.name, c.arguments) for c in got_calls]
    if calls:  # no part of a marker or a call leaks into the content
        assert "tool_call" not in sent and '"name"' not in sent


@pytest.mark.parametrize("kind,text,reasoning,content", [
    ("qwen3", "<think>\nplan</think>\n\nanswer", "\nplan", "answer"),
    ("qwen3", "just an answer", None, "just an answer"),
    ("deepseek-r1", "plan</think>answer", "plan", "answer"),
    ("deepseek-r1", "<think>plan</think>\nanswer", "plan", "answer"),
    ("deepseek-r1", "unfinished plan", "unfinished plan", ""),
])
def test_reasoning_split_whole_and_streamed(kind, text, reasoning, content):
    assert split_reasoning(kind, text) == (reasoning, content)
    s = ReasoningStream(kind)
    parts = [s.feed(ch) for ch in text] + [s.finish()]
    assert "".join(r for r, _ in parts) == (reasoning or "")
    assert "".join(c for _, c in parts) == content


TOOLS = [{"name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "integer"}},
                                      "required": ["a"]}},
         {"name": "g"}]


def test_tool_choice_schemas():
    named = tool_call_schema(TOOLS, "f", parallel=True)
    jsonschema.validate({"a": 1}, named)
    required = tool_call_schema(TOOLS, None, parallel=False)
    jsonschema.validate([{"name": "f", "parameters": {"a": 1}}], required)
    for bad in ([], [{"name": "h", "parameters": {}}], [{"name": "f", "parameters": {"a": 1}}] * 2):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, required)
    calls = calls_from_required('[{"name": "f", "parameters": {"a": 1}}]')
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("f", {"a": 1})]
    assert calls_from_required('{"name": "f"}') is None
